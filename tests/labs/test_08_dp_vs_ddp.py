"""Lab 08: DataParallel against DDP: the timing loop, and the comparison run for real.

Runs against solutions/08_dp_vs_ddp.py; with LAB_TARGET=labs, against your labs/08_dp_vs_ddp.py:

    LAB_TARGET=labs .venv/bin/python -m pytest tests/labs/test_08_dp_vs_ddp.py
"""

import json
import time

import pytest
import torch
from torch import nn

from tests.conftest import PYTHON, lab_path, load_script, run_command, torchrun

LAB = "08_dp_vs_ddp"
QUICK = ["--model", "lenet", "--batch-size", "8", "--steps", "3", "--warmup-steps", "1"]


class SlowFirstCalls(nn.Module):
    """A linear model whose first ``slow_calls`` forwards sleep, to tell warm-up from timed steps."""

    def __init__(self, slow_calls: int, pause: float):
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.slow_calls, self.pause, self.calls = slow_calls, pause, 0

    def forward(self, X):
        self.calls += 1
        if self.calls <= self.slow_calls:
            time.sleep(self.pause)
        return self.linear(X)


def batches(count, size=5):
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(size, 4, generator=generator), torch.randint(0, 3, (size,), generator=generator))
            for _ in range(count)]


def test_measure_trains_on_every_batch_and_times_only_the_steps_after_the_warm_up():
    lab = load_script(lab_path(LAB))
    model = SlowFirstCalls(slow_calls=2, pause=0.4)
    before = [p.detach().clone() for p in model.parameters()]
    result = lab.measure(model, batches(5), torch.device("cpu"), warmup_steps=2)
    assert model.calls == 5
    assert (result["steps"], result["samples"]) == (3, 15)
    assert 0 < result["seconds"] < 0.4, "the warm-up steps (0.4 s each) must not be on the clock"
    assert result["peak_memory_mib"] > 0
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters())), "it must train"


def test_measure_with_no_step_left_to_time_says_so():
    lab = load_script(lab_path(LAB))
    with pytest.raises(ValueError, match="no step to time"):
        lab.measure(nn.Linear(4, 3), batches(2), torch.device("cpu"), warmup_steps=2)


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
    run = run_command([PYTHON, lab_path(LAB), "--steps", "0", "--results-dir", tmp_path], timeout=60)
    assert run.returncode != 0
    assert "must be at least 1" in run.stderr and "Traceback" not in run.output
