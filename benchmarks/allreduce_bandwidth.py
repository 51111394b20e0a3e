"""Allreduce bandwidth over tensor sizes: the hand-made naive and ring allreduce against ``dist.all_reduce``.

    torchrun --standalone --nproc_per_node=2 benchmarks/allreduce_bandwidth.py                 # CPU, gloo
    torchrun --standalone --nproc_per_node=4 benchmarks/allreduce_bandwidth.py --sizes 1M 64M 256M   # 4 GPUs
    torchrun ... benchmarks/allreduce_bandwidth.py --plot allreduce.png

Figures follow nccl-tests' definitions, so they compare with what ``all_reduce_perf`` prints:
- algorithm bandwidth, algbw = S / t, for a tensor of S bytes that took t seconds;
- bus bandwidth, busbw = algbw * 2(N-1)/N: what each link carried, since a ring allreduce sends 2(N-1)/N * S
  per rank. busbw is what to compare with the hardware's link speed; it does not depend on N for a ring.
t is the median over iterations of the slowest rank's time.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from common.collectives import naive_all_reduce, ring_all_reduce
from common.distributed import print0, setup_distributed, teardown_distributed

ALGORITHMS = {"naive": naive_all_reduce, "ring": ring_all_reduce, "dist.all_reduce": dist.all_reduce}
UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str) -> int:
    """'4K', '16M', '1G' or a plain number of bytes -> bytes."""
    scale = UNITS.get(text[-1].upper(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def time_all_reduce(all_reduce, tensor: torch.Tensor, iterations: int, warmup: int = 2) -> float:
    """Median seconds per call, each call timed as the slowest rank saw it."""
    times = []
    for i in range(warmup + iterations):
        dist.barrier()  # start together, so one rank's lateness is not billed to the collective
        start = time.perf_counter()
        all_reduce(tensor)
        if tensor.is_cuda:
            torch.cuda.synchronize()  # GPU work is asynchronous: wait for it before reading the clock
        elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64, device=tensor.device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(elapsed.item())
    return statistics.median(times)


def main(args):
    env = setup_distributed(args.backend)
    try:
        rows = []
        print0(f"{env.world_size} processes, backend {env.backend}, device {env.device.type}")
        print0(f"{'size':>10} {'algorithm':>16} {'time (ms)':>10} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}")
        for size in args.sizes:
            tensor = torch.ones(max(1, parse_size(size) // 4), dtype=torch.float32, device=env.device)
            for name in args.algorithms:
                seconds = time_all_reduce(ALGORITHMS[name], tensor, args.iterations)
                algbw = tensor.numel() * tensor.element_size() / seconds / 1e9
                busbw = algbw * 2 * (env.world_size - 1) / env.world_size
                rows.append({"size": size, "algorithm": name, "seconds": seconds, "algbw": algbw, "busbw": busbw})
                print0(f"{size:>10} {name:>16} {seconds * 1e3:>10.3f} {algbw:>13.3f} {busbw:>13.3f}")
                tensor.fill_(1.0)  # repeated sums grow the values; keep them finite
        if args.plot and env.rank == 0:
            plot(rows, args.plot, f"allreduce, {env.world_size} processes, {env.backend} on {env.device.type}")
            print0(f"plot written to {args.plot}")
    finally:
        teardown_distributed()


def plot(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for name in dict.fromkeys(row["algorithm"] for row in rows):
        mine = [row for row in rows if row["algorithm"] == name]
        axes.plot([parse_size(row["size"]) for row in mine], [row["busbw"] for row in mine], marker="o", label=name)
    axes.set(xscale="log", xlabel="tensor size (bytes)", ylabel="bus bandwidth (GB/s)", title=title)
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["4K", "64K", "1M", "16M"], help="bytes, e.g. 4K 16M 1G")
    parser.add_argument("--algorithms", nargs="+", choices=list(ALGORITHMS), default=list(ALGORITHMS))
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto")
    parser.add_argument("--plot", help="write a bus-bandwidth plot (PNG) here")
    return parser.parse_args()


if __name__ == "__main__":
    main(parse_args())
