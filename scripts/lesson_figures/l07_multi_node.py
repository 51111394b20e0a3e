"""Lesson 07's pictures: the emulated cluster, and the bus bandwidth measured over its slow link."""

import json
from pathlib import Path

from common.cli import parse_size

from .draw import RESULTS, box, canvas, plt, save

CLUSTER_RESULTS = RESULTS / "cluster_network.json"


def emulated_cluster(path: Path) -> None:
    """Two nodes (network namespaces) of two processes, each node's eth0 cabled to a bridge, tbf on both ends."""
    fig, axes = canvas(9, 4.6)
    for node, x in enumerate((0.2, 6.2)):
        box(axes, x, 0.4, 3.6, 4.6, "", "#eef4fb")
        axes.text(x + 1.8, 4.6, f"node {node} (namespace mgc-node{node})", ha="center", fontsize=9, weight="bold")
        for local, y in enumerate((3.3, 1.9)):
            box(axes, x + 0.3, y, 1.4, 0.9, f"rank {2 * node + local}\n(process)", "#ffffff", 9)
        axes.annotate("", xy=(x + 1.0, 2.85), xytext=(x + 1.0, 3.25), arrowprops={"arrowstyle": "<->"})
        axes.text(x + 1.85, 3.05, "TCP over loopback:\nabout 1 GB/s here", fontsize=8, va="center", color="#2a6f2a")
        eth_x = x + 2.6 if node == 0 else x + 0.2
        box(axes, eth_x, 0.8, 0.8, 0.6, "eth0", "#ffe9c7", 9)
        axes.text(eth_x + 0.4, 0.7, f"198.18.0.{100 + node}", ha="center", va="top", fontsize=8)
    box(axes, 4.3, 3.2, 1.4, 1.0, "switch\n(bridge)", "#dddddd", 9)
    for start, end in (((3.62, 1.4), (4.3, 3.4)), ((6.38, 1.4), (5.7, 3.4))):
        axes.plot(*zip(start, end), color="#c05000", lw=2.5)
    axes.text(5.0, 1.2, "each link: tbf\nat 1 Gbit/s,\nboth directions", ha="center", fontsize=9, color="#c05000")
    axes.text(5.0, 5.6, "One machine, two emulated nodes of two processes each (scripts/cluster.py)", ha="center")
    save(fig, path)


def slow_link_bus_bandwidth(path: Path) -> None:
    """Bus bandwidth against size, gloo's all-reduce and the hand-written ring, over 1 Gbit/s and over loopback."""
    rows = json.loads(CLUSTER_RESULTS.read_text())["allreduce"]
    sizes = list(dict.fromkeys(row["size"] for row in rows))  # in the order measured: smallest first
    fig, axes = plt.subplots(figsize=(7, 4))
    styles = {("1gbit", "dist.all_reduce"): ("tab:blue", "-"), ("1gbit", "ring"): ("tab:orange", "-")}
    styles |= {("loopback", "dist.all_reduce"): ("tab:blue", ":"), ("loopback", "ring"): ("tab:orange", ":")}
    for (where, algorithm), (colour, line) in styles.items():
        # from the size and the time: the printed busbw has 3 decimals, too few for the smallest sizes. With 2 ranks
        # busbw = algbw x 2(N-1)/N = S / t.
        ms = {row["size"]: row["ms"] for row in rows if (row["where"], row["algorithm"]) == (where, algorithm)}
        values = [parse_size(size) / (ms[size] / 1e3) / 1e9 for size in sizes]
        label = f"{algorithm}, {'1 Gbit/s link' if where == '1gbit' else where}"
        axes.plot(sizes, values, marker="o", color=colour, linestyle=line, label=label)
    axes.axhline(0.125, color="black", lw=1, linestyle="--", label="the link: 1 Gbit/s = 0.125 GB/s")
    axes.set_yscale("log")
    axes.set_xlabel("all-reduce size (bytes), 2 ranks")
    axes.set_ylabel("bus bandwidth (GB/s)")
    axes.set_title("Two nodes over an emulated 1 Gbit/s link against two processes on loopback")
    axes.legend(fontsize=8)
    save(fig, path)


FIGURES = {
    "07_emulated_cluster": (emulated_cluster, None),
    "07_slow_link_bus_bandwidth": (slow_link_bus_bandwidth, CLUSTER_RESULTS),
}
