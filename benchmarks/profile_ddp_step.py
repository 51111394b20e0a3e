"""Profile DDP training steps with torch.profiler: a Chrome trace, the costliest ops, and communication's share.

    torchrun --standalone --nproc_per_node=2 benchmarks/profile_ddp_step.py --trace ddp_step.json.gz   # CPU, gloo
    torchrun --standalone --nproc_per_node=1 benchmarks/profile_ddp_step.py --trace ddp_step.json.gz   # one GPU

Every rank trains ``--warmup`` unprofiled steps, one more while the profiler starts, and then ``--steps``
profiled ones, on one fixed random batch;
rank 0 prints the ops that took the most time (self time, per step: device time on a GPU, CPU time on a CPU),
on a GPU the share of device time in communication kernels (names holding ``nccl``, ``gloo`` or ``c10d``; on a
CPU gloo communicates on threads of its own, ``pt_gloo_runloop``, which the trace records as ``gloo:all_reduce``
spans beside the main thread's ``c10d::allreduce_``, and this script does not add up), and writes
the trace, which https://ui.perfetto.dev or chrome://tracing opens (a ``.gz`` name is written compressed).
On a GPU, device time covers kernels only: a step's wall time is also spent launching them and waiting.
"""

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, schedule

from common.cli import argument_parser, positive_int
from common.distributed import is_main, print0, set_seed, setup_distributed, teardown_distributed
from common.metrics import synchronize
from common.models import MODELS

COMMUNICATION_MARKS = ("nccl", "gloo", "c10d")


def parse_args(argv=None):
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="simplecnn")
    parser.add_argument("--batch-size", type=positive_int, default=64, help="per rank")
    parser.add_argument("--warmup", type=positive_int, default=3, help="steps before the profiler records")
    parser.add_argument("--steps", type=positive_int, default=5, help="profiled steps")
    parser.add_argument("--rows", type=positive_int, default=12, help="ops to list")
    parser.add_argument("--trace", type=Path, help="rank 0 writes the Chrome trace here")
    parser.add_argument("--json", type=Path, help="rank 0 also writes the figures to this file")
    return parser.parse_args(argv)


def is_communication(name: str) -> bool:
    """Ops of the process group: NCCL kernels, gloo and c10d calls."""
    return any(mark in name.lower() for mark in COMMUNICATION_MARKS)


def main(args):
    env = setup_distributed()
    try:
        set_seed(0, env.rank)
        model_class = MODELS[args.model]
        net = DDP(model_class().to(env.device), device_ids=env.device_ids)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        X = torch.randn(args.batch_size, *model_class.input_shape, device=env.device)
        y = torch.randint(0, 10, (args.batch_size,), device=env.device)
        on_gpu = env.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])

        def train_step():
            F.cross_entropy(net(X), y).backward()  # DDP all-reduces the gradients during this backward
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        for _ in range(args.warmup):  # kernel choice, allocations, DDP's bucket rebuild after the first step
            train_step()
        # one more step with the profiler running but not recording (its own start-up), then one recorded cycle
        with profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=args.steps, repeat=1)) as prof:
            train_step()
            prof.step()
            synchronize(env.device)
            start = time.perf_counter()
            for _ in range(args.steps):
                train_step()
                prof.step()
            synchronize(env.device)
            ms_per_step = 1000 * (time.perf_counter() - start) / args.steps
        clock = "device" if on_gpu else "cpu"
        events = [event for event in prof.key_averages() if getattr(event, f"self_{clock}_time_total") > 0]
        events.sort(key=lambda event: getattr(event, f"self_{clock}_time_total"), reverse=True)
        total_us = sum(getattr(event, f"self_{clock}_time_total") for event in events)
        communication_us = sum(
            getattr(event, f"self_{clock}_time_total") for event in events if is_communication(event.key)
        )
        # On a GPU, NCCL's kernels are device time like any other; gloo works on threads of its own, unrecorded
        share = communication_us / max(total_us, 1) if on_gpu else None
        where = torch.cuda.get_device_name(env.device) if on_gpu else "cpu"
        setup = (
            f"{args.model}, batch {args.batch_size} per rank, DDP on {env.world_size} rank(s), {env.backend} on "
            f"{where}, PyTorch {torch.__version__}; {args.steps} profiled steps after {args.warmup} warm-up"
        )
        top = [
            {
                "op": event.key,
                "ms_per_step": getattr(event, f"self_{clock}_time_total") / 1000 / args.steps,
                "calls_per_step": event.count / args.steps,
            }
            for event in events[: args.rows]
        ]
        print0(setup)
        print0(
            f"wall {ms_per_step:.2f} ms/step; self {clock} time {total_us / 1000 / args.steps:.2f} ms/step; "
            + (f"NCCL kernels {share:.1%} of it" if on_gpu else "gloo's own threads are not in it")
        )
        print0(f"{'ms/step':>8} {'calls':>5}  op (self {clock} time)")
        for row in top:
            print0(f"{row['ms_per_step']:>8.3f} {row['calls_per_step']:>5.0f}  {row['op'][:90]}")
        if is_main():
            if args.trace:
                prof.export_chrome_trace(str(args.trace))
            if args.json:
                args.json.write_text(
                    json.dumps(
                        {
                            "setup": setup,
                            "clock": clock,
                            "ms_per_step": ms_per_step,
                            "self_time_ms_per_step": total_us / 1000 / args.steps,
                            "communication_share": share,
                            "top_ops": top,
                        },
                        indent=2,
                    )
                )
    finally:
        teardown_distributed()


if __name__ == "__main__":
    main(parse_args())
