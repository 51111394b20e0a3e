"""DDP against one process: equal parameters after N steps, rank 0's weights at construction, and the gradient
buckets DDP all-reduces (each test forms a real gloo process group of 2 or 3 CPU processes).

The functions that run on the ranks live at module level, because spawned processes import them by name.
Every run has a deadline (``timeout``), so a hang fails the test in seconds instead of stalling CI.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from common.ddp import ddp_buckets, weights_before_and_after_ddp
from common.distributed import replicas_in_sync, set_seed
from common.launch import run_on_ranks
from common.models import LeNet

STEPS, BATCH, LR = 3, 16, 0.1


def batches():
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, 1, 28, 28, generator=generator), torch.randint(0, 10, (BATCH,), generator=generator))
        for _ in range(STEPS)
    ]


def sgd_steps(model, shards):
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for X, y in shards:
        optimizer.zero_grad()
        F.cross_entropy(model(X), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def train_on_half_batches(env):
    """Each rank trains on its half of every batch, once with DDP and once without any gradient sync."""
    shards = [(X.chunk(env.world_size)[env.rank], y.chunk(env.world_size)[env.rank]) for X, y in batches()]
    set_seed(0)
    ddp_model = DDP(LeNet())
    with_ddp = sgd_steps(ddp_model, shards)
    set_seed(0)
    local_model = LeNet()
    without_sync = sgd_steps(local_model, shards)
    return {
        "ddp": with_ddp,
        "no_sync": without_sync,
        "in_sync": [replicas_in_sync(ddp_model), replicas_in_sync(local_model)],
    }


def test_ddp_on_two_half_batches_equals_one_process_on_the_whole_batch():
    set_seed(0)
    reference = sgd_steps(LeNet(), batches())
    ranks = run_on_ranks(train_on_half_batches, 2, timeout=90)
    for rank in ranks:
        torch.testing.assert_close(rank["ddp"], reference)
        assert rank["in_sync"] == [True, False]  # replicas_in_sync sees the difference too
    # The same comparison fails without DDP's gradient averaging: the test can tell the two apart.
    with pytest.raises(AssertionError):
        torch.testing.assert_close(ranks[0]["no_sync"], reference)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(ranks[0]["no_sync"], ranks[1]["no_sync"])


def test_ddp_construction_gives_every_rank_the_weights_of_rank_0():
    ranks = run_on_ranks(weights_before_and_after_ddp, 3, timeout=90)
    assert ranks[0]["before"] != ranks[1]["before"] != ranks[2]["before"]
    assert all(rank["after"] == ranks[0]["before"] for rank in ranks)


BUCKET_CONFIGURATIONS = {
    "default": {},
    "bucket_cap_mb=0.3": {"bucket_cap_mb": 0.3},
    "find_unused_parameters=True": {"find_unused_parameters": True},
}
MiB = 2**20


@pytest.fixture(scope="module")
def buckets():
    """Rank 0's buckets, step by step, from one 2-rank run of ``common.ddp.ddp_buckets``."""
    return run_on_ranks(ddp_buckets, 2, BUCKET_CONFIGURATIONS, timeout=120)[0]


def mlp_parameter_bytes():
    """The bytes of each parameter of ``ddp_buckets``' MLP, in ``model.parameters()`` order."""
    model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(6)))
    return {name: p.numel() * p.element_size() for name, p in model.named_parameters()}


def cut_greedily(names, caps):
    """DDP's rule, written again: fill a bucket in the order given and close it once its bytes reach its cap
    (``caps[i]`` for bucket i, the last cap for every later one)."""
    sizes, buckets, current, total = mlp_parameter_bytes(), [], [], 0
    for name in names:
        current, total = current + [name], total + sizes[name]
        if total >= caps[min(len(buckets), len(caps) - 1)]:
            buckets, current, total = buckets + [current], [], 0
    return buckets + [current] if current else buckets


def bucket_contents(step):
    assert [bucket["index"] for bucket in step] == list(range(len(step)))  # launched in index order
    sizes = mlp_parameter_bytes()
    assert all(bucket["bytes"] == sum(sizes[name] for name in bucket["parameters"]) for bucket in step)
    return [bucket["parameters"] for bucket in step]


def test_ddp_default_bucket_caps_are_1_mib_for_the_first_bucket_and_25_mib_after(buckets):
    assert dist._DEFAULT_FIRST_BUCKET_BYTES == MiB
    assert buckets["default"]["bucket_cap_bytes"] == 25 * MiB
    assert buckets["bucket_cap_mb=0.3"]["bucket_cap_bytes"] == int(0.3 * MiB)


def test_ddp_all_reduces_every_gradient_in_one_bucket_in_the_first_step(buckets):
    for name in ("default", "bucket_cap_mb=0.3"):
        assert bucket_contents(buckets[name]["steps"][0]) == [list(mlp_parameter_bytes())]


def test_ddp_rebuilds_its_buckets_after_the_first_step_in_the_order_gradients_became_ready(buckets):
    default, small = buckets["default"], buckets["bucket_cap_mb=0.3"]
    assert set(default["ready_order"][:2]) == {"5.bias", "5.weight"}  # the last layer's gradients come first
    # Default: a first bucket closed at 1 MiB (here 4 layers, 1.004 MiB), then 25 MiB ones (the 2 layers left).
    assert bucket_contents(default["steps"][1]) == cut_greedily(default["ready_order"], [MiB, 25 * MiB])
    assert len(default["steps"][1]) == 2
    # An explicit bucket_cap_mb caps the first bucket too: three buckets of 2 layers (514 KiB >= 0.3 MiB).
    assert bucket_contents(small["steps"][1]) == cut_greedily(small["ready_order"], [int(0.3 * MiB)])
    assert len(small["steps"][1]) == 3


def test_with_find_unused_parameters_ddp_cuts_buckets_from_the_first_parameter_reverses_them_and_never_rebuilds(
    buckets,
):
    # Cut from model.parameters() in order, the first cut (the first layers) at 1 MiB, then reversed: the bucket
    # with the last layers goes first. The same buckets at every step.
    expected = cut_greedily(list(mlp_parameter_bytes()), [MiB, 25 * MiB])[::-1]
    for step in buckets["find_unused_parameters=True"]["steps"]:
        assert bucket_contents(step) == expected
