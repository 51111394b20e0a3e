"""Lab 01: real runs of the DDP training script through torchrun (gloo, CPU), as the README tells readers to.

Runs against solutions/01_ddp_basic.py; with LAB_TARGET=labs, against your labs/01_ddp_basic.py:

    LAB_TARGET=labs .venv/bin/python -m pytest tests/labs/test_01_ddp_basic.py

Each run has a timeout, so a hang fails the test instead of stalling CI.
"""

import json
import subprocess

import pytest
import torch

from tests.conftest import NO_NETWORK, PYTHON, REPO, TORCHRUN, lab_path, run_command, torchrun
from tests.fake_datasets import write_fashion_mnist
from tests.labs import load_lab

LAB = "01_ddp_basic"
SCRIPT = lab_path(LAB)  # most tests run it with torchrun, as the README does
# What these tests call in the script itself: parse_args(argv) -> args, and main(args), in this process.
NEEDS = ("parse_args", "main")
# Over seeds 0-3 on a 2-core CPU, 5 epochs on digits with 2 processes reach 94.4-97.5% test accuracy; one
# epoch reaches 45-66% and chance is 10%. 85% fails a run that stops learning, without flaking.
MIN_ACCURACY = 0.85


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """4 epochs with a checkpoint per epoch, then a resumed run to epoch 5."""
    folder = tmp_path_factory.mktemp("ddp")
    first = torchrun(
        SCRIPT,
        "--dataset",
        "digits",
        "--epochs",
        "4",
        "--checkpoint-dir",
        folder / "ckpt",
        "--metrics-file",
        folder / "first.json",
    )
    resumed = torchrun(
        SCRIPT,
        "--dataset",
        "digits",
        "--epochs",
        "5",
        "--checkpoint-dir",
        folder / "ckpt",
        "--resume",
        "--metrics-file",
        folder / "resumed.json",
    )
    return folder, first, resumed


def test_two_processes_train_digits_and_write_the_metrics_file(trained):
    folder, first, _ = trained
    assert first.returncode == 0, first.output
    metrics = json.loads((folder / "first.json").read_text())
    assert metrics["world_size"] == 2 and metrics["backend"] == "gloo" and metrics["device"] == "cpu"
    assert metrics["epochs_run"] == [1, 2, 3, 4] and len(metrics["epoch_times"]) == 4
    assert metrics["samples_per_second"] > 0 and metrics["final_train_loss"] < metrics["history"][0]["train_loss"]
    assert metrics["history"][0]["samples"] == 1438  # every training image once per epoch
    assert metrics["replicas_in_sync"] is True
    # Rank 0 alone prints: each epoch's summary appears once, not once per process.
    assert first.stdout.count("epoch 1/4: train loss") == 1
    assert "accuracy" in first.stdout and "of 359" in first.stdout  # every test image counted once


def test_a_resumed_run_continues_from_the_saved_epoch_and_reaches_the_accuracy(trained):
    folder, _, resumed = trained
    assert resumed.returncode == 0, resumed.output
    assert "resumed from" in resumed.stdout and "4 epoch(s)" in resumed.stdout
    metrics = json.loads((folder / "resumed.json").read_text())
    assert metrics["epochs_run"] == [5]  # epoch 5 only, not a fresh start
    assert metrics["final_test_accuracy"] >= MIN_ACCURACY, resumed.stdout
    state = torch.load(folder / "ckpt" / "checkpoint.pt", weights_only=True)
    assert state["epoch"] == 5 and state["step"] == 5 * 12  # 719 images per rank, 64 per batch: 12 steps
    assert [p.name for p in (folder / "ckpt").iterdir()] == ["checkpoint.pt"]  # no temporary files left


def differing_tensors(state, reference):
    """Names of the model's and the optimizer's (momentum) tensors that are not bit-identical to the reference."""
    names = [name for name in reference["model"] if not torch.equal(state["model"][name], reference["model"][name])]
    return names + [
        f"momentum {index}"
        for index, buffers in reference["optimizer"]["state"].items()
        if not torch.equal(state["optimizer"]["state"][index]["momentum_buffer"], buffers["momentum_buffer"])
    ]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The 5 epochs of `trained` in one run: its final checkpoint."""
    folder = tmp_path_factory.mktemp("ddp_uninterrupted")
    run = torchrun(SCRIPT, "--dataset", "digits", "--epochs", "5", "--checkpoint-dir", folder)
    assert run.returncode == 0, run.output
    return torch.load(folder / "checkpoint.pt", weights_only=True)


def test_resuming_lenet_on_2_processes_ends_bit_identical_to_the_uninterrupted_run(trained, uninterrupted):
    # LeNet draws no random numbers while training, and set_epoch(epoch) rebuilds each remaining epoch's order.
    folder, _, resumed = trained
    assert resumed.returncode == 0, resumed.output
    state = torch.load(folder / "ckpt" / "checkpoint.pt", weights_only=True)
    assert (state["epoch"], state["step"]) == (uninterrupted["epoch"], uninterrupted["step"]) == (5, 60)
    assert differing_tensors(state, uninterrupted) == []


@pytest.mark.parametrize("model, differs", [("lenet", False), ("simplecnn", True)])
def test_a_resumed_run_is_bit_identical_without_dropout_and_a_different_run_with_it(tmp_path, model, differs):
    # The checkpoint holds no RNG state: a resumed run draws its dropout masks from set_seed(seed, rank) again,
    # the masks of the run's first steps, not those the uninterrupted run draws next. In-process, a world of one,
    # on Fashion-MNIST files of 64 + 16 images (a test set that small keeps each epoch's evaluation cheap).
    lab = load_lab(LAB, NEEDS)
    write_fashion_mnist(tmp_path / "data", train_size=64, test_size=16)
    quick = [
        "--dataset",
        "fashion-mnist",
        "--data-dir",
        str(tmp_path / "data"),
        "--num-workers",
        "0",
        "--model",
        model,
        "--batch-size",
        "16",
        "--max-batches-per-epoch",
        "2",
        "--lr",
        "0.01",
    ]

    def final_state(folder, *extra):
        lab.main(lab.parse_args([*quick, "--checkpoint-dir", str(folder), *extra]))
        return torch.load(folder / "checkpoint.pt", weights_only=True)

    final_state(tmp_path / "resumed", "--epochs", "1")
    resumed = final_state(tmp_path / "resumed", "--epochs", "2", "--resume")
    reference = final_state(tmp_path / "uninterrupted", "--epochs", "2")
    assert resumed["step"] == reference["step"] == 4
    assert bool(differing_tensors(resumed, reference)) == differs, differing_tensors(resumed, reference)


@pytest.mark.parametrize("nproc", [1, pytest.param(3, marks=pytest.mark.slow), 4])  # 3: make test-slow
def test_any_number_of_processes_from_1_to_4(tmp_path, nproc):
    run = torchrun(
        SCRIPT,
        "--dataset",
        "digits",
        "--epochs",
        "1",
        "--max-batches-per-epoch",
        "2",
        "--batch-size",
        "16",
        "--metrics-file",
        tmp_path / "m.json",
        nproc=nproc,
    )
    assert run.returncode == 0, run.output
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["world_size"] == nproc and metrics["global_batch_size"] == 16 * nproc
    assert metrics["history"][0]["samples"] == 2 * 16 * nproc  # --max-batches-per-epoch 2 on every rank
    assert metrics["replicas_in_sync"] is True


def test_plain_python_runs_as_a_world_of_one(tmp_path):
    run = run_command(
        [
            PYTHON,
            SCRIPT,
            "--dataset",
            "synthetic",
            "--model",
            "simplecnn",
            "--epochs",
            "1",
            "--max-batches-per-epoch",
            "2",
            "--batch-size",
            "8",
            "--metrics-file",
            tmp_path / "m.json",
        ],
        timeout=120,
    )
    assert run.returncode == 0, run.output
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["world_size"] == 1 and metrics["model"] == "simplecnn" and metrics["history"][0]["samples"] == 16


def assert_fails_fast_with(run, message, status=None):
    assert run.returncode != 0 and (status is None or run.returncode == status), run.output
    assert message in run.output, run.output
    assert run.seconds < 60
    # Our processes end with the message, not a traceback through the course's code or torchvision
    # (torchrun, the launcher, prints a summary with a traceback of its own after the message).
    assert not frames_in_our_code(run.output), run.output


def frames_in_our_code(output: str) -> list[str]:
    """Traceback lines that point into common/, solutions/, labs/ or torchvision."""
    ours = [str(REPO / folder) for folder in ("common", "solutions", "labs")] + ["torchvision"]
    frames = [line for line in output.splitlines() if line.lstrip().startswith('File "')]
    return [frame for frame in frames if any(place in frame for place in ours)]


def test_the_traceback_check_recognises_a_traceback_through_our_code():
    launcher = f'  File "{REPO}/.venv/bin/torchrun", line 8, in <module>'
    assert frames_in_our_code(launcher) == []
    for frame in (
        f'  File "{REPO}/common/data.py", line 9, in load_data',
        '  File "/x/site-packages/torchvision/datasets/mnist.py", line 1, in download',
    ):
        assert frames_in_our_code(f"Traceback (most recent call last):\n{launcher}\n{frame}") == [frame]


def test_missing_data_set_offline_names_the_way_out(tmp_path):
    run = torchrun(
        SCRIPT, "--dataset", "fashion-mnist", "--data-dir", tmp_path / "data", timeout=90, env_extra=NO_NETWORK
    )
    assert_fails_fast_with(run, "--dataset digits")
    assert "could not load data set 'fashion-mnist'" in run.output and str(tmp_path / "data") in run.output


def test_nccl_without_gpus_is_a_clear_error_not_a_hang():
    run = torchrun(SCRIPT, "--dataset", "digits", "--backend", "nccl", timeout=90)
    assert_fails_fast_with(run, "--backend nccl needs one CUDA device per process")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--batch-size", "0"], "argument --batch-size: must be at least 1, got 0"),
        (["--dataset", "imagenet"], "argument --dataset: invalid choice: 'imagenet'"),
        (["--lr", "-1"], "argument --lr: must be above 0"),
        (["--num-workers", "-1"], "argument --num-workers: must be 0 or more"),
        (["--resume"], "--resume needs --checkpoint-dir"),
    ],
)
def test_bad_options_stop_with_a_usage_message(args, message):
    run = run_command([PYTHON, SCRIPT, *args], timeout=60)
    assert_fails_fast_with(run, message, status=2)


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path):
    run = run_command([PYTHON, SCRIPT, "--dataset", "digits", "--checkpoint-dir", tmp_path, "--resume"], timeout=60)
    assert_fails_fast_with(run, "--resume, but there is no checkpoint at", status=1)


def test_two_standalone_runs_at_once_do_not_collide():
    command = [
        TORCHRUN,
        "--standalone",
        "--nproc_per_node=2",
        SCRIPT,
        "--dataset",
        "digits",
        "--epochs",
        "1",
        "--max-batches-per-epoch",
        "2",
    ]
    runs = [
        subprocess.Popen(
            [str(part) for part in command], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for _ in range(2)
    ]
    try:
        outputs = [run.communicate(timeout=180)[0] for run in runs]
    finally:
        for run in runs:
            run.kill()
    assert [run.returncode for run in runs] == [0, 0], outputs
