"""The fault drill of solutions/05_multi_node.py, run N times exactly as its docstring prints it.

    # 10 runs of the documented line; exit status 0 only if all 10 pass
    python benchmarks/restart_drill.py

    # the same line without its TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, to see the restarts fail
    python benchmarks/restart_drill.py --runs 4 --without-variable

The command is read from the docstring, not retyped here, and runs through ``bash -c`` in a fresh temporary
folder per run (linked to the repository's ``solutions/``, ``scripts/`` and ``common/``, so its relative paths
work and every run starts without checkpoints), with this Python's folder first on ``PATH``. A run passes when
it exits 0 after the intended failure and a resume. A restart that fails does so at random (it depends on
which attempt's keys the restarted workers read first), so one run proves little: count passes over many.
"""

import ast
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common.cli import argument_parser
from common.launch import REPO
from common.reports import run_header

SOLUTION = REPO / "solutions" / "05_multi_node.py"
VARIABLE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
LINKED = ("solutions", "scripts", "common")
# What a failed restart, or any other failure, prints: shown for each failed run.
FAILURE = re.compile(r"connectFullMesh|Connection refused|Error:|error:")


def joined_lines(lines):
    """Join backslash-continued lines, as a shell does."""
    command = []
    for line in lines:
        command.append(line.strip().removesuffix("\\").strip())
        if not line.rstrip().endswith("\\"):
            yield " ".join(command)
            command = []


def docstring_commands(path) -> list[str]:
    """The commands a script's module docstring prints: its lines indented by 4 or more spaces that are not
    ``#`` comments, continuation lines joined. Read from the source text, where the ``\\`` are still there."""
    source = Path(path).read_text()
    raw = ast.get_source_segment(source, ast.parse(source).body[0])
    indented = [line for line in raw.splitlines() if line.startswith("    ") and not line.lstrip().startswith("#")]
    return list(joined_lines(indented))


def drill_command(path=SOLUTION) -> str:
    """The one documented command that restarts after a deliberate failure on a single machine."""
    drills = [
        command
        for command in docstring_commands(path)
        if "--max-restarts" in command and "--fail-at-step" in command and "--standalone" in command
    ]
    if len(drills) != 1:
        raise SystemExit(f"expected one fault drill in {path}'s docstring, found {drills}")
    return drills[0]


def without_variable(command: str) -> str:
    prefix = f"{VARIABLE}=1 "
    if not command.startswith(prefix):
        raise SystemExit(f"the documented drill does not start with {prefix!r}: {command}")
    return command.removeprefix(prefix)


def run_in_shell(command: str, folder, env, timeout: float) -> tuple[int | None, str]:
    """``bash -c command`` in ``folder``: (exit status, or None after a timeout; stdout and stderr together).

    On a timeout the command's process group gets SIGTERM, which torchrun passes on to its workers (they run in
    sessions of their own, out of reach of the group), then SIGKILL after 15 s. The output goes to a file, not a
    pipe, so that a worker left behind cannot keep this function waiting for the end of its output."""
    with tempfile.TemporaryFile("w+") as sink:
        process = subprocess.Popen(
            ["bash", "-c", command],
            cwd=folder,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            status = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            status = None
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        sink.seek(0)
        return status, sink.read()


def run_once(command: str, timeout: float) -> tuple[bool, float, list[str]]:
    """One drill in a fresh folder: (passed, seconds, the failure lines of its output)."""
    env = {name: value for name, value in os.environ.items() if name != VARIABLE}
    env.update(PYTHONUNBUFFERED="1", PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]))
    with tempfile.TemporaryDirectory(prefix="restart-drill-") as folder:
        for name in LINKED:
            Path(folder, name).symlink_to(REPO / name, target_is_directory=True)
        start = time.monotonic()
        status, output = run_in_shell(command, folder, env, timeout)
        seconds = time.monotonic() - start
    passed = status == 0 and "fails on purpose" in output and "resumed from" in output
    ending = f"timed out after {timeout:.0f} s" if status is None else f"exit status {status}"
    return passed, seconds, [] if passed else [ending, *failure_lines(output)]


def failure_lines(output: str, limit: int = 4) -> list[str]:
    """The first few distinct lines that say what went wrong, the intended failure left out."""
    lines, seen = [], set()
    for line in output.splitlines():
        line = line.strip()
        shape = re.sub(r"\d+", "N", line)  # one line per message: the retries differ only in ports and counts
        if FAILURE.search(line) and "fails on purpose" not in line and shape not in seen:
            seen.add(shape)
            lines.append(line[:240])
    return lines[:limit]


def main(args) -> int:
    command = drill_command()
    if args.without_variable:
        command = without_variable(command)
    print(run_header(), flush=True)
    print(f"fault drill, {args.runs} run(s), each in a fresh folder:\n  {command}", flush=True)
    passes = 0
    for run in range(1, args.runs + 1):
        passed, seconds, lines = run_once(command, args.timeout)
        passes += passed
        print(f"run {run}/{args.runs}: {'pass' if passed else 'FAIL'} in {seconds:.1f} s", flush=True)
        for line in lines:
            print(f"    {line}", flush=True)
    print(f"passed {passes}/{args.runs} ({'without' if args.without_variable else 'with'} {VARIABLE}=1)")
    return 0 if passes == args.runs else 1


def parse_args(argv=None):
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument(
        "--without-variable",
        action="store_true",
        help=f"drop {VARIABLE}=1 from the documented line (and from this environment)",
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds one run may take")
    parser.add_argument("--print-command", action="store_true", help="print the command that would run, and stop")
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.print_command:
        print(without_variable(drill_command()) if arguments.without_variable else drill_command())
        sys.exit(0)
    sys.exit(main(arguments))
