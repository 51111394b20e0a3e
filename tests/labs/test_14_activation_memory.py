"""Lab 14: recomputation by hand, and the sequence-parallel pair of collectives.

Runs against solutions/14_activation_memory.py; with LAB_TARGET=labs, against your labs/14_activation_memory.py:

    LAB_TARGET=labs .venv/bin/python -m pytest tests/labs/test_14_activation_memory.py

First, in this one process: your ``Recompute`` (through the script's ``RecomputedBlock``) gives the loss and
every gradient of no recomputation, bit for bit, with dropout on, and keeps only each block's input. Then one
spawn of 2 ranks: your ``SequenceParallelGPT`` (built on your all-gather and reduce-scatter functions) against the
whole GPT, its collectives, and the script's own training for one short epoch.
"""

import pytest
import torch

from common.activations import saved_tensors
from common.collectives import count_collectives
from common.distributed import ConfigurationError, DistEnv
from common.experiments.activations import build_gpt, token_batch
from common.gpt import next_token_loss
from common.launch import run_on_ranks
from tests.labs import load_lab

LAB = "14_activation_memory"
# What these tests call in the script: the functions and classes of common.recompute and common.sequence_parallel
# that the lab defines, with the same signatures; parse_args(argv) and train(args, env), the script's own run.
NEEDS = ("Recompute", "RecomputedBlock", "GatherFromSequenceParallel", "ReduceScatterToSequenceParallel")
NEEDS += ("SequenceParallelGPT", "parse_args", "train")
CONFIG = dict(context=16, d_model=16, num_heads=4, num_layers=2, dropout=0.1)
BATCH, WORLD_SIZE = 2, 2


def one_step(model, seed: int = 3):
    tokens, targets = token_batch(CONFIG, BATCH)
    torch.manual_seed(seed)  # the dropout masks
    with saved_tensors(model.parameters()) as saved:
        loss = next_token_loss(model(tokens), targets)
    loss.backward()
    return [loss.detach(), *(p.grad for p in model.parameters())], saved.bytes


def test_your_recompute_gives_the_same_gradients_bit_for_bit_and_keeps_only_each_blocks_input():
    lab = load_lab(LAB, NEEDS)
    reference, saved_without = one_step(build_gpt(CONFIG))
    model = build_gpt(CONFIG)
    for index, block in enumerate(model.blocks):
        model.blocks[index] = lab.RecomputedBlock(block, "by-hand")
    recomputed, saved_with = one_step(model)
    names = ["loss", *(name for name, _ in build_gpt(CONFIG).named_parameters())]
    for name, got, expected in zip(names, recomputed, reference):
        assert torch.equal(got, expected), f"{name}: the recomputed forward must draw the same dropout masks"
    one_input = BATCH * CONFIG["context"] * CONFIG["d_model"] * 4
    whole_layer = (saved_without - saved_with) // CONFIG["num_layers"] + one_input
    assert whole_layer > 10 * one_input  # without recomputation a layer keeps many tensors; with it, its input only


def lab_checks(env):
    lab = load_lab(LAB, NEEDS)
    config = CONFIG | {"dropout": 0.0}
    tokens, targets = token_batch(config, BATCH)
    whole = build_gpt(config).double()
    next_token_loss(whole(tokens), targets).backward()
    split = lab.SequenceParallelGPT(build_gpt(config).double(), env.rank, env.world_size)
    with count_collectives() as forward:
        share = split.loss(tokens, targets)
    with count_collectives() as backward:
        share.backward()
    split.finish_gradients()
    total = share.detach().clone()
    torch.distributed.all_reduce(total)
    wholes = dict(whole.named_parameters())
    replicated = {
        name: (parameter.grad - wholes[name.removeprefix("gpt.")].grad).abs().max().item()
        for name, parameter in split.named_parameters()
        if name.removeprefix("gpt.") in wholes and parameter.shape == wholes[name.removeprefix("gpt.")].shape
    }
    out = {
        "loss difference": (total - next_token_loss(whole(tokens), targets)).abs().item(),
        "replicated gradients": replicated,
        "forward": [call.name for call in forward.calls],
        "backward": [call.name for call in backward.calls],
    }
    args = lab.parse_args(
        ["--parallel", "sequence", "--recompute", "by-hand", "--context", "32", "--d-model", "32", "--layers", "2"]
        + ["--epochs", "1", "--max-batches-per-epoch", "3", "--val-batches", "2", "--sample-length", "8"]
    )
    out["history"] = lab.train(args, env)
    return out


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(lab_checks, WORLD_SIZE, timeout=150)


@pytest.mark.timeout(200)
def test_your_sequence_parallel_gpt_equals_the_whole_one_with_one_all_gather_and_one_reduce_scatter_per_block(results):
    blocks = 2 * CONFIG["num_layers"]
    for rank, result in enumerate(results):
        assert result["loss difference"] < 1e-12, f"rank {rank}: the shares of the loss must add up to the mean"
        # The embeddings, the norms, the row-parallel biases and the head: the whole model's gradients everywhere.
        assert len(result["replicated gradients"]) >= 4 * CONFIG["num_layers"] + 4
        assert max(result["replicated gradients"].values()) < 1e-12, result["replicated gradients"]
        assert result["forward"] == ["all_gather_single", "reduce_scatter_single"] * blocks
        assert result["backward"] == ["all_gather_single", "reduce_scatter_single"] * blocks  # the conjugates


@pytest.mark.timeout(200)
def test_the_script_trains_with_them_and_keeps_the_replicated_parameters_in_sync(results):
    for result in results:
        (epoch,) = result["history"]
        assert epoch["in sync"] is True
        assert 0 < epoch["validation loss"] < 6 and 0 < epoch["train loss"] < 6  # ln 256 = 5.55 at the start
    assert results[0]["history"] == results[1]["history"]  # every rank reports the same figures


def test_the_script_refuses_a_context_that_does_not_divide_by_the_ranks_before_reading_any_text():
    lab = load_lab(LAB, NEEDS)
    args = lab.parse_args(["--parallel", "sequence", "--context", "30", "--text", "no/such/file.txt"])
    env = DistEnv(rank=0, local_rank=0, world_size=4, backend="gloo", device=torch.device("cpu"))
    with pytest.raises(ConfigurationError, match="--context 30 does not divide by the 4 ranks"):
        lab.train(args, env)
