"""Lesson 11's pictures: a model cut into stages, one stage's work, the schedules as timelines (replayed from their
rules by ``common.experiments.pipeline.replay``), the activations they hold, unequal stages, interleaving and zero
bubble, a pipeline with data parallelism, and two measured plots (the bubble against m, and pipelines against DDP
on a slow link)."""

import re
from pathlib import Path

from common.experiments.pipeline import replay, replay_schedule, torch_schedule_order
from common.pipeline import BACKWARD, FORWARD, measured_bubble_fraction

from . import draw
from .draw import IDLE, RANK_COLOURS, REPO, RESULTS, arrow, box, canvas, plt, save

NOTEBOOK = REPO / "notebooks" / "11_pipeline_parallelism.ipynb"
SLOW_LINK = RESULTS / "pipeline_schedules_1gbit.txt"
LOOPBACK = RESULTS / "pipeline_schedules_loopback.txt"  # read beside SLOW_LINK, its twin on loopback
FORWARD_COLOUR, BACKWARD_COLOUR, WEIGHT_COLOUR = "#9ecae1", "#3182bd", "#a1d99b"
EXAMPLE = "illustrative: equal stages, a backward twice a forward, messages free"


def printed_by_cell(cell_id: str) -> str:
    return draw.printed_by_cell(NOTEBOOK, cell_id)


def draw_timeline(axes, records: list[dict], title: str, colour_by_stage: bool = False) -> None:
    """A row per rank (rank 0 on top): grey where the rank idles over the step's span, a box per event. Forwards
    light, backwards dark, a row named by its stage; with ``colour_by_stage`` (several stages per rank) each stage
    has its colour, the kind is the label, and a row is named by its rank."""
    span = max(event["end"] for record in records for event in record["events"])
    for record in records:
        row = record["rank"]
        axes.broken_barh([(0, span)], (row - 0.4, 0.8), facecolors=IDLE, edgecolor="none")
        for event in record["events"]:
            start, width = event["start"], event["end"] - event["start"]
            if colour_by_stage:
                colour = RANK_COLOURS[event["stage"]]
                label = f"{event['kind']}{event['microbatch']}"
                text_colour = "white" if event["kind"] != FORWARD else "black"
                hatch = "//" if event["kind"] == "W" else None
            else:
                colour = {FORWARD: FORWARD_COLOUR, BACKWARD: BACKWARD_COLOUR}[event["kind"]]
                label, text_colour, hatch = f"{event['kind']}{event['microbatch']}", "black", None
                if event["kind"] == BACKWARD:
                    text_colour = "white"
            axes.broken_barh(
                [(start, width)], (row - 0.4, 0.8), facecolors=colour, edgecolor="black", lw=0.8, hatch=hatch
            )
            axes.text(start + width / 2, row, label, ha="center", va="center", fontsize=8, color=text_colour)
    row_name = "rank" if colour_by_stage else "stage"
    axes.set_yticks(range(len(records)), [f"{row_name} {r['rank']}" for r in records], fontsize=9)
    axes.set_ylim(len(records) - 0.5, -0.5)
    axes.set_xlim(0, span)
    axes.set_xticks([])
    axes.set_title(f"{title}: bubble {measured_bubble_fraction(records):.2f} of the step", fontsize=10, loc="left")
    for side in ("top", "right", "left"):
        axes.spines[side].set_visible(False)


def stages_and_messages(path: Path) -> None:
    """Three stages on three ranks; an activation forward and a gradient back at each boundary."""
    fig, axes = canvas(9.5, 3.4, xlim=10.5, ylim=3.8)
    contents = ["stem, block 0", "block 1, block 2", "block 3, head"]  # stage_bounds(6, 3) of DeepMLP's layers
    for rank, x in enumerate((1.0, 4.2, 7.4)):
        box(axes, x, 1.0, 2.2, 1.5, f"stage {rank}\n(rank {rank})\n\n{contents[rank]}", RANK_COLOURS[rank] + "55")
    axes.text(0.45, 1.75, "X", fontsize=12, ha="center", va="center", weight="bold")
    arrow(axes, (0.6, 1.95), (1.0, 1.95))
    axes.text(10.1, 1.75, "loss", fontsize=10, ha="center", va="center", weight="bold")
    arrow(axes, (9.6, 1.95), (9.85, 1.95))
    for x in (3.2, 6.4):
        arrow(axes, (x + 0.05, 2.2), (x + 0.95, 2.2), colour="#1f5f9f")
        arrow(axes, (x + 0.95, 1.3), (x + 0.05, 1.3), colour="#b03020")
        axes.text(x + 0.5, 2.45, "activation\nb x d", ha="center", va="bottom", fontsize=8, color="#1f5f9f")
        axes.text(x + 0.5, 1.05, "gradient\nb x d", ha="center", va="top", fontsize=8, color="#b03020")
    axes.text(
        5.25,
        3.55,
        "Each rank holds and computes only its own layers; only the boundary tensors travel",
        ha="center",
        fontsize=10,
    )
    axes.text(
        5.25, 0.2, "b: samples sent through together (a micro-batch), d: width of the boundary", ha="center", fontsize=8
    )
    save(fig, path)


def one_stage(path: Path) -> None:
    """Stage r's four steps of a micro-batch's forward, and the four of its backward."""
    fig, axes = canvas(10, 3.2, xlim=11, ylim=4.4)
    axes.set_ylim(0.7, 4.4)
    rows = [
        (
            3.0,
            "forward of\nmicro-batch i",
            [
                "receive input X\nfrom stage r - 1",
                "X.requires_grad_()\nrun the layers",
                "isend output\n(detached) to r + 1",
                "keep X and output\nuntil the backward",
            ],
            "#d6e9f5",
        ),
        (
            0.9,
            "backward of\nmicro-batch i",
            [
                "receive the output's\ngradient from r + 1",
                "autograd.backward:\nadds into .grad",
                "isend X.grad\nto stage r - 1",
                "drop X and output:\nactivations freed",
            ],
            "#c6dbef",
        ),
    ]
    for y, title, steps, colour in rows:
        axes.text(0.65, y + 0.45, title, ha="center", va="center", fontsize=9, weight="bold")
        for k, text in enumerate(steps):
            x = 1.5 + k * 2.4
            box(axes, x, y, 2.0, 0.9, text, colour, fontsize=8)
            if k < 3:
                arrow(axes, (x + 2.02, y + 0.45), (x + 2.38, y + 0.45))
    axes.text(
        6.3,
        2.4,
        "... later, when the schedule reaches this micro-batch's backward ...",
        ha="center",
        va="center",
        fontsize=9,
        color="#555555",
        style="italic",
    )
    axes.text(5.5, 4.2, "Stage r, one micro-batch: receives block, sends return at once", ha="center", fontsize=10)
    save(fig, path)


def schedules(path: Path) -> None:
    """Naive, GPipe and 1F1B on 4 equal stages and one batch, split into 4 micro-batches for the last two; replayed
    from their rules on one time axis: naive's one micro-batch is the whole batch, 4 times theirs."""
    runs = [("naive", 1, "naive: the whole batch at once"), ("gpipe", 4, "GPipe, m = 4"), ("1f1b", 4, "1F1B, m = 4")]
    fig, panels = plt.subplots(3, 1, figsize=(9.5, 7.2), sharex=True)
    for axes, (schedule, m, title) in zip(panels, runs):
        seconds = {FORWARD: [4.0 / m] * 4, BACKWARD: [8.0 / m] * 4}  # a micro-batch's time shrinks with its size
        draw_timeline(axes, replay_schedule(schedule, 4, m, seconds), title)
    span = max(
        e["end"] for r in replay_schedule("naive", 4, 1, {FORWARD: [4.0] * 4, BACKWARD: [8.0] * 4}) for e in r["events"]
    )
    for axes in panels:
        axes.set_xlim(0, span)
    panels[-1].set_xlabel(f"time ({EXAMPLE}); grey: the bubble", fontsize=9)
    fig.tight_layout()
    save(fig, path)


def activations_held(path: Path) -> None:
    """Micro-batches whose backward is pending, per stage over one step: GPipe against 1F1B, 4 stages, m = 8."""
    seconds = {FORWARD: [1.0] * 4, BACKWARD: [2.0] * 4}
    fig, panels = plt.subplots(1, 2, figsize=(9.5, 3.6), sharey=True)
    for axes, (schedule, title) in zip(panels, (("gpipe", "GPipe"), ("1f1b", "1F1B"))):
        for record in replay_schedule(schedule, 4, 8, seconds):
            # a micro-batch is held from the end of its forward to the end of its backward on this stage
            changes = sorted((event["end"], 1 if event["kind"] == FORWARD else -1) for event in record["events"])
            times, held, count = [0.0], [0], 0
            for time, change in changes:
                count += change
                times.append(time)
                held.append(count)
            axes.step(times, held, where="post", color=RANK_COLOURS[record["rank"]], label=f"stage {record['rank']}")
        axes.set_title(f"{title}, 4 stages, m = 8", fontsize=10)
        axes.set_xlabel("time (illustrative)", fontsize=9)
        axes.set_xticks([])
        axes.set_yticks(range(9))
        axes.grid(True, axis="y", alpha=0.3)
    panels[0].set_ylabel("micro-batches held")
    panels[1].legend(fontsize=8, loc="upper right")
    fig.suptitle("GPipe holds all m micro-batches on every stage; 1F1B at most p - r on stage r", fontsize=10)
    fig.tight_layout()
    save(fig, path)


def stage_zero_waits(records: list[dict]) -> list[tuple[float, float]]:
    """``(start, end)`` of each wait of stage 0 between two of its events."""
    events = sorted(next(r for r in records if r["rank"] == 0)["events"], key=lambda event: event["start"])
    return [(a["end"], b["start"]) for a, b in zip(events, events[1:]) if b["start"] - a["end"] > 1e-9]


def unequal_stages(path: Path) -> None:
    """GPipe against 1F1B on 2 stages, m = 4, stage 0 a fifth slower than stage 1 (illustrative), each of stage 0's
    waits marked with its length: GPipe's one wait, a forward and a backward of stage 1, against 1F1B's two."""
    seconds = {FORWARD: [1.2, 1.0], BACKWARD: [2.4, 2.0]}
    fig, panels = plt.subplots(2, 1, figsize=(9.5, 4.0), sharex=True)
    for axes, (schedule, title) in zip(panels, (("gpipe", "GPipe"), ("1f1b", "1F1B"))):
        records = replay_schedule(schedule, 2, 4, seconds)
        draw_timeline(axes, records, f"{title}, m = 4")
        waits = stage_zero_waits(records)
        for start, end in waits:
            axes.annotate("", xy=(end, -0.05), xytext=(start, -0.05), arrowprops={"arrowstyle": "<->", "lw": 1.0})
            label = f"waits {end - start:.1f}" if end - start > 1.5 else f"{end - start:.1f}"  # a short one: no room
            axes.text((start + end) / 2, 0.2, label, ha="center", va="center", fontsize=8)
        total = sum(end - start for start, end in waits)
        axes.text(1.0, 1.02, f"stage 0 waits {total:.1f} in all", transform=axes.transAxes, ha="right", fontsize=9)
    span = max(e["end"] for r in replay_schedule("gpipe", 2, 4, seconds) for e in r["events"])
    for axes in panels:
        axes.set_xlim(0, span)
    panels[-1].set_xlabel(
        "time (illustrative units: stage 0's F 1.2 and B 2.4, stage 1's F 1.0 and B 2.0, messages free);"
        " grey: the bubble",
        fontsize=9,
    )
    fig.tight_layout()
    save(fig, path)


def bubble_against_m(path: Path) -> None:
    """The notebook's measured bubble of GPipe and 1F1B, and the formula, against m (2 stages)."""
    rows = [line.split() for line in printed_by_cell("a5ada8e0").splitlines() if re.match(r"\s*\d+\s+\d+\s", line)]
    m = [int(row[0]) for row in rows]
    fig, axes = plt.subplots(figsize=(7, 3.8))
    axes.plot(m, [float(row[2]) for row in rows], "k--", label="formula (p - 1) / (m + p - 1)")
    axes.plot(m, [float(row[3]) for row in rows], "o-", color=RANK_COLOURS[0], label="GPipe, measured")
    axes.plot(m, [float(row[4]) for row in rows], "s-", color=RANK_COLOURS[1], label="1F1B, measured")
    axes.set_xscale("log")
    axes.set_xticks(m, [str(value) for value in m])
    axes.set_ylim(0, 0.6)
    axes.set_xlabel("micro-batches m (the batch of 512 split into m)")
    axes.set_ylabel("bubble: idle share of the step")
    axes.set_title("DeepMLP in 2 stages, 2 CPU processes (notebook 11, loaded machine)", fontsize=10)
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    save(fig, path)


def interleaved_and_zero_bubble(path: Path) -> None:
    """1F1B, interleaved 1F1B and ZBV zero bubble on 2 ranks, m = 4, each rank's work the same, replayed from the
    schedules' orders (torch's for the last two). Colour: the stage; hatched: W, a weight gradient."""
    fig, panels = plt.subplots(3, 1, figsize=(9.5, 6.4), sharex=True)
    one = replay_schedule("1f1b", 2, 4, {FORWARD: [2.0, 2.0], BACKWARD: [4.0, 4.0]})
    for record in one:
        for event in record["events"]:
            event["stage"] = record["rank"]
    interleaved = replay(torch_schedule_order("Interleaved1F1B", 2, 4), {FORWARD: [1.0] * 4, BACKWARD: [2.0] * 4})
    zbv = replay(torch_schedule_order("ZBVZeroBubble", 2, 4), {FORWARD: [1.0] * 4, "I": [1.0] * 4, "W": [1.0] * 4})
    titles = [
        "1F1B: one stage per rank",
        "interleaved 1F1B: stages 0, 2 on rank 0 and 1, 3 on rank 1",
        "ZBV zero bubble: stages 0, 3 on rank 0 and 1, 2 on rank 1; I, then W later",
    ]
    for axes, records, title in zip(panels, (one, interleaved, zbv), titles):
        draw_timeline(axes, records, title, colour_by_stage=True)
    span = max(e["end"] for r in one for e in r["events"])
    for axes in panels:
        axes.set_xlim(0, span)
    handles = [plt.Rectangle((0, 0), 1, 1, fc=RANK_COLOURS[s], ec="black") for s in range(4)]
    handles.append(plt.Rectangle((0, 0), 1, 1, fc="white", ec="black", hatch="//"))
    labels = [f"stage {s}" for s in range(4)] + ["W: a weight gradient"]
    fig.legend(
        handles,
        labels,
        loc="lower center",
        ncol=5,
        fontsize=8,
        title_fontsize=8,
        title="label: the kind of event and the micro-batch; colour: the stage",
    )
    panels[-1].set_xlabel(
        "time (illustrative: equal stages, a rank's work the same in all three, B = 2 F, I = W = F,"
        " stage 0's I included); grey: the bubble",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    save(fig, path)


def pipeline_and_data_parallel(path: Path) -> None:
    """4 ranks: 2 pipelines of 2 stages; the two copies of each stage all-reduce in the last micro-batch's
    backward."""
    fig, axes = canvas(9, 4.2, xlim=10, ylim=5.2)
    axes.set_ylim(0.5, 5.2)
    for copy, y in enumerate((3.0, 0.8)):
        axes.text(0.7, y + 0.55, f"pipeline {copy}\nhalf the batch:\nm micro-batches", ha="center", fontsize=8)
        for stage, x in enumerate((1.8, 6.2)):
            rank = 2 * copy + stage
            box(axes, x, y, 2.4, 1.1, f"rank {rank}\nstage {stage}", RANK_COLOURS[stage] + "55", fontsize=9)
        arrow(axes, (4.25, y + 0.75), (6.15, y + 0.75), colour="#1f5f9f")
        arrow(axes, (6.15, y + 0.35), (4.25, y + 0.35), colour="#b03020")
        axes.text(5.2, y + 0.82, "activations", ha="center", va="bottom", fontsize=8, color="#1f5f9f")
        axes.text(5.2, y + 0.28, "gradients", ha="center", va="top", fontsize=8, color="#b03020")
    for x in (3.0, 7.4):
        arrow(axes, (x, 2.95), (x, 1.95), colour="#555555", style="<->")
        label = "all-reduce gradients\nduring the last\nmicro-batch's backward"
        axes.text(x + 0.12, 2.45, label, fontsize=8, va="center")
    axes.text(
        5.0,
        4.85,
        "Pipeline (2 stages) x data parallelism (2 copies): m = global batch / (micro-batch x 2)",
        ha="center",
        fontsize=10,
    )
    save(fig, path)


def benchmark_rows(path: Path) -> dict:
    """``{run: (ms per step, samples/s)}`` from the benchmark's table."""
    rows = {}
    for line in path.read_text().splitlines():
        match = re.match(r"(\S+(?: \S+)?)\s+(\d+)\s+([\d,]+)\s", line)
        if match and "/m=" in match.group(1) or match and match.group(1) == "ddp":
            rows[match.group(1)] = (float(match.group(2)), float(match.group(3).replace(",", "")))
    return rows


def pipeline_against_ddp_on_a_slow_link(path: Path) -> None:
    """Samples/s of the hand-written schedules, torch's interleaved one and DDP, on loopback and over 1 Gbit/s."""
    loopback, link = benchmark_rows(LOOPBACK), benchmark_rows(SLOW_LINK)
    runs = [run for run in loopback if run in link and not run.startswith("torch") or run == "ddp"]
    fig, axes = plt.subplots(figsize=(9, 4.2))
    positions = range(len(runs))
    axes.bar([p - 0.2 for p in positions], [loopback[r][1] for r in runs], 0.4, color="#bbbbbb", label="loopback")
    axes.bar([p + 0.2 for p in positions], [link[r][1] for r in runs], 0.4, color=RANK_COLOURS[0], label="1 Gbit/s")
    axes.set_xticks(list(positions), runs, rotation=30, ha="right", fontsize=8)
    axes.set_ylabel("samples/s (both processes)")
    axes.set_title("DeepMLP (8 layers) on 2 processes: pipelines against DDP, one node each", fontsize=10)
    axes.grid(True, axis="y", alpha=0.3)
    axes.legend(fontsize=8)
    fig.tight_layout()
    save(fig, path)


FIGURES = {
    "11_stages_and_messages": (stages_and_messages, None),
    "11_one_stage": (one_stage, None),
    "11_schedules": (schedules, None),
    "11_activations_held": (activations_held, None),
    "11_unequal_stages": (unequal_stages, None),
    "11_bubble_against_m": (bubble_against_m, NOTEBOOK),
    "11_pipeline_against_ddp_on_a_slow_link": (pipeline_against_ddp_on_a_slow_link, SLOW_LINK),
    "11_interleaved_and_zero_bubble": (interleaved_and_zero_bubble, None),
    "11_pipeline_and_data_parallel": (pipeline_and_data_parallel, None),
}
