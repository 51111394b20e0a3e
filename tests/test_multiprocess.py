"""Correctness across processes: each test forms a real gloo process group of 2 or 3 CPU processes.

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
from common.distributed import (all_reduce_mean, all_reduce_sum, global_mean, main_process_first, replicas_in_sync,
                                set_seed)
from common.launch import run_on_ranks
from common.metrics import evaluate
from common.models import LeNet

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
    from common.demos import weights_before_and_after_ddp

    ranks = run_on_ranks(weights_before_and_after_ddp, 3, timeout=90)
    assert ranks[0]["before"] != ranks[1]["before"] != ranks[2]["before"]
    assert all(rank["after"] == ranks[0]["before"] for rank in ranks)
