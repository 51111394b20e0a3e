"""Lesson 10's pictures: where a communication hook sits in DDP's backward pass, PowerSGD's two thin matrices, what
compression saves and costs in a step, the error-feedback loop, and two measured plots (bytes and accuracy per
configuration; step time against the link's rate)."""

import json
import re
from pathlib import Path

from .draw import COMMUNICATE, COMPUTE, IDLE, MEMORY, RANK_COLOURS, RESULTS, arrow, box, canvas, plt, save

COMPRESSION_RESULTS = RESULTS / "gradient_compression.json"
CLUSTER_RESULTS = RESULTS / "cluster_network.json"
SWEEP_RESULTS = RESULTS / "compression_link_sweep.txt"
HOOK = "#fdd0a2"  # the part a hook replaces
STATE = "#dadaeb"  # what PowerSGD remembers between steps


def hook_in_ddp(path: Path) -> None:
    """Backward fills buckets from the last layer; each full bucket goes to the hook, which returns a future; DDP
    waits for all futures at the end of backward and copies their values into .grad."""
    fig, axes = canvas(10, 4.4, xlim=10, ylim=5.4)
    axes.text(0.1, 4.95, "backward:", fontsize=10, weight="bold", va="center")
    layers = ["layer 4", "layer 3", "layer 2", "layer 1"]
    for i, layer in enumerate(layers):
        box(axes, 1.4 + i * 1.5, 4.6, 1.3, 0.7, f"grads of\n{layer}", COMPUTE, 9)
    arrow(axes, (1.4, 4.45), (7.4, 4.45), text=None)
    axes.text(7.5, 4.45, "time", fontsize=9, va="center")
    # buckets: layers 4 and 3 in bucket 0, layers 2 and 1 in bucket 1
    for index, x in enumerate((1.4, 4.4)):
        box(axes, x, 3.05, 2.8, 0.75, f"bucket {index}: one flat buffer", MEMORY, 9)
        arrow(axes, (x + 0.65, 4.55), (x + 0.65, 3.85))
        arrow(axes, (x + 2.15, 4.55), (x + 2.15, 3.85))
        box(axes, x, 1.75, 2.8, 0.85, f"hook(state, bucket {index})\nstarts the communication", HOOK, 9)
        arrow(axes, (x + 1.4, 3.0), (x + 1.4, 2.65), text=None)
        axes.text(x + 1.5, 2.82, "full", fontsize=8, va="center")
        box(axes, x + 0.4, 0.55, 2.0, 0.7, f"Future {index}", "#ffffff", 9)
        arrow(axes, (x + 1.4, 1.7), (x + 1.4, 1.3))
        axes.text(x + 1.3, 1.5, "returns (ideally at once)", fontsize=8, va="center", ha="right")
    box(
        axes,
        7.6,
        0.3,
        2.3,
        1.2,
        "end of backward: wait\nfor every future, copy\nthe averaged values\ninto the .grads",
        IDLE,
        9,
    )
    arrow(axes, (3.8, 0.9), (4.75, 0.9), style="-")
    arrow(axes, (6.8, 0.9), (7.55, 0.9))
    axes.text(
        7.6,
        2.2,
        "Without a hook, DDP\nall-reduces each full\nbucket at this point.\nA hook replaces that\nall-reduce (orange).",
        fontsize=9,
        va="center",
    )
    save(fig, path)


def powersgd_factorisation(path: Path) -> None:
    """M (n x m) ~ P (n x r) Q^T (r x m), drawn to scale for LeNet's 128 x 800 layer at r = 2, and the order of one
    compressed step: two products, each followed by an all-reduce."""
    fig, axes = canvas(10, 5.0, xlim=10, ylim=5.8)
    scale = 3.6 / 800  # data units per element, so the shapes are to scale
    n, m, r = 128, 800, 2
    rank_width = max(r * scale, 0.07)  # r columns would be invisible at scale: drawn a little wider
    axes.add_patch(plt.Rectangle((0.2, 3.6), m * scale, n * scale, fc=COMPUTE, ec="black"))
    axes.text(0.2 + m * scale / 2, 3.6 + n * scale / 2, "M", ha="center", va="center", fontsize=12)
    axes.text(0.2 + m * scale / 2, 3.45, f"{n} x {m}: {n * m:,} numbers", ha="center", va="top", fontsize=9)
    axes.text(4.05, 3.6 + n * scale / 2, "~", fontsize=16, ha="center", va="center")
    axes.add_patch(plt.Rectangle((4.4, 3.6), rank_width, n * scale, fc=RANK_COLOURS[0], ec="black"))
    axes.text(4.4 + rank_width + 0.08, 3.6 + n * scale, "P", fontsize=11, va="top")
    axes.text(4.6, 3.45, f"{n} x {r}", ha="center", va="top", fontsize=9)
    axes.add_patch(
        plt.Rectangle((4.9, 3.6 + n * scale - rank_width), m * scale, rank_width, fc=RANK_COLOURS[1], ec="black")
    )
    axes.text(4.9 + m * scale / 2, 3.6 + n * scale + 0.08, "Q^T", ha="center", fontsize=11)
    axes.text(4.9 + m * scale / 2, 3.45, f"{r} x {m}", ha="center", va="top", fontsize=9)
    axes.text(
        5.0,
        5.3,
        f"LeNet's fc 1 at rank r = {r}, to scale: P and Q hold r (n + m) = {r * (n + m):,} numbers, not {n * m:,}",
        ha="center",
        fontsize=10,
    )
    steps = [  # numbered as the lesson's list of steps
        ("2. P = M Q", COMPUTE),
        ("2. all-reduce P:\nsum over ranks", COMMUNICATE),
        ("3. orthogonalise\nP's columns", COMPUTE),
        ("4. Q = M^T P", COMPUTE),
        ("4. all-reduce Q,\ndivide by N", COMMUNICATE),
        ("5. P Q^T into\nthe bucket", COMPUTE),
    ]
    for i, (text, colour) in enumerate(steps):
        x = 0.2 + i * 1.62
        box(axes, x, 1.4, 1.45, 0.95, text, colour, 8.5)
        if i:
            arrow(axes, (x - 0.2, 1.87), (x - 0.02, 1.87))
    axes.text(0.2, 2.65, "Steps 2 to 5 of one compressed step, for every matrix of a bucket at once:", fontsize=10)
    axes.text(
        0.2,
        0.65,
        "Steps 0, 1 and 6 are local: the last error is added (0), Q starts as last step's Q or random numbers drawn\n"
        "alike on every rank (1), and the new error is kept (6).\n"
        "Orange: the two messages of the matrices. Each waits for the product before it. A third message carries\n"
        "the uncompressed tensors: torch's hook sends it first, the hook by hand last.",
        fontsize=9,
        va="center",
    )
    save(fig, path)


def break_even(path: Path) -> None:
    """Illustrative time budgets of one step, plain all-reduce against PowerSGD, on a fast and on a slow link."""
    fig, axes = canvas(10, 3.9, xlim=10.5, ylim=4.9)
    powersgd = [("compute", 3.0, COMPUTE), ("C", 0.8, HOOK), ("2 alpha", 0.8, IDLE)]
    rows = [  # (label, y, [(part, length, colour)]); lengths are illustrative, not measured
        ("fast link, plain", 3.4, [("compute", 3.0, COMPUTE), ("send", 0.9, COMMUNICATE)]),
        ("fast link, PowerSGD", 2.75, [*powersgd, ("", 0.05, COMMUNICATE)]),
        ("slow link, plain", 1.55, [("compute", 3.0, COMPUTE), ("send: grows as the link slows", 4.6, COMMUNICATE)]),
        ("slow link, PowerSGD", 0.9, [*powersgd, ("", 0.25, COMMUNICATE)]),
    ]
    for label, y, parts in rows:
        axes.text(0.05, y + 0.25, label, fontsize=9, va="center")
        x = 2.0
        for part, length, colour in parts:
            axes.add_patch(plt.Rectangle((x, y), length, 0.5, fc=colour, ec="black", lw=0.8))
            if part:
                axes.text(x + length / 2, y + 0.25, part, ha="center", va="center", fontsize=8)
            x += length
    axes.plot([2.0, 2.0], [0.7, 4.1], color="black", lw=0.8)
    axes.text(
        2.0,
        4.25,
        "One step, illustrative lengths. Orange: bytes on the link. C: PowerSGD's products and\n"
        "orthogonalisations. alpha: the fixed cost of one more message (PowerSGD sends two more).",
        fontsize=9,
        va="bottom",
    )
    axes.text(
        7.2,
        3.3,
        "fast link: sending the gradients\ncosts less than C + 2 alpha.\nCompression loses.",
        fontsize=9,
        va="center",
    )
    axes.text(7.2, 1.1, "slow link: it saves more than\nit costs. Compression wins.", fontsize=9, va="center")
    save(fig, path)


def error_feedback_loop(path: Path) -> None:
    """One step of PowerSGD with error feedback: the error left by the last step is added before compressing, and
    what compression leaves out this step becomes the next error."""
    fig, axes = canvas(10, 3.8, xlim=10, ylim=4.4)
    box(axes, 0.1, 2.6, 1.6, 0.9, "this step's\ngradient g", COMPUTE, 9)
    box(axes, 2.3, 2.6, 1.6, 0.9, "M = g + e\n(e: last step's\nerror)", COMPUTE, 9)
    box(axes, 4.5, 2.6, 2.0, 0.9, "compress to rank r,\nall-reduce P and Q", COMMUNICATE, 9)
    box(axes, 7.1, 2.6, 2.7, 0.9, "M_approx = P Q^T\ninto the bucket: the\noptimizer's gradient", MEMORY, 9)
    box(axes, 4.5, 0.5, 2.0, 0.9, "e = M - M_approx\n(kept per rank)", STATE, 9)
    arrow(axes, (1.7, 3.05), (2.3, 3.05))
    arrow(axes, (3.9, 3.05), (4.5, 3.05))
    arrow(axes, (6.5, 3.05), (7.1, 3.05))
    arrow(axes, (8.45, 2.55), (6.55, 0.95))
    axes.text(7.75, 1.55, "what compression\nleft out", fontsize=8, va="center")
    arrow(axes, (4.45, 0.95), (3.1, 2.55))
    axes.text(3.05, 1.55, "added at the\nnext step", fontsize=8, va="center", ha="right")
    axes.text(
        5.0,
        4.05,
        "Error feedback: what compression leaves out is sent later, not lost",
        ha="center",
        fontsize=11,
    )
    axes.text(
        0.1,
        0.75,
        "Without error feedback, e is\nthrown away: the same part\nof the gradient is lost at\nevery step.",
        fontsize=9,
        va="center",
    )
    save(fig, path)


def where_all_reduces_start(path: Path) -> None:
    """The order in which two ranks start their all-reduces with two buckets in flight: torch's hook on gloo, whose
    later all-reduces start from callbacks (a possible order, drawn as an example), against the hook by hand."""
    fig, axes = canvas(10, 4.4, xlim=10.4, ylim=5.2)
    colours = {"U": IDLE, "P": COMMUNICATE, "Q": HOOK}

    def row(y, label, order, bad=()):
        axes.text(0.05, y + 0.25, label, fontsize=9, va="center")
        for i, name in enumerate(order):
            x = 1.3 + i * 0.62
            edge = "#c03030" if i in bad else "black"
            axes.add_patch(plt.Rectangle((x, y), 0.55, 0.5, fc=colours[name[0]], ec=edge, lw=2.2 if i in bad else 0.8))
            axes.text(x + 0.275, y + 0.25, name, ha="center", va="center", fontsize=8)

    axes.text(0.05, 4.85, "torch's powerSGD_hook on gloo: a possible order", fontsize=10, weight="bold")
    row(3.95, "rank 0", ["U0", "P0", "U1", "Q0", "P1", "Q1"], bad=(1, 2))
    row(3.3, "rank 1", ["U0", "U1", "P0", "Q0", "P1", "Q1"], bad=(1, 2))
    axes.text(
        5.2,
        3.9,
        "Each later all-reduce starts in the\ncallback of the one before. The\nsecond collectives pair P0 with U1:\n"
        "different sizes (red).",
        fontsize=8.5,
        va="center",
    )
    axes.text(0.05, 2.45, "the hook by hand: the same order on every rank", fontsize=10, weight="bold")
    row(1.55, "rank 0", ["P0", "Q0", "U0", "P1", "Q1", "U1"])
    row(0.9, "rank 1", ["P0", "Q0", "U0", "P1", "Q1", "U1"])
    axes.text(
        5.2,
        1.5,
        "All three start in the hook, which DDP\ncalls bucket after bucket in the same\norder on every rank.",
        fontsize=8.5,
        va="center",
    )
    axes.text(
        0.05,
        0.3,
        "U: the uncompressed tensors, P and Q: PowerSGD's factors; 0 and 1: the bucket. "
        "Order of starting, left to right.",
        fontsize=8.5,
    )
    save(fig, path)


LABELS = {
    "allreduce": "plain all-reduce",
    "bf16": "bf16",
    "powersgd-r1": "PowerSGD r = 1",
    "powersgd-r2": "PowerSGD r = 2",
    "powersgd-r4": "PowerSGD r = 4",
}


def bytes_and_accuracy(path: Path) -> None:
    """The benchmark's table as two panels: MiB each rank sends per step, and test accuracy after 20 epochs (mean
    and standard deviation over 3 seeds), with error feedback and without."""
    rows = {row["config"]: row for row in json.loads(COMPRESSION_RESULTS.read_text())["summary"]}
    names = list(LABELS)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.9))
    sent = [rows[name]["bytes_sent_per_step"] / 2**20 for name in names]
    left.bar(range(len(names)), sent, color=[IDLE, COMPUTE, *RANK_COLOURS[:3]], edgecolor="black")
    for i, name in enumerate(names):
        text = f"{sent[i]:.4f} MiB"
        if name != "allreduce":
            text += f"\n{rows[name]['fewer_bytes']:.1f}x fewer"
        left.text(i, sent[i] * 1.15, text, ha="center", fontsize=8)
    left.set_yscale("log")
    left.set_yticks([0.01, 0.1, 1, 10], ["0.01", "0.1", "1", "10"])
    left.minorticks_off()
    left.set_ylim(0.01, 30)
    left.set_xticks(range(len(names)), [LABELS[name].replace(" r", "\nr") for name in names], fontsize=8)
    left.set_ylabel("MiB sent per step (log scale)")
    left.set_title("Bytes per step, DeepMLP", fontsize=10)
    colours = [IDLE, COMPUTE, *RANK_COLOURS[:3]]
    for i, name in enumerate(names):
        if not name.startswith("powersgd"):  # no error feedback to switch off: one bar
            bars = [(i, name, None, 0.6)]
        else:
            bars = [(i - 0.2, name, None, 0.4), (i + 0.2, f"{name}-no-ef", "//", 0.4)]
        for x, key, hatch, width in bars:
            mean, spread = 100 * rows[key]["accuracy_mean"], 100 * rows[key]["accuracy_std"]
            right.bar(x, mean, width=width, yerr=spread, capsize=3, color=colours[i], edgecolor="black", hatch=hatch)
    right.bar(0, 0, color="white", edgecolor="black", label="with error feedback")  # legend entries only
    right.bar(0, 0, color="white", edgecolor="black", hatch="//", label="without error feedback")
    right.set_xticks(range(len(names)), [LABELS[name].replace(" r", "\nr") for name in names], fontsize=8)
    right.set_ylim(40, 112)
    right.set_yticks(range(40, 101, 10))
    right.set_ylabel("test accuracy %, 20 epochs (axis from 40)")
    right.set_title("Accuracy, mean and spread over 3 seeds", fontsize=10)
    right.legend(fontsize=8, loc="upper center", ncol=2)
    fig.tight_layout()
    save(fig, path)


SWEEP_ROW = re.compile(r"^\s*(\w+)\s+([\d.]+) \(([\d.]+)-([\d.]+)\)\s+([\d.]+) \(([\d.]+)-([\d.]+)\)\s+\S+$")


def sweep_table() -> dict[str, list[tuple[float, float, float]]]:
    """The sweep's table: ``{link: [(median, lowest, highest) of plain all-reduce, the same of PowerSGD r = 2]}``, in
    ms per step over its rounds."""
    table = {}
    for line in SWEEP_RESULTS.read_text().splitlines():
        match = SWEEP_ROW.match(line)
        if match:
            values = [float(value) for value in match.groups()[1:]]
            table[match.group(1)] = [tuple(values[:3]), tuple(values[3:])]
    return table


def step_time_against_link(path: Path) -> None:
    """ms per step against the link's rate. Left: cluster_network.json's compression part, one run per configuration
    on loopback, 1 Gbit/s and 100 Mbit/s. Right: the sweep, plain all-reduce and PowerSGD at rank 2 at 4, 3 and 2
    Gbit/s (slower to the right, as on the left), median and range over 3 rounds, loopback's medians as dashed lines.
    Two runs under different loads: two panels, not one line."""
    single = json.loads(CLUSTER_RESULTS.read_text())["compression"]
    sweep = sweep_table()
    colours = {"allreduce": "black", "powersgd-r1": RANK_COLOURS[0], "powersgd-r2": RANK_COLOURS[1]}
    colours["powersgd-r4"] = RANK_COLOURS[2]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    wheres = ["loopback", "1gbit", "100mbit"]
    for config, colour in colours.items():
        times = [next(1e3 * r["step_seconds"] for r in single[where] if r["config"] == config) for where in wheres]
        left.plot(range(3), times, marker="o", color=colour, label=LABELS[config])
    left.set_yscale("log")
    left.set_yticks([20, 50, 100, 200, 500], ["20", "50", "100", "200", "500"])
    left.minorticks_off()
    left.set_xticks(range(3), ["loopback", "1 Gbit/s", "100 Mbit/s"])
    left.set_xlabel("link between the two nodes (slower to the right)")
    left.set_ylabel("ms per step (log scale)")
    left.set_title("One run each (cluster_network.txt)", fontsize=10)
    left.legend(fontsize=8)
    rates = [link for link in sweep if link != "loopback"]
    for column, config in enumerate(("allreduce", "powersgd-r2")):
        x = [float(link.removesuffix("gbit")) for link in rates]
        medians = [sweep[link][column][0] for link in rates]
        below = [sweep[link][column][0] - sweep[link][column][1] for link in rates]
        above = [sweep[link][column][2] - sweep[link][column][0] for link in rates]
        shift = -0.04 if column == 0 else 0.04  # side by side, so the ranges do not hide each other
        right.errorbar(
            [value + shift for value in x],
            medians,
            yerr=[below, above],
            marker="o",
            capsize=3,
            color=colours[config],
            label=f"{LABELS[config]}: median, lowest-highest",
        )
        right.axhline(sweep["loopback"][column][0], color=colours[config], lw=0.8, linestyle="--")
    right.text(4.55, sweep["loopback"][0][0] + 0.8, "loopback, plain (median)", fontsize=8)
    right.text(4.55, sweep["loopback"][1][0] + 0.8, "loopback, PowerSGD (median)", fontsize=8)
    right.set_xticks([4, 3, 2], ["4 Gbit/s", "3 Gbit/s", "2 Gbit/s"])
    right.set_xlim(4.6, 1.7)  # reversed: slower to the right, as in the left panel
    right.set_ylim(0, max(high for cells in sweep.values() for _, _, high in cells) + 6)
    right.set_xlabel("link between the two nodes (slower to the right)")
    right.set_ylabel("ms per step")
    right.set_title("The sweep: 3 rounds each (compression_link_sweep.txt)", fontsize=10)
    right.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    save(fig, path)


FIGURES = {
    "10_hook_in_ddp": (hook_in_ddp, None),
    "10_powersgd_factorisation": (powersgd_factorisation, None),
    "10_break_even": (break_even, None),
    "10_error_feedback_loop": (error_feedback_loop, None),
    "10_bytes_and_accuracy": (bytes_and_accuracy, COMPRESSION_RESULTS),
    "10_where_all_reduces_start": (where_all_reduces_start, None),
    "10_step_time_against_link": (step_time_against_link, SWEEP_RESULTS),
}
