"""Correctness across processes: each test forms a real gloo process group of 2 to 4 CPU processes.

The functions that run on the ranks live at module level, because spawned processes import them by name.
Every run has a deadline (``timeout``), so a hang fails the test in seconds instead of stalling CI.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, TensorDataset

from common.checkpoint import load_checkpoint, save_checkpoint
from common.data import make_loader
from common.distributed import (all_reduce_mean, all_reduce_sum, get_rank, global_mean, main_process_first,
                                replicas_in_sync, set_seed)
from common.launch import run_on_ranks
from common.metrics import evaluate
from common.models import LeNet, SimpleCNN

STEPS, BATCH, LR = 3, 16, 0.1


def batches():
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 1, 28, 28, generator=generator), torch.randint(0, 10, (BATCH,), generator=generator))
            for _ in range(STEPS)]


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
    return {"ddp": with_ddp, "no_sync": without_sync,
            "in_sync": [replicas_in_sync(ddp_model), replicas_in_sync(local_model)]}


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


# Logits chosen so that sample i is classified correctly exactly when y[i] == 0. Sample 0, which the sampler
# repeats as padding, is correct; most others are not: counting the padding would inflate the accuracy.
LABELS = torch.tensor([0, 0, 3, 4, 5, 6, 7, 0, 8, 9, 1])
LOGITS = F.one_hot(torch.zeros(11, dtype=torch.long), 10).float() * 3 + torch.linspace(0, 1, 11)[:, None]


class GenericDataset(Dataset):
    """Not a TensorDataset, so ``make_loader`` gives it a ``DataLoader``."""

    def __len__(self):
        return len(LABELS)

    def __getitem__(self, index):
        return LOGITS[index], LABELS[index]


def evaluate_logits(env):
    results = {}
    for kind, dataset in (("tensor", TensorDataset(LOGITS, LABELS)), ("generic", GenericDataset())):
        loader = make_loader(dataset, 2, env.rank, env.world_size, train=False)
        results[kind] = evaluate(nn.Identity(), loader, env.device)
        local = torch.cat([(X.argmax(1) == y).float() for X, y in loader])
        results[kind]["mean_of_rank_means"] = all_reduce_mean(local.mean()).item()
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_distributed_evaluation_counts_every_sample_exactly_once(world_size):
    expected_accuracy = (LOGITS.argmax(1) == LABELS).float().mean().item()  # 3 of 11
    expected_loss = F.cross_entropy(LOGITS, LABELS).item()
    for rank in run_on_ranks(evaluate_logits, world_size, timeout=90):
        for kind in ("tensor", "generic"):
            result = rank[kind]
            assert result["count"] == 11
            assert result["accuracy"] == pytest.approx(expected_accuracy)
            assert result["loss"] == pytest.approx(expected_loss)
            # What the naive average gives, padding included: a different, wrong number.
            assert result["mean_of_rank_means"] != pytest.approx(expected_accuracy)


def reduce_rank_values(env):
    values = [float(10 * env.rank + i) for i in range(env.rank + 1)]  # rank r holds r+1 values
    return {"mean": all_reduce_mean(float(env.rank)).item(), "sum": all_reduce_sum([1.0, env.rank]).tolist(),
            "global_mean": global_mean(sum(values), len(values))}


def test_reductions_equal_the_mean_over_ranks_and_over_samples():
    every_value = [10.0 * rank + i for rank in range(3) for i in range(rank + 1)]
    for rank in run_on_ranks(reduce_rank_values, 3, timeout=90):
        assert rank["mean"] == pytest.approx(1.0)  # (0 + 1 + 2) / 3
        assert rank["sum"] == [3.0, 3.0]
        assert rank["global_mean"] == pytest.approx(sum(every_value) / len(every_value))


def save_then_load_everywhere(env, path):
    set_seed(env.rank)  # different weights on each rank before loading
    model = DDP(LeNet())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if env.rank == 0:
        saved = [p.detach().clone() for p in model.parameters()]
    save_checkpoint(path, model, optimizer, epoch=2, step=7)
    fresh = LeNet()
    state = load_checkpoint(path, fresh, device=env.device)
    return {"state": state, "params": [p.detach() for p in fresh.parameters()],
            "saved": saved if env.rank == 0 else []}


def test_rank_0_saves_and_every_rank_loads_the_same_weights(tmp_path):
    path = tmp_path / "ckpt.pt"
    ranks = run_on_ranks(save_then_load_everywhere, 2, str(path), timeout=90)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]
    for rank in ranks:
        assert rank["state"] == {"epoch": 2, "step": 7}
        torch.testing.assert_close(rank["params"], ranks[0]["saved"], rtol=0, atol=0)


def write_once(env, folder):
    """Each rank, inside main_process_first, records whether rank 0's file already existed."""
    from pathlib import Path
    marker = Path(folder) / "downloaded"
    with main_process_first():
        found = marker.exists()
        if env.rank == 0:
            import time
            time.sleep(0.5)  # a slow "download": the others must still wait for it
            marker.write_text("data")
    return found


def test_main_process_first_lets_rank_0_finish_before_the_others_start(tmp_path):
    assert run_on_ranks(write_once, 3, str(tmp_path), timeout=90) == [False, True, True]


def wait_forever(env):
    if env.rank == 1:
        torch.distributed.barrier()  # rank 0 never joins: a hang
    else:
        import time
        time.sleep(60)


def fail_on_rank_1(env):
    if env.rank == 1:
        raise ValueError("rank 1 broke")
    torch.distributed.barrier()


def test_the_harness_turns_a_hang_into_an_error_by_its_deadline():
    with pytest.raises(TimeoutError, match="still running"):
        run_on_ranks(wait_forever, 2, timeout=8)


def test_the_harness_reports_a_failing_rank_at_once():
    with pytest.raises(RuntimeError, match="rank 1 broke"):
        run_on_ranks(fail_on_rank_1, 2, timeout=60)


def test_ddp_construction_gives_every_rank_the_weights_of_rank_0():
    from common.ddp import weights_before_and_after_ddp

    ranks = run_on_ranks(weights_before_and_after_ddp, 3, timeout=90)
    assert ranks[0]["before"] != ranks[1]["before"] != ranks[2]["before"]
    assert all(rank["after"] == ranks[0]["before"] for rank in ranks)


def whole_batch_reference():
    """One process, SimpleCNN's convolutional layers on the whole BatchNorm demo batch: output and buffers."""
    from common.batchnorm import batch_norm_batch

    set_seed(0)
    model = SimpleCNN()
    return model.features(batch_norm_batch()).detach(), dict(model.named_buffers())


@pytest.fixture(scope="module")
def batch_norm_ranks():
    """One 2-rank run of the lesson's BatchNorm demo, shared by the tests that read it."""
    from common.batchnorm import batch_norm_across_ranks

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
    from common.batchnorm import synchronize_batch_norms
    from common.batchnorm import batch_norm_batch

    set_seed(0)
    return features_gradients(batch_norm_batch().chunk(env.world_size)[env.rank], synchronize_batch_norms(SimpleCNN()))


def test_synchronized_batch_norm_backpropagates_the_gradients_of_one_process_on_the_whole_batch():
    from common.batchnorm import batch_norm_batch

    set_seed(0)
    reference = features_gradients(batch_norm_batch(), SimpleCNN())
    ranks = run_on_ranks(synchronized_gradients, 2, timeout=90)
    torch.testing.assert_close(torch.cat([rank["input"] for rank in ranks]), reference["input"])
    # Parameter gradients stay per rank until DDP all-reduces them: their sum is the whole batch's gradient.
    summed = [sum(grads) for grads in zip(*(rank["params"] for rank in ranks))]
    torch.testing.assert_close(summed, reference["params"])


def sync_batch_norm_on_cpu(env):
    from common.batchnorm import batch_norm_batch

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
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="nn.SyncBatchNorm needs CUDA tensors in PyTorch 2.14; this machine has no CUDA device")
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
    from common.batchnorm import batch_norm_statistics_through_ddp

    return run_on_ranks(batch_norm_statistics_through_ddp, 2, DDP_BATCH_NORM_STEPS, timeout=120)


def hand_computed(rank_of_each_step):
    """Running mean and variance, by hand, after one batch per step from the rank named for that step."""
    from common.batchnorm import ddp_batch_norm_batch, running_statistics

    return running_statistics([ddp_batch_norm_batch(rank, step) for step, rank in enumerate(rank_of_each_step)])


def assert_statistics(buffers, expected):
    mean, var = expected
    torch.testing.assert_close(buffers["running_mean"], mean)
    torch.testing.assert_close(buffers["running_var"], var)
    assert buffers["num_batches_tracked"].item() == DDP_BATCH_NORM_STEPS


def test_with_forward_sync_buffers_each_rank_ends_with_rank_0s_statistics_updated_by_its_own_last_batch(
        batch_norm_through_ddp):
    rank_0, rank_1 = (rank["forward_sync_buffers=True"]["trained"] for rank in batch_norm_through_ddp)
    assert_statistics(rank_0, hand_computed([0, 0, 0]))  # rank 0's own batches only: one shard's statistics
    assert_statistics(rank_1, hand_computed([0, 0, 1]))  # rank 0's, broadcast at the last forward, then its own
    assert (rank_0["running_mean"] - rank_1["running_mean"]).abs().min() > 0.1  # the ranks leave training apart


def test_without_forward_sync_buffers_each_rank_keeps_the_statistics_of_its_own_batches(batch_norm_through_ddp):
    for rank, result in enumerate(batch_norm_through_ddp):
        assert_statistics(result["forward_sync_buffers=False"]["trained"], hand_computed([rank] * 3))


def test_synchronized_batch_norm_through_ddp_gives_every_rank_the_statistics_of_the_global_batches(
        batch_norm_through_ddp):
    from common.batchnorm import ddp_batch_norm_batch, running_statistics

    global_batches = [torch.cat([ddp_batch_norm_batch(rank, step) for rank in range(2)])
                      for step in range(DDP_BATCH_NORM_STEPS)]
    for result in batch_norm_through_ddp:
        assert_statistics(result["synchronized (common/batchnorm.py)"]["trained"], running_statistics(global_batches))


def test_evaluating_through_the_ddp_wrapper_gives_every_rank_rank_0s_statistics(batch_norm_through_ddp):
    for result in batch_norm_through_ddp:
        # The eval forward starts with the broadcast of rank 0's buffers; BatchNorm in eval mode changes nothing.
        assert_statistics(result["forward_sync_buffers=True"]["evaluated_through_ddp"], hand_computed([0, 0, 0]))
    # Without the broadcast, each rank evaluates its shard with its own statistics.
    assert_statistics(batch_norm_through_ddp[1]["forward_sync_buffers=False"]["evaluated_through_ddp"],
                      hand_computed([1, 1, 1]))


def test_ddp_refuses_sync_batch_norm_on_cpu_in_this_pytorch(batch_norm_through_ddp):
    # When PyTorch supports SyncBatchNorm on CPUs this fails: the lesson and common/batchnorm.py need updating.
    for result in batch_norm_through_ddp:
        assert result["sync_batchnorm_on_cpu"] == "ValueError: SyncBatchNorm layers only work with GPU modules"


BUCKET_CONFIGURATIONS = {"default": {}, "bucket_cap_mb=0.3": {"bucket_cap_mb": 0.3},
                         "find_unused_parameters=True": {"find_unused_parameters": True}}
MiB = 2 ** 20


@pytest.fixture(scope="module")
def buckets():
    """Rank 0's buckets, step by step, from one 2-rank run of ``common.ddp.ddp_buckets``."""
    from common.ddp import ddp_buckets

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
    import torch.distributed as dist

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
        buckets):
    # Cut from model.parameters() in order, the first cut (the first layers) at 1 MiB, then reversed: the bucket
    # with the last layers goes first. The same buckets at every step.
    expected = cut_greedily(list(mlp_parameter_bytes()), [MiB, 25 * MiB])[::-1]
    for step in buckets["find_unused_parameters=True"]["steps"]:
        assert bucket_contents(step) == expected


def gradients_against_an_unrelated_all_reduce(env):
    """Rank 0 runs DDP's gradient all-reduce; rank 1, one of its own of the same size and dtype."""
    set_seed(0)
    model = DDP(nn.Linear(4, 1))  # one bucket of 5 float32 gradients
    if env.rank == 0:
        model(torch.ones(2, 4)).sum().backward()  # every gradient is 2
        return [p.grad for p in model.parameters()]
    unrelated = torch.full((5,), 100.0)
    torch.distributed.all_reduce(unrelated)
    return [unrelated]


def test_collectives_pair_up_by_order_so_a_mismatch_of_the_same_size_goes_unnoticed():
    rank_0, rank_1 = run_on_ranks(gradients_against_an_unrelated_all_reduce, 2, timeout=60)
    # DDP divides rank 0's gradients by the world size (2 / 2) and sums them with rank 1's unrelated 100s.
    assert all(torch.equal(grad, torch.full_like(grad, 2 / 2 + 100)) for grad in rank_0)
    assert torch.equal(rank_1[0], torch.full((5,), 100 + 2 / 2))


def test_without_join_uneven_inputs_pair_unrelated_collectives_and_fail():
    from common.ddp import train_on_uneven_inputs

    # Rank 1 runs out of batches and calls replicas_in_sync, whose all-reduce gloo pairs with rank 0's gradient
    # all-reduce. The sizes differ: gloo aborts rank 0, and rank 1 loses its peer. An error within seconds, as
    # soon as rank 1 gets there: a RuntimeError, not the harness's TimeoutError at the deadline. The deadline is
    # generous only so that a busy machine, slow to start the processes, cannot turn it into a TimeoutError.
    # Either rank 1's error comes back, or the harness sees rank 0 killed by SIGABRT (-6) before rank 1 reports.
    with pytest.raises(RuntimeError, match=r"Connection reset by peer|non-zero codes \{0: -6"):
        run_on_ranks(train_on_uneven_inputs, 2, False, timeout=60)


def test_join_lets_each_rank_run_its_own_number_of_steps_and_keeps_the_replicas_identical():
    from common.ddp import train_on_uneven_inputs, uneven_batches

    ranks = run_on_ranks(train_on_uneven_inputs, 2, True, timeout=120)
    assert [rank["steps"] for rank in ranks] == [4, 3]
    assert [rank["in_sync"] for rank in ranks] == [True, True]
    # The reference: three steps on both ranks' batches, then one on rank 0's alone. The joined rank adds zeros
    # to the all-reduce and DDP still divides by the initial world size, 2: that step uses half rank 0's gradient.
    set_seed(0)
    model = LeNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for rank_0, rank_1 in zip(uneven_batches(0), uneven_batches(1) + [None]):
        optimizer.zero_grad()
        losses = [F.cross_entropy(model(X), y) for X, y in filter(None, (rank_0, rank_1))]
        (sum(losses) / 2).backward()  # / 2 also when rank 1 has no batch left
        optimizer.step()
    for rank in ranks:
        torch.testing.assert_close(rank["params"], [p.detach() for p in model.parameters()])


def resume_through_a_fresh_ddp_wrapper(env, batch_size: int = 2) -> dict:
    """Two SGD steps of LeNet through DDP, uninterrupted and resumed, on all 4 ranks and on ranks 0-1 alone.

    Resumed: a fresh LeNet and a fresh DDP wrapper load the model and optimizer state saved after step 1, then
    take step 2 on the same batch. Both runs start step 2 from the same bits, so each rank's own gradients are
    the same too; only DDP's bucket can differ. For each case, rank's parameters after step 2 in both runs and
    the bucket layout step 2 all-reduced (``model.parameters()`` indices, in bucket order).
    """
    import copy

    import torch.distributed as dist

    generator = torch.Generator().manual_seed(env.rank)  # fixed data, different on every rank
    steps = [(torch.randn(batch_size, 1, 28, 28, generator=generator),
              torch.randint(0, 10, (batch_size,), generator=generator)) for _ in range(2)]
    ranks_0_and_1 = dist.new_group([0, 1])  # every rank takes part in creating a group

    def step(net, optimizer, X, y):
        optimizer.zero_grad()
        F.cross_entropy(net(X), y).backward()
        optimizer.step()

    def bucket_layout(net):
        index = {parameter: i for i, parameter in enumerate(net.module.parameters())}
        return [[index[p] for p in bucket.parameters()] for bucket in net.reducer._get_zeros_like_grad_buckets()]

    results = {}
    for world_size, group in ((4, None), (2, ranks_0_and_1)):
        if env.rank >= world_size:
            continue
        for name, ddp_kwargs in (("default", {}), ("find_unused_parameters=True", {"find_unused_parameters": True})):
            set_seed(0)
            net = DDP(LeNet(), process_group=group, **ddp_kwargs)
            optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
            step(net, optimizer, *steps[0])
            # A deep copy: optimizer.state_dict() holds the momentum buffers themselves, which step 2 changes.
            checkpoint = copy.deepcopy({"model": net.module.state_dict(), "optimizer": optimizer.state_dict()})
            step(net, optimizer, *steps[1])
            uninterrupted = [p.detach().clone() for p in net.module.parameters()]
            uninterrupted_layout = bucket_layout(net)  # DDP rebuilds its buckets in step 2's forward

            model = LeNet()
            model.load_state_dict(checkpoint["model"])
            net = DDP(model, process_group=group, **ddp_kwargs)
            optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
            optimizer.load_state_dict(checkpoint["optimizer"])
            step(net, optimizer, *steps[1])  # the fresh wrapper's first step: its initial buckets
            results[f"{world_size} ranks, {name}"] = {
                "uninterrupted": uninterrupted, "resumed": [p.detach().clone() for p in net.module.parameters()],
                "layouts": [uninterrupted_layout, bucket_layout(net)]}
    dist.barrier()  # ranks 2 and 3 leave only once ranks 0 and 1 are done with their group
    return results


@pytest.fixture(scope="module")
def resumed_steps():
    """Rank 0's results of one 4-process run of ``resume_through_a_fresh_ddp_wrapper``."""
    return run_on_ranks(resume_through_a_fresh_ddp_wrapper, 4, timeout=180)[0]


def ulps_at_tensor_scale(a, b):
    """The largest |a - b| of each pair of tensors, in ulps of float32 at the tensor's largest |value|."""
    ulps = []
    for x, y in zip(a, b):
        largest = x.abs().max()
        ulps.append(float((x - y).abs().max() / (torch.nextafter(largest, torch.tensor(float("inf"))) - largest)))
    return ulps


def test_with_4_ranks_and_default_buckets_a_step_resumed_through_a_fresh_ddp_wrapper_is_off_by_rounding(
        resumed_steps):
    case = resumed_steps["4 ranks, default"]
    uninterrupted, resumed = case["uninterrupted"], case["resumed"]
    rebuilt, initial = case["layouts"]
    # One bucket (LeNet's 516 KB < DDP's 1 MiB first cap) both times, its parameters in another order: the
    # uninterrupted run's is rebuilt in the order gradients became ready, the fresh wrapper's is the initial one.
    assert len(rebuilt) == len(initial) == 1 and rebuilt != initial and sorted(rebuilt[0]) == initial[0]
    differing = sum(int((x != y).sum()) for x, y in zip(uninterrupted, resumed))
    largest = max(float((x - y).abs().max()) for x, y in zip(uninterrupted, resumed))
    ulps = ulps_at_tensor_scale(uninterrupted, resumed)
    figure = (f"{differing} of {sum(x.numel() for x in uninterrupted)} parameters differ, by at most {largest:.3g}; "
              f"per tensor, in ulps at its largest |value|: {ulps}")
    print(f"\n4 ranks, DDP defaults, resumed vs uninterrupted step 2: {figure}")
    assert differing > 0, figure
    # Rounding, not a wrong gradient: no tensor moves by more than 2 ulps of its largest value.
    assert max(ulps) <= 2, figure


def test_with_find_unused_parameters_a_resumed_step_equals_the_uninterrupted_one(resumed_steps):
    for world_size in (4, 2):
        case = resumed_steps[f"{world_size} ranks, find_unused_parameters=True"]
        assert case["layouts"][0] == case["layouts"][1]  # the initial buckets, never rebuilt
        assert all(torch.equal(x, y) for x, y in zip(case["uninterrupted"], case["resumed"])), world_size


def test_with_2_ranks_a_resumed_step_equals_the_uninterrupted_one_whatever_the_bucket_order(resumed_steps):
    case = resumed_steps["2 ranks, default"]
    assert case["layouts"][0] != case["layouts"][1]  # rebuilt, as with 4 ranks
    # a + b == b + a in floating point: with two ranks, no summation order can change a bit.
    assert all(torch.equal(x, y) for x, y in zip(case["uninterrupted"], case["resumed"]))
