"""Lab 01 (lesson 03): train with DistributedDataParallel.

One process per device. Each process holds a full copy of the model, trains on its own shard of every epoch
(``DistributedSampler``), and DDP averages the gradients across processes during ``backward()``, so every
copy takes the same optimizer step and the copies never drift apart.

    # CPU, 2 processes (gloo), scikit-learn's bundled digits: runs offline
    torchrun --standalone --nproc_per_node=2 solutions/01_ddp_basic.py --dataset digits

    # 4 GPUs on one machine (NCCL is picked by itself), Fashion-MNIST downloaded into ./data
    torchrun --standalone --nproc_per_node=4 solutions/01_ddp_basic.py

    # one process, no launcher: a world of one
    python solutions/01_ddp_basic.py --dataset digits

    # save a checkpoint every epoch, and later continue from it
    torchrun --standalone --nproc_per_node=2 solutions/01_ddp_basic.py --dataset digits --epochs 2 \
        --checkpoint-dir checkpoints/ddp
    torchrun --standalone --nproc_per_node=2 solutions/01_ddp_basic.py --dataset digits --epochs 4 \
        --checkpoint-dir checkpoints/ddp --resume
"""

import argparse
import time
from itertools import islice
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from common.checkpoint import load_checkpoint, save_checkpoint, write_json
from common.cli import non_negative_int, positive_float, positive_int
from common.data import DATASETS, load_data, make_loader
from common.distributed import (BACKENDS, ConfigurationError, all_reduce_sum, global_mean, is_main, print0,
                                replicas_in_sync, set_seed, setup_distributed, teardown_distributed)
from common.metrics import evaluate, run_summary
from common.models import MODELS


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--dataset", choices=DATASETS, default="fashion-mnist")
    parser.add_argument("--data-dir", default="./data", help="where torchvision data sets are downloaded")
    parser.add_argument("--model", choices=list(MODELS), default="lenet")
    parser.add_argument("--epochs", type=positive_int, default=5)
    parser.add_argument("--batch-size", type=positive_int, default=64,
                        help="per process: the global batch is this times the number of processes")
    parser.add_argument("--lr", type=positive_float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=BACKENDS, default="auto", help="auto: NCCL if every process has a GPU")
    parser.add_argument("--num-workers", type=non_negative_int, default=2,
                        help="loader processes per rank (torchvision data sets)")
    parser.add_argument("--checkpoint-dir", type=Path, help="save a checkpoint here after every epoch")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint in --checkpoint-dir")
    parser.add_argument("--max-steps", type=positive_int, help="end each epoch after this many steps (quick runs)")
    parser.add_argument("--metrics-file", type=Path, help="global rank 0 writes a JSON summary here")
    args = parser.parse_args(argv)
    if args.resume and args.checkpoint_dir is None:
        parser.error("--resume needs --checkpoint-dir")
    return args


def main(args):
    env = setup_distributed(args.backend)
    try:
        train(args, env)
    finally:
        teardown_distributed()  # on errors too: leave the group; the peers learn of it when this process exits


def train(args, env):
    print0(f"{env.world_size} process(es), backend {env.backend}, device {env.device.type} | "
           + " ".join(f"--{key.replace('_', '-')}={value}" for key, value in vars(args).items()))

    # Data: every rank builds the same data set; each sampler hands its rank a disjoint shard.
    model_class = MODELS[args.model]
    data = load_data(args.dataset, args.data_dir, model_class.input_shape)
    loader_options = dict(rank=env.rank, world_size=env.world_size, seed=args.seed,
                          num_workers=args.num_workers, pin_memory=env.device.type == "cuda")
    train_iter = make_loader(data.train, args.batch_size, train=True, **loader_options)
    test_iter = make_loader(data.test, args.batch_size, train=False, **loader_options)

    # Model: the same seed on every rank gives the same initial weights (DDP would broadcast rank 0's anyway).
    set_seed(args.seed)
    net = DDP(model_class(num_classes=data.num_classes).to(env.device),
              device_ids=[env.device] if env.device.type == "cuda" else None)
    set_seed(args.seed, env.rank)  # from here on each rank draws its own random numbers (dropout masks)
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)

    checkpoint = args.checkpoint_dir / "checkpoint.pt" if args.checkpoint_dir else None
    start_epoch, step = 0, 0
    if args.resume:
        if not checkpoint.exists():
            raise ConfigurationError(f"error: --resume, but there is no checkpoint at {checkpoint}")
        state = load_checkpoint(checkpoint, net, optimizer, env.device)
        start_epoch, step = state["epoch"], state["step"]
        print0(f"resumed from {checkpoint}: {start_epoch} epoch(s), {step} step(s) done")

    history = []
    steps_per_epoch = min(len(train_iter), args.max_steps or len(train_iter))
    for epoch in range(start_epoch, args.epochs):
        train_iter.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same permutation on every rank
        start = time.perf_counter()
        loss_sum, samples = train_one_epoch(net, islice(train_iter, steps_per_epoch), optimizer, env.device,
                                            progress=f"epoch {epoch + 1}/{args.epochs}", steps=steps_per_epoch)
        step += steps_per_epoch
        # Reducing the loss waits for every rank's last step, so the clock stops after the real work.
        train_loss = global_mean(loss_sum, samples, env.device)
        seconds = time.perf_counter() - start
        global_samples = int(all_reduce_sum(samples, env.device))
        test = evaluate(net, test_iter, env.device)
        history.append({"epoch": epoch + 1, "train_loss": train_loss, "test_loss": test["loss"],
                        "test_accuracy": test["accuracy"], "seconds": seconds, "samples": global_samples})
        print0(f"epoch {epoch + 1}/{args.epochs}: train loss {train_loss:.4f} | test loss {test['loss']:.4f}, "
               f"accuracy {test['accuracy']:.2%} of {test['count']} | {global_samples / seconds:,.0f} samples/s")
        if checkpoint:
            save_checkpoint(checkpoint, net, optimizer, epoch + 1, step)

    # Every rank applied the same averaged gradients, so the replicas must still be identical, bit for bit.
    in_sync = replicas_in_sync(net)
    print0(f"model replicas identical on all {env.world_size} rank(s): {in_sync}")
    if not history:
        print0(f"nothing to train: the checkpoint has {start_epoch} epoch(s) and --epochs is {args.epochs}")
    if args.metrics_file:
        write_json(args.metrics_file, run_summary(history, env, dataset=args.dataset, model=args.model,
                                                  batch_size_per_process=args.batch_size,
                                                  global_batch_size=args.batch_size * env.world_size,
                                                  replicas_in_sync=in_sync))
        print0(f"metrics written to {args.metrics_file}")


def train_one_epoch(net, batches, optimizer, device, progress: str, steps: int):
    """One pass over this rank's batches; returns the summed loss (a tensor) and the number of samples."""
    net.train()
    loss_sum, samples = torch.zeros((), device=device), 0
    for X, y in tqdm(batches, total=steps, desc=progress, disable=not is_main(), leave=False, mininterval=1.0):
        X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = F.cross_entropy(net(X), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP all-reduces the gradients here, bucket by bucket, while backward runs
        optimizer.step()  # the same averaged gradients on every rank: the replicas stay identical
        loss_sum += loss.detach() * len(y)  # no .item(): that would wait for the GPU at every step
        samples += len(y)
    return loss_sum, samples


if __name__ == "__main__":
    main(parse_args())
