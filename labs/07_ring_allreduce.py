"""Lab 07 (lesson 01): allreduce by hand. A ring allreduce and one-bucket gradient averaging, checked against
PyTorch's own, then timed against a naive allreduce and ``dist.all_reduce`` over tensor sizes.

    torchrun --standalone --nproc_per_node=4 solutions/07_ring_allreduce.py --plot runs/allreduce.png  # CPU (gloo)
    torchrun --standalone --nproc_per_node=4 solutions/07_ring_allreduce.py --sizes 1M 64M 256M  # 4 GPUs (NCCL)

YOUR TASK: write ``ring_all_reduce`` and ``all_reduce_gradients`` below (the TODOs); the rest of the script
checks them against PyTorch and times them. Check your work with

    LAB_TARGET=labs .venv/bin/python -m pytest tests/labs/test_07_ring_allreduce.py

Lesson 01 explains both algorithms; ``solutions/07_ring_allreduce.py`` imports the finished versions from
``common/collectives.py``.

Figures follow nccl-tests' definitions, so they compare with what ``all_reduce_perf`` prints:
- algorithm bandwidth, algbw = S / t, for a tensor of S bytes that took t seconds;
- bus bandwidth, busbw = algbw * 2(N-1)/N: what each link carried, since a ring allreduce sends 2(N-1)/N * S
  per rank. busbw is what to compare with the hardware's link speed; it does not depend on N for a ring.
t is the median over iterations of the slowest rank's time.
"""

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.cli import parse_size
from common.collectives import exchange, naive_all_reduce
from common.distributed import print0, set_seed, setup_distributed, teardown_distributed
from common.models import LeNet

def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a contiguous ``tensor`` over all ranks, in place, with a ring; return it. Call on every rank.

    1. Cut ``tensor.view(-1)`` into N chunks with ``tensor_split`` (sizes may differ by one, some may be empty).
    2. Reduce-scatter, N-1 steps: send one chunk to the right neighbour, receive the left neighbour's partial sum
       of another chunk and add it to yours. Afterwards each rank holds the complete sum of one chunk.
    3. All-gather, N-1 steps: pass the complete chunks round the ring, receiving straight into place.
    ``exchange(send, destination, receive, source)`` sends and receives at once (blocking sends would deadlock).
    """
    # TODO: implement the ring allreduce
    raise NotImplementedError("TODO: ring_all_reduce")


def all_reduce_gradients(model: torch.nn.Module, all_reduce=dist.all_reduce) -> None:
    """Average every parameter's gradient over ranks with ONE ``all_reduce`` call on one flat bucket.

    Flatten all ``p.grad`` into one tensor, all-reduce it, divide by the world size, and copy
    the slices back into the ``p.grad`` tensors in place.
    """
    # TODO: implement one-bucket gradient averaging
    raise NotImplementedError("TODO: all_reduce_gradients")


ALGORITHMS = {"naive": naive_all_reduce, "ring": ring_all_reduce, "dist.all_reduce": dist.all_reduce}
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


def check(env) -> bool:
    """Hand-made results equal PyTorch's: allreduce on sizes that do not divide by N, gradients against DDP."""
    ok = True
    for size in (1, 7, 1000, 1003):
        data = torch.randn(size, generator=torch.Generator().manual_seed(env.rank)).to(env.device)
        expected = data.clone()
        dist.all_reduce(expected)
        for name in ("naive", "ring"):
            ok &= torch.allclose(ALGORITHMS[name](data.clone()), expected, rtol=1e-5, atol=1e-5)

    X = torch.randn(16, *LeNet.input_shape, generator=torch.Generator().manual_seed(env.rank)).to(env.device)
    y = torch.arange(16, device=env.device) % 10
    grads = {}
    for name in ("ddp", "one bucket"):
        set_seed(0)
        model = LeNet().to(env.device)
        net = DDP(model, device_ids=[env.device] if env.device.type == "cuda" else None) if name == "ddp" else model
        F.cross_entropy(net(X), y).backward()
        if name == "one bucket":
            all_reduce_gradients(model, ring_all_reduce)
        grads[name] = [p.grad for p in model.parameters()]
    ok &= all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(grads["ddp"], grads["one bucket"]))
    verdict = torch.tensor(int(ok), device=env.device)
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN)  # one verdict for all ranks: all go on, or all stop
    return bool(verdict)


def main(args):
    env = setup_distributed(args.backend)
    try:
        rows = []
        print0(f"{env.world_size} processes, backend {env.backend}, device {env.device.type}")
        results_match = check(env)
        print0(f"ring and naive allreduce equal dist.all_reduce, one-bucket gradients equal DDP's: {results_match}")
        if not results_match:
            raise SystemExit("error: the hand-made allreduce gives different results; fix it before timing it")
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
    Path(path).parent.mkdir(parents=True, exist_ok=True)
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
