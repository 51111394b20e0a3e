"""Lab 05 (lesson 07): one training script for one node or many, that survives a crash and resumes bit-exactly.

Global rank 0 writes a checkpoint every ``--checkpoint-every`` optimizer steps: model, optimizer, scheduler,
epoch, step, position in the epoch's shuffled order (samples, over all ranks), every rank's RNG state and the
metrics so far. When a worker dies, ``torchrun --max-restarts`` restarts every worker; they find the newest
valid checkpoint and continue from it, and end with the parameters an uninterrupted run would have, bit for
bit. A restart with another world size (``--nnodes MIN:MAX``) goes on with the samples of the epoch not yet
trained, and the learning rate still decays once per epoch.

    # one machine, 2 processes (CPU, gloo)
    torchrun --standalone --nproc-per-node 2 solutions/05_multi_node.py --dataset digits \
        --checkpoint-dir checkpoints/multi_node

    # rehearsal: two "nodes" of 2 processes on this machine, c10d rendezvous on 127.0.0.1
    python scripts/rehearse_two_nodes.py -- solutions/05_multi_node.py --dataset digits

    # a real cluster: the same line on every node; NODE0 is the first node's address, /shared is on every node
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \
        --rdzv-endpoint NODE0:29400 --rdzv-id job42 --max-restarts 3 solutions/05_multi_node.py \
        --checkpoint-dir /shared/checkpoints/job42

    # fault drill: the last rank fails at step 30 on the first attempt; torchrun restarts all, they resume (delete
    # checkpoints/drill to run it again). TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: each attempt gets a store of its own
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 --max-restarts 1 \
        solutions/05_multi_node.py --dataset digits --checkpoint-dir checkpoints/drill --checkpoint-every 10 \
        --fail-at-step 30
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.checkpoint import fixed_buckets, unwrap
from common.distributed import is_main, print0, process_group, rank_map, set_seed
from common.fault_tolerance import (
    fault_tolerance_arguments,
    gather_rng_states,
    newest_valid_checkpoint,
    prune_checkpoints,
    read_verified,
    record,
    restart_attempt,
    set_rng_state,
    step_checkpoint_file,
    write_verified,
)
from common.models import MODELS
from common.training import TrainingHistory, finish_run, make_loaders, training_arguments


def parse_args(argv=None):
    return fault_tolerance_arguments(training_arguments(__doc__.splitlines()[0])).parse_args(argv)


@record  # a failing worker's traceback reaches torchrun, whose summary names the rank (common.fault_tolerance)
def main(args):
    with process_group(args.backend) as env:
        train(args, env)


def train(args, env):
    attempt = restart_attempt(env.device)  # 0, then 1 after the first restart... the same on every rank
    where = rank_map(env)  # (node rank, local rank, host) of every rank
    placement = ", ".join(f"rank {r}: node {n} local {lr} on {h}" for r, (n, lr, h) in enumerate(where))
    print0(f"{env.world_size} process(es), backend {env.backend}, attempt {attempt} | {placement}")
    model_class = MODELS[args.model]
    data, train_iter, test_iter = make_loaders(args, env, model_class)
    set_seed(args.seed)
    # One gradient bucket per parameter (bucket_cap_mb_list=[0]): DDP rebuilds its buckets after step 1, and a bucket
    # of one tensor is laid out the same before and after. With shared buckets a resumed run's first step would sum in
    # another order (4 ranks: 1 ulp off; tests/test_checkpoint.py). It costs one all-reduce per tensor, 8 for LeNet.
    model = model_class(num_classes=data.num_classes).to(env.device)
    net = DDP(model, device_ids=env.device_ids, **fixed_buckets())
    set_seed(args.seed, env.rank)
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    # Stepped once per epoch, not per batch: a step_size in batches would be the batches per epoch of one world
    # size, and a run resumed at another world size would decay at the wrong times.
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)

    history = TrainingHistory(env, args.epochs)
    start_epoch, step, samples_in_epoch, history.rows = resume(args, env, net, optimizer, scheduler)
    per_step = args.batch_size * env.world_size  # positions of the epoch's order that one step trains, all ranks
    for epoch in range(start_epoch, args.epochs):
        train_iter.sampler.set_epoch(epoch)  # the epoch's permutation, the same as before the crash
        # Skip the samples that the checkpoint already holds: the sampler position, counted over all ranks, so that
        # it means the same at another world size (common.data.ResumableSampler).
        train_iter.sampler.start = samples_in_epoch
        history.start_epoch()
        net.train()
        loss_sum, samples = torch.zeros((), device=env.device), 0
        for i, (X, y) in enumerate(train_iter):
            step += 1
            if step == args.fail_at_step and attempt == 0 and env.rank == env.world_size - 1:
                raise RuntimeError(f"--fail-at-step {step}: rank {env.rank} fails on purpose (attempt {attempt})")
            X, y = X.to(env.device), y.to(env.device)
            loss = F.cross_entropy(net(X), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach() * len(y)
            samples += len(y)
            if args.checkpoint_dir and step % args.checkpoint_every == 0 and i + 1 < len(train_iter):
                save(args, step, epoch, samples_in_epoch + (i + 1) * per_step, net, optimizer, scheduler, history.rows)
        samples_in_epoch = 0
        scheduler.step()  # the learning rate decays once per epoch, whatever the world size
        history.end_epoch(epoch + 1, net, loss_sum, samples, test_iter, step=step, attempt=attempt)
        if args.checkpoint_dir and (step % args.checkpoint_every == 0 or epoch + 1 == args.epochs):
            save(args, step, epoch + 1, 0, net, optimizer, scheduler, history.rows)  # the epoch's figures too
    run = dict(restarts=attempt, final_step=step, batch_size_per_process=args.batch_size)
    finish_run(net, history, args, **run, nodes=len({node for node, _, _ in where}))


def save(args, step, epoch, samples_in_epoch, net, optimizer, scheduler, history):
    """Call on every rank: all of them hand in their RNG state, global rank 0 alone writes, all wait for it."""
    # BEGIN LAB: write the checkpoint from global rank 0
    # All ranks gather the RNG states (a collective); rank 0 alone writes model, optimizer, scheduler, epoch, step,
    # samples_in_epoch, rng and history (write_verified, step_checkpoint_file), then prunes; all meet at a barrier.
    rng = gather_rng_states()  # a collective, so it runs on every rank, never inside `if is_main()`
    if is_main():  # global rank 0, not local rank 0: that would be one writer per node, racing on shared storage
        state = dict(model=unwrap(net).state_dict(), optimizer=optimizer.state_dict(), scheduler=scheduler.state_dict())
        state.update(epoch=epoch, step=step, samples_in_epoch=samples_in_epoch, rng=rng, history=history)  # progress
        write_verified(step_checkpoint_file(args.checkpoint_dir, step), state)
        prune_checkpoints(args.checkpoint_dir, args.keep_checkpoints)
    dist.barrier()  # nobody runs ahead (and could crash) before the checkpoint is on disk
    # END LAB


def resume(args, env, net, optimizer, scheduler):
    """Load the newest valid checkpoint in ``args.checkpoint_dir`` on every rank, the one that global rank 0 picked;
    return (epoch, step, samples of the epoch already trained, history), or (0, 0, 0, []) without one."""
    # BEGIN LAB: load the newest valid checkpoint on every rank
    # Rank 0 picks newest_valid_checkpoint(folder, log=print0) and broadcasts its path (broadcast_object_list);
    # every rank reads it (read_verified), loads model, optimizer, scheduler and its own RNG state (another world
    # size: set_seed(step, rank)) and prints "resumed from PATH: epoch E, step S, batch B of the epoch" on rank 0.
    folder = args.checkpoint_dir
    choice = [str(newest_valid_checkpoint(folder, log=print0) or "") if folder and is_main() else ""]
    dist.broadcast_object_list(choice, src=0)
    if not choice[0]:
        return 0, 0, 0, []
    state = read_verified(choice[0], map_location=env.device)
    unwrap(net).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    epoch, step, done = state["epoch"], state["step"], state["samples_in_epoch"]
    if len(state["rng"]) == env.world_size:
        set_rng_state(state["rng"][env.rank])
        position = f"batch {done // (args.batch_size * env.world_size)} of the epoch"
    else:  # an elastic restart with a different world size: the old per-rank streams do not map onto ranks
        set_seed(state["step"], env.rank)
        print0(f"world size {len(state['rng'])} -> {env.world_size}: RNG reseeded, the rest of the epoch re-sharded")
        position = f"{done} samples of the epoch already trained"
    print0(f"resumed from {choice[0]}: epoch {epoch}, step {step}, {position}")
    return epoch, step, done, state["history"]
    # END LAB


if __name__ == "__main__":
    main(parse_args())
