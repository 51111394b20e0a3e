"""Lab 03 (lesson 06): shard the model with FSDP2 (ZeRO-3), and checkpoint it in shards with DCP.

YOUR TASK: fill in the three TODOs. In ``shard_model``, shard the model with ``fully_shard``: each block of
``model.blocks``, then the root, on the mesh, honouring ``--sharding``, ``--precision`` and ``--cpu-offload``. In
``save_checkpoint`` and ``load_checkpoint``, save and load the sharded model and optimizer with
``torch.distributed.checkpoint``, in a way that a run at another world size can load. Everything else (DDP for
``--sharding none``, loaders, the loop, evaluation, memory figures, metrics) is done for you. Check your work with

    LAB_TARGET=labs .venv/bin/python -m pytest tests/labs/test_03_fsdp.py

Every rank holds 1/N of each parameter, of its gradient and of Adam's states (DTensor shards). A block's full
parameters exist only while it computes: FSDP2 all-gathers them before the block runs and reduce-scatters
the gradients after its backward. Checkpoints are sharded too (``torch.distributed.checkpoint``): each rank
writes its own shards. Resumed at the same world size, a model without dropout or BatchNorm (the default mlp)
goes on bit-identically; no RNG state is saved, so simplecnn's dropout masks differ after a resume. A run at
another world size loads them exactly, then trains as a run of its own size (the batch is per process).

    # CPU, 2 processes (gloo), digits, the default DeepMLP (1.46 M parameters), fully sharded
    torchrun --standalone --nproc_per_node=2 solutions/03_fsdp.py --dataset digits

    # keep the gathered parameters from forward to backward (ZeRO-2-like), or plain DDP for comparison
    torchrun --standalone --nproc_per_node=2 solutions/03_fsdp.py --dataset digits --sharding grad-op
    torchrun --standalone --nproc_per_node=2 solutions/03_fsdp.py --dataset digits --sharding none

    # 4 GPUs (NCCL is picked by itself), bf16 compute through MixedPrecisionPolicy
    torchrun --standalone --nproc_per_node=4 solutions/03_fsdp.py --precision bf16

    # sharded checkpoints every epoch; resume them at another world size (DCP reshards on load)
    torchrun --standalone --nproc_per_node=2 solutions/03_fsdp.py --dataset digits --epochs 2 \
        --checkpoint-dir checkpoints/fsdp
    python solutions/03_fsdp.py --dataset digits --epochs 3 --checkpoint-dir checkpoints/fsdp --resume

--sharding: full = fully_shard(block, reshard_after_forward=True), FSDP1's FULL_SHARD, ZeRO-3; grad-op =
fully_shard(block, reshard_after_forward=False), FSDP1's SHARD_GRAD_OP: parameters, gradients and optimizer states
are still sharded between steps, but each block's gathered parameters stay from its forward until its backward.
Under both the root keeps FSDP2's default: gathered from its forward to its backward, which begins with it.
none = DistributedDataParallel, every rank a full replica (ZeRO stage 0), the baseline the others are measured
against.
"""

import os
import shutil
from itertools import islice
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from common.checkpoint import write_json
from common.distributed import (is_main, print0, replicas_in_sync, set_seed, setup_distributed,
                                teardown_distributed)
from common.fsdp import (PRECISIONS, checkpoint_path, export_full_state_dict, latest_checkpoint, make_mesh,
                         mixed_precision_policy, reshard)
from common.memory import local_bytes, training_state_bytes, zero_bytes_per_rank
from common.metrics import peak_memory_mib, run_summary
from common.models import MODELS
from common.training import EpochClock, make_loaders, training_arguments

SHARDING = ("full", "grad-op", "none")


def parse_args(argv=None):
    parser = training_arguments(__doc__.splitlines()[0])
    parser.set_defaults(model="mlp", lr=1e-3)  # Adam's usual learning rate; the model whose blocks shard
    parser.add_argument("--sharding", choices=SHARDING, default="full",
                        help="full: ZeRO-3; grad-op: keep gathered parameters until backward; none: DDP")
    parser.add_argument("--precision", choices=list(PRECISIONS), default="fp32",
                        help="bf16: compute in bf16 (MixedPrecisionPolicy); shards and optimizer stay fp32")
    parser.add_argument("--cpu-offload", action="store_true",
                        help="keep shards, gradients and Adam's states in CPU memory (CPUOffloadPolicy)")
    parser.add_argument("--checkpoint-dir", type=Path, help="save a sharded (DCP) checkpoint here after every epoch")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    args = parser.parse_args(argv)
    if args.resume and args.checkpoint_dir is None:
        parser.error("--resume needs --checkpoint-dir")
    if args.precision != "fp32" and args.sharding == "none":
        parser.error("--precision bf16 goes through FSDP2's MixedPrecisionPolicy: use --sharding full or grad-op")
    if args.cpu_offload and args.sharding == "none":
        parser.error("--cpu-offload goes through FSDP2's CPUOffloadPolicy: use --sharding full or grad-op")
    return args


def main(args):
    env = setup_distributed(args.backend)
    try:
        train(args, env)
    finally:
        teardown_distributed()


def shard_model(model, env, sharding: str, precision: str = "fp32", offload: bool = False):
    """Apply the data parallelism that ``sharding`` names to ``model`` (in place); return the model to train.

    ``offload``: FSDP2 keeps the shards, their gradients and Adam's states in CPU memory and steps on the CPU.
    """
    if sharding == "none":
        return DDP(model, device_ids=[env.device] if env.device.type == "cuda" else None)
    mesh = make_mesh(env)  # 1-D: all ranks shard every parameter among themselves
    # TODO: fully_shard each block of model.blocks (if it has them), then the root model, on `mesh`. --sharding
    # full frees a block's gathered parameters after its forward, grad-op keeps them until its backward
    # (reshard_after_forward); the root keeps FSDP2's default for it. --precision picks the policy
    # (common.fsdp.mixed_precision_policy), and offload asks for CPUOffloadPolicy (pin_memory needs a CUDA
    # driver: only on a GPU) instead of OffloadPolicy().
    raise NotImplementedError("shard the model with fully_shard")
    return model


def save_checkpoint(path, net, optimizer, epoch: int, step: int) -> None:
    """Every rank writes its own shards of model and optimizer into folder ``path`` (DCP), with the progress.

    Written under a temporary name that global rank 0 renames once all ranks are done: never half a checkpoint.
    """
    # TODO: write model and optimizer shards and {"epoch": epoch, "step": step} with torch.distributed.checkpoint
    # (get_state_dict gives the sharded state dicts). Write to a temporary folder first; global rank 0 renames it
    # to `path` once every rank has written.
    raise NotImplementedError("save a sharded checkpoint")


def load_checkpoint(path, net, optimizer) -> dict:
    """Load ``save_checkpoint``'s folder into the sharded ``net`` and ``optimizer``; return the progress.

    Any world size: each rank asks DCP for the slices that its own shards cover, whichever ranks wrote them.
    """
    # TODO: load what save_checkpoint wrote into net and optimizer (dcp.load fills state dicts that already have
    # the right sharded layout; set_state_dict puts them in place) and return the progress dict.
    raise NotImplementedError("load a sharded checkpoint")


def train(args, env):
    print0(f"{env.world_size} process(es), backend {env.backend}, device {env.device.type} | sharding "
           f"{args.sharding}, precision {args.precision}, model {args.model}")
    model_class = MODELS[args.model]
    data, train_iter, test_iter = make_loaders(args, env, model_class)

    set_seed(args.seed)  # the same full model on every rank, before it is cut into shards
    model = model_class(num_classes=data.num_classes).to(env.device)
    num_parameters = sum(p.numel() for p in model.parameters())
    net = shard_model(model, env, args.sharding, args.precision, args.cpu_offload)
    set_seed(args.seed, env.rank)
    optimizer = torch.optim.Adam(net.parameters(), lr=args.lr)  # after sharding: it holds the shards' states

    start_epoch, step = 0, 0
    if args.resume and (found := latest_checkpoint(args.checkpoint_dir)) is not None:
        progress = load_checkpoint(found, net, optimizer)
        start_epoch, step = progress["epoch"], progress["step"]
        print0(f"resumed from {found}: {start_epoch} epoch(s), {step} step(s) done")

    clock = EpochClock(env, args.epochs)
    batches_per_epoch = min(len(train_iter), args.max_steps or len(train_iter))
    state_bytes = None
    for epoch in range(start_epoch, args.epochs):
        train_iter.sampler.set_epoch(epoch)
        clock.start()
        loss_sum, samples, state_bytes = train_one_epoch(net, islice(train_iter, batches_per_epoch), optimizer,
                                                         env.device, batches_per_epoch, progress=f"epoch {epoch + 1}")
        step += batches_per_epoch
        clock.finish(epoch + 1, net, loss_sum, samples, test_iter)
        reshard(net)  # evaluation's forwards (no backward) left the root gathered, and under grad-op every block
        if args.checkpoint_dir:
            save_checkpoint(checkpoint_path(args.checkpoint_dir, epoch + 1), net, optimizer, epoch + 1, step)
    if args.checkpoint_dir:  # one plain state_dict for a model without any wrapper
        export_full_state_dict(args.checkpoint_dir / "model_full.pt", net)
    finish(net, clock, args, env, num_parameters, state_bytes)


def train_one_epoch(net, batches, optimizer, device, num_batches: int, progress: str = ""):
    """One pass over the batches. Returns the summed loss, the samples, and the bytes of model state that this
    rank held after the last step (``common.memory.training_state_bytes``) plus the parameter bytes it held
    between the first forward and its backward: shards under ``full``, whole gathered blocks under ``grad-op``."""
    net.train()
    loss_sum, samples, held = torch.zeros((), device=device), 0, None
    for X, y in tqdm(batches, total=num_batches, desc=progress, disable=not is_main() or not progress,
                     leave=False, mininterval=1.0):
        X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)  # before, not after: the gradients stay to be measured
        loss = F.cross_entropy(net(X), y)
        if held is None:  # unsharded blocks show up as plain Parameters, sharded ones as local shards
            held = local_bytes(net.parameters())
        loss.backward()  # FSDP2 reduce-scatters: each rank keeps the averaged gradient of its shard
        optimizer.step()
        loss_sum += loss.detach() * len(y)
        samples += len(y)
    return loss_sum, samples, {**training_state_bytes(net, optimizer), "parameters_after_forward": held}


def finish(net, clock, args, env, num_parameters: int, state_bytes: dict | None):
    """Gather every rank's memory figures, check the parameters, have rank 0 print and write the metrics."""
    in_sync = replicas_in_sync(net)
    mine = {"rank": env.rank, **(state_bytes or {}), "peak_memory_mib": peak_memory_mib(env.device)}
    per_rank = [None] * env.world_size
    dist.all_gather_object(per_rank, mine)
    stage = 0 if args.sharding == "none" else 3  # between steps grad-op is sharded like full
    predicted = zero_bytes_per_rank(num_parameters, env.world_size, stage)
    print0(f"full parameters identical on all {env.world_size} rank(s): {in_sync}")
    print0(f"{num_parameters:,} parameters; model state per rank, MB (predicted for ZeRO stage {stage}: "
           f"{predicted['total'] / 1e6:.2f})")
    for row in per_rank if state_bytes else []:  # a resumed run with no epoch left trained nothing
        print0(f"  rank {row['rank']}: parameters {row['parameters'] / 1e6:.2f}, gradients "
               f"{row['gradients'] / 1e6:.2f}, optimizer {row['optimizer'] / 1e6:.2f}, total {row['total'] / 1e6:.2f}"
               f" | held between forward and backward {row['parameters_after_forward'] / 1e6:.2f}")
    if args.metrics_file:
        write_json(args.metrics_file, run_summary(
            clock.history, env, dataset=args.dataset, model=args.model, sharding=args.sharding,
            precision=args.precision, num_parameters=num_parameters, parameters_in_sync=in_sync,
            predicted_bytes_per_rank=predicted, memory_per_rank=per_rank))
        print0(f"metrics written to {args.metrics_file}")


if __name__ == "__main__":
    main(parse_args())
