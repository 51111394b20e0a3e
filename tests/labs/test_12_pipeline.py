"""Lab 12: pipeline parallelism by hand: the GPipe schedule.

Runs against solutions/12_pipeline.py; with LAB_TARGET=labs, against your labs/12_pipeline.py:

    LAB_TARGET=labs .venv/bin/python -m pytest tests/labs/test_12_pipeline.py

The lab file is loaded inside each spawned process (by path), since a process can only run what it imports. One
spawn of 2 ranks runs your ``gpipe`` for three SGD steps and the script's own training for one short epoch; the
model, the batches and the one-process reference are tests/test_pipeline.py's.
"""

import pytest
import torch
import torch.nn.functional as F

from common.launch import run_on_ranks
from common.models import DeepMLP
from common.pipeline import Stage, deep_mlp_layers, stage_module
from tests.labs import load_lab
from tests.test_pipeline import BATCH, make_model, train_one_process, train_stage, whole_batch

LAB = "12_pipeline"
# What these tests call in the script: gpipe(stage, num_microbatches, inputs, targets) -> (loss, record), as
# common.pipeline's; parse_args(argv) and train(args, env), the script's own training run.
NEEDS = ("gpipe", "parse_args", "train")
WORLD_SIZE, MICROBATCHES = 2, 4


def lab_checks(env):
    lab = load_lab(LAB, NEEDS)
    out = train_stage(env, lab.gpipe, MICROBATCHES)
    args = lab.parse_args(
        ["--dataset", "digits", "--epochs", "1", "--max-batches-per-epoch", "3", "--num-workers", "0"]
    )
    out["history"] = lab.train(args, env)
    return out


def test_gpipe_on_a_single_stage_gives_the_whole_batch_gradients():
    """One stage is first and last: no messages and no process group, only the micro-batches and their sum."""
    gpipe = load_lab(LAB, NEEDS).gpipe
    model, reference = make_model(), make_model()
    stage = Stage(stage_module(deep_mlp_layers(model), 0, 1), 0, 1, DeepMLP.input_shape, BATCH)
    X, y = whole_batch(0)
    loss, record = gpipe(stage, MICROBATCHES, X, y)
    whole = F.cross_entropy(reference(X), y)
    whole.backward()
    torch.testing.assert_close(loss, whole.detach())
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad)
    assert record["peak_in_flight"] == MICROBATCHES


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(lab_checks, WORLD_SIZE, timeout=180)


@pytest.fixture(scope="module")
def one_process():
    return train_one_process()


@pytest.mark.timeout(240)
def test_gpipe_after_three_steps_equals_one_process_on_the_whole_batch(results, one_process):
    for rank, result in enumerate(results):
        expected = stage_module(one_process["layers"], rank, WORLD_SIZE).state_dict()
        assert result["parameters"].keys() == expected.keys()
        for name, tensor in expected.items():
            torch.testing.assert_close(result["parameters"][name], tensor, msg=f"rank {rank}, {name}")
    torch.testing.assert_close(torch.stack(results[-1]["losses"]), torch.stack(one_process["losses"]))


@pytest.mark.timeout(240)
def test_gpipe_runs_every_forward_then_every_backward_in_reverse_holding_every_microbatch(results):
    expected = [f"F{i}" for i in range(MICROBATCHES)] + [f"B{i}" for i in reversed(range(MICROBATCHES))]
    for result in results:
        for record in result["records"]:
            assert [f"{event['kind']}{event['microbatch']}" for event in record["events"]] == expected
            assert record["peak_in_flight"] == MICROBATCHES


@pytest.mark.timeout(240)
def test_the_script_trains_with_it_and_reports_the_first_steps_timeline(results):
    for result in results:
        (epoch,) = result["history"]
        assert epoch["micro-batches held"] == [MICROBATCHES] * WORLD_SIZE  # the script's default: GPipe, m = 4
        assert 0 < epoch["bubble"] < 1 and epoch["formula"] == pytest.approx(1 / 5)
        assert 0 < epoch["train loss"] < 10 and 0 <= epoch["test accuracy"] <= 1
    assert results[0]["history"] == results[1]["history"]  # every rank reports the same figures
