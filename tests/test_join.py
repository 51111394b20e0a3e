"""Uneven inputs under DDP: collectives pair up by their order, so a rank with fewer batches pairs unrelated
collectives and fails; ``Join`` lets each rank run its own number of steps (2 gloo CPU processes).

The functions that run on the ranks live at module level, because spawned processes import them by name.
Every run has a deadline (``timeout``), so a hang fails the test in seconds instead of stalling CI.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from common.ddp import train_on_uneven_inputs, uneven_batches
from common.distributed import set_seed
from common.launch import run_on_ranks
from common.models import LeNet


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
    # Rank 1 runs out of batches and calls replicas_in_sync, whose all-reduce gloo pairs with rank 0's gradient
    # all-reduce. The sizes differ: gloo aborts rank 0, and rank 1 loses its peer. An error within seconds, as
    # soon as rank 1 gets there: a RuntimeError, not the harness's TimeoutError at the deadline. The deadline is
    # generous only so that a busy machine, slow to start the processes, cannot turn it into a TimeoutError.
    # Either rank 1's error comes back, or the harness sees rank 0 killed by SIGABRT (-6) before rank 1 reports.
    with pytest.raises(RuntimeError, match=r"Connection reset by peer|non-zero codes \{0: -6"):
        run_on_ranks(train_on_uneven_inputs, 2, False, timeout=60)


def test_join_lets_each_rank_run_its_own_number_of_steps_and_keeps_the_replicas_identical():
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
