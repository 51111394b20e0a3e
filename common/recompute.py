"""Activation recomputation (lesson 13): keep a block's input, not its activations, and run its forward again in
backward. Also called activation checkpointing.

A block's activations cost memory from its forward until its backward. Recomputation trades that memory for time:
forward runs without keeping anything but the block's input, and backward first runs the block's forward again,
this time keeping what its gradients need, then goes backward through it. The gradients are the same, bit for bit,
provided the second forward computes the same numbers. Dropout draws random masks, so the random state at the
first forward is kept and put back for the second (Chen et al. 2016, "Training Deep Nets with Sublinear Memory
Cost"; Korthikanti et al. 2022, section 5).

Three ways, from the bottom up:

- ``Recompute``, by hand: an ``autograd.Function`` whose forward runs the block under ``torch.no_grad()`` and saves
  its input and the random state, and whose backward restores the state, runs the forward again with gradients on,
  and calls ``torch.autograd.backward`` through it. This is how ``torch.utils.checkpoint``'s reentrant variant works.
- ``torch.utils.checkpoint.checkpoint(block, X, use_reentrant=False)``: PyTorch's full recomputation. It keeps
  the input and replaces every tensor autograd would save inside by a placeholder that a recomputation refills.
- Selective recomputation: the same call with ``context_fn=create_selective_checkpoint_contexts(policy)``. The
  policy says, operation by operation, whether to keep its output or to recompute it. ``keep_matmuls`` keeps the
  outputs of the linears' matrix products and recomputes the rest: norms, GELU, dropout and the attention core,
  whose scores and probabilities grow with the square of the sequence length while costing few FLOPs.

``apply_recomputation(model, mode)`` wraps each of a model's ``blocks`` in ``RecomputedBlock`` (torchtitan applies
its activation checkpointing the same way: a function that wraps the blocks, after tensor parallelism).
"""

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

RECOMPUTE_MODES = ("none", "by-hand", "full", "selective")


class Recompute(torch.autograd.Function):
    """``function(X)``, keeping only ``X`` and the random state for backward; backward runs ``function`` again.

    ``function`` takes one tensor and returns one. Its parameters (a module's) get their gradients during the
    recomputed backward, as if no recomputation had happened.
    """

    @staticmethod
    def forward(ctx, function, X):
        # BEGIN LAB: forward: keep X and the random state, run the function without a graph
        # random_state(device) gives the state; ctx.save_for_backward keeps a tensor; torch.no_grad() records nothing
        ctx.function = function
        ctx.random_state = random_state(X.device)  # the dropout masks of the second forward must be these
        ctx.save_for_backward(X)  # the only activation kept
        with torch.no_grad():  # nothing inside is saved for backward: its memory is freed as forward goes
            return function(X)
        # END LAB

    @staticmethod
    def backward(ctx, grad_output):
        # BEGIN LAB: backward: put the random state back, run forward again, backward through it
        # X.detach().requires_grad_() makes a new leaf; torch.random.fork_rng() restores the state afterwards;
        # set_random_state(state, device); torch.enable_grad(); torch.autograd.backward(output, grad_output)
        (X,) = ctx.saved_tensors
        X = X.detach().requires_grad_(X.requires_grad)  # a new leaf: its .grad is the gradient to return
        with torch.random.fork_rng(devices=[X.device] if X.device.type == "cuda" else []):  # restored after
            set_random_state(ctx.random_state, X.device)
            with torch.enable_grad():
                output = ctx.function(X)
        torch.autograd.backward(output, grad_output)  # the parameters' .grad accumulate here
        return None, X.grad  # one gradient per input of forward: none for the function
        # END LAB


def random_state(device: torch.device) -> tuple:
    """The random state that dropout on ``device`` draws from: the CPU generator's, and the GPU's on CUDA."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def set_random_state(state: tuple, device: torch.device) -> None:
    """Put back what ``random_state`` returned."""
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def recompute(function, X: torch.Tensor) -> torch.Tensor:
    """``function(X)`` through ``Recompute``: only ``X`` is kept for backward."""
    return Recompute.apply(function, X)


# The linears' matrix products: addmm with a bias, mm without. The attention's own products are bmm, recomputed.
KEPT_BY_SELECTIVE = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


def keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective recomputation's policy: keep the output of every linear's matrix product, recompute the rest
    (the attention core among it). ``MUST_SAVE`` rather than ``PREFER_SAVE``: no compiler may override it."""
    return CheckpointPolicy.MUST_SAVE if op in KEPT_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


class RecomputedBlock(nn.Module):
    """``block``, recomputed in backward as ``mode`` says: ``"by-hand"`` (``Recompute``), ``"full"`` (torch's
    ``checkpoint``), ``"selective"`` (torch's, with ``keep_matmuls``) or ``"none"`` (the block as it is)."""

    def __init__(self, block: nn.Module, mode: str):
        super().__init__()
        if mode not in RECOMPUTE_MODES:
            raise ValueError(f"recompute mode {mode!r}: choose one of {', '.join(RECOMPUTE_MODES)}")
        self.block, self.mode = block, mode

    def forward(self, X):
        if self.mode == "none" or not torch.is_grad_enabled():
            return self.block(X)
        if self.mode == "by-hand":
            return recompute(self.block, X)
        if self.mode == "full":
            return checkpoint(self.block, X, use_reentrant=False)
        return checkpoint(
            self.block,
            X,
            use_reentrant=False,
            context_fn=functools.partial(create_selective_checkpoint_contexts, keep_matmuls),
            respect_saved_tensors_hooks=True,  # what it keeps passes saved_tensors_hooks, as saved tensors do
        )


def apply_recomputation(model: nn.Module, mode: str) -> nn.Module:
    """Wrap each of ``model.blocks`` (an ``nn.ModuleList``) in ``RecomputedBlock(block, mode)``; returns ``model``.
    Apply it after tensor or sequence parallelism has split the blocks."""
    for index, block in enumerate(model.blocks):
        model.blocks[index] = RecomputedBlock(block, mode)
    return model
