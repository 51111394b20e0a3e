"""The benchmarks run for real on small settings and print what they promise."""

import json
import re

import pytest

from tests.conftest import PYTHON, REPO, load_script, run_command, torchrun


@pytest.mark.slow  # a benchmark's drill: make test-slow
def test_the_scaling_benchmark_prints_a_row_per_process_count():
    run = run_command(
        [PYTHON, REPO / "benchmarks/ddp_scaling.py", "--nproc", "1", "--dataset", "digits", "--epochs", "1"],
        timeout=120,
    )
    assert run.returncode == 0, run.output
    lines = run.stdout.splitlines()
    at = lines.index(next(line for line in lines if line.startswith("processes")))  # the weak-scaling table
    header, row = lines[at : at + 2]
    assert header.split()[:4] == ["processes", "backend", "device", "samples/s"]
    assert row.split()[:3] == ["1", "gloo", "cpu"] and row.split()[4:6] == ["1.00x", "100%"]
    assert lines[-1].split()[:2] == ["weak", "1"] and lines[-1].split()[-2:] == ["0.00", "100%"]  # nothing lost


def test_the_accumulation_benchmark_counts_one_all_reduce_round_per_effective_step_under_no_sync():
    run = torchrun(
        "benchmarks/grad_accumulation.py",
        "--model",
        "lenet",
        "--batch-size",
        "2",
        "--accum-steps",
        "4",
        "--steps",
        "2",
        "--rounds",
        "1",
        nproc=2,
        timeout=120,
    )
    assert run.returncode == 0, run.output
    rows = {
        line.rsplit(None, 3)[0].strip(): line.rsplit(None, 3)[1:]
        for line in run.stdout.splitlines()
        if line.strip().startswith(("allreduce every", "no_sync"))
    }
    every, no_sync = rows["allreduce every micro"], rows["no_sync on k-1 of k"]
    assert float(every[0]) == 4 * float(no_sync[0]) and float(no_sync[0]) >= 1  # calls per effective step
    assert float(no_sync[1]) > 0 and float(every[1]) == pytest.approx(4 * float(no_sync[1]), abs=0.04)  # MB, 2 decimals


@pytest.mark.slow  # a benchmark's drill: make test-slow
def test_the_mixed_precision_benchmark_prints_a_row_per_precision_and_bf16_saves_less_for_backward():
    run = run_command(
        [
            PYTHON,
            REPO / "benchmarks/mixed_precision.py",
            "--batch-size",
            "16",
            "--steps",
            "2",
            "--rounds",
            "1",
            "--precisions",
            "fp32",
            "bf16",
        ],
        timeout=120,
    )
    assert run.returncode == 0, run.output
    header, fp32, bf16 = (line.split() for line in run.stdout.strip().splitlines()[-3:])
    assert header == ["precision", "samples/s", "ms/step", "vs", "fp32", "saved", "MiB", "peak", "MiB"]
    assert fp32[0] == "fp32" and fp32[3] == "1.00x" and bf16[0] == "bf16" and float(bf16[1].replace(",", "")) > 0
    # SimpleCNN at 16 images: what bf16 saves on activations (2 bytes, not 4) outweighs its bf16 weight copies;
    # at 1 image it does not (the lesson's table).
    assert float(bf16[4]) < float(fp32[4])


@pytest.mark.slow  # a benchmark's drill: make test-slow
def test_the_teardown_benchmark_prints_a_row_per_condition_and_fishers_p_value():
    run = run_command([PYTHON, REPO / "benchmarks/teardown_pause.py", "--runs", "1", "--progress", "0"], timeout=300)
    assert run.returncode == 0, run.output
    *_, header, with_pause, without, fisher = run.stdout.strip().splitlines()
    assert header.split()[:4] == ["condition", "runs", "aborts", "other"]
    for row, name in ((with_pause, "with pause"), (without, "without")):
        runs, aborts, other = row.removeprefix(name).split()[:3]
        assert (runs, other) == ("1", "0") and aborts in ("0", "1"), run.stdout  # each job ran, cleanly or aborted
    assert fisher.startswith("Fisher's exact test, two-sided: p = ") and 0 <= float(fisher.split()[-1]) <= 1


def test_the_teardown_benchmark_counts_an_abort_at_exit_from_torchruns_report():
    benchmark = load_script(REPO / "benchmarks/teardown_pause.py")
    assert benchmark.outcome(0, "") == "clean"
    assert benchmark.outcome(1, "terminate called without an active exception\n") == "abort"
    # torchrun's report when a worker died by SIGABRT, as it printed it here
    assert benchmark.outcome(1, "  exitcode  : -6 (pid: 7040)  (SIGABRT)\n") == "abort"
    assert benchmark.outcome(1, "  exitcode  : 1 (pid: 7040)\n") == "other failure"


def test_the_restart_drill_repeats_the_fault_drill_exactly_as_the_solution_prints_it():
    """The drill itself runs in tests/test_documented_commands.py; here, that the benchmark runs that same line."""
    source = (REPO / "solutions/05_multi_node.py").read_text()
    unwrapped = re.sub(r"\\\n\s*", " ", source)  # a shell's line continuation, done independently of the benchmark
    documented = next(
        " ".join(line.split())
        for line in unwrapped.splitlines()
        if "--fail-at-step" in line and "--max-restarts" in line and "--standalone" in line
    )
    with_variable = run_command([PYTHON, REPO / "benchmarks/restart_drill.py", "--print-command"], timeout=60)
    without = run_command(
        [PYTHON, REPO / "benchmarks/restart_drill.py", "--print-command", "--without-variable"], timeout=60
    )
    assert with_variable.returncode == 0 and without.returncode == 0, with_variable.output + without.output
    assert with_variable.stdout.strip() == documented
    assert documented.startswith("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun ")
    assert without.stdout.strip() == documented.removeprefix("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 ")


def test_the_restart_drill_reports_why_a_run_failed_not_the_intended_failure():
    drill = load_script(REPO / "benchmarks/restart_drill.py")
    output = (
        "[rank1]: RuntimeError: --fail-at-step 30: rank 1 fails on purpose (attempt 0)\n"
        "[rank0]: RuntimeError: Gloo connectFullMesh failed with ... Connection refused\n"
    )
    assert drill.failure_lines(output) == [
        "[rank0]: RuntimeError: Gloo connectFullMesh failed with ... Connection refused"
    ]


def test_the_allreduce_benchmark_counts_the_messages_and_predicts_each_allreduce_from_its_building_blocks():
    run = torchrun(
        "benchmarks/allreduce_bandwidth.py",
        "--sizes",
        "4",
        "12K",
        "--rounds",
        "1",
        "--iterations",
        "1",
        nproc=3,
        timeout=180,
    )
    assert run.returncode == 0, run.output
    counts = [line.split() for line in run.stdout.splitlines() if line.split()[:1] in (["naive"], ["ring"])]
    # algorithm, rank, sends, receives, sent and received in units of S: 3 ranks
    assert counts == [
        ["naive", "0", "2", "2", "2.000", "2.000"],
        ["naive", "1", "1", "1", "1.000", "1.000"],
        ["naive", "2", "1", "1", "1.000", "1.000"],
    ] + [["ring", str(rank), "4", "4", "1.333", "1.333"] for rank in range(3)]
    # Two sizes timed once each on a loaded machine can fit a negative term: the line's form is what is checked.
    assert re.search(r"one-way: a = -?[\d.]+ ms per message, B = -?[\d.]+ GB/s", run.stdout)
    rows = [line.split() for line in run.stdout.split("4. allreduce")[1].splitlines() if line.split()[:1] == ["12K"]]
    assert len(rows) == 1 and len(rows[0]) == 9  # size, then best (median) and prediction for naive and ring, dist


def test_the_scaler_sync_benchmark_counts_one_host_read_per_step_in_step_and_one_per_get_scale():
    run = run_command(
        [PYTHON, REPO / "benchmarks/scaler_sync.py", "--device", "cpu", "--steps", "2", "--rounds", "1"], timeout=120
    )
    assert run.returncode == 0, run.output
    reads = {
        line[:28].strip(): int(line[28:].split()[0])
        for line in run.stdout.splitlines()
        if line.strip().startswith(("no skip", "get_scale"))
    }
    assert reads == {"no skip count": 1, "get_scale after update": 2, "get_scale before and after": 3}


@pytest.mark.slow  # 25 s: the hooks' bytes are counted in tests/test_compression.py in make test
def test_the_compression_benchmark_prints_a_row_per_configuration_and_powersgd_sends_over_10x_fewer_bytes(tmp_path):
    results, plot = tmp_path / "compression.json", tmp_path / "compression.png"
    run = run_command(
        [PYTHON, REPO / "benchmarks/gradient_compression.py", "--configs", "allreduce", "powersgd-r2", "--seeds", "0"]
        + ["--epochs", "1", "--json", results, "--plot", plot],
        timeout=180,
    )
    assert run.returncode == 0, run.output
    lines = run.stdout.splitlines()
    at = lines.index(next(line for line in lines if line.startswith("configuration")))
    header, plain, powersgd = (line.split() for line in lines[at : at + 3])
    assert header[:4] == ["configuration", "MiB/step", "fewer", "bytes"]
    assert plain[0] == "allreduce" and plain[2] == "1.0x" and plain[-1] == "+0.00"  # plain against itself
    assert powersgd[0] == "powersgd-r2" and float(powersgd[2].rstrip("x")) > 10  # MLP at rank 2: about 100x
    assert float(powersgd[1]) < float(plain[1]) / 10
    assert lines[-2].startswith("goal, >= 10x fewer bytes") and "powersgd-r2 " in lines[-2]
    figures = json.loads(results.read_text())
    assert [run["config"] for run in figures["runs"]] == ["allreduce", "powersgd-r2"]
    assert all(len(run["test_accuracy"]) == 1 for run in figures["runs"]) and plot.stat().st_size > 0


@pytest.mark.slow  # two processes run 11 schedules for a few steps: about 10 s on 2 cores, more under load
def test_the_pipeline_benchmark_prints_a_row_per_schedule_and_ddp():
    run = torchrun(
        "benchmarks/pipeline_schedules.py",
        *("--width", "32", "--depth", "2", "--batch-size", "16", "--microbatches", "2", "4"),
        *("--torch-microbatches", "4", "--steps", "2"),
        timeout=180,
    )
    assert run.returncode == 0, run.output
    lines = run.stdout.splitlines()
    at = lines.index(next(line for line in lines if line.startswith("run ")))
    end = lines.index(next(line for line in lines if line.startswith("median ms per micro-batch")))
    rows = {line[:34].strip(): line[34:].split() for line in lines[at + 1 : end]}
    torch_runs = ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"]
    assert list(rows) == ["naive/m=1", "gpipe/m=2", "gpipe/m=4", "1f1b/m=2", "1f1b/m=4", "ddp"] + [
        f"torch {schedule}/m=4" for schedule in torch_runs
    ]
    assert rows["ddp"][2:4] == ["(no", "bubble:"]
    # measured, replayed and the formula; the naive one replays to a half on 2 stages, whatever the stages cost
    assert rows["naive/m=1"][2:] == [rows["naive/m=1"][2], "0.50", "0.50"]
    assert rows["torch Interleaved1F1B/m=4"][-1] == "0.11" and rows["torch ZBVZeroBubble/m=4"][-1] == "-"
    assert all(0 <= float(value) <= 1 for name, row in rows.items() if name != "ddp" for value in row[2:4])
