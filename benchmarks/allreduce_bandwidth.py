"""Where an allreduce's time goes: messages, point-to-point latency and bandwidth, local copies and additions.

    torchrun --standalone --nproc_per_node=2 benchmarks/allreduce_bandwidth.py
    torchrun --standalone --nproc_per_node=4 benchmarks/allreduce_bandwidth.py --sizes 4K 1M 16M

Lesson 01 times ``naive_all_reduce``, ``ring_all_reduce`` (``common/collectives.py``) and ``dist.all_reduce``
(``solutions/07_ring_allreduce.py``). This script takes those times apart, in four tables:

1. messages: how many point-to-point messages each rank posts per allreduce, and the bytes it sends and
   receives, counted exactly by wrapping ``dist.send``/``isend``/``recv``/``irecv`` (``count_messages``).
2. point to point: rank 0 and rank 1 alone. "one-way" is half a ping-pong (0 sends, 1 sends it back);
   "exchange" is what one ring step does: every rank sends to its right and receives from its left at once
   (``common.collectives.exchange``). A least-squares fit t = a + n / B, relative errors weighted equally,
   gives each a fixed cost a per message and a bandwidth B.
3. local memory, one process: ``copy_`` and the in-place addition ``+=`` that both allreduces do, also in GB/s
   of the tensor's size, to compare with the B of table 2; and the first write to a buffer just allocated
   (``torch.empty_like``, as both allreduces do per call) against a write to one in use: the difference is
   what fresh memory costs (a page fault per page, when the allocator takes it from the kernel).
4. allreduce: measured, and predicted from tables 2 and 3 by the message pattern of each algorithm (naive: rank 0
   receives, adds and sends N-1 full tensors one after the other, into one fresh buffer of S; ring: 2(N-1)
   exchanges of S/N and N-1 additions of S/N, into one fresh buffer of S/N).

Each round's figure is the median of ``--iterations`` calls, each timed as the slowest rank saw it, after a
barrier. The measurements take turns call by call, and every table prints the best round with the median
of the rounds beside it; the fits and predictions use the best rounds, as ``timeit`` does: on a shared machine
other work can only slow a measurement down.
"""

import statistics

import torch
import torch.distributed as dist

from common.cli import argument_parser, parse_size, positive_int
from common.collectives import count_messages, exchange, naive_all_reduce, ring_all_reduce
from common.distributed import BACKENDS, print0, setup_distributed, teardown_distributed
from common.metrics import slowest_rank_seconds
from common.reports import run_header

ALGORITHMS = {"naive": naive_all_reduce, "ring": ring_all_reduce, "dist.all_reduce": dist.all_reduce}


def parse_args(argv=None):
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        nargs="+",
        default=["4", "4K", "64K", "1M", "4M", "16M", "64M"],
        help="tensor sizes in bytes (float32), e.g. 4K 16M",
    )
    parser.add_argument("--iterations", type=positive_int, default=10, help="timed calls per round")
    parser.add_argument("--rounds", type=positive_int, default=5, help="the measurements take turns; medians")
    parser.add_argument("--backend", choices=BACKENDS, default="auto")
    return parser.parse_args(argv)


def point_to_point(rank: int, world_size: int, tensors: dict):
    """The three measured building blocks, for one size: one-way message, ring exchange, local add and copy."""
    full, chunk, received, other = tensors["full"], tensors["chunk"], tensors["received"], tensors["other"]

    def one_way():  # a ping-pong between ranks 0 and 1; the time is halved by the caller
        if rank == 0:
            dist.send(full, 1)
            dist.recv(full, 1)
        elif rank == 1:
            dist.recv(full, 0)
            dist.send(full, 0)

    def ring_exchange():  # one step of the ring: every rank sends right and receives from the left, together
        exchange(chunk, (rank + 1) % world_size, received, (rank - 1) % world_size)

    # Both allreduces receive into a buffer they allocate per call (naive: S on rank 0; ring: S/N on every rank).
    # Memory the allocator takes fresh from the kernel costs a page fault per page at its first write.
    return {
        "one-way": (one_way, 0.5),
        "exchange": (ring_exchange, 1.0),
        "add": (lambda: full.add_(other), 1.0),
        "add chunk": (lambda: chunk.add_(received), 1.0),
        "copy": (lambda: full.copy_(other), 1.0),
        "write": (lambda: full.fill_(2.0), 1.0),
        "new": (lambda: torch.empty_like(full).fill_(2.0), 1.0),
        "new chunk": (lambda: torch.empty_like(chunk).fill_(2.0), 1.0),
        "write chunk": (lambda: chunk.fill_(2.0), 1.0),
    }


def message_numels(size: int, world_size: int):
    """float32 elements of the whole tensor and of the ring's largest chunk, for a tensor of ``size`` bytes."""
    numel = max(1, size // 4)
    return numel, -(-numel // world_size)


def fit_latency_and_bandwidth(sizes, seconds):
    """Least-squares t = a + n / B with each size's relative error weighted equally: (a seconds, B bytes/s)."""
    weights = torch.tensor([1 / t for t in seconds], dtype=torch.float64)
    design = torch.tensor([[1.0, n] for n in sizes], dtype=torch.float64) * weights[:, None]
    a, per_byte = torch.linalg.lstsq(design, torch.ones(len(sizes), dtype=torch.float64)).solution.tolist()
    return a, 1 / per_byte


def main(args):
    env = setup_distributed(args.backend)
    try:
        rank, world_size, device = env.rank, env.world_size, env.device
        if world_size < 2:
            raise SystemExit("error: run with at least 2 processes (torchrun --nproc_per_node=2 ...)")
        print0(run_header())
        print0(
            f"{world_size} processes, backend {env.backend}, device {device.type}, "
            f"{torch.get_num_threads()} thread(s) per process, PyTorch {torch.__version__}; float32 tensors"
        )
        sizes = [parse_size(size) for size in args.sizes]
        print_message_counts(rank, world_size, device, max(sizes))

        names = [
            "one-way",
            "exchange",
            "add",
            "add chunk",
            "copy",
            "write",
            "new",
            "write chunk",
            "new chunk",
            *ALGORITHMS,
        ]
        rounds = {(size, name): [] for size in sizes for name in names}
        for _ in range(args.rounds):
            for size in sizes:
                numel, chunk_numel = message_numels(size, world_size)
                tensors = {
                    "full": torch.ones(numel, device=device),
                    "other": torch.ones(numel, device=device),
                    "chunk": torch.ones(chunk_numel, device=device),
                    "received": torch.ones(chunk_numel, device=device),
                }
                operations = point_to_point(rank, world_size, tensors)
                operations.update({name: (lambda f=f, t=tensors["full"]: f(t), 1.0) for name, f in ALGORITHMS.items()})
                calls = {name: [] for name in names}
                for iteration in range(args.iterations + 1):  # the operations take turns, call by call
                    for name in names:
                        operation, factor = operations[name]
                        seconds = factor * slowest_rank_seconds(operation, device)
                        if iteration:  # the first call allocates and connects: left out
                            calls[name].append(seconds)
                    for tensor in tensors.values():
                        tensor.fill_(1.0)  # repeated sums grow the values; keep them finite
                for name in names:
                    rounds[(size, name)].append(statistics.median(calls[name]))
        # Other work on a shared machine can only slow a round down: the best round is the figure to explain,
        # the median shows how much the load moved it.
        best = {key: min(values) for key, values in rounds.items()}
        median = {key: statistics.median(values) for key, values in rounds.items()}
        print_point_to_point(args.sizes, sizes, best, median)
        print_all_reduce(args.sizes, sizes, world_size, best, median)
    finally:
        teardown_distributed()


def print_message_counts(rank, world_size, device, size):
    """Table 1: messages and bytes per rank for one allreduce of ``size`` bytes, counted, not derived."""
    tensor = torch.ones(max(world_size, size // 4 // world_size * world_size), device=device)  # divides by N
    counts = {}
    for name in ("naive", "ring"):
        with count_messages() as count:
            ALGORITHMS[name](tensor)
        counts[name] = [count.sends, count.receives, count.bytes_sent, count.bytes_received]
    everyone = [None] * world_size
    dist.all_gather_object(everyone, counts)
    S = tensor.numel() * tensor.element_size()
    print0(f"\n1. point-to-point messages per allreduce of S = {S:,} bytes, per rank (counted)")
    print0(f"{'algorithm':>10} {'rank':>5} {'sends':>6} {'receives':>9} {'sent (x S)':>11} {'received (x S)':>15}")
    for name in ("naive", "ring"):
        for r, rank_counts in enumerate(everyone):
            sends, receives, sent, received = rank_counts[name]
            print0(f"{name:>10} {r:>5} {sends:>6} {receives:>9} {sent / S:>11.3f} {received / S:>15.3f}")


def fresh_cost(best, size, name) -> float:
    """Seconds a new buffer's first write takes beyond a write to a buffer in use: page faults, zeroing."""
    in_use = "write chunk" if name == "new chunk" else "write"
    return max(0.0, best[(size, name)] - best[(size, in_use)])


def cell(best, median, key, width=19) -> str:
    """'best (median)' in ms, right-aligned."""
    return f"{f'{best[key] * 1e3:.3f} ({median[key] * 1e3:.3f})':>{width}}"


def print_point_to_point(labels, sizes, best, median):
    """Tables 2 and 3: the building blocks, and the latency/bandwidth fits of the two kinds of message."""
    print0("\n2. point to point over the backend, and 3. local memory on one process: ms, best round (median)")
    columns = {"one-way": "one-way", "exchange": "exchange of S/N", "add": "add (+=)", "copy": "copy_"}
    fresh = {"new": "fresh S", "new chunk": "fresh S/N"}  # first write to a new buffer, minus a write to one in use
    print0(
        f"{'size':>6}"
        + "".join(f"{header:>19}" for header in columns.values())
        + "".join(f"{header:>10}" for header in fresh.values())
    )
    for label, size in zip(labels, sizes):
        cells = "".join(cell(best, median, (size, name)) for name in columns)
        extra = "".join(f"{fresh_cost(best, size, name) * 1e3:>10.3f}" for name in fresh)
        print0(f"{label:>6}{cells}{extra}")
    for name, which in (("one-way", 0), ("exchange", 1)):  # a one-way message carries S, an exchange S/N
        message_bytes = [4 * message_numels(size, dist.get_world_size())[which] for size in sizes]
        a, bandwidth = fit_latency_and_bandwidth(message_bytes, [best[(size, name)] for size in sizes])
        print0(
            f"fit t = a + n / B to the best rounds, {name:>8}: a = {a * 1e3:.3f} ms per message, "
            f"B = {bandwidth / 1e9:.2f} GB/s"
        )
    for name, label in (("add", "+="), ("copy", "copy_")):
        rates = ", ".join(
            f"{label_} {size / best[(size, name)] / 1e9:.2f}" for label_, size in zip(labels, sizes) if size >= 2**20
        )
        print0(f"local {label:>5}, GB/s of the tensor's size, best rounds: {rates}")


def print_all_reduce(labels, sizes, world_size, best, median):
    """Table 4: each allreduce measured, beside the time its message pattern predicts from tables 2 and 3."""
    print0(f"\n4. allreduce, {world_size} ranks: ms, best round (median), and predicted from the best rounds of 2, 3")
    print0(f"{'size':>6} {'naive':>19} {'predicted':>9} {'ring':>19} {'predicted':>9} {'dist.all_reduce':>19}")
    for label, size in zip(labels, sizes):
        naive = (world_size - 1) * (2 * best[(size, "one-way")] + best[(size, "add")]) + fresh_cost(best, size, "new")
        ring = (world_size - 1) * (2 * best[(size, "exchange")] + best[(size, "add chunk")]) + fresh_cost(
            best, size, "new chunk"
        )
        cells = [cell(best, median, (size, name)) for name in ALGORITHMS]
        print0(f"{label:>6} {cells[0]} {naive * 1e3:>9.3f} {cells[1]} {ring * 1e3:>9.3f} {cells[2]}")


if __name__ == "__main__":
    main(parse_args())
