"""Lab 14 (lesson 13): a GPT's activation memory, cut by recomputation and by sequence parallelism, trained on text.

Every process builds the same small GPT (common/gpt.py: lesson 12's layer with a causal mask and dropout) and
trains it to predict the next byte of a text: the Python sources of PyTorch's own torch/nn/modules by default (no
network), or any file (--text FILE). Each epoch prints the training loss, the validation loss and its perplexity.
The first step prints what forward kept for backward on each rank (measured, common.activations.HeldMemory) and the
collectives of forward and backward. The run ends with a sample of generated text.

--parallel data: DDP, each rank on its own batches. --parallel tensor: lesson 12's split of every block over all
ranks, which read the same batches. --parallel sequence: that plus sequence parallelism by hand, the norms, dropouts
and residuals cut along the sequence (--regather: keep only the shards of the linears' inputs). --parallel
torch-sequence: the same by torch's DTensor (SequenceParallel, loss_parallel). --recompute by-hand, full or
selective: each block's activations recomputed in backward instead of kept.

    # CPU, 2 processes (gloo): data parallel, each block recomputed by hand
    torchrun --standalone --nproc_per_node=2 solutions/14_activation_memory.py --recompute by-hand

    # tensor and sequence parallelism by hand over the 2 processes, with selective recomputation
    torchrun --standalone --nproc_per_node=2 solutions/14_activation_memory.py --parallel sequence --recompute selective

    # the same split by torch: SequenceParallel, a vocabulary-parallel head, loss_parallel
    torchrun --standalone --nproc_per_node=2 solutions/14_activation_memory.py --parallel torch-sequence

    # one process, on a text of your own: here the labs' README
    python solutions/14_activation_memory.py --text labs/README.md --context 64 --batch-size 8 --epochs 3

    # 4 GPUs (NCCL): a wider GPT over 512 tokens, split over all four, keeping only the shards
    torchrun --standalone --nproc_per_node=4 solutions/14_activation_memory.py --parallel sequence --regather \
        --d-model 512 --heads 8 --layers 8 --context 512 --batch-size 8

labs/14_activation_memory.py leaves the recomputation by hand (its forward and backward, with the random state put
back) and the sequence-parallel pair (the all-gather and the reduce-scatter, forward and backward) to you.
"""

import math
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.parallel import DistributedDataParallel as DDP

from common.activations import HeldMemory
from common.checkpoint import unwrap
from common.cli import argument_parser, options_line, positive_float, positive_int
from common.collectives import count_collectives
from common.data import FirstBatches, make_loader
from common.distributed import BACKENDS, ConfigurationError, print0, process_group, replicas_in_sync, set_seed
from common.gpt import GPT, generate, next_token_loss
from common.recompute import RECOMPUTE_MODES
from common.sequence_parallel import parallelize_gpt, replicated_in_sync, shard_gpt
from common.text import decode, load_text

# BEGIN LAB: apply the autograd Function (``.apply``)
from common.recompute import recompute  # noqa: F401  # isort: skip
from common.sequence_parallel import gather_from_sequence_parallel, reduce_scatter_to_sequence_parallel  # noqa: F401  # isort: skip

# END LAB
# BEGIN LAB: recomputation by hand: keep a block's input and the random state, run its forward again in backward
from common.recompute import Recompute, RecomputedBlock  # noqa: F401  # isort: skip

# END LAB
# BEGIN LAB: sequence parallelism by hand: all-gather and reduce-scatter along the sequence as autograd functions
from common.sequence_parallel import GatherFromSequenceParallel, ReduceScatterToSequenceParallel  # noqa: F401  # isort: skip
from common.sequence_parallel import SequenceParallelMLP, SequenceParallelSelfAttention  # noqa: F401  # isort: skip
from common.sequence_parallel import SequenceParallelGPT  # isort: skip

# END LAB

PARALLEL = ("data", "tensor", "sequence", "torch-sequence")


def parse_args(argv=None):
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--text", help="a text file to learn (default: PyTorch's torch/nn/modules sources)")
    parser.add_argument("--parallel", choices=PARALLEL, default="data", help="how the processes share the work")
    parser.add_argument("--recompute", choices=RECOMPUTE_MODES, default="none", help="each block, in backward")
    parser.add_argument("--regather", action="store_true", help="--parallel sequence: keep the linears' input shards")
    parser.add_argument("--context", type=positive_int, default=128, help="tokens (bytes) per sequence")
    parser.add_argument("--d-model", type=positive_int, default=128)
    parser.add_argument("--heads", type=positive_int, default=4)
    parser.add_argument("--layers", type=positive_int, default=4)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--epochs", type=positive_int, default=2)
    parser.add_argument("--batch-size", type=positive_int, default=16, help="sequences per step and process group")
    parser.add_argument("--lr", type=positive_float, default=3e-3, help="AdamW's")
    parser.add_argument("--max-batches-per-epoch", type=positive_int, help="for quick runs")
    parser.add_argument("--val-batches", type=positive_int, default=24, help="validation batches per epoch")
    parser.add_argument("--sample-length", type=positive_int, default=120, help="bytes to generate at the end")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=BACKENDS, default="auto")
    return parser.parse_args(argv)


def main(args):
    with process_group(args.backend) as env:  # torchrun's RANK, WORLD_SIZE...; left on errors too
        train(args, env)


def train(args, env):
    print0(f"{env.summary} | {options_line(args)}")
    split = args.parallel != "data"
    if split and args.context % env.world_size:
        raise ConfigurationError(f"error: --context {args.context} does not divide by the {env.world_size} ranks")
    text = load_text(args.text, args.context)  # a missing file stops here, with what to pass instead
    # Data parallelism deals each rank its own batches; a split model needs the same batch on every rank.
    train_iter = FirstBatches(
        make_loader(text.train, args.batch_size, 0 if split else env.rank, 1 if split else env.world_size, True),
        args.max_batches_per_epoch,
    )
    val_iter = FirstBatches(make_loader(text.validation, args.batch_size, 0, 1, train=False), args.val_batches)

    set_seed(args.seed)  # the same weights on every rank
    model = GPT(text.vocab_size, args.context, args.d_model, args.heads, args.layers, args.dropout).to(env.device)
    print0(f"text: {text.source}, {text.num_bytes:,} bytes; {len(text.train):,} training windows of {args.context}")
    print0(f"GPT: {sum(p.numel() for p in model.parameters()):,} parameters")
    net = parallelize(model, args, env)
    # Dropout: where ranks hold different activations (data, sequence parallelism), each draws its own masks.
    set_seed(args.seed, env.rank if args.parallel in ("data", "sequence", "torch-sequence") else 0)
    optimizer = torch.optim.AdamW(net.parameters(), lr=args.lr, foreach=False)  # foreach: plain tensors only

    history = []
    for epoch in range(args.epochs):
        train_iter.sampler.set_epoch(epoch)
        net.train()
        loss_sum, steps, started = 0.0, 0, time.perf_counter()
        for tokens, targets in train_iter:
            tokens, targets = tokens.to(env.device), targets.to(env.device)
            optimizer.zero_grad(set_to_none=True)
            if epoch == steps == 0:
                loss = measured_step(net, tokens, targets, args)
            else:
                with loss_context(args):
                    loss = forward_loss(net, tokens, targets, args)
                    backward(net, loss, args)
            optimizer.step()
            loss_sum, steps = loss_sum + reported(loss, args), steps + 1
        tokens_per_second = steps * args.batch_size * args.context * (1 if split else env.world_size)
        tokens_per_second /= time.perf_counter() - started
        row = {"epoch": epoch + 1, "train loss": mean_over_ranks(loss_sum / max(steps, 1), args, env)}
        row["validation loss"] = evaluate(net, val_iter, args, env)
        row["in sync"] = in_sync(net, args)
        print0(
            f"epoch {epoch + 1}/{args.epochs}: train loss {row['train loss']:.4f} | validation loss "
            f"{row['validation loss']:.4f}, perplexity {math.exp(row['validation loss']):.2f} | "
            f"{tokens_per_second:,.0f} tokens/s | replicated parameters the same on every rank: {row['in sync']}"
        )
        history.append(row)
    sample = generate_text(net, text, args, env)
    print0(f"sample, after the validation text's first {args.context} bytes:\n{sample}")
    return history


def parallelize(model: GPT, args, env):
    """``model`` split or wrapped as ``--parallel`` says, its blocks recomputed as ``--recompute`` says (after the
    split, before DDP: the order torchtitan applies them in)."""
    if args.parallel == "tensor":
        model = shard_gpt(model, env.rank, env.world_size)
    elif args.parallel == "sequence":
        model = SequenceParallelGPT(model, env.rank, env.world_size, regather=args.regather)
    elif args.parallel == "torch-sequence":
        from torch.distributed.device_mesh import init_device_mesh

        model = parallelize_gpt(model, init_device_mesh(env.device.type, (env.world_size,)))
    for index, block in enumerate(model.blocks):  # common.recompute.apply_recomputation, written out
        model.blocks[index] = RecomputedBlock(block, args.recompute)
    return DDP(model, device_ids=env.device_ids) if args.parallel == "data" else model


def loss_context(args):
    """torch's vocabulary-parallel head needs ``loss_parallel`` around the loss and its backward."""
    return loss_parallel() if args.parallel == "torch-sequence" else nullcontext()


def forward_loss(net, tokens, targets, args):
    """The loss to call backward on: by-hand sequence parallelism's is this rank's share of the mean."""
    if args.parallel == "sequence":
        return net.loss(tokens, targets)
    return next_token_loss(net(tokens), targets)


def backward(net, loss, args) -> None:
    loss.backward()
    if args.parallel == "sequence":
        net.finish_gradients()  # the replicated parameters saw this rank's tokens only: sum their gradients


def reported(loss, args) -> float:
    """The step's mean loss on this rank (sequence parallelism: this rank's share of it; DTensor: its value)."""
    return (loss.full_tensor() if isinstance(loss, DTensor) else loss).item()


def mean_over_ranks(value: float, args, env) -> float:
    """Data parallelism: the mean of the ranks' losses; sequence parallelism: the sum of their shares; else it."""
    if args.parallel not in ("data", "sequence"):
        return value
    total = torch.tensor(value, dtype=torch.float64, device=env.device)
    dist.all_reduce(total)
    return total.item() / (env.world_size if args.parallel == "data" else 1)


def measured_step(net, tokens, targets, args):
    """The first step's forward and backward, printing what forward kept for backward (``HeldMemory``; not for
    DTensors, whose wrappers hold no storage of their own) and the collectives each pass started (DDP's bucketed
    all-reduces run in C++, where neither counter sees them)."""
    counter = CommDebugMode if args.parallel == "torch-sequence" else count_collectives
    memory = HeldMemory() if args.parallel != "torch-sequence" else nullcontext()
    with loss_context(args), counter() as forward_log, memory:
        loss = forward_loss(net, tokens, targets, args)
        kept = f"{memory.bytes / 2**20:.2f} MiB" if isinstance(memory, HeldMemory) else "not measured (DTensor)"
    with loss_context(args), counter() as backward_log:
        backward(net, loss, args)
    passes = {"forward": describe(forward_log), "backward": describe(backward_log)}
    if args.parallel == "data":
        passes["backward"] = "DDP's gradient all-reduces"
    print0(f"first step: forward kept {kept} for backward on rank 0 | forward: {passes['forward']}, backward: "
           f"{passes['backward']}")  # fmt: skip
    return loss


def describe(log) -> str:
    """What one pass's counter saw, in words: ``2 x all_gather_single (0.25 MiB each)``, ..."""
    if isinstance(log, CommDebugMode):
        counts = {str(op).split(".")[-1]: (count, None) for op, count in log.get_comm_counts().items()}
    else:
        counts = {}
        for call in log.calls:
            count, _ = counts.get(call.name, (0, call.bytes))
            counts[call.name] = (count + 1, call.bytes)
    words = [f"{n} x {name}" + (f" ({size / 2**20:.2f} MiB)" if size else "") for name, (n, size) in counts.items()]
    return " + ".join(words) or "none"


@torch.no_grad()
def evaluate(net, val_iter, args, env) -> float:
    """The mean next-byte loss over ``val_iter``'s windows, the same on every rank (which all take part: a split
    model's forward is a collective)."""
    net.eval()
    total, count = 0.0, 0
    for tokens, targets in val_iter:
        tokens, targets = tokens.to(env.device), targets.to(env.device)
        with loss_context(args):
            if args.parallel == "data":  # every rank holds the whole model: no collective needed
                loss = next_token_loss(unwrap(net)(tokens), targets).item()
            else:
                loss = mean_over_ranks(reported(forward_loss(net, tokens, targets, args), args), args, env)
        total, count = total + loss * len(tokens), count + len(tokens)
    return total / count


def in_sync(net, args) -> bool | None:
    """Whether the copies of what several ranks hold are the same everywhere: the whole model under data
    parallelism, the replicated parameters under the by-hand splits; None for DTensor (not compared here)."""
    if args.parallel == "data":
        return replicas_in_sync(net)
    return replicated_in_sync(net) if args.parallel in ("tensor", "sequence") else None


def generate_text(net, text, args, env) -> str:
    """``--sample-length`` bytes sampled after the first ``--context`` bytes of the validation text. Every rank
    samples (a split model's forward is a collective) with the same seed, so all draw the same bytes."""
    net.eval()

    def logits_of(tokens):  # the last position's logits, on every rank
        if args.parallel == "data":
            return unwrap(net)(tokens)
        logits = net(tokens)
        if isinstance(logits, DTensor):  # cut by vocabulary: gathered whole
            return logits.full_tensor()
        if args.parallel == "sequence":  # the last position is the last rank's: it sends it to the others
            last = logits[:, -1:].contiguous()
            dist.broadcast(last, src=env.world_size - 1)
            return last
        return logits

    prompt = text.validation.tensors[0][:1].to(env.device)
    tokens = generate(logits_of, prompt, args.sample_length, window=args.context, seed=args.seed)
    return decode(tokens[0, args.context :])


if __name__ == "__main__":
    main(parse_args())
