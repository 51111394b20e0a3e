"""Allreduce by hand, from point-to-point messages: what ``dist.all_reduce`` does for you.

Each function sums a tensor over all ranks, in place, so that every rank ends with the same total; call it on
every rank. They are for learning and measuring, not for training: NCCL and gloo do the same thing faster.

- ``naive_all_reduce``: everyone sends to rank 0, rank 0 adds and sends the total back. Rank 0 moves
  2(N-1) full tensors while the others idle: its link is the bottleneck, and it gets worse with every rank.
- ``ring_all_reduce``: the ranks form a ring and the tensor is cut into N chunks. N-1 reduce-scatter steps
  leave each rank with the full sum of one chunk; N-1 all-gather steps pass the finished chunks round. Every
  rank sends 2(N-1)/N of the tensor, whatever N is: bandwidth-optimal.
- ``hand_made_all_reduces``: both of them against ``dist.all_reduce`` on one tensor, run on every rank of a
  group (``common.launch.run_on_ranks``), as lesson 01's notebook shows it.
- ``all_reduce_gradients``: average a model's gradients with one collective over one flat bucket, instead of
  one collective per parameter.
- ``AllReduceCounter``: a DDP communication hook that counts the allreduces DDP makes, their bytes and starts.
- ``count_messages``: counts the point-to-point messages (and bytes) one rank sends and receives in a block.
- ``all_gather_into``, ``reduce_scatter_into``: the two collectives of sharding, under any PyTorch's name.
- ``count_collectives``: records the collectives one rank starts in a block: which, how many bytes, when.
- ``wrapped_dist_functions``: functions of ``torch.distributed`` replaced by wrappers for a block (both counters').
"""

import inspect
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook


def naive_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over ranks in place: reduce to rank 0 with sends, then send the total to every rank."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        incoming = torch.empty_like(tensor)
        for source in range(1, world_size):
            dist.recv(incoming, src=source)
            tensor += incoming
        for destination in range(1, world_size):
            dist.send(tensor, dst=destination)
    else:
        dist.send(tensor, dst=0)
        dist.recv(tensor, src=0)
    return tensor


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a contiguous ``tensor`` over ranks in place with a ring: reduce-scatter, then all-gather.

    Works for any size: ``tensor_split`` cuts chunks whose sizes differ by at most one element (some may be
    empty when the tensor has fewer elements than there are ranks).
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size == 1:
        return tensor
    chunks = tensor.view(-1).tensor_split(world_size)  # views: writing a chunk writes the tensor
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    incoming = torch.empty_like(chunks[0])  # the first chunk is the largest

    # Reduce-scatter. At step s, rank r passes its partial sum of chunk (r - s) to the right and adds the left
    # neighbour's partial sum of chunk (r - s - 1) to its own. After N-1 steps, chunk (r + 1) is complete on r.
    for step in range(world_size - 1):
        send_chunk = chunks[(rank - step) % world_size]
        recv_chunk = chunks[(rank - step - 1) % world_size]
        received = incoming[: recv_chunk.numel()]
        exchange(send_chunk, right, received, left)
        recv_chunk += received

    # All-gather. At step s, rank r passes the complete chunk (r + 1 - s) to the right and receives the complete
    # chunk (r - s) from the left, straight into place.
    for step in range(world_size - 1):
        exchange(chunks[(rank + 1 - step) % world_size], right, chunks[(rank - step) % world_size], left)
    return tensor


def exchange(send: torch.Tensor, destination: int, receive: torch.Tensor, source: int) -> None:
    """Send ``send`` to rank ``destination`` while receiving into ``receive`` from rank ``source``.

    Both messages are posted before waiting on either. That matters in a ring: if every rank first did a
    blocking send, all would wait for a receive that nobody has posted yet. Empty tensors are skipped.
    """
    requests = []
    if send.numel():  # an empty chunk has nothing to send; its receiver knows, and posts no receive
        requests.append(dist.isend(send, destination))
    if receive.numel():
        requests.append(dist.irecv(receive, source))
    for request in requests:
        request.wait()


def hand_made_all_reduces(env, size: int = 10) -> dict:
    """Run the naive and the ring all-reduce on a tensor of ``size`` (need not divide by the world size) and
    report whether each equals ``dist.all_reduce``'s result."""
    data = torch.arange(size, dtype=torch.float64) * (env.rank + 1)
    expected = data.clone()
    dist.all_reduce(expected)
    return {
        "naive": torch.equal(naive_all_reduce(data.clone()), expected),
        "ring": torch.equal(ring_all_reduce(data.clone()), expected),
        "sum": expected[:4].tolist(),
    }


def all_reduce_gradients(model: nn.Module, all_reduce=dist.all_reduce) -> None:
    """Average every parameter's gradient over ranks with ONE collective on one flat buffer (one bucket).

    One big message instead of one per parameter: fewer, larger messages use the links far better. ``all_reduce``
    is any in-place sum (``dist.all_reduce``, ``ring_all_reduce``, ``naive_all_reduce``).
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    bucket = torch.cat([g.reshape(-1) for g in grads])
    all_reduce(bucket)
    bucket /= dist.get_world_size()  # sum, then divide: any backend, any version
    offset = 0
    for g in grads:
        g.copy_(bucket[offset : offset + g.numel()].view_as(g))  # in place: the optimizer holds these tensors
        offset += g.numel()


@dataclass
class AllReduceCounter:
    """How many allreduces DDP started, and how many bytes they carried, since ``attach`` or ``reset``; and each
    bucket's start, ``(time.perf_counter(), bytes)``.

        counter = AllReduceCounter.attach(ddp_model)   # before the first forward
        ...train...
        counter.calls, counter.bytes, counter.starts

    It registers a communication hook that counts each gradient bucket, then all-reduces it exactly as DDP's
    default does (sum, divide by the world size), so training is unchanged.
    """

    calls: int = 0
    bytes: int = 0
    process_group: object = None  # DDP's: the data-parallel ranks (None: the whole world)
    starts: list = field(default_factory=list)

    @classmethod
    def attach(cls, ddp_model) -> "AllReduceCounter":
        counter = cls(process_group=ddp_model.process_group)
        ddp_model.register_comm_hook(counter, _counting_all_reduce_hook)
        return counter

    def reset(self) -> None:
        self.calls, self.bytes, self.starts = 0, 0, []


def _counting_all_reduce_hook(counter: AllReduceCounter, bucket: dist.GradBucket):
    size = bucket.buffer().numel() * bucket.buffer().element_size()
    counter.calls += 1
    counter.bytes += size
    counter.starts.append((time.perf_counter(), size))
    return allreduce_hook(counter.process_group, bucket)  # over DDP's group, divided by its size


@dataclass
class MessageCount:
    """Point-to-point messages one rank posted, and the bytes they carried (``count_messages`` fills it)."""

    sends: int = 0
    receives: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    grouped: int = 0  # of those sends and receives, the ones posted in a ``dist.batch_isend_irecv`` group


@contextmanager
def count_messages():
    """Count this rank's ``dist.send``/``isend`` and ``dist.recv``/``irecv`` calls inside the block.

        with count_messages() as count:
            ring_all_reduce(tensor)
        count.sends, count.receives, count.bytes_sent

    It wraps the four functions of ``torch.distributed`` for the duration of the block, so it sees the calls
    that code makes through ``dist.<name>`` (as this module does), not messages a backend sends inside its own
    collectives such as ``dist.all_reduce``. It counts each ``isend``/``irecv`` of a ``dist.batch_isend_irecv``
    group too: ``dist.P2POp`` accepts only the real ``isend``/``irecv``, so inside the block it is handed them.
    """
    count = MessageCount()

    def tally(name, tensor):
        size = tensor.numel() * tensor.element_size()
        if name in ("send", "isend"):
            count.sends, count.bytes_sent = count.sends + 1, count.bytes_sent + size
        else:
            count.receives, count.bytes_received = count.receives + 1, count.bytes_received + size

    def counting(name, original):
        if name == "P2POp":  # built from the wrappers below: unwrap them, P2POp checks its op by identity

            def build(op, *args, **kwargs):
                return original(getattr(op, "__wrapped__", op), *args, **kwargs)

            return build
        if name == "batch_isend_irecv":  # its ops hold the real isend/irecv, which do not count: count here

            def batch(ops):
                for op in ops:
                    tally(op.op.__name__, op.tensor)
                count.grouped += len(ops)
                return original(ops)

            return batch

        def wrapper(tensor, *args, **kwargs):
            tally(name, tensor)
            return original(tensor, *args, **kwargs)

        wrapper.__wrapped__ = original
        return wrapper

    with wrapped_dist_functions(("send", "isend", "recv", "irecv", "P2POp", "batch_isend_irecv"), counting):
        yield count


@contextmanager
def wrapped_dist_functions(names, make_wrapper):
    """Inside the block, each ``torch.distributed.<name>`` of ``names`` that this PyTorch has is
    ``make_wrapper(name, original)``; the originals come back after it, on an error too.

    Code that looks the function up at each call (``dist.all_reduce(...)``, as this course's code does) goes through
    the wrapper; code that bound the function before the block, or calls C++ (DDP's reducer), does not.
    """
    originals = {name: getattr(dist, name) for name in names if hasattr(dist, name)}
    for name, original in originals.items():
        setattr(dist, name, make_wrapper(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def all_gather_into(output: torch.Tensor, shard: torch.Tensor, async_op: bool = False, group=None):
    """All-gather every rank's equal-sized ``shard`` into ``output`` (rank 0's first): ``dist.all_gather_single``
    over ``group`` (None: every rank).

    PyTorch 2.14 renamed ``all_gather_into_tensor`` to ``all_gather_single`` and deprecated the old name; older
    versions (the GPU machine's 2.11, say) may have only the old one. Looked up at each call, so that
    ``count_collectives`` sees it.
    """
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, shard, group=group, async_op=async_op)


def reduce_scatter_into(output: torch.Tensor, input: torch.Tensor, async_op: bool = False, group=None):
    """Sum ``input`` over the ranks of ``group`` (None: every rank) and leave rank r's r-th equal chunk of the sum in
    ``output``:
    ``dist.reduce_scatter_single`` (``reduce_scatter_tensor`` before PyTorch 2.14; see ``all_gather_into``)."""
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return reduce_scatter(output, input, group=group, async_op=async_op)


# The tensor whose size a collective's bytes are counted from: the one it reduces, broadcasts or gathers in full.
COUNTED_COLLECTIVES = {
    "all_reduce": lambda tensor, *args, **kwargs: [tensor],
    "broadcast": lambda tensor, *args, **kwargs: [tensor],
    "reduce_scatter_single": lambda output, input, *args, **kwargs: [input],  # the whole, before scattering
    "all_gather_single": lambda output, input, *args, **kwargs: [output],  # the whole, once gathered
    "reduce_scatter_tensor": lambda output, input, *args, **kwargs: [input],  # their names before PyTorch 2.14
    "all_gather_into_tensor": lambda output, input, *args, **kwargs: [output],
    "all_gather": lambda tensor_list, tensor, *args, **kwargs: tensor_list,
    "reduce_scatter": lambda output, input_list, *args, **kwargs: input_list,
    "all_to_all_single": lambda output, input, *args, **kwargs: [input],  # the rows this rank sends, itself included
}


@dataclass
class CollectiveCall:
    """One collective a rank started: its name in ``torch.distributed``, the bytes of the whole tensor it works on
    (the all-reduced or broadcast tensor, the reduce-scattered input, the all-gathered output), whether it was
    started asynchronously, when (``time.perf_counter()`` at the call), when the call returned (for a blocking
    call, when the collective had finished on this rank; for an asynchronous one, when it was queued), and the
    global ranks of its group."""

    name: str
    bytes: int
    async_op: bool
    started: float
    group_ranks: tuple[int, ...] = ()
    returned: float = 0.0


@dataclass
class CollectiveLog:
    """The collectives a rank started inside ``count_collectives``, in order."""

    calls: list[CollectiveCall] = field(default_factory=list)

    def count(self, name: str | None = None) -> int:
        """How many calls of collective ``name`` (all of them with ``None``)."""
        return sum(1 for call in self.calls if name in (None, call.name))

    def bytes(self, name: str | None = None) -> int:
        """The bytes of the calls of collective ``name`` (all of them with ``None``), added up."""
        return sum(call.bytes for call in self.calls if name in (None, call.name))


@contextmanager
def count_collectives():
    """Record every collective of ``COUNTED_COLLECTIVES`` this rank starts inside the block.

        with count_collectives() as log:
            loss.backward()
            net.finish_gradient_synchronization()
        log.count("all_reduce"), log.bytes("all_reduce"), log.calls[0].started

    Like ``count_messages``, it wraps the functions of ``torch.distributed`` for the duration of the block: it sees
    the calls that Python code makes through ``dist.<name>`` (this course's hand-built DDP and ZeRO, and FSDP2's
    own collectives), not those that ``DistributedDataParallel``'s C++ reducer makes: count those with
    ``AllReduceCounter``.
    """
    log = CollectiveLog()

    def counting(name, original):
        signature = inspect.signature(original)

        def wrapper(*args, **kwargs):
            tensors = COUNTED_COLLECTIVES[name](*args, **kwargs)
            size = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
            group = signature.bind(*args, **kwargs).arguments.get("group") or dist.group.WORLD
            ranks = tuple(dist.get_process_group_ranks(group))
            call = CollectiveCall(name, size, bool(kwargs.get("async_op", False)), time.perf_counter(), ranks)
            log.calls.append(call)
            result = original(*args, **kwargs)
            call.returned = time.perf_counter()
            return result

        return wrapper

    with wrapped_dist_functions(COUNTED_COLLECTIVES, counting):
        yield log
