"""Lab 12 (lesson 11): pipeline parallelism by hand: DeepMLP cut into stages, one per process; naive, GPipe, 1F1B.

Every process builds the whole model with the same seed and keeps a contiguous slice of its layers (its stage).
A batch flows forward from stage 0 to the last stage as point-to-point messages, the loss is taken there, and the
gradients flow back; each stage then steps its own optimizer on its own parameters. The schedules order that work:
the whole batch stage after stage (naive), or micro-batches, all forwards then all backwards (GPipe), or one
forward one backward (1F1B). The script prints, for the first step of every epoch, the bubble (the share of the
step the stages waited) against the formula (p-1)/(m+p-1), and the micro-batches each stage held at once.

    # CPU, 2 processes (gloo), digits, DeepMLP in 2 stages, GPipe with 4 micro-batches
    torchrun --standalone --nproc_per_node=2 solutions/12_pipeline.py --dataset digits

    # the other schedules
    torchrun --standalone --nproc_per_node=2 solutions/12_pipeline.py --dataset digits --schedule naive
    torchrun --standalone --nproc_per_node=2 solutions/12_pipeline.py --dataset digits --schedule 1f1b \
        --microbatches 8

    # 4 GPUs (NCCL is picked by itself), Fashion-MNIST: 4 stages, GPipe (1F1B is gloo-only here: see below)
    torchrun --standalone --nproc_per_node=4 solutions/12_pipeline.py --microbatches 8

The stages and schedules are written out in common/pipeline.py (lesson 11 shows them in full); labs/12_pipeline.py
leaves the GPipe schedule to you. Every process trains on the same batches: the pipeline splits the model, not the
data. ``--batch-size`` is the whole pipeline's batch, split into ``--microbatches``.

1F1B runs on gloo only. Its neighbours send to each other at the same time (an activation forward, a gradient
back); common/pipeline.py posts those sends with ``isend``, which is enough for gloo, but NCCL may hold a send
until the matching receive runs, and the two must then be posted together (``dist.batch_isend_irecv``, as
torch.distributed.pipelining's ``Schedule1F1B`` does). Rather than risk a hang, the script refuses 1F1B on NCCL.
"""

import torch
import torch.distributed as dist

from common.cli import options_line, positive_int
from common.data import FirstBatches, load_data, make_loader
from common.distributed import ConfigurationError, print0, process_group, set_seed
from common.metrics import evaluate
from common.models import DeepMLP
from common.pipeline import (
    Stage,
    bubble_fraction_formula,
    deep_mlp_layers,
    measured_bubble_fraction,
    naive,
    one_f_one_b,
    stage_module,
)

# BEGIN LAB: the GPipe schedule in common/pipeline.py
from common.pipeline import gpipe  # noqa: F401  # isort: skip

# END LAB
from common.training import progress_bar, training_arguments

SCHEDULE_NAMES = ("gpipe", "1f1b", "naive")


def parse_args(argv=None):
    parser = training_arguments(__doc__.splitlines()[0])
    parser.set_defaults(model="mlp")  # a stack of layers to cut into stages
    parser.add_argument("--schedule", choices=SCHEDULE_NAMES, default="gpipe", help="1f1b: gloo only (see above)")
    parser.add_argument("--microbatches", type=positive_int, default=4, help="m: micro-batches per batch")
    return parser.parse_args(argv)


def main(args):
    with process_group(args.backend) as env:  # torchrun's RANK, WORLD_SIZE...; left on errors too
        train(args, env)


def train(args, env):
    print0(f"{env.summary} | {options_line(args)}")
    if args.model != "mlp":
        raise ConfigurationError("error: the pipeline cuts DeepMLP into stages: use --model mlp")
    if args.schedule == "1f1b" and env.backend == "nccl" and env.world_size > 1:
        raise ConfigurationError(
            "error: --schedule 1f1b is gloo-only here: facing sends need dist.batch_isend_irecv on NCCL (docstring)"
        )
    if args.batch_size % args.microbatches:
        raise ConfigurationError(
            f"error: --batch-size {args.batch_size} must split into {args.microbatches} micro-batches"
        )
    data = load_data(args.dataset, args.data_dir, DeepMLP.input_shape)
    # One loader of the same batches on every rank: the first stage reads the inputs, the last the targets.
    train_iter = FirstBatches(
        make_loader(data.train, args.batch_size, rank=0, world_size=1, train=True, seed=args.seed),
        args.max_batches_per_epoch,
    )
    test_iter = make_loader(data.test, args.batch_size, rank=env.rank, world_size=env.world_size, train=False)

    set_seed(args.seed)
    model = DeepMLP(num_classes=data.num_classes).to(env.device)  # the same weights on every rank
    layers = deep_mlp_layers(model)
    stage = Stage(
        stage_module(layers, env.rank, env.world_size), env.rank, env.world_size, DeepMLP.input_shape, args.batch_size
    )
    optimizer = torch.optim.SGD(stage.module.parameters(), lr=args.lr, momentum=0.9)  # this stage's only
    print0(
        f"{env.world_size} stage(s) of DeepMLP's {len(layers)} layers; schedule {args.schedule}, "
        f"{args.microbatches} micro-batch(es) of {args.batch_size // args.microbatches}"
    )

    history = []
    for epoch in range(args.epochs):
        train_iter.sampler.set_epoch(epoch)
        loss_sum, batches, records = 0.0, 0, None
        for X, y in progress_bar(train_iter, f"epoch {epoch + 1}/{args.epochs}"):
            if len(X) != args.batch_size:
                continue  # the epoch's last, short batch: a pipeline step needs the batch size its stages expect
            optimizer.zero_grad(set_to_none=True)
            loss, record = run_schedule(stage, args, X.to(env.device), y.to(env.device))
            optimizer.step()  # each stage steps its own parameters, with the whole batch's gradients
            if records is None:  # the epoch's first step: its timeline
                records = gather(record)
            if loss is not None:
                loss_sum, batches = loss_sum + float(loss), batches + 1
        history.append(report(epoch, args, env, stage, model, test_iter, loss_sum, batches, records))
    return history


def run_schedule(stage, args, X, y):
    """One step's forward and backward with ``--schedule``: inputs to the first stage, targets to the last."""
    inputs = X if stage.is_first else None
    targets = y if stage.is_last else None
    if args.schedule == "naive":
        return naive(stage, inputs, targets)
    schedule = gpipe if args.schedule == "gpipe" else one_f_one_b
    return schedule(stage, args.microbatches, inputs, targets)


def gather(record):
    """Every rank's record of one step, on every rank."""
    records = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    return records


def report(epoch, args, env, stage, model, test_iter, loss_sum, batches, records):
    """Print and return the epoch's loss (the last stage's), the first step's bubble and the micro-batches each
    stage held, and the test accuracy of the whole model, put together from every stage's parameters."""
    # The last stage knows the loss: it sends it to everyone with a broadcast from the last rank.
    loss = torch.tensor([loss_sum / max(batches, 1)], dtype=torch.float64, device=env.device)
    dist.broadcast(loss, src=env.world_size - 1)
    m = 1 if args.schedule == "naive" else args.microbatches
    bubble = measured_bubble_fraction(records)
    held = [record["peak_in_flight"] for record in records]
    assemble_whole_model(model, stage)
    test = evaluate(model, test_iter, env.device)
    row = {
        "train loss": loss.item(),
        "test accuracy": test["accuracy"],
        "bubble": bubble,
        "formula": bubble_fraction_formula(env.world_size, m),
        "micro-batches held": held,
    }
    print0(
        f"epoch {epoch + 1}/{args.epochs}: train loss {row['train loss']:.4f} | test accuracy {test['accuracy']:.2%} | "
        f"bubble {bubble:.2f} measured, {row['formula']:.2f} by the formula | micro-batches held per stage {held}"
    )
    return row


def assemble_whole_model(model, stage):
    """Copy every stage's trained parameters into every rank's ``model``, so that any rank can evaluate it whole.

    Each rank's ``model`` holds its own stage's parameters, trained, and the other stages' as they were built.
    """
    names = {parameter: name for name, parameter in model.named_parameters()}
    mine = {names[parameter]: parameter.detach().cpu() for parameter in stage.module.parameters()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            owner = next(part for part in everyone if name in part)
            parameter.copy_(owner[name])


if __name__ == "__main__":
    main(parse_args())
