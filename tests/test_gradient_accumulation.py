"""The arithmetic of gradient accumulation, on one process: why the loss is divided by the micro-steps."""

import torch
import torch.nn.functional as F

from common.models import LeNet

K, MICRO_BATCH = 4, 5


def gradients(micro_batches, divide: bool):
    torch.manual_seed(0)
    model = LeNet()
    for X, y in micro_batches:
        loss = F.cross_entropy(model(X), y)
        (loss / len(micro_batches) if divide else loss).backward()  # .grad adds up across backward calls
    return [p.grad for p in model.parameters()]


def test_divided_micro_step_losses_give_the_whole_batch_gradient_and_undivided_ones_k_times_it():
    generator = torch.Generator().manual_seed(0)
    X, y = torch.randn(K * MICRO_BATCH, 1, 28, 28, generator=generator), torch.randint(0, 10, (K * MICRO_BATCH,))
    whole_batch = gradients([(X, y)], divide=True)
    micro_batches = list(zip(X.split(MICRO_BATCH), y.split(MICRO_BATCH)))
    torch.testing.assert_close(gradients(micro_batches, divide=True), whole_batch)
    torch.testing.assert_close(gradients(micro_batches, divide=False), [K * g for g in whole_batch])
