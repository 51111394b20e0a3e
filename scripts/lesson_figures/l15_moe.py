"""Lesson 15's pictures: a mixture-of-experts layer, the dispatch of expert parallelism on 2 ranks, capacity and
dropping; and four measured plots: tokens per expert over training and tokens dropped against the capacity factor
(notebook 15), step time against the dense MLP (notebook 15), and solution 16 on loopback and on emulated links
(results/)."""

import re
from pathlib import Path

from . import draw
from .draw import COMMUNICATE, COMPUTE, IDLE, MEMORY, RANK_COLOURS, REPO, RESULTS, arrow, box, canvas, plt, save, tint

NOTEBOOK = REPO / "notebooks" / "15_mixture_of_experts.ipynb"
# The cells whose printed output the measured plots read (their ids in the committed notebook).
TRAINING_CELL, DROPPED_CELL, TIMES_CELL = "0d5530d8", "952e6c9d", "b0a17f74"
LINK_RUNS = {  # solution 16 on 2 processes, 1 epoch: the same run on three networks
    "loopback": RESULTS / "16_moe_loopback.txt",
    "1 Gbit/s": RESULTS / "16_moe_cluster_1gbit.txt",
    "100 Mbit/s": RESULTS / "16_moe_cluster_100mbit.txt",
}
EXPERT_COLOURS = ("#4e79a7", "#9ecae1", "#f28e2b", "#fdd0a2")  # experts 0, 1 (rank 0), 2, 3 (rank 1)


def printed_by_cell(cell_id: str) -> str:
    return draw.printed_by_cell(NOTEBOOK, cell_id)


def moe_layer(path: Path) -> None:
    """One token through a top-1 MoE layer: the router's softmax, the chosen expert, the gate times its output. As in
    lesson 13's pre-norm block, the router and the expert see norm(x), and only the residual adds x."""
    fig, axes = canvas(10, 4.2, xlim=20, ylim=8.4)
    axes.text(
        10, 8.1, "A mixture-of-experts layer in place of the MLP (top-1)", ha="center", fontsize=12, weight="bold"
    )
    box(axes, 0.2, 3.6, 2.2, 1.0, "token x\n(width h)", tint(RANK_COLOURS[2]), 9)
    box(axes, 3.2, 3.6, 2.6, 1.0, "router: E scores\nW_r norm(x)", "#bcbddc", 8)
    arrow(axes, (2.4, 4.1), (3.4, 4.1))
    probs = (0.15, 0.55, 0.2, 0.1)
    for index, p in enumerate(probs):
        axes.add_patch(plt.Rectangle((6.6 + index * 0.6, 3.2), 0.45, 2.6 * p, fc=EXPERT_COLOURS[index], ec="black"))
        axes.text(6.82 + index * 0.6, 2.85, f"{index}", ha="center", fontsize=8)
    axes.text(7.7, 5.4, "softmax p", ha="center", fontsize=9)
    axes.text(7.7, 1.7, "top-1: expert 1,\ngate g = p_1 = 0.55", ha="center", fontsize=8)
    arrow(axes, (5.8, 4.1), (6.5, 4.1))
    for index in range(4):
        y = 6.2 - 1.4 * index
        chosen = index == 1
        box(axes, 10.6, y, 3.0, 1.0, f"expert {index}: MLP", EXPERT_COLOURS[index] if chosen else IDLE, 9)
    arrow(axes, (9.1, 4.4), (10.6, 5.3), text="norm(x)", fontsize=8)
    box(axes, 14.4, 4.3, 2.6, 1.0, "g times\nexpert_1(norm(x))", COMPUTE, 7.5)
    arrow(axes, (13.6, 5.3), (14.4, 4.8))
    box(axes, 17.6, 4.3, 2.2, 1.0, "+ x\n(residual)", tint(RANK_COLOURS[2]), 9)
    arrow(axes, (17.0, 4.8), (17.6, 4.8))
    axes.text(
        10,
        0.5,
        "E experts hold E times the MLP's parameters. Each token runs k of them, and the others idle for it.",
        ha="center",
        fontsize=9,
    )
    save(fig, path)


def rows(axes, x: float, y: float, experts: list[int], width: float = 0.42, text: str = "") -> None:
    """A row of token blocks, coloured by the expert each goes to."""
    for index, expert in enumerate(experts):
        axes.add_patch(plt.Rectangle((x + index * width, y), width, 0.7, fc=EXPERT_COLOURS[expert], ec="black"))
    if text:
        axes.text(x + len(experts) * width / 2, y + 0.95, text, ha="center", fontsize=8)


def all_to_all(path: Path) -> None:
    """Two ranks, experts 0-1 on rank 0 and 2-3 on rank 1: sort by expert, all-to-all out, group by expert, run,
    put back, all-to-all home."""
    fig, axes = canvas(11, 5.0, xlim=22, ylim=10)
    axes.text(11, 9.6, "Expert parallelism on 2 ranks: two all-to-alls per layer", ha="center", fontsize=12,
              weight="bold")  # fmt: skip
    mine = {0: [2, 0, 3, 1, 0, 2], 1: [1, 3, 2, 2, 0]}
    sent = {rank: sorted(experts) for rank, experts in mine.items()}
    arrived = {0: [e for e in sent[0] if e < 2] + [e for e in sent[1] if e < 2]}
    arrived[1] = [e for e in sent[0] if e >= 2] + [e for e in sent[1] if e >= 2]
    grouped = {rank: sorted(experts) for rank, experts in arrived.items()}
    columns = [
        (0.8, "this rank's tokens\n(colour: their expert)", mine),
        (4.6, "sorted by expert", sent),
        (9.6, "arrived: by source rank", arrived),
        (14.2, "grouped by expert:\neach expert runs once", grouped),
    ]
    for rank in range(2):
        y = 6.4 - 3.6 * rank
        axes.text(0.0, y + 0.35, f"rank {rank}", fontsize=9, va="center", rotation=90)
        for x, title, content in columns:
            rows(axes, x, y, content[rank], text=title if rank == 0 else "")
        arrow(axes, (3.5, y + 0.35), (4.5, y + 0.35))
        arrow(axes, (13.0, y + 0.35), (14.1, y + 0.35))
        box(axes, 18.0, y - 0.1, 3.6, 0.9, f"experts {2 * rank}, {2 * rank + 1}", EXPERT_COLOURS[2 * rank], 9)
    for rank in range(2):
        arrow(axes, (7.2, 6.75 - 3.6 * rank), (9.5, 6.75 - 3.6 * (1 - rank)), colour="#888888")
        arrow(axes, (7.2, 6.75 - 3.6 * rank), (9.5, 6.75 - 3.6 * rank), colour="#888888")
        arrow(axes, (16.8, 6.75 - 3.6 * rank), (17.9, 6.75 - 3.6 * rank))
    box(axes, 7.3, 4.45, 2.1, 1.0, "all-to-all\n(uneven)", COMMUNICATE, 8)
    axes.text(
        11,
        1.2,
        "Before: one small all-to-all of the counts, so every rank knows how many rows it will receive. After: the\n"
        "inverse permutation, a second all-to-all with the splits swapped, and each result times its gate. "
        "Backward: the same, reversed.",
        ha="center",
        fontsize=9,
    )
    save(fig, path)


def capacity(path: Path) -> None:
    """Eight tokens over four experts at capacity factor 1 (top-1): capacity 2, the third and fourth tokens of a busy
    expert dropped, two slots of other experts left empty.
    Each box is as tall as the capacity: the dropped rows stick out above it."""
    fig, axes = canvas(9, 4.2, xlim=18, ylim=8.4)
    axes.text(9, 8.0, "Capacity: ceil(factor x T k / E) per expert, the rest dropped", ha="center", fontsize=12,
              weight="bold")  # fmt: skip
    load = {0: 4, 1: 2, 2: 1, 3: 1}  # 8 tokens, top-1, E = 4: capacity 2 at factor 1
    for expert, count in load.items():
        x = 1.5 + 4 * expert
        axes.add_patch(plt.Rectangle((x, 1.5), 2.4, 2.4, fc="white", ec="black"))  # 2 slots: the capacity
        for slot in range(count):
            dropped = slot >= 2
            axes.add_patch(
                plt.Rectangle(
                    (x + 0.2, 1.7 + slot * 1.1),
                    2.0,
                    0.9,
                    fc="white" if dropped else EXPERT_COLOURS[expert],
                    ec="#e15759" if dropped else "black",
                    hatch="//" if dropped else None,
                )
            )
        axes.text(x + 1.2, 1.0, f"expert {expert}", ha="center", fontsize=9)
    axes.plot([1.2, 17.2], [3.9, 3.9], color="#e15759", lw=2, ls="--")
    axes.text(17.3, 3.9, "capacity\n= 2", fontsize=8, va="center")
    axes.text(4.5, 6.6, "dropped: the residual carries\nthese tokens on unchanged", ha="center", fontsize=8,
              color="#e15759")  # fmt: skip
    axes.text(9, 0.2, "8 tokens, top-1, 4 experts, factor 1.0: 2 of 8 dropped, 2 slots left empty", ha="center",
              fontsize=9)  # fmt: skip
    save(fig, path)


def tokens_per_expert(path: Path) -> None:
    """Notebook 15's section 2: each expert's share of layer 1's tokens over training, without and with the loss."""
    printed = printed_by_cell(TRAINING_CELL)
    lines = re.findall(r"^weight ([\d.]+), step\s+(\d+): ([\d. ]+)$", printed, re.MULTILINE)
    runs = {}
    for weight, step, shares in lines:
        runs.setdefault(weight, []).append((int(step), [float(s) for s in shares.split()]))
    fig, panels = plt.subplots(1, len(runs), figsize=(10, 3.2), sharey=True)
    for (weight, points), ax in zip(runs.items(), panels):
        steps = [step for step, _ in points]
        for expert in range(len(points[0][1])):
            ax.plot(steps, [shares[expert] for _, shares in points], "o-", ms=3, color=EXPERT_COLOURS[expert],
                    label=f"expert {expert}")  # fmt: skip
        ax.axhline(1 / len(points[0][1]), color="grey", lw=0.8, ls=":")
        title = "no balancing loss" if float(weight) == 0 else f"balancing loss, weight {weight}"
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("training step")
    panels[0].set_ylabel("share of layer 1's tokens")
    panels[-1].legend(fontsize=7)
    fig.suptitle("Tokens per expert while the GPT learns the text (top-1, 4 experts): notebook 15", fontsize=10)
    fig.tight_layout()
    save(fig, path)


def dropped_against_capacity(path: Path) -> None:
    """Notebook 15's section 3: the share of assignments dropped at each capacity factor, for both routers."""
    printed = printed_by_cell(DROPPED_CELL)
    factors = [float(f) for f in re.search(r"capacity factor: (.+)", printed).group(1).split()]
    fig, ax = plt.subplots(figsize=(6, 3.3))
    for index, (name, values) in enumerate(re.findall(r"^(weight [\d.]+)\s*: (.+)$", printed, re.MULTILINE)):
        shares = [float(v.rstrip("%")) for v in values.split()]
        label = "router trained without the balancing loss" if name == "weight 0.0" else f"trained with {name}"
        ax.plot(factors, shares, "o-", color=RANK_COLOURS[index], label=label)
    ax.set_xlabel("capacity factor (1 = an even share)")
    ax.set_ylabel("assignments dropped (%)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.set_title("One batch of 1,024 tokens through layer 1's router: notebook 15", fontsize=10)
    fig.tight_layout()
    save(fig, path)


def step_time_and_links(path: Path) -> None:
    """Left: notebook 15's step times (dense, MoE). Right: solution 16's ms per step on three networks, the
    all-to-all part apart."""
    printed = printed_by_cell(TIMES_CELL)
    timed = re.findall(r"^(.+?)\s+([\d.]+) ms \| +([\d,]+) parameters, +([\d,]+) active", printed, re.MULTILINE)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10.5, 3.3), gridspec_kw={"width_ratios": [1, 1.1]})
    for index, (name, ms, parameters, active) in enumerate(timed):
        left.barh(index, float(ms), color=MEMORY if name == "dense" else COMPUTE, edgecolor="black")
        thousands = int(parameters.replace(",", "")) / 1e3
        left.text(float(ms) * 1.02, index, f"{ms} ms, {thousands:.0f}k params", va="center", fontsize=7)
    left.set_yticks(range(len(timed)), [row[0] for row in timed], fontsize=8)
    left.invert_yaxis()
    left.set_xlim(0, max(float(row[1]) for row in timed) * 1.8)
    left.set_xlabel("forward + backward, one process (ms)")
    left.set_title("Step time against the dense MLP", fontsize=10)
    for index, (name, file) in enumerate(LINK_RUNS.items()):
        line = re.search(r"per step: ([\d.]+) ms, all-to-alls ([\d.]+) ms", file.read_text())
        step, exchange = float(line.group(1)), float(line.group(2))
        right.barh(
            index, exchange, color=COMMUNICATE, edgecolor="black", label="in the all-to-alls" if index == 0 else None
        )
        right.barh(index, step - exchange, left=exchange, color=COMPUTE, edgecolor="black",
                   label="the rest" if index == 0 else None)  # fmt: skip
        right.text(step * 1.02, index, f"{step} ms", va="center", fontsize=8)
    right.set_yticks(range(len(LINK_RUNS)), list(LINK_RUNS), fontsize=8)
    right.invert_yaxis()
    right.set_xlabel("ms per training step, rank 0 of 2")
    right.set_xlim(0, 260)
    right.set_title("Solution 16 on loopback and between two emulated nodes", fontsize=10)
    right.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    save(fig, path)


FIGURES = {
    "15_moe_layer": (moe_layer, None),
    "15_all_to_all": (all_to_all, None),
    "15_capacity": (capacity, None),
    "15_tokens_per_expert": (tokens_per_expert, NOTEBOOK),
    "15_dropped_against_capacity": (dropped_against_capacity, NOTEBOOK),
    "15_step_time_and_links": (step_time_and_links, RESULTS / "16_moe_cluster_100mbit.txt"),
}
