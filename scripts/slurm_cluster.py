"""Submit a SLURM batch file to a real SLURM cluster emulated on one machine, wait for it, print its output.

    # lesson 07's launch file on 2 nodes of 1 process each, joined at 1 Gbit/s (root; slurm-wlm and munge installed)
    .venv/bin/python scripts/slurm_cluster.py --nodes 2 -- --gpus-per-node=0 --cpus-per-task=1 \
        --export=ALL,NPROC_PER_NODE=1 launch/slurm_multi_node.sbatch solutions/01_ddp_basic.py --dataset digits

Everything after ``--`` goes to ``sbatch --wait`` as it is: options, the batch file, the batch file's arguments.
The nodes are ``scripts/cluster.py``'s network namespaces (``common/cluster.py``). Inside each one this command
starts a ``slurmd``, in a UTS namespace of its own (its host name is ``node<k>``, which is how ``slurmd`` finds its
node name) and a mount namespace of its own (a generated hosts file is bind-mounted on ``/etc/hosts``, so that
every node resolves every other's name; the machine's own file is never touched). Node 0 also runs the
``slurmctld`` and the one ``munged`` that signs the daemons' messages. ``slurm.conf``, ``cgroup.conf``, the munge
key, the daemons' state, logs and sockets all live in one temporary folder, ``slurm-cluster-<name>``.

On every path (the job passed or failed, a daemon would not start, Ctrl-C, the ``--timeout``) the daemons are
stopped by their process ids, whatever the job left running dies with its node's namespace, and the folder and
the namespaces are removed. A run killed by SIGKILL, which no handler sees, leaves them to the next run of the
same ``--name``, which removes them first (every daemon, munged included, runs inside a node). The exit status is
the job's (``sbatch --wait``'s), 2 when the cluster could not be built, 124 past the timeout and 130 on Ctrl-C.
It installs nothing: ``make test-cluster`` installs the packages.
"""

import argparse
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common.cluster import ClusterError, EmulatedCluster, address, parse_rate, require_root
from common.launch import load_script

cluster_script = load_script(Path(__file__).with_name("cluster.py"))  # the same signal handling as the emulator's
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "srun", "unshare")
MUNGE = "munge.socket"

# Only what this machine lacks or must differ from SLURM's defaults. Processes are tracked by their parents' ids
# (linuxproc) and tasks are not bound to cores (none): neither needs a cgroup of its own. select/linear allocates
# whole nodes, one job at a time, as a course run wants.
SLURM_CONF = """\
ClusterName={name}
SlurmctldHost=node0({controller})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={folder}/{munge}
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool/%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SelectType=select/linear
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
FirstJobId={first_job}
{nodes}
PartitionName=course Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
# This machine mounts cgroup v1 hierarchies under a tmpfs; slurmd refuses to start until it is told so ("No
# filesystem mounted on /sys/fs/cgroup ... Unable to initialize cgroup plugin").
CGROUP_CONF = "CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\nCgroupAutomount=no\n"


def node_name(node: int) -> str:
    return f"node{node}"


def write_configuration(folder: Path, args) -> Path:
    """slurm.conf, cgroup.conf, a hosts file and a fresh munge key in ``folder``; return slurm.conf's path.

    ``CPUs`` is this machine's count on every node, as ``slurmd`` checks it against the hardware it sees."""
    for part in ("state", "spool"):
        (folder / part).mkdir()
    cpus = os.cpu_count() or 1
    nodes = "\n".join(
        f"NodeName={node_name(k)} NodeAddr={address(k)} CPUs={cpus} State=UNKNOWN" for k in range(args.nodes)
    )
    conf = folder / "slurm.conf"
    # Each emulated cluster numbers its jobs afresh: starting from the clock keeps a job's output file (%j) from
    # landing on an earlier run's, which the job would overwrite while this command is still reading the old one.
    first_job = int(time.time()) % 60_000_000 + 1
    settings = dict(name=args.name, controller=address(0), folder=folder, munge=MUNGE, nodes=nodes, first_job=first_job)
    conf.write_text(SLURM_CONF.format(**settings))
    (folder / "cgroup.conf").write_text(CGROUP_CONF)
    hosts = "127.0.0.1 localhost\n" + "".join(f"{address(k)} {node_name(k)}\n" for k in range(args.nodes))
    (folder / "hosts").write_text(hosts)
    key = folder / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o400)
    return conf


def on_node(cluster: EmulatedCluster, folder: Path, node: int, command: list[str]) -> list[str]:
    """``command`` inside node ``node``: its network namespace, its own host name and its own ``/etc/hosts``."""
    name, hosts = node_name(node), folder / "hosts"
    inside = f'hostname {name} && mount --bind {hosts} /etc/hosts && exec "$@"'
    wrapper = ["unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c", inside, name, *command]
    return cluster.on_node(node, wrapper)


def start(command: list[str], log: Path, env: dict) -> subprocess.Popen:
    """A daemon in the foreground, its output to ``log``; it runs in a process group of its own (Ctrl-C in the
    terminal reaches this command only, which stops the daemons itself)."""
    with open(log, "ab") as file:
        return subprocess.Popen(command, stdout=file, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_until(condition, seconds: float, what: str, daemons: list) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        for name, process, log in daemons:
            if process.poll() is not None:
                raise ClusterError(f"{name} exited with {process.returncode}: {last_line(log)}")
        if time.monotonic() > deadline:
            raise ClusterError(
                f"{what} not within {seconds:.0f} s; " + "; ".join(last_line(log) for *_, log in daemons)
            )
        time.sleep(0.2)


def last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()] if log.exists() else []
    errors = [line for line in lines if "error" in line.lower() or "fatal" in line.lower()]
    return f"{log.name}: {(errors or lines or ['(empty)'])[-1].strip()}"


def stop(daemons: list) -> None:
    """SIGTERM each daemon by its process id, SIGKILL what is still running 10 s later."""
    for signal_number, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 0.0)):
        for _, process, _ in daemons:
            if process.poll() is None:
                process.send_signal(signal_number)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(process.poll() is None for _, process, _ in daemons):
            time.sleep(0.1)


def follow(path_holder: list, done: threading.Event) -> None:
    """Print the job's output file as it grows, until ``done`` is set and the file is read to its end."""
    position = 0
    while True:
        finished = done.is_set()
        if path_holder and Path(path_holder[0]).exists():
            with open(path_holder[0], "rb") as file:
                file.seek(position)
                chunk = file.read()
            position += len(chunk)
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()
        if finished:
            return
        time.sleep(0.3)


def submit(cluster, folder: Path, env: dict, args, sbatch: list[str]) -> int:
    """``sbatch --wait`` from node 0, in this folder; print the job's output as it comes; the job's exit status."""
    command = on_node(cluster, folder, 0, ["sbatch", "--wait", f"--chdir={os.getcwd()}", *sbatch])
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    output_path, job_id, done = [], [], threading.Event()
    follower = threading.Thread(target=follow, args=(output_path, done), daemon=True)
    follower.start()
    try:
        start_time = time.monotonic()
        for line in job.stdout:  # "Submitted batch job N", then nothing until the job ends (or an error)
            match = re.match(r"Submitted batch job (\d+)", line)
            if not match:
                print(f"sbatch: {line.rstrip()}", flush=True)
                continue
            job_id.append(match.group(1))
            where = re.search(r"StdOut=(\S+)", show_job(cluster, folder, env, job_id[0]))
            print(f"slurm: job {job_id[0]} submitted; its output, {where.group(1) if where else '?'}:", flush=True)
            if where:
                output_path.append(where.group(1))
        code = job.wait(timeout=max(1.0, args.timeout - (time.monotonic() - start_time)))
    except subprocess.TimeoutExpired:
        print(f"error: the job passed --timeout {args.timeout:.0f} s and was stopped", file=sys.stderr)
        return 124
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        done.set()
        follower.join(timeout=10)
    # What SLURM says of the job: a job that failed before its first line (an output file it could not open, say)
    # prints nothing, and only its state and reason tell why.
    fields = (
        re.findall(r"\b(JobState|Reason|ExitCode)=(\S+)", show_job(cluster, folder, env, job_id[0])) if job_id else []
    )
    print(f"slurm: sbatch --wait exited with {code}; job {' '.join(map('='.join, fields))}", flush=True)
    return code


def show_job(cluster, folder: Path, env: dict, job: str) -> str:
    """``scontrol show job``'s record of ``job``: its state, exit code, reason and output file."""
    command = on_node(cluster, folder, 0, ["scontrol", "show", "job", job])
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=30).stdout


def check() -> None:
    """Raise ``ClusterError`` (one line) where this machine cannot run the cluster: not root, no SLURM or munge, or
    no network namespaces."""
    missing = [program for program in PROGRAMS if shutil.which(program) is None]
    if missing:
        raise ClusterError(f"{', '.join(missing)} not found: install them as root with apt-get install slurm-wlm munge")
    require_root()
    probe = subprocess.run(["ip", "netns", "add", "slurmprobe"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise ClusterError(f"this machine refuses network namespaces: `ip netns add` said {probe.stderr.strip()!r}")
    subprocess.run(["ip", "netns", "delete", "slurmprobe"], capture_output=True)


def run(args, sbatch: list[str]) -> int:
    check()
    daemons = []
    with EmulatedCluster(args.nodes, args.link, args.name) as cluster:
        # The cluster holds its name's lock: a folder of that name is left from a run that was killed, and goes.
        folder = Path(tempfile.gettempdir()) / f"slurm-cluster-{args.name}"
        shutil.rmtree(folder, ignore_errors=True)
        try:
            folder.mkdir(mode=0o700)  # munged refuses a key that others could reach
            conf = write_configuration(folder, args)
            env = {**os.environ, "SLURM_CONF": str(conf), "PYTHONUNBUFFERED": "1"}
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nodes)))  # as cluster.py
            munged = [
                "munged", "--foreground", "--force", f"--key-file={folder}/munge.key", f"--socket={folder}/{MUNGE}",
                f"--pid-file={folder}/munged.pid", f"--seed-file={folder}/munge.seed",
                f"--log-file={folder}/munged.log",
            ]  # fmt: skip
            # Every daemon runs inside a node, munged too (its socket is a file, which every node reaches): after a
            # SIGKILL, which no handler sees, the next run removes the namespaces, the daemons in them and the folder.
            daemons.append(
                ("munged", start(cluster.on_node(0, munged), folder / "munged.out", env), folder / "munged.log")
            )
            wait_until(lambda: (folder / MUNGE).exists(), 20, "munged's socket", daemons)
            controller = on_node(cluster, folder, 0, ["slurmctld", "-D", "-f", str(conf)])
            daemons.append(("slurmctld", start(controller, folder / "slurmctld.out", env), folder / "slurmctld.log"))
            for node in range(args.nodes):
                log = folder / f"slurmd-{node_name(node)}.log"
                slurmd = on_node(cluster, folder, node, ["slurmd", "-D", "-f", str(conf)])
                daemons.append((f"slurmd on {node_name(node)}", start(slurmd, folder / f"{log.stem}.out", env), log))

            def idle() -> bool:
                sinfo = on_node(cluster, folder, 0, ["sinfo", "--noheader", "--Node", "--format=%N %t"])
                states = subprocess.run(sinfo, capture_output=True, text=True, env=env, timeout=30).stdout.split()
                return states[1::2].count("idle") == args.nodes

            wait_until(idle, 60, f"{args.nodes} idle node(s)", daemons)
            print(
                f"slurm: {args.nodes} idle node(s) ({', '.join(map(node_name, range(args.nodes)))}), links of "
                f"{args.link}; munged, slurmctld and {args.nodes} slurmd; configuration in {folder}",
                flush=True,
            )
            return submit(cluster, folder, env, args, sbatch)
        finally:
            stop(daemons)  # each daemon by its own id, before the namespaces go
            shutil.rmtree(folder, ignore_errors=True)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=2, help="emulated nodes, each with a slurmd")
    parser.add_argument("--link", default="1gbit", help="each node's link rate in each direction, as tc writes it")
    parser.add_argument("--name", default="slurm", help="the namespaces' prefix: <name>-node0, <name>-switch")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds the job may take before it is stopped")
    parser.add_argument("--check", action="store_true", help="only check that this machine can run it, and exit")
    parser.add_argument(
        "sbatch", nargs=argparse.REMAINDER, help="-- then sbatch's options, the batch file, its arguments"
    )
    args = parser.parse_args(argv)
    sbatch = args.sbatch[1:] if args.sbatch[:1] == ["--"] else args.sbatch
    if not sbatch and not args.check:
        parser.error("give the batch file after --, e.g. -- launch/slurm_multi_node.sbatch")
    if args.nodes < 1:
        parser.error("--nodes must be at least 1")
    try:
        parse_rate(args.link)
    except ClusterError as error:
        parser.error(str(error))
    return args, sbatch


def main(args, sbatch: list[str]) -> int:
    with cluster_script.signals_interrupt_this_process():
        try:
            if args.check:
                check()
                print("slurm cluster: this machine can run it (root, network namespaces, slurm-wlm and munge)")
                return 0
            return run(args, sbatch)
        except ClusterError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("slurm: interrupted; daemons stopped, the network and the folder removed", file=sys.stderr)
            return 130


if __name__ == "__main__":
    sys.exit(main(*parse_args()))
