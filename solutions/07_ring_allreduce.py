"""Lab 07 (lesson 01): allreduce by hand. A ring allreduce and one-bucket gradient averaging, checked against
PyTorch's own, then timed against a naive allreduce and ``dist.all_reduce`` over tensor sizes.

    torchrun --standalone --nproc_per_node=4 solutions/07_ring_allreduce.py --plot runs/allreduce.png  # CPU (gloo)
    torchrun --standalone --nproc_per_node=4 solutions/07_ring_allreduce.py --sizes 1M 64M 256M  # 4 GPUs (NCCL)

``ring_all_reduce`` and ``all_reduce_gradients`` are written out in ``common/collectives.py`` (lesson 01 shows
them in full); ``labs/07_ring_allreduce.py`` leaves them to you.

Bandwidths follow nccl-tests' definitions (``all_reduce_perf`` prints the same two columns):
- algorithm bandwidth, algbw = S / t, for a tensor of S bytes that took t seconds;
- bus bandwidth, busbw = algbw * 2(N-1)/N: what each link carried, since a ring allreduce sends 2(N-1)/N * S
  per rank. busbw is what to compare with the hardware's link speed; it does not depend on N for a ring.
t is the median over iterations of the slowest rank's time for one call after a barrier. nccl-tests times a loop of
back-to-back calls instead, so its t is not measured the same way: compare the columns' meaning, not the values.
"""

import argparse
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.cli import parse_size, positive_int
from common.collectives import naive_all_reduce

# BEGIN LAB: the ring allreduce
# N chunks; N-1 reduce-scatter steps (send a chunk to the right, add the left neighbour's partial sum of
# another), then N-1 all-gather steps. exchange() sends and receives at once: blocking sends would deadlock.
from common.collectives import ring_all_reduce  # isort: skip

# END LAB
# BEGIN LAB: one-bucket gradient averaging
# Flatten every p.grad into one tensor, all-reduce it, divide by the world size, and copy the slices back
# into the p.grad tensors in place (the optimizer holds them).
from common.collectives import all_reduce_gradients  # isort: skip

# END LAB
from common.distributed import BACKENDS, is_main, print0, process_group, set_seed
from common.metrics import slowest_rank_seconds
from common.models import LeNet
from common.reports import plot_bus_bandwidth

ALGORITHMS = {"naive": naive_all_reduce, "ring": ring_all_reduce, "dist.all_reduce": dist.all_reduce}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--sizes", nargs="+", default=["4K", "64K", "1M", "16M"], help="bytes, e.g. 4K 16M 1G")
    parser.add_argument("--algorithms", nargs="+", choices=list(ALGORITHMS), default=list(ALGORITHMS))
    parser.add_argument("--iterations", type=positive_int, default=10)
    parser.add_argument("--backend", choices=BACKENDS, default="auto")
    parser.add_argument("--plot", help="write a bus-bandwidth plot (PNG) here")
    return parser.parse_args(argv)


def main(args):
    with process_group(args.backend) as env:
        print0(f"{env.world_size} processes, backend {env.backend}, device {env.device.type}")
        results_match = check(env)
        print0(f"ring and naive allreduce equal dist.all_reduce, one-bucket gradients equal DDP's: {results_match}")
        if not results_match:
            raise SystemExit("error: the hand-made allreduce gives different results; fix it before timing it")
        rows = measure(args, env)
        if args.plot and is_main():
            plot_bus_bandwidth(
                rows, args.plot, f"allreduce, {env.world_size} processes, {env.backend} on {env.device.type}"
            )
            print0(f"plot written to {args.plot}")


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
        net = DDP(model, device_ids=env.device_ids) if name == "ddp" else model
        F.cross_entropy(net(X), y).backward()
        if name == "one bucket":
            all_reduce_gradients(model, ring_all_reduce)
        grads[name] = [p.grad for p in model.parameters()]
    ok &= all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(grads["ddp"], grads["one bucket"]))
    verdict = torch.tensor(int(ok), device=env.device)
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN)  # one verdict for all ranks: all go on, or all stop
    return bool(verdict)


def measure(args, env) -> list[dict]:
    """Time every algorithm on every size; print a table row each, and return the rows."""
    rows = []
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
    return rows


def time_all_reduce(all_reduce, tensor: torch.Tensor, iterations: int, warmup: int = 2) -> float:
    """Median seconds per call, each call timed as the slowest rank saw it; the first ``warmup`` calls untimed."""
    times = [slowest_rank_seconds(lambda: all_reduce(tensor), tensor.device) for _ in range(warmup + iterations)]
    return statistics.median(times[warmup:])


if __name__ == "__main__":
    main(parse_args())
