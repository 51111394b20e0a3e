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

from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.checkpoint import load_checkpoint, save_checkpoint
from common.cli import options_line
from common.distributed import ConfigurationError, print0, process_group, set_seed
from common.models import MODELS
from common.training import TrainingHistory, finish_run, make_loaders, progress_bar, training_arguments


def parse_args(argv=None):
    parser = training_arguments(__doc__.splitlines()[0])
    parser.add_argument("--checkpoint-dir", type=Path, help="save a checkpoint here after every epoch")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint in --checkpoint-dir")
    args = parser.parse_args(argv)
    if args.resume and args.checkpoint_dir is None:
        parser.error("--resume needs --checkpoint-dir")
    return args


def main(args):
    with process_group(args.backend) as env:  # torchrun's RANK, WORLD_SIZE...; left on errors too
        train(args, env)


def train(args, env):
    print0(f"{env.summary} | {options_line(args)}")
    # Data: every rank builds the same data set; each sampler hands its rank a disjoint shard.
    model_class = MODELS[args.model]
    data, train_iter, test_iter = make_loaders(args, env, model_class)

    # Model: the same seed on every rank gives the same initial weights (DDP would broadcast rank 0's anyway).
    set_seed(args.seed)
    model = model_class(num_classes=data.num_classes).to(env.device)
    # BEGIN LAB: wrap the model in DistributedDataParallel and call it `net`
    # device_ids: the one GPU this process owns, or None on a CPU (env.device_ids gives either).
    net = DDP(model, device_ids=env.device_ids)
    # END LAB
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

    history = TrainingHistory(env, args.epochs)
    for epoch in range(start_epoch, args.epochs):
        train_iter.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same permutation on every rank
        history.start_epoch()
        loss_sum, samples = train_one_epoch(
            net, progress_bar(train_iter, f"epoch {epoch + 1}/{args.epochs}"), optimizer, env.device
        )
        step += len(train_iter)
        history.end_epoch(epoch + 1, net, loss_sum, samples, test_iter)  # evaluates on the whole test set
        if checkpoint:
            save_checkpoint(checkpoint, net, optimizer, epoch + 1, step)

    if not history.rows:
        print0(f"nothing to train: the checkpoint has {start_epoch} epoch(s) and --epochs is {args.epochs}")
    # Every rank applied the same averaged gradients, so the replicas must still be identical, bit for bit.
    finish_run(
        net, history, args, batch_size_per_process=args.batch_size, global_batch_size=args.batch_size * env.world_size
    )


def train_one_epoch(net, batches, optimizer, device):
    """One pass over this rank's batches; returns the summed loss (a tensor) and the number of samples."""
    # BEGIN LAB: the training step
    # Put the model in training mode, then for each (X, y) batch: move it to `device`, compute the cross-entropy
    # loss, zero the gradients, backward (DDP averages the gradients across ranks here) and take an optimizer
    # step. Keep a running sum of loss * batch size (without .item()) and count the samples.
    net.train()
    loss_sum, samples = torch.zeros((), device=device), 0
    for X, y in batches:
        X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = F.cross_entropy(net(X), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP all-reduces the gradients here, bucket by bucket, while backward runs
        optimizer.step()  # the same averaged gradients on every rank: the replicas stay identical
        loss_sum += loss.detach() * len(y)  # no .item(): that would wait for the GPU at every step
        samples += len(y)
    return loss_sum, samples
    # END LAB


if __name__ == "__main__":
    main(parse_args())
