"""Lesson 12's pictures: the MLP cut by columns then rows, attention cut by heads, one layer's step with its four
all-reduces, the 2-D (dp, tp) mesh; and three measured plots (bytes against tokens, the time inside all-reduces
beside DDP's buckets, three layouts over the emulated 1 Gbit/s link)."""

import json
import re
from pathlib import Path

from . import draw
from .draw import COMMUNICATE, COMPUTE, IDLE, RANK_COLOURS, REPO, RESULTS, arrow, box, canvas, plt, save, tint

NOTEBOOK = REPO / "notebooks" / "12_tensor_parallelism.ipynb"
CLUSTER_RESULTS = RESULTS / "cluster_network.json"


def printed_by_cell(cell_id: str) -> str:
    return draw.printed_by_cell(NOTEBOOK, cell_id)


def mlp_columns_then_rows(path: Path) -> None:
    """Megatron's MLP on 2 ranks: A cut by columns, B by rows; f before, g after; the shapes each rank holds."""
    fig, axes = canvas(10, 5.6, xlim=20, ylim=11)
    axes.text(10, 10.6, "The MLP  Z = GELU(X A) B  on 2 ranks", ha="center", fontsize=12, weight="bold")
    # The two weights, each cut in two: A by columns (side by side), B by rows (one above the other).
    axes.text(3.5, 9.6, "A (d x 4d): cut by columns", ha="center", fontsize=9)
    for rank in range(2):
        axes.add_patch(plt.Rectangle((1.0 + 2.5 * rank, 7.9), 2.5, 1.3, fc=tint(RANK_COLOURS[rank]), ec="black"))
        axes.text(2.25 + 2.5 * rank, 8.55, f"A_{rank}", ha="center", va="center", fontsize=10)
    axes.text(10.0, 9.6, "B (4d x d): cut by rows", ha="center", fontsize=9)
    for rank in range(2):
        axes.add_patch(plt.Rectangle((9.4, 8.55 - 0.85 * rank), 1.2, 0.85, fc=tint(RANK_COLOURS[rank]), ec="black"))
        axes.text(10.0, 8.97 - 0.85 * rank, f"B_{rank}", ha="center", va="center", fontsize=10)
    axes.text(
        15.8,
        8.5,
        "f: forward passes X on,\n    backward sums X's gradient\ng: forward sums the partials,\n"
        "    backward passes Z's gradient on",
        fontsize=9,
        va="center",
    )
    for rank, y in enumerate((5.0, 1.8)):
        colour = tint(RANK_COLOURS[rank])
        axes.text(0.1, y + 0.6, f"rank {rank}", fontsize=10, weight="bold", va="center")
        box(axes, 1.6, y, 1.6, 1.2, "X, whole\n(tokens, d)", "#ffffff", 8)
        arrow(axes, (3.2, y + 0.6), (3.6, y + 0.6))
        box(axes, 3.6, y + 0.15, 0.9, 0.9, "f", COMMUNICATE, 10)
        arrow(axes, (4.5, y + 0.6), (4.9, y + 0.6))
        box(axes, 4.9, y, 3.3, 1.2, f"Y_{rank} = GELU(X A_{rank})\n(tokens, 4d/2)", colour, 8)
        arrow(axes, (8.2, y + 0.6), (8.6, y + 0.6))
        box(axes, 8.6, y, 3.1, 1.2, f"Y_{rank} B_{rank}:\na partial sum\n(tokens, d)", colour, 8)
        arrow(axes, (11.7, y + 0.6), (12.2, y + 0.6))
        arrow(axes, (14.6, y + 0.6), (15.1, y + 0.6))
        box(axes, 15.1, y, 3.4, 1.2, "Z + bias, (tokens, d):\nwhole, the same\non both ranks", "#ffffff", 8)
    box(axes, 12.2, 1.6, 2.4, 4.8, "g\n\nall-reduce:\nsum the\npartials", COMMUNICATE, 9)
    axes.text(
        10,
        0.7,
        "No communication until g: each rank's GELU runs on its own slice of the hidden features.",
        ha="center",
        fontsize=9,
    )
    save(fig, path)


def attention_by_heads(path: Path) -> None:
    """Attention on 2 ranks with 4 heads (solution 13's layer): each rank projects and attends over its 2 heads."""
    fig, axes = canvas(10, 5.4, xlim=20, ylim=11)
    axes.text(
        10,
        10.6,
        "Attention cut by heads: 4 heads on 2 ranks, as in solution 13",
        ha="center",
        fontsize=12,
        weight="bold",
    )
    for rank, y in enumerate((6.2, 2.0)):
        colour = tint(RANK_COLOURS[rank])
        heads = (2 * rank, 2 * rank + 1)
        axes.text(0.1, y + 1.2, f"rank {rank}", fontsize=10, weight="bold", va="center")
        box(axes, 1.6, y + 0.6, 1.6, 1.2, "X, whole\n(tokens, d)", "#ffffff", 8)
        arrow(axes, (3.2, y + 1.2), (3.6, y + 1.2))
        box(axes, 3.6, y + 0.75, 0.9, 0.9, "f", COMMUNICATE, 10)
        arrow(axes, (4.5, y + 1.2), (4.9, y + 1.2))
        box(
            axes,
            4.9,
            y + 0.3,
            3.2,
            1.8,
            f"q, k, v of heads\n{heads[0]} and {heads[1]}: rows of\nPyTorch's W_q,\nW_k, W_v",
            colour,
            8,
        )
        for index, head in enumerate(heads):
            hy = y + 1.3 - 1.3 * index
            arrow(axes, (8.1, y + 1.2), (8.7, hy + 0.5))
            box(axes, 8.7, hy, 3.0, 1.0, f"head {head}:\nsoftmax(q k^T) v", colour, 8)
            arrow(axes, (11.7, hy + 0.5), (12.2, y + 1.2))
        box(axes, 12.2, y + 0.6, 2.7, 1.2, f"out_{rank}: its\ncolumns of\nPyTorch's W_out", colour, 8)
        arrow(axes, (14.9, y + 1.2), (15.3, y + 1.2))
        arrow(axes, (16.8, y + 1.2), (17.3, y + 1.2))
        box(axes, 17.3, y + 0.6, 2.6, 1.2, "sum + b_out,\nwhole on both", "#ffffff", 8)
    box(axes, 15.3, 2.4, 1.5, 5.8, "g\n\nall-\nreduce", COMMUNICATE, 9)
    axes.text(
        10,
        0.9,
        "Heads never mix: a rank's scores, softmax and weighted sum need only its own heads' q, k and v.\n"
        "Rows and columns named as PyTorch stores a weight, (out, in): its rows are the math's columns (section 2).",
        ha="center",
        fontsize=9,
    )
    save(fig, path)


def layer_step_timeline(path: Path) -> None:
    """One training step of one layer on 2 ranks, schematic: the four all-reduces, each between two computations
    that need it; the rank that arrives first waits inside the all-reduce for the other."""
    # (label, rank 0's time, rank 1's time) for a computation; ("g"/"f", transfer time) for an all-reduce.
    # Made-up durations, for the order of events only: rank 1 is a little slower in some computations.
    steps = [
        ("norm", 1.0, 1.0),
        ("attention,\nmy heads", 4.0, 4.8),
        ("g", 1.6),
        ("norm", 1.0, 1.0),
        ("MLP, my\nslice", 5.0, 5.0),
        ("g", 1.6),
        ("MLP\nbackward", 9.0, 8.2),
        ("f", 1.6),
        ("norm", 1.0, 1.0),
        ("attention\nbackward", 7.0, 7.9),
        ("f", 1.6),
        ("norm", 1.0, 1.0),
        ("SGD", 1.5, 1.5),
    ]
    fig, axes = plt.subplots(figsize=(10, 3.4))
    now = [0.0, 0.0]
    forward_end = None
    for index, step in enumerate(steps):
        if len(step) == 3:
            label, *times = step
            for rank in range(2):
                axes.broken_barh([(now[rank], times[rank])], (rank - 0.35, 0.7), facecolors=COMPUTE, edgecolor="grey")
                middle = now[rank] + times[rank] / 2
                if times[rank] >= 2.5:
                    axes.text(middle, rank, label, ha="center", va="center", fontsize=8)
                else:  # a short bar (a norm, SGD): its label turned on its side, to fit
                    axes.text(middle, rank, label, ha="center", va="center", fontsize=8, rotation=90)
                now[rank] += times[rank]
        else:
            name, transfer = step
            start = max(now)
            for rank in range(2):
                if now[rank] < start:
                    axes.broken_barh(
                        [(now[rank], start - now[rank])],
                        (rank - 0.35, 0.7),
                        facecolors=IDLE,
                        hatch="///",
                        edgecolor="grey",
                    )
                axes.broken_barh([(start, transfer)], (rank - 0.35, 0.7), facecolors=COMMUNICATE, edgecolor="black")
            axes.text(start + transfer / 2, -0.55, name, ha="center", va="bottom", fontsize=10, weight="bold")
            now = [start + transfer] * 2
            if index == 5:
                forward_end = now[0]
    axes.axvline(forward_end, color="black", linestyle=":", lw=1)
    axes.text(forward_end - 0.3, 1.75, "forward | backward", ha="center", fontsize=9)
    axes.set_yticks([0, 1], ["rank 0", "rank 1"])
    axes.set_ylim(1.95, -1.0)
    axes.set_xlim(0, max(now) + 0.5)
    axes.set_xticks([])
    axes.set_xlabel("time (schematic: made-up durations, in the layer's order)")
    handles = [
        plt.Rectangle((0, 0), 1, 1, fc=COMPUTE, ec="grey", label="computation"),
        plt.Rectangle((0, 0), 1, 1, fc=IDLE, ec="grey", hatch="///", label="inside the all-reduce, waiting"),
        plt.Rectangle((0, 0), 1, 1, fc=COMMUNICATE, ec="black", label="all-reduce, both ranks there"),
    ]
    axes.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, fontsize=8, frameon=False)
    axes.set_title("One layer's training step on 2 ranks: g twice in forward, f twice in backward", fontsize=11)
    for side in ("top", "right"):
        axes.spines[side].set_visible(False)
    save(fig, path)


def mesh_2d(path: Path) -> None:
    """The 2 x 2 (dp, tp) mesh: a replica per node, the tp groups inside a node, the dp groups across nodes."""
    fig, axes = canvas(10, 5.8, xlim=20, ylim=12)
    axes.text(
        10,
        11.5,
        'A 2 x 2 mesh, mesh_dim_names=("dp", "tp"): rank r is shard r % 2 of replica r // 2',
        ha="center",
        fontsize=11,
        weight="bold",
    )
    for replica, y in enumerate((7.4, 1.4)):
        box(axes, 0.6, y - 0.5, 11.0, 3.4, "", "#f4f4f4")
        axes.text(3.0, y + 2.5, f"node {replica}: replica {replica}, its own batches", fontsize=9, weight="bold")
        for shard in range(2):
            rank = 2 * replica + shard
            box(axes, 1.2 + 7.2 * shard, y, 2.6, 1.7, f"rank {rank}\nshard {shard}", tint(RANK_COLOURS[shard]), 10)
        arrow(axes, (3.8, y + 0.85), (8.4, y + 0.85), style="<->")
        axes.text(6.1, y + 1.25, f"tp group {{{2 * replica}, {2 * replica + 1}}}", ha="center", fontsize=8)
        axes.text(6.1, y + 0.6, "f and g: 4 all-reduces\nper layer", ha="center", fontsize=8, va="top")
    axes.plot([0.3, 12.0], [5.6, 5.6], color="#c05000", lw=2, linestyle="--")
    axes.text(12.2, 5.6, "the slower link\nbetween nodes", fontsize=8, color="#c05000", va="center")
    for shard in range(2):
        x = 2.5 + 7.2 * shard
        arrow(axes, (x, 7.4), (x, 3.1), colour="#c05000", style="<->")
        axes.text(x + 0.25, 6.25, f"dp group {{{shard}, {shard + 2}}}", fontsize=8, color="#c05000", va="center")
    axes.text(
        14.3,
        8.3,
        "Inside a node, over fast links:\n the tp all-reduces, in the middle\n of every layer.",
        fontsize=9,
        va="center",
    )
    axes.text(
        14.3,
        2.9,
        "Across nodes, over dp:\n DDP: the gradients once per step,\n one all-reduce per bucket.\n"
        " FSDP2: each unit's all-gathers\n and its reduce-scatter.",
        fontsize=9,
        va="center",
    )
    save(fig, path)


def bytes_against_tokens(path: Path) -> None:
    """Notebook 12's table: bytes all-reduced per layer and step by tensor parallelism and by DDP, against tokens."""
    printed = printed_by_cell("5b9865ab")
    rows = re.findall(r"^\s*(\d+)\s+(\d+)\s+(\d+) \|.*\|\s*([\d,]+)\s+([\d,]+)\s*$", printed, re.MULTILINE)
    tokens = [int(row[2]) for row in rows]
    tp = [int(row[3].replace(",", "")) / 2**20 for row in rows]
    ddp = [int(row[4].replace(",", "")) / 2**20 for row in rows]
    crossover = int(re.search(r"the two meet at ([\d,]+) tokens", printed).group(1).replace(",", ""))
    fig, axes = plt.subplots(figsize=(7.5, 4.2))
    axes.plot(tokens, tp, "o-", color=RANK_COLOURS[0], label="tensor parallel: 4 all-reduces of the activations")
    axes.plot(tokens, ddp, "s-", color=RANK_COLOURS[1], label="data parallel (DDP): the gradients, whatever the batch")
    axes.axvline(crossover, color="grey", linestyle=":", lw=1)
    axes.text(crossover * 1.1, min(tp), f"they meet at {crossover} tokens", fontsize=9, color="dimgrey")
    axes.set(xscale="log", yscale="log", xlabel="tokens per step (batch x sequence)", ylabel="MiB all-reduced")
    axes.set_title("One layer of d = 256, per step: counted by notebook 12", fontsize=11)
    axes.legend(fontsize=8, loc="upper left")
    save(fig, path)


def time_in_all_reduces(path: Path) -> None:
    """Notebook 12's timed run: each rank's tensor-parallel step with the time inside its all-reduces, and DDP's
    backward with the moments its two buckets started."""
    steps = re.findall(r"rank (\d+): (\d+) all-reduces, ([\d.]+) ms of a ([\d.]+) ms step", printed_by_cell("7ccf25ac"))
    ddp = printed_by_cell("2856481f")
    buckets = re.findall(r"([\d.]+) MiB, all-reduce started\s+([\d.]+) ms", ddp)  # as printed, 2 decimals kept
    backward = float(re.search(r"backward returned after ([\d.]+) ms", ddp).group(1))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.3), gridspec_kw={"width_ratios": [1.1, 1]})
    for row, (rank, count, inside, step) in enumerate(steps):
        inside, step = float(inside), float(step)
        left.barh(row, step - inside, color=COMPUTE, edgecolor="grey")
        left.barh(row, inside, left=step - inside, color=COMMUNICATE, edgecolor="black")
        left.text(step - inside / 2, row, f"{inside} ms", ha="center", va="center", fontsize=8)
        left.text(step + 8, row, f"{step} ms", va="center", fontsize=8)
    left.set_yticks(range(len(steps)), [f"rank {rank}" for rank, *_ in steps])
    left.set_ylim(len(steps) - 0.4, -0.6)
    left.set_xlim(0, 520)
    left.set_xlabel(
        "ms in one step: the time inside the all-reduces is summed\n"
        "and drawn last; in time they are spread over the step"
    )
    left.set_title("tensor parallel: 16 all-reduces per step\n(orange: inside them, waiting included)", fontsize=9)
    right.barh(0, backward, color=COMPUTE, edgecolor="grey")
    for number, (mib, start) in enumerate(buckets):
        x = float(start)
        right.plot([x, x], [-0.45, 0.45], color="black", lw=2)
        above = number == 0  # the first label above the bar, the second below it: they never overlap
        right.annotate(
            f"bucket {number}: {mib} MiB\nstarts at {start} ms",
            xy=(x, -0.45 if above else 0.45),
            xytext=(x + 15, -1.0) if above else (x - 125, 1.25),
            fontsize=8,
            va="center",
            arrowprops={"arrowstyle": "->"},
        )
    right.text(backward + 4, 0, f"{backward} ms", va="center", fontsize=8)
    right.set_yticks([0], ["rank 0"])
    right.set_ylim(1.7, -1.4)
    right.set_xlim(0, 270)
    right.set_xlabel("ms into backward")
    right.set_title("DDP, half the batch per rank: one backward\nand when each bucket's all-reduce starts", fontsize=9)
    fig.suptitle("Measured in notebook 12: 4 layers of d = 256, 16 x 128 tokens, 2 processes", fontsize=11)
    fig.tight_layout()
    save(fig, path)


def cluster_layouts(path: Path) -> None:
    """Solution 13 on the emulated cluster: samples/s of three layouts, loopback against the 1 Gbit/s link."""
    rows = json.loads(CLUSTER_RESULTS.read_text())["tp"]
    layouts = list(dict.fromkeys(row["layout"] for row in rows))
    fig, axes = plt.subplots(figsize=(8, 4.2))
    for offset, (where, label, colour) in enumerate(
        (("loopback", "4 processes on loopback", RANK_COLOURS[0]), ("1gbit", "2 nodes x 2, 1 Gbit/s link", "#c05000"))
    ):
        for index, layout in enumerate(layouts):
            (runs,) = [row["samples_per_second"] for row in rows if (row["where"], row["layout"]) == (where, layout)]
            middle = sorted(runs)[len(runs) // 2]
            x = index + (offset - 0.5) * 0.36
            axes.bar(x, middle, width=0.34, color=colour, label=label if index == 0 else None)
            axes.errorbar(x, middle, yerr=[[middle - min(runs)], [max(runs) - middle]], color="black", capsize=3)
            axes.text(x, max(runs) + 60, f"{middle:,.0f}", ha="center", fontsize=8)
    axes.set_xticks(range(len(layouts)), [layout.replace(" x ", "\nx ") for layout in layouts])
    axes.set_ylabel("samples/s, median of 3 runs (whiskers: min-max)")
    axes.set_ylim(0, 4000)
    axes.set_title("Solution 13, a global batch of 64: where the tensor-parallel group sits", fontsize=11)
    axes.legend(fontsize=8, loc="upper left")
    save(fig, path)


FIGURES = {
    "12_mlp_columns_then_rows": (mlp_columns_then_rows, None),
    "12_attention_by_heads": (attention_by_heads, None),
    "12_layer_step_timeline": (layer_step_timeline, None),
    "12_mesh_2d": (mesh_2d, None),
    "12_bytes_against_tokens": (bytes_against_tokens, NOTEBOOK),
    "12_time_in_all_reduces": (time_in_all_reduces, NOTEBOOK),
    "12_cluster_layouts": (cluster_layouts, CLUSTER_RESULTS),
}
