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
# # Lesson 04: gradient accumulation
#
# The companion notebook of `lessons/04_gradient_accumulation.md`. It shows why the loss is divided, which
# micro-steps all-reduce under `no_sync`, and what that saves. It checks that accumulation follows the path of a
# bigger batch. And it measures the linear learning-rate scaling rule instead of reciting it. Training runs go
# through `torchrun` as subprocesses, as you would launch them.

# %% tags=["parameters"]
import os

QUICK = os.environ.get("COURSE_QUICK") == "1"  # the test suite sets this for a fast run
NPROC = 2
COMPARE_EPOCHS = 1 if QUICK else 3
LR_EPOCHS = 1 if QUICK else 10
LR_NPROC = 1 if QUICK else 2  # one process starts faster; the full run uses 2
LR_BATCH = ["--batch-size", "64"] if QUICK else []  # the quick run: 4 times fewer steps than the default 16

# Where and when this run was made: the outputs below are this machine's, on this date, under this load.
import datetime

from common.reports import machine_summary

print(machine_summary())
print(
    f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, load average {os.getloadavg()[0]:.1f}, "
    f"{'quick' if QUICK else 'full'} settings"
)

# %%
import json
import subprocess
import sys

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from common.launch import REPO, launch
from common.models import LeNet

# %% [markdown]
# ## Why the loss is divided
#
# `.grad` adds up over `backward()` calls. Four micro-batches of 5 samples leave the sum of four mean-loss
# gradients in `.grad`. That is four times the gradient of the 20 samples together. Dividing each micro-step's loss
# by 4 gives the whole batch's gradient, up to float rounding.
#
# ![.grad after each micro-step, with and without dividing the loss](../lessons/figures/04_loss_division.png)

# %%
# NBVAL_CHECK_OUTPUT
generator = torch.Generator().manual_seed(0)
X, y = torch.randn(20, 1, 28, 28, generator=generator), torch.randint(0, 10, (20,), generator=generator)


def accumulated_gradient(micro_batches, divide):
    torch.manual_seed(0)
    model = LeNet()
    for X_micro, y_micro in micro_batches:
        loss = F.cross_entropy(model(X_micro), y_micro)
        (loss / len(micro_batches) if divide else loss).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


whole = accumulated_gradient([(X, y)], divide=True)
micro = list(zip(X.split(5), y.split(5)))
divided, undivided = accumulated_gradient(micro, divide=True), accumulated_gradient(micro, divide=False)
print("divided by 4: equal to the whole batch's gradient:", torch.allclose(divided, whole, atol=1e-6))
print(f"not divided: {undivided.norm() / whole.norm():.2f} times the whole batch's gradient")

# %% [markdown]
# ## Which micro-steps all-reduce
#
# Take k = 4 and an epoch of 10 micro-batches, numbered i = 0 to 9. The cell below prints three rules. The course's
# rule steps after every k-th micro-batch and after the last one. The other two are found in other material. `S`
# marks a micro-step that all-reduces and steps, and `.` marks one inside `no_sync`.


# %%
# NBVAL_CHECK_OUTPUT
def schedule(num_batches, k, steps_after):
    return "".join("S" if steps_after(i, k, num_batches) else "." for i in range(num_batches))


rules = {
    "course: every k-th, and the last": lambda i, k, n: (i + 1) % k == 0 or i == n - 1,
    "i % k == 0 steps (off by one)": lambda i, k, n: i % k == 0,
    "(i + 1) % k == 0 only": lambda i, k, n: (i + 1) % k == 0,
}
for name, rule in rules.items():
    print(f"{name:>34}: {schedule(10, 4, rule)}")

# %% [markdown]
# The second rule steps after the very first micro-batch, i = 0, alone, with a gradient divided by 4. Every later
# group is shifted by one, and i = 9 is never stepped. The third rule never steps on i = 8 and 9. In both, the
# unstepped gradients stay in `.grad` and leak into the next epoch's first step.
#
# ![Three step rules over ten micro-batches, marking which micro-steps step](../lessons/figures/04_group_schedules.png)
#
# ## What no_sync saves
#
# `benchmarks/grad_accumulation.py` counts DDP's all-reduces with a communication hook,
# `common.collectives.AllReduceCounter`. It times an optimizer step of 4 micro-steps, with and without `no_sync`.
# It calls the optimizer step an *effective step*. DDP sends SimpleCNN's gradients in 2 buckets, one all-reduce
# call each. So expect 8 calls per optimizer step without `no_sync`, and 2 with it.
#
# ![Timeline of two ranks over four micro-steps, with and without no_sync](../lessons/figures/04_no_sync_timeline.png)

# %%
print(
    launch(
        "benchmarks/grad_accumulation.py", "--steps", 2 if QUICK else 5, "--rounds", 1 if QUICK else 5, nproc=NPROC
    ).stdout
)

# %% [markdown]
# ## Accumulation follows the path of a bigger batch
#
# This cell trains LeNet, which has no BatchNorm, with 4 micro-batches of 16 per process against plain batches of
# 64 per process, in the same data order. Each printed line gives the epoch, then each run's name and its mean
# training loss. The training losses agree up to the rounding of float sums.

# %%
histories = {}
for name, script, batch_args in [
    ("4 x 16, accumulated", "solutions/02_gradient_accumulation.py", ["--batch-size", 16, "--grad-accum-steps", 4]),
    ("64, plain DDP", "solutions/01_ddp_basic.py", ["--batch-size", 64]),
]:
    metrics_file = REPO / "runs" / f"04_{script.split('/')[1][:2]}.json"
    launch(
        script,
        "--dataset",
        "digits",
        "--epochs",
        COMPARE_EPOCHS,
        *batch_args,
        "--metrics-file",
        metrics_file,
        nproc=NPROC,
    )
    histories[name] = json.loads(metrics_file.read_text())["history"]
for epoch in range(COMPARE_EPOCHS):
    print(
        f"epoch {epoch + 1}: "
        + ", ".join(f"{name}: train loss {history[epoch]['train_loss']:.5f}" for name, history in histories.items())
    )

# %% [markdown]
# ## The linear scaling rule, measured
#
# `benchmarks/lr_scaling.py` trains four times on digits, each for the same number of epochs. The baseline uses 16
# samples per process on 2 processes, so batch 32, at lr 0.05. The other three runs take 4 times the batch through
# accumulation. One keeps the lr, one takes 4 times the lr, and one reaches 4 times the lr by a one-epoch linear
# warm-up.

# %%
results_file = REPO / "runs" / "04_lr_scaling.json"
run = subprocess.run(
    [
        sys.executable,
        "benchmarks/lr_scaling.py",
        "--epochs",
        str(LR_EPOCHS),
        "--nproc",
        str(LR_NPROC),
        *LR_BATCH,
        "--results-file",
        str(results_file),
    ],
    capture_output=True,
    text=True,
    cwd=REPO,
)
print(run.stdout)
assert run.returncode == 0, run.stderr[-2000:]
figure, axes = plt.subplots(figsize=(7, 4))
for result in json.loads(results_file.read_text()):
    epochs = range(1, len(result["test_accuracy"]) + 1)
    axes.plot(
        epochs,
        result["test_accuracy"],
        marker="o",
        label=f"{result['name']} (batch {result['effective_batch']}, lr {result['lr']:.2f})",
    )
axes.set(xlabel="epoch", ylabel="test accuracy", title="same epochs, larger batch: does scaling the lr help?")
axes.legend()
plt.show()
