"""Lesson 13's pictures: one layer's saved activations term by term, recomputation on a timeline, the two conjugate
collectives of sequence parallelism, a layer cut by heads and by the sequence; and three measured plots from
notebook 13 (a layer's bytes against the sequence length, the recomputation table, memory per rank)."""

import re
from pathlib import Path

from common.activations import activation_bytes_per_layer

from . import draw
from .draw import COMMUNICATE, COMPUTE, IDLE, MEMORY, RANK_COLOURS, REPO, arrow, box, canvas, plt, save, tint

NOTEBOOK = REPO / "notebooks" / "13_memory_and_sequence_parallelism.ipynb"
# The cells whose printed output the measured plots read (their ids in the committed notebook).
SWEEP_CELL, RECOMPUTE_CELL, PER_RANK_CELL = "c82935ad", "088a4092", "58ba4177"


def printed_by_cell(cell_id: str) -> str:
    return draw.printed_by_cell(NOTEBOOK, cell_id)


GROUP_COLOURS = {
    "the two norms": "#bcbddc",
    "attention, linear in s": COMPUTE,
    "attention, the s^2 scores": "#e6550d",
    "MLP": MEMORY,
}


def grouped_terms(seq: int, batch: int, hidden: int, heads: int, **bytes_per_value) -> dict[str, float]:
    """``activation_bytes_per_layer`` summed into the picture's four groups, in MiB."""
    terms = activation_bytes_per_layer(seq, batch, hidden, heads, **bytes_per_value)
    scores = ("softmax", "probabilities")
    quadratic = sum(nbytes for term, nbytes in terms["attention"].items() if any(word in term for word in scores))
    groups = {
        "the two norms": sum(terms["attention_norm"].values()) + sum(terms["mlp_norm"].values()),
        "attention, linear in s": sum(terms["attention"].values()) - quadratic,
        "attention, the s^2 scores": quadratic,
        "MLP": sum(terms["mlp"].values()),
    }
    return {group: nbytes / 2**20 for group, nbytes in groups.items()}


def where_a_layers_memory_goes(path: Path) -> None:
    """Stacked bars of one layer's saved bytes by group: the paper's 16-bit count and this CPU's fp32 one at solution
    14's settings, and the fp32 one at 8 times the sequence, where the scores take over."""
    batch, hidden, heads = 16, 128, 4
    bars = {
        "s = 128, 16-bit values,\n1-byte masks (the paper)": grouped_terms(
            128, batch, hidden, heads, value_bytes=2, mask_bytes=1, norm_statistics=False
        ),
        "s = 128, fp32 values and\nmasks (this CPU)": grouped_terms(128, batch, hidden, heads),
        "s = 1024, fp32 values and\nmasks (this CPU)": grouped_terms(1024, batch, hidden, heads),
    }
    fig, (near, far) = plt.subplots(2, 1, figsize=(9, 4.6), gridspec_kw={"height_ratios": [2, 1]})
    for axes, names in ((near, list(bars)[:2]), (far, list(bars)[2:])):
        for row, name in enumerate(names):
            left = 0.0
            for group, mib in bars[name].items():
                axes.barh(row, mib, left=left, color=GROUP_COLOURS[group], edgecolor="black", label=group)
                if mib > 0.06 * sum(bars[name].values()):
                    axes.text(left + mib / 2, row, f"{mib:.1f}", ha="center", va="center", fontsize=8)
                left += mib
            axes.text(left * 1.01, row, f"{left:.1f} MiB", va="center", fontsize=8)
        axes.set_yticks(range(len(names)), names, fontsize=8)
        axes.invert_yaxis()
        for side in ("top", "right"):
            axes.spines[side].set_visible(False)
    near.set_xlim(0, 38)
    far.set_xlim(0, 1150)
    handles, labels = near.get_legend_handles_labels()
    near.legend(handles[:4], labels[:4], fontsize=8, ncol=4, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    far.set_xlabel("MiB one layer keeps for backward: batch 16, width 128, 4 heads (the formula, term by term)")
    fig.suptitle("Where one layer's activation memory goes", fontsize=11, y=1.04)
    fig.tight_layout()
    save(fig, path)


def recomputation_timeline(path: Path) -> None:
    """Three layers' forward and backward, schematic: without recomputation every layer's activations are kept from
    its forward to its backward; with full recomputation only each layer's input, and its forward runs again."""
    fig, axes = plt.subplots(figsize=(10, 3.6))
    rows = {
        "no recomputation": ["F1", "F2", "F3", "B3", "B2", "B1"],
        "full recomputation": ["F1", "F2", "F3", "R3", "B3", "R2", "B2", "R1", "B1"],
    }
    colours = {"F": COMPUTE, "B": "#fdd0a2", "R": "#c6dbef"}
    widths = {"F": 1.0, "B": 2.0, "R": 1.0}
    for row, (name, steps) in enumerate(rows.items()):
        y = 2.2 * (1 - row)  # the first row on top
        now, kept, held = 0.0, 0, []
        for step in steps:
            kind = step[0]
            width = widths[kind]
            hatch = "//" if kind == "R" else None
            axes.broken_barh([(now, width)], (y, 0.8), facecolors=colours[kind], edgecolor="grey", hatch=hatch)
            axes.text(now + width / 2, y + 0.4, step, ha="center", va="center", fontsize=8)
            before = kept
            if name == "no recomputation":
                kept += {"F": 3, "B": -3}[kind]  # a layer's activations: 3 units, from its forward to its backward
            else:
                kept += {"F": 1, "R": 3, "B": -4}[kind]  # its input (1 unit); the recomputed 3 until its backward
            held.append((now, now + width, max(before, kept)))  # a backward still holds what it frees at its end
            now += width
        for start, end, units in held:
            axes.fill_between([start, end], [y + 0.95 + 0.09 * units] * 2, y + 0.95, color=MEMORY, lw=0)
        axes.text(-0.3, y + 0.4, name, ha="right", va="center", fontsize=9)
    axes.text(-0.3, 3.4, "green: activations\nheld (schematic)", ha="right", fontsize=8, color="dimgrey")
    axes.set_xlim(-4.2, 14.5)
    axes.set_ylim(-0.4, 4.3)
    axes.axis("off")
    handles = [
        plt.Rectangle((0, 0), 1, 1, fc=COMPUTE, ec="grey", label="forward of layer i (Fi)"),
        plt.Rectangle((0, 0), 1, 1, fc="#c6dbef", ec="grey", hatch="//", label="its forward again (Ri)"),
        plt.Rectangle((0, 0), 1, 1, fc="#fdd0a2", ec="grey", label="its backward (Bi)"),
    ]
    axes.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.55, -0.12), ncol=3, fontsize=8, frameon=False)
    axes.set_title(
        "Recomputation keeps each layer's input only, and runs the layer's forward again just before its backward",
        fontsize=10,
    )
    save(fig, path)


def tokens(axes, x: float, y: float, ranks: list[int], width: float = 0.5, text: str = "") -> None:
    """A row of token blocks, coloured by the rank whose tokens they are (two blocks per rank)."""
    for index, rank in enumerate(ranks):
        axes.add_patch(plt.Rectangle((x + index * width, y), width, 0.7, fc=tint(RANK_COLOURS[rank]), ec="black"))
    if text:
        axes.text(x + len(ranks) * width / 2, y + 1.0, text, ha="center", fontsize=8)


def conjugate_collectives(path: Path) -> None:
    """The pair on 2 ranks: g all-gathers the sequence in forward and reduce-scatters the gradient in backward; g-bar
    reduce-scatters the partial sums in forward and all-gathers the gradient in backward."""
    fig, axes = canvas(10, 5.2, xlim=20, ylim=11)
    axes.text(10, 10.7, "Sequence parallelism's two collectives, on 2 ranks", ha="center", fontsize=12, weight="bold")
    panels = (
        (
            0.3,
            "GatherFromSequenceParallel: before\nthe attention and before the MLP",
            "all-gather",
            "reduce-scatter",
            "this rank's\ntokens",
        ),
        (
            10.3,
            "ReduceScatterToSequenceParallel:\nafter each of them",
            "reduce-scatter",
            "all-gather",
            "a partial sum,\nevery token",
        ),
    )
    for x, title, forward, backward, before in panels:
        axes.text(x + 4.7, 9.0, title, ha="center", fontsize=9, weight="bold")
        for rank in range(2):
            y = 6.6 - 2.6 * rank
            axes.text(x, y + 0.35, f"rank {rank}", fontsize=9, va="center")
            if forward == "all-gather":
                tokens(axes, x + 1.4, y, [rank, rank], text=before if rank == 0 else "")
                tokens(axes, x + 6.2, y, [0, 0, 1, 1], text="every token" if rank == 0 else "")
            else:
                tokens(axes, x + 1.4, y, [2 + 2 * rank] * 4, text=before if rank == 0 else "")  # two partial sums
                tokens(axes, x + 6.9, y, [rank, rank], text="the sum, this\nrank's tokens" if rank == 0 else "")
            arrow(axes, (x + 3.8, y + 0.35), (x + 5.9, y + 0.35))
        box(axes, x + 3.8, 4.9, 2.1, 1.0, forward, COMMUNICATE, 8)
        axes.text(x + 4.7, 2.4, f"forward: {forward}", ha="center", fontsize=9)
        axes.text(x + 4.7, 1.7, f"backward: {backward} of the gradient", ha="center", fontsize=9)
    axes.text(
        10,
        0.5,
        "An all-reduce is a reduce-scatter and an all-gather: the pair moves the bytes that tensor parallelism's "
        "all-reduce moves.",
        ha="center",
        fontsize=9,
    )
    save(fig, path)


def sequence_parallel_layer(path: Path) -> None:
    """One layer on 2 ranks, tensor parallelism above, with sequence parallelism below: which regions hold the whole
    sequence, which are cut by heads or hidden features, and where each collective sits."""
    fig, axes = canvas(11, 5.2, xlim=24, ylim=11.5)
    whole, halves, split = IDLE, tint(RANK_COLOURS[2], 0.55), tint(RANK_COLOURS[0], 0.5)
    stages = ["norm", "IN", "attention\nby heads", "OUT", "dropout,\nresidual"] * 2
    stages[7] = "MLP by\nhidden"
    rows = (
        ("Tensor parallelism (lesson 12): the norms, dropouts and residuals hold the whole (b, s, h) on every rank",
         ("f: identity\n(backward:\nall-reduce)", "g:\nall-reduce\n(backward:\nidentity)"), whole, 6.6),
        ("Tensor + sequence parallelism: there each rank holds (b, s/2, h), its half of the tokens",
         ("all-gather\n(backward:\nreduce-\nscatter)", "reduce-\nscatter\n(backward:\nall-gather)"), halves, 1.4),
    )  # fmt: skip
    for title, (gather, scatter), outside, y in rows:
        axes.text(0.2, y + 3.0, title, fontsize=9, weight="bold")
        x = 0.2
        for stage in stages:
            if stage in ("IN", "OUT"):
                box(axes, x, y + 0.1, 1.9, 2.0, gather if stage == "IN" else scatter, COMMUNICATE, 7)
                x += 2.2
                continue
            box(axes, x, y, 2.0, 2.2, stage, split if "by" in stage else outside, 8)
            x += 2.3
    handles = [
        plt.Rectangle((0, 0), 1, 1, fc=whole, ec="black", label="the whole sequence on every rank"),
        plt.Rectangle((0, 0), 1, 1, fc=halves, ec="black", label="each rank its half of the tokens"),
        plt.Rectangle((0, 0), 1, 1, fc=split, ec="black", label="each rank its heads or hidden features"),
        plt.Rectangle((0, 0), 1, 1, fc=COMMUNICATE, ec="black", label="a collective"),
    ]
    axes.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, -0.04), ncol=4, fontsize=8, frameon=False)
    save(fig, path)


def layer_bytes_against_sequence(path: Path) -> None:
    """Notebook 13's section 2: one layer's measured bytes against the sequence length, with the formula."""
    printed = printed_by_cell(SWEEP_CELL)
    rows = [
        tuple(int(value.replace(",", "")) for value in row)
        for row in re.findall(r"^\s*(\d+)\s+(\d+) \|\s+([\d,]+)\s+([\d,]+)", printed, re.MULTILINE)
    ]
    fig, axes = plt.subplots(figsize=(7.5, 4.2))
    for index, batch in enumerate(sorted({row[1] for row in rows})):
        mine = [row for row in rows if row[1] == batch]
        seqs = [row[0] for row in mine]
        colour = RANK_COLOURS[index]
        axes.plot(seqs, [row[2] / 2**20 for row in mine], "o", color=colour, label=f"measured, batch {batch}")
        axes.plot(seqs, [row[3] / 2**20 for row in mine], "-", color=colour, lw=1, label=f"formula, batch {batch}")
        linear = [(row[3] - 12 * 4 * row[0] ** 2 * batch) / 2**20 for row in mine]  # 12 a s^2 b bytes, a = 4
        axes.plot(seqs, linear, ":", color=colour, lw=1, label=f"its terms linear in s, batch {batch}")
    axes.set(xscale="log", yscale="log", xlabel="sequence length s (tokens)", ylabel="MiB one layer keeps")
    lengths = sorted({row[0] for row in rows})
    axes.set_xticks(lengths, [str(length) for length in lengths])
    axes.set_xticks([], minor=True)
    axes.set_yticks([0.5, 1, 2, 5, 10, 20], ["0.5", "1", "2", "5", "10", "20"])
    axes.set_yticks([], minor=True)
    axes.set_title("One layer of width 128, 4 heads, fp32 on a CPU: measured by notebook 13", fontsize=10)
    axes.legend(fontsize=7, loc="upper left")
    save(fig, path)


def recomputation_measured(path: Path) -> None:
    """Notebook 13's section 4: what each recomputation mode kept after forward, its peak, and its step time."""
    printed = printed_by_cell(RECOMPUTE_CELL)
    rows = re.findall(r"^(\S+)\s+([\d.]+) MiB\s+([\d.]+) MiB\s+([\d.]+) ms \| (\w+)", printed, re.MULTILINE)
    fig, (memory, time) = plt.subplots(1, 2, figsize=(10, 3.2), gridspec_kw={"width_ratios": [1.6, 1]})
    names = [row[0] for row in rows]
    for index, (name, kept, peak, ms, same) in enumerate(rows):
        memory.barh(index - 0.18, float(kept), height=0.34, color=MEMORY, edgecolor="black")
        memory.barh(index + 0.18, float(peak), height=0.34, color="#fdae6b", edgecolor="black")
        memory.text(float(kept) + 1, index - 0.18, f"{kept}", va="center", fontsize=7)
        memory.text(float(peak) + 1, index + 0.18, f"{peak}", va="center", fontsize=7)
        time.barh(index, float(ms), color=COMPUTE, edgecolor="black")
        time.text(float(ms) * 1.01, index, f"{ms} ms", va="center", fontsize=7)
    for axes in (memory, time):
        axes.set_yticks(range(len(names)), names)
        axes.invert_yaxis()
    memory.set_xlabel("MiB: green kept after forward, orange the peak in the step")
    time.set_xlabel("median step time (a shared CPU)")
    time.set_xlim(0, max(float(row[3]) for row in rows) * 1.3)
    memory.set_xlim(0, max(float(row[2]) for row in rows) * 1.15)
    same = "the same gradients, bit for bit" if all(row[4] == "True" for row in rows) else "gradients differ"
    fig.suptitle(f"Recomputation on solution 14's GPT, batch 16 x 128: {same}", fontsize=10)
    fig.tight_layout()
    save(fig, path)


def memory_per_rank(path: Path) -> None:
    """Notebook 13's section 6: model state and activations on one rank, five ways."""
    printed = printed_by_cell(PER_RANK_CELL)
    rows = re.findall(r"^(.+?)\s+model state\s+([\d.]+) MiB, activations\s+([\d.]+) MiB", printed, re.MULTILINE)
    fig, axes = plt.subplots(figsize=(9, 3.4))
    for index, (name, state, activations) in enumerate(rows):
        state, activations = float(state), float(activations)
        axes.barh(index, state, color="#bcbddc", edgecolor="black", label="model state" if index == 0 else None)
        axes.barh(
            index, activations, left=state, color=MEMORY, edgecolor="black", label="activations" if index == 0 else None
        )
        axes.text(state + activations + 1, index, f"{state + activations:.1f} MiB", va="center", fontsize=8)
    axes.set_yticks(range(len(rows)), [row[0] for row in rows], fontsize=8)
    axes.invert_yaxis()
    axes.set_xlim(0, max(float(s) + float(a) for _, s, a in rows) * 1.2)
    axes.set_xlabel("MiB on rank 0 of 2: parameters, gradients and AdamW's states; activations kept after forward")
    axes.set_title("Solution 14's GPT, batch 16 x 128, one AdamW step: measured by notebook 13", fontsize=10)
    axes.legend(fontsize=8, loc="lower right")
    for side in ("top", "right"):
        axes.spines[side].set_visible(False)
    save(fig, path)


FIGURES = {
    "13_where_a_layers_memory_goes": (where_a_layers_memory_goes, None),
    "13_recomputation_timeline": (recomputation_timeline, None),
    "13_conjugate_collectives": (conjugate_collectives, None),
    "13_sequence_parallel_layer": (sequence_parallel_layer, None),
    "13_layer_bytes_against_sequence": (layer_bytes_against_sequence, NOTEBOOK),
    "13_recomputation_measured": (recomputation_measured, NOTEBOOK),
    "13_memory_per_rank": (memory_per_rank, NOTEBOOK),
}
