"""Lesson 09's pictures: which of four parts slows a step, one profiled step of two ranks from their traces, a GPU
left idle by its host, the bucket sweep on loopback and over a slow link, the alpha-beta fit with its residuals,
and weak against strong scaling."""

import json
import re
from pathlib import Path

from common.profiling import REGIONS, _clip, _interval, _is_communication, _subtract, _union, load_trace

from .draw import COMMUNICATE, COMPUTE, IDLE, MEMORY, RANK_COLOURS, REPO, RESULTS, arrow, box, canvas, plt, save

CPU_TRACES = RESULTS / "traces_mlp_1mib"  # solutions/06_profiling.py --model mlp --bucket-cap-mb 1, 2 ranks, gloo
GPU_TRACE = REPO / "results" / "nvidia-h200" / "traces" / "rank0.json"  # one process, SimpleCNN, NCCL
NOTEBOOK = REPO / "notebooks" / "09_profiling_and_scaling.ipynb"
SWEEP_CELL = "f9d77951"  # the bucket sweep on loopback: cap, buckets, all-reduces, step, communication, exposed
CLUSTER = RESULTS / "cluster_network.json"  # the same sweep and an all-reduce fit over an emulated 1 Gbit/s link
RESIDUALS = RESULTS / "alpha_beta_residuals.txt"  # the loopback fit, size by size
RESIDUALS_RUN2 = RESULTS / "alpha_beta_residuals_run2.txt"  # the same command, minutes later
SCALING = RESULTS / "ddp_scaling.txt"  # weak and strong scaling at 1 and 2 processes on the 2-core machine
H100_SUMMARY = REPO / "results" / "nvidia-h100-80gb-hbm3" / "summary.md"  # weak scaling on 1-8 CPU cores
REGION_COLOURS = {"data": "#c7b8e0", "forward": "#9ecae1", "backward": "#6baed6", "optimizer": "#a1d99b"}
BUSY = "#08519c"  # an op or a kernel computing: darker than every region, so it never reads as one
EXPOSED = "#d62728"


def four_reasons(path: Path) -> None:
    """The trace's step split four ways; the largest part names the bottleneck and its fix. Memory apart."""
    fig, axes = canvas(10, 5.6, xlim=12, ylim=7)
    box(
        axes, 3.2, 5.9, 5.6, 0.8, "one profiled step, split into four parts:\nwhich part is the largest?", "#ffffff", 10
    )
    parts = [
        ("data-bound", "time in next(loader)\nand the copy", "worker processes,\npinned memory,\nprefetch (section 3)"),
        (
            "communication-bound",
            "all-reduce time that\nbackward did not hide",
            "a bigger batch per device,\nbucket size (section 4),\ncompression (lesson 10)",
        ),
        (
            "overhead-bound",
            "device idle between ops:\nlaunches, Python",
            "a bigger batch per device,\ntorch.compile,\nCUDA graphs",
        ),
        (
            "compute-bound",
            "ops or kernels busy\nmost of the step",
            "mixed precision (lesson 05),\nfaster kernels,\nthen read MFU (section 6)",
        ),
    ]
    colours = ["#c7b8e0", COMMUNICATE, IDLE, COMPUTE]
    for index, ((name, seen, fix), colour) in enumerate(zip(parts, colours)):
        x = 0.08 + index * 2.98
        arrow(axes, (6.0, 5.9), (x + 1.42, 4.95))
        box(axes, x, 4.25, 2.84, 0.7, name, colour, 10, weight="bold")
        axes.text(x + 1.42, 4.05, seen, ha="center", va="top", fontsize=8.5, style="italic")
        axes.text(x + 0.05, 2.95, "the fix:", fontsize=8, color="#555555")
        box(axes, x, 1.55, 2.84, 1.3, fix, "#ffffff", 9)
    box(axes, 0.08, 0.2, 11.78, 0.9, "", MEMORY)
    axes.text(
        6.0,
        0.65,
        "Memory is a limit, not a time: a batch or model that does not fit.\n"
        "The fix: sharding (lesson 06), accumulation (lesson 04); find where it goes with a snapshot (section 8).",
        ha="center",
        va="center",
        fontsize=9,
    )
    save(fig, path)


def _cpu_step(rank: int, step: int = 0) -> dict:
    """One profiled step of a CPU trace: its regions, the union of gloo's spans, the main thread's computation and
    the exposed part, as ``step_breakdowns`` defines them; times in ms from the step's start on the shared clock."""
    trace = load_trace(CPU_TRACES / f"rank{rank}.json")
    events = [event for event in trace["traceEvents"] if event.get("ph") == "X" and "dur" in event]
    labels = sorted(
        (event for event in events if event.get("cat") == "user_annotation" and event["name"] in REGIONS),
        key=lambda event: event["ts"],
    )
    main = labels[0]["tid"]
    regions = labels[4 * step : 4 * step + 4]
    backward = _interval(regions[2])
    main_ops = [event for event in events if event.get("cat") == "cpu_op" and event["tid"] == main]
    computing = _subtract(
        _union(_interval(op) for op in main_ops if not _is_communication(op["name"])),
        _union(_interval(op) for op in main_ops if _is_communication(op["name"])),
    )
    communicating = _union(_clip([_interval(e) for e in events if e["name"].startswith("gloo:")], *backward))
    computing_in_backward = _union(_clip(computing, *backward))
    return {
        "regions": [(event["name"], *_interval(event)) for event in regions],
        "computing": computing_in_backward,
        "communicating": communicating,
        "exposed": _subtract(communicating, computing_in_backward),
    }


def step_timeline(path: Path) -> None:
    """Both ranks' first profiled step: the main thread's regions, when it computed in backward, gloo's
    all-reduce spans, and the part of them that nothing hid."""
    steps = {rank: _cpu_step(rank) for rank in (0, 1)}
    origin = min(region[1] for step in steps.values() for region in step["regions"])
    fig, axes = plt.subplots(figsize=(10, 4.4))
    rows = []
    for rank, step in steps.items():
        top = 7.5 - 4 * rank
        for name, start, end in step["regions"]:
            axes.barh(top, (end - start) / 1e3, left=(start - origin) / 1e3, color=REGION_COLOURS[name], height=0.8)
            if (end - start) / 1e3 > 2.5:
                axes.text((start + end) / 2e3 - origin / 1e3, top, name, ha="center", va="center", fontsize=8)
        for row, key, colour in (
            (1, "computing", BUSY),
            (2, "communicating", COMMUNICATE),
            (3, "exposed", EXPOSED),
        ):
            for start, end in step[key]:
                axes.barh(top - row, (end - start) / 1e3, left=(start - origin) / 1e3, color=colour, height=0.7)
        rows += [
            (top, f"rank {rank}: regions"),
            (top - 1, "computing in backward"),
            (top - 2, "gloo all-reduces"),
            (top - 3, "exposed: nothing hid it"),
        ]
    axes.set_yticks([y for y, _ in rows], [label for _, label in rows], fontsize=8.5)
    for tick, (y, _) in zip(axes.get_yticklabels(), rows):
        tick.set_color(RANK_COLOURS[0] if y > 4 else RANK_COLOURS[1])
    axes.axhline(4.0, color="#999999", lw=0.8)
    for name, colour in REGION_COLOURS.items():
        axes.barh(0, 0, color=colour, label=f"region: {name}")
    for name, colour in (
        ("main thread computing", BUSY),
        ("gloo all-reducing (union of spans)", COMMUNICATE),
        ("exposed communication", EXPOSED),
    ):
        axes.barh(0, 0, color=colour, label=name)
    axes.legend(loc="upper left", bbox_to_anchor=(0.0, -0.17), ncol=4, fontsize=8, frameon=False)
    axes.set_xlabel("ms from the step's start (both traces share this machine's clock)")
    axes.set_title("One profiled step of DeepMLP, 1 MiB buckets, 2 ranks on gloo (first of 3 recorded)", fontsize=10)
    axes.set_ylim(0, 8.2)
    axes.grid(axis="x", alpha=0.3)
    save(fig, path)


def _nested(events: list[dict]) -> list[tuple[int, dict]]:
    """``(depth, event)`` for one thread's events, depth being how many spans enclose it, as Perfetto stacks them."""
    ends, out = [], []
    for event in sorted(events, key=lambda event: (event["ts"], -event["dur"])):
        while ends and ends[-1] <= event["ts"]:
            ends.pop()
        out.append((len(ends), event))
        ends.append(event["ts"] + event["dur"])
    return out


def trace_view(path: Path) -> None:
    """Rank 0's first profiled step as Perfetto lays it out: a row per thread, nested spans stacked under their
    parent, and the three things the lesson says to look for, numbered."""
    trace = load_trace(CPU_TRACES / "rank0.json")
    events = [event for event in trace["traceEvents"] if event.get("ph") == "X" and "dur" in event]
    (step,) = [event for event in events if event["name"] == "ProfilerStep#2"]  # the first recorded step
    start, end = step["ts"], step["ts"] + step["dur"]
    inside = [event for event in events if start <= event["ts"] < end]
    main = step["tid"]
    depths = 4  # ProfilerStep, our labels, the ops under them, the calls inside those
    fig, axes = plt.subplots(figsize=(10, 4.6))
    ms = lambda ts: (ts - start) / 1e3  # noqa: E731
    allreduce_calls = []
    for depth, event in _nested([event for event in inside if event["tid"] == main]):
        if depth >= depths:
            continue
        name, y = event["name"], depths + 1 - depth
        if name.startswith("ProfilerStep"):
            colour = "#bdbdbd"
        elif name in REGIONS:
            colour = REGION_COLOURS[name]
        elif name == "c10d::allreduce_":
            colour = "#d94801"
            allreduce_calls.append((ms(event["ts"]), y))
        elif event.get("cat") == "user_annotation":
            colour = "#fdd0a2"
        else:
            colour = "#dadaeb"
        width = max(event["dur"] / 1e3, 0.25 if name == "c10d::allreduce_" else 0.12)  # a call of a few us shows
        edge = {} if name == "c10d::allreduce_" else {"edgecolor": "white", "linewidth": 0.3}
        axes.barh(y, width, left=ms(event["ts"]), color=colour, height=0.8, zorder=3 if edge == {} else 2, **edge)
        shown = name.replace("autograd::engine::evaluate_function: ", "evaluate_function: ")
        if event["dur"] / 1e3 > 0.2 * len(shown) + 0.3:
            axes.text(ms(event["ts"]) + width / 2, y, shown, ha="center", va="center", fontsize=7.5)
        elif name in REGIONS and event["dur"] / 1e3 > 1:  # "optim." in its short bar
            axes.text(ms(event["ts"]) + width / 2, y, name[:5] + ".", ha="center", va="center", fontsize=7)
        elif event["dur"] / 1e3 > 3:
            axes.text(ms(event["ts"]) + width / 2, y, shown[:14] + "...", ha="center", va="center", fontsize=7)
    gloo_threads = sorted({event["tid"] for event in inside if event["name"].startswith("gloo:")})
    for row, tid in enumerate(gloo_threads):
        for event in inside:
            if event["tid"] == tid and event["name"].startswith("gloo:"):
                y = -0.4 - row
                axes.barh(y, event["dur"] / 1e3, left=ms(event["ts"]), color=COMMUNICATE, height=0.8)
                axes.text(
                    ms(event["ts"]) + event["dur"] / 2e3, y, "gloo:\nall_reduce", ha="center", va="center", fontsize=6.5
                )
    ticks = [(depths + 1 - depth, f"main thread, depth {depth}") for depth in range(depths)]
    ticks += [(-0.4 - row, f"gloo thread {row + 1} (pt_gloo_runloop)") for row in range(len(gloo_threads))]
    axes.set_yticks([y for y, _ in ticks], [label for _, label in ticks], fontsize=8.5)
    axes.axhline(0.5, color="#999999", lw=0.8)

    def number(text, xy, target):
        axes.annotate(
            text,
            xy=target,
            xytext=xy,
            fontsize=10,
            weight="bold",
            ha="center",
            va="center",
            bbox={"boxstyle": "circle,pad=0.25", "fc": "white", "ec": "black"},
            arrowprops={"arrowstyle": "->", "lw": 1.1},
        )

    top = depths + 1  # the ProfilerStep row
    number("1", (12.0, top + 0.95), (12.0, top + 0.4))
    number("1", (12.0, top + 0.95), (20.0, top - 0.6))
    number("2", (8.0, 1.0), (6.5, top - 2.4))
    number("2", (8.0, 1.0), (12.0, top - 2.4))
    for x, y in allreduce_calls:
        number("3", (27.0, 1.0), (x + 0.12, y - 0.4))
    axes.set_xlim(0, ms(end) + 0.5)
    axes.set_ylim(-0.4 - len(gloo_threads) + 0.4, top + 1.4)
    axes.set_xlabel("ms from the start of ProfilerStep#2")
    axes.set_title(
        "rank0.json, one recorded step, redrawn as Perfetto lays it out (not a screenshot)\n"
        "1: the step and our four labels    2: forward's and backward's ops    "
        "3: c10d::allreduce_, DDP enqueuing a bucket",
        fontsize=9.5,
    )
    axes.grid(axis="x", alpha=0.3)
    save(fig, path)


def gpu_idle_timeline(path: Path) -> None:
    """The H200's first profiled step: the host's labels against the GPU's kernels, and the time no kernel ran."""
    trace = load_trace(GPU_TRACE)
    events = [event for event in trace["traceEvents"] if event.get("ph") == "X" and "dur" in event]
    labels = sorted(
        (event for event in events if event.get("cat") == "user_annotation" and event["name"] in REGIONS),
        key=lambda event: event["ts"],
    )
    # As step_breakdowns: the step ends with its optimizer label, or with the last kernel that started before the
    # next step's data label, if later.
    start, next_step = labels[0]["ts"], labels[4]["ts"]
    labels = labels[:4]
    kernels = _union(_clip([_interval(e) for e in events if e.get("cat") == "kernel"], start, next_step))
    end = max([labels[-1]["ts"] + labels[-1]["dur"]] + [e for _, e in kernels])
    fig, axes = plt.subplots(figsize=(10, 2.6))
    for event in labels:
        left, width = (event["ts"] - start) / 1e3, event["dur"] / 1e3
        axes.barh(2, width, left=left, color=REGION_COLOURS[event["name"]], height=0.7)
        name = event["name"] if width > 1 else event["name"][:5] + "."  # "optim." in its short bar
        axes.text(left + width / 2, 2, name, ha="center", va="center", fontsize=8)
    axes.barh(1, (end - start) / 1e3, left=0, color=IDLE, height=0.7, label="no kernel running")
    for s, e in kernels:
        axes.barh(1, max((e - s) / 1e3, 0.02), left=(s - start) / 1e3, color="#08519c", height=0.7)
    axes.barh(1, 0, color="#08519c", label="a kernel running")
    axes.set_yticks([2, 1], ["host: the step's labels", "GPU: kernels"], fontsize=9)
    axes.set_xlabel("ms from the step's start")
    axes.set_title("One profiled step on one H200 (SimpleCNN, batch 256): the GPU waits for its host", fontsize=10)
    axes.set_ylim(0.4, 2.6)
    axes.legend(loc="upper right", bbox_to_anchor=(1.0, -0.28), ncol=2, fontsize=8, frameon=False)
    save(fig, path)


def _notebook_sweep() -> list[dict]:
    """The notebook's loopback sweep, as printed: cap, step, communication and exposed ms."""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    (cell,) = [cell for cell in cells if cell.get("id") == SWEEP_CELL]
    text = "".join("".join(output.get("text", "")) for output in cell["outputs"])
    rows = []
    for line in text.splitlines()[1:]:
        fields = [field.strip() for field in line.split("|")]
        if len(fields) == 7:
            rows.append(dict(zip(("cap", "step", "communication", "exposed"), map(float, [fields[0], *fields[3:6]]))))
    return rows


def bucket_sweep(path: Path) -> None:
    """Step, communication and exposed communication per bucket cap: loopback (the notebook) and 1 Gbit/s."""
    loopback = _notebook_sweep()
    slow = [
        {"cap": row["cap_mb"], "step": row["step_ms"], "communication": row["communication_ms"]}
        | {"exposed": row["exposed_communication_ms"]}
        for row in json.loads(CLUSTER.read_text())["buckets"]
    ]
    fig, panels = plt.subplots(1, 2, figsize=(10, 3.9), sharey=True)
    for axes, rows, title in (
        (panels[0], loopback, "loopback, 2 processes (the notebook)"),
        (panels[1], slow, "2 emulated nodes over 1 Gbit/s"),
    ):
        positions = range(len(rows))
        for offset, key, colour, label in (
            (-0.27, "step", "#bdbdbd", "step"),
            (0.0, "communication", COMMUNICATE, "communication"),
            (0.27, "exposed", "#d62728", "exposed communication"),
        ):
            values = [row[key] for row in rows]
            axes.bar([p + offset for p in positions], values, width=0.26, color=colour, label=label)
            for p, value in zip(positions, values):
                axes.text(p + offset, value + 0.8, f"{value:.1f}", ha="center", va="bottom", fontsize=7, rotation=90)
        axes.set_xticks(list(positions), [f"{row['cap']:g} MiB" for row in rows])
        axes.set_xlabel("bucket cap (6, 5, 2 and 1 buckets)")
        axes.set_title(title, fontsize=10)
        axes.grid(axis="y", alpha=0.3)
    panels[0].set_ylabel("ms per step (rank 0, mean of 3 steps)")
    panels[0].set_ylim(0, 72)
    panels[1].legend(fontsize=8, loc="lower right")
    fig.suptitle("DeepMLP's bucket sweep: what overlap hides, and what the step pays", fontsize=11)
    save(fig, path)


def _loopback_fit(path: Path) -> dict:
    """A recorded loopback fit: alpha, beta, each size's time, and LeNet's bucket (size, measured, fitted)."""
    text = path.read_text()
    alpha_ms, bandwidth = map(float, re.search(r"^\s+2\s+gloo\s+([\d.]+)\s+([\d.]+)", text, re.M).groups())
    points = [
        (int(size.replace(",", "")), float(ms))
        for size, ms in re.findall(r"^\s+([\d,]+)\s+([\d.]+)\s+[\d.]+\s+[\d.]+x$", text, re.M)
    ]
    bucket = re.search(r"([\d,]+) bytes, back to back: measured ([\d.]+) ms, fitted ([\d.]+) ms", text).groups()
    return {
        "alpha_ms": alpha_ms,
        "ms_per_byte": 1 / (bandwidth * 1e9) * 1e3,
        "points": points,
        "bucket": (int(bucket[0].replace(",", "")), float(bucket[1]), float(bucket[2])),
    }


def alpha_beta_residuals(path: Path) -> None:
    """Each measured size against the fitted line t = alpha + beta n: two loopback runs and one over 1 Gbit/s; then
    the residuals, measured / fitted, with LeNet's bucket beside them."""
    (slow,) = [fit for fit in json.loads(CLUSTER.read_text())["fit"] if fit["link"] == "1gbit"]
    fits = {}
    for run, (source, marker) in enumerate(((RESIDUALS, "o"), (RESIDUALS_RUN2, "s")), start=1):
        fit = _loopback_fit(source)
        fits[f"loopback, run {run}"] = (fit["alpha_ms"], fit["ms_per_byte"], fit["points"], marker, fit["bucket"])
    slow_points = [(n, t * 1e3) for n, t in zip(slow["sizes_bytes"], slow["seconds"])]
    fits["2 nodes over 1 Gbit/s"] = (slow["alpha_s"] * 1e3, slow["beta_s_per_byte"] * 1e3, slow_points, "^", None)
    colours = dict(zip(fits, (RANK_COLOURS[0], RANK_COLOURS[4], RANK_COLOURS[1])))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    grid = [4 * 2 ** (k / 4) for k in range(4 * 23)]
    for label, (alpha, beta, points, marker, bucket) in fits.items():
        sizes, times = zip(*points)
        colour = colours[label]
        left.plot(sizes, times, marker, color=colour, label=f"{label}: measured")
        left.plot(grid, [alpha + beta * n for n in grid], "-", color=colour, lw=1, label=f"{label}: fitted line")
        right.plot(sizes, [t / (alpha + beta * n) for n, t in points], marker + "-", color=colour, label=label)
        if bucket:
            size, measured, fitted = bucket
            right.plot([size], [measured / fitted], "*", color=colour, markersize=13, markeredgecolor="black")
    right.plot([], [], "*", color="white", markeredgecolor="black", markersize=11, label="LeNet's bucket (516,272 B)")
    left.set(xscale="log", yscale="log", xlabel="all-reduce size (bytes)", ylabel="ms (median)")
    left.set_title("t(n) = alpha + beta n, fitted on relative errors", fontsize=10)
    left.legend(fontsize=7)
    right.axhline(1.0, color="black", lw=1, linestyle="--")
    right.set(xscale="log", yscale="log", xlabel="all-reduce size (bytes)", ylabel="measured / fitted")
    right.set_yticks([0.5, 1, 2, 4, 8], ["0.5x", "1x", "2x", "4x", "8x"])
    right.minorticks_off()
    right.set_title("residuals: 1x is on the line", fontsize=10)
    right.legend(fontsize=7, loc="upper right")
    for axes in (left, right):
        axes.grid(alpha=0.3)
    save(fig, path)


def _scaling_rows() -> dict:
    """Efficiency by process count: the 2-core machine's weak and strong runs, and the H100 host's weak run."""
    text = SCALING.read_text()
    runs = {}
    for mode in ("weak", "strong"):
        block = text.split(f"{mode} scaling: ")[1].split("\n\n")[0]
        runs[f"{mode}, 2-core machine"] = [
            (int(n), float(eff))
            for n, eff in re.findall(r"^\s+(\d+)\s+gloo\s+cpu\s+[\d,]+\s+[\d.]+x\s+(\d+)%", block, re.M)
        ]
    h100 = H100_SUMMARY.read_text().split("## DDP scaling on CPU cores (gloo)")[1]
    runs["weak, 16-core H100 host, 1 thread each"] = [
        (int(n), float(eff)) for n, eff in re.findall(r"^\s+(\d+)\s+gloo\s+cpu\s+[\d,]+\s+[\d.]+x\s+(\d+)%", h100, re.M)
    ]
    return runs


def scaling_curves(path: Path) -> None:
    """Efficiency against the process count: weak and strong scaling on 2 cores, weak scaling with a core each."""
    runs = _scaling_rows()
    fig, axes = plt.subplots(figsize=(7.5, 4))
    styles = {
        "weak, 2-core machine": (RANK_COLOURS[0], "-", "o"),
        "strong, 2-core machine": (RANK_COLOURS[1], "-", "s"),
        "weak, 16-core H100 host, 1 thread each": (RANK_COLOURS[2], "--", "o"),
    }
    for label, rows in runs.items():
        colour, line, marker = styles[label]
        counts, efficiency = zip(*rows)
        axes.plot(counts, efficiency, linestyle=line, marker=marker, color=colour, label=label)
        for n, value in rows[1:]:  # every run starts at 100%
            axes.annotate(f"{value:g}%", (n, value), textcoords="offset points", xytext=(6, 4), fontsize=8)
    axes.axhline(100, color="gray", linestyle=":", label="ideal")
    axes.set_xscale("log", base=2)
    axes.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
    axes.set(xlabel="processes (gloo on CPU)", ylabel="scaling efficiency (%)", ylim=(0, 115))
    axes.set_title("Weak against strong scaling, DDP(LeNet), from the committed runs", fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="lower left")
    save(fig, path)


FIGURES = {
    "09_four_reasons": (four_reasons, None),
    "09_trace_view": (trace_view, CPU_TRACES / "rank0.json"),
    "09_step_timeline": (step_timeline, CPU_TRACES / "rank0.json"),
    "09_gpu_idle_timeline": (gpu_idle_timeline, GPU_TRACE),
    "09_bucket_sweep": (bucket_sweep, CLUSTER),
    "09_alpha_beta_residuals": (alpha_beta_residuals, RESIDUALS_RUN2),
    "09_scaling_curves": (scaling_curves, SCALING),
}
