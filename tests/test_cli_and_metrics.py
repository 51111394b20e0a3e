import argparse

import pytest
import torch

from common.cli import non_negative_int, positive_float, positive_int
from common.distributed import DistEnv
from common.metrics import run_summary


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
