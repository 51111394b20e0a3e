"""Lesson 06's pictures: who holds what under each ZeRO stage, the two collectives FSDP uses, ZeRO-1's bins, FSDP2's
row shards, one FSDP2 step unit by unit, DCP's files read by another number of ranks, and a 1-D mesh beside HSDP's.

All are diagrams drawn from code. Where a picture carries a size, it is computed here from ``DeepMLP`` with the
course's own functions (``common.memory.zero_bytes_per_rank``, ZeroRedundancyOptimizer's partition rule), and
equals a figure that lesson 06 quotes from its notebook; the other pictures say "illustrative" on their face.
"""

from pathlib import Path

from matplotlib.patches import Patch, Rectangle

from common.memory import zero_bytes_per_rank
from common.models import DeepMLP

from .draw import COMMUNICATE, COMPUTE, IDLE, RANK_COLOURS, arrow, box, canvas, plt, save

PARTS = ("parameters", "gradients", "optimizer")
PART_COLOURS = {"parameters": "#4e79a7", "gradients": "#f28e2b", "optimizer": "#59a14f"}
PART_LABELS = {"parameters": "parameters", "gradients": "gradients", "optimizer": "optimizer states (Adam)"}
SHARDED = {0: (), 1: ("optimizer",), 2: ("gradients", "optimizer"), 3: PARTS}


def _deep_mlp_sizes() -> dict:
    """Parameter counts of the default DeepMLP: the whole, the root's own (stem and head), and one block."""
    model = DeepMLP()
    whole = sum(p.numel() for p in model.parameters())
    root = sum(p.numel() for module in (model.stem, model.head) for p in module.parameters())
    block = sum(p.numel() for p in model.blocks[0].parameters())
    return {"whole": whole, "root": root, "block": block, "blocks": len(model.blocks)}


def who_holds_what(path: Path) -> None:
    """Per-rank stacked bars of parameters, gradients and Adam's states under ZeRO stages 0-3, 4 ranks, DeepMLP."""
    whole = _deep_mlp_sizes()["whole"]
    world_size = 4
    names = (
        "DDP\n(ZeRO stage 0)",
        "ZeRO-1\n(optimizer states)",
        "ZeRO-2\n(+ gradients)",
        "ZeRO-3 = FSDP2\n(+ parameters)",
    )
    fig, axes = plt.subplots(figsize=(9.5, 4.6))
    for stage, name in enumerate(names):
        held = zero_bytes_per_rank(whole, world_size, stage)
        for rank in range(world_size):
            x = stage * 5.5 + rank
            bottom = 0.0
            for part in PARTS:
                sharded = part in SHARDED[stage]
                height = held[part] / 1e6
                axes.bar(
                    x,
                    height,
                    bottom=bottom,
                    width=0.8,
                    color=PART_COLOURS[part],
                    edgecolor="black",
                    lw=0.6,
                    hatch="//" if sharded else None,
                    alpha=0.85 if sharded else 1.0,
                )
                bottom += height
            axes.text(x, -0.9, f"r{rank}", ha="center", va="top", fontsize=8)
        axes.text(
            stage * 5.5 + 1.5, held["total"] / 1e6 + 0.5, f"{held['total'] / 1e6:.2f} MB", ha="center", fontsize=9
        )
        axes.text(stage * 5.5 + 1.5, -2.6, name, ha="center", va="top", fontsize=9)
    axes.set_xlim(-0.8, 3 * 5.5 + 3.8)
    axes.set_ylim(0, 26)
    axes.set_xticks([])
    axes.set_ylabel("MB held by each rank")
    axes.spines[["top", "right"]].set_visible(False)
    handles = [Patch(facecolor=PART_COLOURS[part], edgecolor="black", label=PART_LABELS[part]) for part in PARTS]
    handles.append(
        Patch(facecolor="white", edgecolor="black", hatch="//", label="sharded: a different quarter per rank")
    )
    axes.legend(handles=handles, fontsize=8, loc="upper right")
    axes.set_title(
        "What each of 4 ranks (r0-r3) holds: DeepMLP, Adam in fp32\n"
        "(ZeRO's arithmetic, common.memory.zero_bytes_per_rank)",
        fontsize=10,
    )
    save(fig, path)


def _vector(axes, x, y, cells, cell=0.6, height=0.55):
    """A row of cells: each cell is (colour, text); ``None`` colour leaves it empty."""
    for i, (colour, text) in enumerate(cells):
        face = colour if colour is not None else "white"
        axes.add_patch(Rectangle((x + i * cell, y), cell, height, fc=face, ec="black", lw=0.8))
        if text:
            axes.text(x + (i + 0.5) * cell, y + height / 2, text, ha="center", va="center", fontsize=8)


def collectives(path: Path) -> None:
    """All-gather and reduce-scatter on 4 ranks of an 8-element tensor: what each rank holds before and after."""
    ranks, chunk = 4, 2
    fig, axes = canvas(10, 5.6, xlim=20, ylim=11.2)
    for panel, (title, x0) in enumerate((("all-gather", 0.0), ("reduce-scatter", 10.0))):
        axes.text(x0 + 5.2, 10.7, title, ha="center", fontsize=12, weight="bold")
        axes.text(x0 + 2.9, 10.0, "before", ha="center", fontsize=9)
        axes.text(x0 + 7.6, 10.0, "after", ha="center", fontsize=9)
        for rank in range(ranks):
            y = 8.8 - rank * 1.0
            axes.text(x0 + 1.0, y + 0.27, f"rank {rank}", ha="right", va="center", fontsize=8)
            if panel == 0:  # all-gather: each rank starts with its own chunk, ends with every chunk
                before = [(RANK_COLOURS[rank], f"s{rank}") if i // chunk == rank else (None, "") for i in range(8)]
                after = [(RANK_COLOURS[i // chunk], f"s{i // chunk}") for i in range(8)]
            else:  # reduce-scatter: each rank starts with a whole tensor of its own, ends with one chunk of the sum
                before = [(RANK_COLOURS[rank], f"g{rank}") for _ in range(8)]
                after = [("#cccccc", "Σ") if i // chunk == rank else (None, "") for i in range(8)]
            _vector(axes, x0 + 1.1, y, before, cell=0.45)
            _vector(axes, x0 + 5.8, y, after, cell=0.45)
        axes.annotate("", xy=(x0 + 5.65, 7.6), xytext=(x0 + 4.9, 7.6), arrowprops={"arrowstyle": "-|>", "lw": 2})
    axes.text(
        5.2,
        4.3,
        "Each rank holds one chunk (s0..s3) of a tensor.\nAfterwards every rank holds the whole tensor.\n"
        "FSDP: the shards of a unit's weights become\nthe whole weights, just before the unit computes.",
        ha="center",
        va="top",
        fontsize=9,
    )
    axes.text(
        15.2,
        4.3,
        "Each rank holds a whole tensor of its own (g0..g3).\nAfterwards rank r holds chunk r of their sum (Σ),\n"
        "or of their mean with ReduceOp.AVG.\nFSDP: each rank's whole gradients become\n"
        "its shard of the averaged gradients (AVG).",
        ha="center",
        va="top",
        fontsize=9,
    )
    axes.text(
        10.0,
        1.0,
        "Illustrative: 4 ranks, 8 elements, chunks of 2. "
        "On a ring each rank sends and receives (N-1)/N of the tensor.\n"
        "A ring all-reduce (lesson 01) is a reduce-scatter followed by an all-gather.",
        ha="center",
        va="center",
        fontsize=9,
        style="italic",
    )
    save(fig, path)


def zero1_bins(path: Path) -> None:
    """ZeroRedundancyOptimizer's partition of DeepMLP's tensors over 4 ranks: largest first, to the least loaded."""
    named = [(name, p.numel()) for name, p in DeepMLP().named_parameters()]
    loads, owned = [0] * 4, [[] for _ in range(4)]
    for order, (name, numel) in enumerate(sorted(named, key=lambda item: -item[1]), start=1):
        rank = loads.index(min(loads))  # the first such rank on a tie, as _partition_parameters does
        loads[rank] += numel
        owned[rank].append((order, name, numel))
    fig, axes = plt.subplots(figsize=(9.5, 3.8))
    even = sum(numel for _, numel in named) * 8 / 4 / 1e6
    for rank, tensors in enumerate(owned):
        left = 0.0
        small = [t for t in tensors if t[2] < 100_000]
        for order, name, numel in (t for t in tensors if t[2] >= 100_000):
            width = numel * 8 / 1e6  # Adam's two fp32 moments: 8 bytes per element
            axes.barh(rank, width, left=left, color=RANK_COLOURS[rank], edgecolor="black", height=0.6)
            label = name.replace(".0.weight", " weight").replace(".1.weight", " weight").replace("blocks.", "block ")
            axes.text(left + width / 2, rank, f"#{order}: {label}", ha="center", va="center", fontsize=8)
            left += width
        if small:
            width = sum(numel for *_, numel in small) * 8 / 1e6
            axes.barh(rank, width, left=left, color="#dddddd", edgecolor="black", height=0.6)
            left += width
            what = (
                "head weight" if any("head.weight" in name for _, name, _ in small) else f"{len(small)} small tensors"
            )
            axes.text(left + 0.05, rank + 0.38, f"+ {what}", ha="left", va="center", fontsize=8)
        total = (8 * loads[rank] + 4 * len(tensors)) / 1e6  # plus one 4-byte step counter per tensor
        axes.text(left + 0.05, rank, f"{total:.2f} MB", ha="left", va="center", fontsize=9, weight="bold")
    axes.axvline(even, color="black", linestyle="--", lw=1, zorder=0)  # behind the bars
    axes.text(even + 0.05, -0.6, f"an even share: {even:.2f} MB", ha="left", va="center", fontsize=8)
    axes.set_yticks(range(4), [f"rank {rank}" for rank in range(4)])
    axes.set_ylim(3.5, -0.85)  # rank 0 on top
    axes.set_xlim(0, 5.2)
    axes.set_xlabel("MB of Adam state each rank keeps (DeepMLP, 4 ranks)")
    axes.set_title(
        "ZeRO-1 deals whole tensors: largest first (#1, #2, ...), each to the rank holding the fewest elements",
        fontsize=10,
    )
    axes.spines[["top", "right"]].set_visible(False)
    save(fig, path)


def _rows(axes, x, y_top, rows_per_rank, scale, width, labels=True, fontsize=8):
    """A weight cut into row chunks, one colour per rank, from the top down; returns the bottom y."""
    y = y_top
    for rank, rows in enumerate(rows_per_rank):
        height = rows * scale
        axes.add_patch(Rectangle((x, y - height), width, height, fc=RANK_COLOURS[rank], ec="black", lw=0.8))
        if labels:
            axes.text(
                x + width / 2, y - height / 2, f"rank {rank}\n{rows} rows", ha="center", va="center", fontsize=fontsize
            )
        y -= height
    return y


def row_shards(path: Path) -> None:
    """Each weight cut into row chunks, one per rank: every rank holds a piece of every layer, chunks may be uneven."""
    fig, axes = canvas(10, 5.2, xlim=20, ylim=10.4)
    axes.text(5.0, 10.0, "DeepMLP on 4 ranks: every weight is cut along dim 0", ha="center", fontsize=10, weight="bold")
    layers = (
        ("stem weight\n512 x 784", 512, 784),
        ("block weight\n512 x 512", 512, 512),
        ("head weight\n10 x 512", 10, 512),
    )
    x = 0.3
    for label, rows, columns in layers:
        width = columns / 784 * 3.6
        chunk = -(-rows // 4)  # torch.chunk's rows per rank: ceil(rows / 4), the last one shorter
        per_rank = [min(chunk, rows - rank * chunk) for rank in range(4)]
        scale = 7.0 / 512 if rows > 10 else 0.28
        bottom = _rows(axes, x, 8.8, per_rank, scale, width, labels=rows > 10)
        if rows <= 10:
            axes.text(x + width / 2, bottom - 0.2, "3 + 3 + 3 + 1 rows", ha="center", va="top", fontsize=8)
        axes.text(x + width / 2, 9.05, label, ha="center", va="bottom", fontsize=8)
        x += width + 0.5
    axes.text(
        5.0,
        0.7,
        "Not the first quarter of the layers on rank 0:\nthat would be pipeline parallelism.",
        ha="center",
        fontsize=9,
        style="italic",
    )
    axes.text(15.5, 10.0, "A 37-row weight (tests/test_fsdp.py)", ha="center", fontsize=10, weight="bold")
    for i, (world_size, per_rank) in enumerate(((2, (19, 18)), (4, (10, 10, 10, 7)))):
        x = 12.4 + i * 3.6
        _rows(axes, x, 8.8, per_rank, 7.0 / 37, 2.8)
        axes.text(x + 1.4, 9.05, f"{world_size} ranks", ha="center", va="bottom", fontsize=9)
    axes.text(
        15.5, 0.7, "Chunks of ceil(37 / N) rows; the last one is shorter.", ha="center", fontsize=9, style="italic"
    )
    save(fig, path)


def fsdp_step(path: Path) -> None:
    """One FSDP2 training step of DeepMLP, unit by unit, on three streams, and the gathered parameters over time."""
    sizes = _deep_mlp_sizes()
    world_size = 2
    mb = 4 / 1e6  # fp32 bytes per parameter, in MB
    shards = sizes["whole"] * mb / world_size
    # Gathering a unit allocates it whole, and FSDP2 keeps this rank's shard meanwhile (FSDPParam keeps
    # _sharded_param_data; free_unsharded_param frees only the gathered copy): each gathered unit adds its whole size.
    root_extra = sizes["root"] * mb
    block_extra = sizes["block"] * mb
    fig, (timeline, memory) = plt.subplots(
        2, 1, figsize=(10, 6.6), sharex=True, gridspec_kw={"height_ratios": [1.25, 1]}
    )
    rows = {"all-gather stream": 2, "compute stream": 1, "reduce-scatter stream": 0}
    blocks = sizes["blocks"]

    def bar(row, start, text, colour, length=1.0):
        timeline.broken_barh(
            [(start + 0.04, length - 0.08)], (rows[row] - 0.35, 0.7), facecolors=colour, edgecolor="black"
        )
        timeline.text(start + length / 2, rows[row], text, ha="center", va="center", fontsize=8)

    # forward: gather the root, then each block one ahead of its compute (implicit prefetch); free each block after
    bar("all-gather stream", 0, "root", COMMUNICATE)
    bar("compute stream", 1, "stem", COMPUTE)
    for b in range(blocks):
        bar("all-gather stream", 1 + b, f"b{b}", COMMUNICATE)
        bar("compute stream", 2 + b, f"b{b}", COMPUTE)
    bar("compute stream", 2 + blocks, "head", COMPUTE)
    backward = 3 + blocks
    # backward: head first (the root stayed gathered), each block gathered again one ahead, reduce-scattered after
    bar("compute stream", backward, "head'", "#c6dbef")
    for i, b in enumerate(reversed(range(blocks))):
        bar("all-gather stream", backward + i, f"b{b}", COMMUNICATE)
        bar("compute stream", backward + 1 + i, f"b{b}'", "#c6dbef")
        bar("reduce-scatter stream", backward + 2 + i, f"b{b}", "#fdd0a2")
    bar("compute stream", backward + 1 + blocks, "stem'", "#c6dbef")
    bar("reduce-scatter stream", backward + 2 + blocks, "root", "#fdd0a2")
    end = backward + 3 + blocks
    bar("compute stream", end, "Adam", IDLE)
    timeline.axvline(backward, color="black", lw=1, linestyle=":")
    timeline.text(backward / 2, 2.75, "forward", ha="center", fontsize=9, weight="bold")
    timeline.text((backward + end) / 2, 2.75, "backward", ha="center", fontsize=9, weight="bold")
    timeline.set_yticks(list(rows.values()), list(rows))
    timeline.set_ylim(-0.6, 3.1)
    timeline.spines[["top", "right"]].set_visible(False)
    timeline.set_title(
        "One FSDP2 step of DeepMLP: 5 units (root = stem + head, blocks b0-b3); ' marks a backward\n"
        "Schematic: what runs where on a GPU. On gloo and 2 CPU cores nothing overlaps.",
        fontsize=10,
    )

    # memory: gathered parameters held by one rank, with blocks resharded after forward (True) or kept (False)
    def level(t, keep_blocks):
        held = shards
        if 0 <= t < backward + 2 + blocks:
            held += root_extra  # the root: gathered from the start of forward to the end of its backward
        for b in range(blocks):
            gathered_fw, freed_fw = 1 + b, 3 + b  # gathered one step ahead, freed after its forward
            back_i = blocks - 1 - b
            gathered_bw, freed_bw = backward + back_i, backward + 2 + back_i  # freed after its backward
            if keep_blocks:
                held += block_extra if gathered_fw <= t < freed_bw else 0
            else:
                held += block_extra if gathered_fw <= t < freed_fw or gathered_bw <= t < freed_bw else 0
        return held

    times = [i / 20 for i in range(-20, 20 * (end + 1) + 1)]
    memory.plot(
        times, [level(t, False) for t in times], color="#4e79a7", lw=2, label="blocks: reshard_after_forward=True"
    )
    memory.plot(
        times,
        [level(t, True) for t in times],
        color="#e15759",
        lw=1.6,
        linestyle="--",
        label="blocks: False (ZeRO-2-like), no all-gathers in backward. The root keeps its default in both.",
    )
    after_true, after_false = level(backward - 0.01, False), level(backward - 0.01, True)
    peak_true = max(level(t, False) for t in times)
    for value, text in (
        (shards, "shards only"),
        (after_true, "after forward, True"),
        (peak_true, "peak, True (root + 2 blocks)"),
        (after_false, "after forward, False"),
    ):
        memory.axhline(value, color="grey", lw=0.6, linestyle=":")
        memory.text(end + 1.05, value, f"{text}: {value:.2f} MB", va="center", fontsize=8)
    memory.axvline(backward, color="black", lw=1, linestyle=":")
    memory.set_yticks([])
    memory.set_ylim(shards - 0.6, after_false + 0.6)
    memory.set_ylabel("parameter memory, MB,\none rank (N = 2)")
    memory.set_xlabel(
        "time (schematic). Levels from DeepMLP's sizes: all shards, plus each gathered unit whole. "
        "All-gather buffers left out."
    )
    memory.set_xticks([])
    memory.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, frameon=False)
    memory.spines[["top", "right"]].set_visible(False)
    save(fig, path)


def dcp_reshard(path: Path) -> None:
    """A checkpoint written by 2 ranks, one file each, read by 4 ranks that each ask for the rows they hold."""
    fig, axes = canvas(10, 5.0, xlim=20, ylim=10)
    axes.text(3.0, 9.5, "saved by 2 ranks", ha="center", fontsize=10, weight="bold")
    axes.text(10.0, 9.5, "on disk", ha="center", fontsize=10, weight="bold")
    axes.text(17.0, 9.5, "loaded by 4 ranks", ha="center", fontsize=10, weight="bold")
    for rank in range(2):
        y = 6.8 - rank * 3.6
        box(axes, 0.8, y, 4.4, 2.4, "", "#f5f5f5")
        axes.text(3.0, y + 2.0, f"rank {rank}", ha="center", fontsize=9)
        axes.add_patch(Rectangle((1.6, y + 0.3), 2.8, 1.4, fc=RANK_COLOURS[rank], ec="black"))
        axes.text(3.0, y + 1.0, f"rows {4 * rank}-{4 * rank + 3}", ha="center", va="center", fontsize=9)
        box(axes, 8.2, y + 0.4, 3.6, 1.6, f"__{rank}_0.distcp\nrows {4 * rank}-{4 * rank + 3}", RANK_COLOURS[rank], 9)
        arrow(axes, (5.3, y + 1.2), (8.1, y + 1.2))
        axes.text(6.7, y + 1.45, "writes", ha="center", fontsize=8)
    box(axes, 7.7, 0.4, 4.6, 1.5, ".metadata: which rows\nof which tensor are in which file", "#ffffff", 8)
    for rank in range(4):
        y = 7.6 - rank * 2.3
        box(axes, 14.8, y, 4.4, 1.7, "", "#f5f5f5")
        axes.text(15.6, y + 0.85, f"rank {rank}", ha="center", va="center", fontsize=9)
        axes.add_patch(Rectangle((16.6, y + 0.35), 2.2, 1.0, fc=RANK_COLOURS[rank // 2], ec="black"))
        axes.text(17.7, y + 0.85, f"rows {2 * rank}-{2 * rank + 1}", ha="center", va="center", fontsize=9)
        file_y = 6.8 - (rank // 2) * 3.6 + 1.2
        arrow(axes, (11.9, file_y), (14.7, y + 0.85))
    axes.text(13.3, 9.0, "reads", ha="center", fontsize=8)
    axes.text(
        10.0,
        -0.3,
        "Illustrative: one weight of 8 rows. Each loading rank asks for the rows its own shard covers.",
        ha="center",
        fontsize=9,
        style="italic",
    )
    save(fig, path)


def mesh_hsdp(path: Path) -> None:
    """A 1-D mesh of 8 ranks (FSDP) beside a 2 x 4 mesh (HSDP): shard within a node, replicate across nodes."""
    fig, axes = canvas(10, 5.0, xlim=20, ylim=10)
    for title, x0, hsdp in (("1-D mesh: FSDP over all 8 ranks", 0.0, False), ("2-D mesh (2 x 4): HSDP", 10.2, True)):
        axes.text(x0 + 4.9, 9.4, title, ha="center", fontsize=10, weight="bold")
        for node in range(2):
            y = 6.5 - node * 2.3
            box(axes, x0 + 0.9, y - 0.2, 7.9, 1.9, "", "#eef4fb")
            axes.text(x0 + 0.55, y + 0.75, f"node {node}", rotation=90, ha="center", va="center", fontsize=8)
            for local in range(4):
                rank = 4 * node + local
                shard, share = (local, "1/4") if hsdp else (rank, "1/8")
                colour = RANK_COLOURS[shard]
                box(axes, x0 + 1.1 + local * 1.95, y, 1.6, 1.5, f"rank {rank}\nshard {shard}\n({share})", colour, 8)
    axes.text(
        4.9,
        3.3,
        "Every parameter is cut into 8 chunks.\nEach all-gather and reduce-scatter spans all 8 ranks,\n"
        "so it crosses the slower link between nodes.",
        ha="center",
        va="top",
        fontsize=9,
    )
    arrow(axes, (11.3, 3.75), (18.8, 3.75), style="<->")
    axes.text(15.05, 3.55, 'dim 1, "shard": all-gather and reduce-scatter in a node', ha="center", va="top", fontsize=8)
    arrow(axes, (19.3, 7.9), (19.3, 4.4), style="<->")
    axes.text(19.5, 6.15, 'dim 0,\n"replicate"', ha="left", va="center", fontsize=8)
    axes.text(
        15.05,
        2.9,
        "The same shard sits on each node. Gradients are\nreduce-scattered in the node, then all-reduced\n"
        "across nodes. Illustrative: 2 nodes x 4 GPUs.",
        ha="center",
        va="top",
        fontsize=9,
    )
    save(fig, path)


FIGURES = {
    "06_who_holds_what": (who_holds_what, None),
    "06_collectives": (collectives, None),
    "06_zero1_bins": (zero1_bins, None),
    "06_row_shards": (row_shards, None),
    "06_fsdp_step": (fsdp_step, None),
    "06_dcp_reshard": (dcp_reshard, None),
    "06_mesh_hsdp": (mesh_hsdp, None),
}
