"""The benchmarks run for real on small settings and print what they promise."""

import importlib.util

import pytest

from tests.conftest import PYTHON, REPO, run_command, torchrun


def load_script(path):
    """Import a script that is not part of a package, by its path."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


parse_size = load_script(REPO / "benchmarks" / "allreduce_bandwidth.py").parse_size


def test_sizes_read_with_binary_units():
    assert [parse_size(text) for text in ("4K", "16M", "1G", "100", "0.5K")] == [4096, 16 * 2**20, 2**30, 100, 512]


def test_allreduce_bandwidth_prints_every_algorithm_and_the_bus_factor(tmp_path):
    run = torchrun("benchmarks/allreduce_bandwidth.py", "--sizes", "4K", "256K", "--iterations", "2",
                   "--plot", tmp_path / "plot.png", nproc=3, timeout=120)
    assert run.returncode == 0, run.output
    rows = [line.split() for line in run.stdout.splitlines() if line.split()[:1] in (["4K"], ["256K"])]
    assert [(row[0], row[1]) for row in rows] == [
        (size, name) for size in ("4K", "256K") for name in ("naive", "ring", "dist.all_reduce")]
    for row in rows:
        algbw, busbw = float(row[3]), float(row[4])
        assert busbw == pytest.approx(algbw * 4 / 3, abs=2e-3)  # 2(N-1)/N at N = 3
    assert (tmp_path / "plot.png").stat().st_size > 10_000


def test_the_scaling_benchmark_prints_a_row_per_process_count():
    run = run_command([PYTHON, REPO / "benchmarks/ddp_scaling.py", "--nproc", "1", "--dataset", "digits",
                       "--epochs", "1"], timeout=120)
    assert run.returncode == 0, run.output
    header, row = run.stdout.strip().splitlines()[-2:]
    assert header.split()[:4] == ["processes", "backend", "device", "samples/s"]
    assert row.split()[:3] == ["1", "gloo", "cpu"] and row.split()[4] == "1.00x"
