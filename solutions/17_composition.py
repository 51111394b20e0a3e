"""Lab 17 (lesson 16): the GPT trained on a mesh of pipeline x data x context x tensor ranks, proved equal to 1-D FSDP.

Every process builds the same GPT (common/gpt.py) from the same seed, then common/parallelize.py applies the mesh
--pp x --dp x --cp x --tp to it, in torchtitan's order: the pipeline cut (this rank's blocks, a GPipe schedule of
--microbatches), tensor + sequence parallelism (lesson 13's plan, a vocabulary-parallel head), context parallelism
(lesson 14's ring attention over the --cp ranks, each holding a zig-zag share of every sequence), then FSDP2 over
the data and context ranks (--replicas R: HSDP, R replicas of FSDP groups). Each step draws one global batch of
--batch-size windows of the text (the same on every rank, from --seed); data rank d trains on its 1/dp share, and
its --cp ranks each on 1/cp of every sequence's positions. It prints the loss of each step, averaged over the
whole batch.

The proof (torchtitan's "converging" check): the same command with --dp equal to the world size (or --control) is
plain 1-D FSDP, the control. Both runs see the same batches in the same order from the same weights, so their
losses per step, and the parameters they end with (--save FILE writes them, gathered whole, from rank 0), must
agree to rounding. Dropout is off by default: its masks depend on how the work is cut.

Before training it prints what the planner (lesson 16, section 3) says the fullest rank holds, beside what the
ranks hold: the parameters of their local shards, the largest over all ranks. They agree to within 3%: the planner
divides every parameter by tp, but tensor parallelism keeps the norms and the row-wise biases whole on each tensor
rank, and FSDP cuts dim 0 into dp pieces, the first ones a row larger where dp does not divide it.

    # CPU, 4 processes (gloo): 2 data x 2 tensor ranks, then the 1-D FSDP control on the same 4
    torchrun --standalone --nproc_per_node=4 solutions/17_composition.py --dp 2 --tp 2
    torchrun --standalone --nproc_per_node=4 solutions/17_composition.py --control

    # 2 context ranks (lesson 14's ring attention, each rank half of every sequence) x 2 tensor ranks
    torchrun --standalone --nproc_per_node=4 solutions/17_composition.py --cp 2 --tp 2

    # 2 pipeline stages x 2 tensor ranks, 4 micro-batches per step
    torchrun --standalone --nproc_per_node=4 solutions/17_composition.py --pp 2 --tp 2 --microbatches 4

    # 8 processes: 2 x 2 x 2, in float64 with SGD, where it equals the control to 1e-12
    torchrun --standalone --nproc_per_node=8 solutions/17_composition.py --pp 2 --dp 2 --tp 2 --dtype float64 \
        --optimizer sgd --lr 0.5

    # one process: the control alone (a mesh of 1 x 1 x 1 x 1), on a smaller GPT
    python solutions/17_composition.py --layers 2 --d-model 32

    # 8 GPUs (NCCL): a wider GPT, 2 stages x 2 data x 2 tensor ranks
    torchrun --standalone --nproc_per_node=8 solutions/17_composition.py --pp 2 --dp 2 --tp 2 \
        --d-model 512 --heads 8 --layers 8 --context 512 --batch-size 32 --steps 50

labs/17_composition.py leaves to you the order in which the mesh is applied (common.parallelize.parallelize), and
the planner's formula for the parameters on the fullest rank (common.planner.device_parameters: pp's stage, cut by
tp; common.planner.sharded_parameters: then cut by FSDP's shard group, under ZeRO-3 only).
"""

import time

import torch
import torch.distributed as dist

from common.checkpoint import atomic_write
from common.cli import argument_parser, options_line, positive_float, positive_int
from common.distributed import BACKENDS, is_main, print0, process_group, set_seed
from common.gpt import GPT
from common.parallelize import (
    check_degrees,
    context_share,
    data_rank,
    forward_backward,
    gathered_parameters,
    global_mean_loss,
    make_mesh,
    make_schedule,
)
from common.planner import Config, gpt_model
from common.text import load_text

# BEGIN LAB: the mesh applied to the GPT in torchtitan's order
from common.parallelize import parallelize  # isort: skip

# END LAB

# BEGIN LAB: the parameters on the fullest pipeline stage, cut by tp (no FSDP yet)
# lesson 16, section 3: stage_blocks() gives each stage's blocks (6 blocks on 4 stages: 1, 2, 2, 1), the first
# stage adds the embeddings, the last the final norm and the head; Model.layer_parameters(), embedding_parameters()
# and head_parameters() give the pieces
from common.planner import device_parameters  # isort: skip

# END LAB

# BEGIN LAB: device_parameters, cut again over FSDP's shard group under ZeRO-3 only
# lesson 16, section 3; Config.zero says whether FSDP shards (3) or not (0-2: the stage stays whole), and
# Config.shard_group is the ranks it shards over: the data ranks of one replica, times the context ranks
from common.planner import sharded_parameters  # isort: skip

# END LAB

DTYPES = {"float32": torch.float32, "float64": torch.float64}
# AdamW divides by the gradients' own size: a run whose gradients are all twice too large (summed over the data
# ranks, not averaged) takes the same steps. Plain SGD takes twice the step: the proof runs both.
OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


def parse_args(argv=None):
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--pp", type=positive_int, default=1, help="pipeline stages")
    parser.add_argument("--dp", type=positive_int, help="data-parallel (FSDP) ranks (default: what is left)")
    parser.add_argument("--replicas", type=positive_int, default=1, help="HSDP: --dp as replicas of FSDP groups")
    parser.add_argument("--cp", type=positive_int, default=1, help="context-parallel ranks: ring attention")
    parser.add_argument("--tp", type=positive_int, default=1, help="tensor + sequence parallel ranks")
    parser.add_argument("--control", action="store_true", help="1-D FSDP over every process: the reference run")
    parser.add_argument("--microbatches", type=positive_int, default=2, help="per step and data rank, with --pp")
    parser.add_argument("--text", help="a text file to learn (default: PyTorch's torch/nn/modules sources)")
    parser.add_argument("--context", type=positive_int, default=64, help="tokens (bytes) per sequence")
    parser.add_argument("--d-model", type=positive_int, default=64)
    parser.add_argument("--heads", type=positive_int, default=4)
    parser.add_argument("--layers", type=positive_int, default=4)
    parser.add_argument("--dropout", type=float, default=0.0, help="off: its masks depend on the mesh")
    parser.add_argument("--batch-size", type=positive_int, default=16, help="the global batch: sequences per step")
    parser.add_argument("--steps", type=positive_int, default=10)
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="sgd: a gradient's scale shows")
    parser.add_argument("--lr", type=positive_float, default=3e-3)
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="of the parameters and the compute")
    parser.add_argument("--save", help="write the losses and the final parameters, gathered whole, to this file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=BACKENDS, default="auto")
    return parser.parse_args(argv)


def main(args):
    with process_group(args.backend) as env:  # torchrun's RANK, WORLD_SIZE...; left on errors too
        train(args, env)


def degrees(args, world_size: int) -> tuple[int, int, int, int]:
    """(pp, dp, cp, tp): --control is 1 x world x 1 x 1; a missing --dp is what the world leaves after the rest."""
    if args.control:
        return 1, world_size, 1, 1
    dp = args.dp if args.dp is not None else max(world_size // (args.pp * args.cp * args.tp), 1)
    return args.pp, dp, args.cp, args.tp


def train(args, env):
    print0(f"{env.summary} | {options_line(args)}")
    pp, dp, cp, tp = degrees(args, env.world_size)
    shapes = dict(num_layers=args.layers, num_heads=args.heads, d_model=args.d_model, context=args.context)
    shapes |= dict(vocab_size=256, batch_size=args.batch_size, microbatches=args.microbatches)
    replicas = 1 if args.control else args.replicas
    check_degrees(pp, dp, tp, env.world_size, replicas, cp, **shapes)  # before any text is read or any collective
    text = load_text(args.text, args.context)
    mesh = make_mesh(env.device.type, pp, dp, tp, env.world_size, replicas, cp)
    print0(f"mesh: pp {pp} x dp {dp} ({replicas} replica(s)) x cp {cp} x tp {tp} = {env.world_size} processes: {mesh}")

    set_seed(args.seed)  # the same whole model on every rank, and in the control
    gpt = GPT(text.vocab_size, args.context, args.d_model, args.heads, args.layers, args.dropout)
    gpt = gpt.to(env.device, DTYPES[args.dtype])
    print0(f"GPT: {sum(p.numel() for p in gpt.parameters()):,} parameters; text: {text.source}")
    model, first_block = parallelize(gpt, mesh)
    held = parameters_held(model, env.device)
    planned = gpt_model(text.vocab_size, args.context, args.d_model, args.heads, args.layers, args.dropout)
    config = Config(dp=dp, tp=tp, pp=pp, cp=cp, zero=3, replicas=replicas)
    predicted = sharded_parameters(planned, config)
    print0(f"parameters on the fullest rank: {held:,} held; the planner: {device_parameters(planned, config):,.0f} "
           f"after pp and tp, {predicted:,.0f} once FSDP shards them over {config.shard_group} rank(s) "
           f"({held / predicted - 1:+.1%})")  # fmt: skip
    schedule = make_schedule(model, mesh, args.microbatches, env.device)
    optimizer = OPTIMIZERS[args.optimizer](model.parameters(), lr=args.lr, foreach=False)  # after: the shards

    data_index, share = data_rank(mesh)[0], args.batch_size // dp
    order = torch.randperm(len(text.train), generator=torch.Generator().manual_seed(args.seed))
    losses, started = [], time.perf_counter()
    for step in range(args.steps):
        rows = order[(step * args.batch_size) % len(order) :][: args.batch_size]  # the global batch
        rows = rows[data_index * share : (data_index + 1) * share]  # this data rank's share of it
        tokens, targets = (context_share(t[rows], mesh).to(env.device) for t in text.train.tensors)  # cp: positions
        optimizer.zero_grad(set_to_none=True)
        local = forward_backward(model, schedule, mesh, tokens, targets)
        optimizer.step()
        losses.append(global_mean_loss(local, mesh, env.device))
        print0(f"step {step + 1}/{args.steps}: loss {losses[-1]:.6f}")
    print0(f"{args.steps} steps in {time.perf_counter() - started:.1f} s")

    parameters = gathered_parameters(model, first_block)  # every rank takes part; rank 0 writes
    if args.save and is_main():
        record = {
            "mesh": {"pp": pp, "dp": dp, "replicas": replicas, "cp": cp, "tp": tp},
            "losses": losses,
            "parameters": parameters,
        }
        atomic_write(args.save, lambda file: torch.save(record, file))  # read back with weights_only=True
    return {"losses": losses, "parameters": parameters, "held parameters": (held, predicted)}


def parameters_held(model, device) -> int:
    """The parameters of this rank's local shards (a DTensor's ``to_local()``), the largest over all ranks."""
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    largest = torch.tensor([local], device=device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)  # every rank takes part; gloo and NCCL both have MAX
    return int(largest.item())


if __name__ == "__main__":
    main(parse_args())
