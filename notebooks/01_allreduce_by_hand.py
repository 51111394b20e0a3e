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
# # Lesson 01: allreduce by hand
#
# The companion notebook of `lessons/01_allreduce_by_hand.md`. Part 1 trains a LeNet data-parallel in one
# process, the way d2l does it from scratch. It uses every GPU there is, or else simulated CPU "devices". Simulated
# devices show that the algorithm is correct, not that it is fast. Part 2 moves to processes. It builds a naive and
# a ring allreduce from point-to-point messages, and times them against `dist.all_reduce`.

# %% tags=["parameters"]
import os

QUICK = os.environ.get("COURSE_QUICK") == "1"  # the test suite sets this for a fast run
NUM_SIMULATED_DEVICES = 2  # used when there are fewer than 2 GPUs
NUM_EPOCHS = 3 if QUICK else 20
BATCH_SIZE, LR = 64, 0.5
NPROC = 4  # processes for the bandwidth benchmark

import datetime

from common.reports import machine_summary

settings = "quick settings (COURSE_QUICK=1)" if QUICK else "full settings"
print(f"{machine_summary()}; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {settings}")

# %%
import inspect

import torch
from d2l import torch as d2l
from IPython.display import Image

from common import scratch
from common.data import load_data
from common.launch import REPO, launch

gpus = torch.cuda.device_count()
if gpus >= 2:
    devices = [torch.device(f"cuda:{i}") for i in range(gpus)]
else:  # several replicas on the one device there is: shows the algorithm is correct, not that it is fast
    devices = [torch.device("cuda:0" if gpus else "cpu")] * NUM_SIMULATED_DEVICES
print(
    f"PyTorch {torch.__version__}; devices: {[str(d) for d in devices]}"
    + ("" if gpus >= 2 else " (simulated: correctness, not speed)")
)

# %% [markdown]
# ## Part 1: one process, several devices
#
# The model is a function of its parameters, so that we can hold one copy of them per device. Each device then
# sums its gradients with the others and takes the same step:
#
# ![One data-parallel step on three devices, allreduce in the middle](../lessons/figures/01_data_parallel_step.png)
#
# The code lives in `common/scratch.py`. Here it is in full.

# %%
for function in (scratch.lenet, scratch.get_params, scratch.allreduce, scratch.split_batch, scratch.train_batch):
    print(inspect.getsource(function))

# %% [markdown]
# `allreduce` sums a list of tensors, one per device, and writes the sum back into each of them:

# %%
# NBVAL_CHECK_OUTPUT
data = [torch.ones(1, 2, device=device) * (i + 1) for i, device in enumerate(devices[:2])]
print("before:", [tensor.tolist() for tensor in data])
scratch.allreduce(data)
print("after: ", [tensor.tolist() for tensor in data])

# %% [markdown]
# ### The in-place pitfall
#
# The list handed to `allreduce` holds the replicas' own `.grad` tensors. Writing the sum into them with
# `data[i][:] = ...` updates the replicas. Assigning it with `data[i] = ...` only rebinds a list slot. Every replica
# but the first then keeps its partial gradient.
#
# ![Writing in place against rebinding a list slot](../lessons/figures/01_in_place_against_rebinding.png)
#
# One step of each:

# %%
# NBVAL_CHECK_OUTPUT
generator = torch.Generator().manual_seed(0)
X, y = torch.randn(16, 1, 28, 28, generator=generator), torch.randint(0, 10, (16,), generator=generator)
for variant in (scratch.allreduce, scratch.all_reduce_by_assignment):
    params = scratch.init_lenet_params(generator=torch.Generator().manual_seed(0))
    device_params = [scratch.get_params(params, device) for device in devices]
    scratch.train_batch(X, y, device_params, devices, lr=0.1, all_reduce=variant)
    identical = all(torch.equal(a, b.to(a.device)) for a, b in zip(device_params[0], device_params[-1]))
    print(f"{variant.__name__:>24}: replicas identical after one step: {identical}")

# %% [markdown]
# ### Training
#
# d2l's recipe: a `Timer`, one `train_batch` per mini-batch, and the accuracy of replica 0 after every epoch. The
# data are scikit-learn's digits, which need no download. `d2l.load_data_fashion_mnist` gives you d2l's original.

# %%
data = load_data("digits")
X_train, y_train = data.train.tensors
X_test, y_test = data.test.tensors


def accuracy(params):
    """Test accuracy of one replica's parameters."""
    with torch.no_grad():
        logits = scratch.lenet(X_test.to(params[0].device), params)
    return (logits.argmax(1).cpu() == y_test).float().mean().item()


def fit(devices, num_epochs, batch_size, lr, all_reduce=scratch.allreduce):
    """Train from the same initial parameters and batch order every time. Returns every replica's parameters,
    replica 0's test accuracy after each epoch, and the seconds per epoch."""
    params = scratch.init_lenet_params(generator=torch.Generator().manual_seed(0))
    device_params = [scratch.get_params(params, device) for device in devices]
    timer, accuracies = d2l.Timer(), []
    for epoch in range(num_epochs):
        timer.start()
        order = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(epoch))
        for batch in order.split(batch_size):
            scratch.train_batch(X_train[batch], y_train[batch], device_params, devices, lr, all_reduce=all_reduce)
        timer.stop()
        accuracies.append(accuracy(device_params[0]))
    return device_params, accuracies, timer.avg()


def train(devices, num_epochs, batch_size, lr):
    _, accuracies, seconds_per_epoch = fit(devices, num_epochs, batch_size, lr)
    d2l.plot(list(range(1, num_epochs + 1)), [accuracies], "epoch", "test accuracy", xlim=[1, num_epochs])
    print(f"test accuracy {accuracies[-1]:.2%}, {seconds_per_epoch:.2f} s/epoch on {len(devices)} device(s)")


train(devices, NUM_EPOCHS, BATCH_SIZE, LR)

# %% [markdown]
# ### The learning rate, measured
#
# `sgd` divides the summed gradient by the batch size, so `lr` scales the mean gradient. From d2l's
# initialisation, with weights drawn at 0.01 scale, the network starts on a plateau at chance accuracy. The
# learning rate decides how soon it leaves it. The same run, with the same batches, at three learning rates:

# %%
for lr in (0.1, LR, 1.0):
    device_params, accuracies, _ = fit(devices, NUM_EPOCHS, BATCH_SIZE, lr)
    above_half = next((epoch for epoch, value in enumerate(accuracies, 1) if value > 0.5), None)
    finite = all(torch.isfinite(param).all() for param in device_params[0])
    print(
        f"lr {lr}: test accuracy {accuracies[-1]:.1%} after {NUM_EPOCHS} epochs, above 50% from epoch "
        f"{above_half}, parameters finite: {finite}"
    )

# %% [markdown]
# ### The in-place pitfall, over a whole run
#
# The same training with `all_reduce_by_assignment`. Replica 0 receives the full sum at every step, and the others
# keep their partial gradients. How far apart do the replicas end, and what does each score?

# %%
device_params, _, _ = fit(devices, NUM_EPOCHS, BATCH_SIZE, LR, all_reduce=scratch.all_reduce_by_assignment)
gap = max((a - b.to(a.device)).abs().max().item() for a, b in zip(device_params[0], device_params[-1]))
print(
    f"by assignment, {len(devices)} replicas, lr {LR}: test accuracy of replica 0 {accuracy(device_params[0]):.1%}, "
    f"of replica {len(devices) - 1} {accuracy(device_params[-1]):.1%}; largest parameter gap {gap:.3g}"
)

# %% [markdown]
# ## Part 2: processes, and allreduce from messages
#
# With one process per device, no process holds all the tensors, so the processes (ranks) must exchange messages.
# Take an allreduce of S bytes over N ranks. The naive way has every rank send to rank 0, and rank 0 send the sum
# back. The ring has every rank send to its right neighbour.
#
# ![Naive allreduce through rank 0 against the ring, 4 ranks](../lessons/figures/01_naive_against_ring.png)
#
# Under naive, rank 0 receives (N-1)·S and sends (N-1)·S: 2(N-1)·S through its link. A ring rank sends
# 2(N-1)/N·S and receives as much, under 2·S each way whatever N is. The table prints rank 0's naive traffic both
# ways, and what one ring rank sends. Halve the naive column to compare one direction with one direction: rank 0
# sends 1, 3, 7, 15 and 63 times S.

# %%
# NBVAL_CHECK_OUTPUT
print(f"{'N':>3} {'naive, rank 0 (x S)':>20} {'ring, every rank (x S)':>23}")
for n in (2, 4, 8, 16, 64):
    print(f"{n:>3} {2 * (n - 1):>20} {2 * (n - 1) / n:>23.3f}")

# %% [markdown]
# Both are in `common/collectives.py`, as `naive_all_reduce` and `ring_all_reduce`. The ring cuts the tensor into
# N chunks. N-1 reduce-scatter steps leave each rank with the complete sum of one chunk. N-1 all-gather steps then
# pass the finished chunks round:
#
# ![The ring allreduce step by step, 4 ranks and 4 chunks](../lessons/figures/01_ring_steps.png)
#
# On 3 processes and a tensor of 10 integer-valued elements, both give exactly what `dist.all_reduce` gives. On
# random floats they match only to rounding, since they may add in another order. 10 does not divide by 3, so the
# ring's chunks differ in size:

# %%
# NBVAL_CHECK_OUTPUT
from common.collectives import hand_made_all_reduces
from common.launch import run_on_ranks

for rank, result in enumerate(run_on_ranks(hand_made_all_reduces, 3)):
    print(f"rank {rank}: naive equal {result['naive']}, ring equal {result['ring']}, first sums {result['sum']}")

# %% [markdown]
# ### Bandwidth
#
# `solutions/07_ring_allreduce.py` checks both again. Then it times them, and reports two rates as nccl-tests
# defines them: algorithm bandwidth is bytes / time, and bus bandwidth is algbw · 2(N-1)/N. Each time is the
# median of single calls, each after a barrier, as the slowest rank saw it. On a CPU the processes share the
# memory bus and the cores. So read the figures as a comparison of algorithms on this machine, not as link speeds.
#
# This cell runs `NPROC` = 4 processes. On a machine with fewer cores than that, two or more processes share each
# core, and the times measure the crowding as much as the algorithms. The output below came from a machine with 2
# cores: its largest size points the way the ring's smaller volume predicts, but it is not a clean measurement.

# %%
sizes = ["4K", "64K", "1M"] if QUICK else ["4K", "64K", "1M", "16M", "64M"]
plot_file = "runs/01_allreduce_bandwidth.png"
print(launch("solutions/07_ring_allreduce.py", "--sizes", *sizes, "--plot", plot_file, nproc=NPROC).stdout)
Image(filename=str(REPO / plot_file))
