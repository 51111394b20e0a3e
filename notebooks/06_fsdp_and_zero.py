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
# # Lesson 06: FSDP2 and ZeRO
#
# The companion notebook of `lessons/06_fsdp_and_zero.md`. It starts with the memory arithmetic. Then it
# measures what each rank really holds under DDP, ZeRO-1 and FSDP2, at world sizes 1, 2 and 4. Then it trains
# FSDP2 against DDP. Last, it resumes a sharded checkpoint saved by 2 processes with another number of them.
#
# The multi-process work runs through `common.launch.run_on_ranks` and `torchrun` subprocesses. Nothing here is
# defined in the notebook and run by a spawned process.

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
WORLD_SIZES = (2,) if QUICK else (1, 2, 4)
MAX_BATCHES = 2 if QUICK else None  # batches per epoch; None: the whole epoch
RESUME_NPROC = 1 if QUICK else 4  # the world size that resumes the 2-process checkpoint

# %%
import shutil
from pathlib import Path

import torch

from common.data import load_data
from common.fsdp import measure_strategies
from common.launch import REPO, launch, run_on_ranks
from common.memory import bytes_per_parameter, zero_bytes_per_rank
from common.models import DeepMLP

# %% [markdown]
# ## The arithmetic: 16 bytes per parameter
#
# Adam keeps four things per parameter: its value, its gradient and two running moments. In fp32 that is
# 4 + 4 + 8 bytes. In the ZeRO paper's mixed precision it is 2 + 2 for the fp16 value and gradient, and 12 in the
# optimizer: an fp32 master copy and the two fp32 moments. DDP replicates all of it on every rank. Each ZeRO stage
# divides one more part by N, the number of ranks.
#
# ![What each of 4 ranks holds under DDP and ZeRO stages 1-3](../lessons/figures/06_who_holds_what.png)

# %%
# NBVAL_CHECK_OUTPUT
print("bytes per parameter:", {precision: bytes_per_parameter(precision) for precision in ("fp32", "mixed")})
num_parameters = sum(p.numel() for p in DeepMLP().parameters())
for name, psi, n, precision, unit in [
    ("DeepMLP", num_parameters, 4, "fp32", 1e6),
    ("ZeRO paper, 7.5 B", 7.5e9, 64, "mixed", 1e9),
    ("LLaMA-70B", 70e9, 4, "mixed", 1e9),
]:
    row = "  ".join(
        f"stage {stage}: {zero_bytes_per_rank(psi, n, stage, precision)['total'] / unit:8.2f}" for stage in range(4)
    )
    print(f"{name:>18} ({precision}, N = {n:2d}), {'MB' if unit == 1e6 else 'GB'} per rank: {row}")

# %% [markdown]
# ## What each rank really holds
#
# `common.fsdp.measure_model_state` builds the default `DeepMLP` and applies a strategy. It takes one Adam step
# and counts the bytes of this rank's parameters, gradients and optimizer states. For a DTensor it counts the
# local shard only. It also counts the parameter bytes that the modules point to between forward and backward: a
# gathered unit whole, a resharded one as its shard. It wraps the model with `shard_model` of
# `solutions/03_fsdp.py`, the script's own code. The "predicted" column is the arithmetic: stage 0
# for DDP, 1 for ZeRO-1, and 3 for both FSDP2 modes, which shard alike at rest.

# %%
PREDICTED_STAGE = {"ddp": 0, "zero1": 1, "fsdp-grad-op": 3, "fsdp-full": 3}
measured = {world_size: run_on_ranks(measure_strategies, world_size, timeout=180) for world_size in WORLD_SIZES}
print(
    f"DeepMLP, {num_parameters:,} parameters, Adam fp32, gloo on CPU: MB held per rank\n"
    f"{'N':>2} {'strategy':>12} | {'parameters':>10} {'gradients':>9} {'optimizer':>9} {'total':>6} (rank 0) | "
    f"{'largest total':>13} {'predicted':>9} | {'after forward':>13}"
)
for world_size, ranks in measured.items():
    for strategy in PREDICTED_STAGE:
        rank0, largest = ranks[0][strategy], max(rank[strategy]["total"] for rank in ranks)
        predicted = zero_bytes_per_rank(num_parameters, world_size, PREDICTED_STAGE[strategy])["total"]
        print(
            f"{world_size:>2} {strategy:>12} | {rank0['parameters'] / 1e6:10.2f} {rank0['gradients'] / 1e6:9.2f} "
            f"{rank0['optimizer'] / 1e6:9.2f} {rank0['total'] / 1e6:6.2f}          | {largest / 1e6:13.2f} "
            f"{predicted / 1e6:9.2f} | {rank0['after_forward'] / 1e6:13.2f}"
        )
for world_size, ranks in measured.items():
    shares = " / ".join(f"{rank['zero1']['optimizer'] / 1e6:.2f}" for rank in ranks)
    print(f"zero1 with N = {world_size}: optimizer MB on ranks 0..{world_size - 1}: {shares}")

# %% [markdown]
# FSDP2 holds 1/N of everything, as stage 3 predicts, up to the rows that do not divide evenly.
#
# ZeRO-1 keeps whole parameters and gradients and splits only the optimizer states. It splits them by *whole
# tensors*: each parameter's states live on one rank. So the ranks' totals straddle the prediction, and a rank's
# share depends on which tensors it drew. With 4 ranks, one of them holds the states of two 512 x 512 block
# weights.
#
# ![ZeRO-1's partition of DeepMLP's tensors over 4 ranks, largest first](../lessons/figures/06_zero1_bins.png)
#
# `fsdp-grad-op` shards like `fsdp-full` between steps. Its "after forward" column shows the price: every block
# stays gathered from its forward to its backward. Under `fsdp-full`, "after forward" is more than 1/N. The root's
# own parameters, the 512 x 784 stem weight and the head, stay gathered, and the next section says why.
#
# "after forward" is not all the memory. FSDP2 keeps each shard while its unit is gathered, and the gathered copy
# comes on top. So a rank's parameter memory is its shards plus every gathered unit whole.
#
# Activations and temporary buffers are not counted here. On a GPU, `torch.cuda.max_memory_allocated` would add
# them, and `measure_model_state` reports it there. No GPU figures have been measured for this notebook.
#
# ## The root: gathered once per step
#
# `fully_shard`'s `reshard_after_forward` defaults to `None`. FSDP2 turns it into `True` for every unit but the
# root, and into `False` for the root. Backward starts with the root's own parameters, the head. So resharding
# them after forward would only gather them again at once.
#
# ![One FSDP2 step unit by unit, with the parameter bytes one rank holds](../lessons/figures/06_fsdp_step.png)
#
# `fsdp-full-root-resharded` forces `True` on the root too, with `set_reshard_after_forward(True, recurse=False)`
# or `fully_shard(model, reshard_after_forward=True)`. `CommDebugMode` counts the all-gathers of one training
# step. "backward start" is the parameter bytes that the modules point to once the head's backward has run.

# %%
mlp = DeepMLP()
root_parameters = sum(p.numel() for module in (mlp.stem, mlp.head) for p in module.parameters())
print(
    f"the root's own parameters (stem and head): {root_parameters:,}, {root_parameters / num_parameters:.0%} of the "
    f"model; {1 + len(mlp.blocks)} units\n"
)
print(
    f"{'N':>2} {'strategy':>24} | {'all-gathers per step':>20} | MB held: {'after forward':>13} {'backward start':>14}"
)
for world_size, ranks in measured.items():
    for strategy in ("fsdp-grad-op", "fsdp-full", "fsdp-full-root-resharded"):
        rank0 = ranks[0][strategy]
        print(
            f"{world_size:>2} {strategy:>24} | {rank0['all_gathers']:>20} | {'':>8} "
            f"{rank0['after_forward'] / 1e6:13.2f} {rank0['backward_start'] / 1e6:14.2f}"
        )

# %% [markdown]
# Forcing the root to reshard saves its bytes only between the forward and the backward, when nothing computes.
# The moment backward begins they are back: the "backward start" columns agree. And the step pays one all-gather
# more, of the root's parameters. They are 28% of this model, since its stem is the largest layer. With one
# process FSDP2 issues no all-gather. It still copies each unit into a whole buffer before the unit computes, and
# the table does not count that copy.
#
# To shard the stem between its forward and its backward, give it a unit of its own, with
# `fully_shard(model.stem)` before the root. That costs one all-gather more in forward and one in backward.
#
# ## FSDP2 trains like DDP
#
# The same script runs with the same seed and data. `--sharding none` is DDP, and `--sharding full` is FSDP2. The
# losses agree to the printed digits. The lesson's tests also check the gradients, and the parameters after
# several Adam steps. The full run saves a sharded checkpoint after its epoch.

# %%
checkpoints = Path("runs/06_checkpoints")  # relative to the repository, where the scripts run
shutil.rmtree(REPO / checkpoints, ignore_errors=True)
steps = ["--max-batches-per-epoch", MAX_BATCHES] if MAX_BATCHES else []
for sharding in ("none", "full"):
    extra = ["--checkpoint-dir", checkpoints] if sharding == "full" else []
    output = launch(
        "solutions/03_fsdp.py", "--dataset", "digits", "--epochs", 1, "--sharding", sharding, *steps, *extra
    ).stdout
    print(
        "\n".join(line for line in output.splitlines() if "epoch 1/1" in line or "rank 0" in line or "sharding" in line)
    )

# %% [markdown]
# ## A checkpoint from 2 processes, resumed by another number of them
#
# Each of the 2 ranks wrote its own shard file. `.metadata` records which slice of which tensor each file holds.
# A run at another world size asks DCP for the slices its own shards cover.
#
# ![A checkpoint written by 2 ranks, one file each, read by 4 ranks](../lessons/figures/06_dcp_reshard.png)
#
# The run loads exactly the saved state, but what follows is another run. `--batch-size` is per process, so the
# steps and their batches differ from the 2-process run's. At the same world size, DeepMLP would go on
# bit-identically. Lesson 06 says what holds for a model with dropout or BatchNorm.

# %%
print(sorted(path.name for path in (REPO / checkpoints / "epoch-0001").iterdir()))
output = launch(
    "solutions/03_fsdp.py",
    "--dataset",
    "digits",
    "--epochs",
    2,
    *steps,
    "--checkpoint-dir",
    checkpoints,
    "--resume",
    nproc=RESUME_NPROC,
).stdout
print(
    "\n".join(line for line in output.splitlines() if "resumed" in line or "epoch 2/2" in line or "process(es)" in line)
)

# %% [markdown]
# ## Export: one plain state dict
#
# At the end the script gathered the whole model into `model_full.pt`. Every rank called `get_model_state_dict`
# with `full_state_dict=True, cpu_offload=True`, and rank 0 wrote the file. It loads into the bare model class,
# with no process group at all:

# %%
model = DeepMLP()
model.load_state_dict(torch.load(REPO / checkpoints / "model_full.pt", weights_only=True))
test = load_data("digits", input_shape=DeepMLP.input_shape).test
X, y = test.tensors
with torch.no_grad():
    accuracy = (model(X).argmax(dim=1) == y).float().mean().item()
print(f"plain DeepMLP from model_full.pt: test accuracy {accuracy:.2%} on {len(y)} digits")
