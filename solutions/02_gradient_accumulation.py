"""Lab 02 (lesson 04): gradient accumulation under DDP, with no_sync, clipping and learning-rate warm-up.

Each optimizer step adds up the gradients of ``--grad-accum-steps`` micro-batches on every process. Only the
last micro-step all-reduces: the others run inside ``net.no_sync()``, where DDP leaves the gradients in
``.grad`` and sends nothing. Effective batch = --batch-size x --grad-accum-steps x number of processes.

    # CPU, 2 processes, 4 micro-steps of 16: an effective batch of 128
    torchrun --standalone --nproc_per_node=2 solutions/02_gradient_accumulation.py --dataset digits \
        --batch-size 16 --grad-accum-steps 4

    # 4 GPUs, effective batch 64 x 8 x 4 = 2048: a larger lr, warmed up over the first epoch (30 steps)
    torchrun --standalone --nproc_per_node=4 solutions/02_gradient_accumulation.py --grad-accum-steps 8 \
        --lr 0.4 --warmup-steps 30 --clip-grad-norm 1.0

    # one process, no launcher
    python solutions/02_gradient_accumulation.py --dataset digits --grad-accum-steps 4
"""

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.distributed import print0, process_group, set_seed
from common.models import MODELS
from common.training import (
    TrainingHistory,
    accumulation_arguments,
    accumulation_details,
    finish_run,
    linear_warmup,
    make_loaders,
    progress_bar,
    training_arguments,
)


def parse_args(argv=None):
    return accumulation_arguments(training_arguments(__doc__.splitlines()[0])).parse_args(argv)


def main(args):
    with process_group(args.backend) as env:
        train(args, env)


def train(args, env):
    effective_batch = args.batch_size * args.grad_accum_steps * env.world_size
    print0(
        f"{env.summary} | effective batch "
        f"{effective_batch} = {args.batch_size} per micro-step x {args.grad_accum_steps} micro-steps x "
        f"{env.world_size} process(es), lr {args.lr}, warm-up {args.warmup_steps} step(s)"
    )
    model_class = MODELS[args.model]
    data, train_iter, test_iter = make_loaders(args, env, model_class)

    set_seed(args.seed)
    net = DDP(model_class(num_classes=data.num_classes).to(env.device), device_ids=env.device_ids)
    set_seed(args.seed, env.rank)
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    scheduler = linear_warmup(optimizer, args.warmup_steps)  # lr x 1/w, 2/w, ... 1 over the first optimizer steps

    history = TrainingHistory(env, args.epochs)
    for epoch in range(args.epochs):
        train_iter.sampler.set_epoch(epoch)
        history.start_epoch()
        loss_sum, samples, optimizer_steps = train_one_epoch(
            net,
            progress_bar(train_iter, f"epoch {epoch + 1}/{args.epochs}"),
            optimizer,
            scheduler,
            args.grad_accum_steps,
            env.device,
            clip_grad_norm=args.clip_grad_norm,
        )
        history.end_epoch(
            epoch + 1, net, loss_sum, samples, test_iter, optimizer_steps=optimizer_steps, lr=scheduler.get_last_lr()[0]
        )
    finish_run(net, history, args, **accumulation_details(args, env.world_size))


def train_one_epoch(net, batches, optimizer, scheduler, accum_steps: int, device, clip_grad_norm: float | None = None):
    """One pass over ``batches`` (micro-batches: it needs their number, ``len(batches)``), an optimizer step after
    every ``accum_steps`` of them and after the last, possibly shorter, group. Returns the summed loss (a tensor),
    the samples and the optimizer steps."""
    net.train()
    loss_sum, samples, optimizer_steps = torch.zeros((), device=device), 0, 0
    for i, (X, y) in enumerate(batches):
        X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
        # BEGIN LAB: accumulate, then step
        # Forward AND backward in `net.no_sync()` on every micro-step of a group but its last (the epoch's last
        # group may be shorter), on the loss divided by the group's micro-steps; after the last: clip if asked, step
        # the optimizer and the scheduler, zero the gradients, count the step. Keep `loss` undivided for below.
        group_start = i - i % accum_steps
        micro_steps = min(accum_steps, len(batches) - group_start)  # the epoch's last group may be shorter
        last_micro_step = i == group_start + micro_steps - 1
        # Forward and backward both inside no_sync: DDP decides in forward whether backward will all-reduce.
        with nullcontext() if last_micro_step else net.no_sync():
            loss = F.cross_entropy(net(X), y)
            # .grad adds up the micro-steps' gradients: divide, so the step uses their mean, not k times it.
            (loss / micro_steps).backward()
        if last_micro_step:  # .grad now holds the gradient averaged over micro-steps and ranks
            if clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            optimizer_steps += 1
        # END LAB
        loss_sum += loss.detach() * len(y)
        samples += len(y)
    return loss_sum, samples, optimizer_steps


if __name__ == "__main__":
    main(parse_args())
