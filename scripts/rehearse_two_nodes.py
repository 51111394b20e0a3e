"""Rehearse a multi-node run on one machine: N torchrun launchers ("nodes") meet through c10d on 127.0.0.1.

Each launcher is started exactly as it would be on its own node of a cluster; only the address differs. The
training script runs unchanged, so what works here works on a cluster (with NCCL instead of gloo there).

    # two nodes of 2 processes each: a world of 4
    python scripts/rehearse_two_nodes.py -- solutions/05_multi_node.py --dataset digits --epochs 2

    # node-local disks: {node} in an argument becomes the launcher's number (0, 1, ...)
    python scripts/rehearse_two_nodes.py -- solutions/05_multi_node.py --dataset digits \
        --checkpoint-dir /tmp/rehearsal/node{node}/checkpoints

    # fault drill: every launcher may restart its workers once
    python scripts/rehearse_two_nodes.py --max-restarts 1 -- solutions/05_multi_node.py --dataset digits \
        --checkpoint-dir /tmp/drill --checkpoint-every 10 --fail-at-step 30

Each output line is prefixed with its launcher, ``[node 1]``. The first launcher hosts the rendezvous store
(``--rdzv-conf is_host=1``): if the port is taken, it fails at once with EADDRINUSE instead of connecting to
whatever listens there and waiting. The whole rehearsal has a deadline; at the deadline, or once one launcher
has failed and the others have not ended within ``--grace`` seconds, the launchers still running are stopped,
each with its own process group (only the processes this script started).
"""

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from common.launch import TORCHRUN

# Workers get a store of their own on every attempt instead of sharing the agent's rendezvous store, whose
# keys from the failed attempt make a restarted gloo group connect to dead peers (PyTorch 2.14.1, measured;
# pytorch/pytorch#135712, #167288). Only restarts need it; it costs nothing otherwise.
RESTARTABLE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now: bind to port 0 and let the kernel choose."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    """True when something already holds ``host:port``: the rendezvous store could not listen there."""
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return True
        return False


def launcher_command(node: int, args, script_args: list[str]) -> list[str]:
    """The torchrun line that node ``node`` runs: the same on every node but for ``is_host``."""
    conf = f"is_host={int(node == 0)},join_timeout={args.join_timeout}"
    return [
        TORCHRUN,
        "--nnodes",
        args.nnodes,
        "--nproc-per-node",
        str(args.nproc_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{args.host}:{args.port}",
        "--rdzv-id",
        args.rdzv_id,
        "--rdzv-conf",
        conf,
        "--max-restarts",
        str(args.max_restarts),
        *[part.replace("{node}", str(node)) for part in script_args],
    ]


def stream(node: int, process: subprocess.Popen, sink) -> None:
    for line in process.stdout:
        sink.write(f"[node {node}] {line}")
        sink.flush()


def rehearse(args, script_args: list[str]) -> int:
    """Start the launchers, relay their output, wait for them; return 0 if all succeeded, else an exit status."""
    if port_in_use(args.host, args.port):
        print(
            f"error: rendezvous port {args.host}:{args.port} is already in use by another program. Pick "
            f"another --port, or leave --port out to get a free one. Do not kill processes you did not start.",
            file=sys.stderr,
        )
        return 2
    count = int(args.nnodes.split(":")[-1]) if args.launchers is None else args.launchers
    print(
        f"rehearsal: {count} launcher(s) x {args.nproc_per_node} process(es), --nnodes {args.nnodes}, "
        f"c10d rendezvous at {args.host}:{args.port}",
        flush=True,
    )
    start = time.monotonic()
    processes, threads = [], []
    for node in range(count):  # in the caller's folder, like torchrun on a node: relative paths hold
        process = subprocess.Popen(
            launcher_command(node, args, script_args),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env={**RESTARTABLE, **os.environ, "PYTHONUNBUFFERED": "1"},
        )
        processes.append(process)
        threads.append(threading.Thread(target=stream, args=(node, process, sys.stdout), daemon=True))
        threads[-1].start()
    deadline, failed_at = start + args.timeout, None
    while any(process.poll() is None for process in processes):
        now = time.monotonic()
        if failed_at is None and any(process.poll() not in (None, 0) for process in processes):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + args.grace):
            print(f"rehearsal: stopping the launchers still running after {now - start:.0f} s", flush=True)
            stop(processes)
            break
        time.sleep(0.1)
    for thread in threads:
        thread.join(timeout=5)
    codes = [process.wait() for process in processes]
    seconds = time.monotonic() - start
    print(f"rehearsal: exit codes {codes}, wall time {seconds:.1f} s", flush=True)
    if time.monotonic() > deadline:
        print(f"error: the rehearsal ran past --timeout {args.timeout} s and was stopped", file=sys.stderr)
        return 124
    return next((code if code > 0 else 1 for code in codes if code != 0), 0)


def stop(processes) -> None:
    """SIGTERM each launcher's process group (torchrun forwards it to its workers), then SIGKILL what is left."""
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    time.sleep(3)
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--nnodes", default="2", help="torchrun's --nnodes: a number, or MIN:MAX (elastic)")
    parser.add_argument("--launchers", type=int, help="how many launchers to start (default: MAX of --nnodes)")
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, help="rendezvous port (default: a free one)")
    parser.add_argument("--rdzv-id", default="rehearsal")
    parser.add_argument("--max-restarts", type=int, default=0)
    parser.add_argument("--join-timeout", type=int, default=120, help="seconds a launcher waits for the others")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before the whole rehearsal is stopped")
    parser.add_argument(
        "--grace", type=float, default=30, help="seconds the other launchers get to end once one has failed"
    )
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- then the training script and its options")
    args = parser.parse_args(argv)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        parser.error("give the training script after --, e.g. -- solutions/05_multi_node.py --dataset digits")
    args.port = args.port or free_port(args.host)
    return args, script


if __name__ == "__main__":
    sys.exit(rehearse(*parse_args()))
