"""Lesson 08's ZeRO builds measured: peak memory per rank in each phase of a step, and ZeRO-3's prefetch.

    torchrun --standalone --nproc_per_node=2 benchmarks/zero_by_hand.py            # CPU, gloo (about a minute)

Memory: one Adam step of ``DeepMLP(--width, --depth)`` under torch's DDP, lesson 08's ZeRO-1 under DDP (broadcasts),
``FlatZeRO1Optimizer``, ``ZeRO2Optimizer`` and ``ZeRO3Model`` (``common.experiments.zero.phase_peaks``), counted by
``LiveTensorBytes`` (live tensor storages, from before the model was made): "held", every tensor alive as the step
begins (parameters, optimizer states, DDP's buckets, flat buffers), and the most bytes alive at once in each phase,
beside lesson 06's arithmetic for the stage (``common.memory.zero_bytes_per_rank``: parameters, gradients and
optimizer states, nothing else). The largest figure over the ranks. DDP and the flat stages use ``--bucket-cap-mb``
buckets. Not counted: memory that C++ code takes without an ATen operator, and the batch.

Time: ZeRO-3's step with prefetch (each unit's all-gather started while the unit before computes) and without, on
``DeepMLP(--time-width, --time-depth)``, the two taking turns; the median round on the slowest rank.
"""

import statistics

import torch.distributed as dist

from common.cli import argument_parser, positive_float, positive_int
from common.distributed import BACKENDS, print0, setup_distributed, teardown_distributed
from common.experiments.zero import BUILDS, STAGE_OF_BUILD, phase_peaks, zero3_step_seconds
from common.memory import zero_bytes_per_rank
from common.models import DeepMLP
from common.reports import run_header


def parse_args(argv=None):
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--width", type=positive_int, default=512, help="DeepMLP's width, for memory")
    parser.add_argument("--depth", type=positive_int, default=4, help="DeepMLP's blocks, for memory")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="per rank")
    parser.add_argument("--bucket-cap-mb", type=positive_float, default=1.0, help="DDP's and the flat stages' buckets")
    parser.add_argument("--time-width", type=positive_int, default=1024, help="DeepMLP's width, for ZeRO-3's time")
    parser.add_argument("--time-depth", type=positive_int, default=8, help="DeepMLP's blocks, for ZeRO-3's time")
    parser.add_argument("--steps", type=positive_int, default=3, help="timed steps per setting and round")
    parser.add_argument("--rounds", type=positive_int, default=7, help="the settings take turns; medians")
    parser.add_argument("--backend", choices=BACKENDS, default="auto")
    return parser.parse_args(argv)


def main(args):
    env = setup_distributed(args.backend)
    try:
        print0(f"{run_header()}; {env.world_size} processes, {env.backend}")
        peaks = phase_peaks(env, args.width, args.depth, args.batch_size, args.bucket_cap_mb)
        every_rank = [None] * env.world_size
        dist.all_gather_object(every_rank, peaks)
        numel = sum(p.numel() for p in DeepMLP(width=args.width, depth=args.depth).parameters())
        print0(
            f"\nMemory per rank, MB (the largest over the ranks): DeepMLP(width={args.width}, depth={args.depth}), "
            f"{numel:,} parameters, Adam, batch {args.batch_size} per rank, buckets of {args.bucket_cap_mb:g} MiB"
        )
        print0(f"{'build':<20} {'held':>7} {'forward':>8} {'backward':>9} {'step':>7} {'peak':>7} {'predicted':>10}")
        for name in BUILDS:
            figures = {key: max(rank[name][key] for rank in every_rank) / 1e6 for key in every_rank[0][name]}
            predicted = zero_bytes_per_rank(numel, env.world_size, STAGE_OF_BUILD[name])["total"] / 1e6
            peak = max(figures["forward"], figures["backward"], figures["step"])
            print0(f"{name:<20} {figures['held']:>7.2f} {figures['forward']:>8.2f} {figures['backward']:>9.2f} "
                   f"{figures['step']:>7.2f} {peak:>7.2f} {predicted:>10.2f}")  # fmt: skip
        seconds = zero3_step_seconds(env, args.time_width, args.time_depth, args.batch_size, args.steps, args.rounds)
        numel = sum(p.numel() for p in DeepMLP(width=args.time_width, depth=args.time_depth).parameters())
        print0(
            f"\nZeRO-3 step time: DeepMLP(width={args.time_width}, depth={args.time_depth}), {numel:,} parameters, "
            f"batch {args.batch_size} per rank; median of {args.rounds} rounds of {args.steps} steps, slowest rank"
        )
        medians = {name: statistics.median(times) / args.steps * 1e3 for name, times in seconds.items()}
        for name, times in seconds.items():
            rounds = ", ".join(f"{t / args.steps * 1e3:.1f}" for t in times)
            print0(f"{name:<12} {medians[name]:>7.1f} ms/step (rounds: {rounds})")
        print0(f"prefetch / no prefetch: {medians['prefetch'] / medians['no prefetch']:.2f}")
    finally:
        teardown_distributed()


if __name__ == "__main__":
    main(parse_args())
