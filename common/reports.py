"""What the measuring solutions write for people to read: a line per result, Markdown tables, JSON and PNG plots.

- ``plot_accuracy_curves``: test accuracy against the epoch, one line per training configuration (lesson 10's
  gradient compression, ``benchmarks/gradient_compression.py``).
- ``plot_bus_bandwidth``: lesson 01's all-reduce timings (``solutions/07_ring_allreduce.py``), bandwidth against size.
- ``comparison_result``, ``describe_comparison``, ``write_comparison``: lesson 02's DataParallel against DDP
  (``solutions/08_dp_vs_ddp.py``), samples/s and peak memory per device, as a line, a table (``results.md``),
  figures (``results.json``) and a plot (``results.png``).
- ``machine_summary``: the hardware and PyTorch a measurement ran on, in one line, for a notebook to print.

Plots use ``matplotlib.figure.Figure`` directly, not ``pyplot``: nothing to display, no global figure state.
"""

import datetime
import os
import platform
from pathlib import Path

import torch

from common.cli import parse_size
from common.memory import memory_kind
from common.metrics import write_json


def plot_accuracy_curves(curves: dict[str, list[float]], path, title: str, styles: dict | None = None) -> None:
    """Plot test accuracy (%) against the epoch, one line per configuration, to the PNG ``path`` (folders created).

    ``curves``: ``{label: [accuracy after epoch 1, after epoch 2, ...]}``, accuracies as fractions. ``styles``:
    ``{label: matplotlib line options}`` for the labels that need them, such as ``{"linestyle": "--"}`` to tell a
    variant from its original, or one ``color`` for a pair of related lines.
    """
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(9, 4.5), layout="tight")
    axes = figure.subplots()
    for label, accuracies in curves.items():
        epochs = range(1, len(accuracies) + 1)
        axes.plot(epochs, [100 * accuracy for accuracy in accuracies], label=label, **(styles or {}).get(label, {}))
    axes.set(xlabel="epoch", ylabel="test accuracy (%)", title=title)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))  # beside the curves, not on them
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def plot_bus_bandwidth(rows: list[dict], path, title: str) -> None:
    """Plot bus bandwidth against tensor size, one line per algorithm, to the PNG ``path`` (folders created).

    ``rows``: one dict per measurement with ``size`` (text such as ``"4K"``), ``algorithm`` and ``busbw`` (GB/s).
    """
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4), layout="tight")
    axes = figure.subplots()
    for name in dict.fromkeys(row["algorithm"] for row in rows):
        mine = [row for row in rows if row["algorithm"] == name]
        axes.plot([parse_size(row["size"]) for row in mine], [row["busbw"] for row in mine], marker="o", label=name)
    axes.set(xscale="log", xlabel="tensor size (bytes)", ylabel="bus bandwidth (GB/s)", title=title)
    axes.grid(True, alpha=0.3)
    axes.legend()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def comparison_result(
    mode: str, processes: int, devices: list[str], samples_per_second: float, peak_memory_mib: list[float], device
) -> dict:
    """One mode's figures, as ``describe_comparison`` and ``write_comparison`` read them: ``devices`` and
    ``peak_memory_mib`` one per device; ``device``, the first of them, tells how memory was measured."""
    return {
        "mode": mode,
        "processes": processes,
        "devices": devices,
        "samples_per_second": samples_per_second,
        "peak_memory_mib": peak_memory_mib,
        "memory_kind": memory_kind(device),
    }


def describe_comparison(result: dict) -> str:
    """One line for one mode's result: processes, devices, samples/s and peak memory per device."""
    memory = ", ".join(f"{mib:,.0f}" for mib in result["peak_memory_mib"])
    return (
        f"{result['mode']:>12}: {result['processes']} process(es) on {len(result['devices'])} device(s), "
        f"{result['samples_per_second']:,.0f} samples/s, peak memory per device [{memory}] MiB "
        f"({result['memory_kind']})"
    )


def write_comparison(folder: Path, results: list[dict], skipped: str | None, setting: dict, where: str) -> None:
    """Write ``results.json`` (``setting`` with the PyTorch version and CUDA devices, ``results``, why DataParallel
    was skipped), ``results.md`` (a table) and ``results.png`` (throughput and peak memory per device) into
    ``folder``. ``setting`` names the ``model`` and ``global_batch_size``; ``where``, say ``"gloo on cpu"``, goes
    into the plot's title. Call on one process."""
    folder.mkdir(parents=True, exist_ok=True)
    setting = {
        **setting,
        "torch_version": torch.__version__,
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }
    write_json(folder / "results.json", {**setting, "results": results, "dataparallel_skipped": skipped})
    lines = [
        "| mode | processes | devices | samples/s | peak memory per device (MiB) | memory measured as |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        memory = ", ".join(f"{mib:,.0f}" for mib in r["peak_memory_mib"])
        lines.append(
            f"| {r['mode']} | {r['processes']} | {', '.join(r['devices'])} | "
            f"{r['samples_per_second']:,.0f} | {memory} | {r['memory_kind']} |"
        )
    if skipped:
        lines.append(f"\nDataParallel skipped: {skipped}")
    (folder / "results.md").write_text("\n".join(lines) + "\n")
    title = f"{setting['model']}, global batch {setting['global_batch_size']}, {where}"
    _plot_comparison(results, folder / "results.png", title, skipped)


def _plot_comparison(results: list[dict], path: Path, title: str, skipped: str | None) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 3.8), layout="constrained")
    speed_axes, memory_axes = figure.subplots(1, 2)
    modes = [r["mode"] for r in results]
    speed_axes.bar(modes, [r["samples_per_second"] for r in results], color=["tab:blue", "tab:orange"][: len(modes)])
    if skipped:
        speed_axes.bar(["DataParallel"], [0], color="tab:orange")
        speed_axes.text(1, 0, "skipped:\nneeds 2+ GPUs", ha="center", va="bottom")
    speed_axes.set(ylabel="samples/s", title="throughput")
    width = 0.8 / len(results)
    devices = max(len(r["peak_memory_mib"]) for r in results)
    for i, r in enumerate(results):
        positions = [device + (i - (len(results) - 1) / 2) * width for device in range(len(r["peak_memory_mib"]))]
        memory_axes.bar(positions, r["peak_memory_mib"], width=width, label=r["mode"])
    memory_axes.set_xticks(range(devices))
    memory_axes.set(
        xlabel="device (DDP: the rank's device)",
        ylabel=f"MiB, {results[0]['memory_kind']}",
        title="peak memory per device",
    )
    memory_axes.legend(loc="lower right")
    figure.suptitle(title)
    figure.savefig(path, dpi=100)


def machine_summary() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo, else ``platform.processor()``) with the vector instructions
    PyTorch's kernels use on it (and whether it has bf16 instructions), the cores this process may use, the GPUs if
    any, and PyTorch's version: ``"AMD EPYC (AVX512, bf16), 2 CPU cores; PyTorch 2.14.1+cu130"``. Two machines with
    one model name can differ there ("AMD EPYC" is what a virtual machine of several EPYC generations reports), and
    that changes results: bf16 is fast only with bf16 instructions, and AVX2 and AVX512 kernels round differently."""
    cpu, flags = platform.processor() or "an unnamed CPU", set()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
        cpu = names[0] if names else cpu
        flags = next((set(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), set())
    except OSError:
        pass
    bf16 = ", bf16" if flags & {"avx512_bf16", "amx_bf16"} else ""
    cpu = f"{cpu} ({torch.backends.cpu.get_cpu_capability()}{bf16})"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpus = [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())]
    devices = f"{cpu}, {cores} CPU cores" + (f", GPUs: {', '.join(gpus)}" if gpus else "")
    return f"{devices}; PyTorch {torch.__version__}"


def run_header() -> str:
    """Where and when a measurement ran, as a benchmark's or notebook's first line: ``machine_summary()``, the UTC
    time, and the load average (1, 5, 15 minutes): on 2 cores, one other busy process halves a timing."""
    now = datetime.datetime.now(datetime.timezone.utc)
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    return f"{machine_summary()}; {now:%Y-%m-%d %H:%M} UTC; load average {load}"
