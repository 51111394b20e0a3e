"""Lab 10: ZeRO by hand, the sharded step of ZeRO-1.

Runs against solutions/10_zero_by_hand.py; with LAB_TARGET=labs, against your labs/10_zero_by_hand.py:

    LAB_TARGET=labs .venv/bin/python -m pytest tests/labs/test_10_zero_by_hand.py

The lab file is loaded inside each spawned process (by path), since a process can only run what it imports.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from common.collectives import count_collectives
from common.launch import run_on_ranks
from common.memory import local_bytes, optimizer_state_tensors
from common.models import DeepMLP
from tests.labs import load_lab

LAB = "10_zero_by_hand"
# What these tests call in the script: partition_by_size(parameters, world_size) -> [[indices of rank 0], ...];
# ZeRO1Optimizer(params, optimizer_class, **defaults), with step() and zero_grad() and the local optimizer at .optim.
NEEDS = ("partition_by_size", "ZeRO1Optimizer")
STEPS, WORLD_SIZE = 3, 2


def test_partition_gives_the_largest_tensor_first_to_the_least_loaded_rank():
    partition_by_size = load_lab(LAB, NEEDS).partition_by_size
    tensors = [torch.empty(n) for n in (10, 40, 30, 20, 5, 5, 25)]
    # by size: 40, 30, 25, 20, 10, 5, 5 (the two 5s in their order); loads after each at 2 ranks: [40, 0],
    # [40, 30], [40, 55], [60, 55], [60, 65], [65, 65], then the tie goes to rank 0: [70, 65]
    assert partition_by_size(tensors, 2) == [[1, 3, 4, 5], [0, 2, 6]]
    # at 3 ranks: [40, 0, 0], [40, 30, 0], [40, 30, 25], [40, 30, 45], [40, 40, 45], [45, 40, 45], [45, 45, 45]
    assert partition_by_size(tensors, 3) == [[1, 4], [0, 2, 5], [3, 6]]
    assert partition_by_size(tensors[:1], 2) == [[0], []], "a rank may own nothing"


def zero1_against_torch(env):
    lab = load_lab(LAB, NEEDS)
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(12, 1, 28, 28, generator=generator), torch.randint(0, 10, (12,), generator=generator))]
    data = [(X[env.rank :: env.world_size], y[env.rank :: env.world_size]) for X, y in data * STEPS]
    results = {}
    for name in ("lab", "torch"):
        torch.manual_seed(0)
        model = DeepMLP(width=24, depth=3)
        model.blocks[0][0].bias.requires_grad_(False)  # frozen (before DDP sees it): neither stepped nor sent
        net = DDP(model)
        if name == "lab":
            optimizer = lab.ZeRO1Optimizer(net.parameters(), torch.optim.Adam, lr=0.01)
        else:
            optimizer = ZeroRedundancyOptimizer(net.parameters(), torch.optim.Adam, lr=0.01)
        for step, (X, y) in enumerate(data):
            with count_collectives() as log:
                optimizer.zero_grad(set_to_none=True)
                F.cross_entropy(net(X), y).backward()
                optimizer.step()
            if step == 0:
                results[f"{name}_broadcasts"] = [log.count("broadcast"), log.bytes("broadcast")]
        results[name] = [p.detach().clone() for p in net.parameters()]
        results[f"{name}_state_bytes"] = local_bytes(optimizer_state_tensors(optimizer))
        results[f"{name}_stepped"] = sum(p.numel() for p in net.parameters() if p in optimizer.optim.state)
    trainable = [p for p in net.parameters() if p.requires_grad]
    results["trainable"] = [len(trainable), 4 * sum(p.numel() for p in trainable)]
    results["share"] = sum(trainable[i].numel() for i in lab.partition_by_size(trainable, env.world_size)[env.rank])
    return results


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(zero1_against_torch, WORLD_SIZE, timeout=60)


def test_zero1_trains_exactly_as_zero_redundancy_optimizer(ranks):
    for rank in ranks:
        torch.testing.assert_close(rank["lab"], rank["torch"], rtol=0, atol=0)
    for rank in ranks[1:]:
        torch.testing.assert_close(rank["lab"], ranks[0]["lab"], rtol=0, atol=0, msg="every rank, the same model")


def test_each_rank_keeps_the_optimizer_state_of_its_share_only(ranks):
    for rank in ranks:
        assert rank["lab_stepped"] == rank["share"], "the local optimizer holds state for this rank's share"
    total = ranks[0]["trainable"][1] // 4
    assert sum(rank["lab_stepped"] for rank in ranks) == total, "every trainable element on exactly one rank"


def test_the_step_broadcasts_every_trainable_parameter_once(ranks):
    for rank in ranks:
        assert rank["lab_broadcasts"] == rank["trainable"]
