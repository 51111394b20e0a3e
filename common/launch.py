"""Start the course's processes: scripts under ``torchrun``, and functions on N local processes.

- ``torchrun_command`` and ``launch``: a repository script under ``torchrun --standalone``, exactly as the README
  tells readers to run it, from the repository's folder so that its relative paths hold. For notebooks,
  benchmarks and tests (``REPO`` and ``TORCHRUN`` are defined here once). ``run_for_json`` launches a script
  that writes its figures to a JSON file (a solution's ``--metrics-file``) and returns them: how the benchmarks
  measure a training run.
- ``run_on_ranks``: a function on N local processes that form a process group, for the places that need the
  results back in the calling process, such as a test comparing a 2-process run with a 1-process reference, or
  a notebook cell. The processes rendezvous through a file (no port to collide on), and a deadline turns a hang
  into an error. ``in_turn`` runs several functions in one such group: each group costs seconds to start.

``run_on_ranks``' function must be importable (defined in a module, not in a notebook or a ``__main__`` script):
each process is a fresh interpreter ("spawn") that finds it by module and name. A script's functions reach the
processes through ``load_script``, called inside the function they run.
"""

import importlib.util
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

# torch is imported inside the functions that need it: a launcher that only starts torchrun
# (scripts/rehearse_two_nodes.py) then starts without loading PyTorch.

REPO = Path(__file__).resolve().parents[1]  # the repository: scripts are launched from here
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))  # the launcher installed beside this Python


def torchrun_command(script, *args, nproc: int = 2) -> list[str]:
    """``torchrun --standalone --nproc_per_node=NPROC SCRIPT ARGS...`` as a list of strings: one machine,
    ``nproc`` processes. ``script`` is a path, relative to the folder the command will run in, or absolute."""
    return [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", str(script), *map(str, args)]


def cluster_command(script, *args, nproc: int = 2, link: str = "1gbit", nodes: int = 2) -> list[str]:
    """``scripts/cluster.py``'s line that runs ``script`` on ``nodes`` emulated nodes of ``nproc // nodes``
    processes, joined by links of ``link`` (lessons 07-12's slow network; it needs root)."""
    if nproc % nodes:
        raise ValueError(f"{nproc} processes do not split evenly over {nodes} nodes")
    return [
        sys.executable,
        str(REPO / "scripts" / "cluster.py"),
        *("--nodes", str(nodes), "--procs-per-node", str(nproc // nodes), "--link", link),
        "--",
        str(script),
        *map(str, args),
    ]


def launch(
    script,
    *args,
    nproc: int = 2,
    env_extra=None,
    timeout: float | None = None,
    check: bool = True,
    link: str | None = None,
) -> subprocess.CompletedProcess:
    """Run ``torchrun_command(script, *args, nproc=nproc)`` in the repository's folder; return the finished
    process, its standard output and error captured as text.

    ``env_extra`` is added to this process's environment. ``check``: a non-zero exit raises ``RuntimeError``
    with the end of the standard error, where the ranks' tracebacks are. ``timeout``: seconds before
    ``subprocess.TimeoutExpired`` (none by default). ``link``: run on two emulated nodes joined at this rate
    instead (``cluster_command``), half the processes on each.
    """
    command = (
        torchrun_command(script, *args, nproc=nproc)
        if link is None
        else cluster_command(script, *args, nproc=nproc, link=link)
    )
    run = subprocess.run(
        command,
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, **(env_extra or {})},
        timeout=timeout,
    )
    if check and run.returncode != 0:
        raise RuntimeError(f"torchrun {script} exited with status {run.returncode}:\n{run.stderr[-2000:]}")
    return run


def run_for_json(
    script,
    *script_args,
    json_option: str,
    nproc: int = 2,
    env_extra=None,
    timeout: float | None = None,
    link: str | None = None,
) -> dict:
    """``launch`` ``script`` with ``script_args`` and ``json_option FILE``, a temporary file; return the JSON the
    script wrote there. Its output is kept back unless it fails (``launch`` raises with its standard error)."""
    with tempfile.TemporaryDirectory(prefix="run_for_json-") as tmp:
        result_file = Path(tmp) / "result.json"
        launch(
            script, *script_args, json_option, result_file, nproc=nproc, env_extra=env_extra, timeout=timeout, link=link
        )
        return json.loads(result_file.read_text())


def run_on_ranks(fn, world_size: int, *args, timeout: float = 60.0):
    """Run ``fn(env, *args)`` on ``world_size`` CPU processes joined by gloo; return each rank's result.

    ``env`` is the ``DistEnv`` that ``setup_distributed`` returns. Results travel back through
    ``torch.save``/``torch.load(weights_only=True)``: tensors, numbers, strings, lists and dicts of those.
    A rank that raises makes this raise with that rank's traceback; processes still running after
    ``timeout`` seconds are killed and a ``TimeoutError`` names them.
    """
    import torch

    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="run_on_ranks-") as tmp:
        tmp = Path(tmp)
        processes = [
            context.Process(target=_worker, args=(fn, rank, world_size, tmp, args, timeout), daemon=True)
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout
        # Poll rather than join one by one: when a rank fails, the others may wait for it forever.
        while time.monotonic() < deadline and any(process.is_alive() for process in processes):
            if any(process.exitcode not in (None, 0) for process in processes):
                break
            time.sleep(0.05)
        hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join()

        # The earliest failure is the cause; later ones are usually other ranks losing their peer.
        errors = sorted(tmp.glob("rank*.error"), key=lambda path: path.stat().st_mtime_ns)
        # A rank killed by a signal (an abort inside a backend) writes no error file: name it too, or the
        # first file would look like the cause when it is only a peer losing its connection.
        silent = {
            rank: process.exitcode
            for rank, process in enumerate(processes)
            if process.exitcode not in (0, None) and not (tmp / f"rank{rank}.error").exists()
        }
        if errors:
            killed = f"rank(s) that died without a Python error (exit codes): {silent}\n" if silent else ""
            raise RuntimeError(
                f"{len(errors)} rank(s) failed; {killed}the first Python error:\n{errors[0].read_text()}"
            )
        if hung and time.monotonic() >= deadline:
            raise TimeoutError(f"rank(s) {hung} of {world_size} still running after {timeout:.0f} s: a hang?")
        failed = {rank: process.exitcode for rank, process in enumerate(processes) if process.exitcode != 0}
        if failed:
            raise RuntimeError(f"rank(s) exited with non-zero codes {failed}")
        return [torch.load(tmp / f"rank{rank}.pt", weights_only=True) for rank in range(world_size)]


def in_turn(env, calls: list[tuple]) -> list:
    """``[fn(env, *args) for fn, args in calls]``: several functions, one after the other, in the process group of
    one ``run_on_ranks`` (``run_on_ranks(in_turn, 2, [(f, (1,)), (g, ())])``), instead of a group for each: on a
    2-core machine every group costs seconds of start-up, most of it importing torch in each process."""
    return [fn(env, *args) for fn, args in calls]


def load_script(path):
    """Import a script that is not part of a package (its name may start with a digit), by its path.

    This is how tests, notebooks and measurements run a solution's own functions (``solutions/03_fsdp.py``'s
    ``shard_model``, say) instead of a copy of them.
    """
    path = Path(path)
    spec = importlib.util.spec_from_file_location(path.stem.replace("-", "_"), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _worker(fn, rank, world_size, tmp, args, timeout):
    import torch

    from common.distributed import setup_distributed, teardown_distributed

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(1)  # N processes on a few cores: one thread each avoids oversubscription
    try:
        env = setup_distributed("gloo", timeout=timedelta(seconds=timeout), init_method=(tmp / "store").as_uri())
        torch.save(fn(env, *args), tmp / f"rank{rank}.pt")
    except BaseException:
        # Written before leaving the group: the moment this rank leaves, its peers fail too, and the
        # earliest error file must be the cause.
        (tmp / f"rank{rank}.error").write_text(f"rank {rank}:\n{traceback.format_exc()}")
        raise SystemExit(1)
    finally:
        teardown_distributed()
