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
# # Lesson 08: build DDP and ZeRO yourself
#
# The companion notebook of `lessons/08_build_ddp_and_zero.md`. The builds live in `common/ddp_by_hand.py` and
# `common/zero_by_hand.py`. Here they run and are measured. The solutions `09_ddp_by_hand.py` and
# `10_zero_by_hand.py` run as `torchrun` subprocesses, and `common.launch.run_on_ranks` runs the rest on 2 processes.
# You will see the collectives of one step, and when each bucket's all-reduce runs during the backward pass. Then
# the step time of each build against torch's DDP, and what each rank holds under ZeRO-1, 2 and 3.
#
# ![The three builds on a timeline of one backward pass](../lessons/figures/08_three_builds_timeline.png)

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
MAX_BATCHES = 2 if QUICK else 20  # batches per epoch of the solutions' runs (1 epoch)
BENCHMARK = ["--width", 256, "--depth", 2, "--steps", 2, "--rounds", 1] if QUICK else []  # benchmarks/ddp_by_hand.py
ZERO_BENCHMARK = ["--time-depth", 2, "--steps", 1, "--rounds", 1] if QUICK else []  # benchmarks/zero_by_hand.py
# The runs of solutions/09_ddp_by_hand.py (--ddp, options) and 10_zero_by_hand.py (--zero, options, processes);
# the quick run keeps one of each: every torchrun costs seconds of start-up
BUILD_RUNS = [
    ("naive", []),
    ("overlapped", []),
    ("bucketed", ["--bucket-cap-mb", "0.05"]),
    ("bucketed", []),
    ("torch", []),
]
ZERO_RUNS = [(1, [], 2), (2, [], 2), (3, [], 2), (3, ["--compute-dtype", "bf16"], 2), (3, [], 4)]
if QUICK:
    BUILD_RUNS = [BUILD_RUNS[2]]  # bucketed, small buckets
    ZERO_RUNS = [ZERO_RUNS[3]]  # ZeRO-3 gathering in bf16

# %%
import matplotlib.pyplot as plt

from common.ddp_by_hand import assign_buckets
from common.experiments.ddp_by_hand import bucket_timeline
from common.launch import launch, run_on_ranks
from common.models import LeNet


def run(script, *args, nproc=2):
    """Run a solution on ``nproc`` CPU processes for one short epoch on digits; return what rank 0 printed."""
    return launch(
        script, "--dataset", "digits", "--epochs", 1, "--max-batches-per-epoch", MAX_BATCHES, *args, nproc=nproc
    ).stdout


def lines(text, *starts):
    """The lines of ``text`` that start with one of ``starts`` (the progress bars and the rest left out)."""
    return "\n".join(line for line in text.splitlines() if line.lstrip().startswith(starts))


# %% [markdown]
# ## The arithmetic: how many messages, how many bytes
#
# LeNet has 8 parameter tensors. The naive build all-reduces each gradient on its own: 8 messages per step. A
# bucketed build sends one message per bucket. The bytes stay the same: every gradient once. `assign_buckets`
# applies DDP's rule. It takes the tensors in reverse order of `parameters()`, the order in which backward produces
# their gradients. It closes a bucket once its size reaches the cap, with the tensor that crossed it.
#
# ![Four gradients packed in reverse order into two flat buckets](../lessons/figures/08_flat_bucket.png)

# %%
# NBVAL_CHECK_OUTPUT
parameters = list(LeNet().parameters())
gradient_bytes = sum(p.numel() * p.element_size() for p in parameters)
print(f"LeNet: {len(parameters)} tensors, {gradient_bytes:,} bytes of fp32 gradients")
for cap_bytes in (1_000, 200_000, 25 * 2**20):
    buckets = assign_buckets(parameters, cap_bytes)
    sizes = [sum(parameters[i].numel() * 4 for i in bucket) for bucket in buckets]
    print(f"cap {cap_bytes:>10,} bytes: {len(buckets)} bucket(s), indices {buckets}, bytes {sizes}")

# %% [markdown]
# ## Four builds, one training
#
# `solutions/09_ddp_by_hand.py` trains LeNet on digits with `--ddp naive`, `overlapped`, `bucketed` or `torch`.
# The last one is `DistributedDataParallel`. Each run prints the collectives of one training step. All four start
# from rank 0's weights and apply the same averaged gradients. So they print the same losses. What differs is how
# the gradients travel.

# %%
for build, extra in BUILD_RUNS:
    printed = run("solutions/09_ddp_by_hand.py", "--ddp", build, *extra)
    print(f"--ddp {build} {' '.join(extra)}".rstrip())
    print(lines(printed, "one training step", "epoch 1/1", "model replicas"), "\n")

# %% [markdown]
# ## When each all-reduce runs: a timeline of one backward pass
#
# `bucket_timeline` times one training step of `BucketedDDP` on `DeepMLP`, on 2 processes. It records when each
# gradient became ready, from its post-accumulate-grad hook. It also records when each bucket's all-reduce started
# and finished. The times are in milliseconds from the start of `backward()`. A bucket that starts before
# `backward()` returns overlaps with it.

# %%
timeline = run_on_ranks(bucket_timeline, 2, 0.5, timeout=120)[0]  # rank 0's view; 0.5 MiB buckets
figure, axes = plt.subplots(figsize=(10, 3.2), layout="tight")
axes.axvspan(0, timeline["backward_ms"], color="tab:blue", alpha=0.12, label="backward()")
for bucket in timeline["buckets"]:
    axes.barh(
        bucket["index"],
        bucket["ended_ms"] - bucket["started_ms"],
        left=bucket["started_ms"],
        color="tab:orange",
        label="all-reduce" if bucket["index"] == 0 else None,
    )
ready = {gradient["parameter"]: gradient["ready_ms"] for gradient in timeline["gradients"]}
for bucket in timeline["buckets"]:
    axes.plot([ready[name] for name in bucket["parameters"]], [bucket["index"]] * len(bucket["parameters"]), "k|")
axes.axvline(timeline["finish_ms"], color="k", linestyle="--", label="finish_gradient_synchronization() returns")
axes.set(xlabel="ms from the start of backward()", ylabel="bucket", yticks=[b["index"] for b in timeline["buckets"]])
axes.invert_yaxis()
axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)  # beside the plot: no bar hidden
plt.show()
print(f"backward() returned at {timeline['backward_ms']:.1f} ms, ", end="")
print(f"all gradients averaged at {timeline['finish_ms']:.1f} ms")
for bucket in timeline["buckets"]:
    print(
        f"bucket {bucket['index']}: {bucket['bytes'] / 2**20:.2f} MiB, {len(bucket['parameters'])} tensors, "
        f"all-reduce {bucket['started_ms']:.1f} -> {bucket['ended_ms']:.1f} ms"
    )

# %% [markdown]
# Each tick is a gradient becoming ready. A bucket's bar starts at its last tick, or later if the bucket before it
# has not started yet: buckets start in order. The bar runs while autograd computes the gradients of the layers
# closer to the input. Only the start order must agree across ranks: gloo runs the all-reduces on worker threads,
# so they can end in any order.
#
# ## Step time against torch's DDP
#
# `benchmarks/ddp_by_hand.py` trains the same `DeepMLP` with every build. The builds take turns, round after round.
# It prints the median step time and the ratio to torch's DDP. Here, on loopback, gloo shares the two cores with
# autograd, so overlap can hide little, and the order of the builds changes from run to run. The lesson quotes the
# same benchmark between two emulated nodes joined by a 1 Gbit/s link, where the builds separate:
#
# ![Step time per build on loopback, 1 Gbit/s and 200 Mbit/s](../lessons/figures/08_build_step_times.png)

# %%
print(launch("benchmarks/ddp_by_hand.py", *BENCHMARK, nproc=2).stdout)

# %% [markdown]
# ## ZeRO by hand: what each rank holds, and what it sends
#
# ![What each of 4 ranks holds under DDP and ZeRO-1, 2, 3](../lessons/figures/08_zero_who_holds_what.png)
#
# `solutions/10_zero_by_hand.py` trains `DeepMLP` with Adam under one ZeRO stage. ZeRO-1 is `ZeRO1Optimizer` on
# the parameters of `BucketedDDP(model)`, which averages the gradients. ZeRO-2 is `ZeRO2Optimizer`, with no DDP.
# ZeRO-3 is `ZeRO3Model`, with the model's blocks as units: the input and output layers form its root. Each run
# prints the collectives of one step. Their bytes are the sizes of the tensors handed to each collective, not the
# traffic on the wire. Each run also prints the bytes of model state each rank holds, beside lesson 06's arithmetic
# from `common.memory.zero_bytes_per_rank`.

# %%
for stage, extra, nproc in ZERO_RUNS:
    print(run("solutions/10_zero_by_hand.py", "--zero", stage, *extra, nproc=nproc))

# %% [markdown]
# ## What each rank holds, measured, and ZeRO-3's prefetch
#
# The model-state figures above are the sizes of the tensors that the model and the optimizer reference after a
# step. They repeat lesson 06's arithmetic. `benchmarks/zero_by_hand.py` measures instead. It counts every tensor
# storage alive during one Adam step of each build, with `common.experiments.zero.LiveTensorBytes`, from before the
# model is made. It prints what a rank holds as the step begins, and its peak in forward, backward and step. Then
# it times ZeRO-3 with prefetch and without. With prefetch, each unit's all-gather starts while the unit before it
# computes.
#
# ![ZeRO-3's forward with and without prefetch](../lessons/figures/08_zero3_prefetch_timeline.png)

# %%
print(launch("benchmarks/zero_by_hand.py", *ZERO_BENCHMARK, nproc=2).stdout)
