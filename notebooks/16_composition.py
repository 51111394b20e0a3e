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
# # Lesson 16: putting it together
#
# The companion notebook of `lessons/16_composition.md`. It runs three things:
#
# 1. The planner on the small GPT and this machine's measured inputs: the ranking.
# 2. One short run of the GPT on a 2 x 2 mesh against the 1-D FSDP control.
# 3. The planner against measurement, plotted from the committed JSON.
#
# ![The mesh and the order of the functions](../lessons/figures/16_mesh_order.png)
#
# Section 3 reads `results/cpu-amd-epyc-2core/planner_check.json`. It does not rerun the benchmark, which takes
# minutes and needs root.

# %%
from common.reports import run_header

# The date says which run these outputs are; the load says how much other jobs shared the CPU with it.
print(run_header())

# %% tags=["parameters"]
import os

QUICK = os.environ.get("COURSE_QUICK") == "1"  # the test suite sets this for a fast run
STEPS = 3 if QUICK else 8  # steps of each run in section 2
# The GPT of section 2: solution 17's options. The quick run's is tinier.
GPT_OPTIONS = ["--layers", "2", "--d-model", "32" if QUICK else "64", "--context", "32" if QUICK else "64"]
TOP = 8  # rows of the ranking

# %%
import json
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch

from common.launch import REPO, launch
from common.parallelize import differences
from common.planner import Cluster, Config, Training, gpt_model, predict_memory, predict_step_time, rank_configs

CHECK = json.loads((REPO / "results" / "cpu-amd-epyc-2core" / "planner_check.json").read_text())
setup = CHECK["setup"]
cluster = Cluster(**CHECK["inputs"]["cluster"])  # this machine's measured inputs: 2 nodes x 2 processes
print(f"cluster: {cluster.nodes} nodes x {cluster.devices_per_node}, {cluster.flops / 1e9:.1f} GFLOP/s per process")
print(f"intra-node alpha {cluster.intra_alpha * 1e3:.3f} ms, 1/beta {1 / cluster.intra_beta / 1e9:.3f} GB/s")
print(f"inter-node alpha {cluster.inter_alpha * 1e3:.3f} ms, 1/beta {1 / cluster.inter_beta / 1e9:.3f} GB/s")

# %% [markdown]
# ## 1. The planner's ranking for the small GPT
#
# The planner enumerates every mesh of the 4 processes, then keeps those that fit and sorts them by step time.
# The model is the GPT that `benchmarks/planner_check.py` ran: 4 layers of width 128, 64 bytes of context. The
# cluster is what that benchmark measured. Each row is one configuration, fastest first.

# %%
gpt = gpt_model(256, setup["seq"], setup["hidden"], setup["heads"], setup["layers"])  # the GPT as the planner sees it
training = Training(setup["batch"], precision="fp32")
plans = rank_configs(gpt, cluster, training, recompute=("none",), zero_stages=(0, 3))
print(f"{len(plans)} configurations fit; the first {TOP}:")
print(" dp tp pp cp  mb x m zero |  MiB | ms: compute    tp   p2p bubble    dp  total")
for plan in plans[:TOP]:
    c, m, t = plan.config, plan.memory, plan.time
    print(f"{c.dp:>3} {c.tp:>2} {c.pp:>2} {c.cp:>2} {c.micro_batch:>3}x{c.micro_batches:<3} {c.zero:>4} | "
          f"{m['total'] / 2**20:4.1f} | {t['compute'] * 1e3:11.1f} {t['tensor parallel'] * 1e3:5.1f} "
          f"{t['pipeline p2p'] * 1e3:5.1f} {t['bubble'] * 1e3:6.1f} {t['data parallel'] * 1e3:5.1f} "
          f"{t['total'] * 1e3:6.1f}")  # fmt: skip

# %% [markdown]
# Two pipeline stages of 2 data ranks come first here. Their messages are small, and so are this model's
# gradients. A 2 x 2 mesh of data and tensor ranks comes lower: its tensor ranks pay for collectives in every block.
# The planner puts them inside a node. The same planner, asked for one mesh,
# prices the four parts of memory:

# %%
for config in [
    Config(dp=4, micro_batch=4, zero=3),
    Config(dp=2, tp=2, micro_batch=8, zero=3),
    Config(tp=4, micro_batch=16),
]:
    memory = predict_memory(gpt, cluster, training, config)
    time = predict_step_time(gpt, cluster, training, config)
    parts = ", ".join(f"{part} {memory[part] / 2**20:.2f}" for part in ("parameters", "gradients", "optimizer",
                                                                        "activations"))  # fmt: skip
    print(f"{config.describe()}: {time['total'] * 1e3:.0f} ms | MiB: {parts}")

# %% [markdown]
# ## 2. A 2 x 2 mesh against the 1-D FSDP control
#
# Solution 17 runs twice on 4 processes: as 2 data x 2 tensor ranks, then as plain FSDP over all 4. Both see the
# same batches from the same weights. Each run saves its losses and its final parameters, gathered whole.

# %%
runs = {}
with tempfile.TemporaryDirectory() as tmp:
    for name, mesh in {"control": ["--control"], "dp 2 x tp 2": ["--dp", "2", "--tp", "2"]}.items():
        path = Path(tmp) / "run.pt"
        launch("solutions/17_composition.py", *mesh, *GPT_OPTIONS, "--steps", STEPS, "--save", path, nproc=4,
               timeout=300)  # fmt: skip
        runs[name] = torch.load(path, weights_only=True)
for step in range(STEPS):
    print(f"step {step + 1}: " + " | ".join(f"{name} {run['losses'][step]:.6f}" for name, run in runs.items()))
gap = differences(runs["control"], runs["dp 2 x tp 2"])
print(f"largest gap: loss {gap['loss']:.1e}, parameter {gap['parameter']:.1e}")

# %% [markdown]
# The losses agree to the printed digits, or nearly. The gap is fp32 rounding of the same sums in another order.
# The cell above prints the gap and asserts nothing. In float64 with SGD, the tests hold seven meshes of 4
# processes to 1e-12. Four are dp2 x tp2, pp2 x dp2, pp2 x tp2 and HSDP 2 x 2. Three add context parallelism:
# cp2 x dp2, cp2 x tp2 and pp2 x cp2.
#
# ## 3. The planner against measurement
#
# The committed benchmark ran 7 meshes on 2 emulated nodes of 2 processes, joined at 1 Gbit/s. Here are its
# predicted and measured step times and memory, with the error of each.

# %%
rows = CHECK["rows"]
print("config       step ms: predicted measured  error | MiB: predicted measured  error")
for row in rows:
    print(f"{row['config']:<12} {row['predicted_seconds'] * 1e3:17.0f} {row['measured_seconds'] * 1e3:8.0f} "
          f"{row['time_error']:+6.0%} | {row['predicted_bytes'] / 2**20:14.2f} {row['measured_bytes'] / 2**20:8.2f} "
          f"{row['memory_error']:+6.0%}")  # fmt: skip
fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
names = [row["config"] for row in rows]
left.scatter([r["predicted_seconds"] * 1e3 for r in rows], [r["measured_seconds"] * 1e3 for r in rows])
right.scatter([r["predicted_bytes"] / 2**20 for r in rows], [r["measured_bytes"] / 2**20 for r in rows])
for axes, key, scale, unit in ((left, "seconds", 1e3, "ms"), (right, "bytes", 1 / 2**20, "MiB")):
    for row in rows:
        axes.annotate(row["config"], (row[f"predicted_{key}"] * scale, row[f"measured_{key}"] * scale), fontsize=7)
    top = max(max(r[f"predicted_{key}"], r[f"measured_{key}"]) for r in rows) * scale * 1.1
    axes.plot([0, top], [0, top], "k--", lw=0.8)
    axes.set(xlabel=f"predicted ({unit})", ylabel=f"measured ({unit})", xlim=(0, top), ylim=(0, top))
left.set_title("Step time: the dashed line is a perfect prediction")
right.set_title("Memory of the fullest rank")
plt.tight_layout()
plt.show()

# %% [markdown]
# Memory lands near the line. Time lands above it: every mesh ran slower than predicted, six of the seven by more
# than 25%. The lesson's section 4 gives the reasons.
