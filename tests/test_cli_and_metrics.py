import argparse
import json
import os
from pathlib import Path

import pytest
import torch

from common import metrics
from common.cli import non_negative_int, options_line, positive_float, positive_int
from common.distributed import DistEnv
from common.metrics import run_summary, write_json


def test_number_types_accept_good_values_and_explain_bad_ones():
    assert positive_int("3") == 3 and positive_float("0.5") == 0.5 and non_negative_int("0") == 0
    with pytest.raises(argparse.ArgumentTypeError, match="0 or more, got -2"):
        non_negative_int("-2")
    with pytest.raises(argparse.ArgumentTypeError, match="at least 1, got 0"):
        positive_int("0")
    with pytest.raises(argparse.ArgumentTypeError, match="above 0, got -1e-3"):
        positive_float("-1e-3")
    with pytest.raises(ValueError):
        positive_int("two")


ENV = DistEnv(rank=0, local_rank=0, world_size=2, backend="gloo", device=torch.device("cpu"))


def test_the_options_line_names_every_option_as_typed_on_the_command_line():
    args = argparse.Namespace(batch_size=32, text=None, backend="auto")
    assert options_line(args) == "--batch-size=32 --text=None --backend=auto"


def test_run_summary_reports_the_last_epoch_and_overall_throughput():
    history = [
        {"epoch": 1, "train_loss": 2.0, "test_loss": 1.5, "test_accuracy": 0.5, "seconds": 2.0, "samples": 100},
        {"epoch": 2, "train_loss": 1.0, "test_loss": 0.5, "test_accuracy": 0.9, "seconds": 3.0, "samples": 100},
    ]
    summary = run_summary(history, ENV, dataset="digits")
    assert summary["final_test_accuracy"] == 0.9 and summary["final_train_loss"] == 1.0
    assert summary["samples_per_second"] == pytest.approx(200 / 5.0)  # all samples over all seconds
    assert summary["epoch_times"] == [2.0, 3.0] and summary["epochs_run"] == [1, 2]
    assert (summary["world_size"], summary["backend"], summary["device"]) == (2, "gloo", "cpu")
    assert summary["dataset"] == "digits" and summary["history"] == history


def test_run_summary_of_a_run_with_nothing_left_to_train_has_no_final_figures():
    summary = run_summary([], ENV)
    assert summary["final_test_accuracy"] is None and summary["samples_per_second"] is None
    assert summary["epochs_run"] == []


def test_write_json_writes_indented_json_and_creates_the_folder(tmp_path):
    write_json(tmp_path / "runs" / "metrics.json", {"accuracy": 0.5, "epochs": [1, 2]})
    text = (tmp_path / "runs" / "metrics.json").read_text()
    assert json.loads(text) == {"accuracy": 0.5, "epochs": [1, 2]} and "\n  " in text


def test_only_global_rank_0_writes_json(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "is_main", lambda: False)
    write_json(tmp_path / "metrics.json", {"a": 1})
    assert list(tmp_path.iterdir()) == []


def test_the_machine_summary_names_the_cpu_the_cores_and_pytorch():
    from common.reports import machine_summary

    summary = machine_summary()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert summary.endswith(f"; PyTorch {torch.__version__}") and f", {cores} CPU cores" in summary
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():  # Linux, as this machine and CI: the model name the kernel reports
        lines = cpuinfo.read_text().splitlines()
        name = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
        assert summary.startswith(f"{name} ({torch.backends.cpu.get_cpu_capability()}")
        flags = next(line for line in lines if line.startswith("flags")).split()
        assert (", bf16)" in summary) == ("avx512_bf16" in flags or "amx_bf16" in flags)
