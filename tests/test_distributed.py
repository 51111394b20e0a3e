"""``common.distributed``: in this one process, then across real gloo process groups of 3 CPU processes
(``common.launch.run_on_ranks``; the functions that run on the ranks live at module level, where spawned
processes can import them)."""

import random

import numpy as np
import pytest
import torch
import torch.distributed as dist

from common import distributed
from common.distributed import (
    ConfigurationError,
    all_reduce_mean,
    all_reduce_sum,
    choose_backend,
    global_mean,
    main_process_first,
    print0,
    set_seed,
    setup_distributed,
    teardown_distributed,
)
from common.launch import run_on_ranks

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has ``n`` CUDA devices."""

    def pretend(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return pretend


def test_auto_picks_gloo_without_gpus(gpus):
    gpus(0)
    assert choose_backend("auto", local_world_size=1) == "gloo"


def test_auto_picks_nccl_only_with_a_gpu_per_local_process(gpus):
    gpus(4)
    assert choose_backend("auto", local_world_size=4) == "nccl"
    assert choose_backend("auto", local_world_size=8) == "gloo"


def test_nccl_without_enough_gpus_is_a_clear_error(gpus):
    gpus(1)
    with pytest.raises(ConfigurationError, match=r"2 local process\(es\) and 1 CUDA device.*--backend gloo"):
        choose_backend("nccl", local_world_size=2)
    gpus(0)
    with pytest.raises(ConfigurationError, match="machine with NVIDIA GPUs"):
        choose_backend("nccl", local_world_size=1)


def test_gloo_can_be_forced_and_unknown_backends_are_refused(gpus):
    gpus(8)
    assert choose_backend("gloo", local_world_size=2) == "gloo"
    with pytest.raises(ConfigurationError, match="unknown backend"):
        choose_backend("mpi")


def test_configuration_error_ends_a_script_with_its_message_and_status_1():
    error = ConfigurationError("error: something the user can fix")
    assert isinstance(error, SystemExit) and error.code == "error: something the user can fix"


@pytest.fixture
def no_torchrun(monkeypatch):
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    yield
    teardown_distributed()


def test_plain_python_is_a_world_of_one(no_torchrun):
    env = setup_distributed()
    try:
        assert (env.rank, env.local_rank, env.world_size, env.backend) == (0, 0, 1, "gloo")
        assert env.device == torch.device("cpu")
        assert dist.is_initialized() and dist.get_world_size() == 1
        assert all_reduce_sum(torch.tensor([1.0, 2.0])).tolist() == [1.0, 2.0]  # a real collective, world of 1
    finally:
        teardown_distributed()
    assert not dist.is_initialized()
    teardown_distributed()  # a second call is harmless


@pytest.mark.parametrize(
    "variables, message",
    [
        ({"RANK": "one"}, "RANK='one' is not an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "outside WORLD_SIZE"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "launch with torchrun"),
    ],
)
def test_inconsistent_environment_is_a_clear_error(no_torchrun, monkeypatch, variables, message):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigurationError, match=message):
        setup_distributed()
    assert not dist.is_initialized()


def test_print0_prints_on_global_rank_0_only(monkeypatch, capsys):
    print0("from rank 0")
    monkeypatch.setattr(distributed, "get_rank", lambda: 1)
    print0("from rank 1")
    assert capsys.readouterr().out == "from rank 0\n"


def test_set_seed_repeats_draws_and_offsets_them_by_rank():
    def draws():
        return torch.rand(3).tolist(), np.random.rand(), random.random()

    set_seed(7)
    first = draws()
    set_seed(7)
    assert draws() == first
    set_seed(7, rank=1)
    assert all(a != b for a, b in zip(draws(), first))
    set_seed(6, rank=1)
    assert draws() == first  # seed + rank: the offset is exactly the rank


def test_reductions_outside_a_process_group_are_the_identity():
    assert all_reduce_mean(torch.tensor([2.0, 4.0])).tolist() == [2.0, 4.0]
    assert global_mean(total=10.0, count=4) == 2.5


def test_main_process_first_runs_the_body_without_a_group():
    ran = []
    with main_process_first():
        ran.append(True)
    assert ran == [True]


def reduce_rank_values(env):
    values = [float(10 * env.rank + i) for i in range(env.rank + 1)]  # rank r holds r+1 values
    return {
        "mean": all_reduce_mean(float(env.rank)).item(),
        "sum": all_reduce_sum([1.0, env.rank]).tolist(),
        "global_mean": global_mean(sum(values), len(values)),
    }


def test_reductions_equal_the_mean_over_ranks_and_over_samples():
    every_value = [10.0 * rank + i for rank in range(3) for i in range(rank + 1)]
    for rank in run_on_ranks(reduce_rank_values, 3, timeout=90):
        assert rank["mean"] == pytest.approx(1.0)  # (0 + 1 + 2) / 3
        assert rank["sum"] == [3.0, 3.0]
        assert rank["global_mean"] == pytest.approx(sum(every_value) / len(every_value))


def write_once(env, folder):
    """Each rank, inside main_process_first, records whether rank 0's file already existed."""
    from pathlib import Path

    marker = Path(folder) / "downloaded"
    with main_process_first():
        found = marker.exists()
        if env.rank == 0:
            import time

            time.sleep(0.5)  # a slow "download": the others must still wait for it
            marker.write_text("data")
    return found


def test_main_process_first_lets_rank_0_finish_before_the_others_start(tmp_path):
    assert run_on_ranks(write_once, 3, str(tmp_path), timeout=90) == [False, True, True]
