"""Run and measure the course on a machine with NVIDIA GPUs, in one command, and record what it measured.

    make gpu-check                               # writes results/<gpu-model>/, with the machine's own python3
    make gpu-check RESULTS=/tmp/out              # writes /tmp/out/<gpu-model>/ instead
    python3 scripts/gpu_check.py --dry-run       # any machine: lists what it would run, runs nothing

In this order, each part under a time limit so that the whole stays within ``--budget`` seconds:
1. every solution under ``torchrun --standalone --nproc_per_node=<GPUs>`` (NCCL), the training ones on digits for a
   few batches: pass/FAIL;
2. ``benchmarks/mixed_precision.py``: SimpleCNN at batch 256 in fp32 (TF32 off), tf32, bf16 and fp16;
3. ``benchmarks/fsdp_memory.py`` at world sizes 1, 2, 4, ... up to the GPUs: model state and CUDA peak per strategy;
4. ``solutions/06_profiling.py`` on all the GPUs: a profile of DDP steps (costliest kernels, each rank's breakdown,
   HTA's view), one Chrome trace per rank and a CUDA memory snapshot;
5. the tests marked ``cuda`` (``pytest -m cuda``);
6. ``benchmarks/ddp_scaling.py`` with gloo on the CPU cores (GPUs hidden), 1, 2, 4 and 8 processes, one thread each.

It writes at most six files into the results folder: ``summary.md`` (versions, the pass/fail table and every
benchmark's printed table), ``gpu_check.json`` (the same as data), ``logs.txt`` (everything the commands printed),
``memory_snapshot.pickle`` (rank 0's CUDA allocations, for https://pytorch.org/memory_viz) and ``traces/rank0.json``,
``traces/rank1.json`` (the traces of the other ranks are deleted once the profile has read them). It installs
nothing from the network: a package the machine lacks can be brought as wheels in ``.whl/`` (``--wheels``),
installed into a temporary folder for this run only.
"""

import argparse
import datetime
import importlib.util
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOLUTION_ARGS = ["--dataset", "digits", "--epochs", "1", "--max-batches-per-epoch", "5"]  # a few batches of real data
# import name -> package name, for what the solutions, benchmarks and tests import beyond the standard library
REQUIRED = {
    "torch": "torch",
    "numpy": "numpy",
    "sklearn": "scikit-learn",
    "tqdm": "tqdm",
    "pytest": "pytest",
    "matplotlib": "matplotlib",
    "yaml": "pyyaml",
    "psutil": "psutil",
    "pynvml": "nvidia-ml-py",
    "tensorboard": "tensorboard",
}
# Holistic Trace Analysis: without it the profile step runs all the same, less HTA's view of the traces.
OPTIONAL = {"hta": "holistictraceanalysis"}
TRACES_KEPT = 2  # rank0.json and rank1.json: a results folder stays small whatever the number of GPUs


@dataclass
class Step:
    """One command of the check. ``command`` starts with ``torchrun`` or ``python`` (this interpreter runs them)."""

    name: str
    part: str
    command: list[str]
    timeout: int
    env: dict = field(default_factory=dict)
    json_file: str | None = None  # the command writes its figures here (a file name in the scratch folder)
    needs_gpus: int = 1  # a machine with fewer skips the step, saying why in one line, and does not fail for it

    def shown(self) -> str:
        """The command as a reader would type it, environment variables first."""
        return " ".join([*(f"{key}={value}" for key, value in self.env.items()), shlex.join(self.command)])


def composition_mesh(num_gpus: int) -> list[str]:
    """Solution 17's mesh for ``num_gpus`` GPUs: 2 stages x 2 context x 2 tensor ranks (data ranks: the rest) where
    8 divide the count, 2 stages x 2 tensor ranks where 4 do, 2 tensor ranks where 2 do, else the 1-D FSDP control;
    a global batch of 8 sequences per GPU, so that every data rank's share splits into the 2 micro-batches."""
    batch = ["--batch-size", str(8 * num_gpus)]
    if num_gpus % 8 == 0:
        return ["--pp", "2", "--cp", "2", "--tp", "2", *batch]
    if num_gpus % 4 == 0:
        return ["--pp", "2", "--tp", "2", *batch]
    return ["--tp", "2", *batch] if num_gpus % 2 == 0 else ["--control", *batch]


def plan(num_gpus: int, cpu_cores: int, out_dir: Path, scratch: Path) -> list[Step]:
    """Every step of the check, in order, for a machine with ``num_gpus`` GPUs and ``cpu_cores`` cores."""
    torchrun = ["torchrun", "--standalone", f"--nproc_per_node={num_gpus}"]
    steps = [
        Step("01_ddp_basic", "solutions", [*torchrun, "solutions/01_ddp_basic.py", *SOLUTION_ARGS], 180),
        Step(
            "02_gradient_accumulation",
            "solutions",
            [*torchrun, "solutions/02_gradient_accumulation.py", *SOLUTION_ARGS],
            180,
        ),
        Step("03_fsdp", "solutions", [*torchrun, "solutions/03_fsdp.py", *SOLUTION_ARGS, "--model", "mlp"], 180),
        *(
            Step(
                f"04_mixed_precision {precision}",
                "solutions",
                [*torchrun, "solutions/04_mixed_precision.py", *SOLUTION_ARGS, "--precision", precision],
                180,
            )
            for precision in ("fp32", "bf16", "fp16")
        ),
        Step(
            "05_multi_node (crash at step 3, one restart)",
            "solutions",
            [
                *torchrun,
                "--max-restarts",
                "1",
                "solutions/05_multi_node.py",
                *SOLUTION_ARGS,
                "--checkpoint-dir",
                str(scratch / "checkpoints"),
                "--checkpoint-every",
                "2",
                "--fail-at-step",
                "3",
            ],
            240,
            env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        ),
        Step(
            "07_ring_allreduce",
            "solutions",
            [*torchrun, "solutions/07_ring_allreduce.py", "--sizes", "4K", "1M", "16M"],
            180,
        ),
        Step(
            "08_dp_vs_ddp",
            "solutions",
            [*torchrun, "solutions/08_dp_vs_ddp.py", "--model", "simplecnn", "--steps", "10"],
            180,
        ),
        Step("09_ddp_by_hand", "solutions", [*torchrun, "solutions/09_ddp_by_hand.py", *SOLUTION_ARGS], 180),
        Step(
            "10_zero_by_hand (ZeRO-3, bf16 gathers)",
            "solutions",
            [*torchrun, "solutions/10_zero_by_hand.py", *SOLUTION_ARGS, "--compute-dtype", "bf16"],
            180,
        ),
        *(
            Step(
                f"11_powersgd ({hook}, compressing from step 2)",
                "solutions",
                [*torchrun, "solutions/11_powersgd.py", *SOLUTION_ARGS, "--hook", hook, "--start-iter", "2"],
                180,
            )
            for hook in ("powersgd", "torch-powersgd")
        ),
        Step(
            "12_pipeline (GPipe, a stage per GPU)",
            "solutions",
            [*torchrun, "solutions/12_pipeline.py", *SOLUTION_ARGS, "--schedule", "gpipe"],
            180,
        ),
        Step(
            "13_tensor_parallel (attention and MLP split over the GPUs by hand)",
            "solutions",
            [*torchrun, "solutions/13_tensor_parallel.py", *SOLUTION_ARGS],
            180,
        ),
        Step(
            "14: the GPT on text, activations recomputed by hand",
            "solutions",
            [
                *torchrun,
                "solutions/14_activation_memory.py",
                "--recompute",
                "by-hand",
                "--epochs",
                "1",
                "--max-batches-per-epoch",
                "5",
                "--val-batches",
                "2",
            ],
            120,
        ),
        Step(
            "15: the GPT with its sequence split over the GPUs, keys and values passed around a ring",
            "solutions",
            [*torchrun, "solutions/15_context_parallel.py", "--epochs", "1", "--max-batches-per-epoch", "5"],
            120,
        ),
        Step(
            "15: PyTorch's context_parallel (CUDA SDPA kernels, NCCL)",
            "solutions",
            [*torchrun, "solutions/15_context_parallel.py", "--method", "torch", "--context", "1024"]
            + ["--epochs", "1", "--max-batches-per-epoch", "5"],
            120,
            needs_gpus=2,
        ),
        Step(
            "16: the GPT with mixture-of-experts MLPs, the experts split over the GPUs",
            "solutions",
            [
                *torchrun,
                "solutions/16_mixture_of_experts.py",
                "--epochs",
                "1",
                "--max-batches-per-epoch",
                "5",
                "--val-batches",
                "2",
            ],
            120,
        ),
        Step(
            "17: the GPT on a pipeline x data x context x tensor mesh of the GPUs (1-D FSDP on an odd count)",
            "solutions",
            [*torchrun, "solutions/17_composition.py", *composition_mesh(num_gpus), "--steps", "5"],
            120,
        ),
        Step(
            "mixed precision",
            "benchmarks",
            [
                "python",
                "benchmarks/mixed_precision.py",
                "--model",
                "simplecnn",
                "--batch-size",
                "256",
                "--json",
                str(scratch / "mixed_precision.json"),
            ],
            240,
            json_file="mixed_precision.json",
        ),
    ]
    steps.append(
        Step(
            "hand-built DDP against torch's DDP",
            "benchmarks",
            [*torchrun, "benchmarks/ddp_by_hand.py", "--json", str(scratch / "ddp_by_hand.json")],
            180,
            json_file="ddp_by_hand.json",
        )
    )
    world_sizes = [size for size in (1, 2, 4, 8, 16, 32, 64) if size <= num_gpus]
    steps += [
        Step(
            f"FSDP2 and ZeRO memory, {size} GPU(s)",
            "benchmarks",
            [
                "torchrun",
                "--standalone",
                f"--nproc_per_node={size}",
                "benchmarks/fsdp_memory.py",
                "--width",
                "4096",
                "--depth",
                "8",
                "--json",
                str(scratch / f"fsdp_memory_{size}.json"),
            ],
            180,
            json_file=f"fsdp_memory_{size}.json",
        )
        for size in world_sizes
    ]
    steps += [
        # The profiler records steps 3-5 of one epoch, on every rank: the global batch stays 256 so that every GPU
        # still gets the 5 batches (a batch of 256 per GPU would leave it 3 of the digits on 2 GPUs).
        Step(
            "profile of DDP steps (solutions/06_profiling.py)",
            "benchmarks",
            [
                *torchrun,
                "solutions/06_profiling.py",
                *SOLUTION_ARGS,
                "--model",
                "simplecnn",
                "--batch-size",
                str(256 // num_gpus),
                "--trace-dir",
                str(out_dir / "traces"),
                "--metrics-file",
                str(scratch / "profile.json"),
                "--memory-snapshot",
                str(out_dir / "memory_snapshot.pickle"),
            ],
            180,
            json_file="profile.json",
        ),
        # the notebook tests need jupytext, which GPU machines may lack, and none of them is marked cuda
        Step(
            "tests marked cuda",
            "tests",
            [
                "python",
                "-m",
                "pytest",
                "-q",
                "-m",
                "cuda",
                "-p",
                "no:cacheprovider",
                "-o",
                "addopts=",
                "tests",
                "--ignore=tests/test_notebooks.py",
            ],
            240,
        ),
    ]
    process_counts = [count for count in (1, 2, 4, 8) if count <= cpu_cores]
    steps.append(
        Step(
            "DDP scaling on CPU cores (gloo)",
            "benchmarks",
            [
                "python",
                "benchmarks/ddp_scaling.py",
                "--nproc",
                *map(str, process_counts),
                "--cpu",
                "--threads",
                "1",
                "--epochs",
                "3",
                "--json",
                str(scratch / "ddp_scaling.json"),
            ],
            300,
            json_file="ddp_scaling.json",
        )
    )
    return steps


def executable(command: list[str]) -> list[str]:
    """``torchrun`` and ``python`` of a step, run with this interpreter (the machine's PyTorch)."""
    head = {"torchrun": [sys.executable, "-m", "torch.distributed.run"], "python": [sys.executable]}[command[0]]
    return [*head, *command[1:]]


def first_error_line(output: str) -> str:
    """The line that names the first exception raised (``SomeError: message``), or else the last line printed."""
    for line in output.splitlines():
        if re.match(r"^\s*[\w.]*(Error|Exception|Interrupt)\b:?", line) or line.startswith("error:"):
            return line.strip()[:200]
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


def run_step(step: Step, timeout: float, env: dict, scratch: Path) -> dict:
    """Run one step in its own process group (a timeout ends torchrun's workers too); return what happened."""
    start = time.perf_counter()
    process = subprocess.Popen(
        executable(step.command),
        cwd=REPO,
        env={**env, **step.env},
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
        status = "pass" if process.returncode == 0 else "FAIL"
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        status = "timeout"
    result = {
        "name": step.name,
        "part": step.part,
        "command": step.shown(),
        "status": status,
        "seconds": round(time.perf_counter() - start, 1),
        "output": output,
    }
    if status != "pass":
        result["error"] = f"no result within {timeout:.0f} s" if status == "timeout" else first_error_line(output)
    if status == "pass" and step.json_file:
        result["data"] = json.loads((scratch / step.json_file).read_text())
    return result


def machine_facts() -> dict:
    """The GPUs, the versions (PyTorch, CUDA, cuDNN, NCCL, driver, Python), the CPU cores and the date."""
    import torch

    facts = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpus": [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "python": platform.python_version(),
        "cpu_cores": os.cpu_count(),
    }
    try:
        facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except (AttributeError, RuntimeError):
        facts["nccl"] = None
    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        facts["driver"] = driver.stdout.split()[0] if driver.stdout.split() else None
    except (OSError, subprocess.TimeoutExpired):
        facts["driver"] = None
    return facts


def folder_name(gpus: list[str]) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``; several GPUs add ``-x<count>``."""
    slug = re.sub(r"[^a-z0-9]+", "-", gpus[0].lower()).strip("-")
    return slug if len(gpus) == 1 else f"{slug}-x{len(gpus)}"


def summary_markdown(report: dict) -> str:
    """The Markdown summary: versions, a pass/fail row per step, and each passing benchmark's printed output."""
    facts = report["facts"]
    gpus = facts["gpus"]
    lines = [
        f"# GPU check, {facts['date']}",
        "",
        f"- GPU: {gpus[0]} x {len(gpus)}" if gpus else "- GPU: none",
        f"- PyTorch {facts['torch']}, CUDA {facts['cuda']}, cuDNN {facts['cudnn']}, NCCL {facts['nccl']}, "
        f"driver {facts['driver']}, Python {facts['python']}, {facts['cpu_cores']} CPU cores",
        f"- `make gpu-check`, {report['seconds']:.0f} s in all",
        "",
        "| part | step | result | seconds | first error line |",
        "|---|---|---|---|---|",
    ]
    for step in report["steps"]:
        error = step.get("error", "").replace("|", "/")
        lines.append(f"| {step['part']} | {step['name']} | {step['status']} | {step['seconds']} | {error} |")
    for step in report["steps"]:
        if step["part"] != "solutions" and step["status"] == "pass":
            printed = [line for line in step["output"].splitlines() if not is_noise(line)]
            lines += ["", f"## {step['name']}", "", f"`{step['command']}`", "", "```", *printed, "```"]
    return "\n".join(lines) + "\n"


def is_noise(line: str) -> bool:
    """torchrun's thread warning banner and the profiler's logging: not the benchmark's output."""
    return (
        line.startswith(("W1", "I1", "*****", "USDT:", "ERROR:", "WARNING:"))
        or "OMP_NUM_THREADS" in line
        or "UserWarning" in line
        or "_warn_once(" in line
        or not line.strip()
    )


def write_results(folder: Path, report: dict) -> list[Path]:
    """Write ``gpu_check.json``, ``summary.md`` and ``logs.txt`` into ``folder``; return the paths."""
    folder.mkdir(parents=True, exist_ok=True)
    data = {
        **report,
        "steps": [{key: value for key, value in step.items() if key != "output"} for step in report["steps"]],
    }
    paths = [folder / "gpu_check.json", folder / "summary.md", folder / "logs.txt"]
    paths[0].write_text(json.dumps(data, indent=2) + "\n")
    paths[1].write_text(summary_markdown(report))
    paths[2].write_text(
        "".join(
            f"=== {step['name']}: {step['command']} ({step['status']}, {step['seconds']} s)\n{step['output']}\n"
            for step in report["steps"]
        )
    )
    return paths


def missing_packages(packages: dict = REQUIRED) -> list[str]:
    """The packages of ``packages`` (import name -> package name) this interpreter cannot import."""
    return [package for module, package in packages.items() if importlib.util.find_spec(module) is None]


def keep_first_traces(trace_dir: Path, kept: int = TRACES_KEPT) -> None:
    """Delete the traces ``rank{N}.json`` of ranks ``kept`` and above from ``trace_dir``, if it exists: the profile
    step has read them all, and rank 0 with one peer is what a reader opens."""
    for path in trace_dir.glob("rank*.json"):
        rank = path.stem.removeprefix("rank")
        if rank.isdigit() and int(rank) >= kept:
            path.unlink()


def install_wheels(wheels: Path, target: Path) -> None:
    """Install the wheels in ``wheels`` into ``target`` without the network; the caller puts it on PYTHONPATH."""
    found = sorted(wheels.glob("*.whl"))
    if found:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-index",
                "--no-deps",
                "--no-compile",
                "--target",
                str(target),
                *map(str, found),
            ],
            check=True,
        )
        sys.path.insert(0, str(target))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=REPO / "results",
        help="the results go into a folder named after the GPU inside this one",
    )
    parser.add_argument("--budget", type=float, default=570, help="seconds for the whole check")
    parser.add_argument("--wheels", type=Path, default=REPO / ".whl", help="wheels to install first, if any")
    parser.add_argument("--dry-run", action="store_true", help="list the steps and run nothing")
    parser.add_argument("--gpus", type=int, help="with --dry-run: plan for this many GPUs (default: those visible)")
    return parser.parse_args(argv)


def main(args) -> int:
    if args.dry_run:
        num_gpus = args.gpus or 1
        for step in plan(num_gpus, os.cpu_count() or 1, args.results / "<gpu-model>", Path("<scratch>")):
            skipped = f" (needs {step.needs_gpus}+ GPUs: skipped here)" if step.needs_gpus > num_gpus else ""
            print(f"[{step.part}] {step.name} (at most {step.timeout} s){skipped}: {step.shown()}")
        return 0
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    install_wheels(args.wheels, scratch / "site")
    missing = missing_packages()
    if "torch" in missing:
        print(f"gpu-check: {sys.executable} has no PyTorch; run it with the machine's own python3", file=sys.stderr)
        return 1
    import torch

    if not torch.cuda.is_available():
        print(
            f"gpu-check: no CUDA GPU visible to {sys.executable} (PyTorch {torch.__version__}); nothing to check "
            "here, run it on a machine with an NVIDIA GPU (or add --dry-run to list what it runs)",
            file=sys.stderr,
        )
        return 1
    facts = machine_facts()
    folder = args.results / folder_name(facts["gpus"])
    folder.mkdir(parents=True, exist_ok=True)
    print(
        f"gpu-check: {len(facts['gpus'])} x {facts['gpus'][0]}, PyTorch {facts['torch']}; writing {folder}", flush=True
    )
    if missing:
        print(
            f"gpu-check: missing {', '.join(missing)}: the steps that need them will fail; bring them as "
            f"wheels in {args.wheels}",
            flush=True,
        )
    for package in missing_packages(OPTIONAL):
        print(f"gpu-check: no {package}: the profile step leaves out HTA's view of the traces", flush=True)
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(scratch / "site"), str(REPO), os.environ.get("PYTHONPATH")])),
    }
    start = time.perf_counter()
    report = {"facts": facts, "missing_packages": missing, "steps": [], "seconds": 0.0}
    for step in plan(len(facts["gpus"]), facts["cpu_cores"] or 1, folder, scratch):
        remaining = args.budget - (time.perf_counter() - start)
        if step.needs_gpus > len(facts["gpus"]):
            result = {
                "name": step.name,
                "part": step.part,
                "command": step.shown(),
                "status": "n/a",
                "seconds": 0,
                "output": "",
                "error": f"needs {step.needs_gpus}+ GPUs (one GPU cannot host two NCCL ranks); skipped",
            }
        elif remaining < 20:
            result = {
                "name": step.name,
                "part": step.part,
                "command": step.shown(),
                "status": "skipped",
                "seconds": 0,
                "output": "",
                "error": f"the {args.budget:.0f} s budget was spent",
            }
        else:
            result = run_step(step, min(step.timeout, remaining), env, scratch)
        keep_first_traces(folder / "traces")  # after the profile step, even one that failed midway
        report["steps"].append(result)
        report["seconds"] = time.perf_counter() - start
        print(f"  {result['status']:>7} {result['seconds']:>6} s  {step.name}  {result.get('error', '')}", flush=True)
        write_results(folder, report)  # after every step: a run cut short still leaves what it measured
    failed = [step["name"] for step in report["steps"] if step["status"] not in ("pass", "n/a")]
    print(
        f"gpu-check: {len(report['steps']) - len(failed)} of {len(report['steps'])} steps passed; results in {folder}",
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(parse_args()))
