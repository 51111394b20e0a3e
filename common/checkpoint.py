"""Checkpoints that survive a crash: written by global rank 0 alone, atomically, loaded with ``weights_only``.

Atomic means a reader sees either the old file or the new one, never half of one: the bytes go to a
temporary file in the same folder, and ``os.replace`` then swaps it in with one rename.
"""

import inspect
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from common.distributed import is_main


def fixed_buckets() -> dict:
    """``DistributedDataParallel`` arguments under which a resumed run sums its gradients as the uninterrupted one.

    DDP rebuilds its gradient buckets after the first step, in the order gradients arrived. A resumed run's fresh
    wrapper takes its first step with the initial buckets, so a gradient sits at another offset in its bucket, and
    gloo's order of addition over 3 or more ranks depends on that offset (1 ulp in a few parameters). With
    ``bucket_cap_mb_list=[0]`` every bucket closes after its first tensor, before and after the rebuild: one
    parameter per bucket, one all-reduce per tensor. PyTorch releases whose DDP lacks ``bucket_cap_mb_list`` (it is
    recent) get ``find_unused_parameters=True`` instead, which never rebuilds the buckets but makes DDP search the
    graph and warn on every run."""
    if "bucket_cap_mb_list" in inspect.signature(DDP.__init__).parameters:
        return {"bucket_cap_mb_list": [0]}
    return {"find_unused_parameters": True}


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside a ``DistributedDataParallel`` (or ``DataParallel``) wrapper; else the model."""
    return getattr(model, "module", model)


def atomic_write(path, write) -> None:
    """Call ``write(file)`` on a temporary file next to ``path``, then rename it to ``path`` in one step."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Same folder as the target: os.replace is atomic only within one file system.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_checkpoint(path, model: nn.Module, optimizer: torch.optim.Optimizer, epoch: int, step: int) -> None:
    """Save what a run needs to resume: model and optimizer state, finished epochs and optimizer steps.

    Call it on every rank: global rank 0 writes, and a barrier then keeps the others from going on (and maybe
    reading the file) before it exists. Rank 0 alone, not "local rank 0", which would write once per node.
    """
    if is_main():
        state = {"model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch, "step": step}
        atomic_write(path, lambda file: torch.save(state, file))
    if dist.is_initialized():
        dist.barrier()


def load_checkpoint(
    path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, device: torch.device | str = "cpu"
) -> dict:
    """Load a checkpoint into ``model`` (and ``optimizer``) on every rank; return its ``epoch`` and ``step``.

    ``weights_only=True`` refuses to unpickle arbitrary objects, so a checkpoint file can't run code.
    """
    state = torch.load(path, map_location=device, weights_only=True)
    unwrap(model).load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    return {"epoch": state["epoch"], "step": state["step"]}
