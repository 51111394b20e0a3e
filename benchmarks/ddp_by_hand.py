"""Step time of the hand-built DDPs (naive, overlapped, bucketed) against torch's DistributedDataParallel.

    torchrun --standalone --nproc_per_node=2 benchmarks/ddp_by_hand.py                      # CPU, gloo
    torchrun --standalone --nproc_per_node=2 benchmarks/ddp_by_hand.py --bucket-caps 0.25 1 5 25 \
        --json runs/ddp_by_hand.json --plot runs/ddp_by_hand.png

Every build trains the same ``DeepMLP(--width, --depth)`` from the same weights on the same fixed batch per rank
(SGD with momentum): ``NaiveDDP``, ``OverlappedDDP``, ``BucketedDDP`` once per ``--bucket-caps`` (MiB) and torch's
DDP at its defaults (25 MiB buckets, the first one 1 MiB). The builds take turns, round after round, so that a
background load hits all alike; each row is the median round, timed on the slowest rank. "all-reduces" is per
step (``count_collectives``; torch's: its buckets, counted by a communication hook on a copy). samples/s counts
every rank's samples; "vs torch" is the ratio to torch DDP's.
"""

import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.cli import argument_parser, positive_float, positive_int
from common.collectives import AllReduceCounter, count_collectives
from common.ddp_by_hand import BucketedDDP, NaiveDDP, OverlappedDDP
from common.distributed import BACKENDS, is_main, print0, setup_distributed, teardown_distributed
from common.metrics import slowest_rank_seconds
from common.models import DeepMLP
from common.reports import run_header


def parse_args(argv=None):
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--width", type=positive_int, default=1024, help="DeepMLP's width")
    parser.add_argument("--depth", type=positive_int, default=4, help="DeepMLP's blocks")
    parser.add_argument("--batch-size", type=positive_int, default=64, help="per rank")
    parser.add_argument("--bucket-caps", type=positive_float, nargs="+", default=[1.0, 5.0, 25.0], help="MiB")
    parser.add_argument("--warmup", type=positive_int, default=3, help="untimed steps per build")
    parser.add_argument("--steps", type=positive_int, default=10, help="timed steps per build and round")
    parser.add_argument("--rounds", type=positive_int, default=3, help="the builds take turns; medians")
    parser.add_argument("--backend", choices=BACKENDS, default="auto")
    parser.add_argument("--json", type=Path, help="rank 0 also writes the rows and the set-up to this file")
    parser.add_argument("--plot", type=Path, help="rank 0 draws samples/s per build to this PNG")
    return parser.parse_args(argv)


def builds(args, env) -> dict:
    """Each build's name, bucket cap (MiB or None) and wrapped model, all from the same initial weights."""

    def model():
        torch.manual_seed(0)
        return DeepMLP(width=args.width, depth=args.depth).to(env.device)

    made = {"naive": (None, NaiveDDP(model())), "overlapped": (None, OverlappedDDP(model()))}
    for cap in args.bucket_caps:
        made[f"bucketed {cap:g}"] = (cap, BucketedDDP(model(), bucket_cap_mb=cap))
    made["torch DDP"] = (25, DDP(model(), device_ids=env.device_ids))
    return made


def make_step(net, X, y):
    """One training step of ``net``; the hand-built wrappers finish their gradient synchronization before the step."""
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

    def step():
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(net(X), y).backward()
        if not isinstance(net, DDP):
            net.finish_gradient_synchronization()
        optimizer.step()

    return step


def all_reduces_per_step(name: str, net, step, args, env, X, y) -> int:
    """How many all-reduces one step of ``net`` starts (torch DDP: on a copy with a counting hook)."""
    if not isinstance(net, DDP):
        with count_collectives() as log:
            step()
        return log.count("all_reduce")
    torch.manual_seed(0)
    copy = DDP(DeepMLP(width=args.width, depth=args.depth).to(env.device), device_ids=env.device_ids)
    counter = AllReduceCounter.attach(copy)
    copy_step = make_step(copy, X, y)
    copy_step()  # the first step runs with one bucket; DDP rebuilds its buckets after it
    counter.reset()
    copy_step()
    return counter.calls


def plot(rows: list[dict], path: Path, title: str) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 3.5), layout="tight")
    axes = figure.subplots()
    axes.barh([row["build"] for row in rows][::-1], [row["samples_per_second"] for row in rows][::-1])
    axes.set(xlabel="samples/s (all ranks)", title=title)
    axes.grid(True, axis="x", alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def main(args):
    env = setup_distributed(args.backend)
    try:
        generator = torch.Generator().manual_seed(env.rank)
        X = torch.randn(args.batch_size, *DeepMLP.input_shape, generator=generator).to(env.device)
        y = torch.randint(0, 10, (args.batch_size,), generator=generator).to(env.device)
        made = builds(args, env)
        steps = {name: make_step(net, X, y) for name, (_, net) in made.items()}
        for step in steps.values():
            for _ in range(args.warmup):
                step()
        counts = {
            name: all_reduces_per_step(name, net, steps[name], args, env, X, y) for name, (_, net) in made.items()
        }
        seconds = {name: [] for name in made}
        for _ in range(args.rounds):
            for name, step in steps.items():
                seconds[name].append(slowest_rank_seconds(lambda: [step() for _ in range(args.steps)], env.device))
        samples = args.steps * args.batch_size * env.world_size
        throughput = {name: samples / statistics.median(times) for name, times in seconds.items()}
        parameters = sum(p.numel() for p in made["naive"][1].parameters())
        title = (
            f"DeepMLP(width={args.width}, depth={args.depth}): {parameters / 1e6:.2f} M parameters, "
            f"{parameters * 4 / 2**20:.1f} MiB of gradients; {env.world_size} processes, {env.backend} on "
            f"{env.device.type}, batch {args.batch_size} per rank; median of {args.rounds} rounds of {args.steps} steps"
        )
        print0(run_header())
        print0(title)
        print0(f"{'build':>10} {'cap MiB':>8} {'all-reduces':>11} {'ms/step':>8} {'samples/s':>10} {'vs torch':>8}")
        rows = []
        for name, (cap, _) in made.items():
            rows.append(
                {
                    "build": name,
                    "bucket_cap_mb": cap,
                    "all_reduces_per_step": counts[name],
                    "ms_per_step": statistics.median(seconds[name]) / args.steps * 1e3,
                    "samples_per_second": throughput[name],
                    "vs_torch": throughput[name] / throughput["torch DDP"],
                }
            )
            row = rows[-1]
            print0(
                f"{name.split()[0]:>10} {'-' if cap is None else f'{cap:g}':>8} {counts[name]:>11} "
                f"{row['ms_per_step']:>8.1f} {row['samples_per_second']:>10,.0f} {row['vs_torch']:>7.2f}x"
            )
        if is_main() and args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"setup": title, "rows": rows}, indent=2))
        if is_main() and args.plot:
            plot(rows, args.plot, title.split(";")[0])
    finally:
        teardown_distributed()


if __name__ == "__main__":
    main(parse_args())
