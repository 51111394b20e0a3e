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
# # Lesson 02: DataParallel, and why the course uses DDP instead
#
# The companion notebook of `lessons/02_data_parallel.md`. It opens `nn.DataParallel`'s forward pass into its
# four steps and runs them by hand. Without GPUs it runs them on CPU "devices", which shows what is computed but
# not how fast. Then it runs `solutions/08_dp_vs_ddp.py`. That script measures DataParallel against DDP on the
# same model, data and global batch. DataParallel needs 2 or more GPUs. With fewer, the script measures DDP alone
# and says so.

# %% tags=["parameters"]
import os

QUICK = os.environ.get("COURSE_QUICK") == "1"  # the test suite sets this for a fast run
NPROC = 2  # DDP processes in the comparison (on a GPU machine: the number of GPUs to compare on)
MODEL = "lenet"  # the lesson's CPU command; on a machine with GPUs, try "simplecnn" too
STEPS = 3 if QUICK else 20

import datetime

from common.reports import machine_summary

settings = "quick settings (COURSE_QUICK=1)" if QUICK else "full settings"
print(f"{machine_summary()}; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {settings}")

# %%
import platform
from pathlib import Path

import torch
import torch.nn.functional as F
from IPython.display import Image, Markdown, display
from torch import nn

from common.data_parallel import data_parallel_forward
from common.launch import REPO, launch
from common.models import LeNet

GPUS = torch.cuda.device_count()


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux): the record of where the figures below come from."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.machine()


print(f"PyTorch {torch.__version__}, {GPUS} CUDA device(s), {os.cpu_count()} CPU core(s): {cpu_name()}")

# %% [markdown]
# ## One forward pass, four steps
#
# ![DataParallel on four GPUs: scatter, replicate, parallel apply, gather](../lessons/figures/02_dp_forward.png)
#
# `nn.DataParallel(model)(X)` does four things. It scatters `X` into one chunk per GPU, from any device, the CPU
# included. It replicates the model from GPU 0 to the other GPUs. It runs the replicas in parallel threads, and it
# gathers the outputs on GPU 0. Scatter, replicate and gather are autograd operations, so `backward()` sums every
# replica's gradient into the original parameters. For LeNet, which has no BatchNorm, the result is the gradient
# of the whole batch, up to floating-point rounding.
#
# `common.data_parallel` writes the same four steps out. With fewer than 2 GPUs, the cell below runs them on two
# CPU "devices", both `"cpu"`. There `tensor.to("cpu")` returns the tensor itself, so both replicas share the
# original parameters and nothing is copied. The cell then shows the split and the sum of the two chunks'
# gradients, not the copies. The tests run the same code on `"cpu:0"` and `"cpu:1"`, where the copies are real.

# %%
# NBVAL_CHECK_OUTPUT
devices = ["cuda:0", "cuda:1"] if GPUS >= 2 else ["cpu", "cpu"]  # two replicas: the same output everywhere
torch.manual_seed(0)
model = LeNet().to(devices[0])
generator = torch.Generator().manual_seed(0)
X, y = torch.randn(10, 1, 28, 28, generator=generator), torch.randint(0, 10, (10,), generator=generator)


def gradients(forward):
    model.zero_grad()
    F.cross_entropy(forward(X), y.to(devices[0])).backward()
    return [p.grad.clone() for p in model.parameters()]


chunk_sizes = []
hook = model.register_forward_pre_hook(lambda module, args: chunk_sizes.append(len(args[0])))
by_hand = gradients(lambda X: data_parallel_forward(model, X, devices))
hook.remove()
whole_batch = gradients(lambda X: model(X.to(devices[0])))
print(f"{len(X)} samples on {len(devices)} replicas: chunks of {sorted(chunk_sizes, reverse=True)}")
print(
    "gradients equal to the whole batch's:", all(torch.allclose(a, b, atol=1e-6) for a, b in zip(by_hand, whole_batch))
)

# %% [markdown]
# The batch you hand DataParallel is the *global* batch. Each of N GPUs gets about 1/N of it, in the chunk sizes
# of `torch.chunk`. Without GPUs, DataParallel splits nothing. It calls the module once, on the whole batch.

# %%
if GPUS == 0:
    sizes = []
    linear = nn.Linear(4, 2)
    linear.register_forward_pre_hook(lambda module, args: sizes.append(len(args[0])))
    net = nn.DataParallel(linear)
    net(torch.randn(6, 4))
    print(f"no GPU: device_ids={net.device_ids}, the module saw batches of {sizes}")
else:
    print(f"{GPUS} GPU(s): DataParallel would split each batch over device_ids={list(range(GPUS))}")

# %% [markdown]
# ## DataParallel against DDP, measured
#
# ![DataParallel: one process and one GIL. DDP: a process per GPU](../lessons/figures/02_one_process_against_ddp.png)
#
# `solutions/08_dp_vs_ddp.py` runs DDP on `NPROC` processes. Then it runs DataParallel on as many GPUs, in one
# process, with the same global batch. On a machine with fewer GPUs than that, it measures DDP alone. It writes
# down why DataParallel was skipped, and no figure in the table is made up.

# %%
results_dir = "runs/02_dp_vs_ddp"  # relative to the repository, where the command runs
print(
    launch(
        "solutions/08_dp_vs_ddp.py", "--model", MODEL, "--steps", STEPS, "--results-dir", results_dir, nproc=NPROC
    ).stdout
)

# %%
display(Markdown((REPO / results_dir / "results.md").read_text()))
display(Image(filename=str(REPO / results_dir / "results.png")))
