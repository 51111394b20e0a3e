"""The hand-made allreduces equal dist.all_reduce, for world sizes 2-4 and sizes that do not divide by them."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.collectives import all_reduce_gradients, naive_all_reduce, ring_all_reduce
from common.distributed import set_seed
from common.launch import run_on_ranks
from common.models import LeNet

SIZES = (1, 3, 7, 1000, 1003)  # 1 and 3 leave some ring chunks empty at world size 4


def compare_with_dist_all_reduce(env):
    results = {}
    for size in SIZES:
        data = torch.randn(size, generator=torch.Generator().manual_seed(100 * env.rank + size))
        expected = data.clone()
        dist.all_reduce(expected)
        for name, all_reduce in (("naive", naive_all_reduce), ("ring", ring_all_reduce)):
            tensor = data.clone()
            returned = all_reduce(tensor)
            results[f"{name}-{size}"] = [returned is tensor, tensor, expected]
    matrix = torch.arange(12.0).reshape(3, 4) * (env.rank + 1)  # a 2-D tensor, summed element-wise
    results["ring-matrix"] = [True, ring_all_reduce(matrix), torch.arange(12.0).reshape(3, 4) * sum(
        range(1, env.world_size + 1))]
    return results


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_naive_and_ring_all_reduce_equal_dist_all_reduce(world_size):
    for rank in run_on_ranks(compare_with_dist_all_reduce, world_size, timeout=120):
        assert set(rank) == {f"{name}-{size}" for name in ("naive", "ring") for size in SIZES} | {"ring-matrix"}
        for key, (in_place, result, expected) in rank.items():
            assert in_place, key
            torch.testing.assert_close(result, expected, msg=key)


def gradients_three_ways(env):
    X = torch.randn(8, 1, 28, 28, generator=torch.Generator().manual_seed(env.rank))
    y = torch.arange(8) % 10
    set_seed(0)
    ddp = DDP(LeNet())
    F.cross_entropy(ddp(X), y).backward()
    results = {"ddp": [p.grad.clone() for p in ddp.parameters()]}
    for name, all_reduce in (("bucket-dist", dist.all_reduce), ("bucket-ring", ring_all_reduce)):
        set_seed(0)
        model = LeNet()
        F.cross_entropy(model(X), y).backward()
        all_reduce_gradients(model, all_reduce)
        results[name] = [p.grad for p in model.parameters()]
    return results


def test_one_bucket_gradient_averaging_equals_ddp():
    for rank in run_on_ranks(gradients_three_ways, 3, timeout=120):
        torch.testing.assert_close(rank["bucket-dist"], rank["ddp"])
        torch.testing.assert_close(rank["bucket-ring"], rank["ddp"])
