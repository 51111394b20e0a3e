"""What no_sync saves: allreduce calls, bytes and time per effective step, with and without it.

    torchrun --standalone --nproc_per_node=2 benchmarks/grad_accumulation.py
    torchrun --standalone --nproc_per_node=4 benchmarks/grad_accumulation.py --model simplecnn --accum-steps 8

Each effective step is ``--accum-steps`` micro-steps of ``--batch-size`` per process, then one SGD step. With
``no_sync`` on every micro-step but the last, DDP all-reduces once per effective step; without it, after every
micro-step. A DDP communication hook counts the allreduces and their bytes (``common.collectives``): "grad MB"
is the gradient data all-reduced, of which a ring allreduce sends 2(N-1)/N from each process.
"""

import statistics
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.cli import argument_parser, positive_int
from common.collectives import AllReduceCounter
from common.distributed import BACKENDS, print0, set_seed, setup_distributed, teardown_distributed
from common.metrics import synchronize
from common.models import MODELS
from common.reports import run_header


def parse_args(argv=None):
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="simplecnn")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="per process and micro-step")
    parser.add_argument("--accum-steps", type=positive_int, default=4)
    parser.add_argument("--steps", type=positive_int, default=5, help="timed effective steps per mode and round")
    parser.add_argument("--rounds", type=positive_int, default=3, help="the modes alternate; medians are printed")
    parser.add_argument("--backend", choices=BACKENDS, default="auto")
    return parser.parse_args(argv)


def effective_steps(net, optimizer, X, y, accum_steps: int, steps: int, use_no_sync: bool, device) -> float:
    """Run ``steps`` effective steps; return the seconds they took (the slowest rank's)."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        for micro_step in range(accum_steps):
            skip_sync = use_no_sync and micro_step < accum_steps - 1
            with net.no_sync() if skip_sync else nullcontext():
                (F.cross_entropy(net(X), y) / accum_steps).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    synchronize(device)
    seconds = torch.tensor(time.perf_counter() - start)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()


def main(args):
    env = setup_distributed(args.backend)
    try:
        model_class = MODELS[args.model]
        generator = torch.Generator().manual_seed(env.rank)
        X = torch.randn(args.batch_size, *model_class.input_shape, generator=generator).to(env.device)
        y = torch.randint(0, 10, (args.batch_size,), generator=generator).to(env.device)
        set_seed(0)
        net = DDP(model_class().to(env.device), device_ids=env.device_ids)
        counter = AllReduceCounter.attach(net)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
        parameters = sum(p.numel() for p in net.parameters())
        print0(run_header())
        print0(
            f"{args.model} ({parameters / 1e6:.2f} M parameters), {env.world_size} process(es), {env.backend} on "
            f"{env.device.type}, {args.accum_steps} micro-steps of {args.batch_size} per effective step"
        )
        print0(f"{'mode':>22} {'allreduces/step':>15} {'grad MB/step':>12} {'ms/step':>8}")
        effective_steps(net, optimizer, X, y, args.accum_steps, 1, False, env.device)  # warm-up, buckets built
        # The modes take turns, round after round, and each reports its median round: a background load that
        # comes and goes then hits both alike, instead of whichever happened to run during it.
        seconds, counts = {False: [], True: []}, {}
        for _ in range(args.rounds):
            for use_no_sync in (False, True):
                counter.reset()
                seconds[use_no_sync].append(
                    effective_steps(net, optimizer, X, y, args.accum_steps, args.steps, use_no_sync, env.device)
                )
                counts[use_no_sync] = (counter.calls, counter.bytes)
        for use_no_sync in (False, True):
            calls, sent = counts[use_no_sync]
            mode = "no_sync on k-1 of k" if use_no_sync else "allreduce every micro"
            print0(
                f"{mode:>22} {calls / args.steps:>15.1f} {sent / args.steps / 1e6:>12.2f} "
                f"{1000 * statistics.median(seconds[use_no_sync]) / args.steps:>8.1f}"
            )
    finally:
        teardown_distributed()


if __name__ == "__main__":
    main(parse_args())
