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
# # Lesson 14: context parallelism
#
# The companion notebook of `lessons/14_context_parallelism.md`. One sequence is split over the ranks, and
# attention, which mixes every position with the positions before it, gets the other ranks' keys and values:
#
# 1. Blockwise attention with an online softmax, in one process.
# 2. Ring attention on 2 and 4 ranks, against `F.scaled_dot_product_attention`, and its messages.
# 3. Load balance under a causal mask: contiguous slices against zig-zag.
# 4. The ring against an all-gather of the keys and values.
# 5. The GPT trained with context parallelism, and solution 15 on the text.
#
# ![Ring attention on four ranks](../lessons/figures/14_ring_attention.png)
#
# Every number printed below is measured on the machine that ran the notebook. The functions it calls live in
# `common/experiments/context_parallel.py`. `common.launch.run_on_ranks` starts the processes of sections 2 to 5.

# %%
from common.reports import run_header

# The date says which run these outputs are; the load says how much other jobs shared the CPU with it.
print(run_header())

# %% tags=["parameters"]
import os

QUICK = os.environ.get("COURSE_QUICK") == "1"  # the test suite sets this for a fast run
SHAPE = dict(batch=2, heads=2, seq=16, head_dim=8)  # the equality checks, in float64
BALANCE_SEQ = 256 if QUICK else 2048  # the load-balance timing: one causal sequence of this length over 4 ranks
COMPARE_SEQ = 128 if QUICK else 2048  # ring against all-gather, on 2 ranks
REPEATS = 2 if QUICK else 15  # timed repeats (the median is printed)
CONFIG = dict(context=16, d_model=16, num_heads=2, num_layers=2)  # the GPT trained both ways, in float64
SOLUTION_FLAGS = ["--epochs", "1", "--max-batches-per-epoch", "2", "--val-batches", "2"] if QUICK else []

# %%
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from common.context_parallel import blockwise_attention
from common.experiments.context_parallel import (
    attention_checks,
    compute_seconds_per_rank,
    plot_balance,
    random_qkv,
    ring_against_all_gather,
    training_losses,
    work_per_rank,
)
from common.launch import in_turn, launch, run_on_ranks

# %% [markdown]
# ## 1. Blockwise attention, in one process
#
# Attention over one block of keys gives an output and, per query, the log of its softmax denominator. `merge`
# combines two such results exactly. So the keys can come one block at a time, and the whole score matrix is never
# held. The cell compares the output and the three gradients with SDPA's, for several block sizes.

# %%
q, k, v, grad = random_qkv(**SHAPE)
for causal in (False, True):
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*whole, is_causal=causal)
    expected_grads = torch.autograd.grad(expected, whole, grad)
    for block_size in (1, 4, 5, 16):
        blocks = [t.clone().requires_grad_() for t in (q, k, v)]
        got = blockwise_attention(*blocks, block_size, causal)
        grads = torch.autograd.grad(got, blocks, grad)
        worst = max((a - b).abs().max().item() for a, b in zip((got, *grads), (expected, *expected_grads)))
        print(f"{'causal' if causal else 'full':>6}, blocks of {block_size:>2} keys: largest difference {worst:.1e}")

# %% [markdown]
# Every block size gives SDPA's numbers to float64 rounding, the gradients too.
#
# ## 2. Ring attention on 2 and 4 ranks
#
# Each rank keeps its slice of q, k and v. The key/value blocks travel around the ring. The cell checks, on
# every rank, the output and its slices of the three gradients, for the ring and the all-gather, both layouts,
# causal and not. It also counts the messages each rank posts.

# %%
checks = {n: run_on_ranks(in_turn, n, [(attention_checks, tuple(SHAPE.values()))], timeout=600) for n in (2, 4)}
for world_size, ranks in checks.items():
    worst = max(c["difference"] for (r,) in ranks for name, c in r.items() if name not in ("formula", "bad length"))
    print(f"{world_size} ranks: largest difference from SDPA over every rank, method, layout and mask: {worst:.1e}")
    (rank0,) = ranks[0]
    print(f"  formula: {rank0['formula']}")
    for name in ("ring, zigzag, causal", "all-gather, zigzag, causal"):
        print(
            f"  {name}: forward (sends, receives, bytes) {rank0[name]['forward']}, backward {rank0[name]['backward']}"
        )
    print(f"  a length that does not divide: {rank0['bad length']}")

# %% [markdown]
# Forward sends N - 1 blocks, backward N - 1 blocks and N gradient blocks. Each message is one key block and one
# value block, stacked. The all-gather posts no point-to-point message: it is one collective.
#
# ## 3. Load balance under a causal mask
#
# With contiguous slices, rank r's queries see r + 1 of the N key blocks. With zig-zag, each rank holds a front
# chunk and its mirror. The cell counts the scores each rank computes, then times each rank's computation in this
# one process, without the messages.

# %%
balance = {}
for layout in ("contiguous", "zigzag"):
    work = work_per_rank(BALANCE_SEQ, 4, layout)
    seconds = compute_seconds_per_rank(BALANCE_SEQ, 4, layout, repeats=REPEATS)
    balance[layout] = {"work": work, "seconds": seconds}
    print(f"{layout:>10}: scores per rank {work}, busiest / mean {max(work) / (sum(work) / len(work)):.2f}")
    print(f"{'':>10}  ms per rank {[round(s * 1e3, 2) for s in seconds]}, "
          f"busiest / mean {max(seconds) / (sum(seconds) / len(seconds)):.2f}")  # fmt: skip
fig, ax = plt.subplots(figsize=(6.5, 3.5))
plot_balance(balance, ax)
fig.tight_layout()
plt.show()

# %% [markdown]
# A ring step waits for its slowest rank. With contiguous slices the last rank does most of the work, and the
# others wait. Zig-zag gives every rank the same count of scores, and close to the same time.
#
# ## 4. The ring against an all-gather
#
# Llama 3 gathered all keys and values at once instead. The cell measures, on 2 and 4 ranks, causal and zig-zag:
# the bytes rank 0 sent, the most memory its forward and backward held at once, and the median time.

# %%
for world_size in (2, 4):
    (compared,) = run_on_ranks(in_turn, world_size, [(ring_against_all_gather, (COMPARE_SEQ, 1, 4, 16, REPEATS))],
                               timeout=600)[0]  # fmt: skip
    for method, row in compared.items():
        print(f"{world_size} ranks, {method:>10}: {row['bytes sent'] / 2**20:.3f} MiB sent, peak "
              f"{row['peak MiB']:.2f} MiB, {row['seconds'] * 1e3:.1f} ms")  # fmt: skip

# %% [markdown]
# The ring sends 3N - 2 blocks per rank: N - 1 forward, N - 1 again in backward and N gradient blocks. The
# all-gather sends N - 1 blocks each way. So the ring sends more bytes here, not fewer. Its gain is memory at large
# N (N > 2): it holds 2 key/value blocks in forward and 4 in backward, whatever N, where the all-gather holds N
# and 2N. At these sizes the ring's peak is set
# by its unfused block arithmetic instead, and CPU SDPA, which the all-gather calls, is a fused kernel. The ring
# is also slower here, in Python, on a shared CPU, where nothing overlaps for free.
#
# ## 5. The GPT with context parallelism
#
# Three AdamW steps of lesson 13's GPT, whole in one process and split over 2 ranks, on the same batches, in
# float64 without dropout. Then solution 15 on the text.

# %%
calls = [(training_losses, (CONFIG, 2, 3, "zigzag", "ring")), (training_losses, (CONFIG, 2, 3, "zigzag", "all-gather"))]
runs = run_on_ranks(in_turn, 2, calls, timeout=600)[0]
for method, losses in zip(("ring", "all-gather"), runs):
    print(f"{method:>10}: one process {[f'{x:.10f}' for x in losses['one process']]}")
    print(f"{'':>10}  split       {[f'{x:.10f}' for x in losses['context parallel']]}")

# %%
printed = launch("solutions/15_context_parallel.py", *SOLUTION_FLAGS, nproc=2, timeout=1500).stdout
print(printed)

# %% [markdown]
# The split GPT's losses equal the whole one's to the last digit printed. The solution trains on the text: the
# validation loss falls well below ln 256 = 5.55 nats, a uniform guess among 256 bytes.
