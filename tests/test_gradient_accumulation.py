"""The arithmetic of gradient accumulation, on one process: why the loss is divided by the micro-steps."""

import torch
import torch.nn.functional as F

from common.models import LeNet
from tests.conftest import REPO, load_script

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


def test_accumulated_and_whole_batch_gradients_differ_only_by_float_rounding_and_training_widens_the_gap():
    # Lesson 04 states these bounds; benchmarks/accumulation_rounding.py prints the measured figures.
    rounding = load_script(REPO / "benchmarks/accumulation_rounding.py")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the benchmark runs: the thread count changes how the kernels split their sums
    try:
        first = rounding.one_step_difference(micro_steps=4)
        after_1, after_30 = rounding.training_drift(micro_steps=4, steps=30, report_at=[1, 30])
    finally:
        torch.set_num_threads(threads)
    assert 0 < first["max_abs"] <= 1e-5 * first["max_grad"]  # another order of float sums, nothing more
    assert after_1["max_param_diff"] < 1e-6
    assert after_1["max_param_diff"] < after_30["max_param_diff"] < 1e-3  # each step's rounding feeds the next
    assert abs(after_30["loss_whole"] - after_30["loss_micro"]) < 1e-3
