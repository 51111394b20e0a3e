"""Lab 07: ring allreduce and one-bucket gradient averaging.

Runs against solutions/07_ring_allreduce.py; with LAB_TARGET=labs, against your labs/07_ring_allreduce.py:

    LAB_TARGET=labs .venv/bin/python -m pytest tests/labs/test_07_ring_allreduce.py

The lab file is loaded inside each spawned process (by path), since a process can only run what it imports.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.collectives import naive_all_reduce
from common.distributed import set_seed
from common.launch import run_on_ranks
from common.models import LeNet
from tests.conftest import lab_path, torchrun
from tests.labs import load_lab

LAB = "07_ring_allreduce"
# What these tests call in the script: ring_all_reduce(tensor) -> the same tensor, summed over ranks in place;
# all_reduce_gradients(model, all_reduce); parse_size(text) -> bytes. The timing runs through its command line.
NEEDS = ("ring_all_reduce", "all_reduce_gradients", "parse_size")
SIZES = (1, 3, 7, 1000, 1003)  # 1 and 3 leave some ring chunks empty at world size 4


def test_sizes_read_with_binary_units():
    parse_size = load_lab(LAB, NEEDS).parse_size
    assert [parse_size(text) for text in ("4K", "16M", "1G", "100", "0.5K")] == [4096, 16 * 2**20, 2**30, 100, 512]


def compare_with_dist_all_reduce(env):
    lab = load_lab(LAB, NEEDS)
    results = {}
    for size in SIZES:
        data = torch.randn(size, generator=torch.Generator().manual_seed(100 * env.rank + size))
        expected = data.clone()
        dist.all_reduce(expected)
        for name, all_reduce in (("naive", naive_all_reduce), ("ring", lab.ring_all_reduce)):
            tensor = data.clone()
            returned = all_reduce(tensor)
            results[f"{name}-{size}"] = [returned is tensor, tensor, expected]
    matrix = torch.arange(12.0).reshape(3, 4) * (env.rank + 1)  # a 2-D tensor, summed element-wise
    total = torch.arange(12.0).reshape(3, 4) * sum(range(1, env.world_size + 1))
    results["ring-matrix"] = [True, lab.ring_all_reduce(matrix), total]
    return results


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_naive_and_ring_all_reduce_equal_dist_all_reduce(world_size):
    for rank in run_on_ranks(compare_with_dist_all_reduce, world_size, timeout=120):
        assert set(rank) == {f"{name}-{size}" for name in ("naive", "ring") for size in SIZES} | {"ring-matrix"}
        for key, (in_place, result, expected) in rank.items():
            assert in_place, f"{key}: the result must be written into the tensor that was passed in"
            torch.testing.assert_close(result, expected, msg=key)


def gradients_three_ways(env):
    lab = load_lab(LAB, NEEDS)
    X = torch.randn(8, 1, 28, 28, generator=torch.Generator().manual_seed(env.rank))
    y = torch.arange(8) % 10
    set_seed(0)
    ddp = DDP(LeNet())
    F.cross_entropy(ddp(X), y).backward()
    results = {"ddp": [p.grad.clone() for p in ddp.parameters()]}
    for name, all_reduce in (("bucket-dist", dist.all_reduce), ("bucket-ring", lab.ring_all_reduce)):
        set_seed(0)
        model = LeNet()
        F.cross_entropy(model(X), y).backward()
        grads_before = [id(p.grad) for p in model.parameters()]
        calls = []

        def counting_all_reduce(tensor, all_reduce=all_reduce):
            calls.append(tensor.numel())
            return all_reduce(tensor)

        lab.all_reduce_gradients(model, counting_all_reduce)
        results[name] = [p.grad for p in model.parameters()]
        results[f"{name}-calls"] = calls
        results[f"{name}-same-tensors"] = grads_before == [id(p.grad) for p in model.parameters()]
    return results


def test_one_bucket_gradient_averaging_equals_ddp_with_one_collective():
    parameters = sum(p.numel() for p in LeNet().parameters())
    for rank in run_on_ranks(gradients_three_ways, 3, timeout=120):
        for name in ("bucket-dist", "bucket-ring"):
            torch.testing.assert_close(rank[name], rank["ddp"], msg=name)
            assert rank[f"{name}-calls"] == [parameters], "one collective over all gradients, flattened"
            assert rank[f"{name}-same-tensors"], "copy into the existing .grad tensors (the optimizer holds them)"


def test_the_script_checks_then_prints_bandwidth_for_every_algorithm(tmp_path):
    run = torchrun(
        lab_path(LAB),
        "--sizes",
        "4K",
        "256K",
        "--iterations",
        "2",
        "--plot",
        tmp_path / "new" / "plot.png",
        nproc=3,
        timeout=120,
    )
    assert run.returncode == 0, run.output
    assert "one-bucket gradients equal DDP's: True" in run.stdout
    rows = [line.split() for line in run.stdout.splitlines() if line.split()[:1] in (["4K"], ["256K"])]
    assert [(row[0], row[1]) for row in rows] == [
        (size, name) for size in ("4K", "256K") for name in ("naive", "ring", "dist.all_reduce")
    ]
    for row in rows:
        algbw, busbw = float(row[3]), float(row[4])
        assert busbw == pytest.approx(algbw * 4 / 3, abs=2e-3)  # bus bandwidth = algbw * 2(N-1)/N at N = 3
    assert (tmp_path / "new" / "plot.png").stat().st_size > 10_000  # the folder is created
