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
# # Lesson 03: DistributedDataParallel
#
# The companion notebook of `lessons/03_distributed_data_parallel.md`. It runs on a laptop CPU (gloo) and on a
# GPU machine (NCCL) alike. Training runs go through `torchrun` as a subprocess, exactly as you would launch
# them; what must run inside several processes comes from `common/`, since a spawned process cannot see a
# function defined in a notebook cell.

# %% tags=["parameters"]
import os

QUICK = os.environ.get("COURSE_QUICK") == "1"  # the test suite sets this for a fast run
NPROC = 2  # processes for the training run: one per GPU, or CPU processes
EPOCHS = 1 if QUICK else 5

# %%
import json
import subprocess
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from torch.utils.data import DistributedSampler

REPO = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
print(f"PyTorch {torch.__version__}, {torch.cuda.device_count()} CUDA device(s)")

# %% [markdown]
# ## What torchrun tells each process
#
# `torchrun` starts the processes and hands each one its identity in environment variables. `--no-python` lets
# it start any command, here a shell that prints them:

# %%
# NBVAL_CHECK_OUTPUT
command = [TORCHRUN, "--standalone", "--nproc_per_node=2", "--no-python", "sh", "-c",
           "echo RANK=$RANK LOCAL_RANK=$LOCAL_RANK WORLD_SIZE=$WORLD_SIZE LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE"]
lines = subprocess.run(command, capture_output=True, text=True, check=True).stdout.splitlines()
print("\n".join(sorted(lines)))

# %% [markdown]
# ## DistributedSampler: one shard per rank, padded to divide
#
# Every rank builds the same data set; the sampler picks this rank's indices. Ten samples on three ranks: each
# rank gets four, so two samples appear twice. That padding is harmless in training, and wrong in evaluation
# unless it is dropped (`common.metrics.evaluate` drops it).

# %%
# NBVAL_CHECK_OUTPUT
dataset = list(range(10))
for rank in range(3):
    print(f"rank {rank}:", list(DistributedSampler(dataset, num_replicas=3, rank=rank, shuffle=False)))

# %% [markdown]
# With `shuffle=True` the permutation depends on the seed and the epoch. Without `sampler.set_epoch(epoch)`,
# every epoch repeats epoch 0's order:

# %%
# NBVAL_CHECK_OUTPUT
sampler = DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=True, seed=0)
for epoch in range(3):
    print(f"epoch {epoch}, no set_epoch:  ", list(sampler))
for epoch in range(3):
    sampler.set_epoch(epoch)
    print(f"epoch {epoch}, set_epoch(epoch):", list(sampler))

# %% [markdown]
# ## DDP's constructor broadcasts rank 0's weights
#
# Three processes initialise LeNet with three different seeds. Wrapping the model in DDP copies rank 0's
# parameters to every rank, so the replicas start identical whatever each rank drew.

# %%
# NBVAL_CHECK_OUTPUT
from common.demos import weights_before_and_after_ddp
from common.launch import run_on_ranks

for rank, weights in enumerate(run_on_ranks(weights_before_and_after_ddp, 3)):
    print(f"rank {rank}: before {[round(w, 4) for w in weights['before']]} "
          f"after {[round(w, 4) for w in weights['after']]}")

# %% [markdown]
# ## Training with DDP, launched as you would launch it

# %%
metrics_file = "runs/03_ddp_digits.json"  # relative to the repository, where the command runs
run = subprocess.run([TORCHRUN, "--standalone", f"--nproc_per_node={NPROC}", "solutions/01_ddp_basic.py",
                      "--dataset", "digits", "--epochs", str(EPOCHS), "--metrics-file", metrics_file],
                     capture_output=True, text=True, cwd=REPO)
print("\n".join(line for line in run.stdout.splitlines() if line.startswith(("epoch", "model", str(NPROC)))))
assert run.returncode == 0, run.stderr[-2000:]

# %%
metrics = json.loads((REPO / metrics_file).read_text())
history = metrics["history"]
figure, (loss_axes, accuracy_axes) = plt.subplots(1, 2, figsize=(10, 3.5))
epochs = [h["epoch"] for h in history]
loss_axes.plot(epochs, [h["train_loss"] for h in history], marker="o", label="train")
loss_axes.plot(epochs, [h["test_loss"] for h in history], marker="o", label="test")
loss_axes.set(xlabel="epoch", ylabel="cross-entropy", title="loss, reduced over ranks")
loss_axes.legend()
accuracy_axes.plot(epochs, [h["test_accuracy"] for h in history], marker="o", color="tab:green")
accuracy_axes.set(xlabel="epoch", ylabel="accuracy", title="test accuracy, every sample once")
figure.suptitle(f"LeNet on digits, {metrics['world_size']} processes, {metrics['backend']} on {metrics['device']}")
figure.tight_layout()
plt.show()
print(f"final test accuracy {metrics['final_test_accuracy']:.2%}, {metrics['samples_per_second']:,.0f} samples/s, "
      f"replicas in sync: {metrics['replicas_in_sync']}")
