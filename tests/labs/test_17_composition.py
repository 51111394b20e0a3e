"""Lab 17: the order in which a mesh of pipeline x data x context x tensor ranks is applied to the GPT, and the
planner's formula for the parameters the fullest rank holds on such a mesh.

Runs against solutions/17_composition.py; with LAB_TARGET=labs, against your labs/17_composition.py:

    LAB_TARGET=labs .venv/bin/python -m pytest tests/labs/test_17_composition.py

First, in this one process: a mesh whose degrees do not multiply to the processes, or do not divide the model,
stops your script at once with a message. Then a spawn of 4 ranks: the script's own ``train`` with your
``parallelize`` on 2 pipeline stages x 2 tensor ranks (and, slow drills, on 2 data x 2 tensor ranks and on 2
context x 2 tensor ranks) against the 1-D FSDP control, in float64 with SGD: the losses per step and the final
parameters to 1e-12 (tests/test_parallelize.py says why these settings; it runs every mesh). The same runs measure
the parameters each rank holds after your ``parallelize`` (the local shards, the largest over the ranks): your
``sharded_parameters`` must predict them to 3% (tensor parallelism keeps the norms and row-wise biases whole, where
the planner divides them by tp). Before that, in this process, your ``device_parameters`` and
``sharded_parameters`` against hand-made meshes.
"""

import pytest
import torch

from common.distributed import ConfigurationError, DistEnv
from common.launch import run_on_ranks
from common.parallelize import differences
from common.planner import Config, Model, gpt_model
from tests.labs import load_lab
from tests.test_parallelize import FLOAT64, FLOAT64_TOLERANCE, MESHES_OF_4, SMALL

LAB = "17_composition"
# What these tests call in the script: common.parallelize's parallelize(gpt, mesh) and common.planner's
# device_parameters(model, config) and sharded_parameters(model, config) as the lab defines them, with the same
# signatures; parse_args(argv) and train(args, env), the script's own run (it returns "held parameters": the largest
# rank's, measured, and your sharded_parameters' prediction).
NEEDS = ("parallelize", "device_parameters", "sharded_parameters", "parse_args", "train")
HELD_TOLERANCE = 0.03  # tp 4 on solution 17's default GPT: +2.1%, the norms and row-wise biases held whole


def lab_runs(env, mesh: str):
    lab = load_lab(LAB, NEEDS)
    runs = [lab.train(lab.parse_args([*m, *SMALL, *FLOAT64]), env) for m in (["--control"], MESHES_OF_4[mesh])]
    return runs if env.rank == 0 else []


# One mesh in make test (12 s on 2 cores); the others, and every mesh with the solution, in make test-slow.
@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "mesh", ["pp2-tp2", *(pytest.param(m, marks=pytest.mark.slow) for m in ("dp2-tp2", "cp2-tp2"))]
)
def test_your_order_trains_the_same_model_as_fsdp_on_4_processes(mesh):
    (runs, *_) = run_on_ranks(lab_runs, 4, mesh, timeout=80)
    control, tested = runs
    assert control["losses"][-1] < control["losses"][0]
    found = differences(control, tested)
    assert found["loss"] <= FLOAT64_TOLERANCE["loss"], (mesh, found)
    assert found["parameter"] <= FLOAT64_TOLERANCE["parameter"], (mesh, found)
    for run in runs:  # the parameters your parallelize left on the fullest rank, against your formula
        held, predicted = run["held parameters"]
        assert held == pytest.approx(predicted, rel=HELD_TOLERANCE), (mesh, held, predicted)
    assert control["held parameters"][0] == control["held parameters"][1]  # 1-D FSDP over 4: exact


# A model small enough to count by hand: no biases, width 8, an MLP 32 wide, a vocabulary of 32.
TINY = Model("tiny", layers=4, hidden=8, heads=2, vocab=32, seq=8)
BLOCK, EMBEDDING, HEAD = TINY.layer_parameters(), TINY.embedding_parameters(), TINY.head_parameters()


def test_your_formula_cuts_the_model_by_pipeline_stage_then_tensor_ranks():
    lab = load_lab(LAB, NEEDS)
    assert BLOCK == 4 * 64 + 2 * 8 * 32 + 2 * 8 and EMBEDDING == 32 * 8 and HEAD == 8 + 8 * 32  # by hand
    assert lab.device_parameters(TINY, Config()) == 4 * BLOCK + EMBEDDING + HEAD  # one device: everything
    assert lab.device_parameters(TINY, Config(tp=2)) == (4 * BLOCK + EMBEDDING + HEAD) / 2
    # 2 stages: 2 blocks each, the first with the embedding, the last with the norm and the head (the larger)
    assert lab.device_parameters(TINY, Config(pp=2)) == 2 * BLOCK + max(EMBEDDING, HEAD)
    assert lab.device_parameters(TINY, Config(pp=2, tp=2)) == (2 * BLOCK + HEAD) / 2
    # 4 stages: one block each, so an end stage is the fullest
    assert lab.device_parameters(TINY, Config(pp=4)) == BLOCK + HEAD
    # Llama 3's layout: 6 blocks on 4 stages are 1, 2, 2, 1: the middle stages hold 2 blocks, the ends 1 and more
    six = Model("six", layers=6, hidden=8, heads=2, vocab=2, seq=8)
    assert lab.device_parameters(six, Config(pp=4)) == 2 * six.layer_parameters()


def test_your_formula_lets_fsdp_shard_over_the_data_ranks_of_one_replica():
    lab = load_lab(LAB, NEEDS)
    whole = 4 * BLOCK + EMBEDDING + HEAD
    assert lab.sharded_parameters(TINY, Config(dp=4, zero=3)) == whole / 4
    assert lab.sharded_parameters(TINY, Config(dp=4, zero=0)) == whole  # ZeRO 0-2 keep the parameters whole
    assert lab.sharded_parameters(TINY, Config(dp=4, zero=3, replicas=2)) == whole / 2  # HSDP: 2 shards each
    assert lab.sharded_parameters(TINY, Config(dp=2, cp=2, zero=3)) == whole / 4  # FSDP spans dp x cp
    assert lab.sharded_parameters(TINY, Config(dp=2, tp=2, pp=2, zero=3)) == (2 * BLOCK + HEAD) / 4
    # solution 17's one-process GPT (--layers 2 --d-model 32): 43,904 parameters, as it prints
    assert lab.sharded_parameters(gpt_model(256, 64, 32, 4, 2), Config(dp=4, zero=3)) == 43_904 / 4


def test_the_script_refuses_a_mesh_that_does_not_fit_before_reading_any_text():
    lab = load_lab(LAB, NEEDS)
    env = DistEnv(rank=0, local_rank=0, world_size=4, backend="gloo", device=torch.device("cpu"))
    with pytest.raises(ConfigurationError, match="needs 3 processes, but 4 were started"):
        lab.train(lab.parse_args(["--dp", "3", "--text", "no/such/file.txt"]), env)
    with pytest.raises(ConfigurationError, match="context 30 does not fit degree 4"):
        lab.train(lab.parse_args(["--tp", "4", "--context", "30", "--text", "no/such/file.txt"]), env)
