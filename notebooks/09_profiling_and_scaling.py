# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lesson 09: profiling, monitoring and scaling
#
# This is the companion notebook of `lessons/09_profiling_and_scaling.md`. It runs `solutions/06_profiling.py` and
# two benchmarks as `torchrun` subprocesses. Then it reads back what they wrote:
# - the trace breakdown of a step, rank by rank
# - a loader that starves training, fixed one option at a time
# - a sweep of DDP's bucket size
# - strong and weak scaling, with a latency-bandwidth model of the all-reduce
# - the TensorBoard scalars of a run
#
# Every number printed here is measured on the machine that ran the notebook. The pictures embedded in the Markdown
# are the lesson's, drawn from other committed runs. The committed outputs come from 2 CPU cores with gloo, and
# other jobs shared them. The first cell prints the load average.

# %%
import datetime
import os

from common.reports import machine_summary

# The date says which run these outputs are; the load says how much other jobs shared the CPU with it.
load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
now = datetime.datetime.now(datetime.timezone.utc)
settings = "quick settings (COURSE_QUICK=1)" if os.environ.get("COURSE_QUICK") == "1" else "full settings"
print(f"{machine_summary()}; run {now:%Y-%m-%d %H:%M} UTC; load average {load}; {settings}")

# %% tags=["parameters"]
import os

QUICK = os.environ.get("COURSE_QUICK") == "1"  # the test suite sets this for a fast run
BATCHES = 4 if QUICK else 12  # batches per epoch of the solution's runs (2 epochs)
BUCKET_CAPS_MB = [] if QUICK else [0.01, 4.0, 25.0]  # the sweep of --bucket-cap-mb, besides the first run's 1 MiB
LOADER = ["--steps", 2, "--epochs", 1] if QUICK else []  # benchmarks/data_loading.py (defaults: 10 steps, 2 epochs)
SCALING = ["--mode", "strong", "--epochs", "1", "--iterations", "2"] if QUICK else ["--mode", "both"]  # ddp_scaling

# %%
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from IPython.display import Image, display

from common.launch import REPO, launch
from common.models import DeepMLP
from common.monitoring import read_scalars
from common.profiling import plot_breakdown
from common.scaling import bucket_bytes, predict_communication_seconds

WORK = Path(tempfile.mkdtemp(prefix="lesson09-"))  # traces, logs and plots go here, not into the repository


def profile_run(name, *args):
    """Run solutions/06_profiling.py on 2 CPU processes for 2 short epochs of digits; return its metrics file."""
    folder = WORK / name
    printed = launch(
        "solutions/06_profiling.py",
        *("--dataset", "digits", "--epochs", 2, "--max-batches-per-epoch", BATCHES, "--num-workers", 0),
        *("--trace-dir", folder / "traces", "--metrics-file", folder / "metrics.json", *args),
        nproc=2,
    ).stdout
    return printed, json.loads((folder / "metrics.json").read_text())


def lines(text, *starts):
    """The lines of ``text`` that start with one of ``starts`` (the progress bars and the rest left out)."""
    return "\n".join(line for line in text.splitlines() if line.lstrip().startswith(starts))


# %% [markdown]
# ## One profiled run: where a step's time goes, rank by rank
#
# The run trains DeepMLP, 1.46 M parameters, with 1 MiB buckets and TensorBoard on. The script labels four regions
# in every step: data, forward, backward and optimizer. It records steps 3 to 5 with `torch.profiler`, one trace
# per rank. Then it prints each rank's breakdown, read back from that rank's trace by
# `common.profiling.step_breakdowns`.
#
# *Exposed* communication is the part of the all-reduces that nothing hid behind computation. The lesson draws one
# such step from a committed trace:
#
# ![One profiled step of two ranks, rank 1 waiting in its all-reduces](../lessons/figures/09_step_timeline.png)

# %%
printed, metrics = profile_run("mlp", "--model", "mlp", "--bucket-cap-mb", 1, "--tensorboard", WORK / "runs")
start = printed.index("per profiled step")
print(printed[start:])

# %% [markdown]
# The same figures as bars. Each bar is a region's mean time per profiled step. Exposed communication is drawn
# hatched at the end of the backward bar. Its length is measured, but its place is only a convention. In a real
# step it can fall anywhere in backward, as the lesson's two-rank timeline above shows.

# %%
profile = metrics["profile"]
plot_breakdown({"rank 0": profile["trace_breakdown"]}, WORK / "breakdown.png", title="rank 0, DeepMLP, 2 ranks")
display(Image(WORK / "breakdown.png"))

# %% [markdown]
# ## A loader that starves training, fixed one option at a time
#
# `benchmarks/data_loading.py` reads the digits from PNG files, one file per sample. Each file waits 2 ms, to
# stand for slow storage, and is decoded and augmented in Python. The benchmark climbs
# `common.data_loading.LOADER_LADDER`, one loader option per rung.

# %%
loading = launch(
    "benchmarks/data_loading.py",
    *("--data-dir", WORK / "data", "--json", WORK / "loading.json", "--plot", WORK / "loading.png", *LOADER),
    nproc=2,
    env_extra={"OMP_NUM_THREADS": "1"},
).stdout
print(loading)
display(Image(WORK / "loading.png"))

# %% [markdown]
# ## DDP's bucket size: all-reduces per step, predicted and counted
#
# `--bucket-cap-mb` sets the cap of every bucket. Lesson 08's `assign_buckets` predicts how many buckets the
# 1.46 M parameters make, and each bucket is one all-reduce. The trace counts the all-reduces each profiled step
# started. Each cap runs once, so a few milliseconds between two rows can be noise. The lesson sets this sweep
# beside the same one over an emulated 1 Gbit/s link:
#
# ![The bucket sweep on loopback and over a 1 Gbit/s link](../lessons/figures/09_bucket_sweep.png)


# %%
def sweep_row(cap, profile):
    b = profile["trace_breakdown"]
    hidden = "-" if b["overlap"] is None else f"{b['overlap']:.0%}"
    return (
        f"{cap:7.2f} | {profile['predicted_all_reduces']:7} | {b['all_reduces']:20.0f} | {b['step_ms']:7.1f} | "
        f"{b['communication_ms']:16.1f} | {b['exposed_communication_ms']:10.1f} | {hidden:>6}"
    )


sweep = {1.0: profile}  # the first run: 1 MiB buckets
for cap in BUCKET_CAPS_MB:
    sweep[cap] = profile_run(f"cap{cap}", "--model", "mlp", "--bucket-cap-mb", cap)[1]["profile"]
print("cap MiB | buckets | all-reduces per step | step ms | communication ms | exposed ms | hidden")
print("\n".join(sweep_row(cap, sweep[cap]) for cap in sorted(sweep)))

# %% [markdown]
# ## Scaling: strong and weak, and a model of the all-reduce
#
# `benchmarks/ddp_scaling.py` trains `solutions/01_ddp_basic.py` at 1 and 2 processes. Weak scaling keeps the
# batch per process fixed. Strong scaling keeps the global batch fixed. Then the benchmark times all-reduces of
# several sizes and fits t(n) = alpha + beta n to them. Alpha is the fixed cost of a call, beta the cost per byte.
# The fit predicts what a step's buckets cost.
#
# In the committed run the single process was slow under the notebook, so its efficiencies came out above 100%.
# The lesson's "Deeper" section has what is known about it.

# %%
scaling = subprocess.run(
    [sys.executable, "benchmarks/ddp_scaling.py", "--nproc", "1", "2", *SCALING]
    + ["--plot", WORK / "scaling.png", "--json", WORK / "scaling.json"],
    cwd=REPO,
    capture_output=True,
    text=True,
    check=True,
).stdout
print(scaling)
display(Image(WORK / "scaling.png"))

# %% [markdown]
# The fit, applied to the bucket sweep above. For each cap it predicts the all-reduce time of DeepMLP's buckets at
# 2 processes. Beside the prediction are the communication and the exposed communication that the traces measured
# inside real steps. The lesson also shows how far each measured size lies from the fitted line:
#
# ![The alpha-beta fit and each size's residual, measured over fitted](../lessons/figures/09_alpha_beta_residuals.png)

# %%
fit = json.loads((WORK / "scaling.json").read_text())["communication"][0]  # 2 processes
print(f"fit at 2 processes: alpha {fit['alpha_s'] * 1e3:.3f} ms, 1/beta {fit['bandwidth_gb_s']:.2f} GB/s")
print("cap MiB | buckets | predicted ms/step | communication ms (trace) | exposed ms (trace)")
for cap in sorted(sweep):
    predicted = 1000 * predict_communication_seconds(bucket_bytes(DeepMLP(), cap), fit)
    b = sweep[cap]["trace_breakdown"]
    print(
        f"{cap:7.2f} | {sweep[cap]['predicted_all_reduces']:7} | {predicted:17.2f} | "
        f"{b['communication_ms']:24.2f} | {b['exposed_communication_ms']:18.2f}"
    )

# %% [markdown]
# ## Monitoring: what TensorBoard received
#
# The first run logged one point per epoch of each scalar, from global rank 0 only. `tensorboard --logdir` shows
# them as curves. `read_scalars` reads the same event files back.

# %%
for tag, points in read_scalars(WORK / "runs").items():
    print(f"{tag:32} " + "  ".join(f"epoch {step}: {value:,.3f}" for step, value in points))
