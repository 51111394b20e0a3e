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
# # Lesson 13: where a transformer's memory goes
#
# The companion notebook of `lessons/13_memory_and_sequence_parallelism.md`. It measures the memory of a training
# step of a small GPT, trained on real text. Then it cuts the largest part, the activations, two ways:
#
# 1. A training step's memory, part by part.
# 2. One layer's saved activations against Korthikanti et al.'s formula.
# 3. The formula's terms, one by one.
# 4. Recomputation: none, by hand, torch's full and selective.
# 5. Sequence parallelism on two processes, against tensor parallelism.
# 6. Memory per rank, all ways side by side.
# 7. Solution 14 trained on the text.
#
# ![A layer on two ranks, cut along the sequence and by heads](../lessons/figures/13_sequence_parallel_layer.png)
#
# Every figure is measured on the machine that ran the notebook. The functions it calls live in
# `common/experiments/activations.py`. `common.launch.run_on_ranks` starts the processes of section 5.

# %%
from common.reports import run_header

# The date says which run these outputs are; the load says how much other jobs shared the CPU with it.
print(run_header())

# %% tags=["parameters"]
import os

QUICK = os.environ.get("COURSE_QUICK") == "1"  # the test suite sets this for a fast run
WORLD_SIZE = 2
# The GPT of solution 14's defaults: width 128, 4 heads, 4 layers, 128 bytes of context; the quick run's is tiny.
if QUICK:
    CONFIG = dict(context=32, d_model=32, num_heads=4, num_layers=2, dropout=0.1)
else:
    CONFIG = dict(context=128, d_model=128, num_heads=4, num_layers=4, dropout=0.1)
BATCH = 4 if QUICK else 16  # sequences per step
# One layer's saved bytes for these (sequence length, batch) pairs, at the GPT's width and heads.
SHAPES = [(16, 1), (32, 1), (32, 4)] if QUICK else [(64, 1), (128, 1), (256, 1), (512, 1), (64, 4), (128, 4), (256, 4)]
STEPS = 3 if QUICK else 10  # timed steps of each recomputation mode (the first left out)
SP_BATCH = 2 if QUICK else 8  # sequence parallelism is checked in float64: a smaller batch
SOLUTION_RUNS = {  # solution 14's flags: the lesson's first command, then sequence parallelism
    "data parallel, recomputed by hand": ["--recompute", "by-hand"],
    "tensor + sequence parallel, selective recomputation": ["--parallel", "sequence", "--recompute", "selective"],
}
if QUICK:
    SMALL = ["--context", "32", "--d-model", "32", "--layers", "2", "--val-batches", "2", "--sample-length", "20"]
    SOLUTION_RUNS = {name: [*flags, *SMALL, "--epochs", "1", "--max-batches-per-epoch", "2"]
                     for name, flags in list(SOLUTION_RUNS.items())[:1]}  # fmt: skip
else:
    SOLUTION_RUNS["tensor + sequence parallel, selective recomputation"] += ["--epochs", "1"]
    SOLUTION_RUNS["tensor + sequence parallel, selective recomputation"] += ["--max-batches-per-epoch", "50"]

# %%
import matplotlib.pyplot as plt

from common.experiments.activations import (
    build_gpt,
    layer_saved_bytes,
    memory_per_rank,
    plot_layer_bytes,
    plot_memory_per_rank,
    recomputation_table,
    saved_bytes_sweep,
    sequence_parallel_checks,
    step_memory,
    torch_sequence_parallel,
)
from common.launch import in_turn, launch, run_on_ranks
from common.text import load_text

text = load_text(context=CONFIG["context"])
print(f"text: {text.source}, {text.num_bytes:,} bytes")
print(f"{len(text.train):,} training and {len(text.validation):,} validation windows of {text.context} bytes")
model = build_gpt(CONFIG)
print(f"GPT {CONFIG}: {sum(p.numel() for p in model.parameters()):,} parameters")


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:8.2f} MiB"


# %% [markdown]
# ## 1. A training step's memory, part by part
#
# Lesson 06 counted the model state: each parameter, its gradient and AdamW's two moments. That is 16 bytes per
# parameter in fp32. Activations come on top. They are the tensors that autograd keeps between forward and backward,
# and they grow with the batch. The cell runs one AdamW step of the GPT on one process and measures each part.
# `HeldMemory` watches every tensor that forward creates and counts those still alive when forward ends.

# %%
parts = step_memory(CONFIG, BATCH)
for part, nbytes in parts.items():
    print(f"{part:<12}{mib(nbytes)}")
state = parts["parameters"] + parts["gradients"] + parts["optimizer"]
print(f"activations / model state = {parts['activations'] / state:.1f} at a batch of {BATCH} x {CONFIG['context']}")

# %% [markdown]
# The activations outweigh the whole model state, at a batch of only a few thousand tokens. Sharding the model
# state, as FSDP does, leaves them untouched. The rest of the notebook cuts them.
#
# ## 2. One layer against the formula
#
# Korthikanti et al. 2022 count what one layer keeps: `s b h (34 + 5 a s / h)` bytes in 16-bit. Here s is the
# sequence length, b the batch, h the width and a the heads. Their count assumes 2 bytes per value and 1 byte per
# dropout mask. This notebook runs in fp32 on a CPU. There PyTorch's dropout keeps its mask as fp32 too. Each
# layer norm also keeps a mean and a 1/std per token. So the formula becomes
# `s b h (72 + 12 a s / h) + 16 s b` bytes.
#
# The cell measures one layer with `saved_tensors`. Its pack hook sees every tensor autograd saves. It counts each
# piece of memory once.

# %%
rows = saved_bytes_sweep(CONFIG["d_model"], CONFIG["num_heads"], SHAPES)
print(f"{'seq':>5} {'batch':>5} | {'measured':>12} {'formula':>12} {'difference':>10} | s^2 term's share")
for row in rows:
    print(
        f"{row['seq']:>5} {row['batch']:>5} | {row['measured']:>12,} {row['formula']:>12,} "
        f"{row['measured'] - row['formula']:>10,} | {row['quadratic'] / row['formula']:.0%}"
    )
fig, ax = plt.subplots(figsize=(6.5, 4))
plot_layer_bytes(rows, ax)
plt.show()

# %% [markdown]
# The measured bytes equal the formula's, with no difference at all. The attention's scores grow with the square
# of the sequence. At short sequences the linear terms dominate. As s grows, the `a s^2 b` term takes over.
#
# ## 3. The terms, one by one
#
# Each module of the layer is run alone. The cell lists what the formula says it keeps, next to the sizes of the
# tensors that autograd saved.

# %%
seq, batch = SHAPES[0]
one_layer = layer_saved_bytes(seq, batch, CONFIG["d_model"], CONFIG["num_heads"])
for module, part in one_layer["by module"].items():
    measured = sorted(part["measured"], reverse=True)
    print(f"{module}: {len(measured)} tensors saved, {sum(measured):,} bytes")
    for (term, nbytes), size in zip(sorted(part["formula"].items(), key=lambda item: -item[1]), measured):
        print(f"    {nbytes:>9,}  {size:>9,}  {term}")

# %% [markdown]
# Every term has a tensor of its size, and no tensor is left over. The masks are as large as the probabilities they
# drop: fp32 on a CPU.
#
# ## 4. Recomputation
#
# Recomputation keeps only each block's input. Backward runs the block's forward again before going back through
# it. Four ways run on the same GPT and the same batches, a step of each in turn:
#
# - none: every activation kept;
# - by hand: `common.recompute.Recompute`, an autograd function that replays the random state;
# - full: `torch.utils.checkpoint.checkpoint`;
# - selective: the same, keeping the outputs of the linears' matrix products.
#
# For each, the cell prints what forward kept, the peak over the whole step, and the median step time. It also
# checks that the loss and every gradient equal those without recomputation, bit for bit.

# %%
table = recomputation_table(CONFIG, BATCH, STEPS)
print(f"{'mode':<10} {'kept after forward':>20} {'peak in the step':>18} {'step':>9} | same gradients")
for mode, result in table.items():
    print(
        f"{mode:<10} {mib(result['kept']):>20} {mib(result['peak']):>18} "
        f"{result['median seconds'] * 1e3:7.1f} ms | {result['identical']}"
    )

# %% [markdown]
# Full recomputation keeps a small fraction of what no recomputation keeps. Its peak is higher than what it keeps.
# During backward one block's activations exist again, for a moment. Selective recomputation keeps the linears'
# outputs, so it keeps more and recomputes less. The dropout masks came out the same because the random state was
# put back. The times come from a shared CPU and move with the load. In theory a recomputed forward costs one more
# forward per step, about a third more. On this shared CPU the steps took 41% to 79% longer.
#
# ## 5. Sequence parallelism on two processes
#
# Tensor parallelism (lesson 12) splits the attention and the MLP. The norms, the dropouts and the residual stream
# still hold the whole sequence on every rank. Sequence parallelism cuts those along the sequence. It replaces each
# all-reduce by an all-gather before the attention or the MLP and a reduce-scatter after it.
#
# The cell runs one step four ways on each rank, in float64 without dropout: the whole GPT, tensor parallelism,
# sequence parallelism, and sequence parallelism that keeps only its shard of the linears' input (`regather`).
# Then torch's version, `parallelize_gpt` with `loss_parallel`, for two AdamW steps.

# %%
calls = [
    (sequence_parallel_checks, (CONFIG, SP_BATCH)),
    (torch_sequence_parallel, (CONFIG, SP_BATCH)),
    (memory_per_rank, (CONFIG, BATCH)),
]
checks, torch_checks, per_rank = zip(*run_on_ranks(in_turn, WORLD_SIZE, calls, timeout=900))
for rank, result in enumerate(checks):
    for version, check in result.items():
        print(
            f"rank {rank}, {version:<28}: loss off by {check['loss difference']:.1e}, "
            f"gradients by {check['gradient difference']:.1e}"
        )
print(f"torch's version after 2 AdamW steps: parameters off by {torch_checks[0]['parameter difference']:.1e}")

# %% [markdown]
# All versions compute the whole GPT's loss and gradients, to float64 rounding. Next, what each sends per step.


# %%
def summary(calls: list) -> str:
    counts = {}
    for name, nbytes in calls:
        count, total = counts.get(name, (0, 0))
        counts[name] = (count + 1, total + nbytes)
    return ", ".join(f"{count} x {name} ({total:,} bytes)" for name, (count, total) in counts.items()) or "none"


def ring_bytes(calls: list) -> float:
    """What each rank sends over a ring: 2 (t - 1) / t of an all-reduce, (t - 1) / t of the others."""
    share = {"all_reduce": 2 * (WORLD_SIZE - 1) / WORLD_SIZE}
    return sum(nbytes * share.get(name, (WORLD_SIZE - 1) / WORLD_SIZE) for name, nbytes in calls)


for version, check in checks[0].items():
    if version == "one process":
        continue
    print(f"{version}:\n  forward : {summary(check['forward'])}\n  backward: {summary(check['backward'])}")
    print(f"  each rank sends {ring_bytes(check['forward'] + check['backward']):,.0f} bytes over a ring")
print(f"torch's, first step: {torch_checks[0]['passes']}; its optimizer step: {torch_checks[0]['optimizer step']}")
print(f"torch's norm gradients after backward: {torch_checks[0]['norm gradients']}")

# %% [markdown]
# Each all-reduce of tensor parallelism became an all-gather and a reduce-scatter of the same tensor. On a ring,
# that pair sends what the all-reduce sends. Backward adds one all-reduce, of the replicated parameters' gradients.
# Each rank computed those from its own tokens only. `regather` gathers each attention's and each MLP's input once
# more in backward: 8 more all-gathers.
#
# torch's version leaves the norms' gradients as partial sums. Its AdamW step then sums each of them at every use.
#
# What each rank saved for backward, in the same step:

# %%
whole = checks[0]["one process"]["saved"]
for version, check in checks[0].items():
    print(f"{version:<28} {mib(check['saved'])}  = {check['saved'] / whole:.3f} of the whole GPT's")

# %% [markdown]
# Tensor parallelism keeps more than half on each rank. The norms' inputs, and the linears' inputs (the norms'
# outputs), stay whole. This run has no dropout, so no masks. Sequence parallelism cuts the norms' inputs in two.
# The linears still keep the gathered, whole sequence. With `regather` they keep only their shard too, and each rank
# keeps exactly half, a few scalars aside.
#
# ## 6. Memory per rank, all together
#
# The same GPT and batch, five ways, on two ranks. Each bar is one rank's model state and the activations that
# forward left alive.

# %%
for name, result in per_rank[0].items():
    print(
        f"{name:<40} model state {mib(result['model state'])}, activations {mib(result['activations'])}, "
        f"total {mib(result['model state'] + result['activations'])}"
    )
fig, ax = plt.subplots(figsize=(7.5, 3))
plot_memory_per_rank(per_rank[0], ax)
fig.tight_layout()
plt.show()

# %% [markdown]
# Recomputation cuts the activations most, at the price of a second forward. Tensor parallelism splits the
# weights and part of the activations. Sequence parallelism splits the rest. The embeddings and the head stay whole
# on every rank in this version, so the model state is not halved.
#
# ## 7. Solution 14 on the text
#
# First the lesson's first command: data parallelism over two processes, each block recomputed by hand. Then
# tensor and sequence parallelism by hand, with selective recomputation, for one shorter epoch.

# %%
for name, flags in SOLUTION_RUNS.items():
    printed = launch("solutions/14_activation_memory.py", *flags, nproc=WORLD_SIZE, timeout=1500).stdout
    print(f"{name}:\n{printed}")

# %% [markdown]
# A uniform guess among 256 bytes would score ln 256 = 5.55 nats. The validation loss falls far below that as the
# model learns the text. The sample shows what it learned first: words, spaces, backticks and underscores. It is
# not Python yet.
