"""Lab 09 (lesson 08): DDP built by hand. Train with a naive, an overlapped or a bucketed DDP of your own, or torch's.

    # CPU, 2 processes (gloo), scikit-learn's bundled digits: runs offline
    torchrun --standalone --nproc_per_node=2 solutions/09_ddp_by_hand.py --dataset digits

    # the naive build: one blocking all-reduce per parameter after backward
    torchrun --standalone --nproc_per_node=2 solutions/09_ddp_by_hand.py --dataset digits --ddp naive

    # torch's DistributedDataParallel on the same data, for comparison; 4 GPUs (NCCL) the same way
    torchrun --standalone --nproc_per_node=2 solutions/09_ddp_by_hand.py --dataset digits --ddp torch
    torchrun --standalone --nproc_per_node=4 solutions/09_ddp_by_hand.py --ddp bucketed

``NaiveDDP``, ``OverlappedDDP``, ``BucketedDDP`` and ``assign_buckets`` are written out in
``common/ddp_by_hand.py`` (lesson 08 shows them in full); ``labs/09_ddp_by_hand.py`` leaves their hooks and
buckets to you. The script prints the collectives of one training step (how many all-reduces, how many MB) and,
at the end, whether the replicas are still identical. ``--bucket-cap-mb 0.05`` makes smaller buckets: more
all-reduces, each started earlier in backward.
"""

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.cli import options_line, positive_float
from common.collectives import AllReduceCounter, count_collectives
from common.ddp_by_hand import NaiveDDP

# BEGIN LAB: the hooks and the buckets of common/ddp_by_hand.py
from common.ddp_by_hand import BucketedDDP, OverlappedDDP, assign_buckets  # noqa: F401  # isort: skip

# END LAB
from common.distributed import print0, process_group, set_seed
from common.models import MODELS
from common.training import TrainingHistory, finish_run, make_loaders, progress_bar, training_arguments

BUILDS = ("naive", "overlapped", "bucketed", "torch")


def parse_args(argv=None):
    parser = training_arguments(__doc__.splitlines()[0])
    parser.add_argument("--ddp", choices=BUILDS, default="bucketed", help="torch: DistributedDataParallel")
    parser.add_argument("--bucket-cap-mb", type=positive_float, default=25.0, help="MiB per bucket (bucketed, torch)")
    return parser.parse_args(argv)


def main(args):
    with process_group(args.backend) as env:  # torchrun's RANK, WORLD_SIZE...; left on errors too
        train(args, env)


def wrap(model, args, env):
    """``model`` in the data-parallel wrapper that ``--ddp`` names; every one broadcasts rank 0's weights."""
    if args.ddp == "naive":
        return NaiveDDP(model)
    if args.ddp == "overlapped":
        return OverlappedDDP(model)
    if args.ddp == "bucketed":
        net = BucketedDDP(model, bucket_cap_mb=args.bucket_cap_mb)
        print0(
            f"{len(net.buckets)} bucket(s) of at most {args.bucket_cap_mb} MiB (plus one parameter), in launch order:"
        )
        for bucket in net.buckets:
            print0(f"  {', '.join(bucket)}")
        return net
    return DDP(model, device_ids=env.device_ids, bucket_cap_mb=args.bucket_cap_mb)


def train(args, env):
    print0(f"{env.summary} | {options_line(args)}")
    model_class = MODELS[args.model]
    data, train_iter, test_iter = make_loaders(args, env, model_class)
    set_seed(args.seed)
    net = wrap(model_class(num_classes=data.num_classes).to(env.device), args, env)
    set_seed(args.seed, env.rank)  # from here on each rank draws its own random numbers (dropout masks)
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    # torch's DDP all-reduces from C++, where count_collectives cannot see it: a communication hook counts instead.
    counter = AllReduceCounter.attach(net) if args.ddp == "torch" else None

    history = TrainingHistory(env, args.epochs)
    for epoch in range(args.epochs):
        train_iter.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same permutation on every rank
        history.start_epoch()
        batches = progress_bar(train_iter, f"epoch {epoch + 1}/{args.epochs}")
        loss_sum, samples = train_one_epoch(net, batches, optimizer, env.device, counter, count=epoch == 0)
        history.end_epoch(epoch + 1, net, loss_sum, samples, test_iter)
    # Every rank applied the same averaged gradients, so the replicas must still be identical, bit for bit.
    finish_run(net, history, args, ddp=args.ddp, bucket_cap_mb=args.bucket_cap_mb)


def train_one_epoch(net, batches, optimizer, device, counter=None, count=False):
    """One pass over this rank's batches; returns the summed loss (a tensor) and the number of samples. With
    ``count``, rank 0 prints the collectives of the second step (the first allocates gradients and buckets)."""
    net.train()
    loss_sum, samples = torch.zeros((), device=device), 0
    for step, (X, y) in enumerate(batches):
        X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)  # before forward: BucketedDDP points the gradients at its buckets
        loss = F.cross_entropy(net(X), y)
        with count_collectives() as log:
            if counter:
                counter.reset()
            loss.backward()  # the hooks of the overlapped and bucketed builds start all-reduces here
            if not isinstance(net, DDP):
                net.finish_gradient_synchronization()  # wait for the all-reduces, divide by the world size
        if count and step == 1:
            calls, size = (
                (counter.calls, counter.bytes) if counter else (log.count("all_reduce"), log.bytes("all_reduce"))
            )
            print0(f"one training step: {calls} all-reduce(s), {size / 2**20:.3f} MiB of gradients")
        optimizer.step()  # the same averaged gradients on every rank: the replicas stay identical
        loss_sum += loss.detach() * len(y)  # no .item(): that would wait for the GPU at every step
        samples += len(y)
    return loss_sum, samples


if __name__ == "__main__":
    main(parse_args())
