"""The linear learning-rate scaling rule, measured: a k times larger batch with and without k times the lr.

    python benchmarks/lr_scaling.py                         # digits, 2 processes, 10 epochs
    python benchmarks/lr_scaling.py --epochs 20 --accum-steps 8 --warmup-epochs 3

Four runs of solutions/02_gradient_accumulation.py, each under ``torchrun --standalone``, all for the same
number of epochs (so the large-batch runs take k times fewer optimizer steps):

- the baseline: --batch-size per process, lr;
- k times the batch through --accum-steps k, the same lr;
- k times the batch, k times the lr (the linear scaling rule);
- k times the batch, k times the lr, reached by a linear warm-up over the first --warmup-epochs epochs.

It prints each run's test accuracy after every epoch and writes them to --results-file for plotting.
"""

import json
import tempfile
from pathlib import Path

from common.cli import argument_parser
from common.launch import launch
from common.reports import run_header

DIGITS_TRAIN_SIZE = 1438


def parse_args(argv=None):
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16, help="per process and micro-step")
    parser.add_argument("--accum-steps", type=int, default=4, help="k: the large batch is k times the baseline")
    parser.add_argument("--lr", type=float, default=0.05, help="the baseline's learning rate")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--warmup-epochs", type=int, default=1, help="of the warm-up run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results-file", type=Path, help="write every run's per-epoch figures here (JSON)")
    return parser.parse_args(argv)


def run(name, accum_steps, lr, warmup_steps, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        metrics_file = Path(tmp) / "metrics.json"
        launch(
            "solutions/02_gradient_accumulation.py",
            "--dataset",
            "digits",
            "--batch-size",
            args.batch_size,
            "--grad-accum-steps",
            accum_steps,
            "--lr",
            lr,
            "--warmup-steps",
            warmup_steps,
            "--epochs",
            args.epochs,
            "--seed",
            args.seed,
            "--metrics-file",
            metrics_file,
            nproc=args.nproc,
        )
        metrics = json.loads(metrics_file.read_text())
    history = metrics["history"]
    return {
        "name": name,
        "effective_batch": metrics["effective_batch_size"],
        "lr": lr,
        "warmup_steps": warmup_steps,
        "optimizer_steps": sum(epoch["optimizer_steps"] for epoch in history),
        "test_accuracy": [epoch["test_accuracy"] for epoch in history],
        "train_loss": [epoch["train_loss"] for epoch in history],
    }


def main(args):
    k = args.accum_steps
    batches_per_rank = -(-DIGITS_TRAIN_SIZE // args.nproc // args.batch_size)
    steps_per_epoch = -(-batches_per_rank // k)
    runs = [
        ("baseline", 1, args.lr, 0),
        (f"{k}x batch, same lr", k, args.lr, 0),
        (f"{k}x batch, {k}x lr", k, k * args.lr, 0),
        (f"{k}x batch, {k}x lr, warm-up", k, k * args.lr, args.warmup_epochs * steps_per_epoch),
    ]
    print(run_header(), flush=True)
    print(
        f"digits, {args.nproc} processes, {args.batch_size} per process and micro-step, {args.epochs} epochs, "
        f"seed {args.seed}"
    )
    print(f"{'run':>26} {'batch':>5} {'lr':>5} {'warm-up':>7} {'steps':>5} {'final acc':>9} {'best acc':>8}")
    results = []
    for name, accum_steps, lr, warmup_steps in runs:
        result = run(name, accum_steps, lr, warmup_steps, args)
        results.append(result)
        print(
            f"{name:>26} {result['effective_batch']:>5} {lr:>5.2f} {warmup_steps:>7} {result['optimizer_steps']:>5} "
            f"{result['test_accuracy'][-1]:>9.2%} {max(result['test_accuracy']):>8.2%}",
            flush=True,
        )
    if args.results_file:
        args.results_file.parent.mkdir(parents=True, exist_ok=True)
        args.results_file.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main(parse_args())
