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
# # Lesson 11: pipeline parallelism
#
# This is the companion notebook of `lessons/11_pipeline_parallelism.md`. It runs the three schedules of
# `common/pipeline.py` (naive, GPipe and 1F1B) on DeepMLP cut into 2 stages, one stage per process. You will see:
#
# 1. each stage's timeline
# 2. the bubble, the idle share of the step, measured against the formula `(p-1)/(m+p-1)`
# 3. the activations each stage holds
# 4. the throughput against data parallelism on the same two processes
# 5. torch's own `torch.distributed.pipelining` computing the same gradients
#
# Every figure is measured on the machine that ran the notebook. The committed outputs come from 2 CPU cores, one
# process per core, talking over gloo. `common.launch.run_on_ranks` starts the processes. It needs the functions it
# runs to live in a module, so they are in `common/experiments/pipeline.py`.
#
# All the timed runs share one process group, and `time_runs` interleaves them: round after round, one step of
# each. Other work on the machine then slows one step of every run, not every step of one run. So the medians
# over the rounds compare the runs fairly. Fairly, but not fast. When the load average printed below is above the
# number of cores, other work shares the cores, and every time is longer and noisier. The bytes of section 3 do
# not depend on the load.

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
# DeepMLP width 1024 (4 blocks) and a batch of 512: each stage computes for tens of milliseconds, messages are
# small next to it, so the bubbles come near the formula. The quick run's model is smaller and its figures noisier.
WIDTH, DEPTH, BATCH = (256, 4, 128) if QUICK else (1024, 4, 512)
STEPS = 3 if QUICK else 10  # timed steps per run; the first is a warm-up and left out
MICROBATCHES = [1, 2, 4, 8, 16]

# %%
import statistics

import matplotlib.pyplot as plt

from common.experiments.pipeline import (
    by_hand_gradients,
    microbatch_bytes,
    plot_timeline,
    time_runs,
    torch_pipelining_gradients,
)
from common.launch import run_on_ranks
from common.models import DeepMLP
from common.pipeline import bubble_fraction_formula, deep_mlp_layers, measured_bubble_fraction

STAGES = 2
RUNS = [("naive", 1)] + [(schedule, m) for schedule in ("gpipe", "1f1b") for m in MICROBATCHES] + [("ddp", STAGES)]
load_before = os.getloadavg()[0]
timed = run_on_ranks(time_runs, STAGES, RUNS, WIDTH, DEPTH, BATCH, STEPS, timeout=600)  # a list: one dict per rank
load_after = os.getloadavg()[0]


def step_records(run: str, step: int) -> list[dict]:
    """Every rank's record of one step of ``run``."""
    return [rank_results[run]["records"][step] for rank_results in timed]


def step_bubbles(run: str) -> list[float]:
    """The measured bubble of each step of ``run`` but the first (a warm-up)."""
    return [measured_bubble_fraction(step_records(run, step)) for step in range(1, STEPS)]


def median_bubble(run: str) -> float:
    return statistics.median(step_bubbles(run))


def typical_step(run: str) -> int:
    """The step whose bubble is the median one (the lower of the two middle ones)."""
    bubbles = step_bubbles(run)
    return 1 + bubbles.index(statistics.median_low(bubbles))


def median_step_seconds(run: str) -> float:
    return statistics.median(timed[0][run]["step_seconds"][1:])


print(f"DeepMLP width {WIDTH}, depth {DEPTH} ({len(deep_mlp_layers(DeepMLP(width=WIDTH, depth=DEPTH)))} layers) ")
print(f"in {STAGES} stages, a batch of {BATCH}; {STEPS} steps per run, the first left out of every median")
print(f"load average (1 min): {load_before:.1f} before the timed runs, {load_after:.1f} after; {os.cpu_count()} cores")

# %% [markdown]
# ## 1. Each stage's timeline
#
# Here is one step of each run, as each stage spent it. The step shown is the one with the median bubble. Each box
# is a forward (F, light) or a backward (B, dark) of one micro-batch. A box runs from the moment its computation
# started to the moment it ended, so waiting for a message is not in the box. The white is the bubble.
#
# - Naive: stage 1 waits for stage 0's whole forward. Then stage 0 waits while stage 1 runs its forward and its
#   backward.
# - GPipe: all forwards, then all backwards, the last micro-batch's first.
# - 1F1B: stage 0 runs one forward ahead, then alternates. Stage 1 alternates from the start.
#
# One step can be far from typical on a loaded machine. Naive runs its events one after another, so the naive step
# printed below lasted at least the sum of its two busy times, over twice the median naive step of section 4.
#
# The lesson draws the same schedules on 4 equal stages:
#
# ![Naive, GPipe and 1F1B on 4 stages, the bubble in grey](../lessons/figures/11_schedules.png)

# %%
fig, axes = plt.subplots(3, 1, figsize=(10, 5.5), sharex=True)
for ax, (run, title) in zip(axes, [("naive/m=1", "naive"), ("gpipe/m=4", "GPipe, m = 4"), ("1f1b/m=4", "1F1B, m = 4")]):
    records = step_records(run, typical_step(run))
    plot_timeline(records, ax, f"{title}: bubble {measured_bubble_fraction(records):.2f} measured")
for ax in axes[:-1]:
    ax.set_xlabel("")
fig.tight_layout()
plt.show()
for run in ("naive/m=1", "gpipe/m=4", "1f1b/m=4"):
    for record in step_records(run, typical_step(run)):
        events = record["events"]
        busy = sum(event["end"] - event["start"] for event in events) * 1e3
        order = " ".join(f"{event['kind']}{event['microbatch']}" for event in events)
        print(f"{run:<10} stage {record['rank']}: busy {busy:6.1f} ms  {order}")

# %% [markdown]
# ## 2. The bubble against the formula
#
# The measured bubble is the share of the step a stage did not compute, averaged over the stages
# (`measured_bubble_fraction`). Each figure is the median over the steps. The same batch is split into m = 1 to 16
# micro-batches.

# %%
print(f"{'m':>3} {'rows':>5} {'formula':>8} {'GPipe':>7} {'1F1B':>7}   step time GPipe, 1F1B")
bubbles = {"gpipe": [], "1f1b": []}
for m in MICROBATCHES:
    for schedule in bubbles:
        bubbles[schedule].append(median_bubble(f"{schedule}/m={m}"))
    times = ", ".join(f"{median_step_seconds(f'{schedule}/m={m}') * 1e3:5.0f} ms" for schedule in bubbles)
    formula = bubble_fraction_formula(STAGES, m)
    print(f"{m:>3} {BATCH // m:>5} {formula:>8.2f} {bubbles['gpipe'][-1]:>7.2f} {bubbles['1f1b'][-1]:>7.2f}   {times}")
print(f"naive: {median_bubble('naive/m=1'):.2f} measured, {bubble_fraction_formula(STAGES, 1):.2f} by the formula")

fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(MICROBATCHES, [bubble_fraction_formula(STAGES, m) for m in MICROBATCHES], "k--", label="(p-1)/(m+p-1)")
ax.plot(MICROBATCHES, bubbles["gpipe"], "o-", label="GPipe, measured")
ax.plot(MICROBATCHES, bubbles["1f1b"], "s-", label="1F1B, measured")
ax.set(xscale="log", xticks=MICROBATCHES, xticklabels=MICROBATCHES, xlabel="micro-batches m", ylabel="bubble")
ax.legend()
plt.show()

# %% [markdown]
# The formula assumes equal stages and free messages. Neither holds here.
#
# - **The naive row tests nothing.** On 2 stages, naive's bubble is one half whatever the stages cost: each stage
#   waits exactly while the other computes. Only the messages can push it above 0.50.
# - **Fixed costs.** Each micro-batch costs two messages and a few operation launches, whose time hardly depends on
#   its size. As the micro-batches shrink, their computation shrinks with them, but that fixed cost does not. So the
#   measured bubble stops following the formula down, and it flattens. In the committed run, which the lesson's
#   section 5 quotes, no m made the step shorter than m = 1's. The formula's promise, a smaller bubble for more
#   micro-batches, holds only while each micro-batch computes for much longer than its messages take.
# - **Unequal stages.** DeepMLP's first stage holds the 784-wide input layer, and the last one the head and the loss.
#   In the GPipe and 1F1B steps shown in section 1, stage 0 was the busier one. The formula, and the equality of
#   GPipe's and 1F1B's bubbles, assume equal stages. When the first stage is the slower one, GPipe makes it wait for
#   a whole micro-batch of stage 1 between its forwards and its backwards. 1F1B fills most of that wait with stage
#   0's own work. That explains why GPipe's bubble came out above 1F1B's from m = 2 on, but only part of the gap.
#   The lesson's benchmark replays its own runs with their event times and free messages. The replay gives the same
#   order and a smaller gap: the rest is the messages and the waits around them.
#
# ![GPipe against 1F1B on 2 stages when stage 0 is slower](../lessons/figures/11_unequal_stages.png)
#
# ## 3. The activations each stage holds
#
# A micro-batch's activations stay alive from its forward to its backward. GPipe runs every forward before any
# backward, so each stage holds all m micro-batches. 1F1B holds at most `min(m, p - rank)`.
#
# Each schedule measures the bytes a stage holds at its peak, as `peak_activation_bytes`, with
# `common.pipeline.ActivationMemory`. Two kinds of tensors count, each piece of memory once:
#
# - the tensors autograd saved for the backward, from when they are saved until the backward frees them
# - the message buffers still referenced: received inputs and gradients, and sent tensors whose send's handle is
#   still kept.
#
# One micro-batch's saved bytes are measured apart (`microbatch_bytes`). Dividing the peak by them gives the number
# of micro-batches that peak amounts to.

# %%
print("each figure: stage 0, stage 1")
print(f"{'m':>3}  {'peak MiB GPipe':>16} {'peak MiB 1F1B':>16}   {'micro-batches GPipe':>19} {'1F1B':>11}")
for m in MICROBATCHES:
    one = [stage["saved"] for stage in microbatch_bytes(WIDTH, DEPTH, STAGES, BATCH // m)]
    peaks = {
        schedule: [timed[rank][f"{schedule}/m={m}"]["records"][-1]["peak_activation_bytes"] for rank in range(STAGES)]
        for schedule in ("gpipe", "1f1b")
    }
    mib = {schedule: ", ".join(f"{peak / 2**20:.2f}" for peak in peaks[schedule]) for schedule in peaks}
    held = {schedule: ", ".join(f"{peak / size:.2f}" for peak, size in zip(peaks[schedule], one)) for schedule in peaks}
    print(f"{m:>3}  {mib['gpipe']:>16} {mib['1f1b']:>16}   {held['gpipe']:>19} {held['1f1b']:>11}")

# %% [markdown]
# GPipe's peak does not fall as m grows. Its m micro-batches of `batch / m` rows are the whole batch's
# activations, whatever m is. 1F1B's peak falls as `1/m` once m passes the number of stages. Stage 0 holds 2
# micro-batches, and stage 1 holds one. The measured peaks sit a little above whole micro-batches. At its peak,
# stage 0 also holds the gradient it received for the backward under way. Stage 1 also holds its input's gradient,
# whose send is still pending.
#
# That is why pipelines use 1F1B. On equal stages it has GPipe's bubble, and it needs the memory of `p`
# micro-batches instead of `m`. So m can grow to shrink the bubble without running out of memory.
#
# ## 4. Throughput: pipeline against data parallelism on the same two processes
#
# The same model and the same batch, 512 rows in the committed run, run two ways. Either it is cut into 2 stages,
# under GPipe and 1F1B with m = 8. Or each process holds the whole model under DDP and takes half the batch
# (`time_runs`' run `"ddp"`).

# %%
for run in ("naive/m=1", "gpipe/m=8", "1f1b/m=8", "ddp"):
    seconds = median_step_seconds(run)
    print(f"{run:<10} {seconds * 1e3:6.0f} ms per step  {BATCH / seconds:7.0f} samples/s")

# %% [markdown]
# DDP has no bubble: both processes compute the whole forward and backward. It adds one all-reduce per bucket, and
# little of it overlaps the backward here. After its first step, DDP packs this model's gradients into
# two buckets: about 4 MiB for the head and the last block, and about 15 MiB for the rest. The second one holds the
# stem, whose gradient is the backward's last. So most of the bytes start to travel only when the backward ends.
#
# The pipeline loses its bubble and pays two messages per micro-batch. When the model fits on one device, data
# parallelism is usually the faster way to use two. In this run DDP beat both pipelines of 8 micro-batches, though
# not the naive one, and on this loaded machine that order moves from run to run. Naive computes on one process at
# a time, so its two processes never compete for the loaded cores. That may explain its speed here, but this run
# does not test it. A pipeline is for a model that
# does not fit, or for links too slow to all-reduce every gradient. Then it is combined with data parallelism,
# each stage replicated, not chosen instead of it.
#
# ## 5. The same gradients from `torch.distributed.pipelining`
#
# Here is torch's own pipeline. A `PipelineStage` is built by hand around each rank's `nn.Sequential`, so the stages
# are the same. `ScheduleGPipe` runs them with 4 micro-batches. Rank 0 calls `schedule.step(X)`, and the last rank
# calls `schedule.step(target=y, losses=losses)`. Its gradients, against `common.pipeline.gpipe`'s on the same
# batch:

# %%
theirs = run_on_ranks(torch_pipelining_gradients, STAGES, 4, WIDTH, DEPTH, BATCH, timeout=120)
ours = run_on_ranks(by_hand_gradients, STAGES, 4, WIDTH, DEPTH, BATCH, timeout=120)
for rank in range(STAGES):
    differences = [
        (theirs[rank]["gradients"][name] - grad).abs().max().item() for name, grad in ours[rank]["gradients"].items()
    ]
    print(f"stage {rank}: {len(differences)} gradients, largest difference {max(differences):.1e}")
print(f"loss: torch {theirs[-1]['loss'].item():.6f}, by hand {ours[-1]['loss'].item():.6f}")
