"""BatchNorm across ranks: plain BatchNorm per rank, the hand-made synchronized one of ``common.batchnorm``
against one process on the whole batch, ``nn.SyncBatchNorm`` (GPU only in this PyTorch), and BatchNorm's buffers
under DDP. Each test forms a real gloo process group of 1 or 2 CPU processes.

The functions that run on the ranks live at module level, because spawned processes import them by name.
Every run has a deadline (``timeout``), so a hang fails the test in seconds instead of stalling CI.
"""

import pytest
import torch
from torch import nn

from common.batchnorm import (
    batch_norm_across_ranks,
    batch_norm_batch,
    batch_norm_statistics_through_ddp,
    ddp_batch_norm_batch,
    running_statistics,
    synchronize_batch_norms,
)
from common.distributed import get_rank, set_seed
from common.launch import run_on_ranks
from common.models import SimpleCNN


def whole_batch_reference():
    """One process, SimpleCNN's convolutional layers on the whole BatchNorm demo batch: output and buffers."""
    set_seed(0)
    model = SimpleCNN()
    return model.features(batch_norm_batch()).detach(), dict(model.named_buffers())


@pytest.fixture(scope="module")
def batch_norm_ranks():
    """One 2-rank run of the lesson's BatchNorm demo, shared by the tests that read it."""
    return run_on_ranks(batch_norm_across_ranks, 2, timeout=120)


def test_plain_batch_norm_statistics_differ_per_rank_and_from_one_process_on_the_whole_batch(batch_norm_ranks):
    features, buffers = whole_batch_reference()
    plain = [rank["plain"] for rank in batch_norm_ranks]
    first = "features.1.running_mean"  # the first BatchNorm, where the brighter half shows most
    assert (plain[0]["buffers"][first] - plain[1]["buffers"][first]).abs().max() > 0.1
    for rank in plain:
        for name, reference in buffers.items():
            if name.endswith(("running_mean", "running_var")):
                # Each rank saw only its half: in every BatchNorm, a difference far above rounding errors.
                assert (rank["buffers"][name] - reference).abs().max() > 1e-2, name
    with pytest.raises(AssertionError):
        torch.testing.assert_close(plain[0]["features"], features[:8])


def test_synchronized_batch_norm_equals_one_process_on_the_whole_batch(batch_norm_ranks):
    features, buffers = whole_batch_reference()
    for rank, half in zip(batch_norm_ranks, features.chunk(2)):
        torch.testing.assert_close(rank["synchronized"]["buffers"], buffers)  # all three BatchNorms
        torch.testing.assert_close(rank["synchronized"]["features"], half)


def features_gradients(X, model):
    """Backpropagate a fixed weighted sum of SimpleCNN's features through ``model``, in float64.

    float64, because in float32 the biases of the convolutions before a BatchNorm (whose true gradient is zero:
    BatchNorm subtracts any constant) get gradients made of rounding errors, which no two runs share.
    """
    X = X.double().requires_grad_()
    model = model.double()
    weights = torch.randn(16, 256, 4, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    weights = weights.chunk(16 // len(X))[get_rank()]  # this rank's rows: the ranks' losses add up to the whole's
    (model.features(X) * weights).sum().backward()
    return {"input": X.grad, "params": [p.grad for p in model.features.parameters()]}


def synchronized_gradients(env):
    set_seed(0)
    return features_gradients(batch_norm_batch().chunk(env.world_size)[env.rank], synchronize_batch_norms(SimpleCNN()))


def test_synchronized_batch_norm_backpropagates_the_gradients_of_one_process_on_the_whole_batch():
    set_seed(0)
    reference = features_gradients(batch_norm_batch(), SimpleCNN())
    ranks = run_on_ranks(synchronized_gradients, 2, timeout=90)
    torch.testing.assert_close(torch.cat([rank["input"] for rank in ranks]), reference["input"])
    # Parameter gradients stay per rank until DDP all-reduces them: their sum is the whole batch's gradient.
    summed = [sum(grads) for grads in zip(*(rank["params"] for rank in ranks))]
    torch.testing.assert_close(summed, reference["params"])


def sync_batch_norm_on_cpu(env):
    model = nn.SyncBatchNorm.convert_sync_batchnorm(SimpleCNN())
    model.features(batch_norm_batch().chunk(env.world_size)[env.rank])


@pytest.mark.parametrize("world_size", [1, 2])
def test_sync_batch_norm_has_no_cpu_implementation_in_this_pytorch(world_size):
    # The lesson says that nn.SyncBatchNorm runs on GPUs only. When PyTorch adds CPU support, this test fails:
    # then the lesson and common/batchnorm.py's docstring need updating. A world of one raises too: the device
    # check runs whenever a process group is initialised, before the world size is looked at.
    with pytest.raises(RuntimeError, match="ValueError: SyncBatchNorm expected input tensor to be on GPU"):
        run_on_ranks(sync_batch_norm_on_cpu, world_size, timeout=60)


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="nn.SyncBatchNorm needs CUDA tensors in PyTorch 2.14; this machine has no CUDA device",
)
def test_sync_batch_norm_on_a_gpu_equals_one_process_on_the_whole_batch(batch_norm_ranks):
    features, buffers = whole_batch_reference()  # on the CPU
    for rank, half in zip(batch_norm_ranks, features.chunk(2)):
        # CPU and GPU sum in different orders: float32 rounding, far below the per-rank differences (> 1e-2).
        torch.testing.assert_close(rank["sync_batchnorm"]["buffers"], buffers, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(rank["sync_batchnorm"]["features"], half, rtol=1e-4, atol=1e-4)


DDP_BATCH_NORM_STEPS = 3


@pytest.fixture(scope="module")
def batch_norm_through_ddp():
    """One 2-rank run of ``common.batchnorm.batch_norm_statistics_through_ddp``, shared by the tests that read it."""
    return run_on_ranks(batch_norm_statistics_through_ddp, 2, DDP_BATCH_NORM_STEPS, timeout=120)


def hand_computed(rank_of_each_step):
    """Running mean and variance, by hand, after one batch per step from the rank named for that step."""
    return running_statistics([ddp_batch_norm_batch(rank, step) for step, rank in enumerate(rank_of_each_step)])


def assert_statistics(buffers, expected):
    mean, var = expected
    torch.testing.assert_close(buffers["running_mean"], mean)
    torch.testing.assert_close(buffers["running_var"], var)
    assert buffers["num_batches_tracked"].item() == DDP_BATCH_NORM_STEPS


def test_with_forward_sync_buffers_each_rank_ends_with_rank_0s_statistics_updated_by_its_own_last_batch(
    batch_norm_through_ddp,
):
    rank_0, rank_1 = (rank["forward_sync_buffers=True"]["trained"] for rank in batch_norm_through_ddp)
    assert_statistics(rank_0, hand_computed([0, 0, 0]))  # rank 0's own batches only: one shard's statistics
    assert_statistics(rank_1, hand_computed([0, 0, 1]))  # rank 0's, broadcast at the last forward, then its own
    assert (rank_0["running_mean"] - rank_1["running_mean"]).abs().min() > 0.1  # the ranks leave training apart


def test_without_forward_sync_buffers_each_rank_keeps_the_statistics_of_its_own_batches(batch_norm_through_ddp):
    for rank, result in enumerate(batch_norm_through_ddp):
        assert_statistics(result["forward_sync_buffers=False"]["trained"], hand_computed([rank] * 3))


def test_synchronized_batch_norm_through_ddp_gives_every_rank_the_statistics_of_the_global_batches(
    batch_norm_through_ddp,
):
    global_batches = [
        torch.cat([ddp_batch_norm_batch(rank, step) for rank in range(2)]) for step in range(DDP_BATCH_NORM_STEPS)
    ]
    for result in batch_norm_through_ddp:
        assert_statistics(result["synchronized (common/batchnorm.py)"]["trained"], running_statistics(global_batches))


def test_evaluating_through_the_ddp_wrapper_gives_every_rank_rank_0s_statistics(batch_norm_through_ddp):
    for result in batch_norm_through_ddp:
        # The eval forward starts with the broadcast of rank 0's buffers; BatchNorm in eval mode changes nothing.
        assert_statistics(result["forward_sync_buffers=True"]["evaluated_through_ddp"], hand_computed([0, 0, 0]))
    # Without the broadcast, each rank evaluates its shard with its own statistics.
    assert_statistics(
        batch_norm_through_ddp[1]["forward_sync_buffers=False"]["evaluated_through_ddp"], hand_computed([1, 1, 1])
    )


def test_ddp_refuses_sync_batch_norm_on_cpu_in_this_pytorch(batch_norm_through_ddp):
    # When PyTorch supports SyncBatchNorm on CPUs this fails: the lesson and common/batchnorm.py need updating.
    for result in batch_norm_through_ddp:
        assert result["sync_batchnorm_on_cpu"] == "ValueError: SyncBatchNorm layers only work with GPU modules"
