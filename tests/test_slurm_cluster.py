"""Lesson 07's SLURM launch file under a real SLURM: ``scripts/slurm_cluster.py`` starts munged, a slurmctld and one
slurmd per emulated node, and submits ``launch/slurm_multi_node.sbatch`` with ``sbatch --wait``.

The first tests need nothing special: refusals and the generated configuration, in well under a second. The tests
marked ``slurm`` start the daemons, so they need root, network namespaces and Debian's ``slurm-wlm`` and ``munge``.
``make test-cluster`` installs the packages, checks the rest (one line and a failure where it cannot), and runs
them; ``make test`` and ``make test-slow`` leave them out, and a plain ``pytest`` skips them, with one reason,
where the daemons cannot run.
"""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from common.cluster import address, course_namespaces
from common.fault_tolerance import read_verified
from common.launch import load_script
from tests.conftest import PYTHON, REPO, run_command

SLURM_CLUSTER = REPO / "scripts" / "slurm_cluster.py"
SBATCH = REPO / "launch" / "slurm_multi_node.sbatch"
slurm_cluster = load_script(SLURM_CLUSTER)
# One thread per process in both runs compared: the sums inside a process then add in the same order.
SAME_THREADS = {"OMP_NUM_THREADS": "1"}
DAEMONS = ("munged", "slurmctld", "slurmd", "slurmstepd")


def test_without_a_batch_file_it_is_refused_at_once():
    run = run_command([PYTHON, SLURM_CLUSTER, "--nodes", "2"], timeout=30)
    assert run.returncode == 2 and "give the batch file after --" in run.stderr


def test_without_slurm_or_root_it_says_why_in_one_line_and_fails(tmp_path):
    # An empty PATH: no slurmctld, munged or sbatch, as on a machine without the packages.
    run = run_command([PYTHON, SLURM_CLUSTER, "--", SBATCH], timeout=30, env_extra={"PATH": str(tmp_path)})
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("error: munged, slurmctld, slurmd, sbatch")
    assert run.stderr.endswith("not found: install them as root with apt-get install slurm-wlm munge\n")


def test_not_root_it_says_so_in_one_line_and_fails(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # the check reads the user id; nothing of SLURM is replaced
    monkeypatch.setattr(slurm_cluster.shutil, "which", lambda program: f"/usr/bin/{program}")
    assert slurm_cluster.main(*slurm_cluster.parse_args(["--", str(SBATCH)])) == 2
    assert capsys.readouterr().err.startswith("error: the emulated cluster needs root to create network namespaces")


def test_the_configuration_names_each_node_at_its_address_with_this_machines_cpus(tmp_path):
    args, _ = slurm_cluster.parse_args(["--nodes", "3", "--", "job.sbatch"])
    conf = slurm_cluster.write_configuration(tmp_path, args).read_text()
    for node in range(3):
        assert f"NodeName=node{node} NodeAddr={address(node)} CPUs={os.cpu_count()} " in conf
    assert f"SlurmctldHost=node0({address(0)})" in conf
    # Processes and tasks need no cgroup of their own; the one slurmd still loads is told this machine's layout.
    assert "ProctrackType=proctrack/linuxproc" in conf and "TaskPlugin=task/none" in conf
    assert "CgroupPlugin=cgroup/v1" in (tmp_path / "cgroup.conf").read_text()
    assert (tmp_path / "hosts").read_text().splitlines()[1:] == [f"{address(k)} node{k}" for k in range(3)]
    assert (tmp_path / "munge.key").stat().st_mode & 0o777 == 0o400
    assert str(tmp_path) in conf and "/etc/" not in conf and "/var/" not in conf  # everything in the folder


@pytest.fixture(autouse=True)
def slurm_can_run(request):
    """Skip a test marked ``slurm``, with one reason, where the daemons cannot run (no slurm-wlm or munge, not root,
    no network namespaces). ``make test-cluster`` asks the same question first, and fails instead of skipping."""
    if request.node.get_closest_marker("slurm"):
        check = run_command([PYTHON, SLURM_CLUSTER, "--check"], timeout=60)
        if check.returncode != 0:
            pytest.skip(f"SLURM cluster tests skipped: {check.stderr.strip().removeprefix('error: ')}")


TEXT = dict(capture_output=True, text=True)


def running(program: str) -> bool:
    return subprocess.run(["pgrep", "-x", program], **TEXT).stdout != ""


def nothing_left() -> None:
    """No daemon, job step, namespace or folder of an emulated SLURM cluster remains. A job step killed with its
    node's namespace is gone once its parent, the machine's init, has reaped it: that may take a few seconds."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(running(daemon) for daemon in DAEMONS):
        time.sleep(0.5)
    for daemon in DAEMONS:
        assert not running(daemon), (daemon, subprocess.run(["ps", "-C", daemon, "-o", "pid,stat,args"], **TEXT).stdout)
    assert course_namespaces("slurm") == []
    assert list(Path("/tmp").glob("slurm-cluster-*")) == []


def on_slurm(tmp_path, *sbatch, nproc=1, env_extra=None, timeout=400):
    """The course's sbatch file run through ``scripts/slurm_cluster.py`` on 2 CPU nodes, its output in tmp_path."""
    options = ["--gpus-per-node=0", "--cpus-per-task=1", f"--output={tmp_path}/%x-%j.out"]
    env = {"NPROC_PER_NODE": str(nproc), **SAME_THREADS, **(env_extra or {})}
    return run_command([PYTHON, SLURM_CLUSTER, "--nodes", "2", "--", *options, *sbatch], timeout, env_extra=env)


def by_hand(*script, timeout=300):
    """The same world started by hand on the emulated cluster: one torchrun per node, ``scripts/cluster.py``."""
    line = [PYTHON, REPO / "scripts" / "cluster.py", "--nodes", "2", "--procs-per-node", "1", "--", *script]
    return run_command(line, timeout, env_extra=SAME_THREADS)


def without_times(metrics: dict) -> dict:
    """A metrics file without what the clock decides."""
    history = [{key: value for key, value in epoch.items() if key != "seconds"} for epoch in metrics["history"]]
    return {**metrics, "samples_per_second": None, "epoch_times": None, "history": history}


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_the_sbatch_file_runs_solution_01_on_two_nodes_as_the_same_run_started_by_hand(tmp_path):
    script = ["solutions/01_ddp_basic.py", "--dataset", "digits", "--epochs", "2"]
    run = on_slurm(tmp_path, SBATCH, *script, "--metrics-file", tmp_path / "slurm.json")
    assert run.returncode == 0, run.output
    assert "slurm: 2 idle node(s) (node0, node1)" in run.stdout
    assert "job JobState=COMPLETED Reason=None ExitCode=0:0" in run.stdout
    assert "model replicas identical on all 2 rank(s): True" in run.stdout  # the job's output, printed
    nothing_left()
    hand = by_hand(*script, "--metrics-file", tmp_path / "hand.json")
    assert hand.returncode == 0, hand.output
    slurm, started_by_hand = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("slurm", "hand"))
    assert slurm["world_size"] == 2 and slurm["epochs_run"] == [1, 2]
    assert without_times(slurm) == without_times(started_by_hand)  # losses and accuracies to the last bit


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_a_crash_under_slurm_restarts_every_worker_and_ends_as_the_uninterrupted_run_by_hand(tmp_path):
    script = ["solutions/05_multi_node.py", "--dataset", "digits", "--epochs", "2", "--batch-size", "32"]
    script += ["--checkpoint-every", "4"]
    run = on_slurm(
        tmp_path,
        SBATCH,
        *script,
        *("--checkpoint-dir", tmp_path / "slurm", "--metrics-file", tmp_path / "slurm.json", "--fail-at-step", "14"),
        env_extra={"MAX_RESTARTS": "1"},
    )
    assert run.returncode == 0, run.output
    assert "--fail-at-step 14: rank 1 fails on purpose (attempt 0)" in run.stdout
    assert "rank 0: node 0 local 0 on node0, rank 1: node 1 local 0 on node1" in run.stdout
    assert "attempt 1 |" in run.stdout and "/step_00000012.pt: epoch 0, step 12" in run.stdout
    nothing_left()
    hand = by_hand(*script, "--checkpoint-dir", tmp_path / "hand", "--metrics-file", tmp_path / "hand.json")
    assert hand.returncode == 0, hand.output
    slurm, started_by_hand = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("slurm", "hand"))
    assert slurm["restarts"] == 1 and started_by_hand["restarts"] == 0
    assert slurm["final_step"] == started_by_hand["final_step"]
    for key in ("final_test_accuracy", "final_test_loss", "final_train_loss"):
        assert slurm[key] == started_by_hand[key], key
    final = f"step_{slurm['final_step']:08d}.pt"
    resumed, uninterrupted = (read_verified(tmp_path / name / final)["model"] for name in ("slurm", "hand"))
    assert all(torch.equal(resumed[name], uninterrupted[name]) for name in uninterrupted)  # bit for bit


def two_task_job(tmp_path, name: str, task: str) -> Path:
    """A batch file that runs ``task`` (bash) once on each of 2 nodes."""
    path = tmp_path / f"{name}.sbatch"
    path.write_text(f"#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\nsrun bash -c '{task}'\n")
    return path


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_a_failing_job_gives_its_exit_status_and_leaves_nothing_behind(tmp_path):
    fails = two_task_job(tmp_path, "fails", 'echo "task on $(hostname)"; exit $((SLURM_NODEID + 3))')
    run = on_slurm(tmp_path, fails, timeout=200)
    assert run.returncode == 4, run.output  # sbatch --wait exits with the job's status: its tasks' highest
    assert "task on node0" in run.stdout and "task on node1" in run.stdout
    assert "job JobState=FAILED Reason=NonZeroExitCode ExitCode=4:0" in run.stdout
    nothing_left()


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_ctrl_c_stops_the_daemons_and_the_job_and_removes_the_network_and_the_folder(tmp_path):
    sleeps = two_task_job(tmp_path, "sleeps", 'echo "sleeping on $(hostname)"; exec sleep 300')
    process = subprocess.Popen(
        [PYTHON, SLURM_CLUSTER, "--", f"--output={tmp_path}/%j.out", sleeps],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),  # as a shell starts a background job
    )
    seen = []
    for line in process.stdout:  # wait until both tasks run: the interrupt then finds a job to end
        seen.append(line)
        if sum("sleeping on node" in line for line in seen) == 2:
            break
    assert running("slurmstepd")
    process.send_signal(signal.SIGINT)
    try:
        output = "".join(seen) + process.communicate(timeout=120)[0]
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=60)
    assert process.returncode == 130, output
    assert "slurm: interrupted; daemons stopped, the network and the folder removed" in output
    nothing_left()
