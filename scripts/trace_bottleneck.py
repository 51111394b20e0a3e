"""Read committed profiler traces again: each trace's mean profiled step split into the four parts that
``common.profiling.bottleneck`` compares (data, exposed communication, compute, overhead), and its verdict.

    python scripts/trace_bottleneck.py results/cpu-amd-epyc-2core/traces_mlp_1mib/rank0.json \\
        results/cpu-amd-epyc-2core/traces_mlp_1mib/rank1.json

Compute is ``step_breakdowns``' ``compute_ms``: the main thread's ops (on a GPU, the kernels) busy outside the data
region. Overhead is what is left of the step: gaps, and on a GPU the device waiting for its host. It reads files
only: no training, no timing.
"""

import argparse
from pathlib import Path

from common.profiling import bottleneck, load_trace, mean_breakdown, step_breakdowns

HEADER = "trace | step ms | data ms | exposed comm. ms | compute ms (busy) | overhead ms (the rest) | bottleneck"


def parts_row(name: str, row: dict) -> str:
    """One line: the step and its four parts, in ms, and the part ``bottleneck`` names."""
    compute = min(row["compute_ms"], row["step_ms"] - row["data_ms"] - row["exposed_communication_ms"])
    overhead = row["step_ms"] - row["data_ms"] - row["exposed_communication_ms"] - compute
    return (
        f"{name:>5} | {row['step_ms']:7.2f} | {row['data_ms']:7.2f} | {row['exposed_communication_ms']:16.2f} | "
        f"{compute:17.2f} | {overhead:22.2f} | {bottleneck(row)}"
    )


def main(args) -> None:
    print("per trace, the mean of its profiled steps (common.profiling.step_breakdowns, then mean_breakdown):")
    print(HEADER)
    for path in args.traces:
        print(parts_row(path.stem, mean_breakdown(step_breakdowns(load_trace(path)))))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", type=Path, help="trace files (.json or .json.gz), one per rank")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
