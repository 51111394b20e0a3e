"""Lesson 02's pictures: DataParallel's forward and backward, who holds what, one process against many, the GIL's
turns, the timing window of the benchmark, and what the CPU run of the benchmark measured."""

import json
import re
from pathlib import Path

from .draw import COMMUNICATE, COMPUTE, IDLE, MEMORY, RANK_COLOURS, REPO, arrow, box, canvas, plt, save

NOTEBOOK = REPO / "notebooks" / "02_data_parallel.ipynb"
BENCHMARK_CELL = "abed07fd"  # the cell that runs solutions/08_dp_vs_ddp.py on the CPU
MACHINE_CELL = "08401c79"  # the cell that prints the machine, PyTorch and the date

GPU_X = (2.9, 5.3, 7.7, 10.1)  # the centre of each GPU's column; the left margin holds the step labels
HALF = 1.1  # half a column's width
LIGHT = "#ffffff"
ON_GPU0 = "#fde0dd"  # what only GPU 0 holds or does
COPY = RANK_COLOURS[3]  # a copy between GPUs


def _columns(axes, top, bottom):
    """Four shaded GPU columns, their names on top."""
    for gpu, x in enumerate(GPU_X):
        axes.add_patch(
            plt.Rectangle((x - HALF - 0.05, bottom), 2 * HALF + 0.1, top - bottom, fc="#f4f6fa", ec="#c8d0dc")
        )
        axes.text(x, top - 0.3, f"GPU {gpu}", ha="center", fontsize=10, weight="bold", color=RANK_COLOURS[gpu])


def _step(axes, y, number, text):
    axes.text(0.1, y, f"{number}", fontsize=12, weight="bold", va="center")
    axes.text(0.4, y, text, fontsize=8.5, va="center")


def _bus(axes, xs_from, y_from, y_bus, xs_to, y_to, colour=COPY, arrows_to=None):
    """Lines from each of ``xs_from`` down to a horizontal bus at ``y_bus`` that spans ``xs_to`` too, then arrows
    down to each of ``arrows_to`` (by default every one of ``xs_to``)."""
    for x in xs_from:
        axes.plot([x, x], [y_from, y_bus], color=colour, lw=1.4)
    every = [*xs_from, *xs_to]
    axes.plot([min(every), max(every)], [y_bus, y_bus], color=colour, lw=1.4)
    for x in xs_to if arrows_to is None else arrows_to:
        arrow(axes, (x, y_bus), (x, y_to), colour=colour)


def dp_forward(path: Path) -> None:
    """DataParallel's forward in one process: scatter, replicate, parallel_apply, gather (4 GPUs, batch of 256)."""
    fig, axes = canvas(10, 6.4, xlim=11.35, ylim=8.6)
    axes.text(5.7, 8.3, "One forward of nn.DataParallel: one Python process drives all four GPUs", ha="center")
    box(
        axes,
        GPU_X[0] - HALF,
        7.2,
        GPU_X[3] - GPU_X[0] + 2 * HALF,
        0.55,
        "X: the whole batch of 256 samples, here on GPU 0, where the lesson's script puts it",
        LIGHT,
        9,
    )
    _columns(axes, top=6.95, bottom=0.45)

    _step(axes, 5.9, 1, "scatter")
    for gpu, x in enumerate(GPU_X):
        box(axes, x - HALF, 5.6, 0.95, 0.6, f"chunk {gpu}\n{64 * gpu}-{64 * gpu + 63}", COMPUTE, 8)
        arrow(axes, (x - HALF + 0.47, 7.2), (x - HALF + 0.47, 6.22), colour="black" if gpu == 0 else COPY)
    box(axes, GPU_X[0] + 0.0, 5.6, HALF, 0.6, "the model's\nparameters", ON_GPU0, 8)

    _step(axes, 4.75, 2, "replicate")
    arrow(axes, (GPU_X[0] + 0.55, 5.6), (GPU_X[0] + 0.55, 5.02))  # replica 0 shares the original tensors
    _bus(
        axes,
        [],
        5.6,
        5.3,
        [GPU_X[0] + 0.55, *(x + 0.55 for x in GPU_X[1:])],
        5.02,
        arrows_to=[x + 0.55 for x in GPU_X[1:]],
    )
    for gpu, x in enumerate(GPU_X):
        box(axes, x + 0.0, 4.4, HALF, 0.6, f"replica {gpu}" + ("\n(no copy)" if gpu == 0 else ""), MEMORY, 8)
    axes.text(GPU_X[3] + 0.55, 5.42, "copied at\nevery forward", fontsize=8, color=COPY, ha="center", va="bottom")

    _step(axes, 3.55, 3, "parallel_apply")
    for gpu, x in enumerate(GPU_X):
        box(axes, x - HALF, 3.25, 2 * HALF, 0.6, f"thread {gpu} runs\nreplica {gpu} on chunk {gpu}", LIGHT, 8)
        arrow(axes, (x - HALF + 0.47, 5.6), (x - HALF + 0.47, 3.87))
        arrow(axes, (x + 0.55, 4.4), (x + 0.55, 3.87))

    _step(axes, 2.35, 4, "gather")
    for gpu, x in enumerate(GPU_X):
        box(axes, x - HALF, 2.15, 2 * HALF, 0.4, f"out {gpu}: 64 rows", COMPUTE, 8)
        arrow(axes, (x, 3.25), (x, 2.57))
    arrow(axes, (GPU_X[0] - 0.4, 2.15), (GPU_X[0] - 0.4, 1.57))  # out 0 is on GPU 0 already
    _bus(axes, GPU_X[1:], 2.15, 1.85, [GPU_X[0] + 0.4], 1.57)
    box(axes, GPU_X[0] - HALF, 0.95, 2 * HALF, 0.6, "out: 256 rows on GPU 0,\nthen the loss on GPU 0", ON_GPU0, 8)
    axes.text(GPU_X[1] - HALF + 0.1, 1.4, "illustrative sizes: 4 GPUs, a batch of 256, 64 samples per GPU", fontsize=8)
    axes.text(
        GPU_X[1] - HALF + 0.1, 1.05, "red: a copy between GPUs, at every step. Black: no copy.", fontsize=8, color=COPY
    )
    axes.text(GPU_X[1] - HALF + 0.1, 0.7, "With X on the CPU, every chunk is a copy from the CPU.", fontsize=8)
    axes.set_ylim(0.35, 8.6)
    save(fig, path)


def dp_backward(path: Path) -> None:
    """loss.backward() under DataParallel: the output's gradient is scattered, every replica runs its backward, and
    the replicas' gradients are summed into the parameters on GPU 0, where the optimizer steps."""
    fig, axes = canvas(10, 5.6, xlim=11.35, ylim=7.8)
    axes.text(5.7, 7.5, "loss.backward() and optimizer.step() under nn.DataParallel", ha="center")
    _columns(axes, top=7.2, bottom=0.8)
    box(axes, GPU_X[0] - HALF, 6.05, 2 * HALF, 0.55, "the gradient of out\n(256 rows, on GPU 0)", ON_GPU0, 8)

    _step(axes, 5.0, 1, "scatter")
    arrow(axes, (GPU_X[0], 6.05), (GPU_X[0], 5.42))  # GPU 0's own rows: no copy
    _bus(axes, [], 6.05, 5.7, GPU_X, 5.42, arrows_to=GPU_X[1:])
    for gpu, x in enumerate(GPU_X):
        box(axes, x - HALF, 4.8, 2 * HALF, 0.6, f"the gradient of out {gpu}\n(64 rows)", COMPUTE, 8)

    _step(axes, 3.85, 2, "backward")
    for gpu, x in enumerate(GPU_X):
        box(axes, x - HALF, 3.55, 2 * HALF, 0.6, f"backward through\nreplica {gpu}, on GPU {gpu}", LIGHT, 8)
        arrow(axes, (x, 4.8), (x, 4.17))

    _step(axes, 2.7, 3, "sum")
    for gpu, x in enumerate(GPU_X):
        box(axes, x - HALF, 2.4, 2 * HALF, 0.6, f"replica {gpu}'s\nparameter gradients", MEMORY, 8)
        arrow(axes, (x, 3.55), (x, 3.02))
    arrow(axes, (GPU_X[0] - 0.4, 2.4), (GPU_X[0] - 0.4, 1.82))  # replica 0's gradients are on GPU 0 already
    _bus(axes, GPU_X[1:], 2.4, 2.1, [GPU_X[0] + 0.4], 1.82)
    box(axes, GPU_X[0] - HALF, 0.9, 2 * HALF, 0.9, "param.grad = their sum,\nthe whole batch's\ngradient", ON_GPU0, 8)

    _step(axes, 1.4, 4, "step")
    box(
        axes,
        GPU_X[1] - HALF,
        1.0,
        GPU_X[2] - GPU_X[1] + 2 * HALF,
        0.8,
        "optimizer.step() updates the parameters on GPU 0 only.\nThe next forward replicates them again.",
        LIGHT,
        8,
    )
    arrow(axes, (GPU_X[0] + HALF, 1.4), (GPU_X[1] - HALF, 1.4))
    axes.text(
        GPU_X[3], 1.4, "red: a copy between\nGPUs. Black: no copy.", fontsize=8, color=COPY, ha="center", va="center"
    )
    axes.set_ylim(0.7, 7.8)
    save(fig, path)


def _stack(axes, x, blocks, width=1.6):
    """Blocks stacked from y=0.6 upward, each (height, label, colour); heights are schematic, not to scale."""
    y = 0.6
    for height, label, colour in blocks:
        box(axes, x, y, width, height, label, colour, 8)
        y += height + 0.05
    return y


def memory_per_gpu(path: Path) -> None:
    """What each GPU holds during a step: DataParallel piles the model's state on GPU 0, DDP holds it evenly."""
    fig, axes = canvas(10, 4.4, xlim=14.4, ylim=5.8)
    params, grads, optim = (0.5, "parameters", MEMORY), (0.5, "gradients", MEMORY), (0.9, "optimizer\nstate", MEMORY)
    activations = (0.7, "activations\nof its chunk", COMPUTE)
    gpu0 = [params, grads, optim, activations, (0.5, "input batch\n(if put here)", ON_GPU0)]
    gpu0 += [(0.5, "gathered out\nand the loss", ON_GPU0)]
    others = [(0.5, "a copy of the\nparameters", IDLE), (0.7, "its replica's\ngradients,\nuntil summed", IDLE)]
    others += [activations]
    axes.text(3.6, 5.45, "nn.DataParallel: one process", ha="center", fontsize=10, weight="bold")
    for gpu, x in enumerate((0.2, 1.95, 3.7, 5.45)):
        top = _stack(axes, x, gpu0 if gpu == 0 else others)
        axes.text(x + 0.8, 0.3, f"GPU {gpu}", ha="center", fontsize=9, weight="bold", color=RANK_COLOURS[gpu])
        if gpu == 0:
            axes.text(x + 0.8, top + 0.05, "runs out first", ha="center", fontsize=8, color=COPY)
    axes.plot([7.2, 7.2], [0.45, 5.7], color="#999999", lw=1)
    axes.text(10.85, 5.45, "DDP: one process per GPU", ha="center", fontsize=10, weight="bold")
    ddp = [params, (0.5, "gradients, and\na copy to send", MEMORY), optim, (0.7, "activations\nof its slice", COMPUTE)]
    for gpu, x in enumerate((7.45, 9.2, 10.95, 12.7)):
        _stack(axes, x, ddp)
        axes.text(x + 0.8, 0.3, f"GPU {gpu}", ha="center", fontsize=9, weight="bold", color=RANK_COLOURS[gpu])
    axes.text(7.2, -0.1, "schematic: the heights are not to scale and were not measured", ha="center", fontsize=8)
    save(fig, path)


def one_process_against_ddp(path: Path) -> None:
    """DataParallel: one process, one GIL, GPU 0 in the middle of every copy. DDP: a process per GPU."""
    fig, axes = canvas(10, 5.0, xlim=14.4, ylim=7.6)
    axes.text(3.5, 7.25, "nn.DataParallel", ha="center", fontsize=11, weight="bold")
    box(axes, 0.2, 4.6, 6.6, 2.2, "", "#eef4fb")
    axes.text(3.5, 6.45, "one Python process, one interpreter, one GIL", ha="center", fontsize=9)
    box(axes, 2.35, 5.55, 2.3, 0.55, "the GIL: one thread\nruns Python at a time", "#ffe9c7", 8)
    xs = (0.3, 1.95, 3.6, 5.25)
    for gpu, x in enumerate(xs):
        box(axes, x, 4.8, 1.5, 0.5, f"thread {gpu}", LIGHT, 8)
        text = "GPU 0\nparameters,\ngradients,\noptimizer\nstate" if gpu == 0 else f"GPU {gpu}\na replica"
        box(axes, x, 2.3, 1.5, 1.3, text, ON_GPU0 if gpu == 0 else LIGHT, 8)
        arrow(axes, (x + 0.75, 4.8), (x + 0.75, 3.62))
        axes.plot([x + 0.75, x + 0.75], [2.28, 1.9], color=COPY, lw=1.4)
    axes.plot([xs[0] + 0.75, xs[3] + 0.75], [1.9, 1.9], color=COPY, lw=1.4)
    axes.text(
        3.5,
        1.7,
        "every step, through GPU 0: parameters out,\noutputs and gradients back",
        ha="center",
        va="top",
        fontsize=8,
        color=COPY,
    )
    axes.text(3.5, 0.3, "one machine at most", ha="center", fontsize=9)
    axes.plot([7.1, 7.1], [0.1, 7.4], color="#999999", lw=1)

    axes.text(10.75, 7.25, "DistributedDataParallel (DDP)", ha="center", fontsize=11, weight="bold")
    xs = (7.35, 9.1, 10.85, 12.6)
    for rank, x in enumerate(xs):
        box(axes, x, 4.6, 1.5, 2.2, f"process\nrank {rank}:\nits own\ninterpreter,\nmodel and\noptimizer", "#eef4fb", 8)
        text = f"GPU {rank}\nparameters,\ngradients,\noptimizer\nstate"
        box(axes, x, 2.3, 1.5, 1.3, text, LIGHT, 8)
        arrow(axes, (x + 0.75, 4.6), (x + 0.75, 3.62))
        axes.plot([x + 0.75, x + 0.75], [2.28, 1.9], color=COMMUNICATE, lw=2)
    axes.plot([xs[0] + 0.75, xs[3] + 0.75], [1.9, 1.9], color=COMMUNICATE, lw=5, solid_capstyle="round")
    axes.text(
        10.75,
        1.7,
        "gradients all-reduced, bucket by bucket, while backward runs.\n"
        "By default, rank 0's buffers broadcast at the start of a forward\n"
        "(not after one run under no_grad() or no_sync())",
        ha="center",
        va="top",
        fontsize=8,
    )
    axes.text(10.75, 0.3, "one machine or many: the same script", ha="center", fontsize=9)
    save(fig, path)


def gil_turns(path: Path) -> None:
    """Schematic timeline: DataParallel's threads take turns to run Python, so with small kernels the GPUs wait.
    DDP's processes each have an interpreter of their own and run Python at the same time."""
    fig, axes = plt.subplots(2, 1, figsize=(9.5, 4.8), sharex=True)
    python, kernel = "#ffd580", COMPUTE
    # DataParallel: thread 0 and thread 1 alternate; each Python slice queues one small kernel on its GPU.
    lanes = {"thread 0 (Python)": 3, "thread 1 (Python)": 2, "GPU 0": 1, "GPU 1": 0}
    top = axes[0]
    for i in range(6):
        owner = i % 2
        start = 0.2 + i * 1.3
        top.broken_barh([(start, 1.2)], (lanes[f"thread {owner} (Python)"] - 0.35, 0.7), fc=python, ec="black")
        top.broken_barh([(start + 1.2, 0.5)], (lanes[f"GPU {owner}"] - 0.35, 0.7), fc=kernel, ec="black")
    for gpu in (0, 1):
        top.broken_barh([(0, 8.7)], (lanes[f"GPU {gpu}"] - 0.35, 0.7), fc=IDLE, ec="none", zorder=0)
    top.set_title(
        "nn.DataParallel: two threads, one GIL. Python runs in turns, and the GPUs wait between kernels", fontsize=9
    )
    # DDP: both processes run their Python at once.
    bottom = axes[1]
    lanes_ddp = {"process 0 (Python)": 3, "process 1 (Python)": 2, "GPU 0": 1, "GPU 1": 0}
    for i in range(6):
        start = 0.2 + i * 1.3
        for rank in (0, 1):
            bottom.broken_barh(
                [(start, 1.2)], (lanes_ddp[f"process {rank} (Python)"] - 0.35, 0.7), fc=python, ec="black"
            )
            bottom.broken_barh([(start + 1.2, 0.5)], (lanes_ddp[f"GPU {rank}"] - 0.35, 0.7), fc=kernel, ec="black")
    for gpu in (0, 1):
        bottom.broken_barh([(0, 8.7)], (lanes_ddp[f"GPU {gpu}"] - 0.35, 0.7), fc=IDLE, ec="none", zorder=0)
    bottom.set_title(
        "DDP: an interpreter per process. Python runs at the same time, and each GPU gets its kernels sooner",
        fontsize=9,
    )
    for ax, names in ((top, lanes), (bottom, lanes_ddp)):
        ax.set_yticks(list(names.values()), list(names))
        ax.set_ylim(-0.6, 3.6)
        ax.set_xlim(0, 8.7)
        ax.set_xticks([])
        ax.tick_params(axis="y", labelsize=8)
    bottom.set_xlabel("time (schematic, not measured: each slice of Python queues one small kernel)", fontsize=8)
    handles = [plt.Rectangle((0, 0), 1, 1, fc=c, ec="black") for c in (python, kernel, IDLE)]
    fig.legend(
        handles,
        ["Python code runs", "a kernel runs on the GPU", "the GPU is idle"],
        loc="lower center",
        ncol=3,
        fontsize=8,
        bbox_to_anchor=(0.5, 0.0),
    )
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    save(fig, path)


def timing_window(path: Path) -> None:
    """The benchmark's clock: warm-up steps left out, every device synchronised and its peak memory reset when the
    clock starts, and synchronised again before it stops. Below: why a clock read without synchronising is early."""
    fig, axes = canvas(10, 5.2, xlim=12, ylim=6.6)
    axes.text(
        6.0, 6.25, "What time_training_steps times (illustrative: 3 warm-up steps, then the timed steps)", ha="center"
    )
    for step in range(8):
        x = 0.4 + step * 1.4
        warm = step < 3
        label = (
            f"warm-up\nstep {step + 1}"
            if warm
            else {6: "...", 7: "last\ntimed step"}.get(step, f"timed\nstep {step - 2}")
        )
        box(axes, x, 4.7, 1.25, 0.8, label, IDLE if warm else COMPUTE, 8)
    for x in (4.57, 11.6):
        axes.plot([x, x], [4.2, 5.9], color=COPY, lw=2)
    axes.text(
        4.7,
        4.1,
        "synchronize every device,\nreset every device's peak memory,\nstart the clock",
        va="top",
        fontsize=8,
        color=COPY,
    )
    axes.text(11.5, 4.1, "synchronize every device,\nstop the clock", ha="right", va="top", fontsize=8, color=COPY)
    axes.text(
        2.3,
        4.1,
        "left out: work done once.\nFirst allocations, kernel\nloading, library handles,\ncuDNN plans, the first\n"
        "gradients and optimizer\nstate, DDP's bucket rebuild",
        ha="center",
        va="top",
        fontsize=8,
    )
    # Below: CUDA is asynchronous, so Python queues kernels ahead of the GPU.
    axes.text(
        6.0, 2.05, "Why synchronise: Python queues kernels faster than the GPU runs them", ha="center", fontsize=9
    )
    axes.text(0.4, 1.35, "Python queues", fontsize=8, va="center")
    axes.text(0.4, 0.5, "the GPU runs", fontsize=8, va="center")
    for i in range(5):
        axes.add_patch(plt.Rectangle((2.0 + i * 0.9, 1.15), 0.8, 0.4, fc="#ffd580", ec="black"))
        axes.add_patch(plt.Rectangle((2.4 + i * 1.7, 0.3), 1.6, 0.4, fc=COMPUTE, ec="black"))
    axes.plot([6.5, 6.5], [-0.05, 1.7], color="#666666", lw=1.5, linestyle="--")
    axes.text(
        6.4,
        -0.2,
        "clock read here without synchronising:\nit measures how fast Python queued",
        ha="right",
        va="top",
        fontsize=8,
        color="#444444",
    )
    axes.plot([10.8, 10.8], [-0.05, 1.7], color=COPY, lw=2)
    axes.text(10.9, -0.2, "after synchronize:\nthe GPU's work is in", ha="right", va="top", fontsize=8, color=COPY)
    axes.set_ylim(-1.0, 6.6)
    save(fig, path)


def benchmark_output() -> dict:
    """samples/s and each process's peak memory, as the notebook's benchmark cell printed them."""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    printed = {c.get("id"): "".join(p for o in c.get("outputs", []) for p in o.get("text", [])) for c in cells}
    text = printed[BENCHMARK_CELL]
    ddp = re.search(r"DDP: (\d+) process\(es\).*?([\d,]+) samples/s, peak memory per device \[([\d, ]+)\] MiB", text)
    return {
        "header": text.splitlines()[0],
        "machine": printed[MACHINE_CELL].split(";")[0],
        "processes": int(ddp.group(1)),
        "samples_per_second": int(ddp.group(2).replace(",", "")),
        "peak_mib": [int(mib) for mib in ddp.group(3).split(",")],
        "dp_skipped": "DataParallel skipped" in text,
    }


def measured_on_cpu(path: Path) -> None:
    """The committed CPU run of solutions/08_dp_vs_ddp.py: DDP's samples/s and peak memory, DataParallel's slot
    empty, with the reason it printed."""
    run = benchmark_output()
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(9, 3.6))
    speed.bar(["DDP", "DataParallel"], [run["samples_per_second"], 0], color=[RANK_COLOURS[0], IDLE])
    speed.text(0, run["samples_per_second"], f"{run['samples_per_second']:,}", ha="center", va="bottom", fontsize=9)
    speed.text(
        1, run["samples_per_second"] * 0.35, "not run:\nno GPU here\n(it needs 2 or more)", ha="center", fontsize=8
    )
    speed.set_ylabel("samples/s (all processes together)")
    speed.set_ylim(0, run["samples_per_second"] * 1.2)
    names = [f"rank {rank}" for rank in range(run["processes"])]
    memory.bar(names, run["peak_mib"], color=RANK_COLOURS[: run["processes"]])
    for i, mib in enumerate(run["peak_mib"]):
        memory.text(i, mib, f"{mib} MiB", ha="center", va="bottom", fontsize=9)
    memory.set_ylabel("peak resident memory per process (MiB)")
    memory.set_ylim(0, max(run["peak_mib"]) * 1.2)
    memory.set_title("DDP: about the same in every process", fontsize=9)
    speed.set_title("DDP against DataParallel", fontsize=9)
    fig.suptitle(f"Measured on {run['machine']}, gloo (notebook 02's committed output)\n{run['header']}", fontsize=9)
    fig.tight_layout()
    save(fig, path)


FIGURES = {
    "02_dp_forward": (dp_forward, None),
    "02_dp_backward": (dp_backward, None),
    "02_memory_per_gpu": (memory_per_gpu, None),
    "02_one_process_against_ddp": (one_process_against_ddp, None),
    "02_gil_turns": (gil_turns, None),
    "02_timing_window": (timing_window, None),
    "02_measured_on_cpu": (measured_on_cpu, NOTEBOOK),
}
