"""``common.launch``: the torchrun command every notebook, benchmark and test launches, and the harness that
runs a function on N local processes, which turns a hang or a failing rank into an error."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.launch import REPO, TORCHRUN, run_on_ranks, torchrun_command


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
