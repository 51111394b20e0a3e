"""Mixture of experts and expert parallelism (lesson 15): a router, E expert MLPs, and the all-to-all between ranks.

A mixture-of-experts layer replaces a transformer's MLP (``common.tensor_parallel.FeedForward``) with E of them,
the experts, and a router: a linear map from each token to E scores. Each token goes to the k experts with the
highest softmax probabilities (top-k), and its output is the sum of those experts' outputs, each weighted by its
gate: the token's probability for that expert (Shazeer et al. 2017; top-1 is the Switch Transformer's, Fedus et al.
2021, https://arxiv.org/abs/2101.03961). With ``renormalize=True`` the k gates are divided by their sum, so that they
add up to 1 (what GShard does for its top-2; with k = 1 the gate is then always 1 and the router learns nothing
from the output). A token that goes to k experts costs k expert MLPs, however many experts there are: the
parameters grow with E, the work per token with k.

Two more pieces come from the Switch Transformer (section 2.2):

- ``load_balancing_loss``: E times the sum over experts of f_i P_i, where f_i is the fraction of the token-to-expert
  assignments that chose expert i and P_i the mean router probability of expert i. It is 1 when both are uniform.
  f is a count and has no gradient: the gradient reaches the router through P.
- A capacity: each expert takes at most ``ceil(capacity_factor * T * k / E)`` of a batch's T tokens. The
  assignments past it are dropped: that expert adds nothing to that token, whose residual connection carries it on.
  Assignments are served in order of choice, then of position: every token's first choice before any second one.

``MoE`` is the layer in one process: the assignments sorted by expert, each expert run once on its tokens, the
results weighted and added back to their tokens (``moe_by_loop`` is the same layer token by token, the reference).

Expert parallelism (GShard, Lepikhin et al. 2020, https://arxiv.org/abs/2006.16668) splits the experts over the
ranks: rank r of W keeps experts ``r E/W`` up to, not including, ``(r + 1) E/W``, and every rank keeps its own
tokens and a copy of the router. ``ExpertParallelMoE`` sends every token to the rank of its expert and the results back:

1. route this rank's tokens and sort the assignments by expert, so that they are grouped by destination rank;
2. ``exchange_counts``: one small all-to-all tells every rank how many tokens it will receive, from each rank, for
   each of its experts;
3. ``all_to_all``: the tokens go out, with as many rows to each rank as it has to take (uneven splits);
4. ``expert_major_order``: the received rows come grouped by source rank; this permutation groups them by expert,
   each local expert runs once, and the inverse permutation puts the results back in the order they came;
5. ``all_to_all`` again, the other way: each rank gets its own tokens' results, weights them by the gates and adds
   them up, as ``MoE`` does.

``AllToAll`` is the autograd Function: forward sends rows with one set of splits, backward sends the gradient back
with the splits swapped (the reverse exchange). torch has the same thing as
``torch.distributed.nn.functional.all_to_all_single``.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from common.tensor_parallel import FeedForward, maybe_dropout


@dataclass
class Routing:
    """Where a batch of T tokens goes: ``probs`` (T, E), the router's softmax; ``experts`` (T, k), each token's
    chosen experts, best first; ``gates`` (T, k), their weights; ``kept`` (T, k), False where capacity dropped
    the assignment."""

    probs: torch.Tensor
    experts: torch.Tensor
    gates: torch.Tensor
    kept: torch.Tensor

    @property
    def dropped(self) -> int:
        """How many token-to-expert assignments the capacity dropped."""
        return int((~self.kept).sum())

    def counts(self, num_experts: int) -> torch.Tensor:
        """Tokens each expert runs (the kept assignments), shape (E,)."""
        return torch.bincount(self.experts[self.kept], minlength=num_experts)


def check_top_k(top_k: int, num_experts: int) -> None:
    """A top-k of E experts needs 1 <= k <= E: anything else is a ``ValueError`` that says so."""
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top-k must be between 1 and the {num_experts} experts, not {top_k}")


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """The most assignments one expert takes: ``ceil(capacity_factor * T * k / E)`` (the Switch Transformer's,
    with k assignments per token). A factor of 1 is an even share."""
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def keep_within_capacity(experts: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """Which assignments of ``experts`` (T, k) fit in ``capacity`` per expert: (T, k) bool. Served in order of
    choice, then of position: all first choices by position, then all second choices..."""
    slot_major = experts.t().reshape(-1)  # (k T,): the first choices of tokens 0..T-1, then the second choices...
    one_hot = nn.functional.one_hot(slot_major, num_experts)
    place = (one_hot.cumsum(0) * one_hot).sum(1) - 1  # how many assignments to the same expert came before
    return (place < capacity).reshape(experts.shape[1], experts.shape[0]).t()


def route(logits: torch.Tensor, top_k: int, capacity_factor: float | None = None, renormalize: bool = False) -> Routing:
    """``logits`` (T, E), the router's scores: each token's top-k experts by softmax probability, their gates,
    and which assignments fit the capacity (all of them when ``capacity_factor`` is None)."""
    num_experts = logits.shape[-1]
    check_top_k(top_k, num_experts)
    probs = logits.softmax(dim=-1)
    gates, experts = probs.topk(top_k, dim=-1)
    if renormalize:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    if capacity_factor is None:
        kept = torch.ones_like(experts, dtype=torch.bool)
    else:
        capacity = expert_capacity(logits.shape[0], num_experts, top_k, capacity_factor)
        kept = keep_within_capacity(experts, num_experts, capacity)
    return Routing(probs, experts, gates, kept)


def load_balancing_loss(routing: Routing) -> torch.Tensor:
    """Switch Transformer's auxiliary loss, E sum_i f_i P_i: f_i the fraction of the T k assignments (before
    dropping) to expert i, P_i the mean probability of expert i. 1 when balanced. Its gradient flows through P."""
    num_experts = routing.probs.shape[-1]
    fraction = torch.bincount(routing.experts.flatten(), minlength=num_experts) / routing.experts.numel()
    return num_experts * (fraction.to(routing.probs.dtype) * routing.probs.mean(dim=0)).sum()


def sort_by_expert(routing: Routing, num_experts: int):
    """The kept assignments sorted by expert (stable: by position within an expert): ``order`` (A,) indexes the
    flattened (T k) assignments, ``token`` (A,) is each one's token, ``counts`` (E,) how many each expert takes."""
    flat = routing.experts.flatten()
    kept = routing.kept.flatten().nonzero().squeeze(1)
    order = kept[torch.argsort(flat[kept], stable=True)]
    return order, order // routing.experts.shape[1], torch.bincount(flat[kept], minlength=num_experts)


def run_experts(experts: nn.ModuleList, X: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """``X`` (A, d), rows grouped by expert, ``counts[i]`` rows for ``experts[i]``: each expert on its rows, once,
    the outputs in the same order. An expert with no row runs on an empty tensor: its gradients are zeros."""
    return torch.cat([expert(rows) for expert, rows in zip(experts, X.split(counts))])


def combine(Y: torch.Tensor, token: torch.Tensor, gates: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Each row of ``Y`` (A, d) times its gate, added to the output row of its ``token``: (T, d). A token whose
    assignments were all dropped gets zeros."""
    out = Y.new_zeros(num_tokens, Y.shape[1])
    return out.index_add(0, token, Y * gates.unsqueeze(1))


class MoE(nn.Module):
    """A mixture-of-experts MLP: ``router`` (a linear map to E scores, no bias) and E ``FeedForward`` experts of
    ``hidden`` features (4 d_model by default), top-k routing, an optional capacity. In place of a block's MLP:
    input and output (..., d_model). After each forward, ``aux_loss`` holds the load-balancing loss of that batch
    and ``routing`` its ``Routing``. ``dropout``: on the output in training, as ``FeedForward``'s."""

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        top_k: int = 1,
        hidden: int | None = None,
        capacity_factor: float | None = None,
        renormalize: bool = False,
        dropout: float = 0.0,
    ):
        super().__init__()
        check_top_k(top_k, num_experts)
        self.num_experts, self.top_k, self.capacity_factor, self.renormalize = (
            num_experts,
            top_k,
            capacity_factor,
            renormalize,
        )
        self.dropout = dropout
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.experts = nn.ModuleList([FeedForward(d_model, hidden) for _ in range(num_experts)])
        self.aux_loss, self.routing = None, None

    def route(self, tokens: torch.Tensor) -> Routing:
        """``tokens`` (T, d): their ``Routing``; it is kept, and its balancing loss in ``aux_loss``."""
        self.routing = route(self.router(tokens), self.top_k, self.capacity_factor, self.renormalize)
        self.aux_loss = load_balancing_loss(self.routing)
        return self.routing

    def forward(self, X):
        tokens = X.reshape(-1, X.shape[-1])
        routing = self.route(tokens)
        order, token, counts = sort_by_expert(routing, self.num_experts)
        Y = run_experts(self.experts, tokens[token], counts.tolist())
        out = combine(Y, token, routing.gates.flatten()[order], len(tokens))
        return maybe_dropout(out.reshape(X.shape), self.dropout, self.training)


def moe_by_loop(moe: MoE, X: torch.Tensor) -> torch.Tensor:
    """``moe(X)``, one token and one chosen expert at a time: the reference that ``MoE`` and
    ``ExpertParallelMoE`` must equal (dropout left out)."""
    tokens = X.reshape(-1, X.shape[-1])
    routing = route(moe.router(tokens), moe.top_k, moe.capacity_factor, moe.renormalize)
    rows = []
    for t in range(len(tokens)):
        row = torch.zeros_like(tokens[t])
        for slot in range(moe.top_k):
            if routing.kept[t, slot]:
                row = row + routing.gates[t, slot] * moe.experts[int(routing.experts[t, slot])](tokens[t])
        rows.append(row)
    return torch.stack(rows).reshape(X.shape)


def moe_gpt(gpt: nn.Module, num_experts: int, top_k: int = 1, **options) -> nn.Module:
    """``gpt`` (``common.gpt.GPT``) with each block's MLP replaced, in place, by an ``MoE`` of the same width and
    dropout (``options`` go to ``MoE``: ``hidden``, ``capacity_factor``, ``renormalize``). Returns ``gpt``."""
    for block in gpt.blocks:
        d_model, hidden = block.mlp.up.in_features, block.mlp.up.out_features
        layer_options = {"hidden": hidden, "dropout": block.mlp.dropout} | options  # this block's own
        block.mlp = MoE(d_model, num_experts, top_k, **layer_options)
    return gpt


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The ``MoE`` and ``ExpertParallelMoE`` layers of ``model``, in order."""
    return [module for module in model.modules() if isinstance(module, (MoE, ExpertParallelMoE))]


def balance_loss(model: nn.Module) -> torch.Tensor:
    """The mean of ``aux_loss`` over the model's MoE layers, from their last forward. A weight on it is a weight on
    the mean: with L layers, weight / L per layer (Switch adds its weight times each layer's loss)."""
    return torch.stack([layer.aux_loss for layer in moe_layers(model)]).mean()


# Expert parallelism


class AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` with uneven splits as an autograd Function: forward sends ``input_splits[j]``
    rows of ``X`` to rank j and receives ``output_splits[j]`` rows from it; backward sends the gradient back, the
    splits swapped."""

    @staticmethod
    def forward(ctx, X, output_splits, input_splits, group=None):
        # BEGIN LAB: forward: uneven rows to every rank; keep the splits and the group
        # dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group)
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = X.new_empty((sum(output_splits), *X.shape[1:]))
        dist.all_to_all_single(out, X.contiguous(), output_splits, input_splits, group=group)
        return out
        # END LAB

    @staticmethod
    def backward(ctx, grad_output):
        # BEGIN LAB: backward: the reverse all-to-all, each gradient row home
        # each row's gradient goes back to the rank that sent the row: the splits swap places
        output_splits, input_splits = ctx.splits
        grad = grad_output.new_empty((sum(input_splits), *grad_output.shape[1:]))
        dist.all_to_all_single(grad, grad_output.contiguous(), input_splits, output_splits, group=ctx.group)
        return grad, None, None, None
        # END LAB


def all_to_all(X: torch.Tensor, output_splits: list[int], input_splits: list[int], group=None) -> torch.Tensor:
    """``AllToAll`` applied to ``X``."""
    return AllToAll.apply(X, output_splits, input_splits, group)


def exchange_counts(counts: torch.Tensor, world_size: int, group=None) -> torch.Tensor:
    """``counts`` (E,), how many of this rank's tokens go to each expert, experts ``r E/W`` up to, not
    including, ``(r + 1) E/W`` on rank r. Returns (W, E/W): row s, how many tokens rank s sends to each of this
    rank's experts."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)  # an even split: E/W counts to each rank
    return received.view(world_size, -1)


def expert_major_order(received: torch.Tensor) -> torch.Tensor:
    """``received`` (W, E/W) from ``exchange_counts``. The rows that came are grouped by source rank, then by
    expert. Returns the permutation that groups them by expert, then by source: ``rows[index]``."""
    sizes = received.flatten()
    starts = sizes.cumsum(0) - sizes
    blocks = torch.arange(sizes.numel(), device=received.device).view(received.shape).t().flatten()  # expert-major
    index = [torch.arange(starts[b], starts[b] + sizes[b], device=received.device) for b in blocks.tolist()]
    return torch.cat(index) if index else sizes.new_zeros(0)


class ExpertParallelMoE(nn.Module):
    """``moe``'s experts split over the ``world_size`` ranks of ``group``: this rank (``rank`` in the group) keeps
    experts ``rank E/W`` up to, not including, ``(rank + 1) E/W``, and a copy of the router. Each rank routes its
    own tokens; two all-to-alls carry them to their experts and the results back. With no capacity (or none
    reached) it equals ``moe`` on all the ranks' tokens together: the outputs, the experts' gradients, and the
    router's gradient once summed over the ranks."""

    def __init__(self, moe: MoE, rank: int, world_size: int, group=None):
        super().__init__()
        if moe.num_experts % world_size:
            raise ValueError(f"{moe.num_experts} experts do not divide over {world_size} ranks")
        self.num_experts, self.top_k, self.capacity_factor = moe.num_experts, moe.top_k, moe.capacity_factor
        self.renormalize, self.dropout = moe.renormalize, moe.dropout
        self.rank, self.world_size, self.group = rank, world_size, group
        self.router = moe.router
        local = moe.num_experts // world_size
        self.experts = nn.ModuleList(list(moe.experts)[rank * local : (rank + 1) * local])
        self.aux_loss, self.routing, self.received, self.splits = None, None, None, None

    def forward(self, X):
        tokens = X.reshape(-1, X.shape[-1])
        self.routing = route(self.router(tokens), self.top_k, self.capacity_factor, self.renormalize)
        self.aux_loss = load_balancing_loss(self.routing)
        order, token, counts = sort_by_expert(self.routing, self.num_experts)
        # BEGIN LAB: dispatch: the counts, the tokens out, by local expert, results back
        # exchange_counts, all_to_all twice (the second with the splits swapped), expert_major_order and its inverse
        received = exchange_counts(counts, self.world_size, self.group)  # (W, E/W)
        send_splits = counts.view(self.world_size, -1).sum(1).tolist()  # rows to each rank
        receive_splits = received.sum(1).tolist()  # rows from each rank
        arrived = all_to_all(tokens[token], receive_splits, send_splits, self.group)
        index = expert_major_order(received)
        Y = run_experts(self.experts, arrived[index], received.sum(0).tolist())
        back = all_to_all(Y[torch.argsort(index)], send_splits, receive_splits, self.group)
        # END LAB
        self.received, self.splits = received, (send_splits, receive_splits)  # for the solution's byte count
        out = combine(back, token, self.routing.gates.flatten()[order], len(tokens))
        return maybe_dropout(out.reshape(X.shape), self.dropout, self.training)


def expert_parallel_gpt(gpt: nn.Module, rank: int, world_size: int, group=None) -> nn.Module:
    """``gpt`` (from ``moe_gpt``) with each ``MoE`` split by ``ExpertParallelMoE`` over ``group``, in place."""
    for block in gpt.blocks:
        block.mlp = ExpertParallelMoE(block.mlp, rank, world_size, group)
    return gpt


def is_expert_parameter(name: str) -> bool:
    """Whether parameter ``name`` belongs to an expert (held by one rank of the expert-parallel group) rather than
    to every rank (the router, attention, norms, embeddings)."""
    return ".experts." in f".{name}"


def average_gradients(model: nn.Module, world_size: int, replica_group=None) -> None:
    """After backward on ``world_size`` ranks, each on its own tokens with its own mean loss: every gradient
    becomes that of the mean of the ranks' losses. Parameters every rank holds: summed over all ranks. An
    expert's: its all-to-alls already brought it the gradient of every rank of its expert-parallel group, so
    it is summed over ``replica_group`` only, the ranks that hold a copy of the same experts (None: no copies).
    Then both are divided by ``world_size`` (gloo has no average: sum, then divide). Each kind travels as one
    flat tensor, one all-reduce: many small ones would cost a latency each."""
    for parameter in model.parameters():
        if parameter.grad is None:  # an expert that no token reached in this step, in a model without others
            parameter.grad = torch.zeros_like(parameter)
    named = list(model.named_parameters())
    # group None: the whole world for the shared parameters; for the experts, no copies (dp = 1) and no all-reduce
    for experts, group in ((False, None), (True, replica_group)):
        grads = [p.grad for name, p in named if is_expert_parameter(name) == experts]
        if not grads:
            continue
        flat = torch.cat([grad.flatten() for grad in grads])
        if not experts or group is not None:
            dist.all_reduce(flat, group=group)
        flat /= world_size
        for grad, part in zip(grads, flat.split([grad.numel() for grad in grads])):
            grad.copy_(part.view_as(grad))


def all_to_all_bytes(sent: int, received: int, d_model: int, element_size: int, num_experts: int) -> int:
    """The bytes one rank's all-to-alls take per MoE layer and step, as ``count_collectives`` counts them (each
    call's input): forward, the counts (E int64), ``sent`` rows out and ``received`` rows back; backward, the
    reverse of both. Rows are ``d_model`` elements of ``element_size`` bytes."""
    return 2 * (sent + received) * d_model * element_size + 8 * num_experts
