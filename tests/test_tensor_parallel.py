"""Tensor parallelism by hand (common.tensor_parallel) against the unsharded modules, and against torch's DTensor.

One process group per world size (2 and 4) does everything (``every_check``, one spawn each); the tests below only
assert, computing the single-process reference here, in the test process, from the same seeds. In float64, so
that the different order of the sums leaves the results equal to rounding:

- the MLP and the attention block, sharded from the full modules' weights: outputs, the input's gradient and every
  parameter's gradient equal the full module's (each rank's slice of them);
- 3 SGD steps of the tensor-parallel MLP equal 3 steps of one process training the whole MLP;
- ``count_collectives``: one all-reduce forward and one backward per block, of ``mlp_all_reduce_bytes``;
- torch's ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` on gloo, from the same weights:
  the same outputs and gradients, and what ``CommDebugMode`` counts forward and backward.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

from common.collectives import count_collectives
from common.launch import run_on_ranks
from common.tensor_parallel import (
    ColumnParallelLinear,
    FeedForward,
    RowParallelLinear,
    SelfAttention,
    TensorParallelMLP,
    TensorParallelSelfAttention,
    mlp_all_reduce_bytes,
    parallelize_feed_forward,
    shard_range,
)

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


def train(module, steps=STEPS):
    """``steps`` SGD steps on the batch; the parameters at the end."""
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    X, target = batch()
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
    }


def every_check(env):
    """Everything the tests assert on, from one process group."""
    return {
        "mlp": forward_backward(TensorParallelMLP.from_full(full_mlp(), env.rank, env.world_size), counted=True),
        "attention": forward_backward(
            TensorParallelSelfAttention.from_full(full_attention(), env.rank, env.world_size), counted=True
        ),
        "trained": train(TensorParallelMLP.from_full(full_mlp(), env.rank, env.world_size)),
        "torch": torch_checks(env),
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
