"""Lesson 07's machinery: verified checkpoints, RNG states, the rehearsal launcher and the launch files."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import yaml
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from common.debugging import collective_mistakes
from common.fault_tolerance import (
    AtomicErrorHandler,
    CorruptCheckpoint,
    list_checkpoints,
    newest_valid_checkpoint,
    prune_checkpoints,
    read_verified,
    rng_state,
    set_rng_state,
    step_checkpoint_file,
    write_verified,
)
from common.launch import run_on_ranks
from tests.conftest import PYTHON, REPO, TORCHRUN, run_command

REHEARSE = REPO / "scripts" / "rehearse_two_nodes.py"


def state(step):
    return {"model": {"w": torch.full((1000,), float(step))}, "step": step}


def test_a_verified_checkpoint_round_trips_and_a_flipped_byte_is_caught_by_the_digest(tmp_path):
    path = step_checkpoint_file(tmp_path, 3)
    write_verified(path, state(3))
    assert path.name == "step_00000003.pt" and torch.equal(read_verified(path)["model"]["w"], state(3)["model"]["w"])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the tensor's bytes
    path.write_bytes(bytes(data))
    torch.load(path, weights_only=True)  # torch.load alone does not notice: the reason for the digest
    with pytest.raises(CorruptCheckpoint, match="do not match its SHA-256"):
        read_verified(path)


def test_the_newest_valid_checkpoint_skips_truncated_and_unfinished_ones(tmp_path):
    for step in (10, 20, 30, 40):
        write_verified(step_checkpoint_file(tmp_path, step), state(step))
    newest, unfinished = step_checkpoint_file(tmp_path, 40), step_checkpoint_file(tmp_path, 30)
    newest.write_bytes(newest.read_bytes()[:100])  # truncated
    (tmp_path / f"{unfinished.name}.sha256").unlink()  # killed between the file and its digest
    skipped = []
    assert newest_valid_checkpoint(tmp_path, log=skipped.append) == step_checkpoint_file(tmp_path, 20)
    assert len(skipped) == 2 and "no digest" in skipped[1]
    assert newest_valid_checkpoint(tmp_path / "missing") is None


def test_pruning_keeps_the_newest_and_ignores_temporary_files(tmp_path):
    for step in (1, 2, 3):
        write_verified(step_checkpoint_file(tmp_path, step), state(step))
    (tmp_path / ".step_00000004.pt.abc.tmp").write_bytes(b"half")
    assert [path.name for path in list_checkpoints(tmp_path)] == [
        "step_00000003.pt",
        "step_00000002.pt",
        "step_00000001.pt",
    ]
    prune_checkpoints(tmp_path, keep=2)
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        ".step_00000004.pt.abc.tmp",
        "step_00000002.pt",
        "step_00000002.pt.sha256",
        "step_00000003.pt",
        "step_00000003.pt.sha256",
    ]


@pytest.mark.parametrize(
    "map_location",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.cuda,
                pytest.mark.skipif(
                    not torch.cuda.is_available(),
                    reason="needs a GPU: the scripts load checkpoints onto their device, RNG states included",
                ),
            ],
        ),
    ],
)
def test_rng_states_survive_a_weights_only_checkpoint(tmp_path, map_location):
    import random

    import numpy as np

    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    write_verified(tmp_path / "rng.pt", {"rng": [rng_state()]})
    expected = (torch.rand(3), np.random.rand(3), random.random())
    set_rng_state(read_verified(tmp_path / "rng.pt", map_location=map_location)["rng"][0])
    assert torch.equal(torch.rand(3), expected[0]) and (np.random.rand(3) == expected[1]).all()
    assert random.random() == expected[2]


class NotATensor:
    """An object of a class that ``torch.load(weights_only=True)`` has not been told to allow."""


def test_torch_load_refuses_arbitrary_objects_by_default_and_an_explicit_weights_only_resists_the_override(
    tmp_path, monkeypatch
):
    import pickle

    torch.save({"step": 3, "payload": NotATensor()}, tmp_path / "checkpoint.pt")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        torch.load(tmp_path / "checkpoint.pt")  # the default since PyTorch 2.6: weights_only=True
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        torch.load(tmp_path / "checkpoint.pt", weights_only=True)  # explicit: the variable cannot override it
    with pytest.warns(UserWarning, match="TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"):
        loaded = torch.load(tmp_path / "checkpoint.pt")  # the default is overridden: a full unpickler
    assert isinstance(loaded["payload"], NotATensor)


WRITER = """
import sys, torch
from common.fault_tolerance import step_checkpoint_file, write_verified
folder = sys.argv[1]
step = 0
print("started", flush=True)
while True:
    step += 1
    write_verified(step_checkpoint_file(folder, step), {"w": torch.full((4_000_000,), float(step)), "step": step})
"""


@pytest.mark.parametrize("delay", [0.7, 1.3])
def test_a_process_killed_while_saving_never_leaves_a_half_written_checkpoint(tmp_path, delay):
    writer = subprocess.Popen([PYTHON, "-c", WRITER, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "started"
        time.sleep(delay)  # 16 MB per checkpoint: the kill lands in the middle of some write
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    for path in list_checkpoints(tmp_path):  # every file under a checkpoint's name is whole, or has no digest
        if (tmp_path / f"{path.name}.sha256").exists():
            assert read_verified(path)["step"] == int(path.stem.split("_")[1])
    newest = newest_valid_checkpoint(tmp_path, log=lambda message: None)
    assert newest is not None, sorted(path.name for path in tmp_path.iterdir())
    assert torch.equal(read_verified(newest)["w"], torch.full((4_000_000,), float(read_verified(newest)["step"])))


ERROR_WRITER = """
from common.fault_tolerance import AtomicErrorHandler
handler = AtomicErrorHandler()
while True:
    try:
        raise RuntimeError("rank 0 lost its peer " + "x" * 20_000_000)
    except RuntimeError as error:
        handler.record_exception(error)  # about 40 MB of JSON: the message, and the traceback that repeats it
    print("written", flush=True)
"""


def test_torchruns_agent_cannot_read_an_empty_error_file_and_raises_instead(tmp_path):
    """The failure AtomicErrorHandler prevents: a worker killed by the agent's SIGTERM after opening its error file
    (which truncates it) and before writing leaves it empty, and the agent's ProcessFailure raises (PyTorch 2.14.1)
    instead of restarting the workers."""
    (tmp_path / "error.json").write_text("")
    with pytest.raises(json.JSONDecodeError):
        ProcessFailure(local_rank=0, pid=1, exitcode=-15, error_file=str(tmp_path / "error.json"))


def test_an_atomic_error_file_is_whole_even_when_its_writer_is_killed_mid_write(tmp_path):
    """With torch's own ErrorHandler in ERROR_WRITER instead, this failed in 2 of 3 runs (a partial file)."""
    error_file = tmp_path / "error.json"
    writer = subprocess.Popen(
        [PYTHON, "-c", ERROR_WRITER],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)},
    )
    try:
        assert writer.stdout.readline().strip() == "written"  # one whole file exists; the next writes are under way
        time.sleep(0.3)
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    # What torchrun's agent reads: the whole message, with the time it was written.
    failure = ProcessFailure(local_rank=0, pid=writer.pid, exitcode=-9, error_file=str(error_file))
    assert failure.message["message"].startswith("RuntimeError: rank 0 lost its peer xxx")
    assert failure.timestamp > 0 and "Traceback" in failure.message["extraInfo"]["py_callstack"]


def test_without_torchrun_the_atomic_handler_writes_no_file(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.chdir(tmp_path)
    try:
        raise ValueError("not under torchrun")
    except ValueError as error:
        AtomicErrorHandler().record_exception(error)  # torch's handler logs it instead
    assert list(tmp_path.iterdir()) == []


def held_port():
    """A listening socket on a free port, as another program holding the rendezvous port would be."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock, sock.getsockname()[1]


def test_the_rehearsal_refuses_a_rendezvous_port_in_use_at_once():
    sock, port = held_port()
    with sock:
        run = run_command([PYTHON, REHEARSE, "--port", port, "--", "solutions/05_multi_node.py"], timeout=30)
    assert run.returncode == 2 and f"rendezvous port 127.0.0.1:{port} is already in use" in run.stderr
    assert "Do not kill processes you did not start" in run.stderr


def test_torchrun_hosting_the_store_on_a_port_in_use_fails_fast_with_address_already_in_use():
    # Without is_host=1 the same torchrun connects to whatever listens there and waits: a hang (lesson 07).
    sock, port = held_port()
    with sock:
        run = run_command(
            [
                TORCHRUN,
                "--nnodes",
                "1",
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "busy",
                "--rdzv-conf",
                "is_host=1",
                REPO / "solutions/05_multi_node.py",
            ],
            timeout=60,
        )
    assert run.returncode != 0 and run.seconds < 45
    assert "address already in use" in run.output and "EADDRINUSE" in run.output


# torchrun itself (its entry point), with its c10d rendezvous steps logged: the test sees when a node has joined.
TORCHRUN_LOGGING_RENDEZVOUS = (
    "import logging, sys; from torch.distributed.run import main; logging.basicConfig(); "
    "logging.getLogger('torch.distributed.elastic.rendezvous.dynamic_rendezvous').setLevel(logging.DEBUG); "
    "sys.exit(main())"
)


def node_printing_its_group_rank(port, local_addr, *options):
    return [
        PYTHON,
        "-c",
        TORCHRUN_LOGGING_RENDEZVOUS,
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "order",
        "--local-addr",
        local_addr,
        *options,
        "--no-python",
        "printenv",
        "GROUP_RANK",
    ]


def printed_group_ranks(output):
    return [line for line in output.splitlines() if line.strip().isdigit()]


def test_c10d_numbers_the_nodes_by_their_sorted_address_not_by_order_of_arrival(tmp_path):
    # Each node is (address, launcher PID, counter) and the ranks go to the sorted list: "127.0.0.1" < "localhost".
    sock, port = held_port()
    sock.close()
    log = tmp_path / "first.log"
    with log.open("w") as sink:
        first = subprocess.Popen(
            node_printing_its_group_rank(port, "localhost", "--rdzv-conf", "is_host=1"),
            cwd=REPO,
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        deadline = time.monotonic() + 90
        while "added itself to the participants" not in log.read_text() and time.monotonic() < deadline:
            assert first.poll() is None, log.read_text()
            time.sleep(0.2)
        assert "added itself to the participants" in log.read_text(), "the first node never joined"
        second = run_command(node_printing_its_group_rank(port, "127.0.0.1"), timeout=90)
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0 and second.returncode == 0, log.read_text() + second.output
    # The first to arrive, and the host of the store, is node 1; the one that came later is node 0.
    assert printed_group_ranks(log.read_text()) == ["1"] and printed_group_ranks(second.output) == ["0"]


@pytest.fixture(scope="module")
def collective_mistakes_on_2_ranks():
    return run_on_ranks(collective_mistakes, 2, 3.0, timeout=90)  # collectives time out after 3 s


@pytest.mark.slow  # make test-slow: it waits out collective timeouts
def test_a_rank_that_skips_a_collective_is_a_timeout_that_only_detail_pins_on_the_missing_rank(
    collective_mistakes_on_2_ranks,
):
    waiting, skipping = collective_mistakes_on_2_ranks
    for case, message in (
        ("skipped", "Timed out waiting 3000ms for recv operation to complete"),
        ("skipped, DETAIL", "[Rank 0]: Ranks 1 failed to pass monitoredBarrier in 3000 ms"),
    ):
        assert waiting[case]["seconds"] >= 3.0 and skipping[case]["error"] is None  # rank 0 waited it out
        assert message in waiting[case]["error"], waiting[case]["error"]
    assert "Rank" not in waiting["skipped"]["error"]  # without DETAIL, nothing names the rank that is missing


@pytest.mark.slow  # make test-slow: it waits out collective timeouts
def test_under_detail_mismatched_collectives_fail_at_once_with_both_fingerprints(collective_mistakes_on_2_ranks):
    for rank, results in enumerate(collective_mistakes_on_2_ranks):
        result = results["mismatched shapes, DETAIL"]
        assert result["error"].startswith(
            f"Detected mismatch between collectives on ranks. Rank {rank} is running collective: CollectiveFingerPrint("
        ), result
        assert "Collectives differ in the following aspects:   Tensor Tensor shapes:" in result["error"]
        assert result["seconds"] < 3.0  # reported before the timeout, not after it


def test_the_kubeflow_pytorchjob_is_elastic_and_runs_the_lesson_script():
    job = yaml.safe_load((REPO / "launch" / "pytorchjob_multi_node.yaml").read_text())
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    elastic = job["spec"]["elasticPolicy"]
    assert elastic["rdzvBackend"] == "c10d" and 1 <= elastic["minReplicas"] <= elastic["maxReplicas"]
    assert elastic["maxRestarts"] >= 1
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert elastic["minReplicas"] <= worker["replicas"] <= elastic["maxReplicas"]
    container = worker["template"]["spec"]["containers"][0]
    assert container["name"] == "pytorch"  # the operator injects its PET_* variables into this container
    assert container["command"][0] == "torchrun" and "solutions/05_multi_node.py" in container["command"]
    assert {"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"} in container["env"]
    assert (REPO / container["command"][container["command"].index("solutions/05_multi_node.py")]).exists()


def test_the_slurm_script_parses_and_launches_torchrun_with_c10d_on_the_first_node():
    script = REPO / "launch" / "slurm_multi_node.sbatch"
    run = run_command(["bash", "-n", script], timeout=30)
    assert run.returncode == 0, run.output
    text = script.read_text()
    for needed in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "srun",
        "torchrun",
        "--rdzv-backend c10d",
        "--rdzv-id",
        "is_host=",
        "scontrol show hostnames",
        "solutions/05_multi_node.py",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
    ):
        assert needed in text, needed
    assert "--master-addr" not in text and "torch.distributed.launch" not in text


def test_the_environment_contract_lists_what_the_launchers_set():
    text = (REPO / "launch" / "ENVIRONMENT.md").read_text()
    for name in (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "TORCHELASTIC_RESTART_COUNT",
        "NCCL_SOCKET_IFNAME",
        "TORCH_DISTRIBUTED_DEBUG",
        "NCCL_DEBUG",
    ):
        assert f"`{name}" in text, name


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
