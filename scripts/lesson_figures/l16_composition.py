"""Lesson 16's pictures: the mesh and the order in which the functions apply it; the zig-zag positions of context
parallelism on 2 ranks; and four measured plots: the N-D
runs' losses against the 1-D FSDP control (results/), the planner's predicted against measured step time and memory,
the memory by part (results/.../planner_check.json), and the Llama 3 405B plan against the published degrees."""

import json
import re
from pathlib import Path

from common.context_parallel import shard_pieces

from . import draw
from .draw import COMMUNICATE, COMPUTE, IDLE, MEMORY, RANK_COLOURS, RESULTS, arrow, box, canvas, plt, save, tint

RUNS = {  # solution 17, 4 processes, 10 steps each: the control and three N-D meshes (scripts/provenance.py record)
    "control: 1-D FSDP over 4": RESULTS / "16_composition_control.txt",
    "dp 2 x tp 2": RESULTS / "16_composition_dp2_tp2.txt",
    "pp 2 x tp 2, 4 micro-batches": RESULTS / "16_composition_pp2_tp2.txt",
    "cp 2 x tp 2": RESULTS / "16_composition_cp2_tp2.txt",
}
CHECK = RESULTS / "planner_check.json"
PLAN_405B = RESULTS / "plan_llama3_405b_h100x16k.txt"
PARTS = ("parameters", "gradients", "optimizer", "activations")
PART_COLOURS = (RANK_COLOURS[0], RANK_COLOURS[1], RANK_COLOURS[2], MEMORY)


def mesh_order(path: Path) -> None:
    """16 ranks on a pp 2 x dp 2 x cp 2 x tp 2 mesh, and what each function leaves on rank 0: its stage, its tp
    half, its ring over cp with its zig-zag share of the positions, its dp x cp shard of that half."""
    fig, axes = canvas(11, 5.6, xlim=22, ylim=11.2)
    axes.text(11, 10.8, "A GPT on a pp 2 x dp 2 x cp 2 x tp 2 mesh: 16 ranks, four functions in order", ha="center",
              fontsize=12, weight="bold")  # fmt: skip
    for stage in range(2):
        x0 = 0.4 + stage * 5.2
        axes.text(x0 + 2.3, 9.9, f"pp stage {stage}: blocks {2 * stage}-{2 * stage + 1}", ha="center", fontsize=9)
        for row in range(4):  # dp outside cp: the cp ranks of one data rank are neighbours
            dp, cp = divmod(row, 2)
            for tp in range(2):
                rank = stage * 8 + dp * 4 + cp * 2 + tp
                label, colour = f"rank {rank}\ndp {dp} cp {cp} tp {tp}", RANK_COLOURS[rank % len(RANK_COLOURS)]
                box(axes, x0 + tp * 2.3, 8.6 - row * 1.15 - dp * 0.25, 2.1, 0.95, label, tint(colour, 0.45), 7.5)
    # Rank 0's FSDP group: the ranks of its stage and its tp index, over dp x cp flattened into one dim
    axes.add_patch(plt.Rectangle((0.25, 4.85), 2.4, 4.85, fill=False, ec="black", ls="--", lw=1.5))
    axes.text(1.45, 4.55, "rank 0's FSDP group:\nranks 0, 2, 4, 6 (dp x cp)", ha="center", va="top", fontsize=8)
    axes.text(5.4, 2.6, "tp innermost: neighbouring ranks, one node's fast links\n"
              "cp next: a ring that talks in every block\n"
              "the outer dims (dp, pp) cross nodes once they span more than one",
              ha="center", fontsize=8.5)  # fmt: skip
    steps = [
        ("1. pipeline_split", "rank 0 keeps blocks 0-1\n(half the blocks)", COMPUTE),
        ("2. apply_tensor_parallel", "linear, embedding weights cut\nin 2 over tp, norms copied", COMMUNICATE),
        (
            "3. apply_context_parallel",
            "ring attention over cp, 2 of 4 heads;\nit embeds position chunks 0 and 3 of 4",
            COMMUNICATE,
        ),
        ("4. apply_fsdp", "each DTensor cut again over dp x cp:\na quarter of its tp half", MEMORY),
    ]
    for index, (name, held, colour) in enumerate(steps):
        y = 8.6 - index * 2.1
        box(axes, 11.4, y, 4.4, 1.3, name, colour, 9)
        axes.text(16.1, y + 0.65, held, va="center", fontsize=8.5)
        if index:
            arrow(axes, (13.6, y + 2.1), (13.6, y + 1.3))
    box(axes, 11.4, 0.3, 4.4, 1.1, "then the optimizer:\nit sees the final shards", IDLE, 8.5)
    arrow(axes, (13.6, 2.3), (13.6, 1.4))
    save(fig, path)


def zigzag_positions(path: Path) -> None:
    """A causal mask of 8 positions on 2 cp ranks, each query row coloured by the rank that holds it: contiguous,
    rank 1 computes most of the scores; zig-zag (chunks c and 2N - 1 - c of 2N), each rank the same number."""
    seq, world_size = 8, 2
    fig, panels = plt.subplots(1, 2, figsize=(9, 4.6))
    for panel, layout in zip(panels, ("contiguous", "zigzag")):
        owners = {row: rank for rank in range(world_size) for piece in shard_pieces(seq, rank, world_size, layout)
                  for row in piece}  # fmt: skip
        scores = [0] * world_size
        for row in range(seq):
            for column in range(row + 1):  # causal: query ``row`` sees keys 0..row
                panel.add_patch(plt.Rectangle((column, row), 1, 1, fc=RANK_COLOURS[owners[row]], ec="white"))
                scores[owners[row]] += 1
        panel.set_xlim(0, seq)
        panel.set_ylim(seq, 0)
        panel.set_aspect("equal")
        panel.set_xticks([p + 0.5 for p in range(seq)], range(seq))
        panel.set_yticks([p + 0.5 for p in range(seq)], range(seq))
        panel.set(xlabel="key position", ylabel="query position (its row of the position table)")
        held = ", ".join(
            f"rank {rank}: "
            + " and ".join(f"{p.start}-{p.stop - 1}" for p in shard_pieces(seq, rank, world_size, layout))
            for rank in range(world_size)
        )
        panel.set_title(f"{layout}: {held}\nscores per rank {scores}", fontsize=9)
    labels = [f"cp rank {r}'s queries" for r in range(world_size)]
    draw.save_with_rank_legend(
        fig, path, labels, "8 positions on 2 cp ranks: zig-zag gives each rank an early and a late chunk"
    )


def losses_of(result: Path) -> list[float]:
    return [float(value) for value in re.findall(r"^step \d+/\d+: loss (\d+\.\d+)", result.read_text(), re.M)]


def losses(path: Path) -> None:
    """The losses per step of the control and the N-D runs, and each run's gap to the control."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    control = losses_of(next(iter(RUNS.values())))
    for index, (label, result) in enumerate(RUNS.items()):
        values = losses_of(result)
        steps = range(1, len(values) + 1)
        left.plot(steps, values, marker="o" if index == 0 else "x", ms=8 - 2 * index, label=label,
                  color=RANK_COLOURS[index])  # fmt: skip
        if index:
            gaps = [abs(a - b) for a, b in zip(values, control)]
            right.semilogy(steps, [max(gap, 1e-9) for gap in gaps], marker="x", label=label, color=RANK_COLOURS[index])
    right.set_yticks([1e-9, 1e-7, 1e-6, 1e-5], ["printed equal", "1e-7", "1e-6", "1e-5"])
    left.set(xlabel="step", ylabel="loss over the global batch (nats)", title="Losses per step, fp32, AdamW")
    left.legend(fontsize=8)
    right.set(xlabel="step", ylabel="|loss - control's loss|", title="Gap to the control (6 printed decimals)")
    right.legend(fontsize=8)
    fig.tight_layout()
    save(fig, path)


def planner_check(path: Path) -> None:
    """Predicted against measured: step time (and the prediction without the per-call overhead) and peak memory
    per configuration, the error over each pair."""
    rows = json.loads(CHECK.read_text())["rows"]
    names = [row["config"] for row in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    positions = range(len(rows))
    for axes, key, unit, scale in ((left, "seconds", "ms", 1e3), (right, "bytes", "MiB", 1 / 2**20)):
        predicted = [row[f"predicted_{key}"] * scale for row in rows]
        measured = [row[f"measured_{key}"] * scale for row in rows]
        axes.bar([p - 0.2 for p in positions], predicted, 0.4, label="predicted", color=COMPUTE, ec="black")
        axes.bar([p + 0.2 for p in positions], measured, 0.4, label="measured", color=COMMUNICATE, ec="black")
        if key == "seconds":  # the part of each prediction that the per-call overhead adds, outlined
            without = [row["predicted_seconds_without_call_overhead"] * scale for row in rows]
            axes.bar([p - 0.2 for p in positions], without, 0.4, label="predicted without the call overhead",
                     color=tint(COMPUTE, 0.5), ec="black", hatch="//")  # fmt: skip
        errors = [row["time_error" if key == "seconds" else "memory_error"] for row in rows]
        for p, error, top in zip(positions, errors, map(max, predicted, measured)):
            axes.text(p, top * 1.02, f"{error:+.0%}", ha="center", fontsize=8, color="red" * (abs(error) > 0.25)
                      or "black")  # fmt: skip
        axes.set_xticks(list(positions), names, rotation=30, fontsize=8)
        axes.set_ylabel(unit)
        axes.set_ylim(0, max(max(predicted), max(measured)) * 1.25)
        axes.legend(fontsize=8, ncols=2)
    left.set_title("Step time: predicted vs measured (red: off by over 25%)")
    right.set_title("Memory of the fullest rank: predicted vs measured")
    fig.tight_layout()
    save(fig, path)


def memory_parts(path: Path) -> None:
    """The four parts of each configuration's memory, predicted (left bar) and measured (right bar)."""
    rows = json.loads(CHECK.read_text())["rows"]
    fig, axes = plt.subplots(figsize=(11, 4.2))
    for index, row in enumerate(rows):
        for offset, side in ((-0.2, "predicted_memory"), (0.2, "measured_memory")):
            bottom = 0.0
            for part, colour in zip(PARTS, PART_COLOURS):
                value = row[side][part] / 2**20
                axes.bar(index + offset, value, 0.38, bottom=bottom, color=colour, ec="black",
                         hatch="//" if side == "measured_memory" else None,
                         label=part if index == 0 and side == "predicted_memory" else None)  # fmt: skip
                bottom += value
    axes.set_xticks(range(len(rows)), [row["config"] for row in rows], fontsize=8)
    axes.set(ylabel="MiB on the fullest rank", title="Memory by part: predicted (plain) and measured (hatched)")
    axes.set_ylim(0, 20)
    axes.legend(fontsize=8, ncols=4, loc="upper left")
    fig.tight_layout()
    save(fig, path)


def llama_plan(path: Path) -> None:
    """Llama 3 405B on 16,384 H100s: the degrees of the planner's first choice beside the published ones, and the
    predicted MFU of each beside the reported 41%."""
    text = PLAN_405B.read_text()
    first = re.search(r"^\s+1\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s.*?(\d+\.\d+)%$", text, re.M)
    published = re.search(r"^\s*\d+\s+128\s+8\s+16\s+1\s.*full.*?(\d+\.\d+)%$", text, re.M)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": (3, 2)})
    dims = ("dp", "tp", "pp", "cp")
    planner = [int(value) for value in first.groups()[:4]]
    team = [128, 8, 16, 1]
    positions = range(len(dims))
    left.bar([p - 0.2 for p in positions], planner, 0.4, label="planner's first choice", color=COMPUTE, ec="black")
    left.bar([p + 0.2 for p in positions], team, 0.4, label="Llama 3's team (Dubey et al. 2024)", color=COMMUNICATE,
             ec="black")  # fmt: skip
    for p, a, b in zip(positions, planner, team):
        left.text(p - 0.2, a * 1.1, str(a), ha="center", fontsize=8)
        left.text(p + 0.2, b * 1.1, str(b), ha="center", fontsize=8)
    left.set_yscale("log")
    left.set_xticks(list(positions), dims)
    left.set(ylabel="degree", title="Llama 3 405B, 16,384 H100s: the degrees")
    left.legend(fontsize=8)
    mfu = [float(first.group(5)), float(published.group(1)), 41.0]
    labels = ["planner's\nfirst choice", "published degrees,\nas predicted", "published,\nmeasured"]
    right.bar(range(3), mfu, color=(COMPUTE, tint(COMMUNICATE), COMMUNICATE), ec="black")
    for index, value in enumerate(mfu):
        right.text(index, value + 1, f"{value:.1f}%", ha="center", fontsize=8)
    right.set_xticks(range(3), labels, fontsize=8)
    right.set(ylabel="MFU (%)", title="Model FLOPs utilization")
    fig.tight_layout()
    save(fig, path)


FIGURES = {
    "16_mesh_order": (mesh_order, None),
    "16_zigzag_positions": (zigzag_positions, None),
    "16_losses_against_control": (losses, RESULTS / "16_composition_control.txt"),
    "16_planner_check": (planner_check, CHECK),
    "16_memory_parts": (memory_parts, CHECK),
    "16_llama3_plan": (llama_plan, PLAN_405B),
}
