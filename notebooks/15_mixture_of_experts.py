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
# # Lesson 15: mixture of experts and expert parallelism
#
# The companion notebook of `lessons/15_mixture_of_experts.md`. It replaces the MLP of lesson 13's GPT with a
# mixture of experts and measures what that changes:
#
# 1. The layer against a loop over tokens, gradients included.
# 2. Tokens per expert over training, with and without the balancing loss.
# 3. Tokens dropped against the capacity factor.
# 4. Step time against the dense MLP.
# 5. Expert parallelism on two processes, against the one-process layer.
#
# ![Tokens sent to their experts' ranks and back](../lessons/figures/15_all_to_all.png)
#
# Every figure is measured on the machine that ran the notebook. The functions it calls live in
# `common/experiments/moe.py`. `common.launch.run_on_ranks` starts the processes of section 5.

# %%
from common.reports import run_header

# The date says which run these outputs are; the load says how much other jobs shared the CPU with it.
print(run_header())

# %% tags=["parameters"]
import os

QUICK = os.environ.get("COURSE_QUICK") == "1"  # the test suite sets this for a fast run
WORLD_SIZE = 2
# Solution 16's defaults: width 64, 4 heads, 2 layers, 64 bytes of context, no dropout; the quick run's is tinier.
if QUICK:
    CONFIG = dict(context=16, d_model=16, num_heads=2, num_layers=2, dropout=0.0)
else:
    CONFIG = dict(context=64, d_model=64, num_heads=4, num_layers=2, dropout=0.0)
NUM_EXPERTS, TOP_K = 4, 1  # Switch's routing: one expert per token
BATCH = 4 if QUICK else 16  # sequences per step
STEPS = 5 if QUICK else 200  # training steps of each run in section 2
ALPHAS = [0.0, 0.01]  # the balancing loss's weight on the layers' mean: none, and 0.01
FACTORS = [0.5, 0.75, 1.0, 1.25, 1.5, 2.0]  # capacity factors of section 3
VARIANTS = [(4, 1), (8, 1), (4, 2)]  # (experts, top-k) timed in section 4
REPEATS = 2 if QUICK else 20  # timed steps of each (the first two left out)

# %%
import matplotlib.pyplot as plt
import torch

from common.experiments.moe import (
    dropped_by_capacity,
    expert_parallel_checks,
    plot_dropped,
    plot_tokens_per_expert,
    step_times,
    train_routing,
)
from common.launch import run_on_ranks
from common.moe import MoE, moe_by_loop
from common.text import load_text

text = load_text(context=CONFIG["context"])
print(f"text: {text.source}, {text.num_bytes:,} bytes")
print(f"{len(text.train):,} training windows of {text.context} bytes")

# %% [markdown]
# ## 1. The layer against a loop over tokens
#
# `MoE` sorts the assignments by expert and runs each expert once. `moe_by_loop` takes one token and one chosen
# expert at a time. Their gradients must be the same, of the input and of every parameter, with and without
# dropping.

# %%
for top_k, factor in [(1, None), (2, None), (2, 0.75)]:
    torch.manual_seed(0)
    moe = MoE(8, 4, top_k, hidden=16, capacity_factor=factor).double()
    X = torch.randn(3, 7, 8, dtype=torch.float64, requires_grad=True)
    moe(X).square().sum().backward()
    fast = [X.grad.clone(), *(p.grad.clone() for p in moe.parameters())]
    dropped = moe.routing.dropped
    X.grad = None
    moe.zero_grad()
    moe_by_loop(moe, X).square().sum().backward()
    slow = [X.grad, *(p.grad if p.grad is not None else torch.zeros_like(p) for p in moe.parameters())]
    difference = max((a - b).abs().max().item() for a, b in zip(fast, slow))
    print(f"top-{top_k}, capacity {factor}: {dropped} of {21 * top_k} dropped, gradients off by {difference:.0e}")

# %% [markdown]
# ## 2. Tokens per expert over training
#
# The same GPT, trained twice on the text: without the balancing loss, and with a weight of 0.01. That weight
# multiplies the mean of the 2 layers' balancing losses: 0.005 per layer, half of Switch's 0.01 per layer.
# Each step records how many tokens of the batch the
# first layer's router sent to each expert.

# %%
runs = [train_routing(text, CONFIG, NUM_EXPERTS, TOP_K, alpha, STEPS, BATCH) for alpha in ALPHAS]
EVERY = max(1, STEPS // 20)
for run in runs:  # the share of each expert, every EVERY steps: the picture of the lesson reads these lines
    for step in range(0, STEPS, EVERY):
        counts = run["steps"][step]["counts"]
        print(f"weight {run['alpha']}, step {step:>3}: " + " ".join(f"{c / sum(counts):.3f}" for c in counts))
for run in runs:
    last = run["steps"][-20:]
    share = torch.tensor([row["counts"] for row in last], dtype=torch.float64).sum(0)
    share = share / share.sum()
    print(
        f"weight {run['alpha']}: last 20 steps, layer 1's experts took "
        + " ".join(f"{s:.0%}" for s in share.tolist())
        + f" | balancing loss {sum(row['balance'] for row in last) / len(last):.3f}, "
        f"language-model loss {sum(row['loss'] for row in last) / len(last):.3f}"
    )
fig, axes = plt.subplots(1, len(runs), figsize=(10, 3.2), sharey=True)
plot_tokens_per_expert(runs, axes)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 3. Tokens dropped against the capacity factor
#
# Each trained router is given one batch, at capacity factors from 0.5 to 2. A factor of 1 is an even share.

# %%
dropped = {f"weight {run['alpha']}": dropped_by_capacity(run["model"], text, FACTORS, BATCH) for run in runs}
print("capacity factor: " + " ".join(f"{factor:>6}" for factor in FACTORS))
for name, rows in dropped.items():
    print(f"{name:<16}: " + " ".join(f"{row['dropped']:>6.1%}" for row in rows))
fig, ax = plt.subplots(figsize=(5.5, 3.2))
plot_dropped(dropped, ax)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 4. Step time against the dense MLP
#
# One forward and backward in one process. Each expert is as wide as the dense MLP, so top-1 does the same matrix
# work per token.

# %%
times = step_times(CONFIG, VARIANTS, BATCH, REPEATS)
for name, row in times.items():
    print(
        f"{name:<18} {row['ms']:7.1f} ms | {row['parameters']:>9,} parameters, {row['active']:>9,} active "
        f"| {row['ms'] / times['dense']['ms']:.2f} x dense"
    )

# %% [markdown]
# ## 5. Expert parallelism on two processes
#
# Each rank holds its own tokens (3 on rank 0, 7 on rank 1) and half the experts. No token chooses the last
# expert. The split layer must equal the one-process layer on all the tokens, and send the bytes of the formula.

# %%
checks = run_on_ranks(expert_parallel_checks, WORLD_SIZE, timeout=300)
print(f"tokens per expert, all ranks: {checks[0]['tokens per expert']}")
for rank, check in enumerate(checks):
    print(
        f"rank {rank}: output off by {check['output']:.1e}, input gradient by {check['input gradient']:.1e}, "
        f"experts' gradients by {max(check['experts'].values()):.1e}, router's (summed) by {check['router']:.1e}"
    )
    print(
        f"  sent {check['sent']} rows, received {check['received']} | all-to-alls: {len(check['calls'])} calls, "
        f"{check['bytes']:,} bytes, formula {check['formula']:,}"
    )
    rows, gradient = check["torch's rows"], check["torch's gradient"]
    print(f"  round trip exact: {check['round trip']}; torch's all_to_all_single: same rows {rows}, grads {gradient}")
