"""Throughput of solutions/01_ddp_basic.py at several process counts (weak and strong scaling), and its all-reduces.

    python benchmarks/ddp_scaling.py --mode both --plot runs/ddp_scaling.png   # 1 and 2 processes, synthetic data
    python benchmarks/ddp_scaling.py --nproc 1 2 4 --dataset digits --epochs 5
    python benchmarks/ddp_scaling.py --nproc 1 2 4 8 --cpu --threads 1     # gloo on CPU cores, one thread each
    python benchmarks/ddp_scaling.py --nproc 2 --communication-only         # the all-reduce fit alone, no training

Each count runs under ``torchrun --standalone``; the figures come from the metrics file that global rank 0
writes. The first epoch is left out of the throughput (start-up, first-touch allocations) when there are more.
``--cpu`` hides the GPUs (gloo on CPU even where GPUs exist); ``--threads N`` gives every process N intra-op
threads at every count (torchrun sets 1 only for several processes, so one process would otherwise use them all).

- weak scaling (``--mode weak``, the default): ``--batch-size`` per process at every count, so N processes
  train on N times the samples per step. Efficiency = samples/s at N / (N x samples/s at 1).
- strong scaling (``--mode strong``): the global batch stays ``--batch-size``, each of N processes takes
  ``--batch-size / N`` (it must divide). Efficiency = speed-up / N, the speed-up being time at 1 / time at N.

Then the communication (``common/scaling.py``): at every count above 1, one more torchrun launch times
``dist.all_reduce`` at sizes from 4 B to 16 MiB and fits t(n) = alpha + beta n; the model's DDP buckets (DDP's
default cap) give the predicted all-reduce time per step, beside "measured, buckets alone": the same all-reduces
timed back to back with nothing else running (inside a real step, where backward overlaps and competes with
them, the communication is read from a profiler trace: lesson 09). A second table shows how far each measured size
lies from the fitted line (its residual, measured / fitted) and the fit's 1/beta as algorithm and bus bandwidth;
``--communication-only`` prints these two tables alone, with no training. Then a control for every count above 1: one
process alone, with the threads and the batch of one of the N processes (``--threads``, else 1, as torchrun gives
each of several). A last table splits the time each step lost against the ideal into measured parts: what one
process of the N takes alone (control - ideal: fewer threads, a smaller batch), the all-reduces measured alone,
and what neither explains (the N processes running together: cores, memory bandwidth, gloo's threads, less
whatever backward hid). It names no cause by rule; the largest part is the one to look at first.

What the CPU figures mean: the processes share the machine's cores. N processes on fewer than N cores (or N
processes of several threads each on N cores) cannot run their compute in parallel, so the step's compute slows
down as N grows, whatever the communication costs: on 2 cores expect at most 2x in samples/s, and less, since one
process alone uses both cores (torchrun gives each of several processes 1 thread; ``--threads 1`` gives the
1-process run 1 too). gloo's all-reduce between local processes is memory copies and local sockets on those
same cores, not NVLink or InfiniBand: alpha and beta describe this machine, not a GPU cluster. The predicted
all-reduce time is what a step's buckets cost with nothing overlapping them; DDP overlaps them with backward, so
they add less than that, but on a CPU they also take cores from backward: read it as a scale, not an exact share.
"""

import argparse
import json
import os
from pathlib import Path

from common.cli import argument_parser, positive_int
from common.distributed import process_group
from common.launch import run_for_json
from common.metrics import write_json
from common.models import MODELS
from common.reports import run_header
from common.scaling import (
    bucket_bytes,
    bus_bandwidth_gb_s,
    fit_alpha_beta,
    fit_residuals,
    plot_scaling,
    predict_communication_seconds,
    scaling_efficiency,
    time_all_reduce,
    time_bucket_all_reduces,
)

FIT_SIZES = [4**k for k in range(1, 13)]  # 4 B to 16 MiB, every fourfold: small sizes give alpha, large ones beta


def launch_environment(args, threads: int | None = None) -> dict:
    """What every launch adds to this process's environment: GPUs hidden under ``--cpu``, ``threads`` (else
    ``--threads``) intra-op threads."""
    extra = {}
    if args.cpu:
        extra["CUDA_VISIBLE_DEVICES"] = ""
    if threads or args.threads:
        extra["OMP_NUM_THREADS"] = str(threads or args.threads)
    return extra


def measure(nproc: int, batch_size: int, args, threads: int | None = None) -> dict:
    """Train solutions/01_ddp_basic.py on ``nproc`` processes with ``batch_size`` per process (and ``threads``
    intra-op threads each, else ``--threads`` or torchrun's); its figures."""
    metrics = run_for_json(
        "solutions/01_ddp_basic.py",
        *("--dataset", args.dataset, "--model", args.model, "--epochs", args.epochs, "--batch-size", batch_size),
        json_option="--metrics-file",
        nproc=nproc,
        env_extra=launch_environment(args, threads),
    )
    epochs = metrics["history"][1:] or metrics["history"]
    samples_per_second = sum(e["samples"] for e in epochs) / sum(e["seconds"] for e in epochs)
    return {
        "nproc": nproc,
        "backend": metrics["backend"],
        "device": metrics["device"],
        "batch_size_per_process": batch_size,
        "samples_per_second": samples_per_second,
        "step_seconds": batch_size * nproc / samples_per_second,  # one optimizer step: the global batch
        "accuracy": metrics["final_test_accuracy"],
    }


def measure_communication(nproc: int, args) -> dict:
    """The alpha-beta fit of ``dist.all_reduce`` on ``nproc`` processes, and the model's buckets: predicted and
    measured alone. One torchrun launch of this script with ``--fit-only``."""
    measured = run_for_json(
        "benchmarks/ddp_scaling.py",
        *("--model", args.model, "--iterations", args.iterations),
        json_option="--fit-only",
        nproc=nproc,
        env_extra=launch_environment(args),
    )
    fit = fit_alpha_beta(measured["sizes_bytes"], measured["seconds"])
    return {
        "nproc": nproc,
        **measured,
        **fit,
        "predicted_s": predict_communication_seconds(measured["bucket_bytes"], fit),
    }


def fit_only(args):
    """Under torchrun: time the all-reduces of ``FIT_SIZES`` and of the model's buckets; rank 0 writes them."""
    with process_group("auto") as env:  # NCCL where every process has a GPU, as solutions/01_ddp_basic.py picks
        buckets = bucket_bytes(MODELS[args.model](), bucket_cap_mb=None)  # 01 leaves DDP's bucket_cap_mb alone
        seconds = time_all_reduce(FIT_SIZES, args.iterations, env.device)
        buckets_alone = time_bucket_all_reduces(buckets, args.iterations, env.device)
        write_json(
            args.fit_only,
            {
                "backend": env.backend,
                "sizes_bytes": FIT_SIZES,
                "seconds": seconds,
                "bucket_bytes": buckets,
                "buckets_alone_s": buckets_alone,
            },
        )


def per_process_batch(mode: str, nproc: int, batch_size: int) -> int:
    """Weak scaling keeps ``batch_size`` per process; strong scaling splits it over the processes."""
    return batch_size if mode == "weak" else batch_size // nproc


def cores_used(nproc: int, args) -> tuple[str, int, int]:
    """How ``nproc`` processes and their threads share the cores: a phrase, the threads in all, the cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # torchrun sets OMP_NUM_THREADS=1 for several processes only; one process alone takes a thread per core
    threads = int(args.threads or os.environ.get("OMP_NUM_THREADS") or (1 if nproc > 1 else cores))
    return f"{nproc} process(es) x {threads} thread(s) on {cores} core(s)", nproc * threads, cores


def main(args):
    if args.fit_only:
        return fit_only(args)
    if args.communication_only:
        print(run_header(), flush=True)
        communication = {nproc: measure_communication(nproc, args) for nproc in sorted(set(args.nproc)) if nproc > 1}
        if not communication:
            raise SystemExit("--communication-only times all-reduces between processes: give --nproc 2 or more")
        return print_communication(communication, args)
    threads = f"{args.threads} thread(s) per process" if args.threads else "torchrun's threads per process"
    setup = (
        f"solutions/01_ddp_basic.py --dataset {args.dataset} --model {args.model} --epochs {args.epochs}; "
        f"{threads}{'; GPUs hidden' if args.cpu else ''}"
    )
    print(run_header(), flush=True)
    print(setup)
    modes = ["weak", "strong"] if args.mode == "both" else [args.mode]
    counts = sorted(set(args.nproc))  # the smallest first: it is every speed-up's baseline
    measured = {}  # (nproc, batch per process) -> row: the 1-process run is the same in both modes
    rows_by_mode = {}
    for mode in modes:
        what = "per process at every count" if mode == "weak" else "in all, split over the processes"
        print(f"\n{mode} scaling: a batch of {args.batch_size} {what}")
        print(
            f"{'processes':>9} {'backend':>7} {'device':>7} {'samples/s':>10} {'speed-up':>8} {'efficiency':>10} "
            f"{'test acc':>8} {'batch/process':>13}"
        )
        rows = []
        for nproc in counts:
            batch_size = per_process_batch(mode, nproc, args.batch_size)
            if (nproc, batch_size) not in measured:
                measured[(nproc, batch_size)] = measure(nproc, batch_size, args)
            rows.append(measured[(nproc, batch_size)])
            row = scaling_efficiency(rows, mode)[-1]
            print(
                f"{nproc:>9} {row['backend']:>7} {row['device']:>7} {row['samples_per_second']:>10,.0f} "
                f"{row['speedup']:>7.2f}x {row['efficiency']:>10.0%} {row['accuracy']:>8.2%} {batch_size:>13}",
                flush=True,
            )
        rows_by_mode[mode] = scaling_efficiency(rows, mode)

    communication = {nproc: measure_communication(nproc, args) for nproc in counts if nproc > 1}
    print_communication(communication, args)
    controls = measure_controls(rows_by_mode, measured, args)
    print_limits(rows_by_mode, communication, controls)
    if args.plot:
        plot_scaling(rows_by_mode, args.plot, f"DDP, {args.model} on {args.dataset}")
        print(f"\nplot: {args.plot}")
    if args.json:
        all_rows = [row for rows in rows_by_mode.values() for row in rows]
        figures = {"setup": setup, "rows": all_rows, "communication": list(communication.values())}
        figures["controls"] = [{"nproc": n, "batch": batch, **run} for (n, batch), run in controls.items()]
        args.json.write_text(json.dumps(figures, indent=2))


def print_communication(communication: dict, args):
    """The alpha-beta fit at each count, and the buckets' all-reduce time per step: predicted and measured alone."""
    if not communication:
        return
    buckets = next(iter(communication.values()))["bucket_bytes"]
    print(
        f"\ndist.all_reduce, fitted t(n) = alpha + beta n over {FIT_SIZES[0]} B to {FIT_SIZES[-1] // 2**20} MiB "
        f"(median of {args.iterations}); {args.model}'s {len(buckets)} DDP bucket(s): "
        f"{', '.join(f'{size:,}' for size in buckets)} bytes"
    )
    print(
        f"{'processes':>9} {'backend':>7} {'alpha ms':>9} {'1/beta GB/s':>11} {'predicted ms/step':>17} "
        f"{'measured, buckets alone ms/step':>31}"
    )
    for nproc, row in communication.items():
        print(
            f"{nproc:>9} {row['backend']:>7} {row['alpha_s'] * 1e3:>9.3f} {row['bandwidth_gb_s']:>11.2f} "
            f"{row['predicted_s'] * 1e3:>17.3f} {row['buckets_alone_s'] * 1e3:>31.3f}"
        )
    for nproc, row in communication.items():
        print_residuals(nproc, row, args)


def print_residuals(nproc: int, row: dict, args):
    """How far each measured all-reduce lies from the fitted line, and the model's buckets beside it; then the
    fit's 1/beta as algorithm and bus bandwidth."""
    fit = {key: row[key] for key in ("alpha_s", "beta_s_per_byte")}
    print(f"\n{nproc} processes: each size measured against the fit (residual = measured / fitted)")
    print(f"{'bytes':>12} {'measured ms':>11} {'fitted ms':>9} {'residual':>8}")
    residuals = fit_residuals(row["sizes_bytes"], row["seconds"], fit)
    for size, seconds, residual in zip(row["sizes_bytes"], row["seconds"], residuals):
        fitted = fit["alpha_s"] + fit["beta_s_per_byte"] * size
        print(f"{size:>12,} {seconds * 1e3:>11.3f} {fitted * 1e3:>9.3f} {residual:>7.2f}x")
    buckets = row["bucket_bytes"]
    print(
        f"{args.model}'s {len(buckets)} bucket(s), {sum(buckets):,} bytes, back to back: measured "
        f"{row['buckets_alone_s'] * 1e3:.3f} ms, fitted {row['predicted_s'] * 1e3:.3f} ms, residual "
        f"{row['buckets_alone_s'] / row['predicted_s']:.2f}x"
    )
    bus = bus_bandwidth_gb_s(row["bandwidth_gb_s"], nproc)
    print(
        f"1/beta = {row['bandwidth_gb_s']:.2f} GB/s of the tensor's bytes (algorithm bandwidth); x 2(N-1)/N = "
        f"{bus:.2f} GB/s bus bandwidth at {nproc} processes"
    )


def measure_controls(rows_by_mode: dict, measured: dict, args) -> dict:
    """The control of every count above 1, keyed by (count, batch per process): one process alone with the
    threads and the batch of one of that count's processes. A 1-process scaling run with the same threads and
    batch serves as it; else one more launch, once per (threads, batch)."""
    _, baseline_threads, _ = cores_used(1, args)
    runs, controls = {}, {}
    for rows in rows_by_mode.values():
        for row in rows:
            if row["nproc"] == 1:
                continue
            threads = cores_used(row["nproc"], args)[1] // row["nproc"]
            batch = row["batch_size_per_process"]
            if (threads, batch) not in runs:
                same = measured.get((1, batch)) if threads == baseline_threads else None
                runs[threads, batch] = {"threads": threads, **(same or measure(1, batch, args, threads=threads))}
            controls[row["nproc"], batch] = runs[threads, batch]
    return controls


def step_parts(row: dict, ideal: float, communication: dict, control: dict) -> dict:
    """What the step of ``row`` lost against ``ideal`` (seconds), in measured parts that add up to it:

    - ``alone``: the control's step (one process alone, the threads and batch of one of these) minus the ideal;
    - ``all_reduces``: the step's buckets all-reduced back to back, measured with nothing else running;
    - ``together``: the rest, which neither explains: the processes running at once (sharing cores, memory
      bandwidth, gloo's threads), less any communication that backward hid (it can be negative).

    Also ``predicted`` (the alpha-beta fit's all-reduce time) and ``largest``: the name of the largest part."""
    lost = row["step_seconds"] - ideal
    parts = {"alone": control["step_seconds"] - ideal, "all_reduces": communication["buckets_alone_s"]}
    parts["together"] = lost - parts["alone"] - parts["all_reduces"]
    largest = max(parts, key=parts.get)
    return {"lost": lost, **parts, "predicted": communication["predicted_s"], "largest": largest}


PART_NAMES = {
    "alone": "one process alone with these threads and this batch (the control)",
    "all_reduces": "the all-reduces, measured alone",
    "together": "the processes running together (neither of the others)",
}


def print_limits(rows_by_mode: dict, communication: dict, controls: dict):
    """Each step's time against the ideal, and what it lost split into measured parts (``step_parts``)."""
    print("\nwhere a step's time goes, ms (ideal: weak, the 1-process step; strong, the 1-process step / N)")
    print(
        f"{'mode':>6} {'processes':>9} {'step':>8} {'ideal':>8} {'lost':>8} {'control':>8} {'alone':>8} "
        f"{'all-reduces':>11} {'together':>8} {'predicted':>9} {'efficiency':>10}"
    )
    findings = []
    for mode, rows in rows_by_mode.items():
        first = rows[0]
        for row in rows:
            nproc = row["nproc"]
            # The smallest count taken as perfectly efficient: weak, the same step time; strong, N times faster.
            ideal = first["step_seconds"] if mode == "weak" else first["step_seconds"] * first["nproc"] / nproc
            line = f"{mode:>6} {nproc:>9} {row['step_seconds'] * 1e3:>8.2f} {ideal * 1e3:>8.2f}"
            if nproc == 1 or nproc not in communication:
                print(f"{line} {(row['step_seconds'] - ideal) * 1e3:>8.2f} {'':>58} {row['efficiency']:>10.0%}")
                continue
            control = controls[nproc, row["batch_size_per_process"]]
            parts = step_parts(row, ideal, communication[nproc], control)
            print(
                f"{line} {parts['lost'] * 1e3:>8.2f} {control['step_seconds'] * 1e3:>8.2f} "
                f"{parts['alone'] * 1e3:>8.2f} {parts['all_reduces'] * 1e3:>11.3f} {parts['together'] * 1e3:>8.2f} "
                f"{parts['predicted'] * 1e3:>9.3f} {row['efficiency']:>10.0%}"
            )
            findings.append(f"{mode} scaling, {nproc} processes: " + describe_parts(row, parts, control))
    if findings:
        print("\n" + "\n".join(findings))


def describe_parts(row: dict, parts: dict, control: dict) -> str:
    """``step_parts`` in a sentence: the efficiency, the ms lost, each part's ms and share of it, the largest."""
    efficiency = f"efficiency {row['efficiency']:.0%}"
    if parts["lost"] <= 0:
        return f"{efficiency}, at or above the ideal: nothing lost to split"
    shares = "; ".join(
        f"{PART_NAMES[name]} {parts[name] * 1e3:.2f} ms ({parts[name] / parts['lost']:.0%})"
        for name in ("alone", "all_reduces", "together")
    )
    return (
        f"{efficiency}; of the {parts['lost'] * 1e3:.2f} ms lost per step: {shares} (the fit predicted "
        f"{parts['predicted'] * 1e3:.2f} ms of all-reduces; control: 1 process x {control['threads']} thread(s), "
        f"batch {control['batch_size_per_process']}); largest: {PART_NAMES[parts['largest']]}"
    )


def parse_args(argv=None):
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=positive_int, nargs="+", default=[1, 2])
    parser.add_argument("--dataset", default="synthetic")
    parser.add_argument("--model", default="lenet")
    parser.add_argument("--epochs", type=positive_int, default=3)
    parser.add_argument(
        "--batch-size", type=positive_int, default=64, help="per process (weak), or global, split over N (strong)"
    )
    parser.add_argument(
        "--mode",
        choices=["weak", "strong", "both"],
        default="weak",
        help="weak: batch per process fixed; strong: global batch fixed",
    )
    parser.add_argument("--iterations", type=positive_int, default=10, help="timed all-reduces per size (median)")
    parser.add_argument("--cpu", action="store_true", help="hide the GPUs: gloo on CPU cores")
    parser.add_argument("--threads", type=int, help="intra-op threads per process (OMP_NUM_THREADS), at every count")
    parser.add_argument("--plot", type=Path, help="plot speed-up and efficiency against the process count to this PNG")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    parser.add_argument(
        "--communication-only",
        action="store_true",
        help="only time and fit the all-reduce at each --nproc above 1, with its residuals: no training",
    )
    parser.add_argument("--fit-only", type=Path, help=argparse.SUPPRESS)  # internal: the torchrun'd all-reduce timing
    args = parser.parse_args(argv)
    if args.mode in ("strong", "both"):
        uneven = [nproc for nproc in args.nproc if args.batch_size % nproc]
        if uneven:
            parser.error(
                f"--mode {args.mode}: strong scaling splits the global batch of --batch-size {args.batch_size} over "
                f"the processes, and {args.batch_size} does not divide by {', '.join(map(str, uneven))} "
                "(pick a batch size that every --nproc divides)"
            )
    return args


if __name__ == "__main__":
    main(parse_args())
