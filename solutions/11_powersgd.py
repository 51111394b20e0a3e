"""Lab 11 (lesson 10): gradient compression with DDP communication hooks: bf16 and PowerSGD, by hand and torch's.

DDP all-reduces each bucket of gradients; a communication hook replaces that all-reduce. This script trains with
one of four hooks: the plain all-reduce and bf16 compression (by hand), PowerSGD by hand (each weight matrix sent
as two thin matrices P and Q, with error feedback), or torch's ``powerSGD_hook``. It prints the bytes one step
sends once PowerSGD is on, against the plain all-reduce's.

    # CPU, 2 processes (gloo), digits, LeNet: PowerSGD rank 2 by hand, from step 10
    torchrun --standalone --nproc_per_node=2 solutions/11_powersgd.py --dataset digits

    # what error feedback is for: the same without it (compare the accuracy), and rank 1
    torchrun --standalone --nproc_per_node=2 solutions/11_powersgd.py --dataset digits --no-error-feedback
    torchrun --standalone --nproc_per_node=2 solutions/11_powersgd.py --dataset digits --matrix-rank 1

    # the baselines, and torch's hook with the same settings
    torchrun --standalone --nproc_per_node=2 solutions/11_powersgd.py --dataset digits --hook allreduce
    torchrun --standalone --nproc_per_node=2 solutions/11_powersgd.py --dataset digits --hook bf16
    torchrun --standalone --nproc_per_node=2 solutions/11_powersgd.py --dataset digits --hook torch-powersgd

    # a checkpoint after every epoch, with each rank's hook state; run again with more epochs to resume
    torchrun --standalone --nproc_per_node=2 solutions/11_powersgd.py --dataset digits --epochs 2 \
        --checkpoint-dir checkpoints/powersgd
    torchrun --standalone --nproc_per_node=2 solutions/11_powersgd.py --dataset digits --epochs 4 \
        --checkpoint-dir checkpoints/powersgd

    # 4 GPUs (NCCL is picked by itself), Fashion-MNIST; DeepMLP's 512 x 512 matrices compress 100x at rank 2
    torchrun --standalone --nproc_per_node=4 solutions/11_powersgd.py --model mlp

The hooks are written out in common/compression.py (lesson 10 shows them in full); labs/11_powersgd.py leaves
PowerSGD's two products, the orthogonalisation and the error feedback to you. PowerSGD keeps memory between
steps (each rank's error, the Q's, the step count): ``--checkpoint-dir`` saves it with the model, one file per
rank, since each rank's error is its own.
"""

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from common.checkpoint import atomic_write, load_checkpoint, save_checkpoint
from common.cli import non_negative_float, options_line, positive_int
from common.collectives import count_collectives
from common.compression import PowerSGDByHand, allreduce_hook_by_hand, bf16_compress_hook_by_hand

# BEGIN LAB: orthonormal columns by Gram-Schmidt, in place
from common.compression import orthogonalize, powersgd_hook_by_hand  # noqa: F401  # isort: skip

# END LAB
from common.distributed import ConfigurationError, print0, process_group, set_seed
from common.memory import local_bytes
from common.models import MODELS
from common.training import TrainingHistory, finish_run, make_loaders, progress_bar, training_arguments

HOOKS = ("powersgd", "torch-powersgd", "allreduce", "bf16")


def parse_args(argv=None):
    parser = training_arguments(__doc__.splitlines()[0])
    parser.add_argument("--hook", choices=HOOKS, default="powersgd", help="powersgd, allreduce, bf16: by hand")
    parser.add_argument("--matrix-rank", type=positive_int, default=2, help="r: columns of P and Q")
    parser.add_argument(
        "--start-iter", type=positive_int, default=10, help="plain all-reduce for this many steps first (>= 2)"
    )
    parser.add_argument(
        "--min-compression-rate",
        type=non_negative_float,
        default=2.0,
        help="compress a matrix only if this many times fewer numbers travel",
    )
    parser.add_argument(
        "--error-feedback", action=argparse.BooleanOptionalAction, default=True, help="add last step's error"
    )
    parser.add_argument(
        "--warm-start", action=argparse.BooleanOptionalAction, default=True, help="start from last step's Q"
    )
    parser.add_argument("--checkpoint-dir", type=Path, help="save after every epoch; resume from it if there")
    return parser.parse_args(argv)


def main(args):
    with process_group(args.backend) as env:  # torchrun's RANK, WORLD_SIZE...; left on errors too
        train(args, env)


def register_hook(net: DDP, args):
    """Register ``--hook`` on ``net`` (once, before the first backward pass); return PowerSGD's state (or ``None``)."""
    settings = dict(
        matrix_approximation_rank=args.matrix_rank,
        start_powerSGD_iter=args.start_iter,
        min_compression_rate=args.min_compression_rate,
        use_error_feedback=args.error_feedback,
        warm_start=args.warm_start,
        random_seed=args.seed,
    )
    if args.hook == "allreduce":
        net.register_comm_hook(None, allreduce_hook_by_hand)
        return None
    if args.hook == "bf16":
        net.register_comm_hook(None, bf16_compress_hook_by_hand)
        return None
    if args.hook == "torch-powersgd":
        state = powerSGD_hook.PowerSGDState(None, **settings)
        net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return state
    state = PowerSGDByHand(None, **settings)
    net.register_comm_hook(state, powersgd_hook_by_hand)
    return state


def train(args, env):
    print0(f"{env.summary} | {options_line(args)}")
    if (args.error_feedback or args.warm_start) and args.start_iter < 2 and "powersgd" in args.hook:
        raise ConfigurationError("error: --start-iter must be at least 2 with error feedback or warm start")
    if args.checkpoint_dir and args.hook == "torch-powersgd":
        raise ConfigurationError(
            "error: --checkpoint-dir with --hook powersgd (by hand): torch's PowerSGDState keeps its memory per "
            "bucket, in a layout a resumed DDP does not have at its first step (lesson 10)"
        )
    model_class = MODELS[args.model]
    data, train_iter, test_iter = make_loaders(args, env, model_class)
    set_seed(args.seed)
    model = model_class(num_classes=data.num_classes).to(env.device)
    # On gloo torch's hook gets the model in one bucket: with two, its chained all-reduces can start in another order
    # on each rank (common/compression.py).
    one_bucket = args.hook == "torch-powersgd" and env.backend == "gloo"
    bucket_cap_mb = local_bytes(model.parameters()) / 2**20 + 1 if one_bucket else None
    net = DDP(model, device_ids=env.device_ids, bucket_cap_mb=bucket_cap_mb)
    set_seed(args.seed, env.rank)
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    state = register_hook(net, args)

    history = TrainingHistory(env, args.epochs)
    first_epoch, step = 0, 0
    if args.checkpoint_dir and (args.checkpoint_dir / "checkpoint.pt").exists():
        first_epoch, step = resume(args, env, net, optimizer, state)
    bytes_per_step = {}
    for epoch in range(first_epoch, args.epochs):
        train_iter.sampler.set_epoch(epoch)
        history.start_epoch()
        batches = progress_bar(train_iter, f"epoch {epoch + 1}/{args.epochs}")
        loss_sum, samples, step = train_one_epoch(net, batches, optimizer, env.device, step, args, bytes_per_step)
        history.end_epoch(epoch + 1, net, loss_sum, samples, test_iter)
        if args.checkpoint_dir:
            save(args, env, net, optimizer, state, epoch + 1, step)
    finish_run(net, history, args, hook=args.hook, matrix_rank=args.matrix_rank, **bytes_per_step)


def train_one_epoch(net, batches, optimizer, device, step, args, bytes_per_step):
    """One pass over this rank's batches; returns the summed loss, the samples and the global step count. At step
    ``--start-iter`` (the first one the PowerSGD hooks compress) rank 0 prints the all-reduces of the step."""
    net.train()
    loss_sum, samples = torch.zeros((), device=device), 0
    for X, y in batches:
        X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(X), y)
        with count_collectives() as log:  # the hooks are Python: their dist.all_reduce calls are seen
            loss.backward()  # DDP calls the hook once per bucket; it waits for their futures before returning
        if step == args.start_iter:
            sent, plain = log.bytes("all_reduce"), local_bytes(net.module.parameters())
            bytes_per_step.update(bytes_sent_per_step=sent, plain_bytes_per_step=plain)
            print0(
                f"step {step}: {log.count('all_reduce')} all-reduce(s), {sent / 2**20:.4f} MiB sent against "
                f"{plain / 2**20:.4f} MiB of gradients: {plain / sent:.1f}x fewer bytes"
            )
        optimizer.step()
        loss_sum += loss.detach() * len(y)
        samples += len(y)
        step += 1
    return loss_sum, samples, step


def hook_state_file(directory: Path, rank: int) -> Path:
    return directory / f"hook_rank{rank}.pt"


def save(args, env, net, optimizer, state, epoch: int, step: int) -> None:
    """Every rank writes its hook state (its error is its own); then rank 0 the model and optimizer, and a
    barrier. The hook files come first: a ``checkpoint.pt`` on disk means they are all there."""
    if isinstance(state, PowerSGDByHand):
        hook_state = {"hook": args.hook, "world_size": env.world_size, **state.state_dict(net.module)}
        atomic_write(hook_state_file(args.checkpoint_dir, env.rank), lambda file: torch.save(hook_state, file))
        dist.barrier()
    save_checkpoint(args.checkpoint_dir / "checkpoint.pt", net, optimizer, epoch, step)
    print0(f"checkpoint: epoch {epoch}, step {step} in {args.checkpoint_dir}")


def resume(args, env, net, optimizer, state) -> tuple[int, int]:
    """Load the model, optimizer and this rank's hook state; return the epoch and step to go on from."""
    where = load_checkpoint(args.checkpoint_dir / "checkpoint.pt", net, optimizer, env.device)
    if isinstance(state, PowerSGDByHand):
        # Every rank checks every rank's file: one rank failing alone would leave the others waiting in a collective.
        missing = [r for r in range(env.world_size) if not hook_state_file(args.checkpoint_dir, r).exists()]
        if missing:
            raise ConfigurationError(
                f"error: {args.checkpoint_dir} has no PowerSGD state for rank(s) {missing}: it was written by "
                "another --hook, by fewer processes, or a file was lost; without it the run would not be the same"
            )
        saved = torch.load(hook_state_file(args.checkpoint_dir, env.rank), map_location=env.device, weights_only=True)
        if saved["world_size"] != env.world_size:
            raise ConfigurationError(
                f"error: the hook state was saved by {saved['world_size']} processes, this run has {env.world_size}"
            )
        state.load_state_dict(saved, net.module)
    print0(f"resumed from {args.checkpoint_dir}: epoch {where['epoch']}, step {where['step']}")
    return where["epoch"], where["step"]


if __name__ == "__main__":
    main(parse_args())
