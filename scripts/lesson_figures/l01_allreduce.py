"""Lesson 01's pictures: a data-parallel step, the in-place pitfall, naive against ring, the ring's steps chunk by
chunk, bytes and messages per rank, the measured allreduce time against size, and a model of when the ring wins."""

import json
import re
from pathlib import Path

from common.cli import parse_size

from .draw import COMMUNICATE, COMPUTE, IDLE, MEMORY, RANK_COLOURS, REPO, RESULTS, arrow, box, canvas, plt, save

NOTEBOOK = REPO / "notebooks" / "01_allreduce_by_hand.ipynb"
VOLUME_CELL = "c924c918"  # the notebook's volume table: N, naive rank 0 (x S), ring every rank (x S)
BANDWIDTH_RESULTS = RESULTS / "allreduce_bandwidth.txt"


def data_parallel_step(path: Path) -> None:
    """One step on 3 devices: split the batch, forward and backward on each copy, sum the gradients, same update."""
    fig, axes = canvas(9, 5.4, xlim=10, ylim=7)
    axes.text(5, 6.75, "One data-parallel step (illustrative: 3 devices)", ha="center", fontsize=11, weight="bold")
    box(axes, 2.5, 5.7, 5, 0.6, "a batch of B examples, split into 3 slices", "#ffffff", 10)
    for device, x in enumerate((0.5, 3.75, 7.0)):
        arrow(axes, (5, 5.7), (x + 1.25, 5.05))
        box(axes, x, 4.35, 2.5, 0.7, f"slice X{device}\n(about B/3 examples)", "#ffffff", 9)
        box(axes, x, 3.25, 2.5, 0.8, f"device {device}, own copy of w:\nforward and backward", COMPUTE, 9)
        arrow(axes, (x + 1.25, 4.35), (x + 1.25, 4.05))
        box(axes, x + 0.55, 2.35, 1.4, 0.55, f"gradient g{device}", "#ffffff", 9)
        arrow(axes, (x + 1.25, 3.25), (x + 1.25, 2.9))
        arrow(axes, (x + 1.25, 2.35), (x + 1.25, 1.95))
        arrow(axes, (x + 1.25, 1.35), (x + 1.25, 0.95))
        box(axes, x + 0.35, 0.35, 1.8, 0.6, "w -= lr * g / B", MEMORY, 9)
    box(axes, 0.5, 1.35, 9.0, 0.6, "allreduce: g = g0 + g1 + g2, written into every device's gradient", COMMUNICATE, 10)
    axes.text(5, -0.15, "same g and same w everywhere: the copies stay identical", ha="center", fontsize=9)
    save(fig, path)


def in_place_against_rebinding(path: Path) -> None:
    """The list handed to allreduce holds the replicas' .grad tensors: writing into them updates the replicas,
    assigning to the list only rebinds a slot."""
    fig, axes = canvas(10, 4.2, xlim=12, ylim=5)
    panels = (
        (0.2, "data[i][:] = total  (in place)", ("g0 + g1", "g0 + g1"), False),
        (6.2, "data[i] = total  (rebinds a slot)", ("g0 + g1", "g1 (partial)"), True),
    )
    for x, title, contents, rebinds in panels:
        axes.text(x + 2.8, 4.7, title, ha="center", fontsize=10, weight="bold", family="monospace")
        axes.text(x + 0.55, 3.95, "the list data", ha="center", fontsize=9)
        for slot, y in enumerate((2.9, 1.2)):
            box(axes, x + 0.1, y, 0.9, 0.7, f"data[{slot}]", "#ffffff", 9)
            fill = MEMORY if contents[slot] == "g0 + g1" else "#f4b6b6"
            box(axes, x + 3.3, y, 2.3, 0.7, contents[slot], fill, 9)
            axes.text(x + 4.45, y + 0.85, f"replica {slot}'s .grad", ha="center", fontsize=8)
            if rebinds and slot == 1:
                box(axes, x + 1.5, 0.1, 2.1, 0.6, "data[0].to(device 1):\ng0 + g1", "#ffffff", 8)
                arrow(axes, (x + 1.0, 1.4), (x + 1.6, 0.72), colour="#c03030")
                axes.plot([x + 1.0, x + 3.3], [1.55, 1.55], color="#999999", lw=1.2, linestyle=":")
                axes.text(x + 2.15, 1.72, "link lost", ha="center", fontsize=8, color="#999999")
            else:
                arrow(axes, (x + 1.0, y + 0.35), (x + 3.3, y + 0.35))
    note = "Left: both replicas take the same step.  Right: replica 1 steps with its own partial gradient."
    axes.text(6, -0.35, note, ha="center", fontsize=9)
    save(fig, path)


def naive_against_ring(path: Path) -> None:
    """Who talks to whom: naive sends everything through rank 0, the ring keeps every link busy (4 ranks)."""
    fig, axes = canvas(10, 4.6, xlim=12, ylim=5.6)
    centres = {0: (3.0, 2.6), 1: (1.0, 4.2), 2: (5.0, 4.2), 3: (3.0, 0.6)}  # naive: ranks 1-3 around rank 0
    axes.text(3.0, 5.35, "naive: everything through rank 0", ha="center", fontsize=10, weight="bold")
    for rank, (x, y) in centres.items():
        box(axes, x - 0.55, y - 0.3, 1.1, 0.6, f"rank {rank}", RANK_COLOURS[rank], 9, color="white", weight="bold")
        if rank:
            cx, cy = centres[0]
            dx, dy = x - cx, y - cy
            arrow(axes, (x - 0.3 * dx, y - 0.3 * dy), (cx + 0.3 * dx, cy + 0.3 * dy), style="<->")
    axes.text(
        0.1, 2.05, "rank 0 receives N-1 tensors\nand sends N-1 back:\n(N-1)·S = 3·S each way", fontsize=9, va="top"
    )
    axes.text(3.9, 1.75, "every other rank:\nS out, waits\nfor rank 0,\nthen S in", fontsize=9, va="top")
    ring = {0: (9.4, 4.3), 1: (11.2, 2.6), 2: (9.4, 0.9), 3: (7.6, 2.6)}
    axes.text(9.4, 5.35, "ring: every rank sends right", ha="center", fontsize=10, weight="bold")
    for rank, (x, y) in ring.items():
        box(axes, x - 0.55, y - 0.3, 1.1, 0.6, f"rank {rank}", RANK_COLOURS[rank], 9, color="white", weight="bold")
        nx, ny = ring[(rank + 1) % 4]
        dx, dy = nx - x, ny - y
        arrow(axes, (x + 0.3 * dx, y + 0.3 * dy), (nx - 0.3 * dx, ny - 0.3 * dy))
    axes.text(9.4, 2.6, "every rank:\n2(N-1)/N·S\n= 1.5·S\neach way", ha="center", va="center", fontsize=9)
    axes.text(6.0, -0.25, "N = 4 ranks, a tensor of S bytes on each", ha="center", fontsize=9, style="italic")
    save(fig, path)


def _ring_states(world_size: int) -> list[tuple[str, list[list[set]], set]]:
    """What each rank holds of each chunk after each step of ``ring_all_reduce``: (title, holds[rank][chunk] as the
    set of ranks whose values are summed in it, the (rank, chunk) cells written at that step)."""
    ranks = range(world_size)
    holds = [[{rank} for _ in ranks] for rank in ranks]
    states = [("start: each rank's own tensor", [[set(c) for c in row] for row in holds], set())]
    for step in range(world_size - 1):  # reduce-scatter: rank r sends chunk r - step, the right adds it
        sent = [(rank, (rank - step) % world_size, set(holds[rank][(rank - step) % world_size])) for rank in ranks]
        written = set()
        for rank, chunk, values in sent:
            holds[(rank + 1) % world_size][chunk] |= values
            written.add(((rank + 1) % world_size, chunk))
        states.append((f"reduce-scatter, step {step}", [[set(c) for c in row] for row in holds], written))
    for step in range(world_size - 1):  # all-gather: rank r sends the complete chunk r + 1 - step, the right copies
        sent = [
            (rank, (rank + 1 - step) % world_size, set(holds[rank][(rank + 1 - step) % world_size])) for rank in ranks
        ]
        written = set()
        for rank, chunk, values in sent:
            holds[(rank + 1) % world_size][chunk] = values
            written.add(((rank + 1) % world_size, chunk))
        states.append((f"all-gather, step {step}", [[set(c) for c in row] for row in holds], written))
    return states


def ring_steps(path: Path) -> None:
    """The ring's 2(N-1) steps on 4 ranks and 4 chunks: what each rank holds of each chunk after each step."""
    world_size, cell, pitch = 4, 0.52, 2.45
    states = _ring_states(world_size)
    # canvas() keeps matplotlib's margins: a 13.2 x 7.8 inch figure gives about an inch per unit, cropped to ~10.5
    fig, axes = canvas(13.2, 7.8, xlim=10.6, ylim=6.2)
    axes.text(
        5.3,
        6.05,
        "Ring allreduce, illustrative: 4 ranks, each tensor cut into 4 chunks",
        ha="center",
        fontsize=11,
        weight="bold",
    )
    for index, (title, holds, written) in enumerate(states):
        left = 0.6 + (index % 4) * pitch
        top = 5.5 - (index // 4) * 2.8  # the panel's title line
        axes.text(left + 2 * cell, top, title, ha="center", fontsize=9, weight="bold")
        for chunk in range(world_size):
            axes.text(left + (chunk + 0.5) * cell, top - 0.3, f"chunk {chunk}", ha="center", fontsize=7)
        for rank in range(world_size):
            y = top - 0.42 - (rank + 1) * cell
            if index % 4 == 0:
                axes.text(
                    left - 0.08,
                    y + cell / 2,
                    f"rank {rank}",
                    ha="right",
                    va="center",
                    fontsize=8,
                    color=RANK_COLOURS[rank],
                    weight="bold",
                )
            for chunk in range(world_size):
                values = holds[rank][chunk]
                complete = len(values) == world_size
                fill = MEMORY if complete else ("#ffffff" if len(values) == 1 else COMMUNICATE)
                edge, width = ("black", 2.2) if (rank, chunk) in written else ("#888888", 0.6)
                axes.add_patch(plt.Rectangle((left + chunk * cell, y), cell, cell, fc=fill, ec=edge, lw=width))
                text = "sum" if complete else "+".join(str(value) for value in sorted(values))
                axes.text(left + (chunk + 0.5) * cell, y + cell / 2, text, ha="center", va="center", fontsize=8)
    left, top = 0.6 + 3 * pitch, 2.45
    notes = [
        (MEMORY, 0.6, "sum: the complete sum of\nthis chunk over all 4 ranks"),
        (COMMUNICATE, 0.6, "a partial sum: 0+3 is rank 0's\nand rank 3's values added"),
        ("#ffffff", 0.6, "this rank's own values only"),
        ("#ffffff", 2.2, "written at this step, received\nfrom the rank above\n(rank 0 receives from rank 3)"),
    ]
    for row, (colour, width, note) in enumerate(notes):
        y = top - row * 0.58
        edge = "black" if width > 1 else "#888888"
        axes.add_patch(plt.Rectangle((left - 0.15, y - 0.15), 0.3, 0.3, fc=colour, ec=edge, lw=width))
        axes.text(left + 0.25, y, note, va="center", fontsize=8)
    save(fig, path)


def _volume_table() -> list[tuple[int, float, float]]:
    """The notebook's printed rows: (N, naive rank 0's bytes in units of S, the ring's per rank)."""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    (cell,) = [cell for cell in cells if cell.get("id") == VOLUME_CELL]
    text = "".join("".join(output.get("text", "")) for output in cell["outputs"])
    rows = [line.split() for line in text.splitlines()[1:] if line.strip()]
    return [(int(n), float(naive), float(ring)) for n, naive, ring in rows]


def bytes_and_messages_per_rank(path: Path) -> None:
    """Against N: the bytes each rank sends (the notebook's table) and the messages each rank posts (counted)."""
    rows = _volume_table()
    ranks = [n for n, _, _ in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.9))
    # The table's naive column is rank 0's traffic both ways, 2(N-1)·S: it sends half of it, (N-1)·S. The ring's
    # column is what each rank sends, 2(N-1)/N·S; each receives as much again.
    naive_sent = [naive / 2 for _, naive, _ in rows]
    left.plot(ranks, naive_sent, marker="o", color=RANK_COLOURS[0], label="naive, rank 0")
    left.plot(ranks, [1 for _ in ranks], marker="o", color=RANK_COLOURS[0], linestyle=":", label="naive, other ranks")
    left.plot(ranks, [ring for _, _, ring in rows], marker="s", color=RANK_COLOURS[1], label="ring, every rank")
    for n, sent, (_, _, ring) in zip(ranks, naive_sent, rows):
        if sent != ring:  # at 2 ranks both send 1·S: one label
            left.annotate(f"{sent:g}", (n, sent), textcoords="offset points", xytext=(-8, 6), ha="center", fontsize=8)
        left.annotate(f"{ring:.3f}", (n, ring), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xticks(ranks, [str(n) for n in ranks])
    left.set_ylim(0.7, 150)
    left.set_xlabel("ranks N")
    left.set_ylabel("bytes sent per allreduce (x S);\neach rank receives as many")
    left.set_title("Bytes: naive's rank 0 sends (N-1)·S,\na ring rank 2(N-1)/N·S, under 2·S", fontsize=10)
    left.legend(fontsize=8, loc="upper left")
    # Messages posted (sends + receives), by the formulas that the tests count at 2, 3 and 4 ranks, and the steps
    # that must finish one after another: naive's rank 0 receives N-1 times, then sends N-1 times; the ring takes
    # 2(N-1) exchange steps, each a send and a receive posted together.
    posted = [4 * (n - 1) for n in ranks]
    right.plot(ranks, posted, marker="s", color=RANK_COLOURS[1], label="ring rank: posted, 4(N-1)")
    right.plot(
        ranks,
        [2 * (n - 1) for n in ranks],
        marker="o",
        color="black",
        label="both, one after another: 2(N-1)\n(naive rank 0: also its posted count)",
    )
    right.plot(ranks, [2 for _ in ranks], marker="o", color=RANK_COLOURS[0], linestyle=":", label="naive, other ranks")
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xticks(ranks, [str(n) for n in ranks])
    right.set_xlabel("ranks N")
    right.set_ylabel("messages per allreduce")
    right.set_title("Messages: a ring rank posts 4(N-1),\nbut only 2(N-1) steps follow one another", fontsize=10)
    right.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    save(fig, path)


def _table_4(text: str) -> dict[str, dict[int, float]]:
    """Table 4 of the benchmark's output: {series: {bytes: ms}}, best rounds and predictions."""
    series = {name: {} for name in ("naive", "naive predicted", "ring", "ring predicted", "dist.all_reduce")}
    for line in text.split("4. allreduce", 1)[1].splitlines()[2:]:
        words = line.split()
        if not words:
            continue
        numbers = [float(word) for word in words[1:] if not word.startswith("(")]  # best rounds, not (medians)
        size = parse_size(words[0])
        for name, value in zip(series, numbers):
            series[name][size] = value
    return series


def allreduce_time_against_size(path: Path) -> None:
    """Table 4 of results/.../allreduce_bandwidth.txt: measured best rounds and predictions, 2 ranks over gloo."""
    series = _table_4(BANDWIDTH_RESULTS.read_text())
    fig, axes = plt.subplots(figsize=(8.5, 4.8))
    styles = {
        "naive": (RANK_COLOURS[0], "-", "o"),
        "naive predicted": (RANK_COLOURS[0], "--", None),
        "ring": (RANK_COLOURS[1], "-", "s"),
        "ring predicted": (RANK_COLOURS[1], "--", None),
        "dist.all_reduce": (RANK_COLOURS[2], "-", "^"),
    }
    for name, (colour, line, marker) in styles.items():
        sizes = sorted(series[name])
        label = name + (" (from tables 2 and 3)" if "predicted" in name else ", measured best round")
        axes.plot(sizes, [series[name][s] for s in sizes], color=colour, linestyle=line, marker=marker, label=label)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    sizes = sorted(series["naive"])
    names = {4: "4", 4 << 10: "4K", 64 << 10: "64K", 1 << 20: "1M", 4 << 20: "4M", 16 << 20: "16M", 64 << 20: "64M"}
    axes.set_xticks(sizes, [names.get(size, str(size)) for size in sizes])
    axes.set_xlabel("allreduce size in bytes (K = KiB, M = MiB), float32 tensors")
    axes.set_ylabel("time (ms), log scale")
    axes.axvspan(sizes[0] / 1.5, 64 * 1024 * 1.5, color=IDLE, alpha=0.5, lw=0)
    axes.text(
        512,
        0.75,
        "from 4 bytes to 64K, at most 2.1x the time:\na fixed cost per message dominates",
        fontsize=8,
        ha="center",
    )
    axes.set_title("Allreduce time against size: 2 processes, gloo, 2-core CPU (allreduce_bandwidth.txt)", fontsize=10)
    axes.legend(fontsize=8, loc="upper left")
    save(fig, path)


def _fits(text: str) -> dict[str, tuple[float, float]]:
    """The benchmark's two fits t = a + n / B: {"one-way" or "exchange": (a in seconds, B in bytes per second)}."""
    found = re.findall(r"(one-way|exchange): a = ([\d.]+) ms per message, B = ([\d.]+) GB/s", text)
    return {name: (float(a) / 1e3, float(bandwidth) * 1e9) for name, a, bandwidth in found}


def model_time(algorithm: str, world_size: int, size: float, fits: dict) -> float:
    """Seconds the model predicts: 2(N-1) messages one after another, of S (naive, the one-way fit) or of S/N (the
    ring, the exchange fit). Additions and fresh buffers are left out."""
    a, bandwidth = fits["one-way"] if algorithm == "naive" else fits["exchange"]
    message = size if algorithm == "naive" else size / world_size
    return 2 * (world_size - 1) * (a + message / bandwidth)


def ring_against_naive_model(path: Path) -> None:
    """The model of lesson 01's "When the ring wins": time against size for 4, 8 and 64 ranks, from the fits."""
    fits = _fits(BANDWIDTH_RESULTS.read_text())
    sizes = [2.0**power for power in range(2, 29)]
    fig, axes = plt.subplots(figsize=(8.5, 4.8))
    for colour, world_size in zip(RANK_COLOURS[:3], (4, 8, 64)):
        for algorithm, line in (("naive", "-"), ("ring", "--")):
            times = [model_time(algorithm, world_size, size, fits) * 1e3 for size in sizes]
            axes.plot(sizes, times, color=colour, linestyle=line, label=f"{algorithm}, N = {world_size}")
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    ticks = [4, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20]
    axes.set_xticks(ticks, ["4", "4K", "64K", "1M", "16M", "256M"])
    axes.set_xlabel("allreduce size S in bytes (K = KiB, M = MiB)")
    axes.set_ylabel("predicted time (ms), log scale")
    axes.axvspan(40 << 10, 96 << 10, color=IDLE, alpha=0.6, lw=0)
    axes.text(62 << 10, 400, "each pair of lines\ncrosses at about\n45-90 KiB", fontsize=8, ha="center")
    axes.set_title(
        "A model, not a measurement: 2(N-1) messages in a row, each a + bytes / B\n"
        "(naive: one-way fit, messages of S; ring: exchange fit, messages of S/N; allreduce_bandwidth.txt)",
        fontsize=10,
    )
    axes.legend(fontsize=8, loc="upper left", ncol=3)
    save(fig, path)


FIGURES = {
    "01_data_parallel_step": (data_parallel_step, None),
    "01_in_place_against_rebinding": (in_place_against_rebinding, None),
    "01_naive_against_ring": (naive_against_ring, None),
    "01_ring_steps": (ring_steps, None),
    "01_bytes_and_messages_per_rank": (bytes_and_messages_per_rank, NOTEBOOK),
    "01_allreduce_time_against_size": (allreduce_time_against_size, BANDWIDTH_RESULTS),
    "01_ring_against_naive_model": (ring_against_naive_model, BANDWIDTH_RESULTS),
}
