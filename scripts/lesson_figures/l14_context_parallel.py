"""Lesson 14's pictures: the online softmax over key blocks, the ring of key/value blocks, one ring step's overlap,
the causal mask cut two ways, Llama 3's all-gather against the ring; and two measured plots from notebook 14 (the
load balance per rank, the ring against the all-gather)."""

import re
from pathlib import Path

from common.context_parallel import shard_pieces, visible

from . import draw
from .draw import COMMUNICATE, COMPUTE, IDLE, MEMORY, RANK_COLOURS, REPO, arrow, box, canvas, plt, save, tint

NOTEBOOK = REPO / "notebooks" / "14_context_parallelism.ipynb"
# The cells whose printed output the measured plots read (their ids in the committed notebook).
BALANCE_CELL, COMPARE_CELL = "fa75dc43", "65ea0f28"


def printed_by_cell(cell_id: str) -> str:
    return draw.printed_by_cell(NOTEBOOK, cell_id)


def online_softmax(path: Path) -> None:
    """One row of queries, three key blocks: each block gives an output and a log-sum-exp; merge folds them in."""
    fig, axes = canvas(9.6, 4.4, xlim=10.8, ylim=5.0)
    axes.set_ylim(-0.9, 5.0)  # room for the merge's formula below the row
    box(axes, 0.2, 3.3, 1.6, 0.7, "queries Q", RANK_COLOURS[0], fontsize=9, color="white")
    for index in range(3):
        x = 3.4 + 2.5 * index
        arrow(axes, (1.8, 3.5), (x, 2.5))  # the queries meet every block
        box(axes, x, 3.3, 1.9, 0.7, f"keys, values\nblock {index + 1}", tint(RANK_COLOURS[index + 1], 0.3), fontsize=9)
        box(axes, x, 1.9, 1.9, 0.8, f"out{index + 1}, lse{index + 1}\nfrom exp(QK^T/sqrt d)", COMPUTE, fontsize=8)
        arrow(axes, (x + 0.95, 3.3), (x + 0.95, 2.7))
        box(axes, x, 0.4, 1.9, 0.8, "merge" if index else "first block:\nout, lse as they are", MEMORY, fontsize=8)
        arrow(axes, (x + 0.95, 1.9), (x + 0.95, 1.2))
        if index:
            arrow(axes, (x - 0.6, 0.8), (x, 0.8))
            axes.text(x - 0.3, 1.3, "out,\nlse", ha="center", fontsize=7)
    axes.text(
        0.1,
        -0.35,
        "merge:  new_lse = log(exp(lse) + exp(lse_block))\n"
        "        out     = exp(lse - new_lse) out + exp(lse_block - new_lse) out_block",
        fontsize=8,
        family="monospace",
        va="center",
    )
    axes.text(5.4, 4.6, "Blockwise attention: the keys come one block at a time, the result is exact", ha="center")
    save(fig, path)


def ring_attention(path: Path) -> None:
    """Four ranks in a ring. Each keeps its queries; at every step it computes on the block it holds and passes it
    on. The table shows whose block each rank holds at each step."""
    fig, (ring, table) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [1, 1.2]})
    ring.set_xlim(-1.8, 1.8)
    ring.set_ylim(-1.8, 1.8)
    ring.axis("off")
    places = [(0, 1.1), (1.1, 0), (0, -1.1), (-1.1, 0)]
    for rank, (x, y) in enumerate(places):
        box(ring, x - 0.45, y - 0.3, 0.9, 0.6, f"rank {rank}\nQ{rank}", RANK_COLOURS[rank], fontsize=9, color="white")
    for rank, (x, y) in enumerate(places):
        nx, ny = places[(rank + 1) % 4]
        ring.annotate(
            "", xy=(nx * 0.75, ny * 0.75), xytext=(x * 0.75, y * 0.75),
            arrowprops={"arrowstyle": "->", "color": COMMUNICATE, "lw": 2, "connectionstyle": "arc3,rad=-0.3"},
        )  # fmt: skip
    ring.text(0, 0, "K, V blocks\ntravel to\nrank r + 1", ha="center", va="center", fontsize=9)
    table.axis("off")
    table.set_xlim(0, 5)
    table.set_ylim(0, 5)
    for step in range(4):
        table.text(1.5 + step * 0.9, 4.6, f"step {step}", ha="center", fontsize=9)
        for rank in range(4):
            source = (rank - step) % 4
            box(table, 1.1 + step * 0.9, 3.6 - rank * 0.9, 0.8, 0.6, f"KV{source}", tint(RANK_COLOURS[source], 0.3),
                fontsize=9)  # fmt: skip
    for rank in range(4):
        table.text(0.9, 3.9 - rank * 0.9, f"rank {rank}", ha="right", va="center", fontsize=9)
    table.text(2.8, 0.2, "each step: post the held block to r + 1, compute on it, wait", ha="center", fontsize=8)
    fig.suptitle("Ring attention on 4 ranks: N steps, N - 1 messages per rank in forward", fontsize=11)
    save(fig, path)


def overlap(path: Path) -> None:
    """One rank's ring forward on a timeline: the next block's transfer runs while the current block is computed,
    and a step lasts the longer of the two."""
    fig, axes = canvas(9, 2.8, xlim=10, ylim=3.4)
    axes.text(0.1, 2.45, "compute", va="center", fontsize=9)
    axes.text(0.1, 1.45, "network", va="center", fontsize=9)
    for step in range(4):
        x = 1.4 + step * 2.1
        box(axes, x, 2.15, 1.5, 0.6, f"step {step}'s block", COMPUTE, fontsize=8)
        if step < 3:
            box(axes, x, 1.15, 1.9, 0.6, f"receive {step + 1}", COMMUNICATE, fontsize=8)
            box(axes, x + 1.5, 2.15, 0.4, 0.6, "wait", IDLE, fontsize=7)
    axes.text(
        5, 0.5,
        "here the network is the longer, so compute waits: a step takes max(compute one block, send one block)",
        ha="center", fontsize=9,
    )  # fmt: skip
    save(fig, path)


def causal_layouts(path: Path) -> None:
    """The causal mask of a 16-position sequence on 4 ranks, each query row coloured by the rank that holds it; the
    blocks a rank skips are blank. Contiguous: the last rank computes most. Zig-zag: each the same."""
    seq, world_size = 16, 4
    fig, panels = plt.subplots(1, 2, figsize=(9, 4.4))
    for panel, layout in zip(panels, ("contiguous", "zigzag")):
        pieces = [shard_pieces(seq, rank, world_size, layout) for rank in range(world_size)]
        for rank in range(world_size):
            for query in pieces[rank]:
                for source in range(world_size):
                    for key in pieces[source]:
                        if visible(query, key, True) == "none":
                            continue
                        for row in query:
                            for column in key:
                                if column <= row:
                                    panel.add_patch(plt.Rectangle((column, row), 1, 1, color=RANK_COLOURS[rank]))
                        panel.add_patch(plt.Rectangle((key.start, query.start), len(key), len(query), fill=False,
                                                      ec="black", lw=0.6))  # fmt: skip
        panel.set_xlim(0, seq)
        panel.set_ylim(seq, 0)
        panel.set_aspect("equal")
        panel.set_xlabel("key position")
        panel.set_ylabel("query position")
        work = [sum(len(q) * len(k) for s in range(world_size) for q in pieces[r] for k in pieces[s]
                    if visible(q, k, True) != "none") for r in range(world_size)]  # fmt: skip
        panel.set_title(f"{layout}: scores computed per rank {work}", fontsize=9)
    labels = [f"rank {r}'s queries" for r in range(world_size)]
    draw.save_with_rank_legend(
        fig, path, labels, "A causal mask on 4 ranks: boxes are the query-key blocks a rank computes"
    )


def ring_or_all_gather(path: Path) -> None:
    """What one rank holds of the keys and values: the ring two blocks at a time, the all-gather every block."""
    fig, axes = canvas(9, 3.2, xlim=10, ylim=3.6)
    axes.text(0.1, 2.6, "ring", va="center", fontsize=10)
    axes.text(0.1, 1.1, "all-gather\n(Llama 3)", va="center", fontsize=10)
    box(axes, 1.8, 2.3, 1.1, 0.6, "KV held", tint(RANK_COLOURS[1], 0.3), fontsize=8)
    box(axes, 3.0, 2.3, 1.1, 0.6, "KV arriving", tint(RANK_COLOURS[2], 0.3), fontsize=8)
    axes.text(4.4, 2.6, "2 blocks at any N (4 in backward);\nN - 1 messages, then N - 1 + N in backward", va="center",
              fontsize=8)  # fmt: skip
    for rank in range(4):
        box(axes, 1.8 + rank * 1.2, 0.8, 1.1, 0.6, f"KV{rank}", tint(RANK_COLOURS[rank], 0.3), fontsize=8)
    note = "N blocks at once (2N in backward); one\nall-gather, one reduce-scatter in backward"
    axes.text(6.6, 1.1, note, va="center", fontsize=8)
    axes.text(5, 3.4, "Keys and values one rank holds during attention", ha="center", fontsize=11)
    save(fig, path)


def balance_measured(path: Path) -> None:
    """Notebook 14's section 3: each rank's share of the scores and of the measured compute time, both layouts."""
    printed = printed_by_cell(BALANCE_CELL)
    balance = {}
    for layout, work, seconds in re.findall(r"(\w+): scores per rank \[([\d, ]+)\].*?\n\s+ms per rank \[([\d., ]+)\]",
                                            printed):  # fmt: skip
        balance[layout] = {"work": [int(w) for w in work.split(",")], "seconds": [float(s) for s in seconds.split(",")]}
    from common.experiments.context_parallel import plot_balance

    fig, axes = plt.subplots(figsize=(7, 3.6))
    plot_balance(balance, axes)
    axes.set_title("Causal attention over 2,048 positions on 4 ranks: measured by notebook 14", fontsize=10)
    fig.tight_layout()
    save(fig, path)


def ring_against_all_gather_measured(path: Path) -> None:
    """Notebook 14's section 4: bytes sent, peak memory and time of the ring and the all-gather, on 2 and 4 ranks."""
    printed = printed_by_cell(COMPARE_CELL)
    rows = re.findall(r"(\d) ranks,\s+([\w-]+): ([\d.]+) MiB sent, peak ([\d.]+) MiB, ([\d.]+) ms", printed)
    fig, panels = plt.subplots(1, 3, figsize=(10, 3))
    titles = ("MiB rank 0 sent", "peak MiB in attention", "ms, forward + backward")
    for column, (panel, title) in enumerate(zip(panels, titles)):
        for index, (ranks, method, *values) in enumerate(rows):
            colour = COMMUNICATE if method == "ring" else MEMORY
            panel.barh(index, float(values[column]), color=colour, edgecolor="black")
            panel.text(float(values[column]), index, f" {values[column]}", va="center", fontsize=8)
        panel.set_yticks(range(len(rows)), [f"{r} ranks, {m}" for r, m, *_ in rows] if column == 0 else [])
        panel.invert_yaxis()
        panel.set_title(title, fontsize=9)
        panel.set_xlim(0, max(float(row[2 + column]) for row in rows) * 1.35)
    fig.suptitle("The ring against the all-gather: 2,048 positions, causal, zig-zag (notebook 14, a shared CPU)",
                 fontsize=10)  # fmt: skip
    fig.tight_layout()
    save(fig, path)


FIGURES = {
    "14_online_softmax": (online_softmax, None),
    "14_ring_attention": (ring_attention, None),
    "14_ring_overlap": (overlap, None),
    "14_causal_layouts": (causal_layouts, None),
    "14_ring_or_all_gather": (ring_or_all_gather, None),
    "14_balance_measured": (balance_measured, NOTEBOOK),
    "14_ring_against_all_gather_measured": (ring_against_all_gather_measured, NOTEBOOK),
}
