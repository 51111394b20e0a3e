"""Lab 16: the all-to-all as an autograd Function, and the dispatch of expert parallelism.

Runs against solutions/16_mixture_of_experts.py; with LAB_TARGET=labs, against your labs/16_mixture_of_experts.py:

    LAB_TARGET=labs .venv/bin/python -m pytest tests/labs/test_16_mixture_of_experts.py

One spawn of 2 ranks: your ``all_to_all`` there and back, against torch's; your ``ExpertParallelMoE`` (built on your
``exchange_counts``, ``expert_major_order`` and ``all_to_all``) against the one-process layer on both ranks' tokens,
uneven, with an expert no token chooses; and the script's own training for one short epoch. Then, in this process:
the script refuses bad options before it reads any text.
"""

import pytest
import torch

from common.distributed import ConfigurationError, DistEnv
from common.experiments.moe import expert_parallel_checks
from common.launch import run_on_ranks
from tests.labs import load_lab

LAB = "16_mixture_of_experts"
# What these tests call in the script: the functions and classes of common.moe that the lab defines, with the same
# signatures; parse_args(argv) and train(args, env), the script's own run.
NEEDS = ("AllToAll", "all_to_all", "exchange_counts", "expert_major_order", "ExpertParallelMoE", "parse_args", "train")
WORLD_SIZE = 2


def lab_checks(env):
    lab = load_lab(LAB, NEEDS)
    out = expert_parallel_checks(env, num_experts=4, top_k=2, layer=lab.ExpertParallelMoE, move=lab.all_to_all)
    args = lab.parse_args(
        ["--context", "16", "--d-model", "16", "--heads", "2", "--layers", "2", "--batch-size", "4"]
        + ["--epochs", "1", "--max-batches-per-epoch", "3", "--val-batches", "2", "--capacity-factor", "1.0"]
    )
    out["history"] = lab.train(args, env)
    return out


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(lab_checks, WORLD_SIZE, timeout=150)


@pytest.mark.timeout(200)
def test_your_all_to_all_brings_the_rows_back_and_equals_torchs_gradient_included(results):
    for rank, result in enumerate(results):
        assert result["round trip"], f"rank {rank}: the second all-to-all, splits swapped, must undo the first"
        assert result["torch's rows"], "the rows each rank receives must be torch.distributed.nn's"
        assert result["torch's gradient"], "backward must send each row's gradient back to the rank it came from"


@pytest.mark.timeout(200)
def test_your_expert_parallel_layer_equals_the_one_process_layer_forward_and_every_gradient(results):
    for rank, result in enumerate(results):
        assert result["tokens per expert"][-1] == 0  # an expert no token chooses runs on no rows
        assert result["output"] == 0 and result["input gradient"] == 0, rank
        assert max(result["experts"].values()) == 0, result["experts"]
        assert result["router"] < 1e-13
        # forward: the counts, the tokens out, the results back; backward: the two reversed. Nothing else.
        assert result["calls"] == ["all_to_all_single"] * 5
        assert result["bytes"] == result["formula"], "each all-to-all sends the rows it must, no more"


@pytest.mark.timeout(200)
def test_the_script_trains_with_it_and_keeps_every_copy_in_sync(results):
    for result in results:
        (epoch,) = result["history"]
        assert epoch["in sync"] is True
        assert 0 < epoch["validation loss"] < 6 and 0 < epoch["train loss"] < 6  # ln 256 = 5.55 at the start
        assert sum(epoch["tokens per expert"]) == pytest.approx(1.0) and 0 <= epoch["dropped"] < 1
    timings = ("all_to_all_single", "all_reduce", "step ms", "MiB off rank")  # each rank's own clock and rows
    same = [{key: value for key, value in result["history"][0].items() if key not in timings} for result in results]
    assert same[0] == same[1]  # every rank reports the same figures


@pytest.mark.parametrize(
    "options, message",
    [
        (["--experts", "3"], "--ep 2 must divide the 2 processes and the --experts 3"),
        (["--ep", "3"], "--ep 3 must divide the 2 processes"),
        (["--experts", "4", "--top-k", "5"], "--top-k 5: top-k must be between 1 and the 4 experts, not 5"),
    ],
)
def test_the_script_refuses_bad_options_before_reading_any_text(options, message):
    lab = load_lab(LAB, NEEDS)
    args = lab.parse_args([*options, "--text", "no/such/file.txt"])
    env = DistEnv(rank=0, local_rank=0, world_size=2, backend="gloo", device=torch.device("cpu"))
    with pytest.raises(ConfigurationError, match=message.replace("-", "\\-")):
        lab.train(args, env)
