"""Lab 05 (lesson 07): one training script for one node or many, that survives a crash and resumes bit-exactly.

Global rank 0 writes a checkpoint every ``--checkpoint-every`` optimizer steps: model, optimizer, scheduler,
epoch, step, position in the epoch's shuffled order, every rank's RNG state and the metrics so far. When a
worker dies, ``torchrun --max-restarts`` restarts every worker; they find the newest valid checkpoint and
continue from it, and end with the parameters an uninterrupted run would have, bit for bit.

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

from itertools import islice

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.checkpoint import unwrap
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
    # find_unused_parameters=True keeps DDP's first gradient buckets for the run: rebuilt after step 1 (the default),
    # a resumed run's first step would sum in another order (4 ranks: 1 ulp off; tests/test_checkpoint.py).
    model = model_class(num_classes=data.num_classes).to(env.device)
    net = DDP(model, device_ids=env.device_ids, find_unused_parameters=True)
    set_seed(args.seed, env.rank)
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=len(train_iter), gamma=0.8)  # per epoch

    history = TrainingHistory(env, args.epochs)
    start_epoch, step, batch_in_epoch, history.rows = resume(args.checkpoint_dir, env, net, optimizer, scheduler)
    for epoch in range(start_epoch, args.epochs):
        train_iter.sampler.set_epoch(epoch)  # the epoch's permutation, the same as before the crash
        history.start_epoch()
        net.train()
        loss_sum, samples = torch.zeros((), device=env.device), 0
        # Skip the batches that the checkpoint already holds: the sampler position.
        for i, (X, y) in enumerate(islice(train_iter, batch_in_epoch, None), start=batch_in_epoch):
            step += 1
            if step == args.fail_at_step and attempt == 0 and env.rank == env.world_size - 1:
                raise RuntimeError(f"--fail-at-step {step}: rank {env.rank} fails on purpose (attempt {attempt})")
            X, y = X.to(env.device), y.to(env.device)
            loss = F.cross_entropy(net(X), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            loss_sum += loss.detach() * len(y)
            samples += len(y)
            if args.checkpoint_dir and step % args.checkpoint_every == 0 and i + 1 < len(train_iter):
                save(args, step, epoch, i + 1, net, optimizer, scheduler, history.rows)
        batch_in_epoch = 0
        history.end_epoch(epoch + 1, net, loss_sum, samples, test_iter, step=step, attempt=attempt)
        if args.checkpoint_dir and (step % args.checkpoint_every == 0 or epoch + 1 == args.epochs):
            save(args, step, epoch + 1, 0, net, optimizer, scheduler, history.rows)  # the epoch's figures too
    run = dict(restarts=attempt, final_step=step, batch_size_per_process=args.batch_size)
    finish_run(net, history, args, **run, nodes=len({node for node, _, _ in where}))


def save(args, step, epoch, batch_in_epoch, net, optimizer, scheduler, history):
    """Call on every rank: all of them hand in their RNG state, global rank 0 alone writes, all wait for it."""
    # BEGIN LAB: write the checkpoint from global rank 0
    # All ranks gather the RNG states (a collective); rank 0 alone writes model, optimizer, scheduler, epoch, step,
    # batch_in_epoch, rng and history (write_verified, step_checkpoint_file), then prunes; all meet at a barrier.
    rng = gather_rng_states()  # a collective, so it runs on every rank, never inside `if is_main()`
    if is_main():  # global rank 0, not local rank 0: that would be one writer per node, racing on shared storage
        state = dict(model=unwrap(net).state_dict(), optimizer=optimizer.state_dict(), scheduler=scheduler.state_dict())
        state.update(epoch=epoch, step=step, batch_in_epoch=batch_in_epoch, rng=rng, history=history)  # the progress
        write_verified(step_checkpoint_file(args.checkpoint_dir, step), state)
        prune_checkpoints(args.checkpoint_dir, args.keep_checkpoints)
    dist.barrier()  # nobody runs ahead (and could crash) before the checkpoint is on disk
    # END LAB


def resume(folder, env, net, optimizer, scheduler):
    """Load the newest valid checkpoint in ``folder`` on every rank, the one that global rank 0 picked; return
    (epoch, step, batch in epoch, history), or (0, 0, 0, []) without one."""
    # BEGIN LAB: load the newest valid checkpoint on every rank
    # Rank 0 picks newest_valid_checkpoint(folder, log=print0) and broadcasts its path (broadcast_object_list);
    # every rank reads it (read_verified), loads model, optimizer, scheduler and its own RNG state (another world
    # size: set_seed(step, rank)) and prints "resumed from PATH: epoch E, step S, batch B of the epoch" on rank 0.
    choice = [str(newest_valid_checkpoint(folder, log=print0) or "") if folder and is_main() else ""]
    dist.broadcast_object_list(choice, src=0)
    if not choice[0]:
        return 0, 0, 0, []
    state = read_verified(choice[0], map_location=env.device)
    unwrap(net).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if len(state["rng"]) == env.world_size:
        set_rng_state(state["rng"][env.rank])
    else:  # an elastic restart with a different world size: the old per-rank streams do not map onto ranks
        set_seed(state["step"], env.rank)
        print0(f"world size {len(state['rng'])} -> {env.world_size}: RNG reseeded, data order re-sharded")
    epoch, step, batch_in_epoch = state["epoch"], state["step"], state["batch_in_epoch"]
    print0(f"resumed from {choice[0]}: epoch {epoch}, step {step}, batch {batch_in_epoch} of the epoch")
    return epoch, step, batch_in_epoch, state["history"]
    # END LAB


if __name__ == "__main__":
    main(parse_args())
