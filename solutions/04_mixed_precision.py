"""Lab 04 (lesson 05): mixed precision under DDP, with gradient accumulation, clipping and fp16 loss scaling.

``solutions/02_gradient_accumulation.py`` plus ``--precision``. The forward pass runs under
``torch.autocast`` (bf16 or fp16 for matrix products and convolutions, fp32 for the rest); parameters, their
gradients, DDP's allreduce and the optimizer stay in fp32. fp16 also scales the loss with
``torch.amp.GradScaler``, so that small gradients do not underflow to zero: scale and backward on every
micro-step, then unscale_, clip, step and update once per optimizer step.

    # CPU, 2 processes: bf16 (runs on any CPU PyTorch supports), or fp16 with loss scaling
    torchrun --standalone --nproc_per_node=2 solutions/04_mixed_precision.py --dataset digits --precision bf16
    torchrun --standalone --nproc_per_node=2 solutions/04_mixed_precision.py --dataset digits --precision fp16 \
        --batch-size 16 --grad-accum-steps 4 --clip-grad-norm 1.0

    # 4 GPUs: bf16 on Ampere or newer, fp16 on any CUDA GPU
    torchrun --standalone --nproc_per_node=4 solutions/04_mixed_precision.py --model simplecnn --dataset cifar10 \
        --precision bf16
    torchrun --standalone --nproc_per_node=4 solutions/04_mixed_precision.py --model simplecnn --dataset cifar10 \
        --precision fp16 --clip-grad-norm 1.0

    # one process, no launcher
    python solutions/04_mixed_precision.py --dataset digits --precision bf16
"""

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.distributed import print0, process_group, set_seed
from common.models import MODELS
from common.precision import PRECISIONS, check_precision, precision_arguments
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
    return precision_arguments(accumulation_arguments(training_arguments(__doc__.splitlines()[0]))).parse_args(argv)


def main(args):
    with process_group(args.backend) as env:
        train(args, env)


def train(args, env):
    check_precision(args.precision, env.device)
    effective_batch = args.batch_size * args.grad_accum_steps * env.world_size
    print0(
        f"{env.summary}, precision "
        f"{args.precision} | effective batch {effective_batch} = {args.batch_size} x {args.grad_accum_steps} "
        f"micro-steps x {env.world_size} process(es), lr {args.lr}, warm-up {args.warmup_steps} step(s)"
    )
    model_class = MODELS[args.model]
    data, train_iter, test_iter = make_loaders(args, env, model_class)

    set_seed(args.seed)
    net = DDP(model_class(num_classes=data.num_classes).to(env.device), device_ids=env.device_ids)
    set_seed(args.seed, env.rank)
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    scheduler = linear_warmup(optimizer, args.warmup_steps)
    # One scaler for the whole run: its scale is learned across epochs. Disabled, every call is a pass-through.
    scaler = torch.amp.GradScaler(env.device.type, enabled=args.precision == "fp16")

    history, skipped_total = TrainingHistory(env, args.epochs), 0
    for epoch in range(args.epochs):
        train_iter.sampler.set_epoch(epoch)
        history.start_epoch()
        loss_sum, samples, optimizer_steps, skipped_steps = train_one_epoch(
            net,
            progress_bar(train_iter, f"epoch {epoch + 1}/{args.epochs}"),
            optimizer,
            scheduler,
            scaler,
            args.grad_accum_steps,
            env.device,
            precision=args.precision,
            clip_grad_norm=args.clip_grad_norm,
        )
        skipped_total += skipped_steps
        steps = dict(optimizer_steps=optimizer_steps, skipped_steps=skipped_steps, loss_scale=scaler.get_scale())
        history.end_epoch(epoch + 1, net, loss_sum, samples, test_iter, **steps, lr=scheduler.get_last_lr()[0])
        if scaler.is_enabled():
            print0(
                f"  loss scale {scaler.get_scale():g}, {skipped_steps} of {optimizer_steps} step(s) skipped "
                f"(inf/NaN gradients)"
            )
    scaling = dict(precision=args.precision, skipped_steps=skipped_total, final_scale=scaler.get_scale())
    finish_run(net, history, args, **scaling, **accumulation_details(args, env.world_size))


def train_one_epoch(
    net, batches, optimizer, scheduler, scaler, accum_steps: int, device, precision: str = "fp32", clip_grad_norm=None
):
    """One pass over ``batches`` (micro-batches), an optimizer step after every ``accum_steps`` of them and after the
    last, possibly shorter, group, the forward pass autocast to ``precision``, the gradients clipped to the global
    norm ``clip_grad_norm`` when one is given. Returns the summed loss (a tensor), the samples, the optimizer steps
    attempted and how many of them the scaler skipped."""
    net.train()
    loss_sum, samples, optimizer_steps, skipped_steps = torch.zeros((), device=device), 0, 0, 0
    for i, (X, y) in enumerate(batches):
        X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
        group_start = i - i % accum_steps
        micro_steps = min(accum_steps, len(batches) - group_start)  # the epoch's last group may be shorter
        last_micro_step = i == group_start + micro_steps - 1
        # BEGIN LAB: autocast the forward, scale the loss, then unscale_, clip, step, update
        # As in lab 02, plus: the loss under torch.autocast to PRECISIONS[precision] (off for fp32), backward outside
        # it on scaler.scale(loss / micro_steps); scaler.unscale_ BEFORE clipping, then scaler.step and update. A step
        # whose scale went down was skipped: count it in `skipped_steps`, and do not step the scheduler.
        # Forward and backward both inside no_sync: DDP decides in forward whether backward will all-reduce.
        with nullcontext() if last_micro_step else net.no_sync():
            with torch.autocast(device_type=device.type, dtype=PRECISIONS[precision], enabled=precision != "fp32"):
                loss = F.cross_entropy(net(X), y)
            # Divided as in lesson 04, then scaled: S changes only in update(), so every micro-step of a group
            # adds S times its gradient. Backward outside autocast: each op's backward runs in its forward's dtype.
            scaler.scale(loss / micro_steps).backward()
        if last_micro_step:  # .grad now holds S times the gradient averaged over micro-steps and ranks
            if clip_grad_norm is not None:
                scaler.unscale_(optimizer)  # divide by the scale first: max_norm bounds the true gradient
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip_grad_norm)
            scale = scaler.get_scale()  # a host read (a GPU sync), but step() makes one right after: almost free
            scaler.step(optimizer)  # unscales (unless done above), reads the inf flag, skips the step on inf/NaN
            scaler.update()  # halves the scale after a skip, doubles it after growth_interval good steps
            skipped = scaler.get_scale() < scale  # the read that costs: it waits for the optimizer step's kernels
            if not skipped:  # a skipped step did not happen: warm-up counts the steps taken
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            optimizer_steps += 1
            skipped_steps += skipped
        # END LAB
        loss_sum += loss.detach() * len(y)
        samples += len(y)
    return loss_sum, samples, optimizer_steps, skipped_steps


if __name__ == "__main__":
    main(parse_args())
