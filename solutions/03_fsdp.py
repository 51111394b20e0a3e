"""Lab 03 (lesson 06): shard the model with FSDP2 (ZeRO-3), and checkpoint it in shards with DCP.

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
"""

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from common.distributed import print0, process_group, set_seed
from common.fsdp import (
    check_sharding_arguments,
    epoch_checkpoint_dir,
    export_full_state_dict,
    finish_sharded_run,
    latest_checkpoint,
    make_mesh,
    mixed_precision_policy,
    reshard,
    sharding_arguments,
)

# BEGIN LAB: every rank writes its own shards, with torch.distributed.checkpoint
# get_state_dict(net, optimizer) gives the sharded state dicts: dcp.save them and {"epoch": epoch, "step": step}
# into a temporary folder, which global rank 0 renames to `path` once every rank has written.
from common.fsdp import save_sharded_checkpoint  # isort: skip

# END LAB
# BEGIN LAB: load the shards back, at any world size
# dcp.load fills state dicts that already have this run's sharded layout (get_state_dict); set_state_dict puts
# them in place. Return the progress.
from common.fsdp import load_sharded_checkpoint  # isort: skip

# END LAB
from common.memory import local_bytes, training_state_bytes
from common.models import MODELS
from common.training import TrainingHistory, make_loaders, progress_bar, training_arguments


def parse_args(argv=None):
    parser = sharding_arguments(training_arguments(__doc__.splitlines()[0]))
    parser.set_defaults(model="mlp", lr=1e-3)  # Adam's usual learning rate; the model whose blocks shard
    return check_sharding_arguments(parser, parser.parse_args(argv))  # e.g. --resume needs --checkpoint-dir


def main(args):
    with process_group(args.backend) as env:
        train(args, env)


def train(args, env):
    print0(f"{env.summary} | sharding {args.sharding}, precision {args.precision}, model {args.model}")
    model_class = MODELS[args.model]
    data, train_iter, test_iter = make_loaders(args, env, model_class)

    set_seed(args.seed)  # the same full model on every rank, before it is cut into shards
    model = model_class(num_classes=data.num_classes).to(env.device)
    net = shard_model(model, env, args.sharding, args.precision, args.cpu_offload)
    set_seed(args.seed, env.rank)
    optimizer = torch.optim.Adam(net.parameters(), lr=args.lr)  # after sharding: it holds the shards' states

    start_epoch, step, state_bytes = 0, 0, None
    if args.resume and (found := latest_checkpoint(args.checkpoint_dir)) is not None:
        progress = load_sharded_checkpoint(found, net, optimizer)
        start_epoch, step = progress["epoch"], progress["step"]
        print0(f"resumed from {found}: {start_epoch} epoch(s), {step} step(s) done")
    history = TrainingHistory(env, args.epochs)
    for epoch in range(start_epoch, args.epochs):
        train_iter.sampler.set_epoch(epoch)
        history.start_epoch()
        batches = progress_bar(train_iter, f"epoch {epoch + 1}")
        loss_sum, samples, state_bytes = train_one_epoch(net, batches, optimizer, env.device)
        step += len(train_iter)
        history.end_epoch(epoch + 1, net, loss_sum, samples, test_iter)
        reshard(net)  # evaluation's forwards (no backward) left the root gathered, and under grad-op every block
        if args.checkpoint_dir:
            save_sharded_checkpoint(
                epoch_checkpoint_dir(args.checkpoint_dir, epoch + 1), net, optimizer, epoch + 1, step
            )
    if args.checkpoint_dir:  # one plain state_dict for a model without any wrapper
        export_full_state_dict(args.checkpoint_dir / "model_full.pt", net)
    finish_sharded_run(net, history, args, state_bytes)  # in sync? each rank's memory, and ZeRO's


def shard_model(model, env, sharding: str, precision: str = "fp32", offload: bool = False):
    """Apply the data parallelism that ``sharding`` names to ``model`` (in place); return the model to train.
    ``offload``: FSDP2 keeps the shards, their gradients and Adam's states in CPU memory and steps on the CPU."""
    if sharding == "none":
        return DDP(model, device_ids=env.device_ids)
    mesh = make_mesh(env)  # 1-D: all ranks shard every parameter among themselves
    # BEGIN LAB: shard the model with fully_shard
    # Each block of model.blocks (if it has them), then the root model, on `mesh`: full frees a block's gathered
    # parameters after its forward, grad-op keeps them (reshard_after_forward); the root keeps FSDP2's default.
    # mp_policy from mixed_precision_policy(precision); offload: CPUOffloadPolicy, else OffloadPolicy().
    # Pinned CPU memory speeds up the copies to a GPU, and needs a CUDA driver to exist at all.
    offload_policy = CPUOffloadPolicy(pin_memory=env.device.type == "cuda") if offload else OffloadPolicy()
    options = dict(mesh=mesh, mp_policy=mixed_precision_policy(precision), offload_policy=offload_policy)
    # One unit per block, so that one block at a time is gathered; then the root, bottom-up, takes what is left
    # (stem and head). Parameters become DTensors: rank r keeps chunk r of dim 0 (the last chunk may be shorter).
    for block in getattr(model, "blocks", []):  # DeepMLP's blocks; a model without them is one unit
        fully_shard(block, reshard_after_forward=sharding == "full", **options)
    # The root keeps FSDP2's default, which never reshards it after forward: backward starts with the root's own
    # parameters (the head), so freeing them would only gather them again at once, one all-gather more per step.
    fully_shard(model, **options)
    # END LAB
    return model


def train_one_epoch(net, batches, optimizer, device):
    """One pass over the batches. Returns the summed loss, the samples, and the bytes of model state that this
    rank held after the last step (``common.memory.training_state_bytes``) plus the parameter bytes it held
    between the first forward and its backward: shards under ``full``, whole gathered blocks under ``grad-op``."""
    net.train()
    loss_sum, samples, held = torch.zeros((), device=device), 0, None
    for X, y in batches:
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


if __name__ == "__main__":
    main(parse_args())
