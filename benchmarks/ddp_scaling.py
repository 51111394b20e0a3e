"""Throughput of solutions/01_ddp_basic.py at several process counts, same batch size per process.

    python benchmarks/ddp_scaling.py                                   # 1 and 2 processes, synthetic data
    python benchmarks/ddp_scaling.py --nproc 1 2 4 --dataset digits --epochs 5
    python benchmarks/ddp_scaling.py --nproc 1 2 4 8 --cpu --threads 1     # gloo on CPU cores, one thread each

Each count runs under ``torchrun --standalone``; the figures come from the metrics file that global rank 0
writes. The first epoch is left out of the throughput (start-up, first-touch allocations) when there are more.
On a CPU the processes share the same cores, so expect little or no speed-up there: the table says what it is.
``--cpu`` hides the GPUs (gloo on CPU even where GPUs exist); ``--threads N`` gives every process N intra-op
threads at every count (torchrun sets 1 only for several processes, so one process would otherwise use them all).
"""

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

from common.launch import REPO, torchrun_command


def measure(nproc: int, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        metrics_file = Path(tmp) / "metrics.json"
        command = torchrun_command(
            REPO / "solutions/01_ddp_basic.py",
            "--dataset",
            args.dataset,
            "--model",
            args.model,
            "--epochs",
            args.epochs,
            "--batch-size",
            args.batch_size,
            "--metrics-file",
            metrics_file,
            nproc=nproc,
        )
        env = dict(os.environ)
        if args.cpu:
            env["CUDA_VISIBLE_DEVICES"] = ""
        if args.threads:
            env["OMP_NUM_THREADS"] = str(args.threads)
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        metrics = json.loads(metrics_file.read_text())
    epochs = metrics["history"][1:] or metrics["history"]
    return {
        "nproc": nproc,
        "backend": metrics["backend"],
        "device": metrics["device"],
        "samples_per_second": sum(e["samples"] for e in epochs) / sum(e["seconds"] for e in epochs),
        "accuracy": metrics["final_test_accuracy"],
    }


def main(args):
    threads = f"{args.threads} thread(s) per process" if args.threads else "torchrun's threads per process"
    setup = (
        f"solutions/01_ddp_basic.py --dataset {args.dataset} --model {args.model} --epochs {args.epochs} "
        f"--batch-size {args.batch_size} (per process); {threads}{'; GPUs hidden' if args.cpu else ''}"
    )
    print(setup)
    print(
        f"{'processes':>9} {'backend':>7} {'device':>7} {'samples/s':>10} {'speed-up':>8} {'efficiency':>10} "
        f"{'test acc':>8}"
    )
    baseline = None
    rows = []
    for nproc in args.nproc:
        row = measure(nproc, args)
        rows.append(row)
        baseline = baseline or row["samples_per_second"] / row["nproc"]
        speedup = row["samples_per_second"] / baseline
        print(
            f"{nproc:>9} {row['backend']:>7} {row['device']:>7} {row['samples_per_second']:>10,.0f} "
            f"{speedup:>7.2f}x {speedup / nproc:>10.0%} {row['accuracy']:>8.2%}",
            flush=True,
        )
        row.update(speedup=speedup, efficiency=speedup / nproc)
    if args.json:
        args.json.write_text(json.dumps({"setup": setup, "rows": rows}, indent=2))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dataset", default="synthetic")
    parser.add_argument("--model", default="lenet")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--cpu", action="store_true", help="hide the GPUs: gloo on CPU cores")
    parser.add_argument("--threads", type=int, help="intra-op threads per process (OMP_NUM_THREADS), at every count")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
