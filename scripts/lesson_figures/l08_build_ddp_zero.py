"""Lesson 08's pictures: the three DDP builds on a timeline, gradients packed into flat buckets, the measured bucket
timeline, the build benchmark on loopback and over slow links, who holds what under ZeRO, reduce-scatter with
all-gather, and ZeRO-3's prefetch on a timeline."""

import json
import re
from pathlib import Path

from . import draw
from .draw import COMMUNICATE, COMPUTE, IDLE, RANK_COLOURS, REPO, RESULTS, box, canvas, plt, save

NOTEBOOK = REPO / "notebooks" / "08_build_ddp_and_zero.ipynb"
CLUSTER_RESULTS = RESULTS / "cluster_network.json"
STEP = "#c7e9c0"  # the optimizer step
PARAMETERS, GRADIENTS, OPTIMIZER = "#9ecae1", "#fdae6b", "#a1d99b"


def printed_by_cell(cell_id: str) -> str:
    return draw.printed_by_cell(NOTEBOOK, cell_id)


def three_builds_timeline(path: Path) -> None:
    """One backward pass of five layers under each build: when the gradients are ready, when the all-reduces run,
    and when the optimizer step can start. Widths are illustrative, not measured."""
    fig, axes = canvas(10, 6.4, xlim=11.2, ylim=8.4)
    layer_width, start = 1.1, 1.7
    ready = [start + layer_width * (k + 1) for k in range(5)]  # L4's gradient first, L0's last
    backward_end = ready[-1]
    rows = {
        "naive": "all-reduces one gradient after another, after backward",
        "overlapped": "starts each gradient's all-reduce as soon as it is ready",
        "bucketed": "starts one all-reduce per bucket, when the bucket is full",
    }
    for row, (name, note) in enumerate(rows.items()):
        top = 7.8 - row * 2.7
        axes.text(0.0, top, f"{name}: {note}", fontsize=10, weight="bold", va="center")
        compute_y, network_y = top - 0.85, top - 1.55
        axes.text(0.0, compute_y + 0.22, "autograd", fontsize=9, va="center")
        axes.text(0.0, network_y + 0.22, "network", fontsize=9, va="center")
        for k in range(5):
            box(axes, start + layer_width * k, compute_y, layer_width, 0.45, f"grad L{4 - k}", COMPUTE, 8)
        if name == "naive":  # after backward, in parameters() order: L0 first (NaiveDDP loops self.trainable)
            messages = [(backward_end + 0.55 * k, 0.5, f"L{k}") for k in range(5)]
        elif name == "overlapped":
            messages, free = [], 0.0
            for k, t in enumerate(ready):
                begin = max(t, free)
                messages.append((begin, 0.5, f"L{4 - k}"))
                free = begin + 0.5
        else:
            messages = [(ready[1], 0.8, "L4, L3"), (ready[3], 0.8, "L2, L1"), (ready[4] + 0.05, 0.5, "L0")]
        for begin, width, label in messages:
            box(axes, begin, network_y, width - 0.05, 0.45, label, COMMUNICATE, 7)
        step_at = max(begin + width for begin, width, _ in messages)
        box(axes, step_at + 0.1, compute_y, 0.8, 0.45, "step", STEP, 8)
        axes.plot([backward_end, backward_end], [network_y - 0.1, compute_y + 0.55], color="black", lw=1, ls=":")
    axes.text(
        0.0,
        -0.25,
        "Dotted line: backward() returns. Widths are illustrative: five layers, gradients ready from the last layer\n"
        "(L4) to the first (L0). Naive sends in parameters() order, L0 first. Every all-reduce pays a fixed cost, so\n"
        "a bucket of two gradients takes less than two small ones.",
        fontsize=8,
        color="#333333",
    )
    save(fig, path)


def flat_bucket(path: Path) -> None:
    """The tests' example of assign_buckets: tensors of 400, 300, 300 and 200 bytes, a cap of 500 bytes, taken in
    reverse order; each gradient a view of its slice of a flat bucket."""
    fig, axes = canvas(9.5, 4.8, xlim=10, ylim=5.6)
    scale = 0.0085  # data units per byte
    sizes = {0: 400, 1: 300, 2: 300, 3: 200}
    axes.text(0.0, 5.2, "parameters() in order, with their gradients' bytes", fontsize=10, weight="bold")
    x, top_scale = 0.2, 0.0075  # the top row a little narrower, to fit the canvas
    for index, size in sizes.items():
        box(axes, x, 4.2, size * top_scale - 0.08, 0.6, f"p{index}.grad\n{size} bytes", GRADIENTS, 8)
        x += size * top_scale
    axes.annotate("", xy=(0.3, 3.75), xytext=(x - 0.1, 3.75), arrowprops={"arrowstyle": "->", "lw": 1.2})
    axes.text(x / 2, 3.45, "taken in reverse order, the order in which backward produces them", ha="center", fontsize=9)
    axes.text(
        0.0,
        2.85,
        "each bucket is one flat tensor, closed once it reaches the cap of 500 bytes",
        fontsize=10,
        weight="bold",
    )
    buckets = [(0, [3, 2]), (1, [1, 0])]
    y_of = {0: 1.75, 1: 0.55}
    for number, members in buckets:
        y, x = y_of[number], 1.6
        axes.text(0.0, y + 0.3, f"bucket {number}", fontsize=9, va="center")
        for index in members:
            width = sizes[index] * scale
            axes.add_patch(plt.Rectangle((x, y), width, 0.6, fc=GRADIENTS, ec="black", lw=1))
            axes.text(
                x + width / 2,
                y + 0.3,
                f"p{index}.grad is a view\nof bytes {x_bytes(x)}-{x_bytes(x + width)}",
                ha="center",
                va="center",
                fontsize=7,
                bbox={"fc": GRADIENTS, "ec": "none", "pad": 1},  # readable where the cap's line crosses it
                zorder=3,
            )
            x += width
        total = sum(sizes[index] for index in members)
        axes.text(x + 0.15, y + 0.3, f"{total} bytes: one all-reduce", fontsize=9, va="center")
    cap_x = 1.6 + 500 * scale
    axes.plot([cap_x, cap_x], [0.35, 2.55], color="#c05000", lw=1.5, ls="--")
    axes.text(
        cap_x,
        0.15,
        "cap: 500 bytes. Bucket 1 passes it by less than one tensor",
        ha="center",
        fontsize=8,
        color="#c05000",
    )
    save(fig, path)


def x_bytes(x: float) -> int:
    """The byte offset within a bucket drawn from data x = 1.6 at 0.0085 units per byte (flat_bucket's layout)."""
    return round((x - 1.6) / 0.0085)


def bucket_timeline_measured(path: Path) -> None:
    """The notebook's timeline of one BucketedDDP step, rank 0: each bucket's all-reduce from start to end, when
    backward() returned and when all gradients were averaged."""
    text = printed_by_cell("f74f578c")
    backward_ms, finish_ms = map(
        float, re.search(r"returned at ([\d.]+) ms, all gradients averaged at ([\d.]+)", text).groups()
    )
    buckets = [
        (int(index), float(mib), int(tensors), float(begin), float(end))
        for index, mib, tensors, begin, end in re.findall(
            r"bucket (\d+): ([\d.]+) MiB, (\d+) tensors, all-reduce ([\d.]+) -> ([\d.]+) ms", text
        )
    ]
    fig, axes = plt.subplots(figsize=(9, 3.6))
    axes.axvspan(0, backward_ms, color=COMPUTE, alpha=0.5, label="backward() running")
    for index, mib, tensors, begin, end in buckets:
        axes.barh(
            index,
            end - begin,
            left=begin,
            color=COMMUNICATE,
            ec="black",
            height=0.6,
            label="all-reduce of the bucket" if index == 0 else None,
        )
        axes.text(finish_ms + 0.3, index, f"{mib:.2f} MiB, {tensors} tensors", va="center", fontsize=8)
    axes.axvline(backward_ms, color="black", lw=1, ls=":", label=f"backward() returns: {backward_ms} ms")
    axes.axvline(finish_ms, color="black", lw=1.2, ls="--", label=f"all gradients averaged: {finish_ms} ms")
    axes.set_yticks([index for index, *_ in buckets], [f"bucket {index}" for index, *_ in buckets])
    axes.invert_yaxis()
    axes.set_xlim(0, finish_ms + 3.8)  # room for the labels, right of the last line
    axes.set_xlabel("ms from the start of backward()")
    axes.set_title("One step of BucketedDDP, rank 0: DeepMLP(512, 4), 0.5 MiB cap, 2 processes of gloo", fontsize=10)
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    save(fig, path)


def build_step_times(path: Path) -> None:
    """The build benchmark's median step time per build on loopback, over 1 Gbit/s and over 200 Mbit/s
    (benchmarks/cluster_network.py --parts ddp)."""
    runs = json.loads(CLUSTER_RESULTS.read_text())["ddp"]
    titles = {"loopback": "loopback (one machine)", "1gbit": "two nodes, 1 Gbit/s", "200mbit": "two nodes, 200 Mbit/s"}
    after_backward = {"naive", "bucketed 25"}  # the builds whose all-reduces all start after backward ends
    fig, panels = plt.subplots(1, 3, figsize=(10, 3.8), sharey=True)
    for axes, (where, title) in zip(panels, titles.items()):
        rows = runs[where]["rows"]
        names = [
            row["build"].replace("bucketed ", "bucketed, ") + (" MiB" if "bucketed" in row["build"] else "")
            for row in rows
        ]
        values = [row["ms_per_step"] for row in rows]
        colours = [IDLE if row["build"] in after_backward else COMMUNICATE for row in rows]
        axes.barh(range(len(rows)), values, color=colours, ec="black")
        for y, value in enumerate(values):
            axes.text(value, y, f" {value:.1f}", va="center", fontsize=8)
        axes.set_yticks(range(len(rows)), names)
        axes.set_xlim(0, max(values) * 1.3)
        axes.set_title(title, fontsize=10)
        axes.set_xlabel("ms per step (median)")
    panels[0].invert_yaxis()
    handles = [plt.Rectangle((0, 0), 1, 1, fc=colour, ec="black") for colour in (COMMUNICATE, IDLE)]
    fig.legend(
        handles,
        ["starts all-reduces during backward", "starts them only after backward"],
        loc="lower center",
        ncol=2,
        fontsize=8,
        bbox_to_anchor=(0.5, -0.08),
        frameon=False,
    )
    fig.suptitle(
        "DeepMLP(1024, 4), 2 processes of gloo, batch 64 each: the median step time of each build", fontsize=10
    )
    fig.tight_layout()
    save(fig, path)


def zero_who_holds_what(path: Path) -> None:
    """4 ranks under DDP, ZeRO-1, ZeRO-2 and ZeRO-3, Adam in fp32: parameters (Ψ), gradients (Ψ) and Adam's state
    (2Ψ), held whole or a quarter each. An illustrative layout of lesson 06's arithmetic."""
    fig, axes = canvas(10, 5.0, xlim=10.4, ylim=6.2)
    unit = 0.5  # data units per Ψ
    parts = [("parameters", PARAMETERS, 1), ("gradients", GRADIENTS, 1), ("Adam state", OPTIMIZER, 2)]
    designs = {
        "DDP": (False, False, False, "Ψ + Ψ + 2Ψ = 4Ψ"),
        "ZeRO-1": (False, False, True, "Ψ + Ψ + 2Ψ/4"),
        "ZeRO-2": (False, True, True, "Ψ + Ψ/4 + 2Ψ/4"),
        "ZeRO-3": (True, True, True, "(Ψ + Ψ + 2Ψ)/4 = Ψ"),
    }
    for column, (name, (*sharded, total)) in enumerate(designs.items()):
        x0 = 0.75 + column * 2.45
        axes.text(x0 + 1.0, 5.75, name, ha="center", fontsize=11, weight="bold")
        for rank in range(4):
            y = 4.75 - rank * 1.05
            if column == 0:
                axes.text(0.0, y + 0.22, f"rank {rank}", fontsize=9, va="center")
            x = x0
            for (part, colour, size), is_sharded in zip(parts, sharded):
                width = size * unit
                axes.add_patch(plt.Rectangle((x, y), width, 0.45, fc="white", ec="#999999", lw=0.8, ls="--"))
                if is_sharded:
                    quarter = width / 4
                    axes.add_patch(plt.Rectangle((x + rank * quarter, y), quarter, 0.45, fc=colour, ec="black", lw=1))
                else:
                    axes.add_patch(plt.Rectangle((x, y), width, 0.45, fc=colour, ec="black", lw=1))
                x += width
        axes.text(x0 + 1.0, 0.35, f"per rank:\n{total}", ha="center", fontsize=8)
    handles = [plt.Rectangle((0, 0), 1, 1, fc=colour, ec="black") for _, colour, _ in parts]
    handles.append(plt.Rectangle((0, 0), 1, 1, fc="white", ec="#999999", ls="--"))
    labels = ["parameters (Ψ)", "gradients (Ψ)", "Adam's two moments (2Ψ)", "held by another rank"]
    axes.legend(handles, labels, loc="upper center", ncol=4, fontsize=8, bbox_to_anchor=(0.5, 0.02), frameon=False)
    axes.text(
        0.0,
        -0.45,
        "Illustrative: 4 ranks, Adam in fp32, Ψ = the parameters' bytes. A sharded part: each rank "
        "keeps its own quarter.",
        fontsize=8,
        color="#333333",
    )
    save(fig, path)


def reduce_scatter_all_gather(path: Path) -> None:
    """4 ranks, 4 chunks: reduce-scatter leaves rank r the sum of chunk r; rank r updates its chunk; all-gather
    gives every rank every updated chunk. Together the two collectives send what an all-reduce sends."""
    fig, axes = canvas(10, 3.9, xlim=10.6, ylim=4.6)
    cell, gap = 0.42, 0.05
    stages = [
        ("each rank's gradients", "all"),
        ("after reduce-scatter", "sum"),
        ("after the step", "step"),
        ("after all-gather", "params"),
    ]
    for stage, (title, kind) in enumerate(stages):
        x0 = 0.9 + stage * 2.55
        axes.text(x0 + 2 * cell, 4.25, title, ha="center", fontsize=9, weight="bold")
        for rank in range(4):
            y = 3.35 - rank * (cell + 0.3)
            if stage == 0:
                axes.text(0.0, y + cell / 2, f"rank {rank}", fontsize=9, va="center")
            for chunk in range(4):
                x = x0 + chunk * (cell + gap)
                if kind == "all":
                    colour, label = RANK_COLOURS[rank], f"g{rank}"
                elif kind in ("sum", "step") and chunk != rank:
                    colour, label = "white", ""
                elif kind == "sum":
                    colour, label = GRADIENTS, "Σg"
                else:
                    colour, label = PARAMETERS, f"p'{chunk}"
                alpha = 0.45 if kind == "all" else 1.0
                axes.add_patch(plt.Rectangle((x, y), cell, cell, fc=colour, ec="black", lw=0.8, alpha=alpha))
                axes.text(x + cell / 2, y + cell / 2, label, ha="center", va="center", fontsize=7)
        if stage < 3:
            label = ("reduce-scatter", "step my chunk", "all-gather")[stage]
            axes.annotate(
                "",
                xy=(x0 + 2.5, 2.3),
                xytext=(x0 + 4 * (cell + gap) + 0.05, 2.3),
                arrowprops={"arrowstyle": "->", "lw": 1.4},
            )
            axes.text(x0 + 2.25, 2.55, label, ha="center", fontsize=8, rotation=90, va="bottom")
    axes.text(
        0.0,
        0.05,
        "Columns are the 4 chunks of one tensor, and gr is rank r's gradient. Σg, the sum over the ranks of chunk r,\n"
        "lands on rank r, which updates that chunk only (p'r). A reduce-scatter and an all-gather send what one "
        "all-reduce sends.",
        fontsize=8,
        color="#333333",
    )
    save(fig, path)


def zero3_prefetch_timeline(path: Path) -> None:
    """ZeRO-3's forward over four units, with and without prefetch: the next unit's all-gather overlaps the current
    unit's compute. Widths are illustrative, not measured."""
    fig, axes = canvas(10, 4.6, xlim=11.0, ylim=5.6)
    gather, compute = 0.9, 1.2
    for row, (title, prefetch) in enumerate((("without prefetch", False), ("with prefetch", True))):
        top = 5.1 - row * 2.45
        axes.text(0.0, top, title, fontsize=10, weight="bold", va="center")
        network_y, compute_y = top - 0.8, top - 1.5
        axes.text(0.0, network_y + 0.22, "all-gather", fontsize=9, va="center")
        axes.text(0.0, compute_y + 0.22, "compute", fontsize=9, va="center")
        compute_begin = compute_end = gather_free = 1.4
        for unit in range(1, 5):
            # with prefetch, unit k+1's gather starts as unit k starts computing; without, once unit k is done
            begin = max(gather_free, compute_begin) if prefetch else compute_end
            gather_end = begin + gather
            gather_free = gather_end
            box(axes, begin, network_y, gather - 0.05, 0.45, f"unit {unit}", COMMUNICATE, 8)
            compute_begin = max(gather_end, compute_end)
            compute_end = compute_begin + compute
            box(axes, compute_begin, compute_y, compute - 0.05, 0.45, f"unit {unit}", COMPUTE, 8)
        axes.plot([compute_end, compute_end], [compute_y - 0.1, network_y + 0.55], color="black", lw=1, ls=":")
        axes.text(compute_end + 0.1, compute_y + 0.22, "forward\nends", fontsize=8, va="center")
    axes.text(
        0.0,
        0.05,
        "With prefetch, unit k+1's all-gather starts as unit k starts computing: two units' whole parameters exist "
        "at once.\nWidths are illustrative. Backward works the same way, from the last unit to the first.",
        fontsize=8,
        color="#333333",
    )
    save(fig, path)


FIGURES = {
    "08_three_builds_timeline": (three_builds_timeline, None),
    "08_flat_bucket": (flat_bucket, None),
    "08_bucket_timeline_measured": (bucket_timeline_measured, NOTEBOOK),
    "08_build_step_times": (build_step_times, CLUSTER_RESULTS),
    "08_zero_who_holds_what": (zero_who_holds_what, None),
    "08_reduce_scatter_all_gather": (reduce_scatter_all_gather, None),
    "08_zero3_prefetch_timeline": (zero3_prefetch_timeline, None),
}
