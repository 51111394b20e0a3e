"""Lab 08: DataParallel against DDP: the timing loop, and the comparison run for real.

Runs against solutions/08_dp_vs_ddp.py; with LAB_TARGET=labs, against your labs/08_dp_vs_ddp.py:

    LAB_TARGET=labs .venv/bin/python -m pytest tests/labs/test_08_dp_vs_ddp.py
"""

import json

import pytest
import torch
from torch import nn

from common.distributed import DistEnv
from common.models import LeNet
from tests.conftest import PYTHON, lab_path, run_command, torchrun
from tests.labs import load_lab

LAB = "08_dp_vs_ddp"
# What these tests call in the script: time_training_steps(net, batches, device, warmup_steps, other_devices=())
# -> {"seconds", "samples", "steps", "peak_memory_mib"}, which reads the module names `time`, `synchronize` and
# `reset_peak_memory` (the tests replace them); measure_ddp(model_class, X, y, args, env), which calls the
# script's `DDP`, `dist.all_reduce` and `time_training_steps`; and parse_args(argv).
NEEDS = ("time_training_steps", "measure_ddp", "parse_args", "DDP", "dist")
QUICK = ["--model", "lenet", "--batch-size", "8", "--steps", "3", "--warmup-steps", "1"]


class CountsItsCalls(nn.Module):
    """A linear model that counts its forward calls, to tell warm-up from timed steps."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.calls = 0

    def forward(self, X):
        self.calls += 1
        return self.linear(X)


class CallCountClock:
    """Stands in for the ``time`` module: the "time" is the number of forward calls made so far. A clock of
    wall seconds would make the test depend on how busy the machine is."""

    def __init__(self, model: CountsItsCalls):
        self.model = model

    def perf_counter(self) -> float:
        return float(self.model.calls)


def batches(count, size=5):
    generator = torch.Generator().manual_seed(0)
    return [
        (torch.randn(size, 4, generator=generator), torch.randint(0, 3, (size,), generator=generator))
        for _ in range(count)
    ]


def test_measure_trains_on_every_batch_and_times_only_the_steps_after_the_warm_up(monkeypatch):
    lab = load_lab(LAB, NEEDS)
    model = CountsItsCalls()
    monkeypatch.setitem(lab.time_training_steps.__globals__, "time", CallCountClock(model))  # its module's `time`
    before = [p.detach().clone() for p in model.parameters()]
    result = lab.time_training_steps(model, batches(5), torch.device("cpu"), warmup_steps=2)
    assert model.calls == 5
    assert (result["steps"], result["samples"]) == (3, 15)
    assert result["seconds"] == 3, "the clock starts after the 2 warm-up forwards and stops after the last one"
    assert result["peak_memory_mib"] > 0
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters())), "it must train"


def test_measure_with_no_step_left_to_time_says_so():
    lab = load_lab(LAB, NEEDS)
    with pytest.raises(ValueError, match="no step to time"):
        lab.time_training_steps(nn.Linear(4, 3), batches(2), torch.device("cpu"), warmup_steps=2)


def test_measure_resets_every_devices_peak_memory_when_the_clock_starts(monkeypatch):
    # DataParallel's figures for GPUs 1..N-1 must cover the same steps as GPU 0's: no warm-up in any of them.
    lab = load_lab(LAB, NEEDS)
    model = CountsItsCalls()
    resets = []
    monkeypatch.setitem(
        lab.time_training_steps.__globals__,
        "reset_peak_memory",
        lambda device: resets.append((str(device), model.calls)),
    )
    lab.time_training_steps(
        model, batches(4), torch.device("cpu", 0), warmup_steps=2, other_devices=[torch.device("cpu", 1)]
    )
    assert sorted(resets) == [("cpu:0", 2), ("cpu:1", 2)], "each device once, after the 2 warm-up forwards"


class RecordsEachClockRead:
    """Stands in for the ``time`` module: each read of the clock is recorded, with the forward calls made so far."""

    def __init__(self, model: CountsItsCalls, events: list):
        self.model, self.events = model, events

    def perf_counter(self) -> float:
        self.events.append(("clock", self.model.calls))
        return float(self.model.calls)


def test_measure_synchronizes_every_device_before_each_clock_read(monkeypatch):
    # CUDA is asynchronous: each clock read must come after every device has finished the work queued so far, at
    # the start (after the warm-up) and at the end (after the last step), or the clock times how fast Python queued.
    lab = load_lab(LAB, NEEDS)
    model = CountsItsCalls()
    events = []
    monkeypatch.setitem(lab.time_training_steps.__globals__, "time", RecordsEachClockRead(model, events))
    monkeypatch.setitem(
        lab.time_training_steps.__globals__,
        "synchronize",
        lambda device: events.append((f"synchronize {device}", model.calls)),
    )
    lab.time_training_steps(
        model, batches(4), torch.device("cpu", 0), warmup_steps=2, other_devices=[torch.device("cpu", 1)]
    )
    assert events == [
        ("synchronize cpu:0", 2),
        ("synchronize cpu:1", 2),
        ("clock", 2),
        ("synchronize cpu:0", 4),
        ("synchronize cpu:1", 4),
        ("clock", 4),
    ], "every device synchronised after the 2 warm-up forwards and after the last one, each time before the clock"


class StopAtTheCollective(Exception):
    pass


def test_ddp_hands_the_collective_a_tensor_on_the_process_device(monkeypatch):
    # NCCL reduces CUDA tensors only, so a tensor left on the CPU stops a GPU run at its first collective. Without
    # a GPU, the "meta" device stands in for the process's GPU, and the collective records where its tensor is.
    lab = load_lab(LAB, NEEDS)
    devices = []

    def all_reduce(tensor, *args, **kwargs):
        devices.append(tensor.device)
        raise StopAtTheCollective  # a meta tensor holds no value to go on with

    monkeypatch.setattr(lab.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(lab, "DDP", lambda model, device_ids: model)  # no process group needed
    monkeypatch.setattr(
        lab,
        "time_training_steps",
        lambda *args, **kwargs: {"seconds": 1.0, "samples": 8, "steps": 1, "peak_memory_mib": 1.0},
    )
    env = DistEnv(rank=0, local_rank=0, world_size=1, backend="nccl", device=torch.device("meta"))
    X, y = torch.randn(8, *LeNet.input_shape), torch.zeros(8, dtype=torch.long)
    with pytest.raises(StopAtTheCollective):
        lab.measure_ddp(LeNet, X, y, lab.parse_args(QUICK), env)
    assert devices == [torch.device("meta")]


def test_two_processes_measure_ddp_and_say_why_dataparallel_did_not_run(tmp_path):
    run = torchrun(lab_path(LAB), *QUICK, "--results-dir", tmp_path, nproc=2, timeout=180)
    assert run.returncode == 0, run.output
    results = json.loads((tmp_path / "results.json").read_text())
    ddp = results["results"][0]
    assert ddp["mode"] == "DDP" and ddp["processes"] == 2 and len(ddp["devices"]) == 2
    assert ddp["samples_per_second"] > 0 and len(ddp["peak_memory_mib"]) == 2
    assert all(mib > 0 for mib in ddp["peak_memory_mib"])
    assert results["global_batch_size"] == 16
    table = (tmp_path / "results.md").read_text()
    assert "| DDP | 2 |" in table
    assert (tmp_path / "results.png").read_bytes()[:4] == b"\x89PNG"
    if torch.cuda.device_count() >= 2:
        assert [r["mode"] for r in results["results"]] == ["DDP", "DataParallel"]
    else:  # no DataParallel figures at all, and the reason, on screen and in the files
        assert [r["mode"] for r in results["results"]] == ["DDP"]
        assert "DataParallel skipped: it needs 2 or more CUDA devices" in run.stdout
        assert "needs 2 or more CUDA devices" in results["dataparallel_skipped"]
        assert "DataParallel skipped" in table


def test_plain_python_is_a_world_of_one(tmp_path):
    run = run_command([PYTHON, lab_path(LAB), *QUICK, "--results-dir", tmp_path], timeout=120)
    assert run.returncode == 0, run.output
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["results"][0]["processes"] == 1
    assert "DataParallel skipped" in run.stdout


def test_bad_input_stops_with_a_message_and_no_traceback(tmp_path):
    run = run_command([PYTHON, lab_path(LAB), "--steps", "0", "--results-dir", tmp_path], timeout=120)
    assert run.returncode != 0
    assert "must be at least 1" in run.stderr and "Traceback" not in run.output
