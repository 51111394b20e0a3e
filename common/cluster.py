"""A cluster on one machine: "nodes" joined by a real, rate-limited network, for lessons 07-12.

Each node is a Linux network namespace with one Ethernet link (a veth pair) to a bridge, the "switch", in a
namespace of its own. A token-bucket filter (``tc qdisc ... tbf``) on both ends of every link caps it at the
chosen rate in each direction, as a node's network card would. Processes inside one node still talk over that
node's loopback, at memory speed, as GPUs inside a server talk over NVLink; processes on different nodes talk at
the link's rate. Nothing else changes: the training scripts and ``torchrun`` run as on a real cluster, with
``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` naming the node's link.

    with EmulatedCluster(nodes=2, rate="1gbit") as cluster:
        subprocess.run(cluster.on_node(0, ["python", "-c", "print('hello from node 0')"]))

The namespaces have no link into the machine's own namespace and no route out: their addresses (198.18.0.0/24,
inside the 198.18.0.0/15 block that RFC 2544 sets aside for benchmarking networks) exist only inside them. Every
name starts with the cluster's ``name``. One run holds a name at a time (a lock in /run, which the kernel releases
when its holder dies), so a cluster that an earlier, killed run left behind is found and removed by name, its
processes killed, before a new one is made; a live run's cluster is never touched.

Why pyroute2: it speaks netlink, the kernel's own interface for links, addresses and queueing disciplines, from
Python, so the set-up is a dozen readable calls with errors raised as exceptions, rather than a shell script of
``ip``/``tc`` lines whose failures must be parsed. Mininet builds the same kind of network, but for OpenFlow
switches, with more machinery (and a controller) than two links need. The launchers run under ``ip netns exec``
(iproute2), which enters a namespace by name without running our code between ``fork`` and ``exec``.

It needs root (creating namespaces and links is privileged). ``scripts/cluster.py`` is the command readers run.
"""

import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import time

SUBNET = "198.18.0"  # RFC 2544's benchmarking block: an address here means "this test network", nothing else
PREFIX_LENGTH = 24
LINK = "eth0"  # each node's one link, as on a real machine; GLOO_SOCKET_IFNAME names it
MAX_NODES = 64
UNITS = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


class ClusterError(RuntimeError):
    """The emulator cannot do what was asked; the message says what to do instead (one line)."""


# tbf's rate is a 32-bit count of bytes per second in the kernel's netlink message (struct tc_ratespec): 34.3 Gbit/s
# at most, kept to a round 32gbit.
MAX_RATE_BITS = 32 * 10**9


def parse_rate(rate: str) -> int:
    """``"100mbit"`` -> 100_000_000 bits per second. Written as ``tc`` writes rates: a number and kbit, mbit or
    gbit (decimal units: 1gbit is 10^9 bits/s, as network cards are rated)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(kbit|mbit|gbit)", rate.strip().lower())
    if not match or float(match.group(1)) <= 0:
        raise ClusterError(f"unknown link rate {rate!r}: write it as tc does, e.g. 100mbit, 1gbit or 2.5gbit")
    bits = round(float(match.group(1)) * UNITS[match.group(2)])
    if not 10**5 <= bits <= MAX_RATE_BITS:
        raise ClusterError(f"link rate {rate!r} is outside 100kbit..32gbit, the range this emulator is checked for")
    return bits


def address(node: int) -> str:
    """Node ``node``'s address on the cluster's network: node 0 is 198.18.0.100, node 63 198.18.0.163.

    Three digits for every node, so that the addresses sort as strings in the nodes' order: torchrun's c10d
    rendezvous numbers the nodes by their addresses sorted as strings (lesson 07), and 198.18.0.10 would sort
    before 198.18.0.2."""
    return f"{SUBNET}.{100 + node}"


def token_bucket(rate_bits: int) -> dict:
    """The ``tbf`` settings for a link of ``rate_bits``: a bucket of 96 KiB (or half a millisecond of traffic, if
    more), and a queue of 50 ms before packets are dropped, as a switch port buffers.

    The bucket is what may pass at once, faster than the rate, so a message smaller than it can cross the link
    faster than a real link would carry it. It must hold the largest packet the kernel hands to the queue: with
    segmentation offload a veth passes packets of up to 64 KiB, and a smaller bucket makes tbf cut each one up
    (measured here with gloo's all-reduce of 16 MiB between two nodes at 1 Gbit/s: 72% of the link with a 64 KiB
    bucket, 95% with 96 KiB; one TCP stream reached 95% with either)."""
    return {"rate": f"{rate_bits}bit", "burst": max(96 * 1024, rate_bits // 8 // 2000), "latency": "50ms"}


def require_root() -> None:
    if os.geteuid() != 0:
        raise ClusterError(
            "the emulated cluster needs root to create network namespaces: run it as root, or run the script "
            "without the emulator, on loopback"
        )
    if shutil.which("ip") is None:
        raise ClusterError("the emulated cluster needs iproute2's `ip` command (apt-get install iproute2)")


class EmulatedCluster:
    """``nodes`` network namespaces (``<name>-node0``, ...) on a bridge in ``<name>-switch``, each link capped at
    ``rate`` in both directions. A context manager: the namespaces exist inside the ``with`` block only."""

    def __init__(self, nodes: int, rate: str = "1gbit", name: str = "mgc"):
        if not 1 <= nodes <= MAX_NODES:
            raise ClusterError(f"--nodes must be 1 to {MAX_NODES}, not {nodes}")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", name):
            raise ClusterError(f"cluster name {name!r}: 1-8 lower-case letters and digits, starting with a letter")
        self.nodes, self.rate, self.name = nodes, rate, name
        self.rate_bits = parse_rate(rate)
        self.switch = f"{name}-switch"
        self.namespaces = [f"{name}-node{node}" for node in range(nodes)]

    def __enter__(self) -> "EmulatedCluster":
        require_root()
        # One run per name at a time: the lock is the kernel's, so it is released when its holder dies, however.
        self._lock = open(f"/run/{self.name}-cluster.lock", "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise ClusterError(
                f"another run is using the cluster name {self.name!r}: wait for it, or give this one another --name"
            ) from None
        self._builder = os.getpid()
        removed = remove_stale(self.name)  # its holder is gone: whatever carries the name now is left over
        if removed:
            print(f"cluster: removed {len(removed)} namespace(s) an earlier run left behind: {', '.join(removed)}")
        try:
            self._build()
        except BaseException as error:
            self.close()
            if isinstance(error, (KeyboardInterrupt, ClusterError)):
                raise
            raise ClusterError(
                f"could not build the emulated network ({type(error).__name__}: {error}); this machine may not "
                "allow network namespaces or the tbf qdisc: run the script without the emulator, on loopback"
            ) from error
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        from pyroute2 import NetNS, netns  # imported here: `--help` and the refusals need no netlink

        for namespace in (self.switch, *self.namespaces):
            netns.create(namespace)
        bucket = token_bucket(self.rate_bits)
        with NetNS(self.switch) as switch:
            switch.link("add", ifname="switch", kind="bridge")
            bridge = switch.link_lookup(ifname="switch")[0]
            switch.link("set", index=bridge, state="up")
            for node, namespace in enumerate(self.namespaces):
                # one cable: "port<k>" stays in the switch, its other end becomes eth0 inside node k
                switch.link("add", ifname=f"port{node}", kind="veth", peer={"ifname": LINK, "net_ns_fd": namespace})
                port = switch.link_lookup(ifname=f"port{node}")[0]
                switch.link("set", index=port, master=bridge, state="up")
                switch.tc("add", "tbf", index=port, **bucket)  # switch -> node
        for node, namespace in enumerate(self.namespaces):
            with NetNS(namespace) as host:
                link = host.link_lookup(ifname=LINK)[0]
                host.addr("add", index=link, address=address(node), prefixlen=PREFIX_LENGTH)
                host.link("set", index=link, state="up")
                host.link("set", index=host.link_lookup(ifname="lo")[0], state="up")
                host.tc("add", "tbf", index=link, **bucket)  # node -> switch

    def on_node(self, node: int, command: list[str]) -> list[str]:
        """``command`` run inside node ``node``'s namespace, with the communication libraries on its link."""
        return [
            "ip",
            "netns",
            "exec",
            self.namespaces[node],
            "env",
            f"GLOO_SOCKET_IFNAME={LINK}",
            f"NCCL_SOCKET_IFNAME={LINK}",
            *map(str, command),
        ]

    def close(self) -> None:
        """Remove the namespaces (their links and queues go with them), ending any process left inside. Only the
        process that built them does: a forked copy of it (pyroute2 forks one to work inside a namespace) that
        unwinds through this method leaves them alone."""
        if getattr(self, "_builder", None) != os.getpid():
            return
        for namespace in (*self.namespaces, self.switch):
            delete_namespace(namespace)
        if getattr(self, "_lock", None) is not None:
            self._lock.close()  # closing the file releases the lock
            self._lock = None


# A TCP stream from one node to another: the receiver reads to the end and answers one byte, so the sender's clock
# stops when the last byte has crossed both links' token buckets.
_RECEIVER = """
import socket
with socket.create_server(("0.0.0.0", 5201)) as server:
    print("listening", flush=True)
    connection, _ = server.accept()
    with connection:
        while connection.recv(1 << 20):
            pass
        connection.sendall(b"x")
"""
_SENDER = """
import socket, sys, time
total = int(sys.argv[2])
with socket.create_connection((sys.argv[1], 5201), timeout=30) as s:
    chunk = bytes(1 << 20)
    started, sent = time.perf_counter(), 0
    while sent < total:
        s.sendall(chunk)
        sent += len(chunk)
    s.shutdown(socket.SHUT_WR)
    s.recv(1)
    print(sent * 8 / (time.perf_counter() - started))
"""


def measure_link_rate(
    cluster: "EmulatedCluster", seconds: float = 2.0, sender: int = 0, receiver: int = 1, python: str = sys.executable
) -> float:
    """Bits per second one TCP stream from node ``sender`` to node ``receiver`` carries, sending ``seconds`` worth
    at the set rate: the rate a program sees, to compare with the rate the links were set to."""
    source, sink = sender, receiver
    receiver = subprocess.Popen(cluster.on_node(sink, [python, "-c", _RECEIVER]), stdout=subprocess.PIPE, text=True)
    try:
        if receiver.stdout.readline().strip() != "listening":
            raise ClusterError(f"the receiver on node {sink} did not start")
        total = int(cluster.rate_bits / 8 * seconds)
        sender = subprocess.run(
            cluster.on_node(source, [python, "-c", _SENDER, address(sink), str(total)]),
            capture_output=True,
            text=True,
            timeout=30 + 4 * seconds,
        )
        if sender.returncode != 0:
            raise ClusterError(f"the sender on node {source} failed: {sender.stderr.strip().splitlines()[-1:]}")
        return float(sender.stdout)
    finally:
        receiver.kill()
        receiver.wait()


def course_namespaces(name: str) -> list[str]:
    """The namespaces of cluster ``name`` that exist now (``<name>-switch``, ``<name>-node<k>``)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    found = [line.split()[0] for line in listed if line.strip()]
    return sorted(ns for ns in found if re.fullmatch(rf"{re.escape(name)}-(switch|node\d+)", ns))


def remove_stale(name: str) -> list[str]:
    """Remove the namespaces of a cluster ``name`` that an earlier, killed run left behind; return their names."""
    stale = course_namespaces(name)
    for namespace in stale:
        delete_namespace(namespace)
    return stale


def delete_namespace(namespace: str) -> None:
    """Kill every process still in ``namespace`` (only our launchers' leftovers can be there), until none is left,
    then delete it; quiet if it is gone. Deleting removes the name only: a process left inside would keep the
    namespace, and its links, alive unseen."""
    for _ in range(50):
        listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
        if listed.returncode != 0:  # no such namespace
            return
        pids = listed.stdout.split()
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        time.sleep(0.1)  # the kernel reaps them; a process forked meanwhile is caught by the next round
    subprocess.run(["ip", "netns", "delete", namespace], capture_output=True, text=True)
