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
# The companion notebook of `lessons/03_distributed_data_parallel.md`. Its demos run gloo processes on the CPU,
# wherever the notebook runs. Only the training run uses NCCL, on a machine with a GPU for each of its 2
# processes. With a GPU, one demo also runs `nn.SyncBatchNorm` on it. The training run goes through `torchrun`
# as a subprocess, exactly as you would launch it. What must run inside several processes comes from
# `common/`. A spawned process cannot see a function defined in a notebook cell.

# %% tags=["parameters"]
import os

QUICK = os.environ.get("COURSE_QUICK") == "1"  # the test suite sets this for a fast run
NPROC = 2  # processes for the training run: one per GPU, or CPU processes
EPOCHS = 1 if QUICK else 5

import datetime

from common.reports import machine_summary

settings = "quick settings (COURSE_QUICK=1)" if QUICK else "full settings"
print(f"{machine_summary()}; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {settings}")

# %%
import json
import subprocess

import matplotlib.pyplot as plt
import torch
from torch.utils.data import DistributedSampler

from common.launch import REPO, TORCHRUN, launch

print(f"PyTorch {torch.__version__}, {torch.cuda.device_count()} CUDA device(s)")

# %% [markdown]
# ## What torchrun tells each process
#
# `torchrun` starts the processes and hands each one its identity in environment variables. `RANK` is unique
# over all machines, and `LOCAL_RANK` picks the GPU on this machine:
#
# ![Two nodes of four GPUs each, with every process labelled by its
# RANK and LOCAL_RANK](../lessons/figures/03_ranks_on_two_nodes.png)
#
# `--no-python` lets `torchrun` start any command, here a shell that prints the variables:

# %%
# NBVAL_CHECK_OUTPUT
command = [
    TORCHRUN,
    "--standalone",
    "--nproc_per_node=2",
    "--no-python",
    "sh",
    "-c",
    "echo RANK=$RANK LOCAL_RANK=$LOCAL_RANK WORLD_SIZE=$WORLD_SIZE LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE",
]
lines = subprocess.run(command, capture_output=True, text=True, check=True).stdout.splitlines()
print("\n".join(sorted(lines)))

# %% [markdown]
# ## DistributedSampler: one shard per rank, padded to divide
#
# Every rank builds the same data set, and the sampler picks this rank's indices. It shuffles one permutation,
# pads it with its own first indices, and deals it round-robin:
#
# ![DistributedSampler shuffles ten indices, pads them with the permutation's first two, and deals them round-robin
# to three ranks](../lessons/figures/03_sampler_shards.png)
#
# Below, ten samples on three ranks, unshuffled. Each rank gets four, so two samples appear twice. That padding
# is harmless in training. In evaluation it is wrong unless it is dropped, as `common.metrics.evaluate` does.

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
from common.ddp import weights_before_and_after_ddp
from common.launch import run_on_ranks

for rank, weights in enumerate(run_on_ranks(weights_before_and_after_ddp, 3, timeout=120)):
    print(
        f"rank {rank}: before {[round(w, 4) for w in weights['before']]} "
        f"after {[round(w, 4) for w in weights['after']]}"
    )

# %% [markdown]
# ## DDP's gradient buckets
#
# DDP packs the gradients into a few flat buffers, called buckets, and runs one all-reduce per bucket. A
# bucket's all-reduce starts as soon as its gradients are ready, while backward goes on with earlier layers:
#
# ![A timeline of one DDP step for six layers: in step 1 one all-reduce starts after the whole backward. From step
# 2, bucket 0 travels while layers 1 and 0 still compute](../lessons/figures/03_backward_timeline.png)
#
# Which parameters share a bucket changes after the first step. Six `Linear(256, 256)` layers of 257 KiB each
# train for 2 steps on 2 ranks. A communication hook records every bucket as DDP hands it over for its
# all-reduce, in `common.ddp.ddp_buckets`. It runs three times: with the defaults, with `bucket_cap_mb=0.3`, and
# with `find_unused_parameters=True`. Buckets go in index order, bucket 0 first.

# %%
# NBVAL_CHECK_OUTPUT
from unittest import mock

from common.ddp import ddp_buckets

configurations = {
    "default": {},
    "bucket_cap_mb=0.3": {"bucket_cap_mb": 0.3},
    "find_unused_parameters=True": {"find_unused_parameters": True},
}
# The ranks would warn (on stderr, at random moments) that find_unused_parameters=True found nothing unused:
# here that is the point. PyTorch's C++ side reads this variable when a rank starts.
with mock.patch.dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR"):
    recorded = run_on_ranks(ddp_buckets, 2, configurations, timeout=120)[0]
for name, result in recorded.items():
    print(name)
    for step, buckets in enumerate(result["steps"], start=1):
        for bucket in buckets:
            print(
                f"  step {step}, bucket {bucket['index']}: {bucket['bytes'] / 2**20:.3f} MiB  "
                f"{' '.join(bucket['parameters'])}"
            )

# %% [markdown]
# ![A grid of six layers' weights and biases, coloured by the bucket each travels in, for DDP's defaults, a 0.3 MiB
# cap and find_unused_parameters](../lessons/figures/03_bucket_grid.png)
#
# By default the first step has one bucket of everything. DDP does not know yet in which order the gradients
# come. The next forward rebuilds the buckets in the order the gradients became ready, the last layer first. The
# first bucket closes as soon as it reaches 1 MiB, the value of `torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`.
# Later buckets close at `bucket_cap_mb`, 25 MiB by default. An explicit `bucket_cap_mb` caps the first bucket
# too. With `find_unused_parameters=True`, the buckets are cut from `model.parameters()` in order, the first cut
# at 1 MiB. That cut falls inside layer 3, so its weight and its bias travel in different buckets. The list is
# then reversed, and never rebuilt.

# %% [markdown]
# ## Training with DDP, launched as you would launch it

# %%
metrics_file = "runs/03_ddp_digits.json"  # relative to the repository, where the command runs
output = launch(
    "solutions/01_ddp_basic.py", "--dataset", "digits", "--epochs", EPOCHS, "--metrics-file", metrics_file, nproc=NPROC
).stdout
print("\n".join(line for line in output.splitlines() if line.startswith(("epoch", "model", str(NPROC)))))

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
print(
    f"final test accuracy {metrics['final_test_accuracy']:.2%}, {metrics['samples_per_second']:,.0f} samples/s, "
    f"replicas in sync: {metrics['replicas_in_sync']}"
)

# %% [markdown]
# ## BatchNorm across ranks
#
# One batch of 16 images, the last 8 brighter, is split over two ranks. Each rank runs SimpleCNN's
# convolutional layers once in training mode on its half. With plain BatchNorm, each rank normalises with its
# own half's statistics and folds them into its own running averages. The hand-made synchronized BatchNorm of
# `common/batchnorm.py` all-reduces the statistics first. It matches one process holding the whole batch. The
# cell shows the first BatchNorm's `running_mean` for 3 of its 64 channels. It also shows the largest
# difference from the single process, over all 64 channels.

# %%
# NBVAL_CHECK_OUTPUT
from common.batchnorm import batch_norm_across_ranks, batch_norm_batch
from common.distributed import set_seed
from common.models import SimpleCNN

set_seed(0)
single = SimpleCNN()
single.features(batch_norm_batch())  # one process, all 16 images, training mode
reference = dict(single.named_buffers())
ranks = run_on_ranks(batch_norm_across_ranks, 2, timeout=120)


def show(label, buffers):
    mean, var = buffers["features.1.running_mean"], buffers["features.1.running_var"]
    gap_mean = (mean - reference["features.1.running_mean"]).abs().max().item()
    gap_var = (var - reference["features.1.running_var"]).abs().max().item()
    print(
        f"{label:<26} running_mean[:3] {[round(m, 3) for m in mean[:3].tolist()]}"
        f"   largest gap: mean {gap_mean:.3f}, var {gap_var:.3f}"
    )


show("one process, 16 images", reference)
for kind in ("plain", "synchronized"):
    for rank, result in enumerate(ranks):
        show(f"rank {rank}, {kind}", result[kind]["buffers"])

# %% [markdown]
# The real layer comes from `model = nn.SyncBatchNorm.convert_sync_batchnorm(model)`, before DDP. PyTorch 2.14
# has no CPU implementation of it: on CPU tensors its forward raises `ValueError`. With a CUDA device, the same
# demo runs it too, on the GPU:

# %%
if "sync_batchnorm" in ranks[0]:
    for rank, result in enumerate(ranks):
        show(f"rank {rank}, nn.SyncBatchNorm", result["sync_batchnorm"]["buffers"])
else:
    print("no CUDA device here: nn.SyncBatchNorm not run")

# %% [markdown]
# ## BatchNorm statistics through DDP
#
# The cells above ran BatchNorm without DDP. Through DDP, the running averages meet DDP's handling of buffers.
# With its default `forward_sync_buffers=True`, every training forward starts by broadcasting rank 0's buffers
# to every rank:
#
# ![Two ranks over three steps: each forward starts by copying rank 0's running statistics to rank 1, which then
# folds in its own batch](../lessons/figures/03_batchnorm_buffers.png)
#
# A lone `BatchNorm2d(2)` trains for 3 steps on 2 ranks, each on batches of its own, rank 1's brighter. The code
# is `common.batchnorm.batch_norm_statistics_through_ddp`. Beside each rank's `running_mean` stand the batches
# whose statistics it holds. The cell finds them by comparing the buffers with values computed by hand, in
# `common.batchnorm.running_statistics`.

# %%
# NBVAL_CHECK_OUTPUT
from common.batchnorm import batch_norm_statistics_through_ddp, ddp_batch_norm_batch, running_statistics

STEPS = 3
through_ddp = run_on_ranks(batch_norm_statistics_through_ddp, 2, STEPS, timeout=120)
batches = [[ddp_batch_norm_batch(rank, step) for step in range(STEPS)] for rank in range(2)]
by_hand = {
    "rank 0's 3 batches": running_statistics(batches[0]),
    "rank 1's 3 batches": running_statistics(batches[1]),
    "rank 0's first 2 batches, then rank 1's third": running_statistics(batches[0][:2] + batches[1][2:]),
    "the 3 global batches (both ranks')": running_statistics([torch.cat(pair) for pair in zip(*batches)]),
}


def holds(buffers):
    """The hand-computed statistics that these BatchNorm buffers equal."""
    return next(
        (
            name
            for name, (mean, var) in by_hand.items()
            if torch.allclose(buffers["running_mean"], mean) and torch.allclose(buffers["running_var"], var)
        ),
        "none of these",
    )


for variant in ("forward_sync_buffers=True", "forward_sync_buffers=False", "synchronized (common/batchnorm.py)"):
    print(variant)
    for rank, result in enumerate(through_ddp):
        trained = result[variant]["trained"]
        print(
            f"  rank {rank} after training: running_mean {[round(m, 3) for m in trained['running_mean'].tolist()]}"
            f" = {holds(trained)}"
        )
    for rank, result in enumerate(through_ddp):
        print(f"  rank {rank} evaluating through DDP uses: {holds(result[variant]['evaluated_through_ddp'])}")
print("nn.SyncBatchNorm in DDP on CPU:", through_ddp[0]["sync_batchnorm_on_cpu"])

# %% [markdown]
# With the default, rank 0 keeps the statistics of its own shard. Rank 1 keeps those of rank 0, moved by its own
# last batch. `solutions/01_ddp_basic.py` evaluates through the DDP wrapper, with
# `common.metrics.evaluate(net, ...)`. That evaluation starts with the broadcast, so every rank evaluates with
# rank 0's statistics. The checkpoint holds the same ones. Only synchronized BatchNorm gives every rank the
# statistics of the global batches.

# %% [markdown]
# ## Uneven inputs: the failure, and Join
#
# Rank 0 has 4 batches, rank 1 has 3. Without `Join`, rank 0's fourth backward starts a gradient all-reduce that
# rank 1 never runs. Rank 1 has moved on to `replicas_in_sync`, which runs all-reduces of its own:
#
# ![Without Join, rank 0's fourth gradient all-reduce pairs with rank 1's replicas_in_sync and fails, while with Join
# rank 1 answers it with zeros](../lessons/figures/03_collectives_pair_by_order.png)
#
# The deadline of 60 s is only a safety net. What happens first is below.

# %%
import time

from common.ddp import train_on_uneven_inputs

start = time.monotonic()
try:
    run_on_ranks(train_on_uneven_inputs, 2, False, timeout=60)
except (RuntimeError, TimeoutError) as error:
    print(f"without Join: {type(error).__name__} after {time.monotonic() - start:.1f} s, process start included")
    print(str(error).strip().splitlines()[-1].split(" This is")[0])  # the last line, without gloo's advice
else:
    print("without Join: no error")  # not what PyTorch 2.14 does; the lesson would need updating

# %% [markdown]
# Collectives pair up by their order, not by their meaning. gloo paired rank 1's all-reduce of its parameters,
# in float64, with rank 0's all-reduce of its gradients, in float32. It found sizes that differ, and aborted
# rank 0. The `terminate called ... collective mismatch` lines come from rank 0. Rank 1 then lost its peer: that
# is the `RuntimeError`. Had the two all-reduces had the same size, nothing would have failed. Both ranks would
# have carried on with wrong numbers, as the course's tests show.
#
# With `with Join([model]):` around the loop, rank 1 answers rank 0's last gradient all-reduce with zeros, and
# both ranks leave with the same parameters:

# %%
# NBVAL_CHECK_OUTPUT
for rank, result in enumerate(run_on_ranks(train_on_uneven_inputs, 2, True, timeout=120)):
    print(f"with Join, rank {rank}: {result['steps']} steps, replicas in sync: {result['in_sync']}")
