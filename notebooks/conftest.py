"""Notebooks under test run with small settings: their parameters cell reads COURSE_QUICK.

The slowest to execute (30 s to 90 s each on 2 cores, even quick) run with the slow drills: `make test-slow`
and CI run them, `make test` leaves them out to stay under 20 minutes. Their code is tested in `make test` all the
same: each notebook calls the solutions' and common/'s functions, which the tests under tests/ run.
"""

import os
from pathlib import Path

import pytest

os.environ.setdefault("COURSE_QUICK", "1")

SLOW_NOTEBOOKS = {
    "01_allreduce_by_hand.ipynb",
    "03_distributed_data_parallel.ipynb",
    "04_gradient_accumulation.ipynb",
    "09_profiling_and_scaling.ipynb",
    "10_gradient_compression.ipynb",
    "12_tensor_parallelism.ipynb",
    # 26-47 s quick on 2 cores under load 6-8 (2026-11-27): two short trainings, a plot each, a spawn of 2 ranks
    "15_mixture_of_experts.ipynb",
    "14_context_parallelism.ipynb",  # 80 s quick: five process groups, of 2 and 4 ranks
    "16_composition.ipynb",  # 29 s quick under load 3: two torchrun launches of 4 processes
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).name in SLOW_NOTEBOOKS:
            item.add_marker(pytest.mark.slow)
