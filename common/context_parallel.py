"""Context parallelism (lesson 14): one sequence split across ranks, attention computed by passing keys and values.

Sequence parallelism (lesson 13) cuts the token-by-token parts of a layer along the sequence but gathers the whole
sequence for attention. When one sequence's activations do not fit even then, attention itself must work on a
slice: rank r keeps the queries of its own positions and sees the other ranks' keys and values one block at a time.

Three pieces, in the order a reader meets them:

- **Blockwise attention with an online softmax** (Milakov and Gimelshein 2018, "Online normalizer calculation for
  softmax"; the idea of FlashAttention, Dao et al. 2022): attention over one block of keys gives an output and, per
  query, the log of its softmax denominator (the log-sum-exp, ``lse``). ``merge`` combines two such partial
  results exactly, so the key blocks can come one at a time. ``blockwise_attention`` does it in one process.
- **Ring attention** (Liu, Zaharia and Abbeel 2023, "Ring Attention with Blockwise Transformers"): the key/value
  blocks travel around the ranks with ``isend``/``irecv``; the next block's transfer is posted before the current
  block's computation, so the two can overlap. ``RingAttention`` is an autograd Function: its backward sends the
  key/value blocks around again, and each block's gradient travels with it until it is home.
- **Load balance under a causal mask**: position i attends to positions 0..i. With contiguous slices the last rank's
  queries see every key and the first rank's see only their own. The zig-zag layout gives rank r chunk r and chunk
  2N-1-r of 2N chunks, one from the front and its mirror from the back: every rank then does the same work.

``all_gather_attention`` is the other way, used for Llama 3's training (Llama Team 2024, "The Llama 3 Herd of
Models", section 3.3.2): gather every rank's keys and values once (one all-gather forward, one reduce-scatter of
their gradients backward), then attend locally. ``ContextParallelGPT`` runs lesson 13's GPT on either.
``ulysses_attention`` is a third way, DeepSpeed-Ulysses' all-to-all over heads.

Shapes follow ``F.scaled_dot_product_attention``: ``(batch, heads, seq, head_dim)``. A rank's slice is a list of
``pieces``, each a ``range`` of positions (one for contiguous, two for zig-zag). Attention dropout is not built here.
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from common.gpt import GPT
from common.sequence_parallel import gather_from_sequence_parallel
from common.tensor_parallel import SelfAttention, maybe_dropout

LAYOUTS = ("contiguous", "zigzag")
METHODS = ("ring", "all-gather")


# --- who holds which positions ------------------------------------------------------------------------------------


def shard_pieces(seq: int, rank: int, world_size: int, layout: str = "contiguous") -> list[range]:
    """The positions rank ``rank`` of ``world_size`` holds of a sequence of ``seq`` tokens, as ranges.

    ``contiguous``: one range of ``seq / N``. ``zigzag``: chunks ``rank`` and ``2N - 1 - rank`` of ``2N`` chunks.
    A length that does not divide (by N, or by 2N for zig-zag) is a ``ValueError`` at once, before any message."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}: one of {LAYOUTS}")
    chunks = world_size if layout == "contiguous" else 2 * world_size
    if seq % chunks:
        raise ValueError(
            f"a sequence of {seq} tokens does not divide into {chunks} equal chunks ({layout} layout on "
            f"{world_size} ranks): use a multiple of {chunks}"
        )
    size = seq // chunks
    owned = [rank] if layout == "contiguous" else [rank, chunks - 1 - rank]
    return [range(chunk * size, (chunk + 1) * size) for chunk in owned]


def shard_positions(seq: int, rank: int, world_size: int, layout: str = "contiguous") -> torch.Tensor:
    """The positions of ``shard_pieces`` as one int64 tensor, in the order the rank stores them."""
    return torch.cat([torch.arange(piece.start, piece.stop) for piece in shard_pieces(seq, rank, world_size, layout)])


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, layout: str = "contiguous", dim: int = 1):
    """Rank ``rank``'s slice of ``x`` along ``dim`` (the sequence): its pieces, side by side."""
    positions = shard_positions(x.shape[dim], rank, world_size, layout).to(x.device)
    return x.index_select(dim, positions)


def unshard_sequence(shards: list[torch.Tensor], layout: str = "contiguous", dim: int = 1) -> torch.Tensor:
    """The inverse of ``shard_sequence``: every rank's slice (rank 0's first) back in position order."""
    world_size, seq = len(shards), sum(shard.shape[dim] for shard in shards)
    order = torch.cat([shard_positions(seq, rank, world_size, layout) for rank in range(world_size)])
    return torch.cat(shards, dim).index_select(dim, order.argsort().to(shards[0].device))


# --- one block of keys, and the merge -----------------------------------------------------------------------------


def visible(query_piece: range, key_piece: range, causal: bool) -> str:
    """How much of ``key_piece`` the queries of ``query_piece`` see: ``"all"``, ``"none"`` or ``"some"`` (a
    causal mask on a block that straddles the diagonal)."""
    if not causal or key_piece.stop - 1 <= query_piece.start:
        return "all"
    return "none" if key_piece.start > query_piece.stop - 1 else "some"


def causal_mask(query_piece: range, key_piece: range, device=None) -> torch.Tensor:
    """``True`` where a query of ``query_piece`` may see a key of ``key_piece``: key position <= query position."""
    queries = torch.arange(query_piece.start, query_piece.stop, device=device)
    keys = torch.arange(key_piece.start, key_piece.stop, device=device)
    return keys[None, :] <= queries[:, None]


def safe(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with minus infinity (a query that saw no key yet) replaced by 0, so ``exp(scores - lse)`` is 0, not
    NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def block_attention(q, k, v, mask=None):
    """Attention of queries ``q`` over one block of keys ``k`` and values ``v``: the output, as if these were all
    the keys, and each query's log-sum-exp of scores ``(batch, heads, queries)``. ``mask``: where a query may look."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = scores.logsumexp(dim=-1)
    return torch.exp(scores - safe(lse)[..., None]) @ v, lse


def merge(out, lse, block_out, block_lse):
    """Two partial attentions of the same queries over disjoint key sets, as one: the online softmax's step.

    Each output is normalised by its own denominator ``exp(lse)``. Over both key sets the denominator is
    ``exp(lse) + exp(block_lse)``, whose log is ``new_lse``, so each output is reweighted by its share of it."""
    # BEGIN LAB: the online-softmax merge: the new log-sum-exp, each output reweighted
    new_lse = torch.logaddexp(lse, block_lse)  # log(exp(lse) + exp(block_lse)), without overflow
    scale = safe(new_lse)[..., None]  # both -inf (no key seen anywhere yet): weights 0, not NaN
    return torch.exp(lse[..., None] - scale) * out + torch.exp(block_lse[..., None] - scale) * block_out, new_lse
    # END LAB


def attend_pieces(q, k, v, query_pieces, key_pieces, causal):
    """The attention of ``q`` (this rank's queries, its ``query_pieces`` side by side) over one block of keys and
    values (``key_pieces`` side by side), pair of pieces by pair: for each pair that the causal mask does not hide
    entirely, the query rows it covers, its output and its log-sum-exp (``block_attention``). Hidden pairs are
    skipped: no score of theirs is computed."""
    q_start = 0
    for query_piece in query_pieces:
        rows = slice(q_start, q_start + len(query_piece))
        k_start = 0
        for key_piece in key_pieces:
            cols = slice(k_start, k_start + len(key_piece))
            seen = visible(query_piece, key_piece, causal)
            if seen != "none":
                mask = causal_mask(query_piece, key_piece, q.device) if seen == "some" else None
                yield rows, *block_attention(q[..., rows, :], k[..., cols, :], v[..., cols, :], mask)
            k_start = cols.stop
        q_start = rows.stop


def attend_pieces_backward(q, k, v, query_pieces, key_pieces, causal, lse, dout, delta, dq, dk, dv) -> None:
    """The gradients of ``attend_pieces``'s attention, for one block of keys, added into ``dq``, ``dk`` and ``dv``.

    With the final ``lse``, each block's probabilities are exact: ``P = exp(scores - lse)``. Then ``dV = P^T dO``,
    ``dP = dO V^T``, ``dS = P (dP - delta)`` with ``delta = rowsum(dO * O)``, ``dQ = dS K / sqrt(d)`` and
    ``dK = dS^T Q / sqrt(d)``: softmax's backward, block by block (FlashAttention's backward pass)."""
    scale = 1 / math.sqrt(q.shape[-1])
    q_start = 0
    for query_piece in query_pieces:
        rows = slice(q_start, q_start + len(query_piece))
        k_start = 0
        for key_piece in key_pieces:
            cols = slice(k_start, k_start + len(key_piece))
            seen = visible(query_piece, key_piece, causal)
            if seen != "none":
                q_block, k_block, v_block, grad = q[..., rows, :], k[..., cols, :], v[..., cols, :], dout[..., rows, :]
                scores = q_block @ k_block.transpose(-2, -1) * scale
                if seen == "some":
                    scores = scores.masked_fill(~causal_mask(query_piece, key_piece, q.device), float("-inf"))
                P = torch.exp(scores - safe(lse[..., rows])[..., None])
                dv[..., cols, :] += P.transpose(-2, -1) @ grad
                dS = P * (grad @ v_block.transpose(-2, -1) - delta[..., rows, None])
                dq[..., rows, :] += dS @ k_block * scale
                dk[..., cols, :] += dS.transpose(-2, -1) @ q_block * scale
            k_start = cols.stop
        q_start = rows.stop


class BlockwiseAttention(torch.autograd.Function):
    """Attention over key blocks of ``block_size`` one at a time, in one process: forward merges them with the
    online softmax, backward recomputes each block's probabilities from the saved log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, block_size: int, causal: bool):
        seq = q.shape[-2]
        query_pieces = [range(0, seq)]
        key_pieces = [range(start, min(start + block_size, seq)) for start in range(0, seq, block_size)]
        out = torch.zeros_like(q)
        lse = q.new_full(q.shape[:-1], float("-inf"))
        for piece in key_pieces:  # one block of keys at a time: nothing of size seq x seq is ever held
            block = slice(piece.start, piece.stop)
            for rows, block_out, block_lse in attend_pieces(q, k[..., block, :], v[..., block, :], query_pieces,
                                                            [piece], causal):  # fmt: skip
                out[..., rows, :], lse[..., rows] = merge(out[..., rows, :], lse[..., rows], block_out, block_lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pieces, ctx.causal = (query_pieces, key_pieces), causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        (query_pieces, key_pieces), causal = ctx.pieces, ctx.causal
        delta = (dout * out).sum(dim=-1)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for piece in key_pieces:
            block = slice(piece.start, piece.stop)
            attend_pieces_backward(
                q, k[..., block, :], v[..., block, :], query_pieces, [piece], causal, lse, dout, delta,
                dq, dk[..., block, :], dv[..., block, :],
            )  # fmt: skip
        return dq, dk, dv, None, None


def blockwise_attention(q, k, v, block_size: int, causal: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, is_causal=causal)``, computed over key blocks of ``block_size``."""
    return BlockwiseAttention.apply(q, k, v, block_size, causal)


# --- the ring -----------------------------------------------------------------------------------------------------


def global_rank(group, rank: int) -> int:
    """The global rank of rank ``rank`` of ``group`` (None: the default group), for ``isend``/``irecv``."""
    return rank if group is None else dist.get_global_rank(group, rank)


def pass_along(send: torch.Tensor, group=None) -> tuple[torch.Tensor, list]:
    """Post ``send`` to the next rank of the ring and a receive from the previous one, without waiting: the
    received tensor and the two requests, for the caller to ``wait`` on after its computation.

    The two are posted as one group (``dist.batch_isend_irecv``). Gloo would take two separate ``isend`` and
    ``irecv`` calls, but on NCCL each rank's send could then wait for a receive its peer has queued behind its own
    send, and the ring could hang (NVIDIA/nccl#479); a group lets NCCL run both at once."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    received = torch.empty_like(send)
    # BEGIN LAB: the ring's direction: to the next rank, from the previous one, as one group
    requests = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, send, global_rank(group, (rank + 1) % world_size), group=group),
            dist.P2POp(dist.irecv, received, global_rank(group, (rank - 1) % world_size), group=group),
        ]
    )
    # END LAB
    return received, requests


def wait_all(requests: list) -> None:
    """Wait for every posted message."""
    for request in requests:
        request.wait()


class RingAttention(torch.autograd.Function):
    """Attention of this rank's queries over every rank's keys and values, passed around the ring.

    Forward, N steps: at step t this rank holds the key/value block of rank ``r - t``. It posts that block to rank
    ``r + 1`` and a receive from rank ``r - 1``, computes its queries' attention over the block it holds, merges it,
    then waits. Backward, N steps again: the key/value blocks go round once more, and each block's gradient
    (``dkv``) travels with it, collecting every rank's share; after the last step it reaches its owner.
    ``layout``: how the sequence was cut (``shard_pieces``); the full length is N times the local one."""

    @staticmethod
    def forward(ctx, q, k, v, layout: str, causal: bool, group=None):
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        seq = q.shape[-2] * world_size
        pieces = [shard_pieces(seq, source, world_size, layout) for source in range(world_size)]
        out, lse = torch.zeros_like(q), q.new_full(q.shape[:-1], float("-inf"))
        kv = torch.stack([k, v]).contiguous()  # one message per step: keys and values together
        for step in range(world_size):
            source = (rank - step) % world_size  # whose block this rank holds now
            if step < world_size - 1:
                received, requests = pass_along(kv, group)  # posted first: the transfer overlaps the computation
            for rows, block_out, block_lse in attend_pieces(q, kv[0], kv[1], pieces[rank], pieces[source], causal):
                out[..., rows, :], lse[..., rows] = merge(out[..., rows, :], lse[..., rows], block_out, block_lse)
            if step < world_size - 1:
                wait_all(requests)
                kv = received
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.causal, ctx.group, ctx.pieces = layout, causal, group, pieces
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, pieces, causal = ctx.group, ctx.pieces, ctx.causal
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        dout = dout.contiguous()
        delta = (dout * out).sum(dim=-1)
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros_like(kv)  # the gradient of the block this rank holds, summed over the ranks it visited
        for step in range(world_size):
            source = (rank - step) % world_size
            if step < world_size - 1:
                next_kv, kv_requests = pass_along(kv, group)  # the blocks do not change: send them before computing
            attend_pieces_backward(
                q, kv[0], kv[1], pieces[rank], pieces[source], causal, lse, dout, delta, dq, dkv[0], dkv[1]
            )
            if world_size > 1:
                dkv, dkv_requests = pass_along(dkv, group)  # after computing: this rank's share is in it now
                wait_all(dkv_requests)
            if step < world_size - 1:
                wait_all(kv_requests)
                kv = next_kv
        # N passes of dkv: the last one brought this rank's own block's gradient home.
        return dq, dkv[0], dkv[1], None, None, None


def ring_attention(q, k, v, layout: str = "contiguous", causal: bool = False, group=None) -> torch.Tensor:
    """``RingAttention`` applied: this rank's ``(batch, heads, seq / N, head_dim)`` queries, keys and values (cut
    by ``layout``) in, the attention output of its queries out."""
    return RingAttention.apply(q, k, v, layout, causal, group)


def context_parallel_attend(
    queries,
    keys,
    values,
    head_dim: int,
    causal: bool = False,
    dropout: float = 0.0,
    *,
    group=None,
    layout: str = "zigzag",
    method: str = "ring",
) -> torch.Tensor:
    """``common.tensor_parallel.attend`` computed over ``group`` by ``method`` (``"ring"``: ``RingAttention``;
    ``"all-gather"``: ``all_gather_attention``): the ``(batch, seq / N, heads * head_dim)`` projections of this
    rank's positions (cut by ``layout``) in, their attention out, in the same layout. ``heads`` is whatever the
    projections hold: under tensor parallelism, this rank's ``num_heads / tp``. ``ContextParallelSelfAttention``
    calls it, and ``common.parallelize.apply_context_parallel`` puts it in each ``SelfAttention``. No attention
    dropout."""
    if dropout > 0:
        raise ValueError("context-parallel attention has no attention dropout: build the GPT with dropout=0")
    batch, local, width = queries.shape

    def heads(T):  # (batch, local, heads * head_dim) -> (batch, heads, local, head_dim)
        return T.view(batch, local, width // head_dim, head_dim).transpose(1, 2)

    attention = RingAttention.apply if method == "ring" else all_gather_attention
    mixed = attention(heads(queries), heads(keys), heads(values), layout, causal, group)
    return mixed.transpose(1, 2).reshape(batch, local, width)


def ring_messages(batch: int, heads: int, seq: int, head_dim: int, world_size: int, element_size: int) -> dict:
    """What one rank sends in one ``RingAttention`` forward and backward: each message is one key/value block (or
    its gradient), ``2 batch heads (seq / N) head_dim`` elements. Forward: N - 1 blocks. Backward: N - 1 blocks
    and N gradients."""
    message = 2 * batch * heads * (seq // world_size) * head_dim * element_size
    forward, backward = world_size - 1, 2 * world_size - 1 if world_size > 1 else 0
    return {"message bytes": message, "forward sends": forward, "backward sends": backward}


def all_gather_attention(q, k, v, layout: str = "contiguous", causal: bool = False, group=None) -> torch.Tensor:
    """Llama 3's way: all-gather every rank's keys and values (one collective), then attend this rank's queries
    over the whole sequence. Backward reduce-scatters the keys' and values' gradients (lesson 13's
    ``GatherFromSequenceParallel``). Every rank holds all keys and values at once, N times the ring's block."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    seq = q.shape[-2] * world_size
    batch, heads, local, head_dim = k.shape
    kv = torch.cat([k, v], dim=1).transpose(1, 2).reshape(batch, local, 2 * heads * head_dim)  # sequence on dim 1
    gathered = gather_from_sequence_parallel(kv, group)  # rank order: its pieces, then the next rank's
    keys, values = gathered.view(batch, seq, 2 * heads, head_dim).transpose(1, 2).chunk(2, dim=1)
    mask = None
    if causal:
        query_positions = shard_positions(seq, rank, world_size, layout).to(q.device)
        key_positions = torch.cat([shard_positions(seq, r, world_size, layout) for r in range(world_size)])
        mask = key_positions.to(q.device)[None, :] <= query_positions[:, None]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group=None) -> torch.Tensor:
    """Cut ``x`` into N equal chunks along ``scatter_dim`` and send chunk j to rank j; put the N chunks received
    side by side along ``gather_dim``, rank 0's first. One ``all_to_all_single`` over ``group``."""
    world_size = dist.get_world_size(group)
    stacked = torch.stack(x.chunk(world_size, dim=scatter_dim)).contiguous()  # row j goes to rank j
    received = torch.empty_like(stacked)
    dist.all_to_all_single(received, stacked, group=group)  # row i came from rank i
    return torch.cat(received.unbind(0), dim=gather_dim)


class AllToAll(torch.autograd.Function):
    """``all_to_all`` in forward; backward sends the gradient back the other way (the dimensions swapped)."""

    @staticmethod
    def forward(ctx, x, scatter_dim: int, gather_dim: int, group=None):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def ulysses_attention(q, k, v, layout: str = "contiguous", causal: bool = False, group=None) -> torch.Tensor:
    """DeepSpeed-Ulysses (Jacobs et al. 2023): an all-to-all turns "every head, this rank's positions" into "this
    rank's heads, every position"; ordinary attention runs on whole sequences; a second all-to-all turns the output
    back. The heads must divide by the ranks: each rank takes ``heads / N`` of them whole."""
    world_size = dist.get_world_size(group)
    if q.shape[1] % world_size:
        raise ValueError(f"{q.shape[1]} heads do not divide by the {world_size} ranks: Ulysses gives each whole heads")
    seq = q.shape[-2] * world_size
    order = torch.cat([shard_positions(seq, r, world_size, layout) for r in range(world_size)]).to(q.device)
    by_position = order.argsort()  # the gathered sequence comes in rank order: sort it into position order
    whole = [AllToAll.apply(t, 1, 2, group).index_select(2, by_position) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*whole, is_causal=causal)
    return AllToAll.apply(out.index_select(2, order), 2, 1, group)  # back to rank order, then to every head


# --- the GPT ------------------------------------------------------------------------------------------------------


class ContextParallelSelfAttention(nn.Module):
    """Lesson 13's ``SelfAttention`` (its own ``q``, ``k``, ``v`` and ``out``, whole on every rank) over this rank's
    slice of the sequence, its attention computed by ``method``: ``"ring"`` or ``"all-gather"``."""

    def __init__(self, attention: SelfAttention, layout: str, method: str = "ring", group=None):
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}: one of {METHODS}")
        self.q, self.k, self.v, self.out = attention.q, attention.k, attention.v, attention.out
        self.num_heads, self.head_dim, self.causal = attention.num_heads, attention.head_dim, attention.causal
        self.dropout, self.layout, self.method, self.group = attention.dropout, layout, method, group

    def forward(self, X):
        dropout = self.dropout if self.training else 0.0
        mixed = context_parallel_attend(
            self.q(X), self.k(X), self.v(X), self.head_dim, self.causal, dropout,
            group=self.group, layout=self.layout, method=self.method,
        )  # fmt: skip
        return self.out(mixed)


class ContextParallelGPT(nn.Module):
    """``gpt`` with its sequence split over ``group``: rank ``rank`` of ``world_size`` embeds and scores only its
    positions (``shard_positions``), and every attention sees the other ranks' keys through ``method``. Every
    parameter stays whole on every rank. ``loss`` is this rank's share of the mean next-token loss. After backward,
    ``finish_gradients`` sums every gradient over the group: each rank's holds its tokens' terms only."""

    def __init__(self, gpt: GPT, rank: int, world_size: int, layout: str = "zigzag", method: str = "ring", group=None):
        super().__init__()
        self.gpt, self.rank, self.world_size, self.layout, self.group = gpt, rank, world_size, layout, group
        for block in gpt.blocks:
            block.attention = ContextParallelSelfAttention(block.attention, layout, method, group)
        self.blocks = gpt.blocks

    def positions(self, seq: int) -> torch.Tensor:
        """This rank's positions of a sequence of ``seq`` tokens."""
        return shard_positions(seq, self.rank, self.world_size, self.layout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The logits of this rank's positions: ``(batch, seq / N, vocab)``, in ``shard_positions`` order."""
        positions = self.positions(tokens.shape[1]).to(tokens.device)
        X = self.gpt.token(tokens[:, positions]) + self.gpt.position(positions)
        X = maybe_dropout(X, self.gpt.dropout, self.training)
        for block in self.blocks:
            X = block(X)
        return self.gpt.head(self.gpt.norm(X))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """This rank's tokens' summed cross-entropy over all the batch's tokens: summed over the ranks, the mean."""
        logits = self(tokens)
        mine = targets[:, self.positions(targets.shape[1]).to(targets.device)]
        return F.cross_entropy(logits.flatten(0, 1), mine.flatten(), reduction="sum") / targets.numel()

    def finish_gradients(self) -> None:
        """Sum every parameter's gradient over the group (``all_reduce``): the gradient of the whole sequence."""
        for parameter in self.parameters():
            if parameter.grad is not None:
                dist.all_reduce(parameter.grad, group=self.group)
