"""``common.launch``: the harness that runs a function on N local processes turns a hang or a failing rank
into an error."""

import pytest
import torch

from common.launch import run_on_ranks


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
        run_on_ranks(wait_forever, 2, timeout=8)


def test_the_harness_reports_a_failing_rank_at_once():
    with pytest.raises(RuntimeError, match="rank 1 broke"):
        run_on_ranks(fail_on_rank_1, 2, timeout=60)
