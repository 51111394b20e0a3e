"""fp32 vs tf32 vs bf16 vs fp16: training speed and memory of one process, per precision.

    python benchmarks/mixed_precision.py                        # SimpleCNN; batch 256 on a GPU, 64 on a CPU
    python benchmarks/mixed_precision.py --precisions fp32 bf16 --batch-size 128 --steps 20

The rows: ``fp32`` computes in full fp32 (TF32 off for matrix products and convolutions, which PyTorch's
defaults leave on for cuDNN convolutions); ``tf32`` keeps fp32 tensors but lets matrix products and convolutions
use TF32 tensor cores (CUDA on Ampere or newer only; 10 mantissa bits); ``bf16`` and ``fp16`` autocast, fp16 with
``torch.amp.GradScaler``. On a GPU the default runs all four, on a CPU fp32, bf16 and fp16.

Each row times ``--steps`` full training steps (autocast forward, scaled backward for fp16, SGD step) on one
fixed random batch, after 2 untimed warm-up steps, and takes the median step. ``--rounds`` repeats the whole
comparison, precisions taking turns, and each row reports its fastest round, as ``timeit`` does: on a shared
machine other work can only slow a measurement down. Two memory figures:

- "saved MiB": the tensors autograd keeps from the forward pass for the backward (activations, and autocast's
  low-precision copies of the weights; not the parameters themselves). This is what mixed precision shrinks,
  and it is the same on every device.
- "peak MiB": on CUDA, ``torch.cuda.max_memory_allocated`` over the timed steps: every tensor, parameters,
  gradients and optimizer state included. On a CPU, the peak resident memory of the process, Python and
  PyTorch included, which cannot be reset: each precision therefore runs in a fresh process of its own.
"""

import json
import multiprocessing
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from common.cli import argument_parser, positive_int
from common.memory import memory_kind, peak_memory_mib, reset_peak_memory
from common.metrics import synchronize
from common.models import MODELS
from common.precision import PRECISIONS, check_precision
from common.reports import run_header

WARMUP_STEPS = 2
# fp32 tensors with TF32 tensor-core arithmetic: not an autocast dtype, a setting of the matmul and conv backends
VARIANTS = ("fp32", "tf32", *(precision for precision in PRECISIONS if precision != "fp32"))


def parse_args(argv=None):
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="simplecnn")
    parser.add_argument("--batch-size", type=positive_int, help="default: 256 on a GPU, 64 on a CPU")
    parser.add_argument("--steps", type=positive_int, default=10, help="timed training steps per precision")
    parser.add_argument(
        "--precisions",
        nargs="+",
        choices=VARIANTS,
        help="default: fp32 tf32 bf16 fp16 on a GPU that has TF32, fp32 bf16 fp16 elsewhere",
    )
    parser.add_argument("--rounds", type=positive_int, default=3, help="repeat the comparison, keep the fastest")
    parser.add_argument("--json", type=Path, help="also write the rows and the set-up to this file")
    return parser.parse_args(argv)


def has_tf32(device: torch.device) -> bool:
    """TF32 tensor cores exist on NVIDIA GPUs of compute capability 8.0 (Ampere) and newer, nowhere else."""
    return device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 8


def set_fp32_math(precision: str) -> None:
    """How fp32 matrix products and convolutions compute on CUDA: TF32 for ``tf32``, full fp32 (``ieee``) else.

    PyTorch's defaults differ per backend (cuDNN convolutions may use TF32, cuBLAS matrix products may not): both
    are set here, so that ``fp32`` means fp32 and ``tf32`` means TF32. ``fp32_precision`` is the API PyTorch 2.9
    introduced in place of ``allow_tf32`` (which still works, and sets it). The autocast rows keep this too, for the
    ops autocast leaves in fp32.
    """
    math = "tf32" if precision == "tf32" else "ieee"
    torch.backends.cuda.matmul.fp32_precision = math
    torch.backends.cudnn.conv.fp32_precision = math


def autocast_dtype(precision: str) -> torch.dtype:
    """The dtype autocast runs in for a row: fp32 and tf32 keep fp32 (autocast off)."""
    return torch.float32 if precision == "tf32" else PRECISIONS[precision]


def saved_for_backward_mib(net, X, y, precision: str) -> float:
    """MiB of the tensors one forward pass saves for backward, parameters excluded, each storage counted once."""
    parameters = {p.untyped_storage().data_ptr() for p in net.parameters()}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast(
            device_type=X.device.type, dtype=autocast_dtype(precision), enabled=precision in ("bf16", "fp16")
        ):
            F.cross_entropy(net(X), y)  # the graph is dropped unused: this measures, it does not train
    return sum(saved.values()) / 2**20


def measure(model_name: str, precision: str, batch_size: int, steps: int, device_name: str) -> dict:
    """Time ``steps`` training steps in ``precision``; return samples/s and ms of the median step, and the memory."""
    device = torch.device(device_name)
    if device.type == "cuda":
        set_fp32_math(precision)
    torch.manual_seed(0)
    model_class = MODELS[model_name]
    net = model_class().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    X = torch.randn(batch_size, *model_class.input_shape, device=device)
    y = torch.randint(0, 10, (batch_size,), device=device)

    def train_step():
        with torch.autocast(
            device_type=device.type, dtype=autocast_dtype(precision), enabled=precision in ("bf16", "fp16")
        ):
            loss = F.cross_entropy(net(X), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    saved_mib = saved_for_backward_mib(net, X, y, precision)
    for _ in range(WARMUP_STEPS):  # first calls pick kernels and allocate the gradients and momentum buffers
        train_step()
    reset_peak_memory(device)
    step_seconds = []
    for _ in range(steps):
        synchronize(device)  # each clock reading waits for the GPU: it times the work, not its queueing
        start = time.perf_counter()
        train_step()
        synchronize(device)
        step_seconds.append(time.perf_counter() - start)
    seconds = statistics.median(step_seconds)
    return {
        "precision": precision,
        "samples_per_second": batch_size / seconds,
        "ms_per_step": 1000 * seconds,
        "saved_mib": saved_mib,
        "peak_mib": peak_memory_mib(device),
    }


# The CPU features that decide how fast bf16 and fp16 can be: AVX512_BF16 and AMX have bf16 dot products, AVX512_FP16
# and AMX-FP16 fp16 arithmetic; with AVX2 and F16C alone, 16-bit values are converted to fp32 to compute.
SIXTEEN_BIT_CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16")


def describe_cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """One line: the instruction set PyTorch's CPU kernels dispatch to, and which 16-bit-relevant flags the CPU has."""
    try:
        flags_line = next(line for line in cpuinfo.read_text().splitlines() if line.startswith("flags"))
        flags = set(flags_line.split(":", 1)[1].split())
    except (OSError, StopIteration):  # not Linux, or no flags line: say so rather than guess
        return f"cpu capability {torch.backends.cpu.get_cpu_capability()}; cpu flags unknown (no {cpuinfo})"
    present = [flag for flag in SIXTEEN_BIT_CPU_FLAGS if flag in flags]
    absent = [flag for flag in SIXTEEN_BIT_CPU_FLAGS if flag not in flags]
    return (
        f"cpu capability {torch.backends.cpu.get_cpu_capability()}; cpu flags present: {' '.join(present) or '-'}"
        f"; absent: {' '.join(absent) or '-'}"
    )


def main(args):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batch_size = args.batch_size or (256 if device.type == "cuda" else 64)
    precisions = args.precisions or [v for v in VARIANTS if v != "tf32" or has_tf32(device)]
    for precision in precisions:
        if precision == "tf32" and not has_tf32(device):
            raise SystemExit(f"error: tf32 needs an NVIDIA GPU of compute capability 8.0 or newer, not {device}")
        if precision != "tf32":
            check_precision(precision, device)  # a clear message now, not a silent fp32 row later
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    setup = (
        f"{args.model}, batch {batch_size}, median of {args.steps} steps after {WARMUP_STEPS} warm-up, best of "
        f"{args.rounds} round(s), one process on {where}, PyTorch {torch.__version__}; "
        f"peak = {memory_kind(device)}"
    )
    print(run_header(), flush=True)
    print(setup, flush=True)
    if device.type == "cpu":
        print(describe_cpu(), flush=True)
    context = multiprocessing.get_context("spawn")
    best = {}
    for _ in range(args.rounds):
        for precision in precisions:
            with context.Pool(1) as pool:  # a fresh process per precision: its own peak memory, its own warm-up
                row = pool.apply(measure, (args.model, precision, batch_size, args.steps, str(device)))
            if precision not in best or row["ms_per_step"] < best[precision]["ms_per_step"]:
                best[precision] = row
    print(f"{'precision':>9} {'samples/s':>10} {'ms/step':>8} {'vs fp32':>7} {'saved MiB':>9} {'peak MiB':>8}")
    for precision, row in best.items():
        row["vs_fp32"] = row["samples_per_second"] / best["fp32"]["samples_per_second"] if "fp32" in best else None
        speedup = "-" if row["vs_fp32"] is None else f"{row['vs_fp32']:.2f}x"
        print(
            f"{precision:>9} {row['samples_per_second']:>10,.0f} {row['ms_per_step']:>8.1f} {speedup:>7} "
            f"{row['saved_mib']:>9.1f} {row['peak_mib']:>8.0f}"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"setup": setup, "batch_size": batch_size, "rows": list(best.values())}, indent=2)
        )


if __name__ == "__main__":
    main(parse_args())
