"""What notebook 14 and the tests measure with ``common.context_parallel``: the ring and the all-gather against
``F.scaled_dot_product_attention`` on every rank, the messages against the formula, the GPT trained both ways, the
work and time per rank in each layout, and the ring against the all-gather (``common.launch.run_on_ranks`` runs the
functions that take ``env``: they need a module). The notebook's plots are here too."""

import copy
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common.activations import HeldMemory
from common.collectives import count_collectives, count_messages
from common.context_parallel import (
    LAYOUTS,
    METHODS,
    ContextParallelGPT,
    all_gather_attention,
    attend_pieces,
    merge,
    ring_attention,
    ring_messages,
    shard_pieces,
    shard_sequence,
    ulysses_attention,
    visible,
)
from common.experiments.activations import build_gpt, token_batch
from common.gpt import next_token_loss

ATTENTION = {"ring": ring_attention, "all-gather": all_gather_attention}


def random_qkv(batch: int, heads: int, seq: int, head_dim: int, dtype=torch.float64, seed: int = 0):
    """Queries, keys, values and an output gradient ``(batch, heads, seq, head_dim)``, the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, seq, head_dim, generator=generator, dtype=dtype) for _ in range(4)]


def sdpa_reference(q, k, v, grad, causal: bool) -> list:
    """SDPA on the whole sequence: its output and the gradients of q, k and v for the output gradient ``grad``."""
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = F.scaled_dot_product_attention(*whole, is_causal=causal)
    return [reference.detach(), *torch.autograd.grad(reference, whole, grad)]


def attention_checks(env, batch: int = 2, heads: int = 2, seq: int = 16, head_dim: int = 8) -> dict:
    """On every rank, for each method, layout and mask: the largest difference of this rank's output and of its
    slices of the gradients of q, k and v from ``F.scaled_dot_product_attention`` on the whole sequence (float64),
    and for the ring, the messages this rank posted in forward and in backward (``count_messages``)."""
    q, k, v, grad = random_qkv(batch, heads, seq, head_dim)
    results = {}
    for causal in (False, True):
        expected = sdpa_reference(q, k, v, grad, causal)
        for layout in LAYOUTS:

            def mine(t):  # this rank's slice along the sequence
                return shard_sequence(t, env.rank, env.world_size, layout, dim=2)

            for method in METHODS:
                local = [mine(t).requires_grad_() for t in (q, k, v)]
                with count_messages() as forward:
                    out = ATTENTION[method](*local, layout, causal)
                with count_messages() as backward:
                    gradients = torch.autograd.grad(out, local, mine(grad))
                got = [out.detach(), *gradients]
                results[(method, layout, causal)] = {
                    "difference": max((a - mine(b)).abs().max().item() for a, b in zip(got, expected)),
                    "forward": (forward.sends, forward.receives, forward.bytes_sent),
                    "backward": (backward.sends, backward.receives, backward.bytes_sent),
                    "grouped": forward.grouped + backward.grouped,  # posted in batch_isend_irecv groups
                }
    results["formula"] = ring_messages(batch, heads, seq, head_dim, env.world_size, 8)
    odd = q[..., : 2 * env.world_size - 1, :]  # 2N - 1 tokens per rank: N (2N - 1) does not divide into 2N chunks
    with count_messages() as posted:
        try:
            ring_attention(odd, odd, odd, "zigzag", True)
            results["bad length"] = "accepted"
        except ValueError as error:
            results["bad length"] = f"{error}; {'no message' if posted.sends == 0 else 'messages'} posted"
    return {f"{key[0]}, {key[1]}, {'causal' if key[2] else 'full'}" if isinstance(key, tuple) else key: value
            for key, value in results.items()}  # fmt: skip


def ulysses_checks(env, batch: int = 2, heads: int = 4, seq: int = 16, head_dim: int = 8) -> dict:
    """On every rank: ``ulysses_attention`` against SDPA on the whole sequence (output and this rank's slices of
    the three gradients, float64), both layouts, causal and not; and the error that heads not divisible by the ranks
    raise before any collective."""
    q, k, v, grad = random_qkv(batch, heads, seq, head_dim)
    results = {}
    for causal in (False, True):
        expected = sdpa_reference(q, k, v, grad, causal)
        for layout in LAYOUTS:
            local = [shard_sequence(t, env.rank, env.world_size, layout, dim=2).requires_grad_() for t in (q, k, v)]
            out = ulysses_attention(*local, layout, causal)
            got = [out.detach(), *torch.autograd.grad(out, local, shard_sequence(grad, env.rank, env.world_size,
                                                                                 layout, dim=2))]  # fmt: skip
            mine = [shard_sequence(t, env.rank, env.world_size, layout, dim=2) for t in expected]
            results[f"{layout}, {'causal' if causal else 'full'}"] = max(
                (a - b).abs().max().item() for a, b in zip(got, mine)
            )
    odd = q[:, : env.world_size - 1 or 1]  # fewer heads than ranks
    try:
        ulysses_attention(shard_sequence(odd, env.rank, env.world_size, dim=2), odd[:, :, :1], odd[:, :, :1])
        results["heads that do not divide"] = "accepted"
    except ValueError as error:
        results["heads that do not divide"] = str(error)
    return results


def training_losses(env, config: dict, batch: int, steps: int, layout: str, method: str, lr: float = 3e-3):
    """The losses of ``steps`` AdamW steps of the whole GPT (every rank computes it alone) and of the same GPT
    with context parallelism (``ContextParallelGPT``), on the same batches, in float64 without dropout."""
    config = config | {"dropout": 0.0}
    whole = build_gpt(config).double()
    split = ContextParallelGPT(copy.deepcopy(whole), env.rank, env.world_size, layout, method)
    optimizers = [torch.optim.AdamW(net.parameters(), lr=lr, foreach=False) for net in (whole, split)]
    losses = {"one process": [], "context parallel": []}
    for step in range(steps):
        tokens, targets = token_batch(config, batch, step)
        for name, net, optimizer in zip(losses, (whole, split), optimizers):
            optimizer.zero_grad(set_to_none=True)
            if name == "one process":
                loss = next_token_loss(net(tokens), targets)
                loss.backward()
            else:
                loss = net.loss(tokens, targets)
                loss.backward()
                net.finish_gradients()
                loss = loss.detach().clone()
                dist.all_reduce(loss)  # the ranks' shares, added up: the mean over every token
            optimizer.step()
            losses[name].append(loss.item())
    return losses


def work_per_rank(seq: int, world_size: int, layout: str, causal: bool = True) -> list[int]:
    """The query-key scores each rank computes in one ring forward (``attend_pieces`` skips hidden pairs)."""
    pieces = [shard_pieces(seq, rank, world_size, layout) for rank in range(world_size)]
    return [
        sum(
            len(query) * len(key)
            for source in range(world_size)
            for query in pieces[rank]
            for key in pieces[source]
            if visible(query, key, causal) != "none"
        )
        for rank in range(world_size)
    ]


def compute_seconds_per_rank(
    seq: int, world_size: int, layout: str, batch: int = 1, heads: int = 4, head_dim: int = 16, repeats: int = 5
) -> list[float]:
    """Each rank's attention computation in one causal ring forward, timed in this one process: the blocks it would
    receive, merged, without the messages (float32). The ranks take turns within each repeat, after one round to
    warm up, so that a load that comes and goes hits them alike; the median of ``repeats`` per rank."""
    q, k, v, _ = random_qkv(batch, heads, seq, head_dim, dtype=torch.float32)
    pieces = [shard_pieces(seq, rank, world_size, layout) for rank in range(world_size)]
    local = [[shard_sequence(t, r, world_size, layout, 2) for t in (q, k, v)] for r in range(world_size)]
    times, threads = [[] for _ in range(world_size)], torch.get_num_threads()
    torch.set_num_threads(1)  # one core, as one rank of a ring on this machine would have
    for _ in range(repeats + 1):
        for rank in range(world_size):
            local_q = local[rank][0]
            out, lse = torch.zeros_like(local_q), local_q.new_full(local_q.shape[:-1], float("-inf"))
            started = time.perf_counter()
            for source in range(world_size):
                blocks = attend_pieces(local_q, *local[source][1:], pieces[rank], pieces[source], True)
                for rows, block_out, block_lse in blocks:
                    out[..., rows, :], lse[..., rows] = merge(out[..., rows, :], lse[..., rows], block_out, block_lse)
            times[rank].append(time.perf_counter() - started)
    torch.set_num_threads(threads)
    return [statistics.median(rank_times[1:]) for rank_times in times]  # the first round warms up


def ring_step_seconds(env, seq: int, layout: str, batch: int = 1, heads: int = 4, head_dim: int = 16, repeats=5):
    """The median wall time of one causal ring attention forward and backward on this rank (float32)."""
    q, k, v, grad = random_qkv(batch, heads, seq, head_dim, dtype=torch.float32)
    local = [shard_sequence(t, env.rank, env.world_size, layout, dim=2).requires_grad_() for t in (q, k, v)]
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        started = time.perf_counter()
        out = ring_attention(*local, layout, True)
        torch.autograd.grad(out, local, shard_sequence(grad, env.rank, env.world_size, layout, dim=2))
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])  # the first run warms up


def ring_against_all_gather(env, seq: int, batch: int = 1, heads: int = 4, head_dim: int = 16, repeats: int = 5):
    """For each method, on this rank, causal and zig-zag, float32: the bytes it sent (ring: its ``isend``\\ s;
    all-gather: (N - 1) / N of the gathered keys and values and of their reduce-scattered gradients, what a ring
    algorithm sends for those collectives), the most memory
    forward and backward held at once (``HeldMemory.peak``) and the median time of forward and backward."""
    q, k, v, grad = random_qkv(batch, heads, seq, head_dim, dtype=torch.float32)
    results, share = {}, (env.world_size - 1) / env.world_size
    for method in METHODS:
        local = [shard_sequence(t, env.rank, env.world_size, "zigzag", dim=2).requires_grad_() for t in (q, k, v)]
        local_grad = shard_sequence(grad, env.rank, env.world_size, "zigzag", dim=2)
        with count_messages() as messages, count_collectives() as collectives, HeldMemory() as memory:
            out = ATTENTION[method](*local, "zigzag", True)
            torch.autograd.grad(out, local, local_grad)
            del out
        times = []
        for _ in range(repeats):
            dist.barrier()
            started = time.perf_counter()
            torch.autograd.grad(ATTENTION[method](*local, "zigzag", True), local, local_grad)
            times.append(time.perf_counter() - started)
        results[method] = {
            # a ring all-gather or reduce-scatter sends (N - 1) / N of the whole tensor from each rank
            "bytes sent": messages.bytes_sent if method == "ring" else collectives.bytes() * share,
            "peak MiB": memory.peak / 2**20,
            "seconds": statistics.median(times),
        }
    return results


def plot_balance(balance: dict, ax) -> None:
    """Bars: each rank's share of the causal work (scores computed) and of the measured compute time, per layout."""
    width = 0.2
    for index, (layout, row) in enumerate(balance.items()):
        ranks = range(len(row["work"]))
        total_work, total_time = sum(row["work"]), sum(row["seconds"])
        ax.bar([r + (2 * index - 1.5) * width for r in ranks], [w / total_work for w in row["work"]], width,
               label=f"{layout}: work", color=f"C{index}", alpha=0.5)  # fmt: skip
        ax.bar([r + (2 * index - 0.5) * width for r in ranks], [s / total_time for s in row["seconds"]], width,
               label=f"{layout}: time", color=f"C{index}")  # fmt: skip
        ax.set_xticks(list(ranks))
    ax.axhline(1 / len(row["work"]), color="grey", linestyle=":", label="an equal share")
    ax.set_xlabel("rank")
    ax.set_ylabel("share of the causal attention")
    ax.legend(fontsize="small")
