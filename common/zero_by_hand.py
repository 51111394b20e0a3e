"""ZeRO built by hand: sharded optimizer state (stage 1), gradients (2) and parameters (3).

ZeRO (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC20, 2020)
removes the copies of model state that data parallelism keeps on every rank, in three stages; PyTorch's FSDP
(Zhao et al., "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel", VLDB 2023) is stage 3. Each
class here builds one stage from the plain collectives, so that lesson 08 can check it against PyTorch's own
(``ZeroRedundancyOptimizer``, FSDP2's ``fully_shard``) and count what it sends:

- ``partition_by_size``: whole tensors shared out among ranks, balanced by size (ZeRO-1's rule).
- ``ZeRO1Optimizer`` (stage 1): wraps any ``torch.optim`` class; each rank keeps the optimizer state of its share
  of the parameters, steps its share, and broadcasts the updated values. Used after DDP has averaged gradients.
- ``ZeRO2Optimizer`` (stage 2): no DDP; the parameters live in flat, padded buckets; during backward each complete
  bucket of gradients is reduce-scattered and freed, so a rank keeps only its 1/N of the averaged gradients; it
  steps its 1/N of every bucket and all-gathers the result: DDP's bytes, as one reduce-scatter and one all-gather.
- ``FlatZeRO1Optimizer`` (stage 1 as in the paper and DeepSpeed): the same buckets and traffic, but the whole
  gradients are kept through backward and reduce-scattered in ``step``.
- ``ZeRO3Model`` (stage 3, fully sharded): a rank keeps 1/N of every unit's parameters; a unit is all-gathered
  just before it computes and freed after; gradients are reduce-scattered to their owners.
- ``gather_full_parameters``: ZeRO-3's whole parameters by name, for checking and saving.

Every collective goes through ``dist.broadcast`` or ``common.collectives.all_gather_into`` / ``reduce_scatter_into``,
looked up at call time, so that ``common.collectives.count_collectives`` sees them all. Gradients are summed, then
divided by the world size: older PyTorch versions refuse ``ReduceOp.AVG`` on gloo. (DDP divides first: with no
communication hook, it scales each gradient by 1/N as it copies it into its bucket, then sums the buckets.)
"""

import math
from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from common.collectives import all_gather_into, reduce_scatter_into
from common.ddp_by_hand import assign_buckets, broadcast_parameters_and_buffers, require_process_group


def partition_by_size(parameters, world_size: int) -> list[list[int]]:
    """Share whole tensors out among ``world_size`` ranks, balanced by size: ``shares[rank]`` lists the indices
    (ascending) of the tensors that ``rank`` owns.

    ``parameters`` is a list of tensors (one parameter group) or a list of parameter groups, each a list of tensors;
    the indices count the tensors of all groups in order, as if the groups were laid end to end.
    ``ZeroRedundancyOptimizer``'s rule (``_partition_parameters`` in
    ``torch/distributed/optim/zero_redundancy_optimizer.py``), so both give the same shares: group after group, the
    group's tensors largest first, each to the rank that owns the fewest elements so far (the lowest rank on a
    tie), the loads carried over from one group to the next. Sorting within a group, not across groups, changes the
    answer: groups [[A (10)], [B0 (100), B1 (100)]] at 2 ranks give A to rank 0, then B0 to rank 1 and B1 to
    rank 0, [[A, B1], [B0]]; sorting all three together would give [[A, B0], [B1]]. Greedy, so the shares are as
    even as the tensors allow, not equal: one tensor larger than total / N makes its rank the largest.
    """
    groups = [parameters] if all(isinstance(p, torch.Tensor) for p in parameters) else parameters
    # BEGIN LAB: share the tensors out group by group, largest first, to the least-loaded rank
    # sorted(..., reverse=True) is stable: tensors of equal size keep their order, as in PyTorch's. The loads
    # carry over from one group to the next.
    shares, loads, first = [[] for _ in range(world_size)], [0] * world_size, 0
    for group in groups:
        sizes = [p.numel() for p in group]
        for index in sorted(range(len(sizes)), key=lambda i: sizes[i], reverse=True):
            rank = loads.index(min(loads))  # the first of the least-loaded ranks
            shares[rank].append(first + index)
            loads[rank] += sizes[index]
        first += len(group)
    return [sorted(share) for share in shares]
    # END LAB


class ZeRO1Optimizer(torch.optim.Optimizer):
    """ZeRO stage 1: each rank keeps the optimizer state of its share of the parameters only.

        net = DDP(model)                                   # DDP (or a hand-built one) averages the gradients
        optimizer = ZeRO1Optimizer(net.parameters(), torch.optim.Adam, lr=1e-3)
        loss.backward(); optimizer.step(); optimizer.zero_grad()

    ``optimizer_class`` is any ``torch.optim`` class and ``defaults`` its keyword arguments. The trainable
    parameters are shared out by ``partition_by_size``, group by group; each rank builds ``optimizer_class`` on its
    share alone (``self.optim``, the name ``ZeroRedundancyOptimizer`` uses), so Adam's two states exist for 1/N of
    the model on each rank. ``step`` steps that share, then every updated parameter is broadcast from its owner: one
    broadcast per parameter, as ``ZeroRedundancyOptimizer`` does by default. (One flat buffer per owner would send
    the same bytes in N messages instead; ``ZeRO2Optimizer`` goes further, with one all-gather.) Frozen parameters
    are in no share: they never change, so there is nothing to step or send.

    It subclasses ``torch.optim.Optimizer`` so that it goes wherever an optimizer goes: LR schedulers change
    ``param_groups[i]["lr"]`` (which holds every parameter, so ``zero_grad``, inherited, clears all gradients), and
    ``step`` copies the hyperparameters into the local optimizer's groups before stepping. ``state_dict`` and
    ``load_state_dict`` are this rank's share (the local optimizer's): save one per rank, or gather them yourself.
    """

    def __init__(self, params, optimizer_class, **defaults):
        require_process_group("ZeRO1Optimizer")
        super().__init__(params, defaults)
        groups = [[p for p in group["params"] if p.requires_grad] for group in self.param_groups]
        shares = partition_by_size(groups, dist.get_world_size())  # group by group, as ZeroRedundancyOptimizer
        owner_of = {index: rank for rank, share in enumerate(shares) for index in share}
        # owner[p]: the rank that steps p and broadcasts it, in the order of param_groups (the same on every rank)
        self.owner = {p: owner_of[index] for index, p in enumerate(p for group in groups for p in group)}
        rank = dist.get_rank()
        local_groups = [
            {**group, "params": [p for p in group["params"] if self.owner.get(p) == rank]}
            for group in self.param_groups
        ]
        self.optim = optimizer_class(local_groups, **defaults)  # a group may be empty: torch.optim allows it
        for group, local in zip(self.param_groups, self.optim.param_groups):
            group.update({key: value for key, value in local.items() if key != "params"})  # the class's defaults

    def step(self, closure=None):
        """Step this rank's share of the parameters, then broadcast each updated parameter from its owner."""
        for group, local in zip(self.param_groups, self.optim.param_groups):
            local.update({key: value for key, value in group.items() if key != "params"})  # e.g. a scheduler's lr
        # BEGIN LAB: step my share, then send every updated parameter from its owner to every rank
        # self.optim holds my share; self.owner maps each parameter to its owner's rank. Start the broadcasts
        # asynchronously (async_op=True), then wait on every handle before returning.
        loss = self.optim.step(closure)
        with torch.no_grad():
            handles = [dist.broadcast(p.detach(), src=owner, async_op=True) for p, owner in self.owner.items()]
        for handle in handles:
            handle.wait()
        return loss
        # END LAB

    def state_dict(self):
        """This rank's share of the optimizer state (the local optimizer's ``state_dict``)."""
        return self.optim.state_dict()

    def load_state_dict(self, state_dict) -> None:
        """Load ``state_dict``'s share of the optimizer state, saved by this rank at the same world size."""
        self.optim.load_state_dict(state_dict)


class FlatShard:
    """Parameters of the same dtype and device laid end to end in one flat buffer, padded to a multiple of N, and
    rank r's r-th equal piece of it: DeepSpeed's and FSDP1's flat parameter, used by ZeRO-2 and ZeRO-3.

    ``parameters`` are unique tensors; ``numels`` their sizes; ``shard_numel`` the size of each rank's piece.
    """

    def __init__(self, parameters: list[torch.Tensor], world_size: int):
        dtypes = {(p.dtype, p.device) for p in parameters}
        if len(dtypes) > 1:
            raise ValueError(f"one flat buffer needs one dtype and device, not {sorted(map(str, dtypes))}")
        self.dtype, self.device = parameters[0].dtype, parameters[0].device
        self.shapes = [p.shape for p in parameters]
        self.numels = [p.numel() for p in parameters]
        self.world_size = world_size
        self.shard_numel = math.ceil(sum(self.numels) / world_size)
        self.padding = self.shard_numel * world_size - sum(self.numels)

    def flatten(self, tensors) -> torch.Tensor:
        """One padded flat tensor of ``tensors`` (the parameters' shapes; ``None`` is zeros)."""
        pieces = [
            torch.zeros(numel, dtype=self.dtype, device=self.device) if t is None else t.reshape(-1)
            for t, numel in zip(tensors, self.numels)
        ]
        return torch.cat([*pieces, torch.zeros(self.padding, dtype=pieces[0].dtype, device=self.device)])

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The parameters as views into ``flat`` (one ``split``: its backward is one concatenation)."""
        pieces = flat.split([*self.numels, self.padding])
        return [piece.view(shape) for piece, shape in zip(pieces, self.shapes)]

    def piece(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s piece of ``flat`` (a view)."""
        return flat[rank * self.shard_numel : (rank + 1) * self.shard_numel]


class ZeRO2Optimizer(torch.optim.Optimizer):
    """ZeRO stage 2: optimizer states and gradients sharded; every rank keeps the whole parameters.

        optimizer = ZeRO2Optimizer(model, torch.optim.Adam, lr=1e-3)   # no DDP around the model
        loss.backward(); optimizer.step(); optimizer.zero_grad()

    At construction rank 0's parameters and buffers are broadcast, and the trainable parameters are cut into buckets
    of about ``bucket_cap_mb`` MiB by DDP's rule (``assign_buckets``: reverse order, the order backward produces
    them). Each bucket's parameters become views into one flat buffer, padded to a multiple of N and cut into N equal
    contiguous pieces (``FlatShard``); rank r's piece of each bucket (``self.pieces``) is what the local optimizer
    (``self.optim``) steps, in place, so stepping writes the module's parameters.

    During backward, a post-accumulate-grad hook copies each gradient into its bucket's flat gradient buffer (made when
    the bucket's first gradient arrives) and frees the ``.grad`` at once; as soon as a bucket is complete, and the
    buckets before it have started, it is reduce-scattered asynchronously: each rank receives the sum of its piece,
    divides it by N and adds it to its piece's ``.grad``, and the bucket's flat gradient is freed when the next bucket
    starts (one bucket in the air at a time). So a rank holds its 1/N of the gradients, plus the one or two buckets on
    their way, never the whole gradient, as DeepSpeed's stage 2, which also reduces its gradient buckets during
    backward, each rank keeping the slices it owns. (On gloo the measured peak also holds the copy that gloo's
    reduce-scatter makes of the bucket it sends: one bucket more.) At the end of each backward (an autograd engine
    callback) the buckets that did not complete are sent, with zeros for the missing gradients. ``step`` steps the
    pieces and all-gathers every bucket from its pieces. Per step, then, one reduce-scatter and one all-gather per
    bucket, of the padded bucket's bytes: on a ring each moves (N-1)/N of them, and DDP's all-reduce of the same buckets
    2(N-1)/N: the same bytes (an all-reduce is a reduce-scatter followed by an all-gather). After backward the module's
    parameters have no ``.grad``: the averaged gradients are the pieces' (``self.pieces[b].grad``). Two backward passes
    before a step add their reduce-scattered gradients into the pieces (gradient accumulation, with one reduce-scatter
    per backward, as DeepSpeed's stage 2).

    Flat pieces need an element-wise optimizer (SGD, Adam, AdamW, RMSprop, Adagrad...: torch.optim's common ones),
    since a piece holds parts of several parameters and the parts of one parameter lie on several ranks: an optimizer
    that looks at a whole tensor (a norm for LAMB's or LARS's trust ratio, Adafactor's row and column factors, Muon's
    orthogonalization) would see the wrong tensor. A parameter that receives no gradient in a backward gets zeros in
    the flat buffer, as in DeepSpeed and FSDP1: plain SGD leaves it alone, but momentum or Adam's moments still move
    it, unlike a plain optimizer, which skips a ``None`` gradient. Every rank's backward must reach at least one
    trainable parameter (the hooks start the buckets; a rank whose backward has none would start none). Frozen
    parameters are left out and stay as they are. A subclass of ``torch.optim.Optimizer`` whose ``param_groups`` and
    ``state`` are the local optimizer's, so an LR scheduler's change reaches it; ``state_dict`` is this rank's
    pieces'.
    """

    reduce_during_backward = True  # ZeRO-2; the paper's ZeRO-1 (FlatZeRO1Optimizer) reduces in step

    def __init__(self, module: nn.Module, optimizer_class, bucket_cap_mb: float = 25.0, **defaults):
        require_process_group(type(self).__name__)
        self.module, self.world_size, self.rank = module, dist.get_world_size(), dist.get_rank()
        broadcast_parameters_and_buffers(module)  # the same start on every rank, as DDP
        self.parameters = [p for p in module.parameters() if p.requires_grad]  # unique: tied ones once
        self.bucket_indices = assign_buckets(self.parameters, int(bucket_cap_mb * 2**20))
        self.layouts, self.flats, self.pieces, self.slot = [], [], [], {}
        with torch.no_grad():
            for b, bucket in enumerate(self.bucket_indices):
                params = [self.parameters[i] for i in bucket]
                layout = FlatShard(params, self.world_size)
                flat = layout.flatten(params)
                for p, view in zip(params, layout.views(flat)):
                    p.data = view  # the module's parameters now live in the bucket's flat buffer
                self.layouts.append(layout)
                self.flats.append(flat)
                self.pieces.append(nn.Parameter(layout.piece(flat, self.rank)))  # a view: stepping it writes flat
                self.slot.update((i, (b, position)) for position, i in enumerate(bucket))
        self.optim = optimizer_class(self.pieces, **defaults)
        super().__init__(self.pieces, self.optim.defaults)
        self.param_groups, self.state = self.optim.param_groups, self.optim.state  # one object, two names
        self._start_round()
        if self.reduce_during_backward:
            for i, p in enumerate(self.parameters):
                p.register_post_accumulate_grad_hook(lambda p, i=i: self._gradient_ready(i))

    def _start_round(self) -> None:
        self.grad_flats = [None] * len(self.bucket_indices)  # each bucket's flat gradient, while it fills
        self.pending = [len(bucket) for bucket in self.bucket_indices]  # gradients each bucket still waits for
        self.next_bucket, self.in_flight, self.callback_queued = 0, None, False

    def _gradient_ready(self, i: int) -> None:
        """The hook: move gradient ``i`` into its bucket, free it, and start every complete bucket, in order."""
        if not self.callback_queued:  # the end of this backward sends what did not complete
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self.callback_queued = True
        b, position = self.slot[i]
        if self.grad_flats[b] is None:  # zeros: padding, and gradients that never come, stay zero
            self.grad_flats[b] = self.flats[b].new_zeros(self.flats[b].numel())
        p = self.parameters[i]
        with torch.no_grad():
            self.layouts[b].views(self.grad_flats[b])[position].copy_(p.grad)
        p.grad = None  # the whole gradient lives on only in its bucket, until the bucket is sent
        self.pending[b] -= 1
        while self.next_bucket < len(self.pending) and self.pending[self.next_bucket] == 0:
            self._reduce_scatter_bucket(self.next_bucket)
            self.next_bucket += 1

    @torch.no_grad()
    def _reduce_scatter_bucket(self, b: int) -> None:
        """Start bucket ``b``'s reduce-scatter (its flat gradient, or its parameters' ``.grad``, freed), after
        finishing the one in the air."""
        flat_grad = self.grad_flats[b]
        if flat_grad is None:  # no hook filled it: ZeRO-1's step, or no gradient came on this rank
            params = [self.parameters[i] for i in self.bucket_indices[b]]
            flat_grad = self.layouts[b].flatten([p.grad for p in params])
            for p in params:
                p.grad = None
        self.grad_flats[b] = None
        self._finish_in_flight()
        received = torch.empty_like(self.pieces[b])
        handle = reduce_scatter_into(received, flat_grad, async_op=True)  # each rank receives its piece's sum
        self.in_flight = (b, handle, flat_grad, received)  # flat_grad must live until the collective is done

    @torch.no_grad()
    def _finish_in_flight(self) -> None:
        """Wait for the bucket in the air, average its piece into the piece's ``.grad``, free its flat gradient."""
        if self.in_flight is None:
            return
        b, handle, _, received = self.in_flight
        handle.wait()
        received.div_(self.world_size)
        piece = self.pieces[b]
        if piece.grad is None:
            piece.grad = received
        else:
            piece.grad += received  # a second backward before the step: accumulate
        self.in_flight = None

    def _finish_backward(self) -> None:
        """Send the buckets not sent yet, in order (zeros for missing gradients), and wait for the last one."""
        for b in range(self.next_bucket, len(self.bucket_indices)):
            self._reduce_scatter_bucket(b)
        self._finish_in_flight()
        self._start_round()

    @torch.no_grad()
    def step(self, closure=None):
        """Step this rank's pieces, then all-gather every bucket from its pieces into the parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.reduce_during_backward:
            self._finish_backward()  # ZeRO-1: every bucket reduce-scattered now, from the whole gradients
        self.optim.step()
        in_flight = None  # at most two buckets' all-gathers in the air: each holds buffers of a bucket's size
        for flat, piece in zip(self.flats, self.pieces):
            handle = all_gather_into(flat, piece.detach().clone(), async_op=True)  # a copy: no aliasing the output
            if in_flight is not None:
                in_flight.wait()
            in_flight = handle
        in_flight.wait()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the whole gradients (ZeRO-1's, or left without a hook) and this rank's gradient pieces."""
        for p in self.parameters:
            p.grad = None
        self.optim.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        """This rank's pieces of the optimizer state (the local optimizer's ``state_dict``)."""
        return self.optim.state_dict()

    def load_state_dict(self, state_dict) -> None:
        """Load ``state_dict``'s pieces of the optimizer state, saved by this rank at the same world size."""
        self.optim.load_state_dict(state_dict)


class FlatZeRO1Optimizer(ZeRO2Optimizer):
    """ZeRO stage 1 as the paper and DeepSpeed build it: ``ZeRO2Optimizer``'s buckets, pieces and traffic (one
    reduce-scatter and one all-gather per bucket, DDP's bytes), but the whole gradients are kept during backward
    (and added up over several backward passes, with no communication) and reduce-scattered in ``step``. The
    optimizer state is 1/N per rank, the gradients whole until the step, freed bucket by bucket as each is sent.
    ``ZeRO1Optimizer`` is the other ZeRO-1, ``ZeroRedundancyOptimizer``'s: under DDP, whole tensors, broadcasts.

        optimizer = FlatZeRO1Optimizer(model, torch.optim.Adam, lr=1e-3)   # no DDP around the model
    """

    reduce_during_backward = False


class ShardedUnit:
    """One communication unit of ``ZeRO3Model``: its trainable parameters as a ``FlatShard``, this rank's fp32 piece
    (``shard``, a ``nn.Parameter``), and where each parameter lives in the module (``slots``: module and attribute,
    several for a tied parameter), so that gathered views can be put there and taken away again."""

    def __init__(self, name: str, parameters, slots, names, compute_dtype, world_size: int, rank: int):
        self.name, self.slots, self.names = name, slots, names
        self.layout = FlatShard(parameters, world_size)
        self.world_size, self.compute_dtype = world_size, compute_dtype
        with torch.no_grad():
            flat = self.layout.flatten(parameters)
            self.shard = nn.Parameter(self.layout.piece(flat, rank).clone())  # the master piece, full precision
        # between gathers a parameter is a meta tensor: its shape, and no memory
        self.freed = [torch.empty(p.shape, dtype=p.dtype, device="meta") for p in parameters]
        self.prefetched = None  # (whole buffer, handle, source): an all-gather started before it is needed
        self.next_in_forward = self.previous_in_forward = None  # the units to prefetch (ZeRO3Model sets them)

    def put(self, tensors) -> None:
        """Make ``tensors`` the module's parameters (plain attributes: the ``nn.Parameter`` s are gone)."""
        for tensor, slots in zip(tensors, self.slots):
            for module, attribute in slots:
                setattr(module, attribute, tensor)

    def gather(self, async_op: bool = False):
        """All-gather the whole flat buffer, in the compute dtype (a bf16 gather sends half the bytes); with
        ``async_op``, start it and return the buffer, the handle and the source, which must live until the end."""
        dtype = self.compute_dtype or self.shard.dtype
        full = torch.empty(self.layout.shard_numel * self.world_size, dtype=dtype, device=self.shard.device)
        source = self.shard.detach().to(dtype)
        handle = all_gather_into(full, source, async_op=async_op)
        return (full, handle, source) if async_op else full

    def prefetch(self) -> None:
        """Start this unit's all-gather now, asynchronously, so that it runs while another unit computes."""
        if self.prefetched is None:
            self.prefetched = self.gather(async_op=True)

    def gathered(self) -> torch.Tensor:
        """The whole flat buffer: the prefetched all-gather's, once it is done, or one all-gathered now."""
        if self.prefetched is None:
            return self.gather()
        full, handle, _ = self.prefetched
        self.prefetched = None
        handle.wait()
        return full

    def drop_prefetched(self) -> None:
        """Finish and forget a prefetched all-gather that was never used (its shard may change before the next)."""
        if self.prefetched is not None:
            self.gathered()

    def reduce_scatter(self, flat_grad: torch.Tensor | None) -> torch.Tensor:
        """This rank's piece of the gradient averaged over ranks, in the shard's dtype (fp32: one reduce-scatter)."""
        if flat_grad is None:  # no parameter of the unit took part: zeros, so that every rank still joins in
            flat_grad = torch.zeros(self.layout.shard_numel * self.world_size, device=self.shard.device)
        grad = torch.empty_like(self.shard)
        reduce_scatter_into(grad, flat_grad.to(self.shard.dtype).contiguous())
        return grad.div_(self.world_size)


class _GatheredUnitFunction(torch.autograd.Function):
    """A unit's forward between an all-gather and a free; its backward gathers again, recomputes, reduce-scatters."""

    @staticmethod
    def forward(ctx, unit, run, kwargs, shard, *args):
        ctx.unit, ctx.run, ctx.kwargs = unit, run, kwargs
        ctx.rng = _rng_state(shard.device)  # the recompute must draw the same dropout masks
        ctx.tensor_positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_positions))
        full = unit.gathered()  # prefetched while the unit before computed, or gathered now
        if unit.next_in_forward is not None:
            unit.next_in_forward.prefetch()  # the next unit's all-gather runs while this one computes
        unit.put(unit.layout.views(full))
        try:
            return run(*args, **kwargs)  # autograd records nothing inside a Function's forward
        finally:
            unit.put(unit.freed)  # the gathered buffer is freed here; only the shard remains

    @staticmethod
    def backward(ctx, *grad_outputs):
        unit, args = ctx.unit, list(ctx.others)
        needs_grad = [ctx.needs_input_grad[4 + position] for position in ctx.tensor_positions]
        inputs = [t.detach().requires_grad_(needed) for t, needed in zip(ctx.saved_tensors, needs_grad)]
        for position, tensor in zip(ctx.tensor_positions, inputs):
            args[position] = tensor
        full = unit.gathered().requires_grad_()  # gathered again (the forward freed it), or prefetched
        if unit.previous_in_forward is not None:
            unit.previous_in_forward.prefetch()  # backward goes on with the unit before: its gather starts now
        with torch.enable_grad(), _replayed_rng(ctx.rng, full.device):
            unit.put(unit.layout.views(full))
            outputs = ctx.run(*args, **ctx.kwargs)  # the recompute (activation checkpointing)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if g is not None and o.requires_grad]
        wanted = [full, *(t for t in inputs if t.requires_grad)]
        grads = list(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True))
        unit.put(unit.freed)
        grad_shard = unit.reduce_scatter(grads.pop(0))  # autograd adds it into shard.grad: accumulation works
        input_grads = [grads.pop(0) if t.requires_grad else None for t in inputs]
        all_grads = [None] * len(args)
        for position, grad in zip(ctx.tensor_positions, input_grads):
            all_grads[position] = grad
        return None, None, None, grad_shard, *all_grads


class _GatheredRootFunction(torch.autograd.Function):
    """The root unit: gathered once at the start of forward, kept for the whole step, reduce-scattered at the end
    of backward (the root's gradient is complete only when backward has gone through everything)."""

    @staticmethod
    def forward(ctx, unit, shard):
        ctx.unit = unit
        return unit.gather()

    @staticmethod
    def backward(ctx, flat_grad):
        ctx.unit.put(ctx.unit.freed)
        return None, ctx.unit.reduce_scatter(flat_grad)


def _rng_state(device: torch.device):
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


@contextmanager
def _replayed_rng(state, device: torch.device):
    """Run a block with the random number generators as ``_rng_state`` saved them; restore them after."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


def _default_units(module: nn.Module) -> list[nn.Module]:
    """The module's children that have parameters; containers (``ModuleList``, ``ModuleDict``), which have no
    forward to wrap, give their children instead."""
    units = []
    for child in module.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            units += _default_units(child)
        elif any(True for _ in child.parameters()):
            units.append(child)
    return units


class ZeRO3Model(nn.Module):
    """ZeRO stage 3, fully sharded: each rank keeps 1/N of every parameter, of its gradient and of its optimizer
    states; a unit's whole parameters exist only while it computes.

        net = ZeRO3Model(model, units=list(model.blocks))     # rank 0's parameters, cut into shards
        optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)   # AFTER wrapping: it must see the shards
        loss = F.cross_entropy(net(X), y); loss.backward(); optimizer.step()

    ``units`` (default: the module's children that have parameters, a ``ModuleList``'s items one by one) are the
    modules gathered one at a time; the trainable parameters outside them form the root unit. Each unit's trainable
    parameters are laid end to end in a padded flat buffer (``FlatShard``) of which each rank keeps its 1/N, an fp32
    ``nn.Parameter``; the original ``nn.Parameter`` s leave the module, so ``parameters()`` yields the shards (and
    the frozen parameters, which stay whole and unsharded), and the optimizer must be built after wrapping, with an
    element-wise ``torch.optim`` class (see ``ZeRO2Optimizer`` for why), as under FSDP2.

    A unit's forward runs inside a ``torch.autograd.Function``: it all-gathers the unit, puts views of the gathered
    buffer where the parameters were, runs the unit without recording a graph, and frees the buffer. Its backward
    all-gathers again, **recomputes the unit's forward** with autograd on, backpropagates through it, and
    reduce-scatters the flat gradient (in fp32, divided by N): each rank receives its piece, which autograd adds
    into the shard's ``.grad``. Recomputing is activation checkpointing: it keeps only each unit's inputs, and costs
    one more forward of every unit per step (about a third more compute for a Linear stack). FSDP does not
    recompute: it keeps the gathered parameter tensors that autograd saved, frees their *storage* after forward
    (``free_storage``, ``storage.resize_(0)``, in ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``; FSDP1's
    ``_free_storage`` in ``_flat_param.py``) and refills the same storage before backward (``alloc_storage``), so
    autograd finds its saved weights again. That needs the autograd graph to hold the same tensor objects, which a
    plain autograd Function cannot arrange without those storage tricks.

    With ``prefetch`` (the default), a unit's all-gather does not wait for its turn: as unit k starts its forward,
    it starts unit k+1's all-gather asynchronously, which then runs while unit k computes; as unit k starts its
    backward, it starts unit k-1's (FSDP's forward and backward prefetch: ``set_modules_to_forward_prefetch`` and
    ``set_modules_to_backward_prefetch`` in FSDP2). "Next" is the next in ``units``: give them in the order forward
    runs them (the default order, the module's children, is). A unit that runs out of that order is still right,
    only gathered without overlap; a prefetched gather left unused is dropped at the next forward. Two units' whole
    parameters exist at once, instead of one: the memory that buys the overlap. The collectives are the same.

    The root unit (the parameters outside ``units``, tied parameters among them) is gathered once at the start of
    forward and kept until the end of its backward, as FSDP2 keeps its root (``fully_shard``'s
    ``reshard_after_forward`` is ``False`` for the root by default: backward starts with the root's last layers, so
    freeing them would only gather them again at once); its activations are kept, not recomputed. A forward under
    ``torch.no_grad()`` (evaluation) frees the root at once. Per training step: all-gathers = 1 (root) + 2 per unit,
    reduce-scatters = 1 per unit, the root included.

    ``compute_dtype`` (``torch.bfloat16`` or ``torch.float16``): the gathered weights, hence forward and backward,
    are in that dtype (half the all-gather bytes), and each unit's floating-point inputs are cast to it (FSDP2's
    ``cast_forward_inputs``); the shards stay fp32 (the master weights) and the gradients are reduce-scattered in
    fp32; frozen parameters are stored in it, whole (never stepped, they need no master copy).

    A parameter that receives no gradient in a step, on some ranks or on all, gets zeros in its unit's flat gradient
    (as in ``ZeRO2Optimizer``: momentum or Adam's moments still move it) when the unit ran forward and backward; a
    unit that no rank ran leaves its shard's ``.grad`` at ``None``, and the optimizer skips the shard, as one
    process skips a parameter with no gradient. Every rank must run each unit the same number of times: a gather
    or reduce-scatter that one rank starts and another does not hangs them both, as under FSDP.

    A parameter shared by two units is a ``ValueError``: put the modules that share it into one unit, or leave them
    out of ``units`` (the root unit then holds it). Units take tensors as positional arguments (non-tensor keywords
    are fine) and return a tensor or a tuple of tensors; a unit with BatchNorm would update its running statistics
    twice per step (the recompute), as under ``torch.utils.checkpoint``. Under ``compute_dtype`` the model's output
    is in that dtype too (FSDP2's default ``output_dtype``).
    """

    def __init__(self, module: nn.Module, units=None, compute_dtype: torch.dtype | None = None, prefetch: bool = True):
        super().__init__()
        require_process_group("ZeRO3Model")
        world_size, rank = dist.get_world_size(), dist.get_rank()
        broadcast_parameters_and_buffers(module)  # every shard cut from the same model
        self.module, self.compute_dtype = module, compute_dtype
        units = _default_units(module) if units is None else list(units)
        unit_names = _unit_names(module, units)
        # Who owns each trainable parameter: the unit whose subtree registers it ("" for the root), everywhere.
        owners, slots, names = {}, {}, {}
        for path, submodule in module.named_modules(remove_duplicate=False):
            owner = next((name for name in unit_names if path == name or path.startswith(name + ".")), "")
            for attribute, p in submodule._parameters.items():
                if p is None or not p.requires_grad:
                    continue  # frozen parameters stay whole, where they are
                owners.setdefault(p, set()).add(owner)
                if (submodule, attribute) not in slots.setdefault(p, []):  # a module reached by two paths: once
                    slots[p].append((submodule, attribute))
                names.setdefault(p, f"{path}.{attribute}" if path else attribute)
        for p, found in owners.items():
            if len(found) > 1:
                places = ", ".join(sorted(f"unit {name!r}" if name else "the root" for name in found))
                raise ValueError(
                    f"parameter {names[p]!r} is shared by {places}: put the modules that share it into one unit, or "
                    "leave them out of `units`, so that it belongs to the root unit (gathered from forward to backward)"
                )
        self.parameter_names = [name for name, _ in module.named_parameters()]  # for gather_full_parameters
        if compute_dtype is not None:  # frozen parameters are never stepped: stored in the compute dtype, no master
            for p in module.parameters():
                if not p.requires_grad and p.is_floating_point():
                    p.data = p.data.to(compute_dtype)
        self.units = []
        for name in [*unit_names, ""]:  # the root unit last
            params = [p for p in owners if owners[p] == {name}]
            if not params:
                continue
            self.units.append(
                ShardedUnit(
                    name,
                    params,
                    [slots[p] for p in params],
                    [names[p] for p in params],
                    compute_dtype,
                    world_size,
                    rank,
                )  # fmt: skip
            )
            for p in params:
                for submodule, attribute in slots[p]:
                    del submodule._parameters[attribute]
            self.units[-1].put(self.units[-1].freed)  # plain attributes now, not parameters
        self.shards = nn.ParameterList(unit.shard for unit in self.units)  # what parameters() yields
        self.root = self.units[-1] if self.units and self.units[-1].name == "" else None
        for unit in self.units:
            if unit is not self.root:
                submodule = module.get_submodule(unit.name)
                submodule.forward = partial(self._unit_forward, unit, submodule.forward)
        chain = [unit for unit in self.units if unit is not self.root]  # in the order of units: forward's
        if prefetch:
            for unit, following in zip(chain, chain[1:]):
                unit.next_in_forward, following.previous_in_forward = following, unit

    def _unit_forward(self, unit: ShardedUnit, run, *args, **kwargs):
        if any(isinstance(value, torch.Tensor) for value in kwargs.values()):
            raise TypeError(f"unit {unit.name!r}: pass tensors as positional arguments, so that they get gradients")
        return _GatheredUnitFunction.apply(unit, run, kwargs, unit.shard, *self._cast(args))

    def _cast(self, args):
        if self.compute_dtype is None:
            return args
        return tuple(a.to(self.compute_dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)

    def forward(self, *args, **kwargs):
        """Gather the root unit (kept until its backward), then run the module; each unit gathers itself."""
        args = self._cast(args)
        for unit in self.units:
            unit.drop_prefetched()  # one prefetched in the last step but not used is stale: the shards moved
        if self.root is None:
            return self.module(*args, **kwargs)
        self.root.put(self.root.layout.views(_GatheredRootFunction.apply(self.root, self.root.shard)))
        output = self.module(*args, **kwargs)
        if not torch.is_grad_enabled():
            self.root.put(self.root.freed)  # no backward will come to free it
        return output


def _unit_names(module: nn.Module, units) -> list[str]:
    """The path of each unit in ``module``; a ``ValueError`` for a unit that is not in it, in it twice, or inside
    another unit."""
    paths = {}
    for path, submodule in module.named_modules(remove_duplicate=False):
        paths.setdefault(id(submodule), []).append(path)
    names = []
    for unit in units:
        found = paths.get(id(unit), [])
        if len(found) != 1 or found[0] == "":
            raise ValueError(
                f"each unit must be a submodule of the model, in it once; {type(unit).__name__} is at {found}"
            )
        names.append(found[0])
    for name in names:
        if any(name.startswith(other + ".") for other in names):
            raise ValueError(f"unit {name!r} is inside another unit: units must not nest")
    return names


@torch.no_grad()
def gather_full_parameters(model: ZeRO3Model) -> dict[str, torch.Tensor]:
    """Every parameter of ``model.module`` whole, by its name in the original module (``named_parameters``' names
    and order; a tied parameter once), for checking and saving. All-gathers: call on every rank."""
    gathered = {}
    for unit in model.units:
        full = torch.empty(unit.layout.shard_numel * unit.layout.world_size, dtype=unit.shard.dtype,
                           device=unit.shard.device)  # fmt: skip
        all_gather_into(full, unit.shard.detach())  # the fp32 master pieces, whatever the compute dtype
        gathered.update(zip(unit.names, unit.layout.views(full)))
    gathered.update((name, p.detach()) for name, p in model.module.named_parameters())  # the frozen ones, whole
    return {name: gathered[name] for name in model.parameter_names}
