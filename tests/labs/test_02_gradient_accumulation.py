"""Lab 02: gradient accumulation under DDP.

Runs against solutions/02_gradient_accumulation.py; with LAB_TARGET=labs, against your
labs/02_gradient_accumulation.py:

    LAB_TARGET=labs .venv/bin/python -m pytest tests/labs/test_02_gradient_accumulation.py
"""

import json

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.collectives import AllReduceCounter
from common.distributed import set_seed
from common.launch import run_on_ranks
from common.models import LeNet
from tests.conftest import PYTHON, REPO, lab_path, run_command, torchrun
from tests.labs import load_lab

LAB = "02_gradient_accumulation"
# What these tests call in the script: train_one_epoch(net, batches, optimizer, scheduler, accum_steps, device,
# clip_grad_norm=None) -> (summed loss, samples, optimizer steps); the rest they run through its command line.
NEEDS = ("train_one_epoch",)
MICRO_BATCH, LR = 4, 0.1


def samples(count, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, 1, 28, 28, generator=generator), torch.randint(0, 10, (count,), generator=generator)


def rank_micro_batches(X, y, rank, world_size):
    """Micro-batch j of rank r holds samples (j * world_size + r) * MICRO_BATCH onwards: the ranks' micro-batches
    together cover X exactly once."""
    chunks = list(zip(X.split(MICRO_BATCH), y.split(MICRO_BATCH)))
    return chunks[rank::world_size]


def accumulate(env, accum_steps, micro_batches, clip_grad_norm):
    lab = load_lab(LAB, NEEDS)
    X, y = samples(micro_batches * env.world_size * MICRO_BATCH)
    set_seed(0)
    net = DDP(LeNet())
    counter = AllReduceCounter.attach(net)
    sent_before_micro_step = []
    net.register_forward_pre_hook(lambda module, args: sent_before_micro_step.append(counter.calls))
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    batches = rank_micro_batches(X, y, env.rank, env.world_size)
    loss_sum, count, steps = lab.train_one_epoch(
        net, batches, optimizer, scheduler, accum_steps, env.device, clip_grad_norm=clip_grad_norm
    )
    sends = [
        after - before for before, after in zip(sent_before_micro_step, sent_before_micro_step[1:] + [counter.calls])
    ]
    return {
        "params": [p.detach() for p in net.parameters()],
        "steps": steps,
        "samples": count,
        "loss_sum": float(loss_sum),
        "sends": sends,
    }


def reference(groups, clip_grad_norm=None):
    """One process, one plain SGD step per group of samples (each group: a whole effective batch)."""
    set_seed(0)
    model = LeNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for X, y in groups:
        optimizer.zero_grad()
        F.cross_entropy(model(X), y).backward()
        if clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def test_four_micro_steps_on_two_ranks_equal_one_step_on_the_whole_effective_batch():
    X, y = samples(4 * 2 * MICRO_BATCH)
    expected = reference([(X, y)])
    for rank in run_on_ranks(accumulate, 2, 4, 4, None, timeout=120):
        torch.testing.assert_close(rank["params"], expected)
        assert rank["steps"] == 1 and rank["samples"] == 4 * MICRO_BATCH
        # no_sync: the first three micro-steps send nothing, the last one all-reduces
        assert rank["sends"][:3] == [0, 0, 0] and rank["sends"][3] >= 1, rank["sends"]


def test_the_shorter_last_group_of_an_epoch_takes_its_own_step():
    # 6 micro-batches per rank with 4 per step: a group of 4, then a group of 2
    X, y = samples(6 * 2 * MICRO_BATCH)
    first = 4 * 2 * MICRO_BATCH
    expected = reference([(X[:first], y[:first]), (X[first:], y[first:])])
    for rank in run_on_ranks(accumulate, 2, 4, 6, None, timeout=120):
        torch.testing.assert_close(rank["params"], expected)
        assert rank["steps"] == 2
        assert [sends > 0 for sends in rank["sends"]] == [False, False, False, True, False, True]


def test_clipping_acts_on_the_gradient_averaged_over_micro_steps_and_ranks():
    X, y = samples(2 * 2 * MICRO_BATCH)
    expected = reference([(X, y)], clip_grad_norm=0.05)
    unclipped = reference([(X, y)])
    for rank in run_on_ranks(accumulate, 2, 2, 2, 0.05, timeout=120):
        torch.testing.assert_close(rank["params"], expected)
        assert not torch.allclose(rank["params"][0], unclipped[0])  # the clip did bite


def test_digits_with_accumulation_trains_and_writes_its_metrics(tmp_path):
    metrics_file = tmp_path / "metrics.json"
    run = torchrun(
        lab_path(LAB),
        "--dataset",
        "digits",
        "--batch-size",
        "16",
        "--grad-accum-steps",
        "4",
        "--epochs",
        "3",
        "--metrics-file",
        metrics_file,
        nproc=2,
        timeout=180,
    )
    assert run.returncode == 0, run.output
    metrics = json.loads(metrics_file.read_text())
    assert metrics["effective_batch_size"] == 128 and metrics["replicas_in_sync"] is True
    # 1438 training images, 719 per rank, 45 micro-batches of 16: 11 groups of 4 and one of 1
    assert [epoch["optimizer_steps"] for epoch in metrics["history"]] == [12, 12, 12]
    assert metrics["final_test_accuracy"] >= 0.8


def test_four_micro_batches_of_16_follow_the_path_of_batches_of_64(tmp_path):
    # The same effective batch, the same data order: the same training, up to float rounding.
    common = ["--dataset", "digits", "--epochs", "2", "--seed", "1"]
    accumulated, plain = tmp_path / "accumulated.json", tmp_path / "plain.json"
    run = torchrun(
        lab_path(LAB),
        *common,
        "--batch-size",
        "16",
        "--grad-accum-steps",
        "4",
        "--metrics-file",
        accumulated,
        nproc=2,
        timeout=180,
    )
    assert run.returncode == 0, run.output
    run = torchrun(
        REPO / "solutions/01_ddp_basic.py", *common, "--batch-size", "64", "--metrics-file", plain, nproc=2, timeout=180
    )
    assert run.returncode == 0, run.output
    losses = [
        [epoch["train_loss"] for epoch in json.loads(path.read_text())["history"]] for path in (accumulated, plain)
    ]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-3, atol=1e-3)


def test_bad_accumulation_steps_stop_with_a_message(tmp_path):
    run = run_command([PYTHON, lab_path(LAB), "--dataset", "digits", "--grad-accum-steps", "0"], timeout=60)
    assert run.returncode != 0
    assert "must be at least 1" in run.stderr and "Traceback" not in run.output
