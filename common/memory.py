"""Memory in one place: the arithmetic of data-parallel training, what a rank really holds, and peak memory.

Training with Adam keeps, for every parameter, its value, its gradient and two optimizer states (the running
mean and mean square of the gradient). In fp32 that is 4 + 4 + 8 = 16 bytes. The ZeRO paper (Rajbhandari et
al., 2019, section 3) counts mixed-precision Adam: fp16 parameters and gradients (2 + 2) and, in the optimizer,
an fp32 master copy of the parameters plus Adam's two fp32 states (4 + 4 + 4 = 12, its "K = 12"): 16 bytes
again. Mixed precision does not shrink this *model state*; it shrinks activations and traffic.

DDP replicates all 16 bytes on every rank. ZeRO divides them by the number of ranks N, in stages:

    stage 0 (DDP)       nothing sharded
    stage 1             optimizer states / N                       (ZeroRedundancyOptimizer)
    stage 2             optimizer states and gradients / N         (FSDP2, reshard_after_forward=False, roughly)
    stage 3             optimizer states, gradients, parameters / N   (FSDP2, reshard_after_forward=True)

``zero_bytes_per_rank`` computes those figures; ``training_state_bytes`` measures what a rank holds, shards of
DTensors included, so that the two can be compared. ``reset_peak_memory`` and ``peak_memory_mib`` measure the
peak a device (or, on a CPU, the process) reached, activations and temporary buffers included.
"""

import sys

import torch
from torch import nn

BYTES_PER_PARAMETER = {
    # fp32 Adam: fp32 value, fp32 gradient, exp_avg and exp_avg_sq in fp32
    "fp32": {"parameters": 4, "gradients": 4, "optimizer": 8},
    # ZeRO's mixed-precision Adam: fp16/bf16 value and gradient; fp32 master weights, exp_avg, exp_avg_sq
    "mixed": {"parameters": 2, "gradients": 2, "optimizer": 12},
}
SHARDED_BY_STAGE = {
    0: (),
    1: ("optimizer",),
    2: ("optimizer", "gradients"),
    3: ("optimizer", "gradients", "parameters"),
}


def bytes_per_parameter(precision: str = "fp32") -> dict:
    """Bytes of model state per parameter for Adam: ``{"parameters", "gradients", "optimizer", "total"}``.

    ``precision`` is ``"fp32"`` (4 + 4 + 8) or ``"mixed"`` (ZeRO's 2 + 2 + 12); both total 16.
    """
    if precision not in BYTES_PER_PARAMETER:
        raise ValueError(f"precision must be one of {sorted(BYTES_PER_PARAMETER)}, not {precision!r}")
    figures = dict(BYTES_PER_PARAMETER[precision])
    return {**figures, "total": sum(figures.values())}


def zero_bytes_per_rank(num_parameters: int, world_size: int, stage: int, precision: str = "fp32") -> dict:
    """Bytes of model state on each of ``world_size`` ranks under ZeRO ``stage`` (0 = DDP, 1, 2 or 3).

    Each sharded part is divided by ``world_size``; the rest is a full replica on every rank. Activations,
    temporary buffers and the all-gathered parameters of the block being computed are not counted.
    Returns ``{"parameters", "gradients", "optimizer", "total"}`` in bytes (floats: shares of a whole).
    """
    if stage not in SHARDED_BY_STAGE:
        raise ValueError(f"stage must be 0, 1, 2 or 3, not {stage!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, not {world_size}")
    per_parameter = bytes_per_parameter(precision)
    figures = {
        part: num_parameters * per_parameter[part] / (world_size if part in SHARDED_BY_STAGE[stage] else 1)
        for part in ("parameters", "gradients", "optimizer")
    }
    return {**figures, "total": sum(figures.values())}


def local_bytes(tensors) -> int:
    """Bytes that this rank stores for ``tensors``: for a DTensor only its local shard, ``None`` counts 0."""
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # DTensor: this rank's shard
        total += local.numel() * local.element_size()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list:
    """Every tensor an optimizer keeps (Adam: ``exp_avg``, ``exp_avg_sq``, ``step``), on this rank.

    ``ZeroRedundancyOptimizer`` keeps the states of this rank's parameters in its local ``optim``.
    """
    inner = getattr(optimizer, "optim", optimizer)
    return [value for state in inner.state.values() for value in state.values() if isinstance(value, torch.Tensor)]


def training_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """What this rank holds of the model state right now: bytes of parameters, gradients and optimizer states.

    Call it after ``optimizer.step()`` and before ``zero_grad``, when all three exist. Under FSDP2 the
    parameters and gradients are DTensors and only the local shard counts; under ZeRO-1 only this rank's
    partition of the optimizer states exists. The gradients are those of the model's parameters and of the
    parameters the (local) optimizer steps, each tensor once: lesson 08's ZeRO-2 keeps its gradient piece on the
    piece it steps, not on the model's parameters.
    """
    parameters = list(model.parameters())
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's and lesson 08's: this rank's share
    stepped = [p for group in local.param_groups for p in group["params"]]
    gradients = {id(p.grad): p.grad for p in [*parameters, *stepped] if p.grad is not None}
    figures = {
        "parameters": local_bytes(parameters),
        "gradients": local_bytes(gradients.values()),
        "optimizer": local_bytes(optimizer_state_tensors(optimizer)),
    }
    return {**figures, "total": sum(figures.values())}


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory measurement on a CUDA device (on a CPU the process peak cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory in MiB: tensors allocated on ``device`` by this process since the last reset (CUDA), or the
    peak resident memory of the whole process since it started (CPU), which includes Python and PyTorch."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource  # Unix only; PyTorch's CPU distributed backends are too

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


def memory_kind(device: torch.device) -> str:
    """What ``peak_memory_mib`` measures on ``device``, for table headers and plot labels."""
    return "CUDA max_memory_allocated" if device.type == "cuda" else "process peak RSS"
