"""Distributed evaluation counts every test sample exactly once, whatever padding the sampler adds
(``common.metrics.evaluate``, on 2 and 3 gloo processes)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from common.data import make_loader
from common.distributed import all_reduce_mean
from common.launch import run_on_ranks
from common.metrics import evaluate

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
