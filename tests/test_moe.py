"""Lesson 15's mechanism (common.moe): routing, capacity, the balancing loss, the layer against a loop over tokens,
and expert parallelism against the one-process layer on 2 and 4 ranks, the 4 also on a 2-D mesh of data and expert
parallelism (both spawns are slow: `make test-slow` runs them)."""

import pytest
import torch

from common.experiments.moe import expert_parallel_checks, mesh_checks
from common.gpt import GPT
from common.launch import in_turn, run_on_ranks
from common.moe import (
    ExpertParallelMoE,
    MoE,
    Routing,
    average_gradients,
    expert_capacity,
    keep_within_capacity,
    load_balancing_loss,
    moe_by_loop,
    moe_gpt,
    route,
)
from common.tensor_parallel import FeedForward


def test_top_k_picks_the_most_probable_experts_and_the_gates_are_their_probabilities_or_sum_to_one():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 2.0]]).log_softmax(-1)  # probs = softmax
    probs = logits.softmax(-1)
    routing = route(logits, top_k=2)
    assert routing.experts.tolist() == [[1, 2], [0, 3]]
    assert torch.equal(routing.gates, probs.gather(1, routing.experts))
    assert (routing.gates.sum(1) < 1).all()
    renormalized = route(logits, top_k=2, renormalize=True)
    torch.testing.assert_close(renormalized.gates.sum(1), torch.ones(2))
    assert route(logits, top_k=1).experts.tolist() == [[1], [0]]
    assert routing.kept.all() and routing.dropped == 0


def test_capacity_serves_every_first_choice_before_any_second_one_in_order_of_position():
    assert expert_capacity(num_tokens=6, num_experts=3, top_k=2, capacity_factor=1.0) == 4
    assert expert_capacity(num_tokens=6, num_experts=4, top_k=1, capacity_factor=1.25) == 2  # ceil(1.875)
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])  # (T = 4, k = 2)
    kept = keep_within_capacity(experts, num_experts=3, capacity=2)
    # expert 0: tokens 0 and 1 (first choices) fill it; token 2's first choice and token 3's second are dropped.
    # expert 1: token 3's first choice, then token 0's second; token 2's second is dropped.
    assert kept.tolist() == [[True, True], [True, True], [False, False], [True, False]]
    logits = torch.zeros(4, 3)
    logits[:, 0] = 1.0  # every token prefers expert 0
    routing = route(logits, top_k=1, capacity_factor=1.5)  # capacity ceil(1.5 * 4 / 3) = 2
    assert routing.kept.flatten().tolist() == [True, True, False, False] and routing.dropped == 2
    assert routing.counts(3).tolist() == [2, 0, 0]


@pytest.mark.parametrize("top_k, capacity_factor", [(1, None), (2, None), (2, 0.75)])
def test_the_layer_equals_a_loop_over_tokens_gradients_included(top_k, capacity_factor):
    torch.manual_seed(0)
    moe = MoE(8, 4, top_k, hidden=16, capacity_factor=capacity_factor).double()
    X = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(2, 5, 8, dtype=torch.float64)
    (moe(X) * weight).sum().backward()
    dropped = moe.routing.dropped
    grads = [X.grad.clone(), *(p.grad.clone() for p in moe.parameters())]
    X.grad = None
    moe.zero_grad()
    (moe_by_loop(moe, X) * weight).sum().backward()
    for got, expected in zip(grads, [X.grad, *(p.grad for p in moe.parameters())]):
        expected = torch.zeros_like(got) if expected is None else expected  # an expert no token chose
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    assert (dropped > 0) == (capacity_factor is not None)  # a factor of 0.75 drops a quarter at least


def test_the_balancing_loss_is_one_when_balanced_and_its_gradient_reaches_the_router():
    uniform = torch.full((4, 4), 0.25)
    balanced = Routing(uniform, torch.arange(4).unsqueeze(1), uniform[:, :1], torch.ones(4, 1, dtype=torch.bool))
    assert load_balancing_loss(balanced).item() == pytest.approx(1.0)
    lopsided = route(torch.tensor([[5.0, 0.0]] * 4), top_k=1)  # every token on expert 0
    assert load_balancing_loss(lopsided).item() > 1.9  # 2 * (1 * P_0 + 0), P_0 = 0.993
    torch.manual_seed(0)
    moe = MoE(8, 4, top_k=2, hidden=16)
    moe(torch.randn(10, 8))
    moe.aux_loss.backward()
    assert moe.router.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in moe.experts.parameters())  # the experts play no part in it


def test_moe_gpt_gives_each_block_experts_of_that_blocks_own_width_and_dropout():
    gpt = GPT(vocab_size=16, context=4, d_model=8, num_heads=2, num_layers=2, dropout=0.0)
    gpt.blocks[1].mlp = FeedForward(8, hidden=24, dropout=0.25)  # a second block unlike the first
    moe_gpt(gpt, num_experts=2, capacity_factor=1.0)
    first, second = (block.mlp for block in gpt.blocks)
    assert (first.experts[0].up.out_features, first.dropout) == (32, 0.0)
    assert (second.experts[0].up.out_features, second.dropout) == (24, 0.25)
    assert first.capacity_factor == second.capacity_factor == 1.0


def test_average_gradients_sums_the_experts_over_their_copies_only_and_divides_everything_by_all_ranks(monkeypatch):
    # A fast stand-in for the slow 2 x 2 mesh test: all_reduce is faked, as if 2 copies (dp = 2) held the same
    # gradient, so that summing doubles it. W = 4 ranks. The shared parameters: summed over the world (None).
    replica_group = object()
    calls = []

    def all_reduce(flat, group=None):
        calls.append(group)
        flat *= 2

    monkeypatch.setattr("torch.distributed.all_reduce", all_reduce)
    moe = MoE(4, 2, hidden=8)
    for p in moe.parameters():
        p.grad = torch.ones_like(p)
    average_gradients(moe, world_size=4, replica_group=replica_group)
    assert calls == [None, replica_group]  # the shared parameters over the world, the experts over their copies
    assert all(torch.all(p.grad == 0.5) for p in moe.parameters())  # 1 x 2 / 4
    calls.clear()
    for p in moe.parameters():
        p.grad = torch.ones_like(p)
    average_gradients(moe, world_size=4)  # dp = 1: no copies of the experts, no all-reduce for them
    assert calls == [None]
    assert torch.all(moe.router.weight.grad == 0.5) and all(torch.all(p.grad == 0.25) for p in moe.experts.parameters())


def test_bad_input_fails_at_once_with_a_clear_message():
    with pytest.raises(ValueError, match="top-k must be between 1 and the 4 experts, not 5"):
        MoE(8, 4, top_k=5)
    with pytest.raises(ValueError, match="top-k must be between 1 and the 3 experts, not 0"):
        route(torch.zeros(2, 3), top_k=0)
    with pytest.raises(ValueError, match="6 experts do not divide over 4 ranks"):
        ExpertParallelMoE(MoE(8, 6), rank=0, world_size=4)


CONFIG = dict(vocab_size=256, context=8, d_model=16, num_heads=2, num_layers=2, dropout=0.0)


# One spawn per world, both in `make test-slow`: `make test` runs the same checks on 2 ranks against the solution's
# layer in tests/labs/test_16_mixture_of_experts.py (its 20-minute budget has no room for both).
@pytest.fixture(
    scope="module", params=[pytest.param(n, marks=pytest.mark.slow) for n in (2, 4)], ids=lambda n: f"world{n}"
)
def world(request):
    world_size = request.param
    calls = [(expert_parallel_checks, (2 * world_size, 2))]
    if world_size == 4:
        calls.append((mesh_checks, (CONFIG,)))
    return world_size, run_on_ranks(in_turn, world_size, calls, timeout=150)


@pytest.mark.timeout(200)
def test_expert_parallel_layer_equals_the_one_process_layer_with_uneven_tokens_and_an_empty_expert(world):
    world_size, results = world
    for rank, (checks, *_) in enumerate(results):
        assert checks["tokens per expert"][-1] == 0, "the last expert must receive no token"
        assert len(set(checks["tokens per expert"])) > 2  # uneven
        assert checks["output"] == 0 and checks["input gradient"] == 0, rank  # the same sums in the same order
        assert len(checks["experts"]) == 8 and max(checks["experts"].values()) == 0, checks["experts"]
        assert checks["router"] < 1e-13, "the router's gradient, summed over the ranks, is the whole layer's"


@pytest.mark.timeout(200)
def test_dispatch_and_combine_are_inverse_and_equal_torchs_all_to_all(world):
    for checks, *_ in world[1]:
        assert checks["round trip"] and checks["torch's rows"] and checks["torch's gradient"]
        # forward: the counts, the tokens out, the results back; backward: the two reversed
        assert checks["calls"] == ["all_to_all_single"] * 5
        assert checks["bytes"] == checks["formula"]


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [4], indirect=True, ids=["world4"])  # a 2 x 2 mesh needs 4 ranks
def test_expert_and_data_parallel_on_a_2_by_2_mesh_give_the_whole_models_gradients(world):
    world_size, results = world
    coordinates = set()
    for _, mesh in results:
        coordinates.add(tuple(mesh["coordinate"]))
        assert len(mesh["gradients"]) > 40 and max(mesh["gradients"].values()) < 1e-15, mesh["gradients"]
    assert coordinates == {(0, 0), (0, 1), (1, 0), (1, 1)}
