"""Lab 11: PowerSGD by hand: Gram-Schmidt, the two products, error feedback.

Runs against solutions/11_powersgd.py; with LAB_TARGET=labs, against your labs/11_powersgd.py:

    LAB_TARGET=labs .venv/bin/python -m pytest tests/labs/test_11_powersgd.py

The lab file is loaded inside each spawned process (by path), since a process can only run what it imports. One
spawn of 2 ranks does everything; the tests below assert on what it returns. The hand-made buckets are
common.experiments.compression.HandMadeBucket; the gradients and the small conv net are tests/test_compression.py's.
"""

import json

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from common.experiments.compression import HandMadeBucket, constant_gradient_drift
from common.launch import run_on_ranks
from tests.labs import load_lab
from tests.test_compression import (
    SEED,
    STEPS,
    batches,
    ddp_with,
    direct_gradients,
    direct_gradients_all_ranks,
    train,
)

LAB = "11_powersgd"
# What these tests call in the script: orthogonalize(matrix, epsilon=0.0), in place; powersgd_hook_by_hand(state,
# bucket) with common.compression.PowerSGDByHand as the state; parse_args(argv) and train(args, env), the script's
# own training run.
NEEDS = ("orthogonalize", "powersgd_hook_by_hand", "parse_args", "train")
WORLD_SIZE = 2
FEEDBACK_STEPS = 198  # compressed steps, after the 2 plain ones
# A short training run: LeNet on digits, 12 steps an epoch at batch 64 on 2 ranks; PowerSGD from step 10.
RUN = ["--dataset", "digits", "--epochs", "6", "--num-workers", "0", "--matrix-rank", "2"]


def lab_checks(env, tmp):
    torch.set_num_threads(
        1
    )  # as torchrun gives each of several processes: bit-reproducible runs, and no oversubscription
    lab = load_lab(LAB, NEEDS)
    from common.compression import PowerSGDByHand

    out = {}
    # One compressed step on hand-made gradients: rank 2, from step 0, min rate 1, no memory.
    bucket = HandMadeBucket(0, 1, direct_gradients(env.rank))
    lab.powersgd_hook_by_hand(PowerSGDByHand(None, 2, 0, 1, False, False, random_seed=SEED), bucket).wait()
    out["direct"] = [g.clone() for g in bucket.gradients()]

    # Under DDP against torch's hook: rank 1 with error feedback and warm start, rank 2 with feedback alone.
    data = batches(env)
    for rank, warm in ((1, True), (2, False)):
        settings = dict(matrix_approximation_rank=rank, start_powerSGD_iter=2, warm_start=warm, random_seed=SEED)
        theirs = train(ddp_with(powerSGD_hook.PowerSGDState(None, **settings), powerSGD_hook.powerSGD_hook), data)
        ours = train(ddp_with(PowerSGDByHand(None, **settings), lab.powersgd_hook_by_hand), data)
        out[f"r{rank}"] = {"torch": theirs, "lab": ours}

    for feedback in (True, False):
        out[f"drift_{feedback}"] = constant_gradient_drift(env, lab.powersgd_hook_by_hand, feedback, FEEDBACK_STEPS)

    # The script's own training run: plain all-reduce, PowerSGD, and PowerSGD stopped after 3 epochs and resumed.
    runs = {
        "allreduce": ["--hook", "allreduce"],
        "powersgd": [],
        "first_half": ["--epochs", "3", "--checkpoint-dir", str(tmp / "checkpoint")],
        "resumed": ["--checkpoint-dir", str(tmp / "checkpoint")],
    }
    for name, extra in runs.items():
        lab.train(lab.parse_args([*RUN, *extra, "--metrics-file", str(tmp / f"{name}.json")]), env)
        if env.rank == 0:
            out[name] = json.loads((tmp / f"{name}.json").read_text())
    # A checkpoint that lost one rank's hook state: every rank refuses to resume (none waits for the others).
    if env.rank == 0:
        (tmp / "checkpoint" / "hook_rank1.pt").unlink()
    dist.barrier()
    try:
        lab.train(lab.parse_args([*RUN, "--epochs", "7", "--checkpoint-dir", str(tmp / "checkpoint")]), env)
    except SystemExit as error:
        out["refused"] = str(error)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_on_ranks(lab_checks, WORLD_SIZE, tmp_path_factory.mktemp("powersgd"), timeout=240)


def test_orthogonalize_gives_orthonormal_columns_spanning_the_same_space():
    orthogonalize = load_lab(LAB, NEEDS).orthogonalize
    matrix = torch.randn(10, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    result = matrix.clone()
    assert orthogonalize(result) is None  # in place
    torch.testing.assert_close(result.T @ result, torch.eye(4, dtype=torch.float64))
    # Gram-Schmidt's columns are QR's up to sign: column i spans what the first i+1 input columns span.
    q = torch.linalg.qr(matrix).Q
    torch.testing.assert_close(result.abs(), q.abs())
    torch.testing.assert_close(result @ result.T @ matrix, matrix)  # the same space: projecting changes nothing


@pytest.mark.timeout(300)
def test_a_low_rank_sum_comes_through_exactly_and_the_bias_uncompressed(results):
    mean = [sum(grads[i] for grads in direct_gradients_all_ranks()) / WORLD_SIZE for i in range(3)]
    for rank in range(WORLD_SIZE):
        got = results[rank]["direct"]
        torch.testing.assert_close(got[2], mean[2], rtol=1e-5, atol=1e-5)  # rank 2 sum: exact
        torch.testing.assert_close(got[1], mean[1])  # the bias: all-reduced as it is
        assert (got[0] - mean[0]).norm() > 0.1 * mean[0].norm()  # a general matrix loses something at rank 2
    assert torch.equal(results[0]["direct"][0], results[1]["direct"][0])


@pytest.mark.timeout(300)
def test_the_hook_gives_torchs_gradients_under_ddp(results):
    for rank in (1, 2):
        (torch_grads, torch_params), (lab_grads, lab_params) = (results[0][f"r{rank}"][k] for k in ("torch", "lab"))
        assert len(lab_grads) == STEPS
        for step, (theirs, ours) in enumerate(zip(torch_grads, lab_grads)):
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5, msg=f"rank {rank}, step {step}")
        torch.testing.assert_close(lab_params, torch_params, rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(300)
def test_error_feedback_delivers_the_whole_gradient_over_time(results):
    """A constant gradient, compressed to rank 1 step after step (``constant_gradient_drift``): with error feedback
    what is left out is sent later, so the mean delivered gradient tends to the true mean; without it the same part
    is lost every step."""
    with_feedback, without_feedback = results[0]["drift_True"], results[0]["drift_False"]
    assert len(with_feedback) == len(without_feedback) == FEEDBACK_STEPS
    assert with_feedback[-1] < 0.15 and with_feedback[-1] < with_feedback[9] / 5, with_feedback[::20]
    assert min(without_feedback) > 0.5, without_feedback[::20]


@pytest.mark.timeout(300)
def test_training_with_powersgd_stays_near_plain_all_reduce_and_resumes_exactly(results):
    runs = results[0]
    plain, compressed = (runs[name]["history"][-1]["test_accuracy"] for name in ("allreduce", "powersgd"))
    assert plain > 0.8 and compressed > plain - 0.05, (plain, compressed)  # a loose margin: 6 epochs, one seed
    assert all(runs[name]["replicas_in_sync"] for name in ("allreduce", "powersgd", "first_half", "resumed"))
    # The resumed run picked up the errors, Q's and step count: its last epoch is the straight run's, bit for bit.
    assert [row["epoch"] for row in runs["resumed"]["history"]] == [4, 5, 6]
    straight, resumed = runs["powersgd"]["history"][-1], runs["resumed"]["history"][-1]
    assert (resumed["test_loss"], resumed["train_loss"]) == (straight["test_loss"], straight["train_loss"])
    for rank in range(WORLD_SIZE):  # a lost hook_rank1.pt: both ranks refuse, naming it
        assert "no PowerSGD state for rank(s) [1]" in results[rank]["refused"]
