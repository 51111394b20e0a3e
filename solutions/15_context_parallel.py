"""Lab 15 (lesson 14): context parallelism, one sequence split over the ranks, its attention passed around a ring.

Every process builds the same small GPT (common/gpt.py, lesson 13's, without dropout) and trains it to predict the
next byte of a text: the Python sources of PyTorch's own torch/nn/modules by default (no network), or any file
(--text FILE). Every rank reads the same batches, and each keeps only its slice of every sequence: its positions'
embeddings, activations and logits. Attention needs every earlier position, so the keys and values travel:
--method ring passes them around the ring block by block (common.context_parallel.RingAttention), --method
all-gather gathers them all at once (Llama 3's way), --method torch is PyTorch's context_parallel (CUDA only).
--layout zigzag gives each rank a chunk from the front and its mirror from the back, so the causal mask leaves
every rank the same work; --layout contiguous gives rank r the r-th slice. The first step prints the messages
and collectives of one forward and backward; each epoch prints the losses and the tokens per second.

    # CPU, 2 processes (gloo): the ring, zig-zag layout
    torchrun --standalone --nproc_per_node=2 solutions/15_context_parallel.py

    # 4 processes, contiguous slices, keys and values all-gathered instead
    torchrun --standalone --nproc_per_node=4 solutions/15_context_parallel.py --layout contiguous --method all-gather

    # one process: the whole sequence, blockwise attention over one block
    python solutions/15_context_parallel.py --epochs 1 --max-batches-per-epoch 20

    # 2+ GPUs (NCCL): PyTorch's context_parallel around F.scaled_dot_product_attention, a longer context
    torchrun --standalone --nproc_per_node=2 solutions/15_context_parallel.py --method torch --context 1024

labs/15_context_parallel.py leaves the online-softmax merge and the ring's send and receive to you.
"""

import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common.cli import argument_parser, options_line, positive_float, positive_int
from common.collectives import count_collectives, count_messages
from common.context_parallel import LAYOUTS, METHODS, shard_pieces
from common.data import FirstBatches, make_loader
from common.distributed import BACKENDS, ConfigurationError, print0, process_group, set_seed
from common.gpt import GPT
from common.text import load_text

# BEGIN LAB: the online-softmax merge, and the ring's direction of messages (one group)
from common.context_parallel import merge, pass_along  # noqa: F401  # isort: skip
from common.context_parallel import BlockwiseAttention, RingAttention  # noqa: F401  # isort: skip
from common.context_parallel import ContextParallelSelfAttention, ContextParallelGPT  # noqa: F401  # isort: skip

# END LAB


def parse_args(argv=None):
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--text", help="a text file to learn (default: PyTorch's torch/nn/modules sources)")
    parser.add_argument("--method", choices=(*METHODS, "torch"), default="ring", help="how keys and values travel")
    parser.add_argument("--layout", choices=LAYOUTS, default="zigzag", help="which positions each rank holds")
    parser.add_argument("--context", type=positive_int, default=256, help="tokens (bytes) per sequence")
    parser.add_argument("--d-model", type=positive_int, default=64)
    parser.add_argument("--heads", type=positive_int, default=4)
    parser.add_argument("--layers", type=positive_int, default=2)
    parser.add_argument("--epochs", type=positive_int, default=2)
    parser.add_argument("--batch-size", type=positive_int, default=8, help="sequences per step, on every rank")
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
    try:  # a context the layout cannot cut fails here, before any text is read or message sent
        shard_pieces(args.context, env.rank, env.world_size, args.layout)
    except ValueError as error:
        raise ConfigurationError(f"error: --context {args.context}: {error}") from None
    if args.method == "torch" and env.device.type != "cuda":
        raise ConfigurationError(
            "error: --method torch needs CUDA GPUs: context_parallel's handler replaces only the CUDA flash, "
            "memory-efficient and cuDNN attention kernels, not the CPU's"
        )
    text = load_text(args.text, args.context)
    # Every rank reads the same batches: the ranks split each sequence, not the batch.
    train_iter = FirstBatches(make_loader(text.train, args.batch_size, 0, 1, True), args.max_batches_per_epoch)
    val_iter = FirstBatches(make_loader(text.validation, args.batch_size, 0, 1, train=False), args.val_batches)

    set_seed(args.seed)  # the same weights on every rank
    model = GPT(text.vocab_size, args.context, args.d_model, args.heads, args.layers, dropout=0.0).to(env.device)
    print0(f"text: {text.source}, {text.num_bytes:,} bytes; {len(text.train):,} training windows of {args.context}")
    print0(f"GPT: {sum(p.numel() for p in model.parameters()):,} parameters; {args.context // env.world_size} "
           f"positions per rank")  # fmt: skip
    net = model if args.method == "torch" else ContextParallelGPT(model, env.rank, env.world_size, args.layout,
                                                                  args.method)  # fmt: skip
    optimizer = torch.optim.AdamW(net.parameters(), lr=args.lr, foreach=False)

    history = []
    for epoch in range(args.epochs):
        train_iter.sampler.set_epoch(epoch)
        net.train()
        loss_sum, steps, started = 0.0, 0, time.perf_counter()
        for tokens, targets in train_iter:
            tokens, targets = tokens.to(env.device), targets.to(env.device)
            optimizer.zero_grad(set_to_none=True)
            with count_messages() as messages, count_collectives() as collectives:
                loss = step_loss(net, tokens, targets, args, env)
            if epoch == steps == 0:
                print0(f"first step on rank 0: {messages.sends} messages sent, {messages.bytes_sent / 2**20:.3f} "
                       f"MiB | collectives: {describe(collectives)}")  # fmt: skip
            optimizer.step()
            loss_sum, steps = loss_sum + loss, steps + 1
        tokens_per_second = steps * args.batch_size * args.context / (time.perf_counter() - started)
        row = {"epoch": epoch + 1, "train loss": loss_sum / max(steps, 1)}
        row["validation loss"] = evaluate(net, val_iter, args, env)
        print0(
            f"epoch {epoch + 1}/{args.epochs}: train loss {row['train loss']:.4f} | validation loss "
            f"{row['validation loss']:.4f}, perplexity {math.exp(row['validation loss']):.2f} | "
            f"{tokens_per_second:,.0f} tokens/s"
        )
        history.append(row)
    return history


def step_loss(net, tokens, targets, args, env) -> float:
    """One forward and backward; every gradient summed over the ranks. The batch's mean loss, on every rank."""
    if args.method == "torch":  # its backward runs inside its context: see torch_context_parallel_loss
        loss = torch_context_parallel_loss(net, tokens, targets, env, backward=True)
    else:
        loss = net.loss(tokens, targets)  # this rank's share of the mean
        loss.backward()
    for parameter in net.parameters():  # each rank's gradients hold its positions' terms only: sum them
        dist.all_reduce(parameter.grad)  # (ContextParallelGPT.finish_gradients, written out)
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item()


def torch_context_parallel_loss(gpt: GPT, tokens, targets, env, backward: bool = False):
    """PyTorch's context parallelism: ``context_parallel`` shards the listed buffers along the sequence in place
    (head-tail, its zig-zag, when the length divides by 2N) and swaps ``F.scaled_dot_product_attention`` for its
    context-parallel version inside the block. Its default all-gathers the keys and values (in forward, and again
    in backward); their gradients still pass rank to rank around a ring. The attention must therefore call SDPA:
    this GPT's ``attend`` does not, so ``sdpa_forward`` runs the same weights through it.

    ``backward``: run ``loss.backward()`` inside the block. It must: on exit ``context_parallel`` removes its SDPA
    handler and puts the buffers back, and SDPA's backward would then run without it, over the whole
    permuted sequence. Returns the loss, detached."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cuda", (env.world_size,))
    positions = torch.arange(tokens.shape[1], device=tokens.device)[None].expand_as(tokens).contiguous()
    tokens, targets = tokens.clone(), targets.clone()
    with context_parallel(mesh, buffers=[tokens, targets, positions], buffer_seq_dims=[1, 1, 1]):
        logits = sdpa_forward(gpt, tokens, positions)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / (
            targets.numel() * env.world_size
        )
        if backward:
            loss.backward()
    return loss.detach()


def sdpa_forward(gpt: GPT, tokens, positions):
    """``gpt``'s forward with its attention computed by ``F.scaled_dot_product_attention(is_causal=True)``, at the
    given ``positions`` (a rank's shard of them under ``context_parallel``)."""
    X = gpt.token(tokens) + gpt.position(positions)
    for block in gpt.blocks:
        a, (batch, seq, width) = block.attention, X.shape
        Y = block.attention_norm(X)
        q, k, v = (p(Y).view(batch, seq, a.num_heads, a.head_dim).transpose(1, 2) for p in (a.q, a.k, a.v))
        mixed = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        X = X + a.out(mixed.transpose(1, 2).reshape(batch, seq, width))
        X = X + block.mlp(block.mlp_norm(X))
    return gpt.head(gpt.norm(X))


def describe(log) -> str:
    """A step's collectives in words: ``38 x all_reduce (0.57 MiB in all)``, or ``none``."""
    counts = {}
    for call in log.calls:
        count, size = counts.get(call.name, (0, 0))
        counts[call.name] = (count + 1, size + call.bytes)
    return " + ".join(f"{n} x {name} ({size / 2**20:.3f} MiB in all)" for name, (n, size) in counts.items()) or "none"


@torch.no_grad()
def evaluate(net, val_iter, args, env) -> float:
    """The mean next-byte loss over ``val_iter``'s windows, the same on every rank (all take part: the attention
    passes keys and values)."""
    net.eval()
    total, count = 0.0, 0
    for tokens, targets in val_iter:
        tokens, targets = tokens.to(env.device), targets.to(env.device)
        if args.method == "torch":
            loss = torch_context_parallel_loss(net, tokens, targets, env)
        else:
            loss = net.loss(tokens, targets)  # this rank's share of the mean
        dist.all_reduce(loss)
        total, count = total + loss.item() * len(tokens), count + len(tokens)
    return total / count


if __name__ == "__main__":
    main(parse_args())
