"""Tensor parallelism by hand (common.tensor_parallel) against the unsharded modules, and against torch's DTensor.

One process group per world size (2 and 4) does everything (``every_check``, one spawn each); the tests below only
assert, computing the single-process reference here, in the test process, from the same seeds. In float64, so
that the different order of the sums leaves the results equal to rounding:

- the MLP and the attention block, sharded from the full modules' weights: outputs, the input's gradient and every
  parameter's gradient equal the full module's (each rank's slice of them);
- 3 SGD steps of the tensor-parallel MLP equal 3 steps of one process training the whole MLP;
- ``count_collectives``: one all-reduce forward and one backward per block, of ``mlp_all_reduce_bytes``;
- torch's ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` on gloo, from the same weights:
  the same outputs and gradients, and what ``CommDebugMode`` counts forward and backward;
- at world size 4, a 2-D mesh of 2 data-parallel replicas x 2 tensor-parallel ranks (attention, then the MLP):
  3 SGD steps by hand (DDP over the replicas) and by torch (FSDP2 over the replicas, DTensor TP within) equal one
  process on the whole batch; the TP all-reduces stay within a replica, DDP's go across replicas.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.parallel import DistributedDataParallel as DDP

from common.collectives import AllReduceCounter, count_collectives
from common.launch import load_script, run_on_ranks
from common.tensor_parallel import (
    ColumnParallelLinear,
    FeedForward,
    RowParallelLinear,
    SelfAttention,
    TensorParallelMLP,
    TensorParallelSelfAttention,
    TransformerBlock,
    data_and_tensor_parallel_mesh,
    mlp_all_reduce_bytes,
    parallelize_block,
    parallelize_feed_forward,
    shard_block,
    shard_range,
)
from tests.conftest import REPO

WORLD_SIZES = (2, 4)
BATCH, SEQ, D_MODEL, NUM_HEADS, STEPS, LR = 2, 3, 8, 4, 3, 0.1
DTYPE = torch.float64


def full_mlp():
    torch.manual_seed(0)
    return FeedForward(D_MODEL).to(DTYPE)


def full_attention():
    torch.manual_seed(1)
    return SelfAttention(D_MODEL, NUM_HEADS).to(DTYPE)


def batch():
    """The input every rank sees whole (tensor parallelism replicates it), and a target for a loss."""
    generator = torch.Generator().manual_seed(2)
    X = torch.randn(BATCH, SEQ, D_MODEL, generator=generator, dtype=DTYPE)
    target = torch.randn(BATCH, SEQ, D_MODEL, generator=generator, dtype=DTYPE)
    return X, target


def loss_of(output, target):
    return F.mse_loss(output, target)


def forward_backward(module, counted: bool):
    """Output, input gradient and parameter gradients of ``module`` on the batch; with ``counted``, what
    ``count_collectives`` saw in forward and in backward (as [name, bytes] pairs)."""
    X, target = batch()
    X.requires_grad_(True)
    if counted:
        with count_collectives() as forward_log:
            output = module(X)
        with count_collectives() as backward_log:
            loss_of(output, target).backward()
        logs = {
            key: [[c.name, c.bytes] for c in log.calls]
            for key, log in [("forward", forward_log), ("backward", backward_log)]
        }
    else:
        loss_of(output := module(X), target).backward()
        logs = None
    gradients = {name: p.grad.clone() for name, p in module.named_parameters()}
    return {"output": output.detach().clone(), "input_grad": X.grad.clone(), "grads": gradients, "collectives": logs}


def train(module, steps=STEPS, data=None):
    """``steps`` SGD steps on ``data`` (the batch by default); the parameters at the end."""
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    X, target = batch() if data is None else data
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss_of(module(X), target).backward()
        optimizer.step()
    return {name: p.detach().clone() for name, p in module.named_parameters()}


class CommDebugModeWithBytes(CommDebugMode):
    """``CommDebugMode`` that also notes the bytes of each all-reduce it sees (its input's size): CommDebugMode
    counts calls only, and the formula is in bytes."""

    def __init__(self):
        super().__init__()
        self.all_reduce_bytes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = super().__torch_dispatch__(func, types, args, kwargs)
        # NotImplemented: a DTensor op, which DTensor first turns into local ops and collectives (seen next).
        if result is not NotImplemented and "all_reduce" in str(getattr(func, "_overloadpacket", "")):
            self.all_reduce_bytes.append(args[0].numel() * args[0].element_size())
        return result


def torch_checks(env):
    """torch's DTensor version of the MLP from the same weights, with ``CommDebugMode`` around forward and backward."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (env.world_size,))
    model = parallelize_feed_forward(full_mlp(), mesh)
    X, target = batch()
    X.requires_grad_(True)
    with count_collectives() as dist_log, CommDebugModeWithBytes() as forward_mode:
        output = model(X)
    with CommDebugModeWithBytes() as backward_mode:
        loss_of(output, target).backward()

    def counts(mode):
        return {str(op): count for op, count in mode.get_comm_counts().items()}

    return {
        "output": (output + 0).detach().clone(),  # an AsyncCollectiveTensor: any op waits and gives a plain tensor
        "input_grad": X.grad.clone(),
        "grads": {name: p.grad.full_tensor().clone() for name, p in model.named_parameters()},
        "local_weight_shapes": {name: list(p.to_local().shape) for name, p in model.named_parameters()},
        "forward_counts": counts(forward_mode),
        "backward_counts": counts(backward_mode),
        "forward_bytes": forward_mode.all_reduce_bytes,
        "backward_bytes": backward_mode.all_reduce_bytes,
        "dist_calls_seen": dist_log.count(),
        "block": torch_block_checks(mesh),
    }


def torch_block_checks(mesh):
    """The whole transformer layer by torch (``parallelize_block``) and by hand (``shard_block``), from the same
    weights: outputs, input gradients, and the all-reduces ``CommDebugMode`` counts forward and backward."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    # parallelize_block's plan without its PrepareModuleInput: each of q, k, v makes its own replicated input.
    plan = {f"attention.{name}": ColwiseParallel() for name in ("q", "k", "v")}
    plan |= {"attention.out": RowwiseParallel(), "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()}
    makers = {
        "torch": lambda: parallelize_block(full_block(), mesh),
        "torch without one input": lambda: parallelize_module(full_block(), mesh, plan),
        "by hand": lambda: shard_block(full_block(), mesh.get_local_rank(), mesh.size()),
    }
    X, target = batch()
    results = {}
    for name, make in makers.items():
        block = make()
        inputs = X.clone().requires_grad_(True)
        with CommDebugMode() as forward_mode:
            output = block(inputs)
        with CommDebugMode() as backward_mode:
            loss_of(output, target).backward()
        counts = [{str(op): n for op, n in mode.get_comm_counts().items()} for mode in (forward_mode, backward_mode)]
        results[name] = {"output": (output + 0).detach(), "input_grad": inputs.grad.clone(), "counts": counts}
    return results


TP_SIZE = 2  # the 2-D checks, in the world of 4: 2 data-parallel replicas of 2 tensor-parallel ranks


def full_block():
    """The 2-D checks' model, whole: a pre-norm transformer layer (norms, attention, MLP; TransformerBlock)."""
    torch.manual_seed(5)
    return TransformerBlock(D_MODEL, NUM_HEADS).to(DTYPE)


def global_batch():
    """The 2-D checks' batch: ``BATCH`` samples for each of the 2 replicas."""
    generator = torch.Generator().manual_seed(4)
    X = torch.randn(2 * BATCH, SEQ, D_MODEL, generator=generator, dtype=DTYPE)
    return X, torch.randn(2 * BATCH, SEQ, D_MODEL, generator=generator, dtype=DTYPE)


def two_d_checks(env):
    """World size 4: the block on a 2 x 2 mesh, by hand (``shard_block``, then DDP over the replicas) and by torch
    (``parallelize_block``, then FSDP2 over the replicas, as PyTorch's tensor-parallel tutorial and torchtitan do);
    then solution 13 itself on the same mesh, both ways, for two batches."""
    from torch.distributed.fsdp import fully_shard

    mesh = data_and_tensor_parallel_mesh("cpu", TP_SIZE)
    shard, replica = mesh["tp"].get_local_rank(), mesh["dp"].get_local_rank()
    X, target = global_batch()
    mine = slice(replica * BATCH, (replica + 1) * BATCH)  # a replica's half of the batch, the same on its TP ranks
    block = shard_block(full_block(), shard, TP_SIZE, mesh["tp"].get_group())
    net = DDP(block, process_group=mesh["dp"].get_group())  # averages each shard's gradient over its replicas
    counter = AllReduceCounter.attach(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        with count_collectives() as log:
            loss_of(net(X[mine]), target[mine]).backward()
        if step == 0:
            calls = [[call.name, call.bytes, list(call.group_ranks)] for call in log.calls]
            dp = {"calls": counter.calls, "bytes": counter.bytes}
        optimizer.step()
    theirs = fully_shard(parallelize_block(full_block(), mesh["tp"]), mesh=mesh["dp"])
    theirs = train(theirs, data=(X[mine], target[mine]))
    solution = load_script(REPO / "solutions" / "13_tensor_parallel.py")
    quick = ["--dataset", "digits", "--epochs", "1", "--max-batches-per-epoch", "2", "--num-workers", "0"]
    script_runs = {
        tp: solution.train(solution.parse_args([*quick, "--data-parallel", "2", "--tp", tp]), env)[0]
        for tp in ("by-hand", "torch")
    }
    return {
        "shard": shard,
        "tp_ranks": dist.get_process_group_ranks(mesh["tp"].get_group()),
        "dp_ranks": dist.get_process_group_ranks(mesh["dp"].get_group()),
        "by_hand": {name: p.detach().clone() for name, p in block.named_parameters()},
        "parameter_bytes": sum(p.numel() * p.element_size() for p in block.parameters()),
        "calls": calls,
        "dp_all_reduces": dp,
        "torch": {name: p.full_tensor().clone() for name, p in theirs.items()},
        "script_runs": script_runs,
    }


def corrupted_copies(env):
    """Solution 13's ``copies_in_sync`` on its model split as the script splits it, with world size / 2 replicas of
    2 tensor-parallel ranks, by hand and by torch: untouched, then with the last rank's copy of a replicated
    parameter changed, then (by hand) its shard of the MLP: what the check returns, or the error it raises."""
    solution = load_script(REPO / "solutions" / "13_tensor_parallel.py")
    mesh = data_and_tensor_parallel_mesh("cpu", TP_SIZE)
    outcomes = {}
    for tp, shard in (("by-hand", solution.shard_by_hand), ("torch", solution.shard_with_torch)):
        for corrupted in (None, "embed.weight", "layer.mlp.up.weight"):
            if tp == "torch" and corrupted == "layer.mlp.up.weight":
                continue  # FSDP2 or not, no other rank holds this rank's piece of it: nothing to corrupt against
            torch.manual_seed(0)
            model = solution.RowTransformer(10)
            shard(model, mesh, env)
            if corrupted and env.rank == env.world_size - 1:
                parameter = model.get_parameter(corrupted)
                with torch.no_grad():  # this rank's own copy: a DTensor's local piece, a plain tensor itself
                    (parameter.to_local() if hasattr(parameter, "to_local") else parameter).add_(1.0)
            try:
                outcomes[tp, corrupted] = solution.copies_in_sync(model, mesh, tp)
            except RuntimeError as error:
                outcomes[tp, corrupted] = str(error)
    return {f"{tp} {corrupted}": outcome for (tp, corrupted), outcome in outcomes.items()}


def every_check(env):
    """Everything the tests assert on, from one process group."""
    return {
        "mlp": forward_backward(TensorParallelMLP.from_full(full_mlp(), env.rank, env.world_size), counted=True),
        "attention": forward_backward(
            TensorParallelSelfAttention.from_full(full_attention(), env.rank, env.world_size), counted=True
        ),
        "trained": train(TensorParallelMLP.from_full(full_mlp(), env.rank, env.world_size)),
        "torch": torch_checks(env),
        "two_d": two_d_checks(env) if env.world_size == 4 else None,
        "corrupted_copies": corrupted_copies(env),
    }


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"world{n}")
def results(request):
    return request.param, run_on_ranks(every_check, request.param, timeout=90)


def mlp_slices(full: dict, rank: int, world_size: int) -> dict:
    """Rank ``rank``'s slices of a full FeedForward's parameters (or their gradients), by name."""
    hidden = shard_range(full["up.weight"].shape[0], rank, world_size)
    return {
        "up.weight": full["up.weight"][hidden],
        "up.bias": full["up.bias"][hidden],
        "down.weight": full["down.weight"][:, hidden],
        "down.bias": full["down.bias"],  # whole on every rank
    }


def attention_slices(full: dict, rank: int, world_size: int) -> dict:
    heads = shard_range(D_MODEL, rank, world_size)
    return {
        "qkv.weight": torch.cat([full[f"{p}.weight"][heads] for p in "qkv"]),
        "qkv.bias": torch.cat([full[f"{p}.bias"][heads] for p in "qkv"]),
        "out.weight": full["out.weight"][:, heads],
        "out.bias": full["out.bias"],
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "block, make_full, slices", [("mlp", full_mlp, mlp_slices), ("attention", full_attention, attention_slices)]
)
def test_sharded_block_equals_the_full_one_outputs_and_every_gradient(results, block, make_full, slices):
    world_size, ranks = results
    reference = forward_backward(make_full(), counted=False)
    for rank, result in enumerate(ranks):
        got = result[block]
        torch.testing.assert_close(got["output"], reference["output"])
        torch.testing.assert_close(got["input_grad"], reference["input_grad"])  # f's all-reduce made it whole
        expected = slices(reference["grads"], rank, world_size)
        assert sorted(got["grads"]) == sorted(expected)
        for name, grad in got["grads"].items():
            torch.testing.assert_close(grad, expected[name], msg=f"{block} rank {rank} {name}")


@pytest.mark.timeout(120)
def test_three_sgd_steps_equal_one_process_training_the_whole_mlp(results):
    world_size, ranks = results
    initial = dict(full_mlp().named_parameters())
    expected_full = train(full_mlp())
    for rank, result in enumerate(ranks):
        expected = mlp_slices(expected_full, rank, world_size)
        for name, parameter in result["trained"].items():
            torch.testing.assert_close(parameter, expected[name], msg=f"rank {rank} {name}")
            # They did move: the test would notice an optimizer that never stepped.
            assert not torch.allclose(parameter, mlp_slices(initial, rank, world_size)[name])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("block", ["mlp", "attention"])
def test_one_all_reduce_forward_and_one_backward_of_the_formulas_bytes(results, block):
    _, ranks = results
    expected_bytes = mlp_all_reduce_bytes(BATCH, SEQ, D_MODEL, torch.finfo(DTYPE).bits // 8)
    assert expected_bytes == 2 * 3 * 8 * 8  # batch x seq x d_model x 8 bytes of float64: 384
    for result in ranks:
        collectives = result[block]["collectives"]
        assert collectives["forward"] == [["all_reduce", expected_bytes]]  # g
        assert collectives["backward"] == [["all_reduce", expected_bytes]]  # f's conjugate


@pytest.mark.timeout(120)
def test_torchs_parallelize_module_on_gloo_equals_the_by_hand_version(results):
    world_size, ranks = results
    for rank, result in enumerate(ranks):
        theirs, ours = result["torch"], result["mlp"]
        torch.testing.assert_close(theirs["output"], ours["output"])
        torch.testing.assert_close(theirs["input_grad"], ours["input_grad"])
        hidden = 4 * D_MODEL // world_size
        assert theirs["local_weight_shapes"] == {
            "up.weight": [hidden, D_MODEL],
            "up.bias": [hidden],
            "down.weight": [D_MODEL, hidden],
            "down.bias": [D_MODEL],  # RowwiseParallel keeps the bias whole (replicated)
        }
        # full_tensor() gathers the whole gradient: this rank's slice of it is the by-hand shard's gradient.
        for name, grad in mlp_slices(theirs["grads"], rank, world_size).items():
            torch.testing.assert_close(grad, ours["grads"][name], msg=f"rank {rank} {name}")


@pytest.mark.timeout(120)
def test_comm_debug_mode_counts_one_all_reduce_forward_and_one_backward_of_the_formulas_bytes(results):
    _, ranks = results
    expected_bytes = mlp_all_reduce_bytes(BATCH, SEQ, D_MODEL, torch.finfo(DTYPE).bits // 8)
    for result in ranks:
        theirs = result["torch"]
        # CommDebugMode reports the functional all-reduce under its older name, c10d_functional.
        assert theirs["forward_counts"] == {"c10d_functional.all_reduce": 1}  # RowwiseParallel's output, as g
        assert theirs["backward_counts"] == {"c10d_functional.all_reduce": 1}  # ColwiseParallel's input grad, as f
        assert theirs["forward_bytes"] == theirs["backward_bytes"] == [expected_bytes]
        # DTensor's collectives are functional ops, not dist.all_reduce: count_collectives sees none of them.
        assert theirs["dist_calls_seen"] == 0


def test_features_that_do_not_divide_by_the_world_size_are_a_value_error():
    with pytest.raises(ValueError, match="out_features=30 do not divide by the world size 4"):
        ColumnParallelLinear.from_full(nn.Linear(8, 30), rank=0, world_size=4)
    with pytest.raises(ValueError, match="in_features=6 do not divide by the world size 4"):
        RowParallelLinear.from_full(nn.Linear(6, 8), rank=1, world_size=4)
    with pytest.raises(ValueError, match="num_heads=2 do not divide by the world size 4"):
        TensorParallelSelfAttention.from_full(SelfAttention(8, num_heads=2), rank=0, world_size=4)
    # Dividing ones shard without complaint, into equal parts that cover the features once.
    parts = [shard_range(32, rank, 4) for rank in range(4)]
    assert [(part.start, part.stop) for part in parts] == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert ColumnParallelLinear.from_full(nn.Linear(8, 32), 3, 4).weight.shape == (8, 8)


def test_the_row_parallel_bias_is_added_once_not_on_every_rank():
    """Without a process group, by arithmetic: the partial products of the row shards sum to the whole product, and
    the bias must be added to the sum once (the rank's ``forward`` does exactly that after its all-reduce)."""
    torch.manual_seed(3)
    linear = nn.Linear(8, 4).to(DTYPE)
    X = torch.randn(5, 8, dtype=DTYPE)
    shards = [RowParallelLinear.from_full(linear, rank, 2) for rank in range(2)]
    partials = [F.linear(X[:, shard_range(8, rank, 2)], shard.weight) for rank, shard in enumerate(shards)]
    torch.testing.assert_close(sum(partials) + shards[0].bias, linear(X))
    assert not torch.allclose(sum(partial + shard.bias for partial, shard in zip(partials, shards)), linear(X))


def block_slices(full: dict, rank: int, world_size: int) -> dict:
    """Rank ``rank``'s slices of a full ``TransformerBlock``'s parameters, under the sharded block's names; the
    norms whole."""

    def part(prefix):
        return {name.removeprefix(prefix): value for name, value in full.items() if name.startswith(prefix)}

    attention = attention_slices(part("attention."), rank, world_size)
    mlp = mlp_slices(part("mlp."), rank, world_size)
    norms = {name: value for name, value in full.items() if "norm" in name}
    return norms | {f"attention.{n}": v for n, v in attention.items()} | {f"mlp.{n}": v for n, v in mlp.items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("results", [4], indirect=True, ids=["world4"])  # the 2-D checks ran in the world of 4
def test_a_2x2_mesh_of_data_and_tensor_parallelism_after_three_steps_equals_one_process_by_hand_and_by_torch(results):
    _, ranks = results
    initial = dict(full_block().named_parameters())
    expected = train(full_block(), data=global_batch())  # one process, the whole batch of both replicas
    for rank, result in enumerate(ranks):
        two_d = result["two_d"]
        mine, before = block_slices(expected, two_d["shard"], TP_SIZE), block_slices(initial, two_d["shard"], TP_SIZE)
        assert sorted(two_d["by_hand"]) == sorted(mine)
        for name, parameter in two_d["by_hand"].items():
            torch.testing.assert_close(parameter, mine[name], msg=f"by hand, rank {rank} {name}")
            assert not torch.allclose(parameter, before[name])  # it did train
        assert sorted(two_d["torch"]) == sorted(expected)
        for name, parameter in two_d["torch"].items():  # full_tensor(): whole, gathered over both mesh dimensions
            torch.testing.assert_close(parameter, expected[name], msg=f"torch, rank {rank} {name}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("results", [4], indirect=True, ids=["world4"])
def test_on_the_2x2_mesh_tp_all_reduces_stay_in_a_replica_and_ddp_all_reduces_the_shards_across_replicas(results):
    _, ranks = results
    activation_bytes = mlp_all_reduce_bytes(BATCH, SEQ, D_MODEL, torch.finfo(DTYPE).bits // 8)
    for rank, result in enumerate(ranks):
        two_d = result["two_d"]
        # Rank r is shard r % 2 of replica r // 2: TP groups {0, 1} and {2, 3}; DP groups {0, 2} and {1, 3}.
        assert two_d["tp_ranks"] == [rank - rank % 2, rank - rank % 2 + 1] and two_d["shard"] == rank % 2
        assert two_d["dp_ranks"] == [rank % 2, rank % 2 + 2]
        # In its TP group, of a replica's activations: one all-reduce forward per block (g) and one backward (f).
        # Then DDP's one bucket: this rank's parameter shards and its whole norms, over its DP group, once the
        # attention norm's gradients, the last, are ready. (count_collectives sees DDP's all-reduce because
        # AllReduceCounter's hook makes it from Python.)
        tp = ["all_reduce", activation_bytes, two_d["tp_ranks"]]
        assert two_d["calls"] == [tp] * 4 + [["all_reduce", two_d["parameter_bytes"], two_d["dp_ranks"]]]
        assert two_d["dp_all_reduces"] == {"calls": 1, "bytes": two_d["parameter_bytes"]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("results", [4], indirect=True, ids=["world4"])
def test_solution_13_on_a_2x2_mesh_keeps_the_shards_in_sync_and_its_two_versions_agree(results):
    _, ranks = results
    for result in ranks:
        runs = result["two_d"]["script_runs"]
        # By hand each shard is on both replicas; FSDP2 (torch) keeps one copy of each piece: nothing to compare.
        assert runs["by-hand"]["replicas in sync"] is True and runs["by-hand"]["shards in sync"] is True
        assert runs["torch"]["replicas in sync"] is True and runs["torch"]["shards in sync"] is None
        # Per rank and step, two blocks: one all-reduce forward (g) and one backward (f) each, of the
        # (batch, rows, d_model) activation; by hand and by torch (CommDebugMode counts calls only).
        assert runs["by-hand"]["forward all-reduces"] == runs["by-hand"]["backward all-reduces"]
        assert runs["by-hand"]["forward all-reduces"] == [runs["by-hand"]["formula bytes"]] * 2
        assert (runs["torch"]["forward all-reduces"], runs["torch"]["backward all-reduces"]) == (2, 2)
        # By hand (DDP over the replicas) and torch's (FSDP2 over them) train the same model on the same batches.
        assert runs["by-hand"]["train loss"] == pytest.approx(runs["torch"]["train loss"], rel=1e-5)
        assert runs["by-hand"]["test accuracy"] == runs["torch"]["test accuracy"]
    # The two ranks of replica 0 computed the same.
    assert ranks[0]["two_d"]["script_runs"] == ranks[1]["two_d"]["script_runs"]


@pytest.mark.timeout(120)
def test_solution_13s_sync_checks_compare_only_what_could_differ_and_fail_when_one_rank_differs(results):
    """One replica (world 2): no rank shares a shard with another, and the check says so (None) instead of comparing
    a rank with itself. Two replicas (world 4): by hand the shards are compared across the replicas; FSDP2's
    replicated pieces across the tensor-parallel ranks that hold them, before any gather. Whatever one rank changes
    in a piece that another rank also holds, every rank raises."""
    world_size, ranks = results
    replicas = world_size // TP_SIZE
    for result in ranks:
        outcomes = result["corrupted_copies"]
        assert outcomes["by-hand None"] == {"replicated": True, "shards": True if replicas > 1 else None}
        assert outcomes["torch None"] == {"replicated": True, "shards": None}
        for tp in ("by-hand", "torch"):
            assert outcomes[f"{tp} embed.weight"] == "copies differ across the ranks that hold them: replicated", tp
        if replicas > 1:
            assert outcomes["by-hand layer.mlp.up.weight"] == "copies differ across the ranks that hold them: shards"
        else:  # rank 1's shard is the only copy of it: there is nothing it could differ from
            assert outcomes["by-hand layer.mlp.up.weight"] == {"replicated": True, "shards": None}


def test_a_row_split_first_linear_would_need_the_sum_before_the_gelu():
    """Without a process group, by arithmetic: cut the MLP's first linear by rows of A (input features) and each
    rank holds a partial pre-activation; the GELU of their sum is not the sum of their GELUs, so an all-reduce would
    have to come before the GELU. Cut by columns of A (output features), the GELU runs on each slice alone."""
    torch.manual_seed(6)
    up = nn.Linear(8, 32).to(DTYPE)
    X = torch.randn(5, 8, dtype=DTYPE)
    whole = F.gelu(up(X))
    halves = [shard_range(8, rank, 2) for rank in range(2)]
    partials = [F.linear(X[:, half], up.weight[:, half]) for half in halves]  # each rank's share of X A
    torch.testing.assert_close(F.gelu(sum(partials) + up.bias), whole)  # summed first, then GELU: right
    assert not torch.allclose(F.gelu(partials[0] + up.bias) + F.gelu(partials[1]), whole)  # GELU per rank: wrong
    columns = [shard_range(32, rank, 2) for rank in range(2)]
    slices = [F.gelu(F.linear(X, up.weight[cols], up.bias[cols])) for cols in columns]
    torch.testing.assert_close(torch.cat(slices, dim=-1), whole)  # by columns: no sum needed before the GELU


@pytest.mark.timeout(120)
def test_torchs_whole_layer_equals_the_by_hand_one_with_two_all_reduces_forward_and_two_backward(results):
    """parallelize_block, whose PrepareModuleInput gives q, k and v one replicated input: its gradient is reduced
    once, as by hand behind one f. The same plan without it reduces it three times: 4 all-reduces backward."""
    _, ranks = results
    for result in ranks:
        block = result["torch"]["block"]
        for version in ("torch", "torch without one input"):
            torch.testing.assert_close(block[version]["output"], block["by hand"]["output"])
            torch.testing.assert_close(block[version]["input_grad"], block["by hand"]["input_grad"])
        # CommDebugMode also sees dist.all_reduce (the c10d op) of the by-hand layer: the same 2 and 2.
        assert block["by hand"]["counts"] == [{"c10d.allreduce_": 2}] * 2
        assert block["torch"]["counts"] == [{"c10d_functional.all_reduce": 2}] * 2  # forward, backward
        assert block["torch without one input"]["counts"] == [
            {"c10d_functional.all_reduce": 2},
            {"c10d_functional.all_reduce": 4},
        ]
