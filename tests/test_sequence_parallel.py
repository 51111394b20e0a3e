"""Sequence parallelism (common.sequence_parallel) against the whole GPT, and against tensor parallelism alone.

One process group per world size (2 and 4) runs every check (``in_turn``: one spawn each); the tests only assert.
In float64 without dropout, so that the versions compute the same numbers to rounding:

- by hand, tensor parallelism alone, and tensor with sequence parallelism (plain, and keeping only the shards of
  the linears' inputs: ``regather``), without recomputation, recomputed by hand and selectively: the loss and every
  gradient equal the whole GPT's (each rank's slice of a split parameter's);
- the collectives: one all-gather and one reduce-scatter per block and pass, each of the activation's bytes,
  where tensor parallelism makes one all-reduce; a ring moves the same bytes per rank either way;
- what each rank saves for backward: 1/t of the whole GPT's with ``regather``;
- torch's ``parallelize_gpt`` with ``loss_parallel``: two AdamW steps end where the whole GPT's do, with the
  all-gathers and reduce-scatters that ``CommDebugMode`` counts; the norms' gradients stay ``Partial`` after
  backward, and AdamW's step all-reduces them, three times each.
"""

import pytest
import torch
import torch.nn.functional as F

from common.experiments.activations import (
    build_gpt,
    sequence_parallel_checks,
    token_batch,
    torch_sequence_parallel,
)
from common.launch import in_turn, run_on_ranks
from common.sequence_parallel import sequence_range

CONFIG = dict(context=16, d_model=16, num_heads=4, num_layers=2, dropout=0.0)
BATCH = 2
ACTIVATION_BYTES = BATCH * CONFIG["context"] * CONFIG["d_model"] * 8  # one (batch, seq, h) float64 tensor
VERSIONS = ("tensor parallel", "sequence parallel", "sequence parallel, regather")


# The world of 4 takes 10 s on 2 cores: `make test-slow` runs it, `make test` the world of 2.
@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=lambda n: f"world{n}")
def results(request):
    calls = [
        (sequence_parallel_checks, (CONFIG, BATCH)),
        (sequence_parallel_checks, (CONFIG, BATCH, "by-hand")),
        (sequence_parallel_checks, (CONFIG, BATCH, "selective")),
        (torch_sequence_parallel, (CONFIG, BATCH)),
    ]
    world_size = request.param
    return world_size, run_on_ranks(in_turn, world_size, calls, timeout=150)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("recompute", [0, 1, 2], ids=["", "recomputed-by-hand", "recomputed-selective"])
def test_sequence_parallelism_by_hand_equals_the_whole_gpt_loss_and_every_gradient(results, recompute):
    _, per_rank = results
    for rank, checks_of_each in enumerate(per_rank):
        checks = checks_of_each[recompute]
        for version in VERSIONS:
            assert checks[version]["loss difference"] < 1e-12, (rank, version)
            assert checks[version]["gradient difference"] < 1e-12, (rank, version)


def ring_bytes(calls: list[tuple[str, int]], world_size: int) -> float:
    """What each rank sends over a ring for ``calls``: an all-reduce 2 (t-1)/t of its bytes, an all-gather or a
    reduce-scatter (t-1)/t of the whole tensor's (lesson 01)."""
    share = {"all_reduce": 2 * (world_size - 1) / world_size}
    return sum(nbytes * share.get(name, (world_size - 1) / world_size) for name, nbytes in calls)


@pytest.mark.timeout(200)
def test_each_block_all_gathers_and_reduce_scatters_where_tensor_parallelism_all_reduces_the_same_ring_bytes(results):
    world_size, per_rank = results
    blocks = 2 * CONFIG["num_layers"]  # the attention and the MLP of each layer
    for checks, *_ in per_rank:
        tensor, sequence, regather = (checks[version] for version in VERSIONS)
        assert tensor["forward"] == tensor["backward"] == [("all_reduce", ACTIVATION_BYTES)] * blocks
        pair = [("all_gather_single", ACTIVATION_BYTES), ("reduce_scatter_single", ACTIVATION_BYTES)]
        assert sequence["forward"] == regather["forward"] == pair * blocks
        # Backward: the conjugates in reverse order, then one all-reduce of the replicated parameters' gradients.
        replicated = sequence["backward"][-1]
        assert replicated[0] == "all_reduce" and replicated == regather["backward"][-1]
        assert sequence["backward"][:-1] == pair * blocks
        assert ring_bytes(sequence["forward"] + sequence["backward"][:-1], world_size) == ring_bytes(
            tensor["forward"] + tensor["backward"], world_size
        )
        # regather: one more all-gather per block in backward, to gather the linear's input again.
        again = [("all_gather_single", ACTIVATION_BYTES)] * 2 + [("reduce_scatter_single", ACTIVATION_BYTES)]
        assert regather["backward"][:-1] == again * blocks


@pytest.mark.timeout(200)
def test_with_regather_each_rank_saves_1_over_t_of_the_whole_gpts_activations(results):
    world_size, per_rank = results
    for checks, *_ in per_rank:
        whole, tensor = checks["one process"]["saved"], checks["tensor parallel"]["saved"]
        sequence, regather = checks["sequence parallel"]["saved"], checks["sequence parallel, regather"]["saved"]
        # All but a few scalars of the loss (its total weight), which every rank keeps once.
        assert abs(regather * world_size - whole) <= 8 * world_size
        # Without regather, each block's linear keeps the gathered input: a whole tensor instead of this rank's part.
        assert sequence - regather == 2 * CONFIG["num_layers"] * ACTIVATION_BYTES * (world_size - 1) // world_size
        assert regather < sequence < tensor < whole


@pytest.mark.timeout(200)
def test_torchs_sequence_parallel_with_loss_parallel_equals_the_whole_gpt_after_two_adamw_steps(results):
    _, per_rank = results
    layers = CONFIG["num_layers"]
    for *_, torch_checks in per_rank:
        assert torch_checks["parameter difference"] < 1e-10
        # Per block and pass one all-gather and one reduce-scatter; the two embeddings' reduce-scatters forward and
        # the head's all-gather (and their conjugates backward); loss_parallel's three all-reduces of the logits'
        # statistics, never the logits themselves.
        assert torch_checks["passes"] == {
            "all_gather_into_tensor": 4 * layers + 3,
            "reduce_scatter_tensor": 4 * layers + 3,
            "all_reduce": 3,
        }
        # The norms' gradients stay partial sums after backward: AdamW's step sums them, at each use.
        assert torch_checks["norm gradients"] == ["(Partial(sum),)"]
        norm_parameters = 2 * (2 * layers + 1)  # weight and bias of two norms per layer, and of the final norm
        assert torch_checks["optimizer step"] == {"all_reduce": 3 * norm_parameters}


def test_a_sequence_that_does_not_divide_by_the_ranks_is_a_value_error_that_says_so():
    assert sequence_range(16, 3, 4) == slice(12, 16)
    with pytest.raises(ValueError, match="a sequence of 30 tokens does not divide by the 4 sequence-parallel ranks"):
        sequence_range(30, 0, 4)


def test_the_whole_gpt_reference_is_causal_a_later_token_changes_no_earlier_logit():
    model = build_gpt(CONFIG).double().eval()
    tokens, _ = token_batch(CONFIG, BATCH)
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 256
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :-1], after[:, :-1])
    assert not torch.allclose(before[:, -1], after[:, -1])
    assert F.softmax(before, dim=-1).sum(-1).allclose(torch.ones(BATCH, CONFIG["context"], dtype=torch.float64))
