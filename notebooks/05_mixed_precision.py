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
# # Lesson 05: mixed precision
#
# The companion notebook of `lessons/05_mixed_precision.md`. It shows what fp16 and bf16 can hold, and why fp16
# gradients need loss scaling. It shows how `torch.amp.GradScaler` adapts its scale, and why `unscale_` comes
# before clipping. Then it measures what bf16 and fp16 do to training and speed on the machine at hand. Training
# runs go through `torchrun`, as subprocesses.

# %% tags=["parameters"]
import os

QUICK = os.environ.get("COURSE_QUICK") == "1"  # the test suite sets this for a fast run
NPROC = 1 if QUICK else 2  # one process starts faster; the full run uses 2
EPOCHS = 1 if QUICK else 5
MAX_BATCHES = ["--max-batches-per-epoch", 4] if QUICK else []
RUN_PRECISIONS = ("fp32", "bf16") if QUICK else ("fp32", "bf16", "fp16")  # fp16 is slow on most CPUs
# full: SimpleCNN, batch 64 on a CPU (256 on a GPU), fp32, bf16 and fp16, best of 3 rounds
BENCHMARK = ["--model", "lenet", "--batch-size", 16, "--steps", 2, "--rounds", 1, "--precisions", "fp32", "bf16"]
BENCHMARK = BENCHMARK if QUICK else []

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

# %% [markdown]
# ## Three formats
#
# A float is stored in three fields: a sign, an exponent and a mantissa. The exponent sets the range, how large
# and how small a number can get. The mantissa sets the precision, how many significant bits a number keeps. The
# fp16 and bf16 formats both have 16 bits, split differently. The fp16 format keeps precision and gives up range.
# The bf16 format keeps fp32's 8-bit exponent, and so its range, but keeps only 7 mantissa bits.
#
# ![fp32, fp16 and bf16 drawn as rows of sign, exponent and mantissa bits](../lessons/figures/05_float_formats.png)

# %%
# NBVAL_CHECK_OUTPUT
print(f"{'dtype':>8} {'exponent':>8} {'mantissa':>8} {'largest':>10} {'smallest normal':>15} {'eps':>10}")
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    info = torch.finfo(dtype)
    mantissa = round(-torch.log2(torch.tensor(info.eps)).item())  # eps = 2**-mantissa bits
    print(
        f"{str(dtype).split('.')[1]:>8} {info.bits - 1 - mantissa:>8} {mantissa:>8} {info.max:>10.3g} "
        f"{info.tiny:>15.3g} {info.eps:>10.3g}"
    )

# %% [markdown]
# ## fp16 underflow, and what the scale rescues
#
# Below its smallest normal number, 6.1e-5, fp16 still has *subnormals*. They keep fewer and fewer significant
# bits, down to 2**-24, about 6e-8. Conversion rounds to the nearest fp16 number. So values between 3e-8 and 6e-8
# round up to 6e-8, and values below 2**-25, about 3e-8, become 0. Gradients that small are common. The gradient of
# a mean loss is divided by the batch size, and products of small factors get smaller still.
#
# Multiplying the loss by a scale S multiplies every gradient by S. That lifts them back into fp16's range.
# Dividing by S in fp32 afterwards restores their true value. The last column of the table does exactly that:
# times 2**16, rounded to fp16, divided by 2**16.
#
# ![fp16's range on a log axis: a gradient of 1e-8 lost, rescued by the scale](../lessons/figures/05_fp16_range.png)

# %%
# NBVAL_CHECK_OUTPUT
scale = 2.0**16
print(f"{'value':>8} {'as fp16':>11} {'as bf16':>11} {'x scale, fp16, / scale':>24}")
for value in (1e-4, 1e-6, 1e-8, 1e-10):
    x = torch.tensor(value)
    rescued = (x * scale).half().float() / scale
    print(f"{value:>8.0e} {x.half().item():>11.4g} {x.bfloat16().item():>11.4g} {rescued.item():>24.4g}")


def gradient(loss_scale):
    # As under autocast: an fp32 weight cast to fp16 for a product with an fp16 activation, and an fp32 loss.
    w = torch.ones(1, requires_grad=True)
    x = torch.full((1,), 1e-4, dtype=torch.float16)
    loss = ((w.half() * x).float() * 1e-4).sum()  # d(loss)/dw = 1e-8, computed in fp16 in the backward
    (loss * loss_scale).backward()
    return (w.grad / loss_scale).item()


print(f"\ngradient of w, true value 1e-08: unscaled {gradient(1.0):.4g}, with loss scale 2**16 {gradient(scale):.4g}")

# %% [markdown]
# ## The scaler's dynamics
#
# No fixed scale suits a whole training run. Too small, and gradients underflow. Too large, and they overflow to
# inf. `GradScaler` starts high, at 2**16 by default, and adapts. `scaler.step` checks the unscaled gradients for
# inf and NaN. If it finds any, it skips `optimizer.step()`, and `scaler.update()` halves the scale. A fused
# optimizer is called anyway, and skips the update inside its kernel. After
# `growth_interval` steps in a row without one, it doubles the scale. The default interval is 2000 steps. Here it
# is 3, and the scale starts at 1024. Steps 2 and 3 get an inf gradient injected.

# %%
# NBVAL_CHECK_OUTPUT
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
X = torch.randn(8, 4)
print(f"{'step':>4} {'inf injected':>12} {'weights moved':>13} {'scale after':>11}")
for step in range(1, 10):
    optimizer.zero_grad()
    scaler.scale(model(X).square().mean()).backward()
    if step in (2, 3):
        model.weight.grad[0, 0] = float("inf")
    before = model.weight.detach().clone()
    scaler.step(optimizer)
    scaler.update()
    moved = not torch.equal(before, model.weight)
    print(f"{step:>4} {str(step in (2, 3)):>12} {str(moved):>13} {scaler.get_scale():>11g}")

# %% [markdown]
# ## unscale_ before clipping
#
# After `scaler.scale(loss).backward()`, the `.grad` tensors hold S times the gradient. Clipping them to
# `max_norm` bounds S times the gradient. Then `scaler.step` divides by S, and the step is up to S times smaller
# than intended. It is exactly S times smaller when the true gradient would have been clipped too, as here.
# `scaler.unscale_(optimizer)` divides first, so that the clip sees the true gradient. `scaler.step` knows it was
# done, and does not divide again. The scaler here is enabled with fp32 arithmetic. So the right order reproduces
# plain fp32 clipping. The cell compares the steps with `torch.allclose`, so "equals" means equal to within
# rounding.

# %%
# NBVAL_CHECK_OUTPUT
MAX_NORM, LR = 0.5, 0.1
generator = torch.Generator().manual_seed(0)
X, y = torch.randn(32, 20, generator=generator), torch.randint(0, 5, (32,), generator=generator)


def clipped_step(mode):
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 5)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", enabled=mode != "fp32, no scaler")
    applied = []  # the norm of the gradient the optimizer really applies
    optimizer.register_step_pre_hook(
        lambda *_: applied.append(torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item())
    )
    scaler.scale(F.cross_entropy(model(X), y)).backward()
    if mode == "unscale_, then clip":
        scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    scaler.step(optimizer)
    scaler.update()
    return applied[0], torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])


_, reference_update = clipped_step("fp32, no scaler")
for mode in ("fp32, no scaler", "unscale_, then clip", "clip the scaled gradients"):
    norm, update = clipped_step(mode)
    print(
        f"{mode:>26}: gradient norm applied {norm:.4g} (max_norm {MAX_NORM}), "
        f"step equals the fp32 one: {torch.allclose(update, reference_update)}"
    )

# %% [markdown]
# ## bf16 and fp16 training on digits
#
# `solutions/04_mixed_precision.py` trains with `--precision fp32`, `bf16` and `fp16`, with the same seed.
# Evaluation runs in fp32, on the trained weights, which are fp32. The fp16 run prints its loss scale and the steps
# it skipped in each epoch.

# %%
histories = {}
for precision in RUN_PRECISIONS:
    metrics_file = REPO / "runs" / f"05_{precision}.json"
    output = launch(
        "solutions/04_mixed_precision.py",
        "--dataset",
        "digits",
        "--epochs",
        EPOCHS,
        *MAX_BATCHES,
        "--precision",
        precision,
        "--metrics-file",
        metrics_file,
        nproc=NPROC,
    ).stdout
    metrics = json.loads(metrics_file.read_text())
    histories[precision] = metrics["history"]
    print(
        f"{precision}: final accuracy {metrics['final_test_accuracy']:.2%}, {metrics['samples_per_second']:,.0f} "
        f"samples/s, {metrics['skipped_steps']} step(s) skipped, final loss scale {metrics['final_scale']:g}"
    )
    for line in output.splitlines():
        if line.startswith("  loss scale"):  # fp16 only: the scaler's state after each epoch
            print(line)
figure, axes = plt.subplots(figsize=(7, 4))
for precision, history in histories.items():
    axes.plot([row["epoch"] for row in history], [row["test_accuracy"] for row in history], marker="o", label=precision)
axes.set(xlabel="epoch", ylabel="test accuracy", title=f"digits, {NPROC} process(es), same seed")
axes.legend()
plt.show()

# %% [markdown]
# ## Speed and memory, measured
#
# `benchmarks/mixed_precision.py` times training steps of SimpleCNN, in one process per precision. It also counts
# the memory that autograd saves for the backward pass. On a CPU, the speed of bf16 and fp16 depends on the
# instructions the CPU has. On a GPU, the lesson's H100 and H200 runs show that it depends on which fp32 you
# compare with.

# %%
run = subprocess.run(
    [sys.executable, "benchmarks/mixed_precision.py", *map(str, BENCHMARK)], capture_output=True, text=True, cwd=REPO
)
print(run.stdout)
assert run.returncode == 0, run.stderr[-2000:]
