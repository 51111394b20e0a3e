"""Tensor parallelism by hand (lesson 12): Megatron-LM's split of a transformer's MLP and attention over ranks.

Data parallelism copies the whole model to every rank; pipeline parallelism gives each rank whole layers. Tensor
parallelism cuts each layer's weight matrices, so that every rank holds ``1 / N`` of every layer and all ranks
work on the same batch at once. Megatron-LM (Shoeybi et al. 2019, https://arxiv.org/abs/1909.08053, section 3)
showed that a transformer's MLP needs only two collectives per pass when its two linears are cut the right way:

- the first linear, ``Y = GELU(X A)``, is cut by COLUMNS of ``A`` (``ColumnParallelLinear``): rank ``r`` holds
  ``A_r``, a slice of the output features, and computes ``GELU(X A_r)`` from the whole input ``X`` with no
  communication. Cutting by columns is what lets the GELU, which is not linear, run on each rank's slice alone;
  cut by rows, the GELU would need the summed result first.
- the second linear, ``Z = Y B``, is cut by ROWS of ``B`` (``RowParallelLinear``): rank ``r`` holds ``B_r``, the
  rows that multiply its slice ``Y_r``, and ``Z = sum_r Y_r B_r`` is one all-reduce of the partial products.

Megatron writes the communication as two conjugate operators (its figure 3), here two ``autograd.Function``\\ s:

- ``f`` (``CopyToTensorParallel``): identity in forward, all-reduce in backward. It stands before the
  column-parallel linear: every rank uses the same ``X``, so ``X``'s gradient is the sum of the ranks' partial
  gradients ``dY_r A_r^T``.
- ``g`` (``ReduceFromTensorParallel``): all-reduce in forward, identity in backward. It stands after the
  row-parallel linear: the sum's gradient with respect to each term is the sum's own gradient, already on every
  rank.

So one MLP costs one all-reduce of the activations (batch x sequence x d_model elements) in forward and one of
the same size in backward (``mlp_all_reduce_bytes``), whatever the world size, and no gradient all-reduce for its
weights: each rank owns its slice's gradient. The row-parallel bias is added once, after the all-reduce: added on
every rank before it, it would be counted N times.

Attention is split the same way, by heads (Megatron section 3, figure 3b; ``TensorParallelSelfAttention``): the
query, key and value projections are column-parallel with each rank taking whole heads, each rank runs attention
on its own heads (heads never mix), and the output projection is row-parallel. One ``f`` before the projections,
one ``g`` after the output: the same two all-reduces as the MLP, so a transformer layer costs four (two forward,
two backward).

PyTorch does this with ``DTensor``: ``parallelize_module(model, mesh, {"up": ColwiseParallel(), "down":
RowwiseParallel()})`` (``parallelize_feed_forward``) turns the full model's parameters into sharded ``DTensor``\\ s
and inserts the same collectives. Its collectives are functional ones (``torch.ops._c10d_functional``), not
``dist.all_reduce``: ``common.collectives.count_collectives`` does not see them, and
``torch.distributed.tensor.debug.CommDebugMode`` counts them instead. On gloo with PyTorch 2.14 it counts what the
by-hand version does: one ``c10d_functional.all_reduce`` in forward (``RowwiseParallel``'s output, as ``g``) and
one in backward (the gradient of ``ColwiseParallel``'s replicated input, as ``f``), each of the activation's size;
outputs and gradients equal the by-hand version's (tests/test_tensor_parallel.py).

Every collective here takes a ``group``: the ranks that share one tensor-parallel copy of the model, the whole world
by default. With a 2-D mesh (``data_and_tensor_parallel_mesh``) the world is R data-parallel replicas of T
tensor-parallel ranks: the TP all-reduces stay within the T ranks of a replica (``mesh["tp"]``), and each
parameter's gradient, a slice or a replicated one, is averaged over the R ranks that hold the same piece
(``mesh["dp"]``), as data parallelism does (``common.collectives.all_reduce_gradients`` with that group).
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class CopyToTensorParallel(torch.autograd.Function):
    """Megatron's ``f``: the input unchanged in forward; the gradient summed over ranks in backward.

    Placed where a replicated activation enters a column-parallel region. Each rank's gradient for it is only its
    slice's contribution, and the true gradient is their sum.
    """

    @staticmethod
    def forward(ctx, X, group=None):
        # BEGIN LAB: f's forward: the input unchanged (a new tensor object); keep the group
        ctx.group = group  # the tensor-parallel ranks (None: all of them)
        return X.view_as(X)  # a new tensor object that shares the data: autograd records f without a copy
        # END LAB

    @staticmethod
    def backward(ctx, grad_output):
        # BEGIN LAB: f's backward: the gradient summed over the group (None for the group)
        # all_reduce works in place: reduce a copy, since autograd may still use grad_output elsewhere.
        grad = grad_output.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None  # one gradient per input of forward: X's, and none for the group
        # END LAB


class ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's ``g``: the input summed over ranks in forward; the gradient unchanged in backward.

    Placed where a row-parallel region's partial sums leave it. The gradient of a sum with respect to each term is
    the gradient of the sum, which every rank already holds.
    """

    @staticmethod
    def forward(ctx, partial, group=None):
        # BEGIN LAB: g's forward: the partials summed over the group, the input left intact
        total = partial.clone(memory_format=torch.contiguous_format)  # in place below: leave the input intact
        dist.all_reduce(total, group=group)
        return total
        # END LAB

    @staticmethod
    def backward(ctx, grad_output):
        # BEGIN LAB: g's backward: the gradient of a sum for each term (None for the group)
        return grad_output, None
        # END LAB


def copy_to_tensor_parallel(X: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's ``f`` applied to ``X``: identity forward, all-reduce over ``group`` backward
    (``CopyToTensorParallel``)."""
    return CopyToTensorParallel.apply(X, group)


def reduce_from_tensor_parallel(partial: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's ``g`` applied to ``partial``: all-reduce over ``group`` forward, identity backward
    (``ReduceFromTensorParallel``)."""
    return ReduceFromTensorParallel.apply(partial, group)


def shard_range(features: int, rank: int, world_size: int, what: str = "features") -> slice:
    """The slice of ``features`` that rank ``rank`` holds: the ``rank``-th of ``world_size`` equal parts.

    Tensor parallelism needs equal parts (every rank runs the same shapes, and the all-reduce needs the same size
    everywhere), so features that do not divide by the world size are a ``ValueError``, not a silent uneven cut.
    """
    if features % world_size:
        raise ValueError(f"{what}={features} do not divide by the world size {world_size}: no equal shards")
    size = features // world_size
    return slice(rank * size, (rank + 1) * size)


class ColumnParallelLinear(nn.Module):
    """``f``, then this rank's slice of a linear's OUTPUT features: ``Y_r = X A_r^T + b_r``.

    ``weight`` is ``(out_features / N, in_features)`` and ``bias`` ``(out_features / N,)``: rows of PyTorch's
    ``(out, in)`` weight are columns of the paper's ``A``. The input is the whole, replicated activation; the
    output is this rank's slice of the features, ready for a row-parallel linear. ``group``: the N
    tensor-parallel ranks (None: the whole world).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, group=None):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.bias = nn.Parameter(bias.detach().clone())
        self.group = group

    @classmethod
    def from_full(cls, linear: nn.Linear, rank: int, world_size: int, group=None) -> "ColumnParallelLinear":
        """Rank ``rank``'s column shard of ``linear``: its slice of the output features, weight and bias both.
        ``rank`` and ``world_size`` count within ``group``, the tensor-parallel ranks."""
        # BEGIN LAB: this rank's output features: rows of the (out, in) weight, and of the bias
        # shard_range(features, rank, world_size, what) gives the slice; name what "out_features"
        rows = shard_range(linear.out_features, rank, world_size, "out_features")
        return cls(linear.weight[rows], linear.bias[rows], group)
        # END LAB

    def forward(self, X):
        return F.linear(copy_to_tensor_parallel(X, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This rank's slice of a linear's INPUT features, then ``g``, then the bias: ``Z = sum_r Y_r B_r^T + b``.

    ``weight`` is ``(out_features, in_features / N)``; ``bias`` is the whole ``(out_features,)``, the same on every
    rank, and added after the all-reduce, once. Its gradient is then the same on every rank with no communication.
    ``group``: the N tensor-parallel ranks (None: the whole world).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, group=None):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.bias = nn.Parameter(bias.detach().clone())
        self.group = group

    @classmethod
    def from_full(cls, linear: nn.Linear, rank: int, world_size: int, group=None) -> "RowParallelLinear":
        """Rank ``rank``'s row shard of ``linear``: its slice of the input features, and the whole bias. ``rank``
        and ``world_size`` count within ``group``, the tensor-parallel ranks."""
        # BEGIN LAB: this rank's input features: columns of the (out, in) weight; the bias whole
        # shard_range(features, rank, world_size, what) gives the slice; name what "in_features"
        columns = shard_range(linear.in_features, rank, world_size, "in_features")
        return cls(linear.weight[:, columns], linear.bias, group)
        # END LAB

    def forward(self, Y_shard):
        return reduce_from_tensor_parallel(F.linear(Y_shard, self.weight), self.group) + self.bias


class FeedForward(nn.Module):
    """A transformer's MLP, whole: ``Linear(d_model, hidden) -> GELU -> Linear(hidden, d_model)``; hidden is 4 d_model
    unless given. The single-process reference that ``TensorParallelMLP`` and torch's ``parallelize_module`` split.
    ``dropout``: the probability of dropout on its output in training (lesson 13's GPT; 0, none, in lesson 12)."""

    def __init__(self, d_model: int, hidden: int | None = None, dropout: float = 0.0):
        super().__init__()
        hidden = 4 * d_model if hidden is None else hidden
        self.up = nn.Linear(d_model, hidden)
        self.down = nn.Linear(hidden, d_model)
        self.dropout = dropout

    def forward(self, X):
        return maybe_dropout(self.down(F.gelu(self.up(X))), self.dropout, self.training)


def maybe_dropout(X: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """``F.dropout(X, p)`` in training when ``p`` > 0; ``X`` itself otherwise, so that a model without dropout saves
    no mask for backward."""
    return F.dropout(X, p, training=True) if p and training else X


class TensorParallelMLP(nn.Module):
    """``FeedForward`` split over ranks: ``up`` column-parallel, GELU on this rank's slice, ``down`` row-parallel.

    Forward: ``f`` (nothing), the two local matrix products, ``g`` (one all-reduce). Backward: ``g``'s conjugate
    (nothing), the local gradients, ``f``'s conjugate (one all-reduce). Its parameters have ``FeedForward``'s names
    (``up.weight``, ..., ``down.bias``) and hold this rank's slices of them.
    """

    def __init__(self, up: ColumnParallelLinear, down: RowParallelLinear, dropout: float = 0.0):
        super().__init__()
        self.up, self.down, self.dropout = up, down, dropout

    @classmethod
    def from_full(cls, mlp: FeedForward, rank: int, world_size: int, group=None) -> "TensorParallelMLP":
        """Rank ``rank``'s shard of the whole ``mlp``, which every rank has built with the same weights; ``rank`` of
        ``world_size`` in ``group``, the tensor-parallel ranks (None: the whole world)."""
        return cls(
            ColumnParallelLinear.from_full(mlp.up, rank, world_size, group),
            RowParallelLinear.from_full(mlp.down, rank, world_size, group),
            mlp.dropout,
        )

    def forward(self, X):
        # The dropout after g acts on the whole output, the same on every rank: it needs the same mask on each.
        return maybe_dropout(self.down(F.gelu(self.up(X))), self.dropout, self.training)


class SelfAttention(nn.Module):
    """Multi-head self-attention, whole: query, key and value projections (``q``, ``k``, ``v``), scaled dot-product
    attention per head, and an output projection ``out``. Lesson 12 uses it without mask and dropout: the split is
    the point. Lesson 13's GPT sets ``causal`` (a token attends to itself and the tokens before it) and ``dropout``
    (on the attention probabilities and on the output, in training).

    The projections are separate linears, as in torchtitan, so that head ``h`` is the output features
    ``h * head_dim`` to ``(h + 1) * head_dim`` of each of them, and a contiguous column shard is whole heads.
    """

    def __init__(self, d_model: int, num_heads: int, causal: bool = False, dropout: float = 0.0):
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} does not divide into num_heads={num_heads} heads")
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.q, self.k, self.v = (nn.Linear(d_model, d_model) for _ in range(3))
        self.out = nn.Linear(d_model, d_model)
        self.causal, self.dropout = causal, dropout
        # How the projections are mixed: ``attend``'s signature. Context parallelism (lesson 16) swaps in ring
        # attention over its ranks (``common.context_parallel.context_parallel_attend``); the module stays the same.
        self.attend = attend

    def forward(self, X):
        p = self.dropout if self.training else 0.0
        mixed = self.attend(self.q(X), self.k(X), self.v(X), self.head_dim, self.causal, p)
        return maybe_dropout(self.out(mixed), p, self.training)


def attend(queries, keys, values, head_dim: int, causal: bool = False, dropout: float = 0.0):
    """Scaled dot-product attention on every head of ``(batch, seq, heads * head_dim)`` projections; the heads'
    outputs side by side, in the same layout. Each head only ever sees its own features.

    ``causal``: position i attends to positions 0..i only, by adding minus infinity to the later scores (an
    addition saves nothing for backward). ``dropout``: the probability of dropping an attention weight (pass 0
    outside training)."""
    batch, seq, width = queries.shape

    def heads(T):  # (batch, seq, heads * head_dim) -> (batch, heads, seq, head_dim)
        return T.view(batch, seq, width // head_dim, head_dim).transpose(1, 2)

    scores = heads(queries) @ heads(keys).transpose(-2, -1) / math.sqrt(head_dim)
    if causal:
        scores = scores + torch.full((seq, seq), float("-inf"), device=scores.device, dtype=scores.dtype).triu(1)
    mixed = maybe_dropout(scores.softmax(dim=-1), dropout, training=True) @ heads(values)
    return mixed.transpose(1, 2).reshape(batch, seq, width)


class TensorParallelSelfAttention(nn.Module):
    """``SelfAttention`` split by heads: rank ``r`` holds ``num_heads / N`` whole heads.

    The three projections of this rank's heads are one ``ColumnParallelLinear`` (``qkv``, their slices stacked),
    so that ``f`` runs once and the input's gradient is all-reduced once, not three times. Attention runs on the
    local heads alone; ``out`` is row-parallel over the same features, and its ``g`` is the forward all-reduce.
    """

    def __init__(
        self,
        qkv: ColumnParallelLinear,
        out: RowParallelLinear,
        head_dim: int,
        causal: bool = False,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.qkv, self.out, self.head_dim = qkv, out, head_dim
        self.causal, self.dropout = causal, dropout

    @classmethod
    def from_full(
        cls, attention: SelfAttention, rank: int, world_size: int, group=None
    ) -> "TensorParallelSelfAttention":
        """Rank ``rank``'s heads of ``attention`` (``rank`` of ``world_size`` in ``group``, as for the MLP). The
        heads, not only the features, must divide by the world size: a head cut in two would need its halves'
        scores summed before the softmax."""
        shard_range(attention.num_heads, rank, world_size, "num_heads")  # the ValueError, in heads
        projections = (attention.q, attention.k, attention.v)
        rows = shard_range(attention.q.out_features, rank, world_size, "out_features")
        qkv = ColumnParallelLinear(
            torch.cat([p.weight[rows] for p in projections]), torch.cat([p.bias[rows] for p in projections]), group
        )
        out = RowParallelLinear.from_full(attention.out, rank, world_size, group)
        return cls(qkv, out, attention.head_dim, attention.causal, attention.dropout)

    def forward(self, X):
        p = self.dropout if self.training else 0.0
        queries, keys, values = self.qkv(X).chunk(3, dim=-1)
        return maybe_dropout(self.out(attend(queries, keys, values, self.head_dim, self.causal, p)), p, self.training)


class TransformerBlock(nn.Module):
    """One pre-norm transformer layer, whole: ``X + attention(norm(X))``, then that plus ``mlp(norm(...))``. The
    norms stay whole on every rank under tensor parallelism; ``shard_block`` splits the attention and the MLP.
    ``causal`` and ``dropout`` go to the attention (and ``dropout`` to the MLP): lesson 13's GPT sets them."""

    def __init__(self, d_model: int, num_heads: int, causal: bool = False, dropout: float = 0.0):
        super().__init__()
        self.attention_norm = nn.LayerNorm(d_model)
        self.attention = SelfAttention(d_model, num_heads, causal, dropout)
        self.mlp_norm = nn.LayerNorm(d_model)
        self.mlp = FeedForward(d_model, dropout=dropout)

    def forward(self, X):
        X = X + self.attention(self.attention_norm(X))
        return X + self.mlp(self.mlp_norm(X))


def shard_block(block: TransformerBlock, rank: int, world_size: int, group=None) -> TransformerBlock:
    """Split ``block``'s attention (by heads) and MLP (by hidden features) in place: rank ``rank`` of ``world_size``
    in ``group`` keeps its shards; the norms stay whole. Returns ``block``."""
    block.attention = TensorParallelSelfAttention.from_full(block.attention, rank, world_size, group)
    block.mlp = TensorParallelMLP.from_full(block.mlp, rank, world_size, group)
    return block


def parallelize_block(block: TransformerBlock, tp_mesh) -> TransformerBlock:
    """torch's version of ``shard_block`` on the 1-D ``tp_mesh``: q, k, v and ``up`` sharded by output features
    (``ColwiseParallel``: whole heads per rank for q, k, v), ``out`` and ``down`` by input features
    (``RowwiseParallel``).

    ``PrepareModuleInput`` on the attention turns its input into one replicated DTensor that q, k and v share, as
    ``TensorParallelSelfAttention``'s one ``f`` before its stacked projection: their three partial gradients add up
    on that DTensor and are all-reduced once. Without it each ``ColwiseParallel`` makes its own replicated input
    from the plain tensor, and backward all-reduces the attention's input gradient three times."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    one_input = PrepareModuleInput(
        input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
    )
    plan = {"attention": one_input} | {f"attention.{name}": ColwiseParallel() for name in ("q", "k", "v")}
    plan |= {"attention.out": RowwiseParallel(), "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()}
    return parallelize_module(block, tp_mesh, plan)


def mlp_all_reduce_bytes(batch_size: int, seq_len: int, d_model: int, element_size: int) -> int:
    """The bytes of the one all-reduce of a tensor-parallel MLP (or attention block) per micro-batch, in forward,
    and again in backward: the ``(batch, seq, d_model)`` activation, ``g``'s output forward and ``f``'s input
    gradient backward. The world size does not appear: every rank all-reduces the whole activation. (A ring moves
    ``2 (N - 1) / N`` of these bytes over each rank's link; the count here is the tensor's size, as
    ``count_collectives`` counts it.)"""
    return batch_size * seq_len * d_model * element_size


def parallelize_feed_forward(mlp: FeedForward, mesh):
    """torch's version of ``TensorParallelMLP``: ``mlp``'s own parameters become ``DTensor`` shards on the
    1-D ``mesh`` (``init_device_mesh(device_type, (world_size,))``), ``up`` sharded by output features
    (``ColwiseParallel``) and ``down`` by input features (``RowwiseParallel``), with the collectives inserted for
    the module's inputs and outputs. Modifies and returns ``mlp``; the weights are rank 0's, scattered
    (``parallelize_module``'s ``src_data_rank=0``)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(mlp, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def data_and_tensor_parallel_mesh(device_type: str, tensor_parallel_size: int):
    """A 2-D ``DeviceMesh`` of every rank, dimensions ``("dp", "tp")``: ``world_size / tensor_parallel_size``
    data-parallel replicas, each of ``tensor_parallel_size`` tensor-parallel ranks.

    Rank r is shard ``r % T`` of replica ``r // T`` (T the tensor-parallel size): a replica is T consecutive ranks,
    on one node when T divides the GPUs per node, where tensor parallelism's all-reduces (two per layer in each
    pass) go over the fast links (Megatron-LM keeps it within a node). The data-parallel traffic crosses nodes:
    with DDP over ``dp``, the gradients' all-reduce once per step, one call per bucket; with FSDP2 over ``dp``,
    each unit's all-gather of its parameters before it computes (again in backward if it was resharded after
    forward) and, after backward, a reduce-scatter of its gradients. ``mesh["tp"].get_group()`` and
    ``mesh["dp"].get_group()`` are this rank's two process groups, ``mesh["tp"].get_local_rank()`` its shard.
    Every rank calls it (it creates process groups).
    """
    from torch.distributed.device_mesh import init_device_mesh

    world_size = dist.get_world_size()
    if tensor_parallel_size < 1 or world_size % tensor_parallel_size:
        raise ValueError(
            f"a tensor-parallel size of {tensor_parallel_size} does not divide the world size {world_size}"
        )
    shape = (world_size // tensor_parallel_size, tensor_parallel_size)
    return init_device_mesh(device_type, shape, mesh_dim_names=("dp", "tp"))
