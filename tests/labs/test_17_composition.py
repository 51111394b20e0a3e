"""Lab 17: the order in which a mesh of pipeline x data x context x tensor ranks is applied to the GPT.

Runs against solutions/17_composition.py; with LAB_TARGET=labs, against your labs/17_composition.py:

    LAB_TARGET=labs .venv/bin/python -m pytest tests/labs/test_17_composition.py

First, in this one process: a mesh whose degrees do not multiply to the processes, or do not divide the model,
stops your script at once with a message. Then a spawn of 4 ranks: the script's own ``train`` with your
``parallelize`` on 2 pipeline stages x 2 tensor ranks (and, slow drills, on 2 data x 2 tensor ranks and on 2
context x 2 tensor ranks) against the 1-D FSDP control, in float64 with SGD: the losses per step and the final
parameters to 1e-12 (tests/test_parallelize.py says why these settings; it runs every mesh).
"""

import pytest
import torch

from common.distributed import ConfigurationError, DistEnv
from common.launch import run_on_ranks
from common.parallelize import differences
from tests.labs import load_lab
from tests.test_parallelize import FLOAT64, FLOAT64_TOLERANCE, MESHES_OF_4, SMALL

LAB = "17_composition"
# What these tests call in the script: common.parallelize's parallelize(gpt, mesh) as the lab defines it, with the
# same signature; parse_args(argv) and train(args, env), the script's own run.
NEEDS = ("parallelize", "parse_args", "train")


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


def test_the_script_refuses_a_mesh_that_does_not_fit_before_reading_any_text():
    lab = load_lab(LAB, NEEDS)
    env = DistEnv(rank=0, local_rank=0, world_size=4, backend="gloo", device=torch.device("cpu"))
    with pytest.raises(ConfigurationError, match="needs 3 processes, but 4 were started"):
        lab.train(lab.parse_args(["--dp", "3", "--text", "no/such/file.txt"]), env)
    with pytest.raises(ConfigurationError, match="context 30 does not fit degree 4"):
        lab.train(lab.parse_args(["--tp", "4", "--context", "30", "--text", "no/such/file.txt"]), env)
