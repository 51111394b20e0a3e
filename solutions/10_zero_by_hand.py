"""Lab 10 (lesson 08): ZeRO by hand: sharded optimizer state (1), gradients (2), parameters (3).

ZeRO-1 keeps 1/N of the optimizer state on each rank, under DDP; ZeRO-2 also 1/N of the gradients, reduce-scattered
instead of all-reduced; ZeRO-3 also 1/N of the parameters, each block all-gathered just before it computes. All
three are built in common/zero_by_hand.py from broadcast, all-gather and reduce-scatter; this script trains with
one of them, prints the collectives of one step, and what each rank holds beside lesson 06's arithmetic.

    # CPU, 2 processes (gloo), digits, DeepMLP fully sharded (ZeRO-3)
    torchrun --standalone --nproc_per_node=2 solutions/10_zero_by_hand.py --dataset digits

    # the other stages; ZeRO-3 gathering the weights in bf16 (half the bytes), fp32 shards and gradients
    torchrun --standalone --nproc_per_node=2 solutions/10_zero_by_hand.py --dataset digits --zero 1
    torchrun --standalone --nproc_per_node=2 solutions/10_zero_by_hand.py --dataset digits --zero 3 --compute-dtype bf16

    # 4 GPUs (NCCL is picked by itself), Fashion-MNIST
    torchrun --standalone --nproc_per_node=4 solutions/10_zero_by_hand.py --zero 3 --compute-dtype bf16
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common.collectives import count_collectives
from common.ddp_by_hand import BucketedDDP
from common.distributed import print0, process_group, set_seed
from common.memory import training_state_bytes, zero_bytes_per_rank
from common.models import MODELS
from common.training import TrainingHistory, make_loaders, progress_bar, training_arguments, write_metrics
from common.zero_by_hand import ZeRO2Optimizer, ZeRO3Model, gather_full_parameters

# BEGIN LAB: the sharded step of common/zero_by_hand.py
from common.zero_by_hand import ZeRO1Optimizer, partition_by_size  # noqa: F401  # isort: skip

# END LAB

COMPUTE_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv=None):
    parser = training_arguments(__doc__.splitlines()[0])
    parser.add_argument("--zero", type=int, choices=(1, 2, 3), default=3, help="the ZeRO stage")
    parser.add_argument("--compute-dtype", choices=COMPUTE_DTYPES, default="fp32", help="ZeRO-3's gathered weights")
    parser.set_defaults(model="mlp", lr=1e-3)  # the sharding lessons' model; Adam's usual learning rate
    args = parser.parse_args(argv)
    if args.compute_dtype != "fp32" and args.zero != 3:
        parser.error("--compute-dtype is ZeRO-3's: use --zero 3")
    return args


def main(args):
    with process_group(args.backend) as env:
        train(args, env)


def train(args, env):
    print0(f"{env.summary} | ZeRO-{args.zero}, compute {args.compute_dtype}, model {args.model}")
    model_class = MODELS[args.model]
    data, train_iter, test_iter = make_loaders(args, env, model_class)
    set_seed(args.seed)  # the same model on every rank (each wrapper broadcasts rank 0's anyway)
    model = model_class(num_classes=data.num_classes).to(env.device)
    num_parameters = sum(p.numel() for p in model.parameters())
    net, optimizer = wrap(model, args)
    set_seed(args.seed, env.rank)

    history, log = TrainingHistory(env, args.epochs), None
    for epoch in range(args.epochs):
        train_iter.sampler.set_epoch(epoch)
        history.start_epoch()
        net.train()
        loss_sum, samples = torch.zeros((), device=env.device), 0
        for X, y in progress_bar(train_iter, f"epoch {epoch + 1}"):
            X, y = X.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)
            with count_collectives() as step_log:  # what one step sends: kept from the first step
                optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(net(X), y)
                loss.backward()
                if args.zero == 1:
                    net.finish_gradient_synchronization()  # BucketedDDP: wait for the last bucket's all-reduce
                optimizer.step()
            log = log or step_log
            loss_sum += loss.detach() * len(y)
            samples += len(y)
        history.end_epoch(epoch + 1, net, loss_sum, samples, test_iter)
    held = training_state_bytes(net, optimizer)  # gradients kept from the last step, as lesson 06 measures
    report(env, args, history, log, held, full_parameters(net, model, args), num_parameters)


def wrap(model, args):
    """The model to call and its optimizer, for ZeRO stage ``args.zero`` (Adam, ``args.lr``)."""
    if args.zero == 1:  # lesson 08's DDP averages the gradients; each rank steps 1/N of them and broadcasts
        net = BucketedDDP(model)
        return net, ZeRO1Optimizer(net.parameters(), torch.optim.Adam, lr=args.lr)
    if args.zero == 2:  # no DDP: the optimizer reduce-scatters the gradients itself
        return model, ZeRO2Optimizer(model, torch.optim.Adam, lr=args.lr)
    net = ZeRO3Model(model, units=getattr(model, "blocks", None), compute_dtype=COMPUTE_DTYPES[args.compute_dtype])
    return net, torch.optim.Adam(net.parameters(), lr=args.lr)  # after wrapping: it must see the shards


def full_parameters(net, model, args) -> torch.Tensor:
    """Every parameter whole, flat (ZeRO-3's gathered: a collective, on every rank)."""
    whole = gather_full_parameters(net).values() if args.zero == 3 else model.parameters()
    return torch.cat([p.detach().reshape(-1).double() for p in whole])


def report(env, args, history, log, held, flat, num_parameters):
    """Print on rank 0 one step's collectives, each rank's model state beside ZeRO's prediction, and whether the
    full parameters agree on every rank; write the metrics. Call on every rank (it gathers)."""
    highest, lowest = flat.clone(), flat.clone()
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    in_sync = bool(torch.equal(highest, lowest))
    per_rank = [None] * env.world_size
    dist.all_gather_object(per_rank, {"rank": env.rank, **held})
    calls = {call.name: (log.count(call.name), log.bytes(call.name) / 1e6) for call in log.calls} if log else {}
    print0("one step's collectives: " + ", ".join(f"{name} x{n} ({mb:.2f} MB)" for name, (n, mb) in calls.items()))
    predicted = zero_bytes_per_rank(num_parameters, env.world_size, args.zero)
    print0(f"{num_parameters:,} parameters; model state per rank, MB (ZeRO-{args.zero} predicts: parameters "
           f"{predicted['parameters'] / 1e6:.2f}, gradients {predicted['gradients'] / 1e6:.2f}, optimizer "
           f"{predicted['optimizer'] / 1e6:.2f}, total {predicted['total'] / 1e6:.2f})")  # fmt: skip
    for row in per_rank:
        print0(f"  rank {row['rank']}: parameters {row['parameters'] / 1e6:.2f}, gradients {row['gradients'] / 1e6:.2f}"
               f", optimizer {row['optimizer'] / 1e6:.2f}, total {row['total'] / 1e6:.2f}")  # fmt: skip
    print0(f"full parameters identical on all {env.world_size} rank(s): {in_sync}")
    setting = dict(zero=args.zero, compute_dtype=args.compute_dtype, num_parameters=num_parameters)
    write_metrics(history, args, **setting, parameters_in_sync=in_sync, predicted_bytes_per_rank=predicted,
                  memory_per_rank=per_rank, collectives_per_step=calls)  # fmt: skip


if __name__ == "__main__":
    main(parse_args())
