"""Lesson 05's pictures: the three float formats, fp16's range, what autocast does, the loss scale, measured speed."""

import json
import re
from pathlib import Path

from .draw import COMMUNICATE, IDLE, MEMORY, REPO, arrow, box, canvas, plt, save

NOTEBOOK = REPO / "notebooks" / "05_mixed_precision.ipynb"
SCALER_CELL = "2c60bcae"  # the notebook cell "The scaler's dynamics": the scale after each step, inf injected
BENCHMARK_CELL = "1a8e602c"  # the notebook cell "Speed and memory, measured": benchmarks/mixed_precision.py on the CPU
H200_SUMMARY = REPO / "results" / "nvidia-h200" / "summary.md"

SIGN, EXPONENT, MANTISSA = "#bdbdbd", "#fdae6b", "#9ecae1"
LOW, FP32 = "#9ecae1", "#fee391"  # 16-bit and fp32, in every figure of this lesson
# benchmarks/mixed_precision.py's rows: precision, samples/s, ms/step, "vs fp32" ratio, saved MiB, peak MiB
ROW = re.compile(r"^\s*(fp32|tf32|bf16|fp16)\s+([\d,]+)\s+([\d.]+)\s+([\d.]+)x\s+([\d.]+)\s+(\d+)\s*$")


def cell_text(cell_id: str) -> str:
    """What one cell of the committed notebook printed."""
    for cell in json.loads(NOTEBOOK.read_text())["cells"]:
        if cell.get("id") == cell_id:
            return "".join("".join(output.get("text", "")) for output in cell.get("outputs", []))
    raise KeyError(cell_id)


def benchmark_rows(text: str) -> dict[str, dict]:
    """``{precision: {"speedup": ..., "saved": ...}}`` from the first table benchmarks/mixed_precision.py printed."""
    rows = {}
    for line in text.splitlines():
        match = ROW.match(line)
        if match and match[1] not in rows:
            rows[match[1]] = {"speedup": float(match[4]), "saved": float(match[5]), "label": f"{match[4]}x"}
    return rows


def float_formats(path: Path) -> None:
    """fp32, fp16 and bf16 as rows of bits: sign, exponent, mantissa, with the range and precision each gives."""
    fig, axes = canvas(10, 3.9, xlim=50, ylim=10.5)
    formats = (
        ("fp32", 8, 23, "largest 3.4e38\nsmallest normal 1.18e-38\neps 1.19e-07"),
        ("fp16", 5, 10, "largest 65504\nsmallest normal 6.1e-05\neps 0.000977"),
        ("bf16", 8, 7, "largest 3.39e38\nsmallest normal 1.18e-38\neps 0.00781"),
    )
    bit = 0.92
    for row, (name, exponent, mantissa, numbers) in enumerate(formats):
        y = 7.6 - row * 3.1
        axes.text(2.6, y + 0.6, name, ha="right", va="center", fontsize=12, weight="bold")
        x = 3.2
        for width, colour, label in ((1, SIGN, ""), (exponent, EXPONENT, "exponent"), (mantissa, MANTISSA, "mantissa")):
            for i in range(width):
                axes.add_patch(plt.Rectangle((x + i * bit, y), bit, 1.2, fc=colour, ec="white", lw=0.8))
            text = f"{label} {width}" if label else "s"
            axes.text(x + width * bit / 2, y + 0.6, text, ha="center", va="center", fontsize=9, color="black")
            x += width * bit
        axes.text(x + 0.4, y + 0.6, f"{1 + exponent + mantissa} bits", va="center", fontsize=9)
        axes.text(37.0, y + 0.6, numbers, va="center", fontsize=9, linespacing=1.3)
    axes.text(3.2, 10.1, "Exponent bits set the range. Mantissa bits set the precision (eps: the gap after 1.0).",
              fontsize=9, va="center")  # fmt: skip
    save(fig, path)


def fp16_range(path: Path) -> None:
    """fp16 on a log axis: rounded to 0, subnormal, normal, overflow; a gradient of 1e-8 lost, and rescued by 2^16."""
    fig, axes = plt.subplots(figsize=(10, 3.8))
    zero_edge, smallest, overflow = 2.0**-25, 2.0**-24, 65520.0  # conversion rounds to the nearest fp16 number
    subnormal = "subnormal: fewer\nsignificant bits.\nsmallest: 6e-8 (2^-24).\n3e-8 to 6e-8\nround up to it"
    zones = (
        (1e-11, zero_edge, IDLE, "becomes 0"),
        (zero_edge, 6.1e-5, "#c6dbef", subnormal),
        (6.1e-5, overflow, LOW, "normal: all 10 mantissa bits"),
        (overflow, 1e7, "#f4a6a6", "overflow:\ninf"),
    )
    for start, end, colour, label in zones:
        axes.axvspan(start, end, color=colour, alpha=0.9)
        middle = (start * end) ** 0.5
        axes.text(middle, 0.78, label, ha="center", va="center", fontsize=8.5 if "\n" in label else 9)
    for edge, label in ((zero_edge, "3e-8\n(2^-25)"), (6.1e-5, "6.1e-5"), (overflow, "65520\n(65504 is the largest)")):
        axes.axvline(edge, color="black", lw=0.8)
        axes.text(edge, -0.07, label, ha="center", va="top", fontsize=9)
    axes.axvline(smallest, color="black", lw=0.8, linestyle=":")
    gradient, scaled = 1e-8, 1e-8 * 2.0**16
    axes.plot([gradient], [0.35], "o", color="#e15759", ms=8)
    axes.text(gradient / 8, 0.2, "a gradient of 1e-8:\n0 in fp16", ha="center", va="top", fontsize=9)
    axes.plot([scaled], [0.35], "o", color="#59a14f", ms=8)
    axes.text(scaled / 2, 0.2, "1e-8 x 2^16: kept", ha="left", va="top", fontsize=9)
    axes.annotate("", xy=(scaled / 1.6, 0.35), xytext=(gradient * 1.6, 0.35),
                  arrowprops={"arrowstyle": "->", "lw": 1.6, "color": "#59a14f"})  # fmt: skip
    axes.text((gradient * scaled) ** 0.5, 0.42, "loss scale S = 2^16 multiplies every gradient", ha="center",
              fontsize=9, color="#2a6f2a")  # fmt: skip
    axes.set_xscale("log")
    axes.set_xlim(1e-11, 1e7)
    axes.set_ylim(0, 1)
    axes.set_yticks([])
    axes.set_xticks([])
    axes.set_title("The magnitudes fp16 can hold, each value rounded to the nearest (bf16 and fp32: normal numbers "
                   "from 1.18e-38 to about 3.4e38)", fontsize=9)  # fmt: skip
    axes.set_xlabel("magnitude of a value (log scale)", labelpad=28)
    save(fig, path)


def autocast_flow(path: Path) -> None:
    """One training step under autocast: fp32 weights, 16-bit copies and ops, fp32 loss, the scaled backward with
    DDP's all-reduce overlapping it, fp32 .grad, then the scaler's calls once per optimizer step."""
    fig, axes = canvas(10.5, 6.0, xlim=22, ylim=12.2)
    lanes = ((9.4, "forward,\ninside\nautocast"), (6.3, "backward,\noutside\nautocast"))
    lanes += ((1.6, "once per\noptimizer\nstep"),)
    for y, label in lanes:
        axes.text(0.1, y + 0.55, label, va="center", fontsize=9, weight="bold")
    h, w = 1.1, 3.4
    forward = (
        (3.6, "fp32 weights\n(parameters)", MEMORY),
        (8.1, "autocast casts\na 16-bit copy", LOW),
        (12.6, "conv, linear\nin bf16 / fp16", LOW),
        (17.1, "loss\nin fp32", FP32),
    )
    for x, text, colour in forward:
        box(axes, x, 9.4, w, h, text, colour, 9)
    for (x0, *_), (x1, *_) in zip(forward, forward[1:]):
        arrow(axes, (x0 + w, 9.95), (x1, 9.95))
    box(axes, 12.6, 11.2, w, 0.8, "X (the batch)", "#ffffff", 9)
    arrow(axes, (14.3, 11.2), (14.3, 10.5))
    backward = (
        (17.1, "scaler.scale:\nloss x S (fp16 only)", FP32),
        (11.4, "backward of each op\nin its forward's dtype", LOW),
        (7.2, "cast back\nto fp32", FP32),
        (3.0, ".grad in fp32\n(x S under fp16)", FP32),
    )
    widths = (3.8, 4.4, 2.8, 3.0)
    for (x, text, colour), width in zip(backward, widths):
        box(axes, x, 6.3, width, h, text, colour, 9)
    arrow(axes, (18.8, 9.4), (18.8, 7.4))
    arrow(axes, (17.1, 6.85), (15.8, 6.85))
    arrow(axes, (11.4, 6.85), (10.0, 6.85))
    arrow(axes, (7.2, 6.85), (6.0, 6.85))
    box(axes, 4.4, 4.2, 13.6, 1.2, "DDP all-reduce of the fp32 gradients (still x S), bucket by bucket,\n"
        "during the last micro-step's backward, done when backward() returns", COMMUNICATE, 9)  # fmt: skip
    arrow(axes, (13.6, 6.3), (13.6, 5.4))
    arrow(axes, (5.2, 5.4), (5.2, 6.3))
    optimizer = (
        ("unscale_:\ndivide by S", FP32),
        ("clip the\ntrue gradient", FP32),
        ("step (skipped\non inf / NaN)", FP32),
        ("update S:\nhalve or grow", FP32),
    )
    xs = (3.0, 7.7, 12.4, 17.1)
    for x, (text, colour) in zip(xs, optimizer):
        box(axes, x, 1.6, w, h, text, colour, 9)
    for x0, x1 in zip(xs, xs[1:]):
        arrow(axes, (x0 + w, 2.15), (x1, 2.15))
    arrow(axes, (3.6, 6.3), (3.6, 2.7))
    legend = ((3.6, LOW, "16-bit (bf16 or fp16)"), (9.0, FP32, "fp32"), (12.0, MEMORY, "stored in fp32"))
    legend += ((15.6, COMMUNICATE, "communication"),)
    for x, colour, label in legend:
        axes.add_patch(plt.Rectangle((x, 0.2), 0.6, 0.5, fc=colour, ec="black", lw=0.8))
        axes.text(x + 0.8, 0.45, label, va="center", fontsize=9)
    save(fig, path)


def autocast_ops(path: Path) -> None:
    """Which dtype autocast gives each op, on CPU and on CUDA, with a 16-bit dtype asked for."""
    ops = (
        ("linear, matmul, conv2d", LOW, LOW, "16-bit on both: the bulk of the arithmetic"),
        ("cross_entropy, mse_loss", FP32, FP32, "fp32 on both: the losses"),
        ("softmax, log_softmax, sum", LOW, FP32, "fp32 on CUDA only"),
        ("mean, relu, max_pool2d", IDLE, IDLE, "on no list: the dtype of the input"),
    )
    fig, axes = canvas(9, 3.6, xlim=18, ylim=7.2)
    axes.text(7.6, 6.6, "CPU autocast", ha="center", fontsize=10, weight="bold")
    axes.text(10.8, 6.6, "CUDA autocast", ha="center", fontsize=10, weight="bold")
    names = {LOW: "bf16 / fp16", FP32: "fp32", IDLE: "as its input"}
    for row, (name, cpu, cuda, note) in enumerate(ops):
        y = 5.1 - row * 1.35
        axes.text(5.8, y + 0.5, name, ha="right", va="center", fontsize=10, family="monospace")
        for x, colour in ((6.3, cpu), (9.5, cuda)):
            box(axes, x, y, 2.6, 1.0, names[colour], colour, 9)
        axes.text(12.4, y + 0.5, note, va="center", fontsize=9)
    axes.text(0.1, 0.1, "torch.autocast(device_type, dtype=torch.bfloat16 or torch.float16), PyTorch 2.14.1",
              fontsize=8, color="#555555")  # fmt: skip
    save(fig, path)


def loss_scale(path: Path) -> None:
    """The notebook's scaler run: the scale after each step, halved at each inf, doubled after 3 good steps."""
    rows = []
    for line in cell_text(SCALER_CELL).splitlines():
        words = line.split()
        if len(words) == 4 and words[0].isdigit():
            rows.append((int(words[0]), words[1] == "True", words[2] == "True", float(words[3])))
    fig, axes = plt.subplots(figsize=(8, 3.8))
    steps = [0] + [step for step, *_ in rows]
    scales = [1024.0] + [scale for *_, scale in rows]  # init_scale=1024 in the cell
    axes.step(steps, scales, where="post", color="black", lw=1.5)
    axes.plot(steps, scales, "o", color="black", ms=4)
    for step, injected, moved, scale in rows:
        if injected:
            axes.axvspan(step - 0.5, step + 0.5, color="#f4a6a6", alpha=0.6, lw=0)
            axes.text(step, 1450, "inf\nskip" if not moved else "inf", ha="center", fontsize=9)
    axes.annotate("3 good steps:\ndoubled", xy=(6, 512), xytext=(6.4, 300), fontsize=9,
                  arrowprops={"arrowstyle": "->"})  # fmt: skip
    axes.annotate("3 good steps:\ndoubled", xy=(9, 1024), xytext=(7.6, 720), fontsize=9,
                  arrowprops={"arrowstyle": "->"})  # fmt: skip
    axes.annotate("halved after\neach skip", xy=(3, 256), xytext=(0.6, 290), fontsize=9,
                  arrowprops={"arrowstyle": "->"})  # fmt: skip
    axes.set_yscale("log", base=2)
    axes.set_yticks([256, 512, 1024], ["256", "512", "1024"])
    axes.set_ylim(180, 2000)
    axes.set_xticks(steps)
    axes.set_xlabel("optimizer step (0: before the first)")
    axes.set_ylabel("loss scale S after the step")
    axes.set_title("GradScaler(init_scale=1024, growth_interval=3), inf injected at steps 2 and 3", fontsize=10)
    save(fig, path)


def _speed_and_memory(path: Path, rows: dict, title: str) -> None:
    """Two panels from one benchmark table: speed relative to fp32, and what autograd saved for the backward."""
    names = list(rows)
    colours = [FP32 if name in ("fp32", "tf32") else LOW for name in names]
    fig, (speed, saved) = plt.subplots(1, 2, figsize=(9, 3.6))
    bars = speed.bar(names, [rows[name]["speedup"] for name in names], color=colours, edgecolor="black")
    speed.bar_label(bars, [rows[name]["label"] for name in names], fontsize=9)
    speed.axhline(1.0, color="black", lw=0.8, linestyle="--")
    speed.set_ylabel("samples/s relative to fp32")
    speed.set_ylim(0, max(row["speedup"] for row in rows.values()) * 1.2)
    bars = saved.bar(names, [rows[name]["saved"] for name in names], color=colours, edgecolor="black")
    saved.bar_label(bars, [f"{rows[name]['saved']:.1f}" for name in names], fontsize=9)
    saved.set_ylabel("kept for backward (MiB)")
    saved.set_ylim(0, max(row["saved"] for row in rows.values()) * 1.2)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save(fig, path)


def speed_cpu(path: Path) -> None:
    """The notebook's benchmark on the 2-core CPU: SimpleCNN at batch 64."""
    rows = benchmark_rows(cell_text(BENCHMARK_CELL))
    _speed_and_memory(path, rows, "SimpleCNN, batch 64, one process on the 2-core AMD EPYC (avx512_bf16, no fp16 math)")


def speed_h200(path: Path) -> None:
    """make gpu-check's benchmark on one H200: SimpleCNN at batch 256, fp32 with TF32 off, then TF32, bf16, fp16."""
    rows = benchmark_rows(H200_SUMMARY.read_text())
    _speed_and_memory(path, rows, "SimpleCNN, batch 256, one NVIDIA H200 (fp32 here: TF32 off), one run")


FIGURES = {
    "05_float_formats": (float_formats, None),
    "05_fp16_range": (fp16_range, None),
    "05_autocast_flow": (autocast_flow, None),
    "05_autocast_ops": (autocast_ops, None),
    "05_loss_scale": (loss_scale, NOTEBOOK),
    "05_speed_cpu": (speed_cpu, NOTEBOOK),
    "05_speed_h200": (speed_h200, H200_SUMMARY),
}
