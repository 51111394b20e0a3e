"""Every command the course prints runs as written.

Where the commands come from, and what counts as one:
- the module docstring of every ``solutions/*.py``: each line indented by four or more spaces that is not a
  ``#`` comment starts a command;
- every fenced block opened with ```` ```bash ```` in ``README.md`` and ``lessons/*.md``: each line that is not
  blank and not a ``#`` comment starts a command.
A line that ends in ``\\`` continues on the next, as in a shell. Two commands are the same when their shell
words are (``shlex.split`` with comments dropped), and each runs once, at its first appearance.

The convention is a list, not a marker: every collected command is run here on CPU, or is named in ``NOT_RUN``
with the reason (GPUs, a cluster, the test suite itself, a benchmark that measures for minutes). The lessons'
blocks mix CPU and GPU lines, and a list keyed by the exact command makes a new or changed command run here (and
fail, if it cannot) until someone decides which it is. A command that is not run still has its files and its
script's options checked, and a ``NOT_RUN`` entry that no file prints any more fails.

How a command runs: through ``bash -c``, exactly as printed, in one temporary folder shared by all of them
(so that a save runs before its ``--resume``, in order), which links to the repository's ``solutions/``,
``labs/``, ``scripts/``, ``benchmarks/``, ``common/`` so that relative paths work and nothing is written into
the repository. The folder of this Python (the course's ``.venv/bin``) comes first on ``PATH``, so ``torchrun``
and ``python`` are the course's. ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` is taken out of the environment: a
command that needs it must say so itself. The network is closed (a download fails at once). Only quick-run
options are appended (``QUICK``), each only where the script's own ``--help`` lists it and the command does
not set it already, and none to a fault drill (``--fail-at-step``), which must reach its failure.
"""

import json
import os
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import NO_NETWORK, PYTHON, REPO, cluster_unavailable, load_script

# The benchmark that repeats the fault drill reads the docstrings the same way: one reader for both.
drill = load_script(REPO / "benchmarks" / "restart_drill.py")
docstring_commands, joined_lines = drill.docstring_commands, drill.joined_lines

LINKED = ("solutions", "labs", "scripts", "benchmarks", "common")
# Appended where the script accepts them, to keep the runs short: one epoch of 2 batches, 2 timed steps, 1 round;
# and a profiler schedule that fits 2 steps (warm up 1, record 1).
QUICK = {
    "--epochs": "1",
    "--max-batches-per-epoch": "2",
    "--steps": "2",
    "--rounds": "1",
    "--iterations": "2",
    "--profile-wait": "0",
    "--profile-steps": "1",
}
TIMEOUT = 240  # seconds per command; the two-node fault drill, the slowest, takes about a minute on 2 cores

FOUR_GPUS = "written for a machine with 4 GPUs (NCCL)"
MEASURES = "a benchmark, which measures for minutes by design"
# These cost a minute each here, and the lab test runs the very same launch and settings, in folders of its own.
SAME_LAUNCH = "the same rehearsal, with the same settings and its own folders, runs in tests/labs/test_05_multi_node.py"
SAME_PROFILE = "the same launch, for fewer batches, runs in tests/labs/test_06_profiling.py (and checks what it prints)"
SMALL_PRECISION = (
    "tests/test_benchmarks.py::test_the_mixed_precision_benchmark_prints_a_row_per_precision_and_"
    "bf16_saves_less_for_backward runs it on small settings (a drill of make test-slow)"
)
SAME_NOTEBOOK_12 = "notebooks/12_tensor_parallelism.ipynb runs the same launch under nbval (--num-workers 0, 2 batches)"
SOLUTION_13_ON_2X2 = (
    "tests/test_tensor_parallel.py::test_solution_13_on_a_2x2_mesh_keeps_the_shards_in_sync_and_its_two_versions_agree "
    "checks what its training computes"
)
# Each reason hangs under its command, which the formatter would not keep.
# fmt: off
NOT_RUN = {
    "torchrun --standalone --nproc_per_node=4 solutions/06_profiling.py --model simplecnn --dataset cifar10 "
    "--memory-snapshot snapshot.pickle": f"{FOUR_GPUS}; it also downloads CIFAR-10",
    "torchrun --standalone --nproc_per_node=2 solutions/06_profiling.py --dataset digits --decode-png "
    "--read-latency-ms 2 --num-workers 0": SAME_PROFILE,
    "torchrun --standalone --nproc_per_node=2 solutions/06_profiling.py --dataset digits --decode-png "
    "--read-latency-ms 2 --num-workers 6 --prefetch-factor 4": SAME_PROFILE,
    "torchrun --standalone --nproc_per_node=2 solutions/06_profiling.py --dataset digits --model mlp "
    "--bucket-cap-mb 1 --tensorboard runs/profiling": SAME_PROFILE,
    "tensorboard --logdir runs/profiling":
        "a web server that runs until stopped; tests/labs/test_06_profiling.py reads the same event files back",
    "torchrun --standalone --nproc_per_node=4 solutions/01_ddp_basic.py":
        f"{FOUR_GPUS}; it also downloads Fashion-MNIST. Its CPU twin (--dataset digits) runs here",
    "torchrun --standalone --nproc_per_node=4 solutions/02_gradient_accumulation.py --grad-accum-steps 8 "
    "--lr 0.4 --warmup-steps 30 --clip-grad-norm 1.0":
        f"{FOUR_GPUS}; it also downloads Fashion-MNIST. Its CPU twin (--dataset digits) runs here",
    "torchrun --standalone --nproc_per_node=4 solutions/03_fsdp.py --precision bf16":
        f"{FOUR_GPUS}; it also downloads Fashion-MNIST. Its CPU twin (--dataset digits) runs here",
    "torchrun --standalone --nproc_per_node=4 solutions/04_mixed_precision.py --model simplecnn --dataset cifar10 "
    "--precision bf16": f"{FOUR_GPUS}, bf16 on Ampere or newer; it also downloads CIFAR-10",
    "torchrun --standalone --nproc_per_node=4 solutions/04_mixed_precision.py --model simplecnn --dataset cifar10 "
    "--precision fp16 --clip-grad-norm 1.0": f"{FOUR_GPUS}; it also downloads CIFAR-10",
    "torchrun --standalone --nproc_per_node=4 solutions/07_ring_allreduce.py --sizes 1M 64M 256M":
        f"{FOUR_GPUS}: 256 MB tensors",
    "torchrun --standalone --nproc_per_node=4 solutions/08_dp_vs_ddp.py":
        f"{FOUR_GPUS}: DataParallel needs 2 or more GPUs",
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d "
    "--rdzv-endpoint NODE0:29400 --rdzv-id job42 --max-restarts 3 solutions/05_multi_node.py "
    "--checkpoint-dir /shared/checkpoints/job42":
        "a cluster: two nodes of 4 GPUs, NODE0 and /shared are placeholders. The same launch with two local "
        "launchers (scripts/rehearse_two_nodes.py) runs here",
    "torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint NODE0:29400 --rdzv-id bw "
    "solutions/07_ring_allreduce.py --algorithms dist.all_reduce --sizes 16M 256M 1G":
        "a cluster: one process on each of two nodes, NODE0 is a placeholder. Its local rehearsal runs here",
    "sbatch launch/slurm_multi_node.sbatch":
        "a SLURM cluster of 4-GPU nodes; tests/test_slurm_cluster.py runs the same file on CPU nodes under a real "
        "SLURM (make test-cluster)",
    "python scripts/slurm_cluster.py --nodes 2 -- --gpus-per-node=0 --cpus-per-task=1 "
    "--export=ALL,NPROC_PER_NODE=1,MAX_RESTARTS=1 launch/slurm_multi_node.sbatch solutions/05_multi_node.py "
    "--dataset digits --epochs 2 --batch-size 32 --checkpoint-every 4 --checkpoint-dir checkpoints/slurm "
    "--fail-at-step 14":
        "root and SLURM's daemons: tests/test_slurm_cluster.py runs the same drill under make test-cluster, "
        "in folders of its own",
    "make test-cluster": "root, apt-get and SLURM's daemons: CI runs it after make test-slow (.ci/run)",
    "kubectl apply -f launch/pytorchjob_multi_node.yaml":
        "a Kubernetes cluster with the Kubeflow training operator; tests/test_multi_node.py checks the YAML",
    "torchrun --standalone --nproc_per_node=2 benchmarks/grad_accumulation.py --steps 5 --rounds 5":
        f"{MEASURES}; tests/test_benchmarks.py::test_the_accumulation_benchmark_counts_one_all_reduce_round_per_"
        "effective_step_under_no_sync runs it on small settings",
    "python benchmarks/mixed_precision.py": f"{MEASURES}: 4 minutes or more on 2 cores; {SMALL_PRECISION}",
    "python benchmarks/mixed_precision.py --model lenet --steps 20": f"{MEASURES}; {SMALL_PRECISION}",
    "python benchmarks/lr_scaling.py": f"{MEASURES}: four training runs, over 2 minutes on 2 shared cores even "
                                       "with --epochs 1",
    "python scripts/rehearse_two_nodes.py -- solutions/05_multi_node.py --dataset digits --epochs 2 --batch-size 32 "
    "--checkpoint-every 4 --checkpoint-dir checkpoints/rehearsal/node{node}":
        f"{SAME_LAUNCH}::test_two_launchers_form_a_world_of_4_and_only_global_rank_0_writes",
    "python scripts/rehearse_two_nodes.py --max-restarts 1 -- solutions/05_multi_node.py --dataset digits --epochs 2 "
    "--batch-size 32 --checkpoint-every 4 --checkpoint-dir checkpoints/drill_two_nodes --fail-at-step 14":
        f"{SAME_LAUNCH}::test_a_crash_with_max_restarts_resumes_to_bit_identical_parameters",
    "python scripts/cluster.py --nodes 2 --procs-per-node 1 --link 1gbit -- benchmarks/zero_by_hand.py":
        f"{MEASURES}: ZeRO-3's step time over the emulated link; notebook 08 runs the benchmark on loopback with "
        "small settings, and tests/test_cluster.py runs scripts/cluster.py",
    "python benchmarks/cluster_network.py --out results/cpu-amd-epyc-2core/cluster_network":
        f"{MEASURES}: every part in turn on the emulated cluster; tests/test_cluster.py checks the "
        "emulator, and each part's scripts run here on loopback",
    "make demo": "make needs the repository as its folder and would set up .venv there; the torchrun line it runs "
                 "(solutions/01_ddp_basic.py --dataset digits on 2 processes) runs here",
    "make test": "the whole test suite, of which this test is a part",
    "LAB_TARGET=labs .venv/bin/python -m pytest tests/labs/test_07_ring_allreduce.py":
        "a starter fails its lab tests until the reader finishes it; "
        "tests/test_labs.py::test_the_starter_still_fails_its_lab_tests checks that it does",
    "LAB_TARGET=labs .venv/bin/python -m pytest tests/labs/test_01_ddp_basic.py":
        "a starter fails its lab tests until the reader finishes it; "
        "tests/test_labs.py::test_the_starter_still_fails_its_lab_tests checks that it does",
    ".venv/bin/python -m pytest tests/test_join.py -k test_join_lets_each_rank_run_its_own_number_of_steps":
        "a test of this suite, which the suite runs itself",
    ".venv/bin/python -m pytest tests/test_memory.py tests/test_fsdp.py tests/labs/test_03_fsdp.py":
        "test files of this suite, which the suite runs itself",
    "torchrun --standalone --nproc_per_node=4 solutions/09_ddp_by_hand.py --ddp bucketed":
        f"{FOUR_GPUS}; it also downloads Fashion-MNIST. Its CPU twin (--dataset digits) runs here",
    "torchrun --standalone --nproc_per_node=4 solutions/10_zero_by_hand.py --zero 3 --compute-dtype bf16":
        f"{FOUR_GPUS}; it also downloads Fashion-MNIST. Its CPU twins (--dataset digits) run here",
    "torchrun --standalone --nproc_per_node=4 solutions/11_powersgd.py --model mlp":
        f"{FOUR_GPUS}; it also downloads Fashion-MNIST. Its CPU twins (--dataset digits) run here",
    "torchrun --standalone --nproc_per_node=4 solutions/12_pipeline.py --microbatches 8":
        f"{FOUR_GPUS}; it also downloads Fashion-MNIST. Its CPU twins (--dataset digits) run here",
    "torchrun --standalone --nproc_per_node=4 solutions/13_tensor_parallel.py":
        f"{FOUR_GPUS}; it also downloads Fashion-MNIST. Its CPU twins (--dataset digits) run here",
    "torchrun --standalone --nproc_per_node=2 benchmarks/ddp_by_hand.py":
        "a benchmark, which times every build for most of a minute; tests/test_ddp_by_hand.py::test_the_benchmark_"
        "prints_a_row_per_build_with_its_ratio_to_torch_ddp runs it on small settings (make test-slow)",
    ".venv/bin/python -m pytest tests/test_ddp_by_hand.py tests/test_zero_by_hand.py":
        "test files of this suite, which the suite runs itself",
    "LAB_TARGET=labs .venv/bin/python -m pytest tests/labs/test_09_ddp_by_hand.py tests/labs/test_10_zero_by_hand.py":
        "the starters fail their lab tests until the reader finishes them; "
        "tests/test_labs.py::test_the_starter_still_fails_its_lab_tests checks that they do",
    ".venv/bin/python -m pytest tests/test_profiling.py tests/test_monitoring.py tests/test_data_loading.py "
    "tests/test_scaling.py": "test files of this suite, which the suite runs itself",
    "LAB_TARGET=labs .venv/bin/python -m pytest tests/labs/test_06_profiling.py":
        "a starter fails its lab tests until the reader finishes it; "
        "tests/test_labs.py::test_the_starter_still_fails_its_lab_tests checks that it does",
    "OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 benchmarks/data_loading.py":
        "a benchmark, which climbs five loaders for most of a minute; notebooks/09_profiling_and_scaling.ipynb runs "
        "it under nbval, and tests/test_data_loading.py::test_the_benchmark_prints_a_row_per_rung_and_writes_its_"
        "figures on small settings",
    "python benchmarks/ddp_scaling.py --mode both --plot runs/ddp_scaling.png":
        "a benchmark, which launches five torchruns for most of a minute; notebooks/09_profiling_and_scaling.ipynb "
        "runs it under nbval on small settings",
    "python benchmarks/gradient_compression.py --plot runs/gradient_compression.png":
        "a benchmark, which trains 24 runs for minutes; notebooks/10_gradient_compression.ipynb runs it under nbval "
        "on small settings",
    ".venv/bin/python -m pytest tests/test_compression.py tests/labs/test_11_powersgd.py":
        "test files of this suite, which the suite runs itself",
    "torchrun --standalone --nproc_per_node=2 benchmarks/pipeline_schedules.py":
        "a benchmark, which times 13 runs for a minute or two; tests/test_benchmarks.py::test_the_pipeline_"
        "benchmark_prints_a_row_per_schedule_and_ddp runs it on small settings (make test-slow)",
    "python scripts/cluster.py --nodes 2 --procs-per-node 1 --link 1gbit -- benchmarks/pipeline_schedules.py":
        "the same benchmark over the emulated link; tests/test_benchmarks.py runs it on loopback with small "
        "settings, and tests/test_cluster.py runs scripts/cluster.py",
    ".venv/bin/python -m pytest tests/test_pipeline.py tests/labs/test_12_pipeline.py":
        "test files of this suite, which the suite runs itself",
    "LAB_TARGET=labs .venv/bin/python -m pytest tests/labs/test_12_pipeline.py":
        "a starter fails its lab tests until the reader finishes it; "
        "tests/test_labs.py::test_the_starter_still_fails_its_lab_tests checks that it does",
    "LAB_TARGET=labs .venv/bin/python -m pytest tests/labs/test_11_powersgd.py":
        "a starter fails its lab tests until the reader finishes it; "
        "tests/test_labs.py::test_the_starter_still_fails_its_lab_tests checks that it does",
    "torchrun --standalone --nproc_per_node=2 solutions/13_tensor_parallel.py --dataset digits --tp torch":
        f"{SAME_NOTEBOOK_12}; tests/test_tensor_parallel.py::test_torchs_whole_layer_equals_the_by_hand_one_with_two_"
        "all_reduces_forward_and_two_backward checks its layer",
    "torchrun --standalone --nproc_per_node=4 solutions/13_tensor_parallel.py --dataset digits --data-parallel 2 "
    "--batch-size 32": f"{SAME_NOTEBOOK_12}; {SOLUTION_13_ON_2X2}",
    "torchrun --standalone --nproc_per_node=4 solutions/13_tensor_parallel.py --dataset digits --data-parallel 2 "
    "--batch-size 32 --tp torch": f"{SAME_NOTEBOOK_12}; {SOLUTION_13_ON_2X2}",
    ".venv/bin/python -m pytest tests/test_tensor_parallel.py tests/labs/test_13_tensor_parallel.py":
        "test files of this suite, which the suite runs itself",
    "LAB_TARGET=labs .venv/bin/python -m pytest tests/labs/test_13_tensor_parallel.py":
        "a starter fails its lab tests until the reader finishes it; "
        "tests/test_labs.py::test_the_starter_still_fails_its_lab_tests checks that it does",
    ".venv/bin/python -m pytest tests/test_activations.py tests/test_sequence_parallel.py "
    "tests/labs/test_14_activation_memory.py": "test files of this suite, which the suite runs itself",
    "LAB_TARGET=labs .venv/bin/python -m pytest tests/labs/test_14_activation_memory.py":
        "a starter fails its lab tests until the reader finishes it; "
        "tests/test_labs.py::test_the_starter_still_fails_its_lab_tests checks that it does",
    "torchrun --standalone --nproc_per_node=4 solutions/14_activation_memory.py --parallel sequence --regather "
    "--d-model 512 --heads 8 --layers 8 --context 512 --batch-size 8":
        f"{FOUR_GPUS}; its CPU twins (--parallel sequence, torch-sequence) run here, and "
        "tests/test_sequence_parallel.py checks --regather on 2 and 4 ranks",
    ".venv/bin/python -m pytest tests/test_moe.py tests/labs/test_16_mixture_of_experts.py":
        "test files of this suite, which the suite runs itself",
    "LAB_TARGET=labs .venv/bin/python -m pytest tests/labs/test_16_mixture_of_experts.py":
        "a starter fails its lab tests until the reader finishes it; "
        "tests/test_labs.py::test_the_starter_still_fails_its_lab_tests checks that it does",
    "torchrun --standalone --nproc_per_node=8 solutions/16_mixture_of_experts.py --experts 16 --top-k 2 "
    "--d-model 512 --heads 8 --layers 8 --context 512 --batch-size 8":
        "written for a machine with 8 GPUs (NCCL); its CPU twins on 2 and 4 processes run here, and "
        "tests/test_moe.py checks the layer on 2 and 4 ranks",
    ".venv/bin/python -m pytest tests/test_parallelize.py tests/test_planner.py tests/labs/test_17_composition.py":
        "test files of this suite, which the suite runs itself",
    "LAB_TARGET=labs .venv/bin/python -m pytest tests/labs/test_17_composition.py":
        "a starter fails its lab tests until the reader finishes it; "
        "tests/test_labs.py::test_the_starter_still_fails_its_lab_tests checks that it does",
    "torchrun --standalone --nproc_per_node=8 solutions/17_composition.py --pp 2 --dp 2 --tp 2 "
    "--d-model 512 --heads 8 --layers 8 --context 512 --batch-size 32 --steps 50":
        "written for a machine with 8 GPUs (NCCL); tests/test_parallelize.py runs the same mesh on 8 CPU processes",
    ".venv/bin/python scripts/cluster.py --nodes 2 --procs-per-node 1 --link 100mbit -- "
    "benchmarks/ring_attention_overlap.py": f"{MEASURES}; its recorded run is "
    "results/cpu-amd-epyc-2core/ring_attention_overlap_100mbit.txt",
    ".venv/bin/python -m pytest tests/test_context_parallel.py tests/labs/test_15_context_parallel.py":
        "test files of this suite, which the suite runs itself",
    "LAB_TARGET=labs .venv/bin/python -m pytest tests/labs/test_15_context_parallel.py":
        "a starter fails its lab tests until the reader finishes it; "
        "tests/test_labs.py::test_the_starter_still_fails_its_lab_tests checks that it does",
    "torchrun --standalone --nproc_per_node=2 solutions/15_context_parallel.py --method torch --context 1024":
        "written for 2 or more GPUs: context_parallel's handler covers only CUDA attention kernels, and one GPU "
        "cannot host two NCCL ranks (make gpu-check runs it where there are two); tests/labs/"
        "test_15_context_parallel.py checks that a CPU is refused",
}
# fmt: on


def markdown_commands(path):
    """The commands of every ```bash block in a Markdown file."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", path.read_text(), flags=re.S | re.M):
        lines = [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        commands += joined_lines(lines)
    return commands


def key(command: str) -> str:
    """A command's shell words, joined: the same command however it is spaced, wrapped or commented."""
    return " ".join(shlex.split(command, comments=True))


def collect():
    """Every printed command once, in the order a reader meets them, with where it was first printed."""
    sources = [*sorted((REPO / "solutions").glob("*.py")), REPO / "README.md", *sorted((REPO / "lessons").glob("*.md"))]
    found = {}
    for path in sources:
        commands = docstring_commands(path) if path.suffix == ".py" else markdown_commands(path)
        for number, command in enumerate(commands, 1):
            found.setdefault(key(command), (f"{path.relative_to(REPO)}:{number}", command))
    return found


COMMANDS = collect()


def script_of(command: str):
    """The script that appended options reach: the last ``.py`` on the line (after a rehearsal's ``--``)."""
    return next((word for word in reversed(shlex.split(command, comments=True)) if word.endswith(".py")), None)


@pytest.fixture(scope="module")
def help_texts():
    """Each script's ``--help``, from one Python process (one import of torch instead of one per script)."""
    scripts = sorted(
        {
            script
            for script in map(script_of, (command for _, command in COMMANDS.values()))
            if script and script.split("/")[0] in LINKED
        }
    )
    program = (
        "import contextlib, io, json, runpy, sys\n"
        "texts = {}\n"
        "for path in sys.argv[1:]:\n"
        "    sys.argv, out = [path, '--help'], io.StringIO()\n"
        "    with contextlib.redirect_stdout(out):\n"
        "        try:\n"
        "            runpy.run_path(path, run_name='__main__')\n"
        "        except SystemExit:\n"
        "            pass\n"
        "    texts[path] = out.getvalue()\n"
        "print('HELP ' + json.dumps(texts))\n"
    )
    done = subprocess.run([PYTHON, "-c", program, *scripts], cwd=REPO, capture_output=True, text=True, timeout=120)
    line = next((line for line in done.stdout.splitlines() if line.startswith("HELP ")), None)
    assert line, done.stdout[-2000:] + done.stderr[-2000:]
    texts = json.loads(line[5:])
    assert all("usage:" in texts[script] for script in scripts), {s: t[:200] for s, t in texts.items()}
    return texts


def quick_options(command: str, help_texts) -> list[str]:
    """The options of ``QUICK`` that the command's script accepts and the command does not set already."""
    words = shlex.split(command, comments=True)
    script = script_of(command)
    if script is None or "--fail-at-step" in words:  # a drill must run long enough to reach its failure
        return []
    return [
        part
        for option, value in QUICK.items()
        if option not in words and re.search(rf"{option}\b", help_texts[script])
        for part in (option, value)
    ]


@pytest.fixture(scope="module")
def reader_folder(tmp_path_factory):
    """A folder that looks like the repository's root to a command, and writes nowhere else."""
    folder = tmp_path_factory.mktemp("reader")
    for name in LINKED:
        (folder / name).symlink_to(REPO / name, target_is_directory=True)
    return folder


def environment():
    env = {name: value for name, value in os.environ.items() if name != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    env.update(NO_NETWORK, PYTHONUNBUFFERED="1", PATH=os.pathsep.join([str(Path(PYTHON).parent), env.get("PATH", "")]))
    return env


def test_every_command_not_run_is_still_printed_and_the_fault_drill_runs():
    assert len(COMMANDS) >= 30, sorted(COMMANDS)  # the collection itself works: it finds the course's commands
    stale = sorted(set(NOT_RUN) - set(COMMANDS))
    assert not stale, f"NOT_RUN names commands that no file prints any more: {stale}"
    run_here = set(COMMANDS) - set(NOT_RUN)
    assert any("--max-restarts" in command for command in run_here), "the fault drill must run here"
    assert all(reason.strip() for reason in NOT_RUN.values())


def test_the_commands_not_run_here_name_files_and_options_that_exist(help_texts):
    for command_key in NOT_RUN:
        words = command_key.split()
        paths = [word for word in words if word.split("/")[0] in (*LINKED, "launch", "tests") and "/" in word]
        assert all((REPO / path).exists() for path in paths), f"{command_key}: a file it names does not exist"
        script = script_of(command_key)
        if script in help_texts:  # the options after the script are the script's own
            options = [word for word in words[words.index(script) + 1 :] if word.startswith("--")]
            unknown = [option for option in options if not re.search(rf"{option}\b", help_texts[script])]
            assert not unknown, f"{command_key}: {script} has no option {unknown}"


def test_the_labs_print_the_same_commands_as_their_solutions():
    for lab in sorted((REPO / "labs").glob("*.py")):
        solution = {key(command) for command in docstring_commands(REPO / "solutions" / lab.name)}
        extra = [
            key(command)
            for command in docstring_commands(lab)
            if key(command) not in solution and not command.startswith("LAB_TARGET=labs ")
        ]
        assert not extra, f"{lab.relative_to(REPO)} prints commands its solution does not: {extra}"


# Over 6 s each on 2 cores (measured 2026-11-27): `make test-slow` runs them, and CI runs both. What stays in
# `make test` runs every script at least once: each solution's first command, lesson 01's ring run, the lab tests'
# fault drill (tests/labs/test_05_multi_node.py) and tests/test_cluster.py's runs on the emulated cluster.
SLOW_COMMANDS = {
    "README.md:9", "lessons/07_multi_node.md:3", "lessons/07_multi_node.md:9", "lessons/05_mixed_precision.md:3",
    "lessons/05_mixed_precision.md:4", "solutions/07_ring_allreduce.py:1", "solutions/05_multi_node.py:2",
    "solutions/05_multi_node.py:4", "solutions/03_fsdp.py:2", "solutions/03_fsdp.py:3", "solutions/03_fsdp.py:5",
    "solutions/03_fsdp.py:6",
    "solutions/04_mixed_precision.py:2", "solutions/08_dp_vs_ddp.py:2", "solutions/09_ddp_by_hand.py:2",
    "solutions/09_ddp_by_hand.py:3", "solutions/10_zero_by_hand.py:2", "solutions/10_zero_by_hand.py:3",
    "solutions/11_powersgd.py:2", "solutions/11_powersgd.py:3", "solutions/11_powersgd.py:4",
    "solutions/11_powersgd.py:5", "solutions/11_powersgd.py:6", "solutions/11_powersgd.py:7",
    "solutions/11_powersgd.py:8", "solutions/01_ddp_basic.py:4", "solutions/01_ddp_basic.py:5",
    "solutions/12_pipeline.py:2", "solutions/12_pipeline.py:3", "solutions/14_activation_memory.py:2",
    "solutions/14_activation_memory.py:3", "solutions/14_activation_memory.py:4",
    "solutions/16_mixture_of_experts.py:2", "solutions/16_mixture_of_experts.py:3",
    "lessons/15_mixture_of_experts.md:3",
    # 4 and 8 processes, 20-35 s each; the one-process command stays in make test
    "solutions/17_composition.py:1", "solutions/17_composition.py:2", "solutions/17_composition.py:3",
    "solutions/17_composition.py:4", "solutions/17_composition.py:5",
    "solutions/15_context_parallel.py:2", "solutions/15_context_parallel.py:3",
}  # fmt: skip


def test_the_slow_commands_are_printed_commands_and_each_solution_keeps_one_in_make_test():
    places = {where for where, _ in COMMANDS.values()}
    assert SLOW_COMMANDS <= places, f"no such command: {sorted(SLOW_COMMANDS - places)}"
    for solution in sorted({where.split(":")[0] for where in places if where.startswith("solutions/")}):
        assert any(where.startswith(solution + ":") and where not in SLOW_COMMANDS for where in places), solution
    # a --resume command resumes what the command before it wrote: both run in the same suite, in order
    commands = list(COMMANDS.values())
    for (before, _), (where, command) in zip(commands, commands[1:]):
        if "--resume" in command.split():
            assert (before in SLOW_COMMANDS) == (where in SLOW_COMMANDS), f"{where} resumes {before}"


@pytest.mark.parametrize(
    "command_key",
    [pytest.param(key, marks=[pytest.mark.slow] * (where in SLOW_COMMANDS)) for key, (where, _) in COMMANDS.items()],
    ids=[where for where, _ in COMMANDS.values()],
)
def test_the_printed_command_runs_as_written(command_key, help_texts, reader_folder):
    where, command = COMMANDS[command_key]
    if command_key in NOT_RUN:
        pytest.skip(f"{where} not run here: {NOT_RUN[command_key]}")
    if "scripts/cluster.py" in command and cluster_unavailable():
        pytest.skip(f"{where} not run here: emulated cluster tests skipped: {cluster_unavailable()}")
    quick = quick_options(command, help_texts)
    line = " ".join([command, *map(shlex.quote, quick)])
    start = time.monotonic()
    status, output = drill.run_in_shell(line, reader_folder, environment(), TIMEOUT)
    ending = f"timed out after {TIMEOUT} s" if status is None else f"exit status {status}"
    report = f"{where}: {line}\n{ending} after {time.monotonic() - start:.0f} s; output tail:\n"
    assert status == 0, report + output[-4000:]
    if "--fail-at-step" in command:  # the drill failed on purpose, was restarted, and resumed
        assert "fails on purpose" in output and "resumed from" in output, report + output[-4000:]
    if "--resume" in command.split():
        assert "resumed from" in output, report + output[-4000:]
