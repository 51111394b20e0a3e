"""Lesson 03's pictures: ranks on two nodes, a DDP step's buckets on a timeline and per layer, the sampler's shards,
BatchNorm's buffers under DDP, and collectives that pair up by order (with Join as the fix)."""

import json
import re
from pathlib import Path

from torch.utils.data import DistributedSampler

from .draw import COMMUNICATE, COMPUTE, IDLE, RANK_COLOURS, REPO, arrow, box, canvas, save

NOTEBOOK = REPO / "notebooks" / "03_distributed_data_parallel.ipynb"
BUCKETS_CELL = "78c3cd83"  # the notebook cell "DDP's gradient buckets": what a communication hook recorded
BUCKET_LINE = re.compile(r"step (\d+), bucket (\d+): ([\d.]+) MiB  (.*)")
RED = "#c0392b"


def ranks_on_two_nodes(path: Path) -> None:
    """Two nodes of four GPUs: one process per GPU, each with its RANK, LOCAL_RANK, and the sizes torchrun sets."""
    fig, axes = canvas(9.5, 4.4, xlim=10, ylim=5.6)
    axes.text(5, 5.35, "torchrun sets WORLD_SIZE=8 in every process", ha="center", fontsize=11, weight="bold")
    axes.text(5, 4.95, "illustrative: 2 nodes x 4 GPUs, one torchrun per node", ha="center", fontsize=9, style="italic")
    for node, x in enumerate((0.15, 5.1)):
        box(axes, x, 0.35, 4.75, 4.2, "", "#eef4fb")
        axes.text(x + 2.375, 4.2, f"node {node}: LOCAL_WORLD_SIZE=4", ha="center", fontsize=10, weight="bold")
        for local in range(4):
            rank = 4 * node + local
            gx = x + 0.15 + local * 1.15
            box(axes, gx, 1.9, 1.0, 1.9, "", "#ffffff")
            axes.text(gx + 0.5, 3.45, f"GPU {local}", ha="center", fontsize=9, weight="bold")
            axes.text(gx + 0.5, 2.85, f"RANK={rank}", ha="center", fontsize=9, color=RANK_COLOURS[rank])
            axes.text(gx + 0.5, 2.3, f"LOCAL_\nRANK={local}", ha="center", fontsize=8, linespacing=1.0)
        axes.text(
            x + 2.375,
            1.1,
            "RANK: unique over all nodes (who am I?)\nLOCAL_RANK: unique on this node (which GPU?)",
            ha="center",
            va="center",
            fontsize=8.5,
        )
    save(fig, path)


def _timeline_panel(axes, y, title, buckets, rebuild):
    """One step on two lanes: compute (forward, then backward layer by layer) and communication (bucket all-reduces).

    ``buckets``: ``[(label, index of the backward block after which it is ready, width), ...]`` in launch order.
    """
    axes.text(0.1, y + 2.05, title, fontsize=10, weight="bold")
    axes.text(0.1, y + 1.35, "compute", fontsize=9, va="center")
    axes.text(0.1, y + 0.5, "communication", fontsize=9, va="center")
    if rebuild:
        box(axes, 1.55, y + 1.05, 0.9, 0.6, "rebuild\n(step 2\nonly)", "#f2f2f2", 8)
    x = 2.55
    box(axes, x, y + 1.05, 1.6, 0.6, "forward", COMPUTE, 9)
    x += 1.7
    ends = []
    for layer in range(5, -1, -1):  # autograd computes the last layer's gradients first
        box(axes, x, y + 1.05, 0.75, 0.6, f"grad\nlayer {layer}", "#c6dbef", 8)
        x += 0.8
        ends.append(x - 0.05)
    comm_end = 0
    for label, ready_after, width in buckets:
        start = max(ends[ready_after] + 0.05, comm_end + 0.05)
        box(axes, start, y + 0.2, width, 0.6, label, COMMUNICATE, 8)
        axes.plot([ends[ready_after], ends[ready_after]], [y + 1.05, y + 0.8], color="black", lw=0.8, ls=":")
        comm_end = start + width
    wait = comm_end + 0.05
    if wait > x:
        box(axes, x, y + 1.05, wait - x - 0.05, 0.6, "wait", IDLE, 8)
        x = wait
    box(axes, x, y + 1.05, 1.1, 0.6, "optimizer\nstep", "#a1d99b", 8)


def backward_timeline(path: Path) -> None:
    """DDP's first step (one bucket, sent after the whole backward) against later steps (buckets overlap backward)."""
    fig, axes = canvas(10, 5.4, xlim=14, ylim=5.6)
    first = [("all-reduce bucket 0\n(every gradient)", 5, 3.0)]
    later = [("all-reduce bucket 0\n(layers 5 to 2)", 3, 2.0), ("all-reduce\nbucket 1\n(layers 1, 0)", 5, 1.3)]
    _timeline_panel(
        axes, 3.0, "Step 1: one bucket of all 12 tensors, sent when the last gradient is ready", first, False
    )
    _timeline_panel(axes, 0.35, "Step 2 and later: bucket 0 travels while layers 1 and 0 still compute", later, True)
    axes.text(
        13.9, 0.02, "illustrative: six Linear layers, durations not to scale", ha="right", fontsize=8, style="italic"
    )
    save(fig, path)


def _recorded_buckets() -> dict:
    """``{configuration: {step: [(bucket index, MiB, [parameter names]), ...]}}`` from the notebook's saved output."""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    cell = next(cell for cell in cells if cell.get("id") == BUCKETS_CELL)
    text = "".join("".join(output.get("text", "")) for output in cell["outputs"])
    recorded, name = {}, None
    for line in text.splitlines():
        match = BUCKET_LINE.search(line)
        if match is None:
            name = line.strip()
            recorded[name] = {}
            continue
        step, index, mib, parameters = match.groups()
        recorded[name].setdefault(int(step), []).append((int(index), mib, parameters.split()))
    return recorded


def bucket_grid(path: Path) -> None:
    """Which bucket each of the six layers' tensors fell in, per configuration and step, as the notebook recorded."""
    recorded = _recorded_buckets()
    rows = [
        ("default, step 1", recorded["default"][1]),
        ("default, step 2 on", recorded["default"][2]),
        ("bucket_cap_mb=0.3, step 2 on", recorded["bucket_cap_mb=0.3"][2]),
        ("find_unused_parameters=True,\nevery step", recorded["find_unused_parameters=True"][1]),
    ]
    tensors = [f"{layer}.{kind}" for layer in range(6) for kind in ("weight", "bias")]
    widths = {"weight": 0.9, "bias": 0.3}
    fig, axes = canvas(10.5, 5.2, xlim=15.8, ylim=len(rows) + 1.4)
    axes.set_ylim(-1.1, len(rows) + 1.4)  # room below the rows for the find_unused_parameters cut and the caption
    x0 = 3.0
    for column, name in enumerate(tensors):
        layer, kind = name.split(".")
        x = x0 + int(layer) * 1.3 + (0.95 if kind == "bias" else 0)
        axes.text(x + widths[kind] / 2, len(rows) + 0.15, "w" if kind == "weight" else "b", ha="center", fontsize=8)
        if kind == "weight":
            axes.text(x + 0.6, len(rows) + 0.55, f"layer {layer}", ha="center", fontsize=9)
    for row, (label, buckets) in enumerate(rows):
        y = len(rows) - 1 - row
        axes.text(x0 - 0.15, y + 0.4, label, ha="right", va="center", fontsize=9)
        where = {name: index for index, _, names in buckets for name in names}
        for name in tensors:
            layer, kind = name.split(".")
            x = x0 + int(layer) * 1.3 + (0.95 if kind == "bias" else 0)
            box(axes, x, y + 0.1, widths[kind], 0.6, str(where[name]), RANK_COLOURS[where[name]], 8, color="white")
        sizes = ", ".join(f"{index}: {mib} MiB" for index, mib, _ in sorted(buckets))
        axes.text(x0 + 6 * 1.3 + 0.1, y + 0.4, f"bucket {sizes}", va="center", fontsize=8.5)
    # find_unused_parameters=True (the bottom row): mark where the 1 MiB cut, counted from layer 0, fell
    where = {name: index for index, _, names in rows[-1][1] for name in names}
    for before, after in zip(tensors, tensors[1:]):
        if where[before] != where[after]:
            layer, kind = after.split(".")
            x = x0 + int(layer) * 1.3 + (0.95 if kind == "bias" else 0) - 0.025
            axes.plot([x, x], [-0.15, 0.85], color=RED, lw=2)
            axes.text(
                x,
                -0.35,
                f"the 1 MiB cut, counted from layer 0, falls inside layer {layer}: its weight and bias split",
                ha="center",
                fontsize=8.5,
                color=RED,
            )
    axes.text(
        7.2,
        -0.95,
        "Six Linear(256, 256) layers on 2 ranks; a cell's number is the bucket its gradient travels in "
        "(bucket 0 first)",
        ha="center",
        fontsize=8.5,
        style="italic",
    )
    save(fig, path)


def sampler_shards(path: Path) -> None:
    """DistributedSampler shuffles one permutation, pads it with its own first indices, and deals it round-robin."""
    size, ranks = 10, 3
    shards = [list(DistributedSampler(list(range(size)), num_replicas=ranks, rank=r, seed=0)) for r in range(ranks)]
    padded = [shards[position % ranks][position // ranks] for position in range(sum(map(len, shards)))]
    fig, axes = canvas(9, 4.6, xlim=13.5, ylim=6.4)
    axes.text(0.1, 5.95, "1. one shuffled permutation of the data set's indices, the same on every rank", fontsize=9)
    axes.text(0.1, 3.45, "2. dealt round-robin: position p goes to rank p mod 3", fontsize=9)
    for position, index in enumerate(padded):
        x = 0.3 + position * 1.05
        pad = position >= size
        rank = position % ranks
        box(axes, x, 4.6, 0.85, 0.8, str(index), "#ffffff" if pad else "#f4f4f4", 11)
        if pad:
            axes.add_patch(plt_rectangle(x, 4.6, 0.85, 0.8))
        axes.text(x + 0.42, 4.35, f"p={position}", ha="center", fontsize=8, color=RANK_COLOURS[rank])
    axes.annotate(
        "padding: the permutation's\nfirst indices again",
        xy=(0.3 + 10.5 * 1.05 + 0.4, 4.2),
        xytext=(8.6, 3.45),
        fontsize=8.5,
        color=RED,
        arrowprops={"arrowstyle": "->", "color": RED},
    )
    for rank, shard in enumerate(shards):
        y = 2.3 - rank * 0.95
        axes.text(0.3, y + 0.35, f"rank {rank}", fontsize=10, color=RANK_COLOURS[rank], weight="bold", va="center")
        for column, index in enumerate(shard):
            x = 1.8 + column * 1.05
            pad = column * ranks + rank >= size
            box(axes, x, y, 0.85, 0.7, str(index), RANK_COLOURS[rank] if not pad else "#ffffff", 11)
            if pad:
                axes.add_patch(plt_rectangle(x, y, 0.85, 0.7))
        axes.text(6.2, y + 0.35, f"{len(shard)} samples", fontsize=9, va="center")
    axes.text(
        13.4,
        0.05,
        "illustrative: 10 samples, 3 ranks, seed 0, epoch 0\nhatched: a padded (repeated) sample",
        ha="right",
        fontsize=8.5,
        style="italic",
    )
    save(fig, path)


def plt_rectangle(x, y, width, height):
    """A hatched, transparent rectangle that marks a padded sample."""
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), width, height, fill=False, hatch="///", edgecolor=RED, lw=0)


def batchnorm_buffers(path: Path) -> None:
    """BatchNorm's running statistics on two ranks over three steps: rank 0's broadcast at every forward."""
    fig, axes = canvas(10, 4.4, xlim=15, ylim=6.2)
    rows = {0: 3.6, 1: 1.5}
    for rank, y in rows.items():
        axes.text(0.1, y + 0.4, f"rank {rank}", fontsize=10, weight="bold", color=RANK_COLOURS[rank], va="center")
    holds = {0: [], 1: []}
    letters = {0: "A", 1: "B"}
    x = 1.3
    for step in range(1, 4):
        axes.text(x + 2.45, 5.5, f"step {step}", ha="center", fontsize=10, weight="bold")
        axes.text(x + 2.45, 5.0, f"batches A{step}, B{step}", ha="center", fontsize=9)
        arrow(axes, (x + 0.35, rows[0] - 0.05), (x + 0.35, rows[1] + 0.85), colour=RED)
        axes.text(x + 0.45, 2.95, "broadcast\nrank 0's\nbuffers", fontsize=8.5, color=RED, va="center")
        holds[1] = list(holds[0])
        for rank, y in rows.items():
            holds[rank] = holds[rank] + [f"{letters[rank]}{step}"]
            box(axes, x + 1.6, y, 1.7, 0.8, "+".join(holds[rank]), "#ffffff", 9)
        x += 3.6
    axes.text(x + 1.45, 5.5, "evaluate via DDP", ha="center", fontsize=10, weight="bold")
    arrow(axes, (x + 0.35, rows[0] - 0.05), (x + 0.35, rows[1] + 0.85), colour=RED)
    for rank, y in rows.items():
        box(axes, x + 0.6, y, 1.7, 0.8, "+".join(holds[0]), "#fff3c4", 9)
    axes.text(
        0.1,
        0.35,
        "A1, A2, A3: rank 0's batches; B1, B2, B3: rank 1's. A box lists the batches whose statistics the running "
        "averages hold,\nwith DDP's default forward_sync_buffers=True and no Join (under Join the highest rank "
        "still training sends).\nNo box ever holds the global batch (A and B together): that takes synchronized "
        "BatchNorm.",
        fontsize=8.5,
    )
    save(fig, path)


def _call(axes, x, y, text, colour, width=1.9):
    """A collective call drawn as a box at ``(x, y)``; returns the x of its centre, where a pairing line starts."""
    box(axes, x, y, width, 0.55, text, colour, 8)
    return x + width / 2


def collectives_pair_by_order(path: Path) -> None:
    """Rank 0's extra gradient all-reduce pairs with rank 1's next collective; Join answers it with zeros instead."""
    fig, axes = canvas(10, 5.8, xlim=15, ylim=8.2)
    lanes = {7.8: "Without Join: rank 0 has 4 batches, rank 1 has 3", 3.75: "With Join([net]) around the loop"}
    for top, title in lanes.items():
        axes.text(0.1, top, title, fontsize=10, weight="bold")
        axes.text(0.1, top - 0.85, "rank 0", fontsize=9, weight="bold", color=RANK_COLOURS[0], va="center")
        axes.text(0.1, top - 2.45, "rank 1", fontsize=9, weight="bold", color=RANK_COLOURS[1], va="center")

    def pair(top, x0, x1, colour="black", lw=1.0):
        axes.plot([x0, x1], [top - 1.15, top - 2.2], color=colour, lw=lw)

    for step in range(4):
        x = 1.2 + step * 2.2
        for top in lanes:
            centre0 = _call(axes, x, top - 1.15, f"step {step + 1}:\nall-reduce grads", COMMUNICATE)
            if step < 3:
                pair(top, centre0, _call(axes, x, top - 2.75, f"step {step + 1}:\nall-reduce grads", COMMUNICATE))
    fourth = 1.2 + 3 * 2.2 + 0.95
    # without Join: rank 1 goes on to replicas_in_sync, whose all-reduce pairs with rank 0's fourth gradient all-reduce
    pair(
        7.8, fourth, _call(axes, 7.8, 7.8 - 2.75, "replicas_in_sync:\nall-reduce params", "#d9d9d9", width=2.2), RED, 2
    )
    axes.text(
        10.3,
        6.05,
        "paired by order, not meaning:\nfloat32 gradients against float64\nparameters, sizes differ: gloo aborts",
        fontsize=8.5,
        color=RED,
        va="center",
    )
    # with Join: rank 1 waits in Join's exit and answers rank 0's fourth all-reduce with zeros
    pair(3.75, fourth, _call(axes, 1.2 + 3 * 2.2, 3.75 - 2.75, "Join: answers\nwith zeros", "#fff3c4"))
    pair(
        3.75,
        _call(axes, 10.1, 3.75 - 1.15, "last to finish:\nbroadcast params", "#c7e9c0"),
        _call(axes, 10.1, 3.75 - 2.75, "receive\nparams", "#c7e9c0"),
    )
    pair(
        3.75,
        _call(axes, 12.4, 3.75 - 1.15, "replicas_in_sync", "#d9d9d9", width=2.2),
        _call(axes, 12.4, 3.75 - 2.75, "replicas_in_sync", "#d9d9d9", width=2.2),
    )
    axes.text(
        0.1,
        0.05,
        "A line joins two calls that gloo pairs: the k-th collective of rank 0 with the k-th of rank 1.\n"
        "Illustrative, after the notebook's demo; Join's own small all-reduces are left out.",
        fontsize=8.5,
        style="italic",
    )
    save(fig, path)


FIGURES = {
    "03_ranks_on_two_nodes": (ranks_on_two_nodes, None),
    "03_backward_timeline": (backward_timeline, None),
    "03_bucket_grid": (bucket_grid, NOTEBOOK),
    "03_sampler_shards": (sampler_shards, None),
    "03_batchnorm_buffers": (batchnorm_buffers, None),
    "03_collectives_pair_by_order": (collectives_pair_by_order, None),
}
