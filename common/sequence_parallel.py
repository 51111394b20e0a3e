"""Sequence parallelism (lesson 13): Megatron-LM's cut of the activations that tensor parallelism leaves whole.

Tensor parallelism (lesson 12, ``common.tensor_parallel``) splits the attention and the MLP, but the layer norms,
the dropouts after each block and the residual additions run on the whole ``(batch, seq, h)`` activation on every
rank: each rank keeps the same copy of those activations. Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", https://arxiv.org/abs/2205.05198, section 4.2.2) cut them along the
sequence instead: rank r of t holds tokens ``r s/t`` to ``(r + 1) s/t`` there. Those operations work token by
token, so each rank runs them on its own tokens alone.

Tensor parallelism's two all-reduces per block then become two conjugate collectives, written here as autograd
functions (the paper's g and g-bar):

- ``GatherFromSequenceParallel``: all-gather along the sequence in forward, before the column-parallel linear,
  which needs every token; reduce-scatter in backward, which sums the ranks' partial gradients (as lesson 12's
  ``f`` did) and leaves each rank its tokens' share.
- ``ReduceScatterToSequenceParallel``: reduce-scatter in forward, after the row-parallel linear: the sum of the
  ranks' partial results, each rank keeping its own tokens; all-gather in backward.

An all-reduce is a reduce-scatter followed by an all-gather, so a ring moves the same bytes either way. What each
rank keeps shrinks: the norms' inputs, the dropout masks and the residual sums are 1/t of the sequence.

Two details make it exact:

- The replicated parameters (embeddings, norms, the row-parallel biases, the head) now see only this rank's tokens,
  so their gradients are partial sums: ``all_reduce_replicated_gradients`` adds them over the group after backward
  (Megatron does the same for its ``sequence_parallel`` parameters).
- The column-parallel linear keeps its input for its weight's gradient. Keeping the gathered input costs a whole
  ``(batch, seq, h)`` tensor per linear that reads it; ``GatherThenLinear`` keeps this rank's shard instead and
  gathers it again in backward, as Megatron-LM does: activations exactly 1/t, for one more all-gather per such
  linear in backward (``regather=True``).

torch's version is ``parallelize_gpt``: ``SequenceParallel`` on the norms, ``PrepareModuleInput`` to gather before
the attention and the MLP, ``RowwiseParallel(output_layouts=Shard(1))`` to reduce-scatter after them, and a
vocabulary-parallel head whose loss ``torch.distributed.tensor.parallel.loss_parallel`` computes without ever
gathering the logits.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from common.collectives import all_gather_into, reduce_scatter_into
from common.gpt import GPT
from common.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelMLP,
    TensorParallelSelfAttention,
    attend,
    maybe_dropout,
    shard_block,
)


def sequence_range(seq: int, rank: int, world_size: int) -> slice:
    """The positions that rank ``rank`` of ``world_size`` holds of a sequence of ``seq`` tokens. A sequence that
    does not divide by the ranks is a ``ValueError``: every rank must hold as many tokens, for the collectives."""
    if seq % world_size:
        raise ValueError(
            f"a sequence of {seq} tokens does not divide by the {world_size} sequence-parallel ranks: "
            f"use a sequence length that is a multiple of {world_size}"
        )
    size = seq // world_size
    return slice(rank * size, (rank + 1) * size)


def all_gather_sequence(shard: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's ``(batch, seq / t, h)`` shard side by side along the sequence: ``(batch, seq, h)``, the same on
    every rank of ``group``. One all-gather (rank r's shard becomes rows r b to (r + 1) b, then the sequence is put
    back in order)."""
    world_size = dist.get_world_size(group)
    gathered = shard.new_empty((world_size * shard.shape[0], *shard.shape[1:]))
    all_gather_into(gathered, shard.contiguous(), group=group)
    return torch.cat(gathered.chunk(world_size), dim=1)


def reduce_scatter_sequence(partial: torch.Tensor, group=None) -> torch.Tensor:
    """The sum over ``group`` of every rank's ``(batch, seq, h)`` ``partial``, of which this rank keeps its own
    tokens: ``(batch, seq / t, h)``. One reduce-scatter (the sequence's chunks stacked first, rank r's r-th)."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    sequence_range(partial.shape[1], rank, world_size)  # the ValueError, before any collective
    stacked = torch.cat(partial.chunk(world_size, dim=1), dim=0)
    shard = partial.new_empty((partial.shape[0], partial.shape[1] // world_size, *partial.shape[2:]))
    reduce_scatter_into(shard, stacked, group=group)
    return shard


class GatherFromSequenceParallel(torch.autograd.Function):
    """The paper's g: all-gather along the sequence in forward, reduce-scatter of the gradient in backward."""

    @staticmethod
    def forward(ctx, shard, group=None):
        # BEGIN LAB: g's forward: the whole sequence from every rank's shard; keep the group
        # all_gather_sequence(shard, group) does the collective
        ctx.group = group
        return all_gather_sequence(shard, group)
        # END LAB

    @staticmethod
    def backward(ctx, grad_output):
        # BEGIN LAB: g's backward: sum the ranks' gradients, keep this rank's tokens
        # every rank used the whole sequence: each holds one term of its gradient (reduce_scatter_sequence)
        return reduce_scatter_sequence(grad_output, ctx.group), None
        # END LAB


class ReduceScatterToSequenceParallel(torch.autograd.Function):
    """The paper's g-bar: reduce-scatter along the sequence in forward, all-gather of the gradient in backward."""

    @staticmethod
    def forward(ctx, partial, group=None):
        # BEGIN LAB: g-bar's forward: sum the partial results, keep this rank's tokens
        ctx.group = group
        return reduce_scatter_sequence(partial, group)
        # END LAB

    @staticmethod
    def backward(ctx, grad_output):
        # BEGIN LAB: g-bar's backward: the whole gradient, gathered from every rank
        # each rank's partial result fed every token of the sum: it needs the gradient of every token
        return all_gather_sequence(grad_output, ctx.group), None
        # END LAB


def gather_from_sequence_parallel(shard: torch.Tensor, group=None) -> torch.Tensor:
    """``GatherFromSequenceParallel`` applied to ``shard``."""
    return GatherFromSequenceParallel.apply(shard, group)


def reduce_scatter_to_sequence_parallel(partial: torch.Tensor, group=None) -> torch.Tensor:
    """``ReduceScatterToSequenceParallel`` applied to ``partial``."""
    return ReduceScatterToSequenceParallel.apply(partial, group)


class GatherThenLinear(torch.autograd.Function):
    """``F.linear(all_gather_sequence(shard), weight, bias)``, keeping only ``shard`` for backward: backward
    gathers it again for the weight's gradient (Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication``
    with sequence parallelism, without its overlap). One more all-gather, one whole input fewer kept."""

    @staticmethod
    def forward(ctx, shard, weight, bias, group=None):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(shard, weight)
        return F.linear(all_gather_sequence(shard, group), weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        shard, weight = ctx.saved_tensors
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:  # all ranks build the same graph, so all of them call this all-gather or none
            whole = all_gather_sequence(shard, ctx.group)  # again: the price of not keeping it
            grad_weight = grad_output.flatten(0, -2).T @ whole.flatten(0, -2)
        grad_input = reduce_scatter_sequence(grad_output @ weight, ctx.group)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_output.flatten(0, -2).sum(0)
        return grad_input, grad_weight, grad_bias, None


class SequenceParallelSelfAttention(TensorParallelSelfAttention):
    """Lesson 12's attention split by heads, between sequence shards: ``(batch, seq / t, h)`` in and out.

    The same shards as ``TensorParallelSelfAttention`` (``from_full`` is its own); only the communication differs:
    all-gather the sequence, the q, k, v projections of this rank's heads and attention on them, the output
    projection's partial result, reduce-scatter, then the bias and the dropout on this rank's tokens. With
    ``regather``, the gather and the projection are ``GatherThenLinear``.
    """

    regather = False

    def forward(self, X_shard):
        group, p = self.qkv.group, (self.dropout if self.training else 0.0)
        if self.regather:
            projected = GatherThenLinear.apply(X_shard, self.qkv.weight, self.qkv.bias, group)
        else:
            projected = F.linear(gather_from_sequence_parallel(X_shard, group), self.qkv.weight, self.qkv.bias)
        queries, keys, values = projected.chunk(3, dim=-1)
        partial = F.linear(attend(queries, keys, values, self.head_dim, self.causal, p), self.out.weight)
        return maybe_dropout(reduce_scatter_to_sequence_parallel(partial, group) + self.out.bias, p, self.training)


class SequenceParallelMLP(TensorParallelMLP):
    """Lesson 12's MLP split by hidden features, between sequence shards: all-gather, this rank's slice of
    ``GELU(X A) B``, reduce-scatter, then the bias and the dropout on this rank's tokens."""

    regather = False

    def forward(self, X_shard):
        group = self.up.group
        if self.regather:
            hidden = GatherThenLinear.apply(X_shard, self.up.weight, self.up.bias, group)
        else:
            hidden = F.linear(gather_from_sequence_parallel(X_shard, group), self.up.weight, self.up.bias)
        partial = F.linear(F.gelu(hidden), self.down.weight)
        mine = reduce_scatter_to_sequence_parallel(partial, group) + self.down.bias
        return maybe_dropout(mine, self.dropout, self.training)


def replicated_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that every rank of a tensor-parallel group holds whole: all but the column-parallel weights
    and biases and the row-parallel weights (the row-parallel biases are whole)."""
    split = set()
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear):
            split |= {id(module.weight), id(module.bias)}
        elif isinstance(module, RowParallelLinear):
            split.add(id(module.weight))
    return [parameter for parameter in model.parameters() if id(parameter) not in split]


def all_reduce_replicated_gradients(model: nn.Module, group=None) -> None:
    """Sum the gradients of ``replicated_parameters`` over ``group``, in one flat all-reduce. Under sequence
    parallelism each rank computed them from its own tokens only: each is one term of the whole gradient."""
    parameters = [p for p in replicated_parameters(model) if p.requires_grad]
    if not parameters:
        return
    for p in parameters:  # a missing gradient counts as zero, so that every rank sends the same layout
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in parameters]
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    dist.all_reduce(flat, group=group)
    for grad, summed in zip(grads, flat.split([grad.numel() for grad in grads])):
        grad.copy_(summed.view_as(grad))


def shard_gpt(gpt: GPT, rank: int, world_size: int, group=None) -> GPT:
    """Tensor parallelism alone, lesson 12's: each block's attention and MLP split over ``group``
    (``shard_block``), everything else whole on every rank, which computes the whole sequence. Returns ``gpt``."""
    for block in gpt.blocks:
        shard_block(block, rank, world_size, group)
    return gpt


def replicated_in_sync(model: nn.Module, group=None) -> bool:
    """True when every rank of ``group`` holds the same ``replicated_parameters``, bit for bit: the check that their
    gradients were the whole ones on every rank. Two all-reduces (the element-wise maximum and minimum over the
    ranks); every rank of ``group`` calls it."""
    flat = torch.cat([p.detach().reshape(-1) for p in replicated_parameters(model)]).double()
    highest, lowest = flat.clone(), flat.clone()
    dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=group)
    return bool(torch.equal(highest, lowest))


class SequenceParallelGPT(nn.Module):
    """``gpt`` with tensor and sequence parallelism over ``group`` (rank ``rank`` of ``world_size`` in it), by hand.

    Every rank reads the whole ``(batch, seq)`` of tokens. It embeds its own slice of the sequence, runs the blocks
    on it (each block gathers the sequence inside, for its attention and its MLP) and scores its own tokens with the
    final norm and the head. ``loss`` is this rank's share of the mean next-token loss: the shares add up to the
    mean over every token. After backward, call ``finish_gradients``. With ``regather``, the blocks keep only their
    shards of the linears' inputs (``GatherThenLinear``).
    """

    def __init__(self, gpt: GPT, rank: int, world_size: int, group=None, regather: bool = False):
        super().__init__()
        self.gpt, self.rank, self.world_size, self.group = gpt, rank, world_size, group
        for block in gpt.blocks:
            block.attention = SequenceParallelSelfAttention.from_full(block.attention, rank, world_size, group)
            block.mlp = SequenceParallelMLP.from_full(block.mlp, rank, world_size, group)
            block.attention.regather = block.mlp.regather = regather
        self.blocks = gpt.blocks  # what common.recompute.apply_recomputation wraps

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The logits of this rank's positions: ``(batch, seq / t, vocab)``."""
        positions = sequence_range(tokens.shape[1], self.rank, self.world_size)
        X = self.gpt.embed(tokens[:, positions], start=positions.start)
        for block in self.blocks:
            X = block(X)
        return self.gpt.head(self.gpt.norm(X))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """This rank's tokens' summed cross-entropy over all the batch's tokens: summed over the ranks, the mean."""
        logits = self(tokens)
        mine = targets[:, sequence_range(targets.shape[1], self.rank, self.world_size)]
        return F.cross_entropy(logits.flatten(0, 1), mine.flatten(), reduction="sum") / targets.numel()

    def finish_gradients(self) -> None:
        """``all_reduce_replicated_gradients`` over the group: the whole gradient of every replicated parameter."""
        all_reduce_replicated_gradients(self, self.group)


def parallelize_gpt(gpt: GPT, tp_mesh) -> GPT:
    """torch's tensor and sequence parallelism of ``gpt`` on the 1-D ``tp_mesh`` (``parallelize_module``), as
    torchtitan plans a Llama: the token and position embeddings cut by rows (``RowwiseParallel``, each rank looks up
    the rows it holds and a reduce-scatter leaves it its tokens' sums), each norm ``SequenceParallel``, the attention
    and the MLP gathered before (``PrepareModuleInput``: ``Shard(1)`` to ``Replicate()``) and reduce-scattered after
    (``RowwiseParallel(output_layouts=Shard(1))``), and the head cut by vocabulary (``ColwiseParallel`` to
    ``Shard(-1)``, a DTensor: compute its loss under ``loss_parallel()``). Every rank must have built the same
    ``gpt``; the residual stream is then this rank's ``(batch, seq / t, h)`` as a plain tensor. Returns ``gpt``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    def gathered():  # one replicated DTensor for the projections that share it: their gradients add up on it
        return PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=False
        )

    plan = {
        "token": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "position": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    for index in range(len(gpt.blocks)):
        block = f"blocks.{index}"
        plan |= {f"{block}.attention_norm": SequenceParallel(), f"{block}.mlp_norm": SequenceParallel()}
        plan |= {f"{block}.attention": gathered(), f"{block}.mlp": gathered()}
        plan |= {f"{block}.attention.{name}": ColwiseParallel() for name in ("q", "k", "v")}
        plan |= {f"{block}.attention.out": RowwiseParallel(output_layouts=Shard(1))}
        plan |= {f"{block}.mlp.up": ColwiseParallel(), f"{block}.mlp.down": RowwiseParallel(output_layouts=Shard(1))}
    return parallelize_module(gpt, tp_mesh, plan)
