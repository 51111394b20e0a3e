"""Lesson 04's pictures: the effective batch, the loss division, no_sync on a timeline, which micro-steps step,
and two measured plots (the learning-rate runs, the rounding drift)."""

import re
from pathlib import Path

from . import draw
from .draw import COMMUNICATE, COMPUTE, RANK_COLOURS, REPO, RESULTS, box, canvas, plt, save

NOTEBOOK = REPO / "notebooks" / "04_gradient_accumulation.ipynb"
ROUNDING = RESULTS / "04_accumulation_rounding.txt"
ROUNDING_2_THREADS = RESULTS / "04_accumulation_rounding_2_threads.txt"
STEP = "#c7e9c0"  # clip, optimizer step, zero_grad


def printed_by_cell(cell_id: str) -> str:
    return draw.printed_by_cell(NOTEBOOK, cell_id)


def effective_batch(path: Path) -> None:
    """2 ranks x 4 micro-steps x 16 samples: the 128 samples behind one optimizer step (the lesson's digits run)."""
    fig, axes = canvas(9, 3.6, xlim=10, ylim=4.6)
    for rank, y in enumerate((2.5, 0.9)):
        axes.text(0.05, y + 0.55, f"rank {rank}", fontsize=10, weight="bold", va="center")
        for micro in range(4):
            x0 = 1.0 + micro * 1.85
            for sample in range(16):
                row, col = divmod(sample, 8)
                axes.add_patch(
                    plt.Rectangle((x0 + col * 0.19, y + 0.6 - row * 0.4), 0.16, 0.34, fc=RANK_COLOURS[rank], ec="none")
                )
            if rank == 0:
                axes.text(x0 + 0.75, y + 1.15, f"micro-step {micro + 1}", ha="center", fontsize=9)
    axes.text(
        4.7,
        0.45,
        "each micro-batch: 16 samples, one forward and backward; memory holds one at a time",
        ha="center",
        fontsize=9,
    )
    axes.plot([8.4, 8.5, 8.5, 8.4], [3.75, 3.75, 0.85, 0.85], color="black", lw=1.4)  # a bracket: all eight
    axes.plot([8.5, 8.62], [2.3, 2.3], color="black", lw=1.4)
    axes.text(
        8.75,
        2.3,
        "one optimizer step on\n16 x 4 x 2 = 128 samples\n\n= micro-batch\n  x micro-steps k\n  x processes N",
        fontsize=9,
        va="center",
    )
    axes.text(5.0, 4.45, "The effective batch of the lesson's digits run", ha="center", fontsize=11)
    save(fig, path)


def loss_division(path: Path) -> None:
    """.grad after each of k = 4 micro-steps, with each loss divided by k and without: illustrative values."""
    gradients = [0.9, 1.3, 0.8, 1.0]  # one gradient element per micro-batch: made up, their mean is 1
    fig, panels = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    for axes, divide in zip(panels, (True, False)):
        # the bar after micro-step m holds the parts of micro-batches 1..m: .grad adds them up
        for after in range(1, 5):
            base = 0.0
            for micro in range(after):
                part = gradients[micro] / 4 if divide else gradients[micro]
                axes.bar(after, part, bottom=base, color=RANK_COLOURS[micro], edgecolor="black", width=0.6)
                base += part
        axes.axhline(1.0, color="black", linestyle="--", lw=1)
        axes.text(4.42, 1.0, "whole-batch\ngradient", fontsize=8, va="center", backgroundcolor="white")
        if not divide:
            axes.axhline(4.0, color="#c03030", linestyle=":", lw=1)
            axes.text(0.45, 4.08, "4 times the whole batch's gradient", fontsize=8, color="#c03030")
        axes.set_xticks([1, 2, 3, 4], [f"after {m}" for m in range(1, 5)])
        axes.set_yticks([])
        axes.set_xlim(0.3, 5.5)
        axes.set_ylim(0, 4.6)
        axes.set_title("loss / k before backward()" if divide else "loss not divided", fontsize=10)
        axes.set_xlabel("micro-steps done (k = 4)")
    panels[0].set_ylabel(".grad of one weight")
    handles = [plt.Rectangle((0, 0), 1, 1, fc=RANK_COLOURS[m], ec="black") for m in range(4)]
    fig.legend(
        handles,
        [f"micro-batch {m + 1}" for m in range(4)],
        loc="lower center",
        ncol=4,
        fontsize=8,
        bbox_to_anchor=(0.5, -0.08),
    )
    fig.suptitle(
        ".grad adds every backward(): divide each loss by k to end at the whole batch's gradient\n"
        "(illustrative values for one weight)",
        fontsize=10,
    )
    fig.tight_layout()
    save(fig, path)


def no_sync_timeline(path: Path) -> None:
    """Two ranks, 4 micro-steps, SimpleCNN's 2 buckets: DDP starts each bucket's all-reduce during the backward, as
    soon as the bucket's gradients are ready, and the step waits for both. Under no_sync the first 3 micro-steps
    send nothing. Widths are illustrative, not measured."""
    fig, axes = canvas(10, 5.6, xlim=11.6, ylim=7.0)
    fwd, bwd, gap = 0.55, 1.0, 0.12
    bucket_1 = (0.35, 0.55)  # (start after the backward began, width): the classifier's gradients are ready first
    bucket_2 = (bwd, 0.3)  # the first layers' gradients are ready last: it starts when the backward ends
    for title, top, use_no_sync in (
        ("without no_sync: an all-reduce round (2 buckets) after every micro-step", 6.3, False),
        ("with no_sync on micro-steps 1-3: 1 round per optimizer step", 3.0, True),
    ):
        axes.text(0.0, top + 0.3, title, fontsize=10, weight="bold")
        rows = {0: top - 0.75, 1: top - 2.25}  # the ranks' compute rows; the all-reduces sit between them
        for rank, y in rows.items():
            axes.text(0.0, y + 0.22, f"rank {rank}", fontsize=9, va="center")
        axes.text(0.0, top - 1.28, "all-reduce", fontsize=8, va="center", color="#555555")
        x = 1.0
        for micro in range(4):
            inside = use_no_sync and micro < 3
            colour = "#d6e9f5" if inside else COMPUTE
            for y in rows.values():
                box(axes, x, y, fwd, 0.45, f"fwd {micro + 1}", colour, 8)
                box(axes, x + fwd, y, bwd, 0.45, f"bwd {micro + 1}", colour, 8)
            if inside:
                axes.text(x + (fwd + bwd) / 2, top - 1.28, ".grad +=\nlocally", fontsize=7, ha="center", va="center")
                x += fwd + bwd + gap
                continue
            for number, (offset, width) in enumerate((bucket_1, bucket_2), start=1):
                box(axes, x + fwd + offset, top - 1.5, width, 0.45, f"b{number}", COMMUNICATE, 8)
            x += fwd + max(bwd, bucket_2[0] + bucket_2[1]) + gap
        for y in rows.values():
            box(axes, x, y, 1.3, 0.45, "clip, step,\nzero_grad", STEP, 7)
    handles = [plt.Rectangle((0, 0), 1, 1, fc=colour, ec="black") for colour in (COMPUTE, "#d6e9f5", COMMUNICATE, STEP)]
    labels = [
        "forward, backward",
        "the same inside no_sync: nothing sent",
        "all-reduce of bucket 1 or 2 (b1, b2)",
        "optimizer step",
    ]
    axes.legend(handles, labels, loc="upper center", ncol=4, fontsize=8, bbox_to_anchor=(0.5, 0.09), frameon=False)
    axes.text(
        0.0,
        -0.2,
        "Widths are illustrative. DDP starts a bucket's all-reduce as soon as its gradients are ready, during the\n"
        "backward. The optimizer step waits until both buckets are done.",
        fontsize=8,
        va="top",
        color="#333333",
    )
    save(fig, path)


def group_schedules(path: Path) -> None:
    """The notebook's three step rules for 10 micro-batches and k = 4: which micro-steps all-reduce and step."""
    lines = [line for line in printed_by_cell("5ec1b56d").splitlines() if ":" in line]
    rules = [(name.strip(), marks.strip()) for name, marks in (line.rsplit(":", 1) for line in lines)]
    notes = {
        0: "groups of 4, 4 and 2: every micro-batch is stepped once",
        1: "steps on i = 0 alone, and every later group is shifted by one.\n"
        "i = 9 is never stepped: its gradient leaks into the next epoch",
        2: "i = 8 and i = 9 are never stepped: their gradients leak into the next epoch",
    }
    fig, axes = canvas(10, 3.9, xlim=12, ylim=4.9)
    for row, (name, marks) in enumerate(rules):
        y = 3.4 - row * 1.35
        axes.text(0.0, y + 0.22, name, fontsize=9, va="center", weight="bold" if row == 0 else None)
        for i, mark in enumerate(marks):
            x = 4.2 + i * 0.75
            stepped = mark == "S"
            box(axes, x, y, 0.65, 0.45, "step" if stepped else "", COMMUNICATE if stepped else "#d6e9f5", 8)
            if row == 0:
                axes.text(x + 0.32, y + 0.75, str(i), ha="center", fontsize=8)
        axes.text(4.2, y - 0.08, notes[row], fontsize=8, va="top", color="#333333" if row == 0 else "#c03030")
    axes.text(0.0, 4.15, "micro-batch i (from 0):", fontsize=8)
    handles = [plt.Rectangle((0, 0), 1, 1, fc=colour, ec="black") for colour in (COMMUNICATE, "#d6e9f5")]
    axes.legend(
        handles,
        ["all-reduce, then optimizer step", "inside no_sync: .grad adds up"],
        loc="lower center",
        ncol=2,
        fontsize=8,
        bbox_to_anchor=(0.5, -0.12),
        frameon=False,
    )
    axes.text(6.0, 4.75, "An epoch of 10 micro-batches, k = 4 (the notebook's output)", ha="center", fontsize=10)
    save(fig, path)


def lr_scaling(path: Path) -> None:
    """Final and best test accuracy of the four learning-rate runs, from the notebook's committed table."""
    rows = []
    for line in printed_by_cell("9b6709ae").splitlines():
        match = re.match(r"\s*(.+?)\s+(\d+)\s+([\d.]+)\s+(\d+)\s+(\d+)\s+([\d.]+)%\s+([\d.]+)%", line)
        if match:
            name, batch, lr, warmup, steps, final, best = match.groups()
            rows.append((f"{name}\n(batch {batch}, lr {lr}, {steps} steps)", float(final), float(best)))
    fig, axes = plt.subplots(figsize=(8, 3.8))
    positions = range(len(rows))
    axes.barh([p + 0.2 for p in positions], [r[2] for r in rows], height=0.4, color="#bbbbbb", label="best epoch")
    axes.barh([p - 0.2 for p in positions], [r[1] for r in rows], height=0.4, color=RANK_COLOURS[0], label="last epoch")
    for p, (_, final, best) in zip(positions, rows):
        axes.text(final + 1, p - 0.2, f"{final:.2f}%", va="center", fontsize=8)
        axes.text(best + 1, p + 0.2, f"{best:.2f}%", va="center", fontsize=8, color="#555555")
    axes.set_yticks(list(positions), [r[0] for r in rows], fontsize=8)
    axes.invert_yaxis()
    axes.set_xlim(0, 112)
    axes.set_xlabel("test accuracy on digits (%): last and best of 10 epochs")
    axes.set_title("The linear scaling rule at k = 4, measured (notebook 04, seed 0)", fontsize=10)
    axes.legend(fontsize=8, loc="upper center", ncol=2, bbox_to_anchor=(0.5, -0.15), frameon=False)
    fig.tight_layout()
    save(fig, path)


def rounding_table(path: Path) -> dict[int, float]:
    """{step: max |parameter difference|} from one recorded run of benchmarks/accumulation_rounding.py."""
    table = {}
    for line in path.read_text().splitlines():
        cells = line.split()
        if len(cells) == 5 and cells[0].isdigit():
            table[int(cells[0])] = float(cells[1])
    return table


def rounding_drift(path: Path) -> None:
    """How far one batch of 64 and 4 accumulated micro-batches of 16 drift apart over training, 1 and 2 threads."""
    fig, axes = plt.subplots(figsize=(7, 3.8))
    for source, label, colour in (
        (ROUNDING, "1 thread", RANK_COLOURS[0]),
        (ROUNDING_2_THREADS, "2 threads", RANK_COLOURS[1]),
    ):
        table = rounding_table(source)
        axes.plot(list(table), list(table.values()), marker="o", color=colour, label=label)
    axes.set_yscale("log")
    axes.set_xlabel("optimizer step (LeNet on digits, SGD with momentum)")
    axes.set_ylabel("max |parameter difference|")
    axes.set_title("Accumulated against one batch: equal up to rounding, and the gap grows", fontsize=10)
    axes.legend(fontsize=8)
    axes.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    save(fig, path)


FIGURES = {
    "04_effective_batch": (effective_batch, None),
    "04_loss_division": (loss_division, None),
    "04_no_sync_timeline": (no_sync_timeline, None),
    "04_group_schedules": (group_schedules, NOTEBOOK),
    "04_lr_scaling": (lr_scaling, NOTEBOOK),
    "04_rounding_drift": (rounding_drift, ROUNDING),
}
