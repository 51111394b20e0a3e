"""Lab 05: multi-node training with crash-and-resume, rehearsed as two torchrun "nodes" on 127.0.0.1 (gloo, CPU).

Runs against solutions/05_multi_node.py; with LAB_TARGET=labs, against your labs/05_multi_node.py:

    LAB_TARGET=labs .venv/bin/python -m pytest tests/labs/test_05_multi_node.py

Every launch goes through scripts/rehearse_two_nodes.py with a deadline, and through run_command's timeout.
"""

import json

import pytest
import torch

from common.fault_tolerance import list_checkpoints, read_verified
from tests.conftest import PYTHON, REPO, TORCHRUN, lab_path, run_command
from tests.fake_datasets import write_fashion_mnist

LAB = "05_multi_node"
# What these tests need from the script: its command line only, run by torchrun and by the two-node rehearsal.
REHEARSE = REPO / "scripts" / "rehearse_two_nodes.py"
# 4 ranks x 32 per batch: 12 steps per epoch of the 1438 digits, 24 in all; checkpoints at 4, 8, 12 (epoch end), ...
TRAINING = ["--dataset", "digits", "--epochs", "2", "--batch-size", "32", "--checkpoint-every", "4"]
FAIL_AT = 14  # in epoch 2, two steps after the checkpoint at step 12


def rehearse(*args, timeout=150, launcher=()):
    return run_command(
        [PYTHON, REHEARSE, "--timeout", timeout - 20, *launcher, "--", lab_path(LAB), *args], timeout=timeout
    )


def final_model(folder):
    state = read_verified(list_checkpoints(folder)[0])
    return state["step"], state["model"]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """An uninterrupted run of two nodes x 2 processes, each node with a disk of its own ({node})."""
    folder = tmp_path_factory.mktemp("two_nodes")
    run = rehearse(
        *TRAINING,
        "--checkpoint-dir",
        folder / "node{node}" / "ckpt",
        "--metrics-file",
        folder / "node{node}" / "metrics.json",
    )
    return folder, run


def test_two_launchers_form_a_world_of_4_and_only_global_rank_0_writes(two_nodes):
    folder, run = two_nodes
    assert run.returncode == 0, run.output[-4000:]
    assert "4 process(es)" in run.stdout and "model replicas identical on all 4 rank(s): True" in run.stdout
    # Both launchers host 2 ranks; global rank 0 is on whichever node the rendezvous made node 0.
    assert "rank 3: node 1 local 1" in run.stdout
    writers = [node for node in (0, 1) if list_checkpoints(folder / f"node{node}" / "ckpt")]
    assert len(writers) == 1, "one node's disk holds checkpoints; per-node (local rank 0) writers would give two"
    writer = writers[0]
    other = folder / f"node{1 - writer}"
    assert not other.exists() or not any(other.rglob("*")), sorted(other.rglob("*"))
    assert f"[node {writer}] 4 process(es)" in run.stdout  # rank 0's launcher printed, and wrote
    metrics = json.loads((folder / f"node{writer}" / "metrics.json").read_text())
    assert metrics["world_size"] == 4 and metrics["nodes"] == 2 and metrics["final_step"] == 24
    assert metrics["replicas_in_sync"] is True and metrics["restarts"] == 0


def test_a_crash_with_max_restarts_resumes_to_bit_identical_parameters(two_nodes, tmp_path):
    folder, reference = two_nodes
    assert reference.returncode == 0, reference.output[-4000:]
    run = rehearse(
        *TRAINING,
        "--checkpoint-dir",
        tmp_path / "ckpt",
        "--fail-at-step",
        FAIL_AT,
        "--metrics-file",
        tmp_path / "metrics.json",
        launcher=["--max-restarts", "1"],
    )
    assert run.returncode == 0, run.output[-4000:]
    assert f"--fail-at-step {FAIL_AT}: rank 3 fails on purpose" in run.output
    assert "resumed from" in run.stdout and "step 12" in run.stdout
    writer = next(node for node in (0, 1) if list_checkpoints(folder / f"node{node}" / "ckpt"))
    expected_step, expected = final_model(folder / f"node{writer}" / "ckpt")
    step, resumed = final_model(tmp_path / "ckpt")
    assert step == expected_step == 24
    assert expected.keys() == resumed.keys()
    assert all(torch.equal(resumed[name], expected[name]) for name in expected), "not bit-identical"
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["restarts"] == 1 and metrics["epochs_run"] == [1, 2]  # the history survived the crash


# Dropout (SimpleCNN) draws from the global RNG at every step, so one draw more or less anywhere in a resumed run
# shifts every later mask, and the parameters differ. Each case is one crash, 2 processes, --max-restarts 1:
# - "digits-mid-epoch": in-memory tensors (TensorBatchLoader), 1 epoch of 4 steps, checkpoints every 2 steps; the
#   crash at step 3 resumes from step 2, in the middle of the epoch (the loop skips the 2 batches done).
# - "fashion-mnist-epoch-boundary": Fashion-MNIST files through DataLoader with 2 persistent workers per loader,
#   2 epochs of 2 steps; the crash at step 3 resumes from the end-of-epoch checkpoint at step 2. Before the loaders
#   had a generator of their own, this one failed: the resumed run's first iterator drew its workers' base seed
#   from the global RNG, once more than the uninterrupted run had at that point.
DROPOUT = ["--model", "simplecnn", "--batch-size", "8", "--lr", "0.01", "--checkpoint-every", "2"]
RESUME_CASES = {
    "digits-mid-epoch": (
        ["--dataset", "digits", "--epochs", "1", "--max-batches-per-epoch", "4"],
        3,
        "epoch 0, step 2, batch 2 of the epoch",
    ),
    "fashion-mnist-epoch-boundary": (
        [
            "--dataset",
            "fashion-mnist",
            "--data-dir",
            "{data}",
            "--num-workers",
            "2",
            "--epochs",
            "2",
            "--max-batches-per-epoch",
            "2",
        ],
        3,
        "epoch 1, step 2, batch 0 of the epoch",
    ),
}


def torchrun_restartable(*args, timeout=240):
    """2 processes on this machine, restarted once if one fails, as the lesson's fault drill runs them."""
    return run_command(
        [TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", lab_path(LAB), *args],
        timeout=timeout,
        env_extra={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
    )


# The epoch-boundary case on Fashion-MNIST files is slow (make test-slow; a plain pytest runs it): make test keeps
# the mid-epoch case, the harder of the two resumes.
@pytest.fixture(
    scope="module",
    params=[pytest.param(case, marks=pytest.mark.slow) if "epoch-boundary" in case else case for case in RESUME_CASES],
)
def dropout_run(request, tmp_path_factory):
    """The uninterrupted run of one case: (case, its arguments, the run, the folder of its checkpoints)."""
    folder = tmp_path_factory.mktemp(request.param)
    write_fashion_mnist(folder / "data", train_size=64, test_size=16)
    args = [str(arg).replace("{data}", str(folder / "data")) for arg in DROPOUT + RESUME_CASES[request.param][0]]
    return request.param, args, torchrun_restartable(*args, "--checkpoint-dir", folder / "ckpt"), folder / "ckpt"


def test_with_dropout_a_crash_resumes_to_bit_identical_parameters_mid_epoch_and_at_an_epoch_boundary(
    dropout_run, tmp_path
):
    case, args, reference, reference_folder = dropout_run
    assert reference.returncode == 0, reference.output[-4000:]
    _, fail_at, resumed_at = RESUME_CASES[case]
    run = torchrun_restartable(*args, "--checkpoint-dir", tmp_path / "ckpt", "--fail-at-step", fail_at)
    assert run.returncode == 0, run.output[-4000:]
    assert f"--fail-at-step {fail_at}: rank 1 fails on purpose" in run.output
    assert f"resumed from {tmp_path / 'ckpt' / 'step_00000002.pt'}: {resumed_at}" in run.stdout
    expected_step, expected = final_model(reference_folder)
    step, resumed = final_model(tmp_path / "ckpt")
    assert step == expected_step == 4 and expected.keys() == resumed.keys()
    different = [name for name in expected if not torch.equal(resumed[name], expected[name])]
    assert not different, f"{len(different)} of {len(expected)} tensors differ: {different}"


def test_without_restarts_a_failure_ends_every_process_promptly_and_names_the_rank(tmp_path):
    run = rehearse(
        *TRAINING, "--checkpoint-dir", tmp_path / "ckpt", "--fail-at-step", "3", timeout=120, launcher=["--grace", "45"]
    )
    assert run.returncode != 0 and run.seconds < 90, run.output[-4000:]
    assert "rehearsal: stopping" not in run.stdout, "a launcher had to be stopped: it hung"
    assert "--fail-at-step 3: rank 3 fails on purpose" in run.output
    assert "rank      : 3" in run.output  # torchrun's failure summary names the global rank


def test_a_corrupt_newest_checkpoint_is_skipped_for_the_one_before(tmp_path):
    # A world of one (plain python), 3 steps per epoch: checkpoints at steps 2, 4 and 6 (the last two kept).
    quick = [
        "--dataset",
        "digits",
        "--max-batches-per-epoch",
        "3",
        "--checkpoint-every",
        "2",
        "--checkpoint-dir",
        tmp_path,
    ]
    first = run_command([PYTHON, lab_path(LAB), *quick, "--epochs", "2"], timeout=120)
    assert first.returncode == 0, first.output
    assert [path.name for path in list_checkpoints(tmp_path)] == ["step_00000006.pt", "step_00000004.pt"]
    newest = tmp_path / "step_00000006.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # truncated, as by a full disk
    resumed = run_command([PYTHON, lab_path(LAB), *quick, "--epochs", "3"], timeout=120)
    assert resumed.returncode == 0, resumed.output
    assert "skipping checkpoint step_00000006.pt" in resumed.stdout
    assert "resumed from" in resumed.stdout and "step_00000004.pt: epoch 1, step 4, batch 1" in resumed.stdout
    assert final_model(tmp_path)[0] == 9


def test_a_mid_epoch_resume_at_another_world_size_skips_exactly_the_samples_trained_and_decays_once_per_epoch(
    tmp_path,
):
    # A world of one trains 8 steps of 32 digits (256 of the 1438 samples of epoch 1), checkpoints at step 8 and
    # fails at step 10. Two processes then resume from step 8, as after an elastic restart with a second node.
    # They must train the other 1182 samples of epoch 1, not skip 8 of their own batches (512 samples), and the
    # learning rate must decay once per epoch: StepLR's step_size may not be the batches per epoch of one rank.
    args = [*TRAINING, "--checkpoint-dir", tmp_path / "ckpt", "--metrics-file", tmp_path / "metrics.json"]
    first = run_command([PYTHON, lab_path(LAB), *args, "--fail-at-step", "10"], timeout=120)
    assert first.returncode != 0 and "--fail-at-step 10: rank 0 fails on purpose" in first.output, first.output
    resumed = run_command([TORCHRUN, "--standalone", "--nproc-per-node", "2", lab_path(LAB), *args], timeout=120)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert "world size 1 -> 2" in resumed.stdout
    assert "step_00000008.pt: epoch 0, step 8, 256 samples of the epoch already trained" in resumed.stdout
    history = json.loads((tmp_path / "metrics.json").read_text())["history"]
    assert [row["samples"] for row in history] == [1438 - 256, 1438]  # 2 x 591 samples, then 2 x 719
    newest, before = (read_verified(path) for path in list_checkpoints(tmp_path / "ckpt"))
    assert newest["step"] == 8 + 19 + 23  # 591 samples per rank in 19 batches of 32, then 23 batches of 719
    for state, epochs_done in ((newest, 2), (before, 1)):  # the end of epoch 2, and a step in the middle of it
        (group,) = state["optimizer"]["param_groups"]
        assert group["lr"] == pytest.approx(group["initial_lr"] * 0.8**epochs_done, rel=1e-12), state["step"]
