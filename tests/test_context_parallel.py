"""Context parallelism (common.context_parallel): blockwise, ring and all-gather attention against
``F.scaled_dot_product_attention``, the zig-zag layout, the ring's messages, and the GPT trained both ways.

In one process: blockwise attention equals SDPA, forward and the gradients of q, k and v, causal and not, for
block sizes that divide the sequence and one that does not; zig-zag sharding and unsharding are inverse; a length
that does not divide fails at once; the causal work per rank is the arithmetic's. One process group per world size
(2, and 4 in the slow run) runs every distributed check (``in_turn``: one spawn each); the tests only assert.
"""

import pytest
import torch
import torch.nn.functional as F

from common.context_parallel import (
    LAYOUTS,
    blockwise_attention,
    shard_pieces,
    shard_sequence,
    unshard_sequence,
)
from common.experiments.context_parallel import (
    attention_checks,
    random_qkv,
    training_losses,
    ulysses_checks,
    work_per_rank,
)
from common.launch import in_turn, run_on_ranks

CONFIG = dict(context=16, d_model=16, num_heads=2, num_layers=2)
SHAPE = dict(batch=2, heads=2, seq=16, head_dim=8)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_blockwise_attention_equals_sdpa_forward_and_every_gradient(block_size, causal):
    q, k, v, grad = random_qkv(**SHAPE)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    blocks = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*whole, is_causal=causal)
    got = blockwise_attention(*blocks, block_size, causal)
    torch.testing.assert_close(got, expected)
    for a, b in zip(torch.autograd.grad(got, blocks, grad), torch.autograd.grad(expected, whole, grad)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_sharding_then_unsharding_gives_back_the_sequence_and_every_position_once(layout, world_size):
    x = torch.randn(2, 24, 3)
    shards = [shard_sequence(x, rank, world_size, layout) for rank in range(world_size)]
    assert torch.equal(unshard_sequence(shards, layout), x)
    positions = sorted(p for rank in range(world_size) for piece in shard_pieces(24, rank, world_size, layout)
                       for p in piece)  # fmt: skip
    assert positions == list(range(24))


def test_zigzag_gives_rank_r_chunk_r_and_its_mirror():
    assert shard_pieces(16, 0, 2, "zigzag") == [range(0, 4), range(12, 16)]
    assert shard_pieces(16, 1, 2, "zigzag") == [range(4, 8), range(8, 12)]


def test_a_length_that_does_not_divide_by_twice_the_ranks_fails_at_once():
    with pytest.raises(ValueError, match="does not divide into 8 equal chunks"):
        shard_pieces(20, 0, 4, "zigzag")
    with pytest.raises(ValueError, match="does not divide into 3"):
        shard_pieces(16, 0, 3, "contiguous")


def test_causal_work_is_lopsided_in_contiguous_slices_and_equal_in_zigzag():
    seq, world_size = 64, 4
    block = (seq // world_size) ** 2
    assert work_per_rank(seq, world_size, "contiguous") == [block * (r + 1) for r in range(world_size)]
    zigzag = work_per_rank(seq, world_size, "zigzag")
    assert len(set(zigzag)) == 1
    # chunks of c = s/2N: its own step computes 3 c x c pairs of chunks (two straddle the diagonal), every other
    # step 2 (half of the block that arrives): (2N + 1) c^2, about half of contiguous's busiest rank
    assert zigzag[0] == (2 * world_size + 1) * (seq // (2 * world_size)) ** 2
    assert work_per_rank(seq, world_size, "contiguous", causal=False) == [block * world_size] * world_size


# The world of 4 takes about 10 s on 2 cores: `make test-slow` runs it, `make test` the world of 2.
@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=lambda n: f"world{n}")
def results(request):
    calls = [(attention_checks, ()), (training_losses, (CONFIG, 2, 3, "zigzag", "ring"))]
    calls += [(training_losses, (CONFIG, 2, 3, "contiguous", "all-gather"))]
    calls += [(ulysses_checks, ())]
    return request.param, run_on_ranks(in_turn, request.param, calls, timeout=150)


@pytest.mark.timeout(200)
def test_ring_and_all_gather_equal_sdpa_forward_and_every_gradient_on_every_rank(results):
    world_size, ranks = results
    for rank, (checks, *_) in enumerate(ranks):  # the ring's and the all-gather's
        for name, check in checks.items():
            if name not in ("formula", "bad length"):
                assert check["difference"] < 1e-12, f"rank {rank} of {world_size}, {name}: {check['difference']}"


@pytest.mark.timeout(200)
def test_the_ring_posts_the_messages_and_bytes_of_the_formula(results):
    world_size, ranks = results
    for checks, *_ in ranks:
        formula = checks["formula"]
        assert formula["message bytes"] == 2 * SHAPE["batch"] * SHAPE["heads"] * 16 // world_size * 8 * 8
        for name, check in checks.items():
            if name.startswith("ring"):
                forward, backward = formula["forward sends"], formula["backward sends"]
                assert check["forward"] == (forward, forward, forward * formula["message bytes"]), name
                assert check["backward"] == (backward, backward, backward * formula["message bytes"]), name
                assert check["grouped"] == 2 * (forward + backward), f"{name}: send and receive in one group (NCCL)"
            elif name == "bad length":
                assert "does not divide into" in check and "no message" in check
            elif name.startswith("all-gather"):
                assert check["forward"][:2] == check["backward"][:2] == (0, 0)  # collectives, not messages


@pytest.mark.timeout(200)
def test_the_gpt_trains_to_the_same_losses_with_context_parallelism(results):
    _, ranks = results
    for _, *runs, _ in ranks:
        for losses in runs:
            torch.testing.assert_close(losses["context parallel"], losses["one process"], rtol=1e-10, atol=1e-10)
            assert losses["one process"][-1] < losses["one process"][0]  # it learns: the steps are not no-ops


@pytest.mark.timeout(200)
def test_ulysses_equals_sdpa_on_every_rank_and_refuses_heads_that_do_not_divide_by_the_ranks(results):
    world_size, ranks = results
    for rank, (*_, checks) in enumerate(ranks):
        refusal = checks.pop("heads that do not divide")
        assert "do not divide by the" in refusal, refusal
        for name, difference in checks.items():
            assert difference < 1e-12, f"rank {rank} of {world_size}, {name}: {difference}"
