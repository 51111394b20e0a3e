"""Lab 13: tensor parallelism by hand: Megatron's f and g, and the column and row split of a linear.

Runs against solutions/13_tensor_parallel.py; with LAB_TARGET=labs, against your labs/13_tensor_parallel.py:

    LAB_TARGET=labs .venv/bin/python -m pytest tests/labs/test_13_tensor_parallel.py

First a check in this one process, without a process group: the shards that your ``from_full`` cuts for 2 ranks
put back together give the full linear's output. Then one spawn of 2 ranks: your MLP and attention block against
the full ones (outputs, the input's gradient, every parameter's gradient, and the all-reduces), and the script's
own training for one short epoch. The modules, the batch and the reference are tests/test_tensor_parallel.py's.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from common.launch import run_on_ranks
from tests.labs import load_lab
from tests.test_tensor_parallel import (
    BATCH,
    D_MODEL,
    DTYPE,
    SEQ,
    attention_slices,
    forward_backward,
    full_attention,
    full_mlp,
    mlp_slices,
)

LAB = "13_tensor_parallel"
# What these tests call in the script: the classes of common.tensor_parallel that the lab defines, with the same
# signatures; parse_args(argv) and train(args, env), the script's own training run.
NEEDS = ("ColumnParallelLinear", "RowParallelLinear", "TensorParallelMLP", "TensorParallelSelfAttention")
NEEDS += ("parse_args", "train")
WORLD_SIZE = 2


def test_the_column_and_row_shards_of_two_ranks_put_back_together_give_the_full_linear():
    """No process group: the shards' local products only (F.linear on their weights), summed or concatenated here."""
    lab = load_lab(LAB, NEEDS)
    torch.manual_seed(0)
    linear = nn.Linear(6, 4).to(DTYPE)
    X = torch.randn(5, 6, dtype=DTYPE)
    columns = [lab.ColumnParallelLinear.from_full(linear, rank, WORLD_SIZE) for rank in range(WORLD_SIZE)]
    assert [tuple(shard.weight.shape) for shard in columns] == [(2, 6)] * WORLD_SIZE
    # Each rank's slice of the output features, side by side in rank order, is the whole output.
    torch.testing.assert_close(torch.cat([F.linear(X, shard.weight, shard.bias) for shard in columns], -1), linear(X))
    rows = [lab.RowParallelLinear.from_full(linear, rank, WORLD_SIZE) for rank in range(WORLD_SIZE)]
    assert [tuple(shard.weight.shape) for shard in rows] == [(4, 3)] * WORLD_SIZE
    # Each rank multiplies its slice of the input features; the partial products sum to the whole, plus one bias.
    partials = [F.linear(X[:, 3 * rank : 3 * (rank + 1)], shard.weight) for rank, shard in enumerate(rows)]
    torch.testing.assert_close(sum(partials) + rows[0].bias, linear(X))
    torch.testing.assert_close(rows[1].bias, linear.bias)


def lab_checks(env):
    lab = load_lab(LAB, NEEDS)
    out = {
        "mlp": forward_backward(lab.TensorParallelMLP.from_full(full_mlp(), env.rank, env.world_size), counted=True),
        "attention": forward_backward(
            lab.TensorParallelSelfAttention.from_full(full_attention(), env.rank, env.world_size), counted=True
        ),
    }
    args = lab.parse_args(
        ["--dataset", "digits", "--epochs", "1", "--max-batches-per-epoch", "3", "--num-workers", "0"]
    )
    out["history"] = lab.train(args, env)
    return out


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(lab_checks, WORLD_SIZE, timeout=120)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "block, make_full, slices", [("mlp", full_mlp, mlp_slices), ("attention", full_attention, attention_slices)]
)
def test_your_blocks_equal_the_full_ones_with_one_all_reduce_forward_and_one_backward(
    results, block, make_full, slices
):
    reference = forward_backward(make_full(), counted=False)
    activation_bytes = BATCH * SEQ * D_MODEL * torch.finfo(DTYPE).bits // 8
    for rank, result in enumerate(results):
        got = result[block]
        torch.testing.assert_close(got["output"], reference["output"], msg=f"{block} rank {rank}: g's sum")
        torch.testing.assert_close(got["input_grad"], reference["input_grad"], msg=f"{block} rank {rank}: f's sum")
        expected = slices(reference["grads"], rank, WORLD_SIZE)
        assert sorted(got["grads"]) == sorted(expected)
        for name, grad in got["grads"].items():
            torch.testing.assert_close(grad, expected[name], msg=f"{block} rank {rank} {name}")
        assert got["collectives"]["forward"] == [["all_reduce", activation_bytes]]  # g
        assert got["collectives"]["backward"] == [["all_reduce", activation_bytes]]  # f's conjugate


@pytest.mark.timeout(180)
def test_the_script_trains_with_them_and_keeps_the_replicated_parameters_in_sync(results):
    for result in results:
        (epoch,) = result["history"]
        assert epoch["replicas in sync"] is True
        # Two blocks: one all-reduce of the (batch, rows, d_model) activation each, forward and backward.
        assert epoch["forward all-reduces"] == epoch["backward all-reduces"] == [epoch["formula bytes"]] * 2
        assert 0 < epoch["train loss"] < 10 and 0 <= epoch["test accuracy"] <= 1
    assert results[0]["history"] == results[1]["history"]  # every rank computes the same outputs
