"""Pipeline schedules against data parallelism on two processes: step time, and the bubble measured and replayed.

    torchrun --standalone --nproc_per_node=2 benchmarks/pipeline_schedules.py                        # loopback
    python scripts/cluster.py --nodes 2 --procs-per-node 1 --link 1gbit -- benchmarks/pipeline_schedules.py

The same ``DeepMLP(--width, --depth)`` and batch of ``--batch-size`` rows, trained with SGD on 2 processes:

- lesson 11's hand-written schedules (``common.pipeline``: naive, GPipe and 1F1B at each of ``--microbatches``),
  cut into 2 stages, and DDP with the whole model on each process and half the batch
  (``common.experiments.pipeline.time_runs``);
- torch's schedules (``torch.distributed.pipelining``) at ``--torch-microbatches``: ``ScheduleGPipe`` and
  ``Schedule1F1B`` on the same 2 stages, ``ScheduleInterleaved1F1B`` and the zero-bubble ones on 4 stages, 2 per
  process (``time_torch_schedules``).

Every run takes one step per round, ``--steps`` rounds, so that a background load hits all alike; each figure is
the median over the rounds, the first left out. "measured" is the bubble of the step's events (the mean over the
ranks of the share of the step a rank did not compute, ``measured_bubble_fraction``). "replayed" replays the
same order of events with each taking its median time in this run and messages free
(``common.experiments.pipeline.replay``): what the schedule would give on these unequal stages if messages cost
nothing. "formula" assumes equal stages and free messages. One thread per process: on the emulated cluster each
node's ``torchrun`` starts a single process, which would otherwise take every core of the shared machine.
"""

import statistics

import torch
import torch.distributed as dist

from common.cli import argument_parser, positive_int
from common.distributed import print0, setup_distributed, teardown_distributed
from common.experiments.pipeline import (
    TORCH_SCHEDULES,
    recorded_orders,
    recorded_seconds,
    replay,
    time_runs,
    torch_stage_indices,
)
from common.models import DeepMLP
from common.pipeline import bubble_fraction_formula, deep_mlp_layers, measured_bubble_fraction, stage_bounds
from common.reports import run_header


def parse_args(argv=None):
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--width", type=positive_int, default=1024, help="DeepMLP's width")
    parser.add_argument("--depth", type=positive_int, default=6, help="DeepMLP's blocks (layers: depth + 2)")
    parser.add_argument("--batch-size", type=positive_int, default=512, help="the whole batch, over both processes")
    parser.add_argument("--microbatches", type=positive_int, nargs="+", default=[2, 4, 8], help="for GPipe and 1F1B")
    parser.add_argument("--torch-microbatches", type=positive_int, default=8, help="for torch's schedules")
    parser.add_argument("--steps", type=positive_int, default=10, help="rounds; the first is left out")
    return parser.parse_args(argv)


def summarize(name: str, step_records: list[list[dict]], seconds: list[float], formula, batch: int) -> dict:
    """One row: median step time and throughput, and the median bubble measured and replayed, steps 1 on."""
    kept = step_records[1:]
    durations = recorded_seconds(kept)
    replayed = [measured_bubble_fraction(replay(recorded_orders(records), durations)) for records in kept]
    median_seconds = statistics.median(seconds[1:])
    return {
        "run": name,
        "ms": median_seconds * 1e3,
        "samples_per_second": batch / median_seconds,
        "measured": statistics.median(measured_bubble_fraction(records) for records in kept),
        "replayed": statistics.median(replayed),
        "formula": formula,
        "durations": durations,
    }


def main(args):
    torch.set_num_threads(1)
    env = setup_distributed("gloo")
    try:
        ours = [("naive", 1)] + [(s, m) for s in ("gpipe", "1f1b") for m in args.microbatches] + [("ddp", 2)]
        theirs = [(schedule, args.torch_microbatches) for schedule in TORCH_SCHEDULES]
        mine = time_runs(env, ours, args.width, args.depth, args.batch_size, args.steps, torch_runs=theirs)
        everything = [None] * env.world_size
        dist.all_gather_object(everything, mine)
        if env.rank != 0:
            return
        p, rows = env.world_size, []
        for name in mine:
            per_rank = [ranks[name] for ranks in everything]
            seconds = per_rank[0]["step_seconds"]
            if name == "ddp":
                median_seconds = statistics.median(seconds[1:])
                rows.append(
                    {"run": "ddp", "ms": median_seconds * 1e3, "samples_per_second": args.batch_size / median_seconds}
                )
                continue
            schedule, m = name.removeprefix("torch ").split("/m=")
            per_stage = TORCH_SCHEDULES[schedule][1] if name.startswith("torch ") else 1
            formula = None if "ZeroBubble" in schedule else bubble_fraction_formula(p, int(m), per_stage)
            steps = [[rank["records"][step] for rank in per_rank] for step in range(args.steps)]
            rows.append(summarize(name, steps, seconds, formula, args.batch_size))

        layers = len(deep_mlp_layers(DeepMLP(width=args.width, depth=args.depth)))
        parameters = sum(p.numel() for p in DeepMLP(width=args.width, depth=args.depth).parameters())
        print0(f"{run_header()} (at the end of the runs)")
        print0(
            f"DeepMLP(width={args.width}, depth={args.depth}): {layers} layers, {parameters / 1e6:.2f} M parameters "
            f"({parameters * 4 / 2**20:.1f} MiB of gradients); {p} processes, gloo, one thread each; a batch of "
            f"{args.batch_size}; median of {args.steps - 1} rounds ({args.steps} run, the first left out)"
        )
        print0(f"2 stages: layers {stage_bounds(layers, p)}; 4 stages: layers {stage_bounds(layers, 2 * p)}")
        for schedule in ("Interleaved1F1B", "ZBVZeroBubble"):
            print0(f"  torch {schedule}: rank r holds stages", [torch_stage_indices(schedule, r, p) for r in range(p)])
        print0(f"{'run':<34} {'ms/step':>8} {'samples/s':>10}   bubble: {'measured':>8} {'replayed':>8} {'formula':>8}")
        for row in rows:
            start = f"{row['run']:<34} {row['ms']:>8.0f} {row['samples_per_second']:>10,.0f}"
            if "measured" not in row:
                print0(f"{start}   (no bubble: every process computes the whole step)")
                continue
            formula = "-" if row["formula"] is None else f"{row['formula']:.2f}"
            print0(f"{start}           {row['measured']:>8.2f} {row['replayed']:>8.2f} {formula:>8}")
        print0("median ms per micro-batch and event, by stage (F forward, B backward, I and W its two halves):")
        for row in rows:
            if row["run"] in ("naive/m=1", f"gpipe/m={max(args.microbatches)}") or "ZBV" in row["run"]:
                times = "; ".join(
                    f"stage {stage} "
                    + " ".join(
                        f"{kind} {by_stage[stage] * 1e3:.1f}"
                        for kind, by_stage in sorted(row["durations"].items(), key=lambda item: "FBIW".index(item[0]))
                        if stage in by_stage
                    )
                    for stage in sorted({s for by_stage in row["durations"].values() for s in by_stage})
                )
                print0(f"  {row['run']:<32} {times}")
    finally:
        teardown_distributed()


if __name__ == "__main__":
    main(parse_args())
