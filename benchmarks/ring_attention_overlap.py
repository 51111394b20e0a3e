"""How much of ring attention's communication hides behind its computation (lesson 14), on a real link.

    # two emulated nodes, one process each, joined by a 1 Gbit/s link (scripts/cluster.py; it needs root)
    python scripts/cluster.py --nodes 2 --procs-per-node 1 --link 1gbit -- benchmarks/ring_attention_overlap.py

    # the same over 100 Mbit/s, where a block's transfer outlasts its computation
    python scripts/cluster.py --nodes 2 --procs-per-node 1 --link 100mbit -- benchmarks/ring_attention_overlap.py

    # the same two processes on this machine's loopback
    torchrun --standalone --nproc_per_node=2 benchmarks/ring_attention_overlap.py --seqs 1024

For each sequence length, causal and zig-zag, float32, one thread per process, rank 0 prints the median of
``--repeats``: the time to compute one other rank's key/value block (``attend_pieces`` and ``merge``), the time to
send one block to the next rank and receive one (``pass_along``, then ``wait``), and one ring step both ways: the
transfer posted before the computation and waited for after it (``RingAttention``'s order), or waited for first.
The share of the send hidden is what the overlap saved, over the send's time. The arithmetic: a block costs
``2 b a (s/N)^2 d`` multiply-adds (half of that for a zig-zag block from another rank) and carries
``2 b a (s/N) d`` values, so longer slices hide better.
"""

import statistics
import time

import torch
import torch.distributed as dist

from common.cli import argument_parser, positive_int
from common.context_parallel import attend_pieces, merge, pass_along, shard_pieces, wait_all
from common.distributed import print0, process_group
from common.experiments.context_parallel import random_qkv
from common.reports import run_header


def parse_args(argv=None):
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=positive_int, nargs="+", default=[1024, 4096], help="sequence lengths")
    parser.add_argument("--heads", type=positive_int, default=4)
    parser.add_argument("--head-dim", type=positive_int, default=16)
    parser.add_argument("--repeats", type=positive_int, default=9)
    return parser.parse_args(argv)


def median_seconds(fn, repeats: int) -> float:
    """The median time of ``fn()`` over ``repeats`` calls after one to warm up, every rank starting together."""
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def measure(env, seq: int, heads: int, head_dim: int, repeats: int) -> dict:
    """This rank's times for one sequence length (see the module's docstring)."""
    q, k, v, _ = random_qkv(1, heads, seq, head_dim, dtype=torch.float32)
    positions = torch.cat(
        [torch.arange(p.start, p.stop) for p in shard_pieces(seq, env.rank, env.world_size, "zigzag")]
    )
    local = [t[:, :, positions] for t in (q, k, v)]
    other = (env.rank - 1) % env.world_size  # the block a rank computes at step 1
    mine, theirs = (shard_pieces(seq, r, env.world_size, "zigzag") for r in (env.rank, other))
    kv = torch.stack(local[1:]).contiguous()

    def compute():
        out, lse = torch.zeros_like(local[0]), local[0].new_full(local[0].shape[:-1], float("-inf"))
        for rows, block_out, block_lse in attend_pieces(local[0], kv[0], kv[1], mine, theirs, True):
            out[..., rows, :], lse[..., rows] = merge(out[..., rows, :], lse[..., rows], block_out, block_lse)

    def transfer():
        wait_all(pass_along(kv)[1])

    def step(overlap: bool):  # one ring step: the next block's transfer and this block's computation
        requests = pass_along(kv)[1]
        if not overlap:
            wait_all(requests)
        compute()
        if overlap:
            wait_all(requests)

    with torch.no_grad():
        return {
            "seq": seq,
            "block MiB": kv.numel() * kv.element_size() / 2**20,
            "compute ms": median_seconds(compute, repeats) * 1e3,
            "transfer ms": median_seconds(transfer, repeats) * 1e3,
            "overlapped ms": median_seconds(lambda: step(True), repeats) * 1e3,
            "waiting ms": median_seconds(lambda: step(False), repeats) * 1e3,
        }


def main(args):
    torch.set_num_threads(1)  # one core per process, on loopback and on the emulated nodes alike
    with process_group("gloo") as env:
        print0(run_header())
        print0(f"{env.world_size} processes, gloo, causal, zig-zag, float32, batch 1, {args.heads} heads of "
               f"{args.head_dim}; medians of {args.repeats}; rank 0's times")  # fmt: skip
        print0(f"{'seq':>6} {'block MiB':>10} {'compute':>10} {'send':>10} {'step, overlapped':>17} "
               f"{'step, waiting':>14} {'send hidden':>12}")  # fmt: skip
        for seq in args.seqs:
            row = measure(env, seq, args.heads, args.head_dim, args.repeats)
            hidden = (row["waiting ms"] - row["overlapped ms"]) / row["transfer ms"]
            print0(f"{seq:>6} {row['block MiB']:>10.3f} {row['compute ms']:>7.2f} ms {row['transfer ms']:>7.2f} ms "
                   f"{row['overlapped ms']:>14.2f} ms {row['waiting ms']:>11.2f} ms {hidden:>12.0%}")  # fmt: skip


if __name__ == "__main__":
    main(parse_args())
