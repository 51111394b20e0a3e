"""``common.launch``: the torchrun command every notebook, benchmark and test launches, and the harness that
runs a function on N local processes, which turns a hang or a failing rank into an error."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.launch import REPO, TORCHRUN, in_turn, run_for_json, run_on_ranks, torchrun_command


def test_the_torchrun_command_is_the_readmes_single_machine_line():
    assert torchrun_command("solutions/01_ddp_basic.py", "--epochs", 2, nproc=4) == [
        TORCHRUN,
        "--standalone",
        "--nproc_per_node=4",
        "solutions/01_ddp_basic.py",
        "--epochs",
        "2",
    ]
    assert Path(TORCHRUN).exists() and (REPO / "solutions" / "01_ddp_basic.py").exists()


def test_importing_the_launcher_leaves_pytorch_unloaded():
    # scripts/rehearse_two_nodes.py imports TORCHRUN from here and only starts torchrun: it need not load PyTorch.
    code = "import sys, common.launch; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


WRITE_RANK_AND_ARGS = """
import json, os, sys
if os.environ["RANK"] == "0":  # as a solution's --metrics-file: global rank 0 writes
    out = sys.argv.index("--out")
    json.dump({"world_size": int(os.environ["WORLD_SIZE"]), "args": sys.argv[1:out]}, open(sys.argv[out + 1], "w"))
"""


def test_run_for_json_returns_what_rank_0_wrote_to_the_file_it_named(tmp_path):
    script = tmp_path / "write.py"
    script.write_text(WRITE_RANK_AND_ARGS)
    assert run_for_json(script, "--seed", 3, json_option="--out", nproc=2, timeout=60) == {
        "world_size": 2,
        "args": ["--seed", "3"],
    }


def test_run_for_json_raises_with_the_failing_scripts_error(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("raise SystemExit('no figures today')")
    with pytest.raises(RuntimeError, match="no figures today"):
        run_for_json(script, json_option="--out", nproc=1, timeout=60)


def wait_forever(env):
    if env.rank == 1:
        torch.distributed.barrier()  # rank 0 never joins: a hang
    else:
        import time

        time.sleep(60)


def fail_on_rank_1(env):
    if env.rank == 1:
        raise ValueError("rank 1 broke")
    torch.distributed.barrier()


def test_the_harness_turns_a_hang_into_an_error_by_its_deadline():
    with pytest.raises(TimeoutError, match="still running"):
        run_on_ranks(wait_forever, 2, timeout=4)  # still starting or already waiting: either way, a hang


def test_the_harness_reports_a_failing_rank_at_once():
    with pytest.raises(RuntimeError, match="rank 1 broke"):
        run_on_ranks(fail_on_rank_1, 2, timeout=60)


def rank_plus(env, offset):
    return env.rank + offset


def world_size_of(env):
    return env.world_size


def test_in_turn_runs_each_function_in_one_group_and_returns_their_results_in_order():
    results = run_on_ranks(in_turn, 2, [(rank_plus, (10,)), (world_size_of, ()), (rank_plus, (20,))], timeout=60)
    assert results == [[10, 2, 20], [11, 2, 21]]
