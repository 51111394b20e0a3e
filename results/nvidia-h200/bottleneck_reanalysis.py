"""Read the H200 profile of `make gpu-check` again with common.profiling's compute_ms and bottleneck.

    cd results/nvidia-h200 && PYTHONPATH=../.. ../../.venv/bin/python bottleneck_reanalysis.py \
        > bottleneck-reanalysis.txt
"""

import datetime
from pathlib import Path

from common.profiling import bottleneck, load_trace, mean_breakdown, step_breakdowns
from common.reports import machine_summary

TRACE = Path(__file__).parent / "traces" / "rank0.json"

rows = step_breakdowns(load_trace(TRACE))
print("# traces/rank0.json read again by common.profiling's step_breakdowns and bottleneck (compute_ms: kernels busy)")
print("# the trace: one NVIDIA H200, PyTorch 2.11.0+cu130, solutions/06_profiling.py in make gpu-check (summary.md)")
print(f"# read on {machine_summary()}, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC,")
print("# by results/nvidia-h200/bottleneck_reanalysis.py; per profiled step, then their mean_breakdown")
print("step |  step ms |  data ms | exposed comm. ms | compute ms (kernels) | overhead ms (the rest) | bottleneck")
for name, row in [*((str(i + 1), row) for i, row in enumerate(rows)), ("mean", mean_breakdown(rows))]:
    rest = row["step_ms"] - row["data_ms"] - row["exposed_communication_ms"] - row["compute_ms"]
    print(
        f"{name:>4} | {row['step_ms']:8.3f} | {row['data_ms']:8.3f} | {row['exposed_communication_ms']:16.3f} | "
        f"{row['compute_ms']:20.3f} | {rest:22.3f} | {bottleneck(row)}"
    )
