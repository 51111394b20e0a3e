"""What every training script after lesson 03 shares: its options, its loaders, the end of an epoch and of a run.

``solutions/01_ddp_basic.py`` writes all of this out in full, once, where lesson 03 teaches it. Later solutions
import it from here, so that each script shows only what its own lesson adds (accumulation, mixed precision).
"""

import argparse
import time
from pathlib import Path

from common.checkpoint import write_json
from common.cli import non_negative_int, positive_float, positive_int
from common.data import DATASETS, load_data, make_loader
from common.distributed import BACKENDS, all_reduce_sum, global_mean, print0, replicas_in_sync
from common.metrics import evaluate, run_summary
from common.models import MODELS


def training_arguments(description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every training script has; a script adds its own to it."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--dataset", choices=DATASETS, default="fashion-mnist")
    parser.add_argument("--data-dir", default="./data", help="where torchvision data sets are downloaded")
    parser.add_argument("--model", choices=list(MODELS), default="lenet")
    parser.add_argument("--epochs", type=positive_int, default=5)
    parser.add_argument("--batch-size", type=positive_int, default=64,
                        help="per process and micro-step: the global batch is this times the number of processes")
    parser.add_argument("--lr", type=positive_float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=BACKENDS, default="auto", help="auto: NCCL if every process has a GPU")
    parser.add_argument("--num-workers", type=non_negative_int, default=2,
                        help="loader processes per rank (torchvision data sets)")
    parser.add_argument("--max-steps", type=positive_int, help="end each epoch after this many batches (quick runs)")
    parser.add_argument("--metrics-file", type=Path, help="global rank 0 writes a JSON summary here")
    return parser


def make_loaders(args, env, model_class):
    """The data set named by ``args.dataset`` and its sharded train and test loaders for this rank."""
    data = load_data(args.dataset, args.data_dir, model_class.input_shape)
    options = dict(rank=env.rank, world_size=env.world_size, seed=args.seed, num_workers=args.num_workers,
                   pin_memory=env.device.type == "cuda")
    return (data, make_loader(data.train, args.batch_size, train=True, **options),
            make_loader(data.test, args.batch_size, train=False, **options))


class EpochClock:
    """Times an epoch of training and reports it: loss reduced over ranks, exact test figures, samples/s."""

    def __init__(self, env, epochs: int):
        self.env, self.epochs, self.history = env, epochs, []

    def start(self) -> None:
        self.started = time.perf_counter()

    def finish(self, epoch: int, net, loss_sum, samples: int, test_iter, **extra) -> dict:
        """Call on every rank (it reduces and gathers); returns and prints the epoch's figures."""
        # Reducing the loss waits for every rank's last step, so the clock stops after the real work.
        train_loss = global_mean(loss_sum, samples, self.env.device)
        seconds = time.perf_counter() - self.started
        global_samples = int(all_reduce_sum(samples, self.env.device))
        test = evaluate(net, test_iter, self.env.device)
        row = {"epoch": epoch, "train_loss": train_loss, "test_loss": test["loss"],
               "test_accuracy": test["accuracy"], "seconds": seconds, "samples": global_samples, **extra}
        self.history.append(row)
        print0(f"epoch {epoch}/{self.epochs}: train loss {train_loss:.4f} | test loss {test['loss']:.4f}, "
               f"accuracy {test['accuracy']:.2%} of {test['count']} | {global_samples / seconds:,.0f} samples/s")
        return row


def finish_run(net, clock: EpochClock, args, **details) -> None:
    """Check that the replicas are still identical, and have global rank 0 write the metrics file."""
    in_sync = replicas_in_sync(net)
    print0(f"model replicas identical on all {clock.env.world_size} rank(s): {in_sync}")
    if args.metrics_file:
        write_json(args.metrics_file, run_summary(clock.history, clock.env, dataset=args.dataset, model=args.model,
                                                  replicas_in_sync=in_sync, **details))
        print0(f"metrics written to {args.metrics_file}")
