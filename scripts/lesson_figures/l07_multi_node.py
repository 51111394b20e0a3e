"""Lesson 07's pictures: the ranks of two nodes, the c10d rendezvous, the agent's restart loop, how a checkpoint is
committed and found, a crash resumed on a timeline, a resume at another world size, the emulated cluster, and the bus
bandwidth over its slow link."""

import json
from pathlib import Path

from common.cli import parse_size

from .draw import COMMUNICATE, COMPUTE, IDLE, MEMORY, RANK_COLOURS, RESULTS, arrow, box, canvas, plt, save

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


def two_node_ranks(path: Path) -> None:
    """2 nodes x 2 GPUs: RANK, LOCAL_RANK, GROUP_RANK and the GPU of each process; rank 0 alone writes checkpoints."""
    fig, axes = canvas(9, 4.8, xlim=10, ylim=5.4)
    for node, x in enumerate((0.2, 5.2)):
        box(axes, x, 1.5, 4.6, 3.2, "", "#eef4fb")
        axes.text(x + 2.3, 4.4, f"node {node}: GROUP_RANK {node}", ha="center", fontsize=10, weight="bold")
        axes.text(x + 2.3, 4.05, "one torchrun, --nproc-per-node 2", ha="center", fontsize=8)
        for local in range(2):
            rank = 2 * node + local
            px = x + 0.25 + local * 2.2
            text = f"RANK {rank}\nLOCAL_RANK {local}\ncuda:{local}"
            box(axes, px, 1.9, 1.9, 1.8, text, RANK_COLOURS[rank], 9)
    axes.text(5.0, 5.15, "WORLD_SIZE 4, LOCAL_WORLD_SIZE 2 on each node", ha="center", fontsize=10)
    axes.text(5.0, 1.2, "RANK = GROUP_RANK x 2 + LOCAL_RANK", ha="center", fontsize=9)
    box(axes, 0.2, 0.05, 4.6, 0.7, "shared checkpoint folder (NFS, Lustre, ...)", MEMORY, 9)
    arrow(axes, (1.4, 1.9), (1.4, 0.78), colour="black")
    axes.text(1.55, 1.35, "rank 0 writes", fontsize=8, va="center")
    axes.text(
        5.4,
        0.4,
        "LOCAL_RANK 0 exists on every node:\na writer per node would race",
        fontsize=8,
        va="center",
        color="#b03030",
    )
    save(fig, path)


def c10d_rendezvous(path: Path) -> None:
    """The c10d store on the endpoint's machine, each agent's (address, pid, counter), sorted into node ranks.

    Host names and process IDs are illustrative: node9 hosts the store and joins first, node10 sorts first."""
    fig, axes = canvas(10, 5.2, xlim=10, ylim=5.6)
    axes.text(
        5.0,
        5.35,
        "c10d rendezvous: the same line on every node (illustrative host names and PIDs)",
        ha="center",
        fontsize=10,
    )
    # the two machines, each with its torchrun agent
    box(axes, 0.1, 2.9, 3.1, 2.0, "", "#eef4fb")
    axes.text(1.65, 4.6, "machine node9 = HOST", ha="center", fontsize=9, weight="bold")
    box(axes, 0.3, 3.85, 2.7, 0.55, "c10d store at HOST:PORT", COMMUNICATE, 8)
    box(axes, 0.3, 3.05, 1.9, 0.6, "agent (torchrun,\nis_host=1), joins 1st", "#ffffff", 8)
    arrow(axes, (1.25, 3.65), (1.25, 3.85))  # node9's agent writes its triple into its own store
    box(axes, 0.1, 0.3, 3.1, 2.0, "", "#eef4fb")
    axes.text(1.65, 1.85, "machine node10", ha="center", fontsize=9, weight="bold")
    box(axes, 0.3, 0.55, 1.9, 0.6, "agent (torchrun)\njoins 2nd", "#ffffff", 8)
    # node10's agent is a client of the store, not of node9's agent
    axes.plot([2.2, 2.65], [0.85, 0.85], color="#555555", lw=1.2)
    arrow(axes, (2.65, 0.85), (2.65, 3.85), colour="#555555")
    axes.text(
        2.55, 2.82, "connects to HOST:PORT,\nwrites its triple", fontsize=8, color="#555555", ha="right", va="top"
    )
    # what the store holds, then sorted
    box(axes, 3.8, 2.9, 2.7, 1.7, "", "#ffffff")
    axes.text(5.15, 4.3, "contents of the store on node9", ha="center", fontsize=8, weight="bold")
    axes.text(5.15, 3.85, "(node9, 4711, 0)", ha="center", fontsize=8, family="monospace")
    axes.text(5.15, 3.4, "(node10, 5230, 0)", ha="center", fontsize=8, family="monospace")
    axes.text(5.15, 3.05, "address, PID, counter", ha="center", fontsize=7, color="#555555")
    arrow(axes, (3.0, 4.12), (3.8, 4.12))
    box(axes, 3.8, 0.3, 2.7, 2.0, "", "#ffffff")
    axes.text(5.15, 2.0, "--nnodes reached: sort", ha="center", fontsize=8, weight="bold")
    axes.text(5.15, 1.45, '"node10" < "node9"', ha="center", fontsize=8, family="monospace")
    axes.text(5.15, 0.95, "node10 -> GROUP_RANK 0", ha="center", fontsize=8)
    axes.text(5.15, 0.55, "node9  -> GROUP_RANK 1", ha="center", fontsize=8)
    arrow(axes, (5.15, 2.9), (5.15, 2.3))
    # each agent starts its workers
    for group_rank, (name, y) in enumerate((("node10", 0.3), ("node9", 2.9))):
        box(axes, 7.1, y, 2.8, 2.0, "", "#eef4fb")
        axes.text(8.5, y + 1.7, f"{name} starts its workers", ha="center", fontsize=8, weight="bold")
        for local in range(2):
            rank = 2 * group_rank + local
            box(axes, 7.25 + local * 1.35, y + 0.2, 1.2, 1.2, f"RANK {rank}\nLOCAL {local}", RANK_COLOURS[rank], 8)
    arrow(axes, (6.5, 1.0), (7.1, 1.0))
    arrow(axes, (6.5, 1.6), (7.1, 3.6))
    save(fig, path)


def restart_loop(path: Path) -> None:
    """torchrun's agent (SimpleElasticAgent._invoke_run): start, watch, on a failure stop all, restart or give up."""
    fig, axes = canvas(10, 4.8, xlim=10, ylim=5.4)
    axes.text(5.0, 5.2, "What the agent of one node does under torchrun --max-restarts N", ha="center", fontsize=10)
    box(axes, 0.2, 3.6, 2.2, 1.0, "rendezvous\n(join, get ranks)", COMMUNICATE, 9)
    box(axes, 3.0, 3.6, 2.2, 1.0, "start the workers:\nscript from the top", COMPUTE, 9)
    box(axes, 5.8, 3.6, 2.0, 1.0, "watch them", "#ffffff", 9)
    box(axes, 8.3, 3.6, 1.5, 1.0, "all done:\nexit 0", MEMORY, 9)
    arrow(axes, (2.4, 4.1), (3.0, 4.1))
    arrow(axes, (5.2, 4.1), (5.8, 4.1))
    arrow(axes, (7.8, 4.1), (8.3, 4.1))
    arrow(axes, (6.8, 3.6), (6.8, 2.7))
    axes.text(6.9, 3.15, "a worker fails", fontsize=8)
    box(axes, 5.6, 1.8, 2.4, 0.9, "stop every worker\non this node", "#f4cccc", 9)
    arrow(axes, (5.6, 2.25), (4.8, 2.25))
    box(axes, 2.6, 1.8, 2.2, 0.9, "restarts left?", IDLE, 9)
    arrow(axes, (3.1, 2.7), (1.3, 3.6), colour="#2a6f2a")
    axes.text(1.15, 2.75, "yes: spend one,\njoin again", fontsize=8, color="#2a6f2a", ha="center")
    arrow(axes, (3.7, 1.8), (3.7, 1.05), colour="#b03030")
    axes.text(3.8, 1.42, "no", fontsize=8, color="#b03030")
    box(axes, 2.3, 0.1, 2.8, 0.9, "exit non-zero, summary\nnames the failed rank", "#f4cccc", 9)
    box(axes, 5.8, 0.1, 4.0, 1.4, "", "#ffffff")
    axes.text(
        7.8,
        0.8,
        "On the other nodes: an agent whose workers still run\nsees a node waiting and restarts them (no restart\n"
        "spent). One whose workers failed first spends one.\nRestarted workers load the newest valid checkpoint.",
        ha="center",
        va="center",
        fontsize=8,
    )
    save(fig, path)


def checkpoint_commit(path: Path) -> None:
    """Writing a checkpoint (temporary file, os.replace, digest last) and finding the newest valid one.

    The step numbers and the two broken checkpoints are illustrative."""
    fig, panels = plt.subplots(1, 2, figsize=(10, 4.2), gridspec_kw={"width_ratios": [1, 1.15]})
    left, right = panels
    for axes in panels:
        axes.set_xlim(0, 10)
        axes.set_ylim(0, 6)
        axes.axis("off")
    left.set_title("Global rank 0 writes, in this order", fontsize=10)
    steps = [
        ("1. torch.save, fsync ->\n    .step_00000120.pt.XXXX.tmp", IDLE),
        ("2. os.replace -> step_00000120.pt", COMPUTE),
        ("3. SHA-256 -> a .tmp, os.replace ->\n    step_00000120.pt.sha256", MEMORY),
    ]
    for i, (text, colour) in enumerate(steps):
        box(left, 0.3, 4.3 - i * 1.55, 9.2, 1.1, text, colour, 9, family="monospace")
        if i:
            arrow(left, (4.9, 4.3 - (i - 1) * 1.55), (4.9, 5.4 - i * 1.55))
    left.text(
        5.0,
        0.35,
        "a rename in the same folder replaces a name in one step:\nno reader sees half a file. The digest comes last:\n"
        "it marks the checkpoint as complete.",
        ha="center",
        fontsize=8,
    )
    right.set_title("On start: rank 0 walks from the newest down (illustrative)", fontsize=10)
    rows = [
        ("step_00000020.pt", "no .sha256: cut off\nbetween the two writes", "#f4cccc", "skip"),
        ("step_00000016.pt", ".sha256 does not match:\na byte changed later", "#f4cccc", "skip"),
        ("step_00000012.pt", ".sha256 matches", MEMORY, "load"),
    ]
    for i, (name, why, colour, verdict) in enumerate(rows):
        y = 4.5 - i * 1.45
        box(right, 0.2, y, 3.9, 1.0, name, colour, 9, family="monospace")
        right.text(4.4, y + 0.5, why, fontsize=8, va="center")
        right.text(
            8.6,
            y + 0.5,
            verdict,
            fontsize=9,
            va="center",
            weight="bold",
            color="#b03030" if verdict == "skip" else "#2a6f2a",
        )
    arrow(right, (0.1, 5.4), (0.1, 1.1), colour="#555555")
    right.text(
        5.0,
        0.3,
        "broadcast to every rank: all load step 12",
        ha="center",
        fontsize=9,
    )
    save(fig, path)


def crash_resume_timeline(path: Path) -> None:
    """The notebook's drill: 2 epochs of 12 steps, a checkpoint every 4, rank 3 fails at step 14, resume from 12."""
    fig, axes = canvas(10, 3.8, xlim=30, ylim=6.0)
    x0 = 3.0  # step s occupies [x0 + s - 1, x0 + s - 0.1]

    def step_box(step, y, colour):
        axes.add_patch(plt.Rectangle((x0 + step - 1, y), 0.9, 0.7, fc=colour, ec="black", lw=0.5))

    axes.text(
        15.0,
        5.7,
        "The notebook's fault drill: --checkpoint-every 4, --fail-at-step 14, --max-restarts 1",
        ha="center",
        fontsize=10,
    )
    axes.text(0.0, 3.85, "attempt 0", fontsize=9, va="center", weight="bold")
    for step in range(1, 14):
        step_box(step, 3.5, COMPUTE)
    # step 14 never runs: rank 3 raises before its forward pass, so no rank finishes it
    axes.add_patch(plt.Rectangle((x0 + 13, 3.5), 0.9, 0.7, fc="white", ec="#b03030", lw=1.2, ls="--", hatch="//"))
    axes.text(
        x0 + 14.2,
        3.85,
        "rank 3 fails on reaching step 14, before computing it:\nstep 14 never runs, every worker stops",
        fontsize=8,
        va="center",
        color="#b03030",
    )
    for saved in (4, 8, 12):
        edge = x0 + saved - 0.05  # after the step: between its box and the next
        axes.plot([edge, edge], [3.35, 4.4], color="#2a6f2a", lw=1.6)
        axes.text(edge, 4.55, f"save {saved}", ha="center", fontsize=8, color="#2a6f2a")
    axes.text(0.0, 1.85, "attempt 1", fontsize=9, va="center", weight="bold")
    for step in range(13, 25):
        step_box(step, 1.5, "#fdd0a2" if step == 13 else COMPUTE)
    arrow(axes, (x0 + 11.95, 3.35), (x0 + 11.95, 2.3), colour="#2a6f2a")
    axes.text(
        x0 + 11.7,
        1.85,
        "loads step_00000012.pt,\nthe newest valid one",
        fontsize=8,
        va="center",
        ha="right",
        color="#2a6f2a",
    )
    axes.text(x0 + 12.5, 1.4, "13 again, then 14\nfor the first time", fontsize=8, ha="center", va="top")
    axes.text(x0 + 24.0, 1.4, "step 24: torch.equal to\nthe uninterrupted run", fontsize=8, ha="right", va="top")
    for step in (1, 12, 24):
        axes.text(x0 + step - 0.55, 0.2, str(step), ha="center", fontsize=8)
    axes.text(x0 + 6.0, 0.2, "optimizer step (2 epochs of 12)", ha="center", fontsize=8)
    axes.text(x0 + 12.3, 2.65, "epoch 2 starts", fontsize=8, color="#555555")
    save(fig, path)


def resize_resume_order(path: Path) -> None:
    """How a resume at another world size finds the samples already trained: positions of the epoch's order, dealt
    out round-robin. Illustrative: 24 samples, batches of 2, 2 ranks train 2 batches each, then 4 ranks resume."""
    fig, axes = canvas(10, 4.2, xlim=10, ylim=6.2)
    x0, width = 1.55, 0.34  # position p occupies [x0 + p * width, x0 + (p + 1) * width)

    def cell(position, y, colour, text="", hatch=None):
        axes.add_patch(
            plt.Rectangle((x0 + position * width, y), width * 0.92, 0.55, fc=colour, ec="black", lw=0.5, hatch=hatch)
        )
        if text:
            axes.text(x0 + (position + 0.46) * width, y + 0.27, text, ha="center", va="center", fontsize=8)

    axes.text(
        5.0,
        6.0,
        "One epoch's shuffled order, dealt out round-robin (illustrative: 24 samples, 2 per batch)",
        ha="center",
        fontsize=10,
    )
    for position in range(0, 24, 4):
        axes.text(x0 + (position + 0.46) * width, 5.25, str(position), ha="center", fontsize=8, color="#555555")
    axes.text(0.0, 5.25, "position", fontsize=8, color="#555555")
    axes.text(5.0, 5.55, "the number in a cell: the rank that trains that position", ha="center", fontsize=8)
    # 2 ranks: rank r takes positions r, r + 2, ...; 2 batches of 2 each = positions 0 to 7
    axes.text(0.0, 4.5, "2 ranks", fontsize=9, weight="bold", va="center")
    for position in range(24):
        trained = position < 8
        cell(position, 4.22, RANK_COLOURS[position % 2] if trained else "#ffffff", str(position % 2))
    axes.text(
        x0 + 4 * width,
        3.85,
        "2 batches of 2 on each rank: positions 0-7 trained, then the crash",
        ha="center",
        fontsize=8,
        va="top",
    )
    axes.text(x0 + 24 * width + 0.1, 4.5, "checkpoint:\n8 samples done", fontsize=8, va="center", color="#2a6f2a")
    # 4 ranks, resumed from 8 samples: the rest dealt out over 4 ranks
    axes.text(0.0, 2.75, "4 ranks,\nresumed", fontsize=9, weight="bold", va="center")
    for position in range(24):
        if position < 8:
            cell(position, 2.47, "#eeeeee", hatch="//")
        else:
            cell(position, 2.47, RANK_COLOURS[(position - 8) % 4], str((position - 8) % 4))
    axes.text(
        x0 + 16 * width,
        2.1,
        "the other 16 positions, dealt out over 4 ranks: each sample once",
        ha="center",
        fontsize=8,
        va="top",
    )
    # what a count of per-rank batches would have skipped
    axes.text(0.0, 1.0, "skip 2 batches\nper rank", fontsize=9, weight="bold", va="center", color="#b03030")
    for position in range(24):
        if position < 16:
            cell(position, 0.72, "#f4c7c7" if position >= 8 else "#eeeeee", hatch="//")
        else:
            cell(position, 0.72, RANK_COLOURS[(position - 16) % 4], str((position - 16) % 4))
    axes.text(
        x0 + 12 * width,
        0.35,
        "at 4 ranks, 2 batches per rank are 16 positions: 8-15 would never be trained",
        ha="center",
        fontsize=8,
        va="top",
        color="#b03030",
    )
    save(fig, path)


FIGURES = {
    "07_two_node_ranks": (two_node_ranks, None),
    "07_c10d_rendezvous": (c10d_rendezvous, None),
    "07_restart_loop": (restart_loop, None),
    "07_checkpoint_commit": (checkpoint_commit, None),
    "07_crash_resume_timeline": (crash_resume_timeline, None),
    "07_resize_resume_order": (resize_resume_order, None),
    "07_emulated_cluster": (emulated_cluster, None),
    "07_slow_link_bus_bandwidth": (slow_link_bus_bandwidth, CLUSTER_RESULTS),
}
