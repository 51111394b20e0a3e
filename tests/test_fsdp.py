"""FSDP2 and ZeRO on CPU with gloo: the same numbers as DDP, 1/N of the memory, and checkpoints that reshard.

Three process groups in all (world sizes 2, 1 and 4), each run once for the whole module: the world-size-2 run
trains DDP, FSDP2 (both reshard modes) and ZeRO-1 side by side and saves a sharded checkpoint; the others load
that checkpoint and measure what each rank holds. Sharding goes through lesson 06's own ``shard_model`` of
``solutions/03_fsdp.py``, checkpoints through ``common.fsdp``'s sharded save and load: what the script runs.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel as DDP

from common.distributed import replicas_in_sync
from common.fsdp import (
    SOLUTION,
    export_full_state_dict,
    force_sum_reduction,
    full_gradients,
    full_parameters,
    full_tensor,
    load_sharded_checkpoint,
    measure_model_state,
    save_sharded_checkpoint,
)
from common.launch import load_script, run_on_ranks
from common.memory import training_state_bytes, zero_bytes_per_rank
from common.models import DeepMLP, SimpleCNN

# 37 rows: dim 0 of every block weight divides by neither 2 nor 4, so the shards are uneven (19 + 18; 10+10+10+7)
WIDTH, DEPTH, STEPS, BATCH, LR = 37, 2, 4, 12, 0.01


def odd_model():
    torch.manual_seed(0)
    return DeepMLP(width=WIDTH, depth=DEPTH)


def step_batches(env):
    """STEPS global batches of BATCH samples; this rank's share of each (every world size sees the same data)."""
    generator = torch.Generator().manual_seed(1)
    X = torch.randn(STEPS, BATCH, 1, 28, 28, generator=generator)
    y = torch.randint(0, 10, (STEPS, BATCH), generator=generator)
    return [(X[s][env.rank :: env.world_size], y[s][env.rank :: env.world_size]) for s in range(STEPS)]


def train(net, optimizer, batches):
    """Adam steps on the batches; returns the gradients of the first step, whole."""
    first_gradients = None
    for X, y in batches:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(net(X), y).backward()
        if first_gradients is None:
            first_gradients = full_gradients(net)
        optimizer.step()
    return first_gradients


def model_state_of_the_big_model(env):
    """What each rank holds of the default DeepMLP under FSDP2 after one Adam step: bytes by kind."""
    torch.manual_seed(0)
    net = load_script(SOLUTION).shard_model(DeepMLP(), env, "full")
    optimizer = torch.optim.Adam(net.parameters())
    X, y = step_batches(env)[0]
    F.cross_entropy(net(X), y).backward()
    optimizer.step()
    return training_state_bytes(net, optimizer)


def side_by_side(env, checkpoint_dir):
    fsdp = load_script(SOLUTION)
    # The collective under FSDP2's fp32 gradients: reduce-scatter with AVG. gloo's once summed (pytorch#162338).
    averaged = torch.empty(2)
    dist.reduce_scatter_single(averaged, torch.full((2 * env.world_size,), float(env.rank + 1)), op=dist.ReduceOp.AVG)
    results = {"reduce_scatter_avg": averaged}
    ddp = DDP(odd_model())
    optimizer = torch.optim.Adam(ddp.parameters(), lr=LR)
    results["ddp_gradients"] = train(ddp, optimizer, step_batches(env))
    results["ddp"] = full_parameters(ddp)

    for name, sharding in (("full", "full"), ("grad_op", "grad-op"), ("force_sum", "full"), ("offload", "full")):
        # CPU offload keeps shards in CPU memory; on this CPU-only machine without pinning it (no CUDA driver)
        net = fsdp.shard_model(odd_model(), env, sharding, offload=name == "offload")
        if name == "force_sum":  # the documented way around a broken AVG: reduce with SUM, then divide by N
            force_sum_reduction(net)
        optimizer = torch.optim.Adam(net.parameters(), lr=LR)  # after sharding: Adam's states are shards too
        results[f"{name}_gradients"] = train(net, optimizer, step_batches(env))
        results[name] = full_parameters(net)
        results[f"{name}_in_sync"] = replicas_in_sync(net)
    weight = net.blocks[0][0].weight
    results["placements"] = [repr(placement) for placement in weight.placements]
    results["local_rows"] = weight.to_local().shape[0]
    results["is_dtensor"] = isinstance(weight, DTensor) and weight.placements == (Shard(0),)

    # the fully sharded run's checkpoint, for the other world sizes to load, and its whole-model export
    net = fsdp.shard_model(odd_model(), env, "full")
    optimizer = torch.optim.Adam(net.parameters(), lr=LR)
    train(net, optimizer, step_batches(env))
    save_sharded_checkpoint(checkpoint_dir / "sharded", net, optimizer, epoch=3, step=STEPS)
    export_full_state_dict(checkpoint_dir / "full.pt", net)
    results["saved"] = full_parameters(net)
    results["saved_exp_avg"] = [full_tensor(optimizer.state[p]["exp_avg"]) for p in net.parameters()]

    # BatchNorm's running statistics are buffers, which FSDP2 neither shards nor synchronizes
    torch.manual_seed(0)
    cnn = fsdp.shard_model(SimpleCNN(), env, "full")
    optimizer = torch.optim.Adam(cnn.parameters(), lr=LR)
    X = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(env.rank))  # each rank its own batch
    F.cross_entropy(cnn(X), torch.zeros(4, dtype=torch.long)).backward()
    optimizer.step()
    results["batch_norm_trained"] = [buffer.clone() for buffer in cnn.buffers()]
    save_sharded_checkpoint(checkpoint_dir / "cnn", cnn, optimizer, epoch=1, step=1)
    torch.manual_seed(0)
    cnn = fsdp.shard_model(SimpleCNN(), env, "full")
    load_sharded_checkpoint(checkpoint_dir / "cnn", cnn, torch.optim.Adam(cnn.parameters(), lr=LR))
    results["batch_norm_loaded"] = [buffer.clone() for buffer in cnn.buffers()]

    zero_net = DDP(odd_model())
    zero = ZeroRedundancyOptimizer(zero_net.parameters(), optimizer_class=torch.optim.Adam, lr=LR)
    train(zero_net, zero, step_batches(env))
    results["zero1"] = full_parameters(zero_net)

    big, zero = zero1_step_on_the_big_model(env)
    results["zero1_bytes"] = training_state_bytes(big, zero)
    results["zero1_owned"] = owned_adam_states(big, zero)
    results["fsdp_bytes"] = model_state_of_the_big_model(env)
    # what the root's reshard_after_forward changes: all-gathers per step, parameter bytes held
    results["root"] = {
        strategy: measure_model_state(env, strategy)
        for strategy in ("fsdp-grad-op", "fsdp-full", "fsdp-full-root-resharded")
    }
    return results


def zero1_step_on_the_big_model(env):
    """DeepMLP under DDP with ZeRO-1 (Adam) after one step: its optimizer state now exists, sharded."""
    torch.manual_seed(0)
    big = DDP(DeepMLP())
    zero = ZeroRedundancyOptimizer(big.parameters(), optimizer_class=torch.optim.Adam)
    X, y = step_batches(env)[0]
    F.cross_entropy(big(X), y).backward()
    zero.step()
    return big, zero


def owned_adam_states(big, zero):
    """{parameter name: (numel of its exp_avg on this rank, numel of the parameter)} for the parameters whose Adam
    state this rank keeps under ZeRO-1 (its local optimizer steps only those)."""
    names = {p: name for name, p in big.module.named_parameters()}
    return {names[p]: (state["exp_avg"].numel(), p.numel()) for p, state in zero.optim.state.items()}


def reload_and_measure(env, checkpoint_dir):
    fsdp = load_script(SOLUTION)
    net = fsdp.shard_model(odd_model(), env, "full")  # a fresh model: its own initial weights, no Adam state
    optimizer = torch.optim.Adam(net.parameters(), lr=LR)
    progress = load_sharded_checkpoint(checkpoint_dir / "sharded", net, optimizer)
    big, zero = zero1_step_on_the_big_model(env)
    return {
        "progress": progress,
        "parameters": full_parameters(net),
        "exp_avg": [full_tensor(optimizer.state[p]["exp_avg"]) for p in net.parameters()],
        "local_rows": net.blocks[0][0].weight.to_local().shape[0],
        "fsdp_bytes": model_state_of_the_big_model(env),
        "zero1_bytes": training_state_bytes(big, zero),
    }


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fsdp")


@pytest.fixture(scope="module")
def two_ranks(checkpoint_dir):
    return run_on_ranks(side_by_side, 2, checkpoint_dir, timeout=120)


@pytest.fixture(scope="module")
def reloaded(checkpoint_dir, two_ranks):
    return {
        world_size: run_on_ranks(reload_and_measure, world_size, checkpoint_dir, timeout=120) for world_size in (1, 4)
    }


def test_fsdp2_parameters_are_row_shards_of_uneven_size(two_ranks, reloaded):
    assert [rank["local_rows"] for rank in two_ranks] == [19, 18]
    assert [rank["local_rows"] for rank in reloaded[4]] == [10, 10, 10, 7]  # chunks of ceil(37 / 4) rows
    assert all(rank["is_dtensor"] and rank["placements"] == ["Shard(dim=0)"] for rank in two_ranks)


def test_gloo_reduce_scatter_with_avg_averages(two_ranks):
    # ranks send 1s and 2s: the mean is 1.5 (a sum would be 3)
    for rank in two_ranks:
        torch.testing.assert_close(rank["reduce_scatter_avg"], torch.full((2,), 1.5))


def test_fsdp2_gradients_are_averaged_over_ranks_like_ddp(two_ranks):
    # A backend that summed instead of averaging would give twice DDP's gradient here. With 2 ranks the sum of
    # two partial gradients does not depend on the order of addition, and dividing by 2 is exact, so dividing
    # before the sum (DDP) or after it (FSDP2) gives the same bits: FSDP2 and DDP agree bit for bit.
    for rank in two_ranks:
        for name in ("full", "grad_op", "force_sum", "offload"):
            torch.testing.assert_close(rank[f"{name}_gradients"], rank["ddp_gradients"], rtol=0, atol=0)


def test_fsdp2_parameters_after_adam_steps_equal_ddp(two_ranks):
    for rank in two_ranks:
        for name in ("full", "grad_op", "force_sum", "offload"):  # bit for bit, as the gradients
            torch.testing.assert_close(rank[name], rank["ddp"], rtol=0, atol=0)
        assert rank["full_in_sync"] and rank["grad_op_in_sync"]
    assert not torch.equal(two_ranks[0]["ddp"][0], odd_model().stem[1].weight)  # the steps did move it


def test_the_root_stays_gathered_from_forward_to_backward_saving_one_all_gather_per_step(two_ranks):
    model = DeepMLP()
    whole = sum(p.numel() for p in model.parameters()) * 4
    root = sum(p.numel() for module in (model.stem, model.head) for p in module.parameters()) * 4  # 28% of it
    units = 1 + len(model.blocks)
    for rank in two_ranks:
        default, forced, grad_op = (
            rank["root"][strategy] for strategy in ("fsdp-full", "fsdp-full-root-resharded", "fsdp-grad-op")
        )
        # FSDP2's default for the root: gathered once, in forward, and kept for backward, which starts with it
        assert default["all_gathers"] == 2 * units - 1 and forced["all_gathers"] == 2 * units
        assert grad_op["all_gathers"] == units  # nothing resharded after forward: no all-gather in backward
        # between forward and backward: the root whole and half of each block, against half of everything
        assert default["after_forward"] == root + (whole - root) / 2
        assert forced["after_forward"] == whole / 2
        # once backward has begun, the forced root is gathered again: the same bytes as under the default
        assert forced["backward_start"] == default["backward_start"] == default["after_forward"]


def test_zero1_around_ddp_equals_ddp_with_plain_adam(two_ranks):
    for rank in two_ranks:
        torch.testing.assert_close(rank["zero1"], rank["ddp"], rtol=0, atol=0)


def test_a_checkpoint_saved_by_two_ranks_loads_on_one_and_on_four(two_ranks, reloaded):
    saved = two_ranks[0]
    for world_size, ranks in reloaded.items():
        assert len(ranks) == world_size
        for rank in ranks:
            assert rank["progress"] == {"epoch": 3, "step": STEPS}
            for loaded, expected in zip(rank["parameters"] + rank["exp_avg"], saved["saved"] + saved["saved_exp_avg"]):
                assert torch.equal(loaded, expected)
    assert not torch.equal(saved["saved"][0], odd_model().stem[1].weight)  # not just the shared initial weights


def test_batchnorm_statistics_stay_per_rank_and_a_checkpoint_keeps_one_copy_of_each(two_ranks):
    trained, loaded = ([rank[key] for rank in two_ranks] for key in ("batch_norm_trained", "batch_norm_loaded"))
    statistics = [i for i, buffer in enumerate(trained[0]) if buffer.is_floating_point()]  # not the batch counters
    assert len(statistics) == 6  # running mean and variance of 3 BatchNorms
    # each rank normalised its own batch, and nothing made the ranks agree
    assert not any(torch.equal(trained[0][i], trained[1][i]) for i in statistics)
    for i in range(len(trained[0])):
        assert torch.equal(loaded[0][i], loaded[1][i])  # loaded, every rank holds the same copy
        assert any(torch.equal(loaded[0][i], rank[i]) for rank in trained)  # some rank's, as DCP chose to write it


def test_the_full_state_dict_loads_into_a_plain_module(checkpoint_dir, two_ranks):
    plain = DeepMLP(width=WIDTH, depth=DEPTH)
    plain.load_state_dict(torch.load(checkpoint_dir / "full.pt", weights_only=True))
    torch.testing.assert_close([p.detach() for p in plain.parameters()], two_ranks[0]["saved"], rtol=0, atol=0)


def test_each_rank_holds_one_nth_of_parameters_gradients_and_optimizer_state(two_ranks, reloaded):
    measured = {1: reloaded[1], 2: two_ranks, 4: reloaded[4]}
    whole = measured[1][0]["fsdp_bytes"]
    num_parameters = sum(p.numel() for p in DeepMLP().parameters())
    assert whole["parameters"] == num_parameters * 4
    for world_size, ranks in measured.items():
        predicted = zero_bytes_per_rank(num_parameters, world_size, stage=3)
        for rank in ranks:
            for kind in ("parameters", "gradients", "optimizer"):
                assert rank["fsdp_bytes"][kind] <= 1.05 * whole[kind] / world_size, (world_size, kind, rank)
                assert rank["fsdp_bytes"][kind] == pytest.approx(predicted[kind], rel=0.05)
        # nothing lost, nothing replicated: the shards add up to the whole
        for kind in ("parameters", "gradients"):
            assert sum(rank["fsdp_bytes"][kind] for rank in ranks) == whole[kind]


def test_zero1_splits_the_optimizer_state_by_whole_tensors(two_ranks, reloaded):
    whole = reloaded[1][0]["fsdp_bytes"]
    state = [rank["zero1_bytes"] for rank in two_ranks]
    assert all(rank["parameters"] == whole["parameters"] and rank["gradients"] == whole["gradients"] for rank in state)
    assert sum(rank["optimizer"] for rank in state) == whole["optimizer"]
    # each tensor's state lives on one rank: a rank can exceed the even share by up to the largest tensor's state
    largest = max(p.numel() for p in DeepMLP().parameters()) * 8
    assert max(rank["optimizer"] for rank in state) <= whole["optimizer"] / 2 + largest
    # whole tensors: every parameter's Adam state on exactly one rank, as large as the parameter itself
    owned = [rank["zero1_owned"] for rank in two_ranks]
    names = [name for name, _ in DeepMLP().named_parameters()]
    assert sorted(name for rank in owned for name in rank) == sorted(names)
    assert all(state == numel for rank in owned for state, numel in rank.values())
    # so the shares are unequal here (5.37 against 6.29 MB): an even split of the elements would make them equal
    assert state[0]["optimizer"] != state[1]["optimizer"]


def test_zero1_on_4_ranks_gives_each_tensor_to_the_least_loaded_rank_largest_first(reloaded):
    # ZeroRedundancyOptimizer._partition_parameters: tensors sorted by size, largest first, each to the rank
    # with the fewest elements so far (the first such rank on a tie). Adam keeps 8 bytes per element on the
    # owning rank, plus one 4-byte step counter per tensor.
    loads, owned = [0] * 4, [0] * 4
    for numel in sorted((p.numel() for p in DeepMLP().parameters()), reverse=True):
        rank = loads.index(min(loads))
        loads[rank] += numel
        owned[rank] += 1
    predicted = [8 * load + 4 * count for load, count in zip(loads, owned)]
    measured = [rank["zero1_bytes"]["optimizer"] for rank in reloaded[4]]
    assert measured == predicted
    # lesson 06's figures: rank 0 the 512 x 784 stem weight alone, rank 1 two 512 x 512 block weights
    assert [round(nbytes / 1e6, 2) for nbytes in measured] == [3.21, 4.19, 2.14, 2.12]
