"""Lab 02 (lesson 04): gradient accumulation under DDP, with no_sync, clipping and learning-rate warm-up.

Each optimizer step adds up the gradients of ``--grad-accum-steps`` micro-batches on every process. Only the
last micro-step all-reduces: the others run inside ``net.no_sync()``, where DDP leaves the gradients in
``.grad`` and sends nothing. Effective batch = --batch-size x --grad-accum-steps x number of processes.

    # CPU, 2 processes, 4 micro-steps of 16: an effective batch of 128
    torchrun --standalone --nproc_per_node=2 solutions/02_gradient_accumulation.py --dataset digits \
        --batch-size 16 --grad-accum-steps 4

    # 4 GPUs, effective batch 64 x 8 x 4 = 2048: a larger lr, warmed up (lesson 04 measures the rule)
    torchrun --standalone --nproc_per_node=4 solutions/02_gradient_accumulation.py --grad-accum-steps 8 \
        --lr 0.4 --warmup-steps 100 --clip-grad-norm 1.0

    # one process, no launcher
    python solutions/02_gradient_accumulation.py --dataset digits --grad-accum-steps 4
"""

from contextlib import nullcontext
from itertools import islice

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from common.cli import non_negative_int, positive_float, positive_int
from common.distributed import is_main, print0, set_seed, setup_distributed, teardown_distributed
from common.models import MODELS
from common.training import EpochClock, finish_run, make_loaders, training_arguments


def parse_args(argv=None):
    parser = training_arguments(__doc__.splitlines()[0])
    parser.add_argument("--grad-accum-steps", type=positive_int, default=1,
                        help="micro-batches per optimizer step on every process")
    parser.add_argument("--clip-grad-norm", type=positive_float,
                        help="clip the global norm of the averaged gradients to this, before each optimizer step")
    parser.add_argument("--warmup-steps", type=non_negative_int, default=0,
                        help="optimizer steps over which the learning rate rises linearly to --lr")
    return parser.parse_args(argv)


def main(args):
    env = setup_distributed(args.backend)
    try:
        train(args, env)
    finally:
        teardown_distributed()


def train(args, env):
    effective_batch = args.batch_size * args.grad_accum_steps * env.world_size
    print0(f"{env.world_size} process(es), backend {env.backend}, device {env.device.type} | effective batch "
           f"{effective_batch} = {args.batch_size} per micro-step x {args.grad_accum_steps} micro-steps x "
           f"{env.world_size} process(es), lr {args.lr}, warm-up {args.warmup_steps} step(s)")
    model_class = MODELS[args.model]
    data, train_iter, test_iter = make_loaders(args, env, model_class)

    set_seed(args.seed)
    net = DDP(model_class(num_classes=data.num_classes).to(env.device),
              device_ids=[env.device] if env.device.type == "cuda" else None)
    set_seed(args.seed, env.rank)
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    # Linear warm-up: lr * 1/w, 2/w, ... up to lr after w optimizer steps, then constant.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                  lambda step: min(1.0, (step + 1) / (args.warmup_steps + 1)))

    clock = EpochClock(env, args.epochs)
    batches_per_epoch = min(len(train_iter), args.max_steps or len(train_iter))
    for epoch in range(args.epochs):
        train_iter.sampler.set_epoch(epoch)
        clock.start()
        loss_sum, samples, optimizer_steps = train_one_epoch(
            net, islice(train_iter, batches_per_epoch), optimizer, scheduler, args.grad_accum_steps, env.device,
            num_batches=batches_per_epoch, clip_grad_norm=args.clip_grad_norm,
            progress=f"epoch {epoch + 1}/{args.epochs}")
        clock.finish(epoch + 1, net, loss_sum, samples, test_iter, optimizer_steps=optimizer_steps,
                     lr=scheduler.get_last_lr()[0])
    finish_run(net, clock, args, batch_size_per_process=args.batch_size, grad_accum_steps=args.grad_accum_steps,
               effective_batch_size=effective_batch, lr=args.lr, warmup_steps=args.warmup_steps,
               clip_grad_norm=args.clip_grad_norm)


def train_one_epoch(net, batches, optimizer, scheduler, accum_steps: int, device, num_batches: int,
                    clip_grad_norm: float | None = None, progress: str = ""):
    """One pass over ``num_batches`` micro-batches, an optimizer step after every ``accum_steps`` of them (and
    after the last, possibly shorter, group). Returns the summed loss (a tensor), the samples and the steps."""
    net.train()
    loss_sum, samples, optimizer_steps = torch.zeros((), device=device), 0, 0
    for i, (X, y) in enumerate(tqdm(batches, total=num_batches, desc=progress, disable=not is_main() or not progress,
                                    leave=False, mininterval=1.0)):
        X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
        group_start = i - i % accum_steps
        micro_steps = min(accum_steps, num_batches - group_start)  # the epoch's last group may be shorter
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
        loss_sum += loss.detach() * len(y)
        samples += len(y)
    return loss_sum, samples, optimizer_steps


if __name__ == "__main__":
    main(parse_args())
