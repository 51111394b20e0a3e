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
# # Lesson 10: gradient compression with DDP communication hooks
#
# The companion notebook of `lessons/10_gradient_compression.md`. It shows what a hook receives from DDP. It prints
# PowerSGD's compression arithmetic for LeNet. It shows error feedback at work on a gradient that never changes.
# Then it runs `solutions/11_powersgd.py`, and plots accuracy against epochs for plain all-reduce and for PowerSGD
# with and without error feedback. Last, it measures what compression costs in compute, to say on which links it
# pays. Every number it prints is measured on the machine that ran the notebook. The pictures are diagrams, drawn
# from code. The committed outputs come from 2 CPU cores with gloo.
#
# ![DDP hands each full bucket to the hook and waits for its future](../lessons/figures/10_hook_in_ddp.png)

# %%
import datetime
import os

from common.reports import machine_summary

# The date says which run these outputs are; the load says how much other jobs shared the CPU with it.
load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
now = datetime.datetime.now(datetime.timezone.utc)
print(f"{machine_summary()}; run {now:%Y-%m-%d %H:%M} UTC; load average {load}")

# %% tags=["parameters"]
import os

QUICK = os.environ.get("COURSE_QUICK") == "1"  # the test suite sets this for a fast run
FEEDBACK_STEPS = 40 if QUICK else 200  # compressed steps of the constant gradient
RUN = ["--epochs", "1", "--max-batches-per-epoch", "11"] if QUICK else ["--epochs", "5"]  # the solution's run
CURVES = ["--epochs", "1", "--seeds", "0"] if QUICK else ["--epochs", "20", "--seeds", "0"]  # accuracy curves
CONFIGS = ["allreduce", "powersgd-r2"] if QUICK else ["allreduce", "powersgd-r2", "powersgd-r1-no-ef"]
REPEATS = 5 if QUICK else 50  # timings of the compression's compute

# %%
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from IPython.display import Image, display

from common.compression import compression_ratio, orthogonalize, powersgd_hook_by_hand
from common.ddp import ddp_buckets
from common.experiments.compression import constant_gradient_drift
from common.launch import REPO, launch, run_on_ranks
from common.models import LeNet
from common.scaling import fit_all_reduce

WORK = Path(tempfile.mkdtemp(prefix="lesson10-"))  # plots and metrics go here, not into the repository

# %% [markdown]
# ## 1. What a hook receives
#
# This hook only looks. It is lesson 03's `common.ddp.ddp_buckets`. It records what DDP hands it: the bucket's
# index, its parameters and its bytes. Then it all-reduces the bucket as DDP would. It runs for two steps of an MLP
# of six 256 x 256 layers, 257 KiB each.
#
# Without `find_unused_parameters=True`, as here, DDP puts every parameter in one bucket at its first step. It
# rebuilds the buckets once, at the second step, in the order in which the gradients became ready. With the default
# `bucket_cap_mb` of 25 MiB, the first rebuilt bucket gets a smaller cap of 1 MiB. With a cap that you set, every
# bucket gets that cap. Here the cap is 0.3 MiB, to see several buckets. With `find_unused_parameters=True`, DDP
# buckets by the caps from the start and never rebuilds, unless `static_graph=True` is set too.

# %%
recorded = run_on_ranks(ddp_buckets, 2, {"cap 0.3 MiB": {"bucket_cap_mb": 0.3}}, timeout=120)[0]["cap 0.3 MiB"]
for step, buckets in enumerate(recorded["steps"]):
    print(f"step {step}:")
    for bucket in buckets:
        print(f"  bucket {bucket['index']}: {bucket['bytes'] / 2**10:7.0f} KiB  {', '.join(bucket['parameters'])}")

# %% [markdown]
# The first step's single bucket lists the parameters in `parameters()` order. The second step's buckets follow
# the order in which the gradients were ready. That is about the reverse: the last layer first. A bucket closes
# as soon as it reaches its cap, so it can pass the cap by one gradient: here each bucket holds two layers. A hook
# is called once per bucket.
#
# ## 2. PowerSGD's arithmetic, matrix by matrix
#
# Each gradient is seen as an `n x m` matrix. A conv weight `(out, in, kh, kw)` is `out x in*kh*kw`. At rank r,
# PowerSGD sends `r*(n+m)` numbers instead of `n*m`. It does so only where that is more than
# `min_compression_rate` times fewer, here 2.
#
# ![LeNet's 128 x 800 gradient next to its thin P and Q](../lessons/figures/10_powersgd_factorisation.png)

# %%
MIN_COMPRESSION_RATE = 2
shapes = {name: tuple(p.shape) for name, p in LeNet().named_parameters()}
print(f"{'parameter':<20} {'shape':<18} {'elements':>9}   " + "   ".join(f"r = {r:<8}" for r in (1, 2, 4)))
sent = {1: 0, 2: 0, 4: 0}
for name, shape in shapes.items():
    cells = []
    for rank in sent:
        ratio = compression_ratio(shape, rank)
        compressed = ratio > MIN_COMPRESSION_RATE and len(shape) > 1
        n = shape[0]
        m = math.prod(shape) // n
        sent[rank] += min(n, m, rank) * (n + m) if compressed else math.prod(shape)
        cells.append(f"{ratio:5.1f}x" + (" " if compressed else " whole"))
    print(f"{name:<20} {str(shape):<18} {math.prod(shape):>9,}   " + "   ".join(f"{c:<12}" for c in cells))
total = sum(math.prod(shape) for shape in shapes.values())
print(f"{'the model':<20} {'':<18} {total:>9,}   " + "   ".join(f"{total / sent[r]:5.1f}x{'':<6}" for r in sent))
print("elements sent:", sent)

# %% [markdown]
# ## 3. Error feedback on a gradient that never changes
#
# Every step hands the hook the same full-rank 16 x 12 gradient, one per rank, compressed to rank 1. The plot shows
# how far the mean of what the hook delivered so far is from the true mean gradient. Without error feedback, the
# same part is dropped at every step, and the distance stays. With it, the dropped part comes later.
#
# ![The error-feedback loop, one step of it](../lessons/figures/10_error_feedback_loop.png)


# %%
curves = {
    feedback: run_on_ranks(constant_gradient_drift, 2, powersgd_hook_by_hand, feedback, FEEDBACK_STEPS, timeout=60)[0]
    for feedback in (True, False)
}
fig, ax = plt.subplots(figsize=(6, 3.5))
for feedback, label in ((True, "with error feedback"), (False, "without")):
    ax.plot(range(1, FEEDBACK_STEPS + 1), curves[feedback], label=label)
ax.set(xlabel="compressed steps", ylabel="|mean delivered - mean gradient| / |mean gradient|", xscale="log")
ax.legend()
plt.show()
print(f"after {FEEDBACK_STEPS} steps: with {curves[True][-1]:.3f}, without {curves[False][-1]:.3f}")

# %% [markdown]
# ## 4. The solution
#
# LeNet on digits, on 2 processes, with PowerSGD at rank 2 by hand from step 10. The line `step 10` counts the
# all-reduces of the first compressed step, and their bytes.

# %%
printed = launch("solutions/11_powersgd.py", "--dataset", "digits", "--num-workers", "0", *RUN, nproc=2).stdout
print(printed)

# %% [markdown]
# ## 5. Accuracy, epoch by epoch
#
# This runs `benchmarks/gradient_compression.py` with three of its configurations and one seed. The lesson's table
# has every configuration over three seeds.

# %%
plot = WORK / "curves.png"
command = [sys.executable, "benchmarks/gradient_compression.py", *CURVES]
command += ["--configs", *CONFIGS, "--plot", str(plot)]
print(subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True, timeout=900).stdout)
display(Image(filename=plot))

# %% [markdown]
# ## 6. When compression pays
#
# Two quantities decide it. C is the compute that PowerSGD adds per step. The cell below times a lower bound of it,
# on one process: the two products, the orthogonalisation of P and `P Q^T` for every compressed matrix of LeNet at
# rank 2. Both hooks also orthogonalise every Q at every step, and add, copy and subtract the error. The timed
# function leaves those out. alpha is the fixed cost of one all-reduce, fitted to gloo's times between 2 processes
# on this machine.
#
# The break-even bandwidth, for one bucket, is `W* = 2 (N-1)/N * (B - B_sent) / (C + 2 alpha(N))`. PowerSGD saves
# time on links slower than W*. With C a lower bound, the W* printed below is an upper bound. alpha is measured at
# 2 processes. For 8 and 64, it is scaled as a ring's latency, N-1 times: an estimate. The saving assumes that
# backward hides none of the all-reduce. Lesson 09 measures how much it hides. Lesson 10's section 6 measures the
# step time itself over emulated links of several rates.
#
# ![Illustrative step budgets on a fast and a slow link](../lessons/figures/10_break_even.png)

# %%
RANK = 2
matrices = [
    torch.randn(shape[0], math.prod(shape[1:]))
    for shape in shapes.values()
    if len(shape) > 1 and compression_ratio(shape, RANK) > MIN_COMPRESSION_RATE
]
qs = [torch.randn(m.shape[1], RANK) for m in matrices]


def compress_and_decompress():
    for matrix, q in zip(matrices, qs):
        p = matrix @ q
        orthogonalize(p)
        q_new = matrix.t() @ p
        matrix_approx = p @ q_new.t()
    return matrix_approx


compress_and_decompress()  # warm up
times = []
for _ in range(REPEATS):
    started = time.perf_counter()
    compress_and_decompress()
    times.append(time.perf_counter() - started)
compute_seconds = sorted(times)[len(times) // 2]


alpha = run_on_ranks(fit_all_reduce, 2, [4, 4096, 65536, 1 << 20], 20 if QUICK else 50, timeout=120)[0]["alpha_s"]
saved_bytes = 4 * (total - sent[RANK])
print(f"C = {compute_seconds * 1e3:.3f} ms of compression compute per step, alpha = {alpha * 1e6:.0f} us")
for ranks in (2, 8, 64):
    alpha_n = alpha * (ranks - 1)  # measured at 2; a ring's latency grows with its 2 (N-1) hops
    break_even = 2 * (ranks - 1) / ranks * saved_bytes / (compute_seconds + 2 * alpha_n)
    how = "measured alpha" if ranks == 2 else "alpha scaled as a ring's, N-1 times"
    print(f"N = {ranks:>2}: PowerSGD rank {RANK} pays on links slower than {break_even / 1e9:.3f} GB/s ({how})")
