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
# # Lesson 07: multi-node training, rendezvous and fault tolerance
#
# The companion notebook of `lessons/07_multi_node.md`. Two `torchrun` launchers on this machine play two
# nodes. They meet through c10d rendezvous on 127.0.0.1 and run `solutions/05_multi_node.py` unchanged.
#
# We check who writes the checkpoint. Then we crash a worker on purpose and compare the resumed run with an
# uninterrupted one, bit for bit. Last, we measure the bus bandwidth between the two "nodes". Every run goes
# through `scripts/rehearse_two_nodes.py` as a subprocess, with a deadline.
#
# ![Two nodes of two processes, with RANK, LOCAL_RANK, GROUP_RANK](../lessons/figures/07_two_node_ranks.png)

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
NPROC_PER_NODE = 1 if QUICK else 2  # processes per "node": 2 nodes x 2 = a world of 4 in the full run
EPOCHS = 1 if QUICK else 2
MAX_BATCHES = 4 if QUICK else 12  # batches per epoch on every rank (digits with 4 ranks x 32 has 12)
FAIL_AT = 3 if QUICK else 14  # the step at which the last rank fails, on the first attempt only
SIZES = ["16M"] if QUICK else ["1M", "16M", "64M"]
SHOW_FAILURE = not QUICK  # the test suite proves it (tests/labs/test_05_multi_node.py); it takes 15-20 s

# %%
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common.fault_tolerance import list_checkpoints, read_verified
from common.launch import REPO

WORK = Path(tempfile.mkdtemp(prefix="lesson07-"))
TRAINING = [
    "--dataset",
    "digits",
    "--epochs",
    EPOCHS,
    "--batch-size",
    32,
    "--max-batches-per-epoch",
    MAX_BATCHES,
    "--checkpoint-every",
    4 if not QUICK else 2,
]


def rehearse(*args, launcher=(), check=True):
    """Two torchrun "nodes" on 127.0.0.1 running a repository script; returns the run, prints its own lines."""
    command = [
        sys.executable,
        "scripts/rehearse_two_nodes.py",
        "--nproc-per-node",
        NPROC_PER_NODE,
        "--timeout",
        240,
        *launcher,
        "--",
        *args,
    ]
    run = subprocess.run([str(part) for part in command], cwd=REPO, capture_output=True, text=True, timeout=300)
    if check:
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


def show(
    run,
    keep=(
        "process(es)",
        "epoch ",
        "resumed",
        "identical",
        "rehearsal:",
        "fails on purpose",
        "busbw",
        "dist.all_reduce",
        "skipping",
    ),
):
    """The lines that matter, without torchrun's warnings and the tracebacks of the intended crash."""
    for line in run.stdout.splitlines():
        if any(word in line for word in keep) and "Traceback" not in line and "raise " not in line:
            print(line)


# %% [markdown]
# ## Two nodes, one world
#
# Each launcher is started as it would be on its own machine. Both get `--nnodes 2` and the same
# `--rdzv-endpoint` and `--rdzv-id`. Each "node" gets a checkpoint folder of its own, as if their disks were
# separate, so that we can see who writes. `{node}` in an argument becomes the launcher's number.

# %%
start = time.perf_counter()
reference = rehearse("solutions/05_multi_node.py", *TRAINING, "--checkpoint-dir", WORK / "node{node}" / "ckpt")
show(reference)
print(f"wall time of the two-node rehearsal, launch to exit: {time.perf_counter() - start:.1f} s")

# %% [markdown]
# The rank map shows each global rank with its node rank, `GROUP_RANK`, and its local rank. With c10d, the node
# ranks go to the nodes sorted by address, then by the launcher's process ID. Neither `--node-rank` nor the order
# in which the launchers joined decides it. Both launchers here have the same address, so the one with the lower
# process ID is node 0. On a cluster, it is the node whose host name sorts first.
#
# ![The c10d rendezvous: sorted triples give the node ranks](../lessons/figures/07_c10d_rendezvous.png)
#
# ## Global rank 0 alone writes

# %%
for node in (0, 1):
    folder = WORK / f"node{node}" / "ckpt"
    print(f"launcher {node}'s disk:", sorted(path.name for path in folder.iterdir()) if folder.exists() else "nothing")

# %% [markdown]
# One disk holds the checkpoints: the disk of the node where global rank 0 runs. A "local rank 0" rule would
# have written on both. On shared storage, the two writers would then race for the same file names.
#
# ## Crash and resume
#
# Now the last rank raises an error on reaching step `FAIL_AT`, before computing it, on the first attempt only.
# With `--max-restarts 1`, torchrun stops every worker on both nodes and runs the rendezvous again. Then it starts
# all workers anew. They load the newest valid checkpoint and go on. With `FAIL_AT` 14 and a checkpoint at step 12,
# they take step 13 again, and then step 14 for the first time. The resume line counts epochs from 0.
#
# ![The drill: a crash at step 14, a resume from step 12](../lessons/figures/07_crash_resume_timeline.png)

# %%
drill = rehearse(
    "solutions/05_multi_node.py",
    *TRAINING,
    "--checkpoint-dir",
    WORK / "drill",
    "--fail-at-step",
    FAIL_AT,
    launcher=["--max-restarts", "1"],
)
show(drill)

# %%
writer = next(node for node in (0, 1) if list_checkpoints(WORK / f"node{node}" / "ckpt"))
expected = read_verified(list_checkpoints(WORK / f"node{writer}" / "ckpt")[0])
resumed = read_verified(list_checkpoints(WORK / "drill")[0])
identical = all(torch.equal(resumed["model"][name], expected["model"][name]) for name in expected["model"])
print(f"final step: uninterrupted {expected['step']}, crashed and resumed {resumed['step']}")
print(f"parameters bit-identical (torch.equal on every tensor): {identical}")

# %% [markdown]
# ## Without restarts: the failure ends everything, promptly
#
# A failure again, now at step 3 and with `--max-restarts 0`. torchrun's summary names the failing rank. Node 1's
# agent stops rank 2 as soon as rank 3 fails. Node 0's workers fail by themselves, because gloo tells them that
# their peer closed the connection. No launcher has to be killed.

# %%
if SHOW_FAILURE:
    start = time.perf_counter()
    failed = rehearse(
        "solutions/05_multi_node.py",
        *TRAINING,
        "--checkpoint-dir",
        WORK / "no_restart",
        "--fail-at-step",
        3,
        check=False,
    )
    lines = failed.stdout.splitlines()
    cause = next(i for i, line in enumerate(lines) if "Root Cause" in line)  # torchrun's summary: the first failure
    print(
        f"exit status {failed.returncode} after {time.perf_counter() - start:.1f} s",
        *lines[cause : cause + 6],
        sep="\n",
    )
    print("a launcher had to be stopped:", "rehearsal: stopping" in failed.stdout)

# %% [markdown]
# ## Bandwidth between the nodes
#
# We run one process per "node", so that every byte of the all-reduce crosses between them. Lesson 01's benchmark
# prints two rates for S bytes all-reduced in t seconds over N ranks. algbw is S/t. busbw, nccl-tests' bus
# bandwidth, is S/t x 2(N-1)/N: what each rank's link carries in a ring all-reduce. With N = 2 the two are equal.
# Here the "link" is the loopback interface.

# %%
bandwidth = rehearse(
    "solutions/07_ring_allreduce.py",
    "--algorithms",
    "dist.all_reduce",
    "--sizes",
    *SIZES,
    "--iterations",
    3 if QUICK else 5,
    launcher=["--nproc-per-node", 1],
)
show(bandwidth, keep=("size", "dist.all_reduce", "rehearsal:"))

# %% [markdown]
# ## A rendezvous port in use
#
# The rehearsal checks the port before it starts anything. torchrun with `--rdzv-conf is_host=1` fails at once
# with EADDRINUSE. Without `is_host`, a torchrun whose endpoint another program holds connects to it as a client
# and waits. That is the hang that leads people to `pkill -9 python`.

# %%
import socket  # noqa: E402

with socket.socket() as holder:
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    busy = holder.getsockname()[1]
    refused = subprocess.run(
        [sys.executable, "scripts/rehearse_two_nodes.py", "--port", str(busy), "--", "solutions/05_multi_node.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
print(f"exit status {refused.returncode}: {refused.stderr.strip()}")
