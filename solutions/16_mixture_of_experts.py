"""Lab 16 (lesson 15): a GPT whose MLPs are mixtures of experts, the experts split over the ranks (expert parallelism).

Every process builds the same small GPT (common/gpt.py) with each block's MLP replaced by a mixture of --experts
MLPs and a router that sends each token to its --top-k best (common/moe.py). The experts are split over --ep ranks:
two all-to-alls per layer carry each token to the rank of its expert and the result back. With more processes than
--ep, the rest is data parallelism: a 2-D mesh of dp x ep ranks, the experts copied over dp. Every rank reads its
own batches. The loss adds --balance times Switch's load-balancing loss; --capacity-factor caps the tokens per
expert (the rest are dropped: their residual carries them on). Each epoch prints the losses, the share of the
tokens each expert of the first layer took, the assignments dropped, and the milliseconds per step spent in the
all-to-alls and in the gradient all-reduces.

    # CPU, 2 processes (gloo): 4 experts, 2 on each rank
    torchrun --standalone --nproc_per_node=2 solutions/16_mixture_of_experts.py

    # 4 processes on a 2 x 2 mesh: experts split over 2 ranks, copied over 2; top-2 routing, no balancing loss
    torchrun --standalone --nproc_per_node=4 solutions/16_mixture_of_experts.py --ep 2 --top-k 2 --balance 0

    # one process: every expert here (its all-to-alls send to itself)
    python solutions/16_mixture_of_experts.py --epochs 1 --max-batches-per-epoch 20

    # 8 GPUs (NCCL): 16 experts, 2 per GPU, a wider GPT
    torchrun --standalone --nproc_per_node=8 solutions/16_mixture_of_experts.py --experts 16 --top-k 2 \
        --d-model 512 --heads 8 --layers 8 --context 512 --batch-size 8

labs/16_mixture_of_experts.py leaves the all-to-all's autograd Function, the count exchange, the expert-major
permutation and the dispatch inside ExpertParallelMoE (the counts, the two all-to-alls, the inverse permutation) to
you.
"""

import math
import time

import torch
import torch.distributed as dist

from common.cli import argument_parser, options_line, positive_float, positive_int
from common.collectives import count_collectives
from common.data import FirstBatches, make_loader
from common.distributed import BACKENDS, ConfigurationError, print0, process_group, set_seed
from common.gpt import GPT, next_token_loss
from common.moe import average_gradients, balance_loss, check_top_k, is_expert_parameter, moe_gpt, moe_layers
from common.text import load_text

# BEGIN LAB: apply the autograd Function (``.apply``)
from common.moe import all_to_all  # noqa: F401  # isort: skip

# END LAB
# BEGIN LAB: the all-to-all as an autograd Function: backward is the reverse exchange
from common.moe import AllToAll  # noqa: F401  # isort: skip

# END LAB
# BEGIN LAB: how many rows this rank receives from each rank, for each of its experts (one even all-to-all)
from common.moe import exchange_counts  # noqa: F401  # isort: skip

# END LAB
# BEGIN LAB: the permutation that groups the received rows by expert, then by source rank
from common.moe import expert_major_order  # noqa: F401  # isort: skip

# END LAB
# BEGIN LAB: expert parallelism: each token to its expert's rank and back
from common.moe import ExpertParallelMoE  # isort: skip

# END LAB


def parse_args(argv=None):
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--text", help="a text file to learn (default: PyTorch's torch/nn/modules sources)")
    parser.add_argument("--experts", type=positive_int, default=4, help="experts per MoE layer")
    parser.add_argument("--top-k", type=positive_int, default=1, help="experts per token")
    parser.add_argument("--ep", type=positive_int, help="ranks the experts are split over (default: all)")
    parser.add_argument("--balance", type=float, default=0.01, help="weight of the load-balancing loss")
    parser.add_argument("--capacity-factor", type=positive_float, help="tokens per expert, x an even share")
    parser.add_argument("--context", type=positive_int, default=64, help="tokens (bytes) per sequence")
    parser.add_argument("--d-model", type=positive_int, default=64)
    parser.add_argument("--heads", type=positive_int, default=4)
    parser.add_argument("--layers", type=positive_int, default=2)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--epochs", type=positive_int, default=2)
    parser.add_argument("--batch-size", type=positive_int, default=16, help="sequences per step and process")
    parser.add_argument("--lr", type=positive_float, default=3e-3, help="AdamW's")
    parser.add_argument("--max-batches-per-epoch", type=positive_int, default=60, help="for quick runs")
    parser.add_argument("--val-batches", type=positive_int, default=8, help="validation batches per epoch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=BACKENDS, default="auto")
    return parser.parse_args(argv)


def main(args):
    with process_group(args.backend) as env:  # torchrun's RANK, WORLD_SIZE...; left on errors too
        train(args, env)


def train(args, env):
    print0(f"{env.summary} | {options_line(args)}")
    ep = args.ep or env.world_size
    if env.world_size % ep or args.experts % ep:
        raise ConfigurationError(
            f"error: --ep {ep} must divide the {env.world_size} processes and the --experts {args.experts}"
        )
    try:
        check_top_k(args.top_k, args.experts)
    except ValueError as error:
        raise ConfigurationError(f"error: --top-k {args.top_k}: {error}") from None
    ep_group, dp_group = make_groups(env, ep)
    text = load_text(args.text, args.context)  # a missing file stops here, with what to pass instead
    # Every rank its own batches (data parallelism over all ranks); validation: the same batches on every rank.
    loader = make_loader(text.train, args.batch_size, env.rank, env.world_size, True)
    train_iter = FirstBatches(loader, args.max_batches_per_epoch)
    val_iter = FirstBatches(make_loader(text.validation, args.batch_size, 0, 1, train=False), args.val_batches)

    set_seed(args.seed)  # the same weights on every rank
    model = GPT(text.vocab_size, args.context, args.d_model, args.heads, args.layers, args.dropout)
    moe_gpt(model, args.experts, args.top_k, capacity_factor=args.capacity_factor)
    print0(f"GPT with {args.experts} experts per layer: {sum(p.numel() for p in model.parameters()):,} parameters")
    ep_rank = env.rank % ep  # the mesh is dp x ep: consecutive ranks share the experts out
    for block in model.blocks:  # common.moe.expert_parallel_gpt, written out
        block.mlp = ExpertParallelMoE(block.mlp, ep_rank, ep, ep_group)
    model.to(env.device)
    print0(f"dp x ep = {env.world_size // ep} x {ep}: rank 0 keeps experts 0-{args.experts // ep - 1} of each layer")
    set_seed(args.seed, env.rank)  # dropout: each rank its own masks
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False)

    history = []
    for epoch in range(args.epochs):
        train_iter.sampler.set_epoch(epoch)
        model.train()
        loss_sum, steps, counts, dropped, off_rank = 0.0, 0, torch.zeros(args.experts, dtype=torch.long), 0, 0
        started = time.perf_counter()
        with count_collectives() as log:
            for tokens, targets in train_iter:
                tokens, targets = tokens.to(env.device), targets.to(env.device)
                loss = next_token_loss(model(tokens), targets)
                optimizer.zero_grad(set_to_none=True)
                (loss + args.balance * balance_loss(model)).backward()
                average_gradients(model, env.world_size, dp_group)  # experts: over dp only; the rest: everyone
                optimizer.step()
                first = moe_layers(model)[0].routing
                counts += first.counts(args.experts).cpu()
                dropped += sum(layer.routing.dropped for layer in moe_layers(model))
                off_rank += rows_off_rank(model, ep_rank) * args.d_model * 4  # fp32 rows
                loss_sum, steps = loss_sum + loss.item(), steps + 1
        seconds = time.perf_counter() - started
        row = {"epoch": epoch + 1, "train loss": summed(loss_sum / steps, env) / env.world_size}
        row["validation loss"] = evaluate(model, val_iter, env)
        counts = summed(counts.double(), env)
        assignments = steps * args.batch_size * args.context * args.top_k * args.layers * env.world_size
        row |= {"tokens per expert": (counts / counts.sum()).tolist(), "dropped": summed(dropped, env) / assignments}
        row |= {name: 1000 * in_collective(log, name) / steps for name in ("all_to_all_single", "all_reduce")}
        row["step ms"], row["in sync"] = 1000 * seconds / steps, in_sync(model, dp_group)
        row["MiB off rank"] = off_rank / steps / 2**20
        shares = " ".join(f"{share:.0%}" for share in row["tokens per expert"])
        print0(
            f"epoch {epoch + 1}/{args.epochs}: train loss {row['train loss']:.4f} | validation loss "
            f"{row['validation loss']:.4f}, perplexity {math.exp(row['validation loss']):.2f} | layer 1's experts "
            f"took {shares} | dropped {row['dropped']:.1%}\n  rank 0, per step: {row['step ms']:.1f} ms, all-to-alls "
            f"{row['all_to_all_single']:.1f} ms ({row['MiB off rank']:.2f} MiB to other ranks), gradient "
            f"all-reduces {row['all_reduce']:.1f} ms | copies the same on every rank: {row['in sync']}"
        )
        history.append(row)
    return history


def make_groups(env, ep: int):
    """The expert-parallel group of this rank (``ep`` consecutive ranks) and its data-parallel one (the ranks that
    hold the same experts), from a 2-D ``DeviceMesh`` (dp, ep); ``None`` for a group of one."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(env.device.type, (env.world_size // ep, ep), mesh_dim_names=("dp", "ep"))
    return mesh.get_group("ep"), mesh.get_group("dp") if ep < env.world_size else None


def summed(value, env):
    """``value`` (a number or a tensor) summed over every rank."""
    total = torch.as_tensor(value, dtype=torch.float64).to(env.device)
    if env.world_size > 1:
        dist.all_reduce(total)
    return total.item() if total.dim() == 0 else total.cpu()


def in_collective(log, name: str) -> float:
    """Seconds this rank spent inside collective ``name`` calls (blocking: waiting for the others included)."""
    return sum(call.returned - call.started for call in log.calls if call.name == name)


def rows_off_rank(model, ep_rank: int) -> int:
    """The rows this rank's all-to-alls sent to other ranks in the last step: the tokens out and the results back
    in forward, the same counts again in backward (the gradients), summed over the MoE layers."""
    rows = 0
    for layer in moe_layers(model):
        send, receive = layer.splits
        rows += 2 * (sum(send) - send[ep_rank] + sum(receive) - receive[ep_rank])
    return rows


@torch.no_grad()
def evaluate(model, val_iter, env) -> float:
    """The mean next-byte loss over ``val_iter``'s windows: the same batches on every rank, which all take part
    (the all-to-alls are collectives), so every rank gets the same figure."""
    model.eval()
    total, count = 0.0, 0
    for tokens, targets in val_iter:
        loss = next_token_loss(model(tokens.to(env.device)), targets.to(env.device)).item()
        total, count = total + loss * len(tokens), count + len(tokens)
    return total / count


def in_sync(model, dp_group) -> bool:
    """Whether every copy is the same: the parameters outside the experts on all ranks, the experts over dp."""
    verdicts = []
    for experts, group in ((False, None), (True, dp_group)):
        flat = [p.detach().flatten() for n, p in model.named_parameters() if is_expert_parameter(n) == experts]
        if experts and group is None:
            continue
        highest, lowest = torch.cat(flat).clone(), torch.cat(flat).clone()
        dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=group)
        verdicts.append(torch.equal(highest, lowest))
    return all(verdicts)


if __name__ == "__main__":
    main(parse_args())
