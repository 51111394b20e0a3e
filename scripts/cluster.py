"""Run a training script on an emulated cluster: nodes joined by a real, rate-limited network, on one machine.

    # two nodes of one process each, joined at 1 Gbit/s (needs root: put sudo in front if you are not)
    .venv/bin/python scripts/cluster.py --nodes 2 --procs-per-node 1 --link 1gbit -- \
        solutions/01_ddp_basic.py --dataset digits

    # two nodes of two processes: inside a node the processes talk over loopback, across nodes at 1 Gbit/s
    .venv/bin/python scripts/cluster.py --nodes 2 --procs-per-node 2 --link 1gbit -- solutions/13_tensor_parallel.py \
        --dataset digits --data-parallel 2

Each node is a network namespace with one link to a switch (``common/cluster.py`` builds them). One ``torchrun``
per node starts inside its namespace, as on a real cluster: c10d rendezvous hosted by node 0 (``is_host=1``),
with ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` naming the node's link. Node 0's output is printed as it comes
(rank 0 prints the summary); another node's is printed when that node fails. The exit status is the worst of the
launchers'. On every path (success, a failed rank, Ctrl-C, the deadline) the launchers are stopped and every
namespace, link and queue is removed.
"""

import argparse
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time

from common.cluster import ClusterError, EmulatedCluster, address, parse_rate, require_root
from common.launch import TORCHRUN

PORT_FREE = "import socket, sys; s = socket.socket(); s.bind((sys.argv[1], int(sys.argv[2])))"


def launcher_command(node: int, args, script: list[str]) -> list[str]:
    """The torchrun line node ``node`` runs: the same on every node but for its address and ``is_host``.

    The c10d rendezvous (lesson 07) orders the nodes by address, and ``--local-addr`` gives each its own (all the
    namespaces share one host name): node K gets group rank K, so it holds ranks K*P .. K*P+P-1."""
    return [
        TORCHRUN,
        f"--nnodes={args.nodes}",
        f"--nproc-per-node={args.procs_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={address(0)}:{args.port}",
        f"--rdzv-id={args.name}",
        f"--rdzv-conf=is_host={int(node == 0)}",
        f"--local-addr={address(node)}",
        *script,
    ]


def port_taken(cluster: EmulatedCluster, port: int) -> bool:
    """True when something inside node 0 already holds ``port`` on its address: the rendezvous could not listen.

    In a cluster this command has just built nothing can; the check guards a caller of ``run_on_cluster`` that
    starts its own servers on the nodes first (tests, benchmarks)."""
    check = subprocess.run(
        cluster.on_node(0, [sys.executable, "-c", PORT_FREE, address(0), str(port)]), capture_output=True, timeout=30
    )
    return check.returncode != 0


def relay(process: subprocess.Popen, lines: list[str], echo: bool) -> None:
    """Read a launcher's output to the end: print it (node 0) or keep it for a failure report (the others)."""
    for line in process.stdout:
        lines.append(line)
        if echo:
            sys.stdout.write(line)
            sys.stdout.flush()


def stop(processes: list[subprocess.Popen]) -> None:
    """SIGTERM each launcher's process group, then SIGKILL what is left of it. torchrun answers SIGTERM by ending
    its workers, which run in sessions of their own; a worker that outlives a SIGKILLed torchrun is killed when its
    node's namespace is removed (``EmulatedCluster.close``)."""
    for signal_number, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 0.0)):
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal_number)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(process.poll() is None for process in processes):
            time.sleep(0.1)


def share_of_the_cores(args) -> dict:
    """``OMP_NUM_THREADS`` for each process: the machine's cores shared out among all the nodes' processes.

    The emulated nodes share one machine's cores. torchrun gives each process all the cores when it starts one
    per node (it sets 1 only for several), so two one-process nodes would each run as many threads as there are
    cores, fight for them, and compute in another order than the same world on loopback. A value already set wins.
    """
    if "OMP_NUM_THREADS" in os.environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // (args.nodes * args.procs_per_node)))}


def failure_lines(lines: list[str], most: int = 60) -> list[str]:
    """What to show of a failed node's output: from its first traceback on (where the error is named), else its
    last lines; at most ``most`` lines."""
    starts = [index for index, line in enumerate(lines) if "Traceback (most recent call last)" in line]
    shown = lines[starts[0] :] if starts else lines[-20:]
    return [line.rstrip("\n") for line in shown[:most]]


def exit_status(code: int) -> int:
    """A shell's view of a return code: a process killed by signal S reads as 128 + S."""
    return 128 - code if code < 0 else code


def run_on_cluster(cluster: EmulatedCluster, args, script: list[str]) -> int:
    """Start one launcher per node, relay node 0's output, wait; return the worst exit status (0 if all passed)."""
    if port_taken(cluster, args.port):
        print(f"error: port {args.port} is already in use on node 0; pick another --port", file=sys.stderr)
        return 2
    print(
        f"cluster: {args.nodes} node(s) x {args.procs_per_node} process(es), links of {args.link} "
        f"(tbf), rendezvous at {address(0)}:{args.port}",
        flush=True,
    )
    start = time.monotonic()
    processes, outputs, threads = [], [], []
    try:
        for node in range(args.nodes):  # in the caller's folder, like torchrun on a node: relative paths hold
            processes.append(
                subprocess.Popen(
                    cluster.on_node(node, launcher_command(node, args, script)),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,  # a group of its own, which stop() signals: torchrun then ends its workers
                    env={**os.environ, "PYTHONUNBUFFERED": "1", **share_of_the_cores(args)},
                )
            )
            outputs.append([])
            threads.append(threading.Thread(target=relay, args=(processes[-1], outputs[-1], node == 0), daemon=True))
            threads[-1].start()
        failed_at, timed_out = None, False
        while any(process.poll() is None for process in processes):
            now = time.monotonic()
            if failed_at is None and any(process.poll() not in (None, 0) for process in processes):
                failed_at = now
            timed_out = now > start + args.timeout
            if timed_out or (failed_at is not None and now > failed_at + args.grace):
                print(f"cluster: stopping the launchers still running after {now - start:.0f} s", flush=True)
                break
            time.sleep(0.1)
    finally:
        stop(processes)  # on every path, Ctrl-C included: nothing of ours runs on once we return
    for thread in threads:
        thread.join(timeout=5)
    codes = [exit_status(process.returncode) for process in processes]
    for node, code in enumerate(codes):
        if code != 0 and node != 0:
            print(f"--- node {node} exited with {code}; its last lines:", *failure_lines(outputs[node]), sep="\n")
    print(f"cluster: exit codes {codes}, wall time {time.monotonic() - start:.1f} s", flush=True)
    if timed_out:
        print(f"error: the run passed --timeout {args.timeout:.0f} s and was stopped", file=sys.stderr)
        return 124
    return max(codes)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=2, help="namespaces, each with one link to the switch")
    parser.add_argument("--procs-per-node", type=int, default=1, help="torchrun's --nproc-per-node on each node")
    parser.add_argument("--link", default="1gbit", help="each link's rate in each direction, as tc writes it")
    parser.add_argument("--port", type=int, default=29500, help="rendezvous port on node 0")
    parser.add_argument("--name", default="mgc", help="the namespaces' prefix: <name>-node0, <name>-switch")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds before the whole run is stopped")
    parser.add_argument("--grace", type=float, default=30, help="seconds the other nodes get once one has failed")
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- then the training script and its options")
    args = parser.parse_args(argv)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        parser.error("give the training script after --, e.g. -- solutions/01_ddp_basic.py --dataset digits")
    if args.nodes < 1 or args.procs_per_node < 1:
        parser.error("--nodes and --procs-per-node must be at least 1")
    if not 1024 <= args.port <= 65535:
        parser.error(f"--port must be 1024-65535, not {args.port}")
    try:
        parse_rate(args.link)
    except ClusterError as error:
        parser.error(str(error))
    return args, script


def alternatives(args, script: list[str]) -> str:
    """The same run as root (sudo keeps neither the virtual environment nor PATH, so name its Python), and the
    same world on loopback, without the emulator."""
    python = os.path.relpath(sys.executable) if not os.path.relpath(sys.executable).startswith("..") else sys.executable
    options = ["--nodes", str(args.nodes), "--procs-per-node", str(args.procs_per_node), "--link", args.link]
    as_root = shlex.join(["sudo", python, "scripts/cluster.py", *options, "--", *script])
    world = args.nodes * args.procs_per_node
    return f"as root: {as_root}; on loopback: torchrun --standalone --nproc_per_node={world} {shlex.join(script)}"


@contextlib.contextmanager
def signals_interrupt_this_process():
    """SIGTERM (a job scheduler, `kill`) and SIGHUP (a closed terminal) take the same path as Ctrl-C while the run
    lasts: stop the launchers, remove the network. Only SIGKILL skips it; the next run with the same --name then
    cleans up. SIGINT is set too: a shell starts a background job with SIGINT ignored, and Python keeps it so.

    Only this process is interrupted. pyroute2 forks short-lived copies of it to work inside a namespace and ends
    them with SIGTERM: a copy that raised KeyboardInterrupt would unwind through this process's frames and remove the
    network it was building. A copy exits at once instead. The handlers before the run come back after it."""
    owner = os.getpid()

    def interrupt(signal_number, frame):
        if os.getpid() != owner:
            os._exit(128 + signal_number)
        raise KeyboardInterrupt

    caught = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    before = {number: signal.signal(number, interrupt) for number in caught}
    try:
        yield
    finally:
        for number, handler in before.items():
            signal.signal(number, handler)


def main(args, script: list[str]) -> int:
    with signals_interrupt_this_process():
        try:
            require_root()
            with EmulatedCluster(args.nodes, args.link, args.name) as cluster:
                return run_on_cluster(cluster, args, script)
        except ClusterError as error:
            print(f"error: {error} ({alternatives(args, script)})", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("cluster: interrupted; launchers stopped and the network removed", file=sys.stderr)
            return 130


if __name__ == "__main__":
    sys.exit(main(*parse_args()))
