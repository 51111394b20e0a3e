"""`make gpu-check` on a machine without a GPU: what it plans, what it writes, and the GPU figures the lessons quote.

The check itself needs an NVIDIA GPU; here its logic is tested: the plan (every command parses with its script's
own argument parser), the one-line refusal without a GPU, the time limit, the result files, and the benchmarks it
runs, on CPU with gloo. The last tests hold the lessons to the recorded GPU runs under results/.
"""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from common.data import FirstBatches, load_data, make_loader
from common.launch import load_script
from common.models import MODELS
from common.profiling import check_profile_settings
from tests.conftest import torchrun as conftest_torchrun

REPO = Path(__file__).resolve().parents[1]
gpu_check = load_script(REPO / "scripts" / "gpu_check.py")


def script_and_arguments(command: list[str]) -> tuple[Path, list[str]] | None:
    """The .py file a planned command runs and the arguments it gets, or None for a module (``-m pytest``)."""
    for index, word in enumerate(command):
        if word.endswith(".py") and not word.startswith("-"):
            return REPO / word, command[index + 1 :]
    return None


def test_the_plan_runs_every_solution_and_each_command_parses_with_its_own_scripts_argument_parser(tmp_path):
    steps = gpu_check.plan(num_gpus=2, cpu_cores=16, out_dir=tmp_path, scratch=tmp_path)
    planned = {script_and_arguments(step.command)[0].name for step in steps if script_and_arguments(step.command)}
    solutions = {path.name for path in (REPO / "solutions").glob("*.py")}
    assert solutions <= planned, f"solutions the GPU check does not run: {sorted(solutions - planned)}"
    for step in steps:
        found = script_and_arguments(step.command)
        if found is None:
            continue
        script, arguments = found
        try:
            load_script(script).parse_args(arguments)  # the check runs rarely: a renamed flag must fail here
        except SystemExit as error:
            pytest.fail(f"{step.name}: {script.name} rejects {arguments}: exit {error.code}")
    # world sizes the GPUs allow, and CPU process counts the cores allow
    assert [step.command[2] for step in steps if "fsdp_memory" in step.name.lower() or "memory" in step.name] == [
        "--nproc_per_node=1",
        "--nproc_per_node=2",
    ]
    scaling = next(step for step in steps if "ddp_scaling.py" in " ".join(step.command))
    assert scaling.command[scaling.command.index("--nproc") + 1 :][:4] == ["1", "2", "4", "8"]
    assert gpu_check.plan(1, 2, tmp_path, tmp_path)[-1].command[3:6] == ["1", "2", "--cpu"]


@pytest.mark.parametrize("num_gpus", [1, 2, 3, 4, 6, 8, 16])
def test_solution_17s_mesh_fits_every_gpu_count_before_any_gpu_runs_it(num_gpus):
    from common.parallelize import check_degrees

    solution = load_script(REPO / "solutions" / "17_composition.py")
    args = solution.parse_args(gpu_check.composition_mesh(num_gpus))
    pp, dp, cp, tp = solution.degrees(args, num_gpus)
    assert (num_gpus < 8 or cp == 2) and (num_gpus % 2 or tp == 2)  # 8 GPUs: every dim the solution has
    shapes = dict(num_layers=args.layers, num_heads=args.heads, d_model=args.d_model, context=args.context)
    shapes |= dict(vocab_size=256, batch_size=args.batch_size, microbatches=args.microbatches)
    check_degrees(pp, dp, tp, num_gpus, args.replicas, cp, **shapes)  # raises, saying why, where it does not fit


def test_the_dry_run_lists_the_steps_and_runs_nothing(tmp_path):
    run = subprocess.run(
        [sys.executable, REPO / "scripts/gpu_check.py", "--dry-run", "--gpus", "4", "--results", tmp_path],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == len(gpu_check.plan(4, 1, tmp_path, tmp_path))
    assert "torchrun --standalone --nproc_per_node=4 solutions/01_ddp_basic.py" in lines[0]
    assert any("pytest -q -m cuda" in line for line in lines)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_without_a_gpu_make_gpu_check_says_so_in_one_line_and_fails(tmp_path):
    run = subprocess.run(
        ["make", "-s", "gpu-check", f"RESULTS={tmp_path}", f"GPU_PYTHON={sys.executable}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0
    message = [line for line in run.stderr.splitlines() if not line.startswith("make")]
    assert len(message) == 1 and message[0].startswith("gpu-check: no CUDA GPU visible"), run.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_step_past_its_time_limit_is_ended_with_the_processes_it_started(tmp_path):
    child_pid = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        f"open({str(child_pid)!r}, 'w').write(str(child.pid)); time.sleep(120)"
    )
    step = gpu_check.Step("sleeper", "tests", ["python", "-c", code], timeout=120)
    start = time.perf_counter()
    result = gpu_check.run_step(step, timeout=5, env={}, scratch=tmp_path)
    assert result["status"] == "timeout" and result["error"] == "no result within 5 s"
    assert time.perf_counter() - start < 60
    pid = int(child_pid.read_text())
    deadline = time.time() + 10
    while Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]:
        assert time.time() < deadline, "the grandchild outlived the step"
        time.sleep(0.2)


def test_the_first_error_line_is_the_exception_a_worker_raised():
    output = (
        "[rank0]: Traceback (most recent call last):\nW1122 torchrun noise\n"
        "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1, unhandled cuda error\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \nsolutions/x.py FAILED\n"
    )
    assert gpu_check.first_error_line(output).startswith("torch.distributed.DistBackendError: NCCL error")
    assert (
        gpu_check.first_error_line("usage: x\nerror: unrecognized arguments: --max-steps\n")
        == "error: unrecognized arguments: --max-steps"
    )
    assert gpu_check.first_error_line("just\nlast line\n") == "last line"


def test_the_result_files_hold_the_versions_every_step_and_each_benchmarks_printed_table(tmp_path):
    facts = {
        "date": "2026-11-22 12:00 UTC",
        "gpus": ["NVIDIA H100 80GB HBM3"] * 2,
        "torch": "2.11.0+cu130",
        "cuda": "13.0",
        "cudnn": 91300,
        "nccl": "2.28.9",
        "driver": "580.159.04",
        "python": "3.12.3",
        "cpu_cores": 16,
    }
    table = "precision  samples/s\n     fp32     70,248"
    steps = [
        {
            "name": "01_ddp_basic",
            "part": "solutions",
            "command": "torchrun a.py",
            "status": "pass",
            "seconds": 9.5,
            "output": "epoch 1\n",
        },
        {
            "name": "03_fsdp",
            "part": "solutions",
            "command": "torchrun b.py",
            "status": "FAIL",
            "seconds": 3.0,
            "output": "Traceback\nValueError: a | b\n",
            "error": "ValueError: a | b",
        },
        {
            "name": "mixed precision",
            "part": "benchmarks",
            "command": "python m.py",
            "status": "pass",
            "seconds": 60,
            "output": "W1122 12:00:00 torchrun banner\n" + table + "\n",
            "data": {"rows": [{"precision": "fp32"}]},
        },
        {
            "name": "profile",
            "part": "benchmarks",
            "command": "torchrun p.py",
            "status": "timeout",
            "seconds": 180,
            "output": "partial\n",
            "error": "no result within 180 s",
        },
    ]
    report = {"facts": facts, "missing_packages": [], "steps": steps, "seconds": 252.5}
    folder = tmp_path / gpu_check.folder_name(facts["gpus"])
    paths = gpu_check.write_results(folder, report)
    assert folder.name == "nvidia-h100-80gb-hbm3-x2" and {p.name for p in paths} == {
        "gpu_check.json",
        "summary.md",
        "logs.txt",
    }
    data = json.loads((folder / "gpu_check.json").read_text())
    assert data["facts"] == facts and [step["status"] for step in data["steps"]] == ["pass", "FAIL", "pass", "timeout"]
    assert "output" not in data["steps"][0] and data["steps"][2]["data"] == {"rows": [{"precision": "fp32"}]}
    summary = (folder / "summary.md").read_text()
    assert "- GPU: NVIDIA H100 80GB HBM3 x 2" in summary
    assert "PyTorch 2.11.0+cu130, CUDA 13.0, cuDNN 91300, NCCL 2.28.9, driver 580.159.04" in summary
    assert "| solutions | 03_fsdp | FAIL | 3.0 | ValueError: a / b |" in summary  # a | would split the table row
    assert f"```\n{table}\n```" in summary and "banner" not in summary  # the table, without torchrun's noise
    assert "## profile" not in summary  # no output of a step that did not finish
    logs = (folder / "logs.txt").read_text()
    assert all(step["output"] in logs for step in steps)
    assert gpu_check.folder_name(["NVIDIA H100 80GB HBM3"]) == "nvidia-h100-80gb-hbm3"


@pytest.mark.slow  # make test-slow: a drill of what make gpu-check runs
def test_the_check_records_each_step_as_it_ends_and_skips_what_the_budget_leaves_no_time_for(tmp_path, monkeypatch):
    facts = {
        "date": "today",
        "gpus": ["Fake GPU X100"],
        "torch": torch.__version__,
        "cuda": None,
        "cudnn": None,
        "nccl": None,
        "driver": None,
        "python": "3",
        "cpu_cores": 2,
    }
    writes = (
        "import json, sys, time; time.sleep(5); json.dump({'rows': [1]}, open(sys.argv[1], 'w')); print('the table')"
    )

    def fake_plan(num_gpus, cpu_cores, out_dir, scratch):
        assert (num_gpus, cpu_cores, out_dir) == (1, 2, tmp_path / "fake-gpu-x100")
        return [
            gpu_check.Step(
                "measures",
                "benchmarks",
                ["python", "-c", writes, str(scratch / "figures.json")],
                60,
                json_file="figures.json",
            ),
            gpu_check.Step(
                "fails", "solutions", ["python", "-c", "import time; time.sleep(5); raise ValueError('no')"], 60
            ),
            gpu_check.Step("too late", "tests", ["python", "-c", "print('never')"], 60),
        ]

    monkeypatch.setattr(gpu_check, "plan", fake_plan)
    monkeypatch.setattr(gpu_check, "machine_facts", lambda: facts)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # 29 s: after the first step (5 s and start-up) 20 s or more are left, after the second less: the third is skipped
    code = gpu_check.main(gpu_check.parse_args(["--results", str(tmp_path), "--budget", "29"]))
    data = json.loads((tmp_path / "fake-gpu-x100" / "gpu_check.json").read_text())
    assert code == 1 and [(step["name"], step["status"]) for step in data["steps"]] == [
        ("measures", "pass"),
        ("fails", "FAIL"),
        ("too late", "skipped"),
    ]
    assert data["steps"][0]["data"] == {"rows": [1]} and data["steps"][1]["error"] == "ValueError: no"
    assert "the table" in (tmp_path / "fake-gpu-x100" / "summary.md").read_text()


def test_a_step_that_needs_two_gpus_is_skipped_in_one_line_on_one_gpu_and_does_not_fail_the_check(
    tmp_path, monkeypatch, capsys
):
    torch_context_parallel = [step for step in gpu_check.plan(1, 2, tmp_path, tmp_path) if "--method" in step.command]
    assert [step.needs_gpus for step in torch_context_parallel] == [2]  # one GPU cannot host two NCCL ranks
    facts = {"date": "today", "gpus": ["Fake GPU X100"], "torch": torch.__version__, "cpu_cores": 2}
    facts |= dict.fromkeys(("cuda", "cudnn", "nccl", "driver", "python"))
    step = gpu_check.Step("two GPUs", "solutions", ["python", "-c", "raise SystemExit(1)"], 60, needs_gpus=2)
    monkeypatch.setattr(gpu_check, "plan", lambda *args: [step])
    monkeypatch.setattr(gpu_check, "machine_facts", lambda: facts)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert gpu_check.main(gpu_check.parse_args(["--results", str(tmp_path)])) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "two GPUs" in line]
    assert "n/a" in line and "needs 2+ GPUs (one GPU cannot host two NCCL ranks)" in line


@pytest.mark.slow  # make test-slow: a drill of what make gpu-check runs
def test_the_tests_marked_cuda_are_those_that_need_a_gpu():
    command = next(step.command for step in gpu_check.plan(1, 1, REPO, REPO) if step.part == "tests")
    run = subprocess.run(
        [sys.executable, *command[1:], "--collect-only"], cwd=REPO, capture_output=True, text=True, timeout=240
    )  # the check's own pytest command, collecting only
    assert run.returncode == 0, run.stdout[-3000:]  # a collection error would fail the check's test step
    collected = [line for line in run.stdout.splitlines() if "::" in line]
    expected = [
        "test_autocast_computes_losses_in_fp32_but_softmax_and_sums_in_fp32_on_cuda_only",
        "test_rng_states_survive_a_weights_only_checkpoint[cuda]",
        "test_sync_batch_norm_on_a_gpu_equals_one_process_on_the_whole_batch",
        "test_dataparallel_on_two_gpus_matches_the_by_hand_version_and_the_whole_batch",
    ]
    for name in expected:
        assert any(name in line for line in collected), f"{name} is not marked cuda:\n{run.stdout}"
    assert not any("[cpu" in line for line in collected)  # the CPU variants stay in the CPU suite only


# --- the benchmarks the check runs, on CPU with gloo ---------------------------------------------------------------
def torchrun(script: str, *arguments, nproc: int = 2) -> subprocess.CompletedProcess:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            REPO / script,
            *map(str, arguments),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return run


@pytest.mark.slow  # make test-slow: a drill of what make gpu-check runs
def test_fsdp_memory_shows_zero1_sharding_the_optimizer_and_fsdp_the_parameters_on_2_ranks(tmp_path):
    torchrun("benchmarks/fsdp_memory.py", "--width", 64, "--depth", 2, "--json", tmp_path / "memory.json")
    data = json.loads((tmp_path / "memory.json").read_text())
    rows = {row["strategy"]: row for row in data["rows"]}
    assert data["world_size"] == 2 and set(rows) == set(load_script(REPO / "benchmarks/fsdp_memory.py").STRATEGIES)
    ddp, zero1, full = rows["ddp"], rows["zero1"], rows["fsdp-full"]
    # ZeroRedundancyOptimizer partitions whole tensors: rank 0 holds some of Adam's states, never all of them
    assert zero1["parameters_mib"] == ddp["parameters_mib"] and zero1["optimizer_mib"] < 0.9 * ddp["optimizer_mib"]
    assert full["parameters_mib"] == pytest.approx(ddp["parameters_mib"] / 2, rel=0.02)
    assert ddp["all_gathers"] == 0 and full["all_gathers"] > 0 and ddp["cuda_peak_mib"] is None
    assert ddp["total_mib"] == pytest.approx(ddp["zero_predicted_mib"], rel=0.01)


def profile_step(num_gpus: int, out_dir: Path, scratch: Path):
    """The check's profile step (solutions/06_profiling.py) for ``num_gpus`` GPUs, and its parsed arguments."""
    step = next(step for step in gpu_check.plan(num_gpus, 16, out_dir, scratch) if "06_profiling.py" in step.shown())
    script, arguments = script_and_arguments(step.command)
    return step, arguments, load_script(script).parse_args(arguments)


@pytest.mark.parametrize("num_gpus", [1, 2, 3, 4, 8])
def test_the_profile_step_has_the_steps_its_profiler_needs_on_every_gpu_and_writes_traces_into_the_results(
    num_gpus, tmp_path
):
    step, arguments, args = profile_step(num_gpus, tmp_path / "results", tmp_path / "scratch")
    assert step.command[2] == f"--nproc_per_node={num_gpus}" and step.json_file == "profile.json"
    assert args.metrics_file == tmp_path / "scratch" / "profile.json"
    assert args.trace_dir == tmp_path / "results" / "traces"
    assert args.memory_snapshot == tmp_path / "results" / "memory_snapshot.pickle"
    data = load_data(args.dataset, args.data_dir, MODELS[args.model].input_shape)
    loader = make_loader(data.train, args.batch_size, train=True, rank=num_gpus - 1, world_size=num_gpus, seed=0)
    batches = args.epochs * len(FirstBatches(loader, args.max_batches_per_epoch))
    assert batches == 5 and args.batch_size * num_gpus <= 256  # the global batch stays 256
    # the solution's own check, which refuses before training a schedule the run cannot fit
    check_profile_settings(args.trace_dir, args.profile_wait, args.profile_warmup, args.profile_steps, batches)


def test_only_the_first_two_ranks_traces_stay_and_the_results_folder_holds_at_most_eight_files(tmp_path):
    folder = tmp_path / "nvidia-h100-80gb-hbm3-x8"
    (folder / "traces").mkdir(parents=True)
    for rank in range(8):
        (folder / "traces" / f"rank{rank}.json").write_text("{}")
    (folder / "memory_snapshot.pickle").write_bytes(b"")
    (folder / "traces" / "notes.json").write_text("{}")  # not a rank's trace: left alone
    gpu_check.keep_first_traces(folder / "traces")
    report = {"facts": {"date": "today", "gpus": ["G"] * 8, **dict.fromkeys(["torch", "cuda", "cudnn", "nccl"])}}
    report["facts"].update(driver=None, python="3", cpu_cores=16)
    gpu_check.write_results(folder, {**report, "missing_packages": [], "steps": [], "seconds": 1.0})
    files = sorted(path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file())
    assert files == [
        "gpu_check.json",
        "logs.txt",
        "memory_snapshot.pickle",
        "summary.md",
        "traces/notes.json",
        "traces/rank0.json",
        "traces/rank1.json",
    ]
    gpu_check.keep_first_traces(tmp_path / "absent")  # no profile yet: nothing to do


@pytest.mark.slow  # make test-slow: a drill of what make gpu-check runs
@pytest.mark.timeout(240)
def test_the_profile_step_on_two_cpu_processes_writes_both_traces_and_no_hta_view(tmp_path):
    _, arguments, _ = profile_step(2, tmp_path / "results", tmp_path)
    snapshot = arguments.index("--memory-snapshot")  # CUDA only: the solution refuses it on a CPU
    run = conftest_torchrun("solutions/06_profiling.py", *arguments[:snapshot], *arguments[snapshot + 2 :], nproc=2)
    assert run.returncode == 0, run.output[-3000:]
    report = json.loads((tmp_path / "profile.json").read_text())["profile"]
    assert len(report["trace_steps"]) == 3 and report["trace_breakdown"]["step_ms"] > 0
    assert sorted(path.name for path in (tmp_path / "results" / "traces").iterdir()) == ["rank0.json", "rank1.json"]
    assert "hta" not in report and "HTA" not in run.stdout  # HTA reads GPU traces only


def test_the_mixed_precision_benchmark_refuses_tf32_without_a_gpu_that_has_it():
    run = subprocess.run(
        [sys.executable, REPO / "benchmarks/mixed_precision.py", "--precisions", "fp32", "tf32"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0 and "tf32 needs an NVIDIA GPU of compute capability 8.0" in run.stderr


# --- the lessons' GPU figures --------------------------------------------------------------------------------------
NUMBER = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)*")


def gpu_runs() -> dict[str, list[Path]]:
    """``{"H100": [folder, ...]}``: the recorded GPU runs under results/, by the GPU's model number."""
    runs = {}
    for summary in sorted((REPO / "results").glob("*/summary.md")):
        gpu = re.search(r"^- GPU: (.+?) x \d+", summary.read_text(), re.MULTILINE)
        if gpu:
            model = re.search(r"\b[A-Z]{1,2}\d{2,4}\b", gpu.group(1)).group(0)
            runs.setdefault(model, []).append(summary.parent)
    return runs


def markdown_blocks(text: str) -> list[tuple[str, bool]]:
    """``(block, is_code)``: fenced code blocks whole; prose split into paragraphs, list items and table rows."""
    blocks, lines, in_code = [], [], False

    def close(is_code=False):
        if lines:
            blocks.append(("\n".join(lines), is_code))
            lines.clear()

    for line in text.splitlines():
        if line.startswith("```"):
            close(is_code=in_code)
            in_code = not in_code
        elif in_code:
            lines.append(line)
        elif not line.strip() or line.lstrip().startswith(("- ", "* ", "|")) or re.match(r"\s*\d+\. ", line):
            close()
            if line.strip():
                lines.append(line)
        else:
            lines.append(line)
    close()
    return blocks


provenance = load_script(REPO / "scripts" / "provenance.py")
VERSION = re.compile(r"(?<![\w.])\d+\.\d+\.\d+(?!\w|\.\d)|(?<=PyTorch )\d+\.\d+")  # versions, not figures


def unrecorded_gpu_figures(text: str, runs: dict[str, list[Path]]) -> list[str]:
    """Every number in a block that names a recorded GPU but appears in none of that GPU's result files, and every
    line of a code block naming the GPU that no result file holds verbatim: ``["<block start>: <figure>", ...]``.

    A block is a paragraph, a list item, a table row or a fenced code block; numbers inside inline code (a flag's
    value, a function's return value) and version numbers are left out of prose. A block that quotes a GPU run names
    the GPU. A figure the document derives in its ``## Derived numbers`` table (a ratio of two GPU figures, say) is
    accepted: tests/test_provenance.py holds each row to inputs printed in committed outputs or to a citation."""
    derived, _ = provenance.derived_numbers(text, set())
    text = provenance.DERIVED.sub(lambda match: "\n" * match.group(0).count("\n"), text)
    problems = []
    for block, is_code in markdown_blocks(text):
        named = [model for model in runs if re.search(rf"\b{model}\b", block)]
        if not named:
            continue
        # a block may compare runs of two GPUs: each figure must be in the records of one GPU it names
        recorded = "\n".join(
            path.read_text()
            for model in named
            for folder in runs[model]
            for path in sorted(folder.iterdir())
            if path.suffix in (".md", ".txt", ".log", ".json")
        )
        recorded_numbers = set(NUMBER.findall(recorded))
        where = block.strip().splitlines()[0][:60]
        prose = block if is_code else VERSION.sub("", re.sub(r"`[^`]*`", "", block))  # names, values, versions
        problems += [
            f"{where}: {number}"
            for number in NUMBER.findall(prose)
            if number not in recorded_numbers and not {number.replace(",", ""), f"{number}%"} & derived.keys()
        ]
        if is_code:
            problems += [
                f"{where}: line {line.strip()!r}"
                for line in block.splitlines()
                if line.strip() and line.strip() not in recorded
            ]
    return problems


def test_the_figure_checker_finds_a_number_no_gpu_run_recorded():
    runs = gpu_runs()
    assert "H100" in runs
    assert unrecorded_gpu_figures("On one H100, fp32 ran at 70,248 samples/s.", runs) == []
    assert unrecorded_gpu_figures("On one H100, fp32 ran at 71,000 samples/s.", runs) == [
        "On one H100, fp32 ran at 71,000 samples/s.: 71,000"
    ]
    assert unrecorded_gpu_figures("```\nH100 made up line\n```", runs) == [
        "H100 made up line: line 'H100 made up line'"
    ]
    assert unrecorded_gpu_figures("On a CPU: 71,000 samples/s.", runs) == []  # names no GPU: not a GPU figure
    derived = "On one H100, bf16 ran 1.23x fp32 in PyTorch 2.14.1.\n\n## Derived numbers\n| figure | how |\n|---|---|\n"
    assert unrecorded_gpu_figures(derived + "| 1.23x | 1 / 2 |\n", runs) == []
    assert unrecorded_gpu_figures(derived + "| 1.25x | 1 / 2 |\n", runs) == [
        "On one H100, bf16 ran 1.23x fp32 in PyTorch 2.14.1.: 1.23"
    ]


@pytest.mark.parametrize(
    "document", ["README.md", *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "lessons").glob("*.md"))]
)
def test_every_figure_a_document_quotes_from_a_gpu_run_is_in_that_runs_recorded_files(document):
    assert unrecorded_gpu_figures((REPO / document).read_text(), gpu_runs()) == []
