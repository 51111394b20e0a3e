"""The benchmarks run for real on small settings and print what they promise."""

from tests.conftest import PYTHON, REPO, run_command


def test_the_scaling_benchmark_prints_a_row_per_process_count():
    run = run_command([PYTHON, REPO / "benchmarks/ddp_scaling.py", "--nproc", "1", "--dataset", "digits",
                       "--epochs", "1"], timeout=120)
    assert run.returncode == 0, run.output
    header, row = run.stdout.strip().splitlines()[-2:]
    assert header.split()[:4] == ["processes", "backend", "device", "samples/s"]
    assert row.split()[:3] == ["1", "gloo", "cpu"] and row.split()[4] == "1.00x"
