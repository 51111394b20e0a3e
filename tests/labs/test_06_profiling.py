"""Lab 06: profile DDP training: the profiler's schedule, the labelled regions, the breakdown of a trace.

Runs against solutions/06_profiling.py; with LAB_TARGET=labs, against your labs/06_profiling.py:

    LAB_TARGET=labs .venv/bin/python -m pytest tests/labs/test_06_profiling.py

One 2-process run of the script (DeepMLP, small buckets, TensorBoard on) serves most tests; two more runs compare a
loader that starves training with the fixed one. Each run goes through the command line, as a reader runs it.
"""

import json

import pytest
import torch

from common.ddp_by_hand import assign_buckets
from common.models import DeepMLP
from common.monitoring import read_scalars
from common.profiling import REGIONS, load_trace
from tests.conftest import PYTHON, lab_path, run_command, torchrun

LAB = "06_profiling"
BUCKET_CAP_MB = 1.0
QUICK = ("--dataset", "digits", "--epochs", "2", "--max-batches-per-epoch", "4", "--num-workers", "0")


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    folder = tmp_path_factory.mktemp("profiled")
    run = torchrun(
        lab_path(LAB),
        *QUICK,
        *("--model", "mlp", "--bucket-cap-mb", BUCKET_CAP_MB),
        *("--trace-dir", folder / "traces", "--tensorboard", folder / "runs"),
        *("--metrics-file", folder / "metrics.json"),
        nproc=2,
        timeout=180,
    )
    assert run.returncode == 0, run.output
    return {"run": run, "folder": folder, "metrics": json.loads((folder / "metrics.json").read_text())}


@pytest.mark.timeout(240)
def test_every_rank_writes_a_trace_with_the_four_regions_and_gloos_all_reduces(profiled):
    for rank in (0, 1):
        trace = load_trace(profiled["folder"] / "traces" / f"rank{rank}.json")
        names = {event.get("name") for event in trace["traceEvents"]}
        assert set(REGIONS) <= names
        assert "gloo:all_reduce" in names, "gloo's own threads carry the all-reduces"
    assert "rank0.json" in profiled["run"].stdout and "https://ui.perfetto.dev" in profiled["run"].stdout


@pytest.mark.timeout(240)
def test_each_profiled_step_runs_one_all_reduce_per_bucket_that_the_bucket_arithmetic_predicts(profiled):
    predicted = len(assign_buckets(list(DeepMLP().parameters()), int(BUCKET_CAP_MB * 2**20)))
    assert predicted > 1, "the cap must cut the model into several buckets for this test to mean something"
    report = profiled["metrics"]["profile"]
    assert report["predicted_all_reduces"] == predicted
    assert [step["all_reduces"] for step in report["trace_steps"]] == [predicted] * 3  # --profile-steps 3


@pytest.mark.timeout(240)
def test_the_trace_breakdown_adds_up_to_the_step_time_the_wall_clock_measured(profiled):
    report = profiled["metrics"]["profile"]
    trace, clock = report["trace_breakdown"], report["timing"]
    parts = sum(trace[f"{name}_ms"] for name in REGIONS)
    assert 0 <= trace["other_ms"] <= 0.1 * trace["step_ms"], "the four regions cover the step"
    assert parts == pytest.approx(trace["step_ms"] - trace["other_ms"], rel=1e-6)
    # the profiled steps are 3 of the run's 8; the clock's mean covers the rest too: the same order of magnitude
    assert 0.5 < trace["step_ms"] / clock["step_ms"] < 2.0
    assert 0 < trace["exposed_communication_ms"] <= trace["communication_ms"]


@pytest.mark.timeout(240)
def test_tensorboard_holds_the_runs_scalars_and_the_replicas_stay_identical(profiled):
    scalars = read_scalars(profiled["folder"] / "runs")
    for tag in ("loss/train", "throughput/samples_per_s", "time_per_step_ms/data", "memory/peak_mib"):
        assert [step for step, _ in scalars[tag]] == [1, 2], tag
    assert all(value > 0 for _, value in scalars["throughput/samples_per_s"])
    assert profiled["metrics"]["replicas_in_sync"] is True
    monitor = profiled["metrics"]["profile"]["monitor"]
    assert monitor["kind"] == ("gpu" if torch.cuda.is_available() else "cpu") and monitor["samples"] >= 1


def loader_run(tmp_path, *loader_options):
    metrics = tmp_path / "metrics.json"
    run = torchrun(
        lab_path(LAB),
        *("--dataset", "digits", "--epochs", "1", "--max-batches-per-epoch", "6"),
        *("--decode-png", "--read-latency-ms", "2", "--data-dir", tmp_path / "data", "--trace-dir", tmp_path / "t"),
        *("--metrics-file", metrics, *loader_options),
        nproc=2,
        timeout=180,
    )
    assert run.returncode == 0, run.output
    return json.loads(metrics.read_text())["profile"]


@pytest.mark.slow  # two profiled runs, 15-23 s on 2 cores: make test-slow and CI run it
@pytest.mark.timeout(400)
def test_the_analysis_names_the_starving_loader_and_not_the_fixed_one(tmp_path):
    starving = loader_run(tmp_path, "--num-workers", "0")  # the docstring's commands, for 6 batches
    assert starving["timing_bottleneck"] == "data loading"
    assert starving["trace_bottleneck"] == "data loading"
    fixed = loader_run(tmp_path, "--num-workers", "6", "--prefetch-factor", "4")  # as the docstring
    assert fixed["timing_bottleneck"] != "data loading"
    assert fixed["timing"]["data_ms"] < starving["timing"]["data_ms"] / 3


@pytest.mark.parametrize(
    "options, message",
    [
        (("--profile-steps", "50"), "the profiler needs"),
        (("--trace-dir", "solutions/06_profiling.py"), "is a file"),
        pytest.param(("--read-latency-ms", "1"), "add --decode-png", marks=pytest.mark.slow),
        pytest.param(("--memory-snapshot", "x.pickle"), "needs a GPU", marks=pytest.mark.slow),
    ],
)
@pytest.mark.timeout(120)
def test_settings_that_cannot_work_fail_at_once_with_a_clear_message(options, message):
    if "--memory-snapshot" in options and torch.cuda.is_available():
        pytest.skip("a GPU is here: the snapshot can be recorded")
    run = run_command([PYTHON, lab_path(LAB), *QUICK, *options], timeout=100)
    assert run.returncode != 0 and message in run.output, run.output
