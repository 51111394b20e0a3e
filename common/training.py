"""What every training script shares: its options, its loaders, the progress bar, each epoch's figures, the run's end.

Each solution imports these, so that the script shows what its own lesson adds (DDP in lesson 03, accumulation
in 04, mixed precision in 05, sharding in 06, restarts in 07) and little else. Read one epoch in a solution as:

    train_iter.sampler.set_epoch(epoch)            # the epoch's shuffle, the same permutation on every rank
    history.start_epoch()                          # the clock
    loss_sum, samples = train_one_epoch(net, progress_bar(train_iter, "epoch 1/5"), optimizer, env.device)
    history.end_epoch(epoch + 1, net, loss_sum, samples, test_iter)   # evaluates net, prints, keeps the row
"""

import argparse
import time
from pathlib import Path

import torch
from tqdm import tqdm

from common.cli import argument_parser, non_negative_int, positive_float, positive_int
from common.data import DATASETS, FirstBatches, load_data, make_loader
from common.distributed import BACKENDS, all_reduce_sum, global_mean, is_main, print0, replicas_in_sync
from common.metrics import evaluate, run_summary, write_json
from common.models import MODELS


def training_arguments(description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every training script has; a script adds its own to it."""
    parser = argument_parser(description)
    parser.add_argument("--dataset", choices=DATASETS, default="fashion-mnist")
    parser.add_argument("--data-dir", default="./data", help="where torchvision data sets are downloaded")
    parser.add_argument("--model", choices=list(MODELS), default="lenet")
    parser.add_argument("--epochs", type=positive_int, default=5)
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=64,
        help="per process (and per micro-step): the global batch is this times the number of processes",
    )
    parser.add_argument("--lr", type=positive_float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=BACKENDS, default="auto", help="auto: NCCL if every process has a GPU")
    parser.add_argument(
        "--num-workers", type=non_negative_int, default=2, help="loader processes per rank (torchvision data sets)"
    )
    parser.add_argument(
        "--max-batches-per-epoch",
        type=positive_int,
        help="end each epoch after this many batches on every process (under --grad-accum-steps, "
        "micro-batches, not optimizer steps); for quick runs",
    )
    parser.add_argument("--metrics-file", type=Path, help="global rank 0 writes a JSON summary here")
    return parser


def accumulation_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add lesson 04's options to ``parser``: micro-batches per optimizer step, gradient clipping, warm-up."""
    parser.add_argument(
        "--grad-accum-steps", type=positive_int, default=1, help="micro-batches per optimizer step on every process"
    )
    parser.add_argument(
        "--clip-grad-norm",
        type=positive_float,
        help="clip the global norm of the averaged (and unscaled) gradients to this, before each step",
    )
    parser.add_argument(
        "--warmup-steps",
        type=non_negative_int,
        default=0,
        help="optimizer steps over which the learning rate rises linearly to --lr",
    )
    return parser


def accumulation_details(args, world_size: int) -> dict:
    """Lesson 04's settings for the run's summary (``finish_run``): the batch per process and per optimizer step
    (the effective batch: batch size x micro-steps x processes), the learning rate, warm-up and clipping."""
    return {
        "batch_size_per_process": args.batch_size,
        "grad_accum_steps": args.grad_accum_steps,
        "effective_batch_size": args.batch_size * args.grad_accum_steps * world_size,
        "lr": args.lr,
        "warmup_steps": args.warmup_steps,
        "clip_grad_norm": args.clip_grad_norm,
    }


def linear_warmup(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A scheduler that multiplies the learning rate by 1/w, 2/w, ... up to 1 after w = ``warmup_steps + 1`` steps,
    then leaves it constant. Step it once per optimizer step, so that warm-up counts optimizer steps."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / (warmup_steps + 1)))


def make_loaders(args, env, model_class):
    """The data set named by ``args.dataset``, and this rank's loaders of it: ``(data, train_iter, test_iter)``.

    Every rank builds the same data set; each loader's ``DistributedSampler`` hands its rank a disjoint shard.
    The train loader ends each epoch after ``--max-batches-per-epoch`` batches (``FirstBatches``); the test loader
    covers its whole shard, so that evaluation always scores the whole test set.
    """
    data = load_data(args.dataset, args.data_dir, model_class.input_shape)
    options = dict(
        rank=env.rank,
        world_size=env.world_size,
        seed=args.seed,
        num_workers=args.num_workers,
        pin_memory=env.device.type == "cuda",
    )
    train_iter = FirstBatches(
        make_loader(data.train, args.batch_size, train=True, **options), args.max_batches_per_epoch
    )
    return data, train_iter, make_loader(data.test, args.batch_size, train=False, **options)


def progress_bar(batches, description: str):
    """``batches`` with a progress bar on global rank 0 only, redrawn at most once a second, gone when done."""
    return tqdm(batches, desc=description, disable=not is_main(), leave=False, mininterval=1.0)


class TrainingHistory:
    """A run's epochs, one row each: time, train loss over all ranks, samples, and the test figures it evaluates.

    ``start_epoch`` starts the clock; ``end_epoch`` stops it, evaluates the model on the whole test set, prints the
    epoch's line on rank 0 and keeps the row in ``rows`` (what ``run_summary`` reads).
    """

    def __init__(self, env, epochs: int):
        self.env, self.epochs, self.rows = env, epochs, []

    def start_epoch(self) -> None:
        """Start the epoch's clock (call on every rank, after ``sampler.set_epoch``)."""
        self.started = time.perf_counter()

    def end_epoch(self, epoch: int, net, loss_sum, samples: int, test_iter, **extra) -> dict:
        """Stop the clock, evaluate ``net`` on ``test_iter``, print and keep the epoch's row (plus ``extra``).

        Call on every rank: it reduces the train loss and the samples, and evaluation gathers.
        """
        # Reducing the loss waits for every rank's last step, so the clock stops after the real work.
        train_loss = global_mean(loss_sum, samples, self.env.device)
        seconds = time.perf_counter() - self.started
        global_samples = int(all_reduce_sum(samples, self.env.device))
        test = evaluate(net, test_iter, self.env.device)
        row = {
            "epoch": epoch,
            "train_loss": train_loss,
            "test_loss": test["loss"],
            "test_accuracy": test["accuracy"],
            "seconds": seconds,
            "samples": global_samples,
            **extra,
        }
        self.rows.append(row)
        print0(
            f"epoch {epoch}/{self.epochs}: train loss {train_loss:.4f} | test loss {test['loss']:.4f}, "
            f"accuracy {test['accuracy']:.2%} of {test['count']} | {global_samples / seconds:,.0f} samples/s"
        )
        return row


def finish_run(net, history: TrainingHistory, args, **details) -> None:
    """Check that the replicas are still identical (call on every rank), then ``write_metrics``."""
    in_sync = replicas_in_sync(net)
    print0(f"model replicas identical on all {history.env.world_size} rank(s): {in_sync}")
    write_metrics(history, args, replicas_in_sync=in_sync, **details)


def write_metrics(history: TrainingHistory, args, **details) -> None:
    """Have global rank 0 write the run's ``run_summary`` to ``--metrics-file``, if one was given."""
    if args.metrics_file:
        write_json(
            args.metrics_file, run_summary(history.rows, history.env, dataset=args.dataset, model=args.model, **details)
        )
        print0(f"metrics written to {args.metrics_file}")
