"""The GPT on an N-D mesh (common.parallelize, solutions/17_composition.py) trains the same model as 1-D FSDP.

torchtitan's "converging" check: the control is the solution with --control (FSDP2 over every process), the test
the same command on a mesh of pipeline x data x context x tensor ranks (the data ranks FSDP, or HSDP: replicas of
FSDP groups; FSDP over the data and context ranks together). Same text, seed, global batch and batch order; after
a few steps the losses per step and the final parameters, gathered whole, must agree:

- in float64 with plain SGD, to 1e-12 (rounding alone; measured: 2e-15). SGD, because AdamW divides by the
  gradients' own size and would hide gradients that are all too large by the same factor (summed over the ranks
  instead of averaged);
- in float32 with AdamW, the reader's default run, within ``FLOAT32_TOLERANCE``: the losses to 1e-5, the
  parameters to 1e-3, a third of one step. AdamW's first steps move every weight by about the learning rate
  (3e-3) whatever the size of its gradient, and where its running averages nearly cancel, rounding shows:
  measured after 3 steps, up to 4.8e-7 for the losses and 1.4e-4 for the parameters (cp2 x tp2).

Each ``run_on_ranks`` runs the control and the meshes one after the other in one process group (start-up is most
of the time on 2 cores). ``make test`` runs two 4-process cases: the lab's (tests/labs/test_17_composition.py: 2
stages x 2 tensor ranks in float64) and 2 context x 2 tensor ranks in float64, with the ring's messages counted
(10 s); one process checks that the other order, FSDP before tensor parallelism, is refused (6 s). Here every
mesh of 4 processes in float64 and in float32, and 8 processes (2 x 2 x 2, HSDP's 2 x 2 with 2 tensor ranks, and
three meshes with 2 context ranks) are slow drills: 20-45 s each on 2 shared cores.
"""

from dataclasses import asdict

import pytest
import torch

from common.collectives import count_messages
from common.context_parallel import ring_messages
from common.distributed import ConfigurationError, DistEnv
from common.gpt import GPT
from common.launch import load_script, run_on_ranks
from common.parallelize import apply_fsdp, apply_tensor_parallel, check_degrees, differences, pipeline_split
from tests.conftest import REPO

SOLUTION = REPO / "solutions" / "17_composition.py"
SMALL = ["--layers", "2", "--d-model", "32", "--heads", "4", "--context", "32", "--batch-size", "8", "--steps", "3"]
FLOAT64 = ["--dtype", "float64", "--optimizer", "sgd", "--lr", "0.5"]
FLOAT32 = ["--dtype", "float32", "--optimizer", "adamw"]
FLOAT32_TOLERANCE = {"loss": 1e-5, "parameter": 1e-3}
FLOAT64_TOLERANCE = {"loss": 1e-12, "parameter": 1e-12}
MESHES_OF_4 = {"dp2-tp2": ["--dp", "2", "--tp", "2"], "pp2-dp2": ["--pp", "2", "--dp", "2"]}
MESHES_OF_4 |= {"pp2-tp2": ["--pp", "2", "--tp", "2"], "hsdp2x2": ["--dp", "4", "--replicas", "2"]}
MESHES_OF_4 |= {"cp2-dp2": ["--cp", "2", "--dp", "2"], "cp2-tp2": ["--cp", "2", "--tp", "2"]}
MESHES_OF_4 |= {"pp2-cp2": ["--pp", "2", "--cp", "2"]}
MESHES_OF_8 = {"pp2-dp2-tp2": ["--pp", "2", "--dp", "2", "--tp", "2"], "hsdp2x2-tp2": ["--dp", "4", "--replicas", "2"]}
MESHES_OF_8["hsdp2x2-tp2"] += ["--tp", "2"]
CP_MESHES_OF_8 = {"dp2-cp2-tp2": ["--dp", "2", "--cp", "2", "--tp", "2"], "pp2-cp2-tp2": ["--pp", "2", "--cp", "2"]}
CP_MESHES_OF_8["pp2-cp2-tp2"] += ["--tp", "2"]
CP_MESHES_OF_8["hsdp2x2-cp2"] = ["--dp", "4", "--replicas", "2", "--cp", "2"]


def control_and_meshes(env, meshes: list[list[str]], precision: list[str], save: str | None = None) -> list[dict]:
    """The solution's ``train`` on the control (``--save save``, if given), then on each mesh; rank 0 returns the
    runs, the others nothing."""
    script = load_script(SOLUTION)
    control = ["--control", *(["--save", save] if save else [])]
    runs = [script.train(script.parse_args([*mesh, *SMALL, *precision]), env) for mesh in [control, *meshes]]
    return runs if env.rank == 0 else []


def assert_converging(runs: list[dict], names: list[str], tolerance: dict) -> None:
    control, *tested = runs
    assert control["losses"][-1] < control["losses"][0]  # it trains
    for name, run in zip(names, tested):
        found = differences(control, run)
        assert found["loss"] <= tolerance["loss"], (name, found)
        assert found["parameter"] <= tolerance["parameter"], (name, found)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", ["float64", "float32"])
def test_every_mesh_of_4_processes_trains_the_same_model_as_fsdp(precision, tmp_path):
    names, saved = list(MESHES_OF_4), tmp_path / "control.pt"
    options = FLOAT64 if precision == "float64" else FLOAT32
    meshes = [MESHES_OF_4[n] for n in names]
    (runs, *_) = run_on_ranks(control_and_meshes, 4, meshes, options, str(saved), timeout=280)
    assert_converging(runs, names, FLOAT64_TOLERANCE if precision == "float64" else FLOAT32_TOLERANCE)
    record = torch.load(saved, weights_only=True)  # --save: what rank 0 wrote is what the run ended with
    assert (
        record["mesh"] == {"pp": 1, "dp": 4, "replicas": 1, "cp": 1, "tp": 1} and record["losses"] == runs[0]["losses"]
    )
    assert differences(runs[0], record) == {"loss": 0.0, "parameter": 0.0}


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_2x2x2_meshes_and_hsdp_with_tensor_parallelism_train_the_same_model_as_fsdp_on_8_processes():
    (runs, *_) = run_on_ranks(control_and_meshes, 8, list(MESHES_OF_8.values()), FLOAT64, timeout=140)
    assert_converging(runs, list(MESHES_OF_8), FLOAT64_TOLERANCE)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_meshes_with_context_parallelism_train_the_same_model_as_fsdp_on_8_processes():
    (runs, *_) = run_on_ranks(control_and_meshes, 8, list(CP_MESHES_OF_8.values()), FLOAT64, timeout=190)
    assert_converging(runs, list(CP_MESHES_OF_8), FLOAT64_TOLERANCE)


def control_and_counted_mesh(env, mesh: list[str]) -> dict:
    """The control, then ``mesh``, in float64, each run inside ``count_messages``: every rank returns its two
    counts of point-to-point messages, rank 0 the runs too."""
    script = load_script(SOLUTION)
    found = {}
    for name, argv in (("control", ["--control"]), ("mesh", mesh)):
        with count_messages() as count:
            found[name] = script.train(script.parse_args([*argv, *SMALL, *FLOAT64]), env)
        found[f"{name} messages"] = asdict(count)
    return found if env.rank == 0 else {key: value for key, value in found.items() if "messages" in key}


# make test's case (4 processes, one spawn): cp2-tp2 in float64. The other meshes with cp are slow drills above.
@pytest.mark.timeout(90)
def test_context_parallelism_runs_the_ring_over_the_cp_ranks_and_trains_the_same_model_as_fsdp():
    ranks = run_on_ranks(control_and_counted_mesh, 4, MESHES_OF_4["cp2-tp2"], timeout=80)
    assert_converging([ranks[0]["control"], ranks[0]["mesh"]], ["cp2-tp2"], FLOAT64_TOLERANCE)
    held, predicted = ranks[0]["mesh"]["held parameters"]  # FSDP shards over dp x cp: 2 ranks, not 1
    assert held == pytest.approx(predicted, rel=0.03), (held, predicted)

    # The ring's messages, on every rank: per step and block one key/value block forward, one more and two
    # gradient blocks backward (ring_messages). Each holds this rank's 2 of 4 heads (tp 2) at 16 of the 32
    # positions (cp 2): whole attention, or a ring over all heads or positions, would not send these.
    def small(name):  # SMALL's value of --name
        return int(SMALL[SMALL.index(f"--{name}") + 1])

    layers, steps, batch, context, heads = (small(n) for n in ("layers", "steps", "batch-size", "context", "heads"))
    d_model = small("d-model")
    ring = ring_messages(batch, heads // 2, context, d_model // heads, world_size=2, element_size=8)
    sends = steps * layers * (ring["forward sends"] + ring["backward sends"])
    for rank in ranks:
        assert rank["control messages"]["sends"] == 0
        sent = rank["mesh messages"]
        assert (sent["sends"], sent["receives"], sent["grouped"]) == (sends, sends, 2 * sends)
        assert sent["bytes_sent"] == sends * ring["message bytes"] == sent["bytes_received"]


def fsdp_then_tensor_parallel(env) -> str:
    """The wrong order on one process: FSDP on a 1-rank data dim, then tensor parallelism on a 1-rank tp dim.
    Returns what tensor parallelism raised, or "" when it raised nothing."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    gpt = GPT(context=16, d_model=16, num_heads=4, num_layers=1, dropout=0.0)
    apply_fsdp(gpt, mesh["dp"])
    try:
        apply_tensor_parallel(gpt, mesh["tp"])
    except ValueError as error:
        return str(error)
    return ""


# Lesson 16, section 1: tensor parallelism after FSDP finds DTensors on the data mesh, and torch refuses them.
@pytest.mark.timeout(60)
def test_fsdp_before_tensor_parallelism_is_refused_by_distribute_tensor():
    (message,) = run_on_ranks(fsdp_then_tensor_parallel, 1, timeout=50)
    assert "Cannot distribute a DTensor with device mesh" in message, message
    assert "(dp=1)" in message and "(tp=1)" in message, message


def test_the_stages_of_a_pipeline_split_chained_compute_the_whole_gpt():
    def build():
        torch.manual_seed(0)
        return GPT(context=16, d_model=16, num_heads=4, num_layers=3, dropout=0.0)

    tokens = torch.randint(0, 256, (2, 16))
    X, firsts = tokens, []
    for stage in range(3):
        part, first = pipeline_split(build(), stage, 3)
        X, firsts = part(X), firsts + [first]
    assert firsts == [0, 1, 2]
    torch.testing.assert_close(X, build()(tokens), rtol=0, atol=0)


def env_of(world_size: int) -> DistEnv:
    return DistEnv(rank=0, local_rank=0, world_size=world_size, backend="gloo", device=torch.device("cpu"))


@pytest.mark.parametrize(
    "argv, world_size, message",
    [
        (["--dp", "3"], 4, "--pp 1 x --dp 3 x --cp 1 x --tp 1 needs 3 processes, but 4 were started"),
        (["--cp", "3"], 4, "--pp 1 x --dp 1 x --cp 3 x --tp 1 needs 3 processes, but 4 were started"),
        (["--cp", "2", "--context", "30"], 4, "context 30 does not fit degree 4: the zig-zag layout"),
        (["--cp", "2", "--tp", "4", "--context", "12"], 8, "context 12 does not fit degree 8: sequence parallelism"),
        (["--pp", "2", "--tp", "4"], 4, "needs 8 processes, but 4 were started"),
        (["--tp", "3", "--heads", "4"], 3, "num_heads 4 does not fit degree 3"),
        (["--pp", "3", "--layers", "2"], 3, "every pipeline stage needs a block"),
        (["--pp", "2", "--dp", "2", "--batch-size", "8", "--microbatches", "3"], 4, "do not split into 3 micro"),
        (["--dp", "4", "--replicas", "3"], 4, "--replicas 3 does not divide --dp 4"),
    ],
)
def test_a_mesh_that_does_not_fit_fails_at_once_with_a_message_that_says_why(argv, world_size, message):
    script = load_script(SOLUTION)
    args = script.parse_args([*argv, "--text", "no/such/file.txt"])  # refused before any text is read
    with pytest.raises(ConfigurationError, match=message):
        script.train(args, env_of(world_size))


def test_the_degrees_must_divide_the_shapes():
    check_degrees(2, 2, 2, 8, num_layers=2, num_heads=4, d_model=32, context=32, vocab_size=256, batch_size=8)
    with pytest.raises(ConfigurationError, match="context 30 does not fit degree 4"):
        check_degrees(1, 1, 4, 4, context=30)
    with pytest.raises(ConfigurationError, match="batch_size 6 does not fit degree 4"):
        check_degrees(1, 4, 1, 4, batch_size=6)
