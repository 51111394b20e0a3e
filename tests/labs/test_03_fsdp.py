"""Lab 03: shard a model with FSDP2 and checkpoint it in shards with DCP.

Runs against solutions/03_fsdp.py; with LAB_TARGET=labs, against your labs/03_fsdp.py:

    LAB_TARGET=labs .venv/bin/python -m pytest tests/labs/test_03_fsdp.py
"""

import json

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.tensor import DTensor

from common.distributed import set_seed
from common.fsdp import full_parameters, full_tensor
from common.launch import run_on_ranks
from common.memory import local_bytes
from common.models import DeepMLP
from tests.conftest import PYTHON, lab_path, run_command, torchrun
from tests.labs import load_lab

LAB = "03_fsdp"
# What these tests call in the script: shard_model(model, env, sharding, precision) -> the model to train;
# save_sharded_checkpoint(path, net, optimizer, epoch, step) and load_sharded_checkpoint(path, net, optimizer)
# -> {"epoch", "step"}; parse_args(argv) and train(args, env), in a process group of the tests' own.
NEEDS = ("shard_model", "save_sharded_checkpoint", "load_sharded_checkpoint", "parse_args", "train")
WIDTH, DEPTH, STEPS, LR = 37, 2, 3, 0.01


def build(lab, env, sharding, precision="fp32"):
    set_seed(0)
    net = lab.shard_model(DeepMLP(width=WIDTH, depth=DEPTH), env, sharding, precision)
    return net, torch.optim.Adam(net.parameters(), lr=LR)


def train(net, optimizer, env):
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        X, y = torch.randn(8, 1, 28, 28, generator=generator), torch.randint(0, 10, (8,), generator=generator)
        optimizer.zero_grad()
        F.cross_entropy(net(X[env.rank :: env.world_size]), y[env.rank :: env.world_size]).backward()
        optimizer.step()


def shard_train_and_checkpoint(env, checkpoint_dir):
    lab = load_lab(LAB, NEEDS)
    results, X = {}, torch.randn(4, 1, 28, 28)
    for sharding in ("none", "full", "grad-op"):
        net, optimizer = build(lab, env, sharding)
        if sharding != "none":
            results[f"{sharding}_dtensors"] = all(isinstance(p, DTensor) for p in net.parameters())
            loss = net(X).sum()  # between forward and backward: what does this rank hold of the parameters?
            for part, modules in (("blocks", net.blocks), ("root", (net.stem, net.head))):
                parameters = [p for module in modules for p in module.parameters()]
                results[f"{sharding}_{part}_whole_bytes"] = sum(p.numel() * p.element_size() for p in parameters)
                results[f"{sharding}_{part}_after_forward"] = local_bytes(parameters)
            loss.backward()
        train(net, optimizer, env)
        results[sharding] = full_parameters(net)
    net, _ = build(lab, env, "full", "bf16")
    results["bf16_output"] = str(net(X).dtype)

    net, optimizer = build(lab, env, "full")
    train(net, optimizer, env)
    lab.save_sharded_checkpoint(checkpoint_dir / "epoch-0001", net, optimizer, 1, STEPS)
    results["saved"] = full_parameters(net) + [full_tensor(optimizer.state[p]["exp_avg"]) for p in net.parameters()]
    fresh, fresh_optimizer = build(lab, env, "full")
    results["progress"] = lab.load_sharded_checkpoint(checkpoint_dir / "epoch-0001", fresh, fresh_optimizer)
    results["loaded"] = full_parameters(fresh) + [
        full_tensor(fresh_optimizer.state[p]["exp_avg"]) for p in fresh.parameters()
    ]

    # The script's own training, in this process group: 2 epochs straight, and 1 epoch then a run that resumes
    for model, quick in (("mlp", []), ("simplecnn", ["--batch-size", "16", "--max-batches-per-epoch", "2"])):
        for name, epochs, resume in (("straight", 2, []), ("stopped", 1, []), ("stopped", 2, ["--resume"])):
            lab.train(
                lab.parse_args(
                    [
                        "--dataset",
                        "digits",
                        "--model",
                        model,
                        "--epochs",
                        str(epochs),
                        *quick,
                        "--checkpoint-dir",
                        str(checkpoint_dir / model / name),
                        *resume,
                    ]
                ),
                env,
            )
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    checkpoint_dir = tmp_path_factory.mktemp("lab03")
    return checkpoint_dir, run_on_ranks(shard_train_and_checkpoint, 2, checkpoint_dir, timeout=240)


def checkpoint_contents(folder, tmp_path) -> dict:
    """Everything a sharded checkpoint holds (model, Adam's states, progress), whole: no process group needed."""
    whole = tmp_path / f"{folder.parent.parent.name}-{folder.parent.name}-{folder.name}.pt"
    dcp_to_torch_save(folder, whole)

    def flatten(tree, prefix=""):
        for key, value in tree.items():
            yield from flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else [(f"{prefix}{key}", value)]

    return dict(flatten(torch.load(whole, weights_only=True)))


def differing(first: dict, second: dict) -> list[str]:
    assert first.keys() == second.keys()
    return [
        key
        for key in first
        if not (torch.equal(first[key], second[key]) if torch.is_tensor(first[key]) else first[key] == second[key])
    ]


def test_every_parameter_becomes_a_dtensor_shard_and_training_equals_ddp(two_ranks):
    for rank in two_ranks[1]:
        assert rank["full_dtensors"] and rank["grad-op_dtensors"]
        torch.testing.assert_close(rank["full"], rank["none"])
        torch.testing.assert_close(rank["grad-op"], rank["none"])


def test_full_reshards_after_forward_and_grad_op_keeps_the_gathered_blocks(two_ranks):
    for rank in two_ranks[1]:
        whole = rank["full_blocks_whole_bytes"]
        assert rank["full_blocks_after_forward"] <= 0.55 * whole  # only this rank's half of each block is held
        assert rank["grad-op_blocks_after_forward"] == whole  # every block still gathered, waiting for backward
        for sharding in ("full", "grad-op"):  # the root (stem, head) keeps FSDP2's default: gathered for backward
            assert rank[f"{sharding}_root_after_forward"] == rank[f"{sharding}_root_whole_bytes"]


def test_bf16_precision_computes_in_bf16(two_ranks):
    assert all(rank["bf16_output"] == "torch.bfloat16" for rank in two_ranks[1])


def test_the_sharded_checkpoint_holds_one_file_per_rank_and_loads_back(two_ranks):
    checkpoint_dir, ranks = two_ranks
    folder = checkpoint_dir / "epoch-0001"
    assert (folder / ".metadata").exists() and len(list(folder.glob("*.distcp"))) == 2
    assert not list(checkpoint_dir.glob("*.partial"))
    for rank in ranks:
        assert rank["progress"] == {"epoch": 1, "step": STEPS}
        for loaded, saved in zip(rank["loaded"], rank["saved"]):
            assert torch.equal(loaded, saved)


def test_resuming_at_the_same_world_size_continues_bit_identically(two_ranks, tmp_path):
    folder = two_ranks[0] / "mlp"  # DeepMLP has no dropout and no BatchNorm
    straight, resumed = (
        checkpoint_contents(folder / name / "epoch-0002", tmp_path) for name in ("straight", "stopped")
    )
    assert straight["progress.step"] == 24 and len(straight) > 40  # 12 steps an epoch; model, Adam, progress
    assert differing(straight, resumed) == []  # every parameter, Adam state and step counter, to the bit
    assert differing(straight, checkpoint_contents(folder / "straight" / "epoch-0001", tmp_path))  # it did train


def test_resuming_simplecnn_differs_since_the_checkpoint_holds_no_rng_state(two_ranks, tmp_path):
    folder = two_ranks[0] / "simplecnn"
    first, second = (
        {name: checkpoint_contents(folder / name / f"epoch-000{epoch}", tmp_path) for name in ("straight", "stopped")}
        for epoch in (1, 2)
    )
    assert differing(first["straight"], first["stopped"]) == []  # the same until the checkpoint
    # after it, the resumed run's dropout masks come from a freshly seeded RNG: every weight moves differently
    changed = differing(second["straight"], second["stopped"])
    assert {"model.features.0.weight", "model.classifier.1.weight", "model.classifier.4.weight"} <= set(changed)


def test_the_script_saves_on_two_ranks_and_resumes_on_one(tmp_path, two_ranks):
    checkpoints, first, second = tmp_path / "checkpoints", tmp_path / "first.json", tmp_path / "second.json"
    run = torchrun(
        lab_path(LAB),
        "--dataset",
        "digits",
        "--epochs",
        "1",
        "--checkpoint-dir",
        checkpoints,
        "--metrics-file",
        first,
        nproc=2,
        timeout=180,
    )
    assert run.returncode == 0, run.output
    metrics = json.loads(first.read_text())
    assert metrics["parameters_in_sync"] is True and metrics["world_size"] == 2
    for rank in metrics["memory_per_rank"]:  # each rank holds about half of each kind of model state
        for kind in ("parameters", "gradients", "optimizer"):
            assert rank[kind] <= 1.05 * metrics["predicted_bytes_per_rank"][kind]
    assert len(list((checkpoints / "epoch-0001").glob("*.distcp"))) == 2

    run = run_command(
        [
            PYTHON,
            lab_path(LAB),
            "--dataset",
            "digits",
            "--epochs",
            "2",
            "--checkpoint-dir",
            checkpoints,
            "--resume",
            "--metrics-file",
            second,
        ],
        timeout=180,
        env_extra={"OMP_NUM_THREADS": "1"},
    )  # as torchrun sets it: 2 cores shared with other tests
    assert run.returncode == 0, run.output
    assert "resumed from" in run.stdout
    metrics = json.loads(second.read_text())
    assert metrics["epochs_run"] == [2] and metrics["world_size"] == 1
    assert metrics["final_test_accuracy"] >= 0.7
    plain = DeepMLP()  # the exported whole model needs no torch.distributed to load
    plain.load_state_dict(torch.load(checkpoints / "model_full.pt", weights_only=True))

    # The first epoch is the 2-process run's, to the bit; the continuation on 1 process is another run
    straight = two_ranks[0] / "mlp" / "straight"
    assert (
        differing(
            checkpoint_contents(checkpoints / "epoch-0001", tmp_path),
            checkpoint_contents(straight / "epoch-0001", tmp_path),
        )
        == []
    )
    resumed = checkpoint_contents(checkpoints / "epoch-0002", tmp_path)
    assert resumed["progress.step"] == 12 + 23  # 64 samples a step on 1 process, not 128: 23 steps, not 12
    assert set(differing(resumed, checkpoint_contents(straight / "epoch-0002", tmp_path))) >= {
        f"model.{name}" for name, _ in DeepMLP().named_parameters()
    }


def test_bf16_with_ddp_stops_with_a_message():
    run = run_command(
        [PYTHON, lab_path(LAB), "--dataset", "digits", "--sharding", "none", "--precision", "bf16"], timeout=60
    )
    assert run.returncode != 0
    assert "MixedPrecisionPolicy" in run.stderr and "Traceback" not in run.output
