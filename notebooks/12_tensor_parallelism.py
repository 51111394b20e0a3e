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
# # Lesson 12: tensor parallelism
#
# The companion notebook of `lessons/12_tensor_parallelism.md`. It splits a transformer layer over two processes,
# the way Megatron-LM does. The attention is cut by heads and the MLP by hidden features, with Megatron's `f` and
# `g` around them (`common/tensor_parallel.py`).
#
# ![The MLP on two ranks: A cut by columns, B by rows, g sums](../lessons/figures/12_mlp_columns_then_rows.png)
#
# Then it measures what the split costs and saves:
#
# 1. The split, checked against the whole layer and against torch's DTensor version.
# 2. The bytes each rank holds.
# 3. The all-reduces of a step, against the formula and against data parallelism's.
# 4. One step's timeline.
# 5. The throughput of one process, of tensor parallelism and of data parallelism, on the same processes.
# 6. Solution 13 on one replica and on a 2-D mesh.
#
# Every figure is measured on the machine that ran the notebook. The committed outputs come from 2 CPU cores, one
# process per core, with gloo. `common.launch.run_on_ranks` starts the processes. The functions it runs are in
# `common/experiments/tensor_parallel.py`.

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
WORLD_SIZE = 2
# A transformer layer of width D_MODEL with HEADS heads (the MLP 4 x wider); the quick run's is tiny.
D_MODEL, HEADS = (64, 4) if QUICK else (256, 8)
CHECK_BATCH, CHECK_SEQ = (4, 16) if QUICK else (8, 64)
# (batch, sequence length) pairs: the tokens per step grow from 16 to 4096.
SHAPES = [(1, 16), (4, 16), (8, 32)] if QUICK else [(1, 16), (2, 32), (4, 64), (8, 64), (16, 64), (16, 128), (32, 128)]
# The timed runs: DEPTH layers, a batch of TIME_BATCH sequences of TIME_SEQ tokens, STEPS steps (the first left out).
DEPTH, TIME_BATCH, TIME_SEQ, STEPS = (1, 4, 16, 3) if QUICK else (4, 16, 128, 10)
SOLUTION_RUN = ["--epochs", "1", "--max-batches-per-epoch", "2"] if QUICK else []

# %%
import statistics

import matplotlib.pyplot as plt

from common.experiments.tensor_parallel import (
    block_stack,
    communication_per_step,
    plot_step_timeline,
    sharded_against_full,
    time_steps,
)
from common.launch import in_turn, launch, run_on_ranks
from common.reports import machine_summary
from common.tensor_parallel import mlp_all_reduce_bytes

block = block_stack(D_MODEL, HEADS, 1)[0]
parameters = sum(p.numel() for p in block.parameters())
print(f"a TransformerBlock of d_model {D_MODEL}, {HEADS} heads, MLP hidden {4 * D_MODEL}: {parameters:,} parameters")
print(f"split over {WORLD_SIZE} processes (gloo, one thread each) on {machine_summary()}")

# %% [markdown]
# Sections 1 to 5 show what three functions of `common/experiments/tensor_parallel.py` measure on every rank. They
# run here one after the other, in one group of processes (`in_turn`). Starting a group costs seconds on this
# machine.

# %%
calls = [
    (sharded_against_full, (D_MODEL, HEADS, CHECK_BATCH, CHECK_SEQ)),
    (communication_per_step, (D_MODEL, HEADS, SHAPES)),
    (time_steps, (D_MODEL, HEADS, DEPTH, TIME_BATCH, TIME_SEQ, STEPS)),
]
# run_on_ranks returns each rank's list of the three results; zip makes three tuples, each with one entry per rank.
checked, communication, timed = zip(*run_on_ranks(in_turn, WORLD_SIZE, calls, timeout=900))

# %% [markdown]
# ## 1. The split, checked
#
# Three versions run one forward and backward on the same batch, in float32:
#
# - The whole layer.
# - This rank's `shard_block` of it, split by hand.
# - torch's `parallelize_block`, split by DTensor with `ColwiseParallel` and `RowwiseParallel`.
#
# Each difference is the largest over every element. The cell compares the output and the gradient of the layer's
# input, which `f`'s backward all-reduce makes whole. For the by-hand split it also compares every parameter
# gradient with this rank's slice of the whole layer's.

# %%
for rank, result in enumerate(checked):
    for version, differences in result["differences"].items():
        cells = ", ".join(f"{what} {value:.1e}" for what, value in differences.items())
        print(f"rank {rank}, {version:<7}: largest difference from the whole layer: {cells}")

# %% [markdown]
# That is float32 rounding only, because the sums run in another order. Each rank adds its own heads' and hidden
# features' share, then the all-reduce adds the shares. The tests check the same in float64, to `assert_close`'s
# default tolerance, and after three SGD steps (lesson 12, "Checked by").
#
# ## 2. What each rank holds
#
# **Parameters.** The attention's and the MLP's weights are cut in N. The norms stay whole. So does each
# row-parallel linear's bias, which is added once, after the all-reduce.
#
# **Activations saved for backward**, counted by `saved_activation_bytes` as in lesson 11. Those inside the blocks
# are cut in N: the attention probabilities, the MLP's hidden features. The layer's input, the norms' outputs and the
# residual sum between the blocks stay whole on every rank.

# %%
rank0 = checked[0]
for what in ("parameter_bytes", "saved_bytes"):
    whole, by_hand = rank0[what]["whole"], rank0[what]["by hand"]
    print(
        f"{what.replace('_', ' '):<16}: whole layer {whole / 2**10:8.1f} KiB, rank 0's shard {by_hand / 2**10:8.1f} KiB"
        f" = {by_hand / whole:.2f} of it (1/{WORLD_SIZE} = {1 / WORLD_SIZE:.2f})"
    )
print(f"torch's version holds {rank0['parameter_bytes']['torch'] / 2**10:.1f} KiB of parameters on rank 0")

# %% [markdown]
# Neither is exactly halved. The parameters almost are, since the whole pieces are small vectors. The activations
# are cut far less, because every rank keeps its own copy of each full-width activation. Megatron-LM's sequence
# parallelism (Korthikanti et al. 2022) cuts those along the sequence, outside the blocks. This lesson does not
# build it.
#
# ## 3. The all-reduces of a step, against the formula and against data parallelism
#
# For each batch shape the cell prints three things:
#
# - The all-reduces the tensor-parallel layer makes in forward and in backward, counted by `count_collectives`.
# - The formula, `mlp_all_reduce_bytes`: batch x seq x d_model x 4 bytes, per block and direction.
# - What DDP all-reduces for the same layer, counted by `AllReduceCounter`: its gradients, whatever the batch.

# %%
rows, ddp = communication[0]["rows"], communication[0]["ddp"]  # rank 0's (rank 1 counts the same)
ddp_bytes = ddp["bytes"]
print(f"DDP: {ddp['all-reduces']} all-reduce(s) of {ddp_bytes:,} bytes per step, whatever the batch")
print(
    f"{'batch':>5} {'seq':>4} {'tokens':>6} | {'forward':>16} {'backward':>16} {'formula':>9} | "
    f"{'TP per step':>11} {'DDP per step':>12}"
)
for row in rows:
    tp_total = sum(row["tp forward"]) + sum(row["tp backward"])
    print(
        f"{row['batch']:>5} {row['seq']:>4} {row['batch'] * row['seq']:>6} | "
        f"{len(row['tp forward'])} x {row['tp forward'][0]:>10,} {len(row['tp backward'])} x "
        f"{row['tp backward'][0]:>10,} {row['formula']:>9,} | {tp_total:>11,} {ddp_bytes:>12,}"
    )

tokens = [row["batch"] * row["seq"] for row in rows]
fig, ax = plt.subplots(figsize=(6.5, 3.8))
ax.plot(
    tokens,
    [(sum(r["tp forward"]) + sum(r["tp backward"])) / 2**20 for r in rows],
    "o-",
    label="tensor parallel: 4 all-reduces of the activations",
)
ax.plot(tokens, [4 * mlp_all_reduce_bytes(1, t, D_MODEL, 4) / 2**20 for t in tokens], "k--", label="4 x formula")
ax.plot(tokens, [ddp_bytes / 2**20] * len(rows), "s-", label="data parallel (DDP): the gradients")
ax.set(xscale="log", yscale="log", xlabel="tokens per step (batch x seq)", ylabel="MiB all-reduced per layer, step")
ax.legend()
plt.show()
crossover = ddp_bytes / (4 * D_MODEL * 4)
print(f"the two meet at {crossover:,.0f} tokens per step: the layer's parameter bytes / (4 all-reduces x d_model x 4)")

# %% [markdown]
# Tensor parallelism all-reduces activations. Its bytes grow with the tokens: four tensors of
# `batch x seq x d_model` per layer and step, however many ranks there are. Data parallelism all-reduces
# gradients: the parameters' bytes, whatever the batch. For a layer of about `12 d_model^2` parameters, the two
# meet near `3 d_model` tokens per step. Past that, tensor parallelism sends more bytes than data parallelism, and
# it sends them in the middle of the computation (next section). It is worth it where a layer's weights or
# activations do not fit otherwise, or where there are more devices than the batch can use, and over fast links.
#
# ## 4. One step's timeline
#
# `time_steps` runs three models on the same two processes, a step of each in turn:
#
# - One process: the whole model on the whole batch in each process. This is the reference.
# - Tensor parallel: each rank its shards, on the whole batch.
# - DDP: the whole model, on half the batch each.
#
# For tensor parallelism it notes when each all-reduce was called and when it returned. Here is one layer's step
# as a schematic first, then the measured step with the median time:
#
# ![One layer's step on two ranks: two all-reduces forward, two backward](../lessons/figures/12_layer_step_timeline.png)


# %%
def median_step(name: str) -> int:
    """The step (not the first) whose time on rank 0 is the median one."""
    seconds = timed[0][name]["seconds"][1:]
    return 1 + seconds.index(statistics.median_low(seconds))


step = median_step("tensor parallel")
timelines = [rank_result["tensor parallel"]["timeline"][step] for rank_result in timed]
fig, ax = plt.subplots(figsize=(10, 2.2))
plot_step_timeline(timelines, ax, f"tensor parallel, {DEPTH} layer(s), {TIME_BATCH} x {TIME_SEQ} tokens: step {step}")
fig.tight_layout()
plt.show()
for rank, timeline in enumerate(timelines):
    waiting = sum(end - start for start, end in timeline["all_reduces"])
    print(
        f"rank {rank}: {len(timeline['all_reduces'])} all-reduces, {waiting * 1e3:.1f} ms of a "
        f"{timeline['end'] * 1e3:.1f} ms step inside them ({waiting / timeline['end']:.0%})"
    )

# %% [markdown]
# In this implementation each all-reduce sits between two computations that need its result. The rank does
# nothing else while it runs (red). A rank that reaches it first waits there for the other. So the share printed
# above is the time inside the all-reduces, waiting for the slower rank included, not the transfer alone.
#
# Megatron-LM does better in backward. It starts the all-reduce of the input's gradient asynchronously, and
# meanwhile computes the weight gradient, which needs no all-reduced value. Kernels that cut the products into
# chunks overlap the forward communication too. PyTorch's symmetric-memory `fused_all_gather_matmul` and
# `fused_matmul_reduce_scatter` do that for sequence-parallel layers on GPUs.
#
# DDP, for comparison. When does it start each bucket's all-reduce in a backward of the same model, with half the
# batch per rank? And how long is that backward, all-reduces included? The cell builds a fresh DDP model with a
# communication hook that notes each bucket (`ddp_bucket_starts`). It prints the second step's buckets, after DDP
# rebuilt them:

# %%
buckets = timed[0]["data parallel"]["buckets"]
for number, (start, size) in enumerate(buckets["buckets"]):
    print(f"DDP bucket {number}: {size / 2**20:6.2f} MiB, all-reduce started {start * 1e3:6.1f} ms into backward")
print(f"backward returned after {buckets['backward'] * 1e3:.1f} ms (every bucket all-reduced)")

# %% [markdown]
# DDP's first bucket, 1 MiB by default, closes early in backward. Its all-reduce runs while backward goes on. The
# second bucket holds the rest of the gradients. It can start only when backward has produced all of them, at the
# end. So most of DDP's bytes are not overlapped here either. With more, smaller buckets (`bucket_cap_mb`, lesson
# 09), more of them would be.
#
# ## 5. Throughput on the same two processes

# %%
reference = statistics.median(timed[0]["one process"]["seconds"][1:])
print(
    f"{DEPTH} layer(s) of d_model {D_MODEL}, a batch of {TIME_BATCH} x {TIME_SEQ} tokens, median of {STEPS - 1} steps"
)
for name in ("one process", "tensor parallel", "data parallel"):
    seconds = statistics.median(timed[0][name]["seconds"][1:])
    print(
        f"{name:<16} {seconds * 1e3:7.1f} ms per step  {TIME_BATCH / seconds:7.1f} sequences/s  "
        f"{reference / seconds:.2f} x one process"
    )

# %% [markdown]
# The three versions ran interleaved, step by step, each process with one thread. So a background load hit them
# alike, and tensor against data parallelism is a fair comparison. Both also ran more than twice as fast as one
# process. Halving each process's work does not explain that, and this run does not measure the cause.
#
# Both halve the matrix products per process, in different ways:
#
# - Data parallelism computes whole-width products on half the batch. It all-reduces the gradients in two buckets.
# - Tensor parallelism computes half-width products on the whole batch. It repeats the norms and the residual
#   additions on every rank. It makes four all-reduces per layer, blocking as built here, of more bytes in all
#   (section 3).
#
# When the model fits on each device, data parallelism is the faster way to use two. Tensor parallelism buys
# memory (section 2), and pays for it in time against data parallelism.
#
# ## 6. Solution 13, on one replica and on a 2-D mesh
#
# First, 2 processes hold one copy of the model, split over both, with batches of 64. Then 4 processes form 2
# data-parallel replicas x 2 tensor-parallel ranks (`--data-parallel 2`), with 32 samples per replica. Ranks 0 and
# 1 hold one copy of the model, split. Ranks 2 and 3 hold the other copy, split the same way.
#
# ![A 2 x 2 mesh: tp groups inside a node, dp groups across nodes](../lessons/figures/12_mesh_2d.png)
#
# The `DistributedSampler` of 2 replicas deals each one the alternate samples of the same shuffled order. So the
# two replicas' batches of 32 are, together, the one run's batch of 64. DDP over each pair {0, 2} and {1, 3}
# averages the gradients of the same shard. The second run therefore takes the first run's steps, up to float
# rounding. Then both run again with torch's version (`--tp torch`): DTensor's tensor parallelism, and FSDP2 over
# the replicas.

# %%
runs = {
    "1 replica x 2 ranks, batch 64": (2, ["--batch-size", "64"]),
    "2 replicas x 2 ranks, batch 32 each": (4, ["--data-parallel", "2", "--batch-size", "32"]),
    "torch's version, 1 replica x 2 ranks, batch 64": (2, ["--batch-size", "64", "--tp", "torch"]),
    "torch's version, 2 replicas x 2 ranks, batch 32 each": (
        4,
        ["--data-parallel", "2", "--batch-size", "32", "--tp", "torch"],
    ),
}
for name, (nproc, args) in runs.items():
    printed = launch(
        "solutions/13_tensor_parallel.py",
        "--dataset",
        "digits",
        "--num-workers",
        "0",
        *args,
        *SOLUTION_RUN,
        nproc=nproc,
        timeout=900,
    ).stdout
    print(f"{name}:\n{printed}")
