"""What lesson 15's tests and notebook run around common.moe: the expert-parallel layer against the one-process
layer on every rank, the all-to-all's round trip and torch's version of it, expert parallelism on a 2-D mesh with
data parallelism, routing over training with and without the balancing loss, tokens dropped against the capacity
factor, and the step time against a dense MLP (``common.launch.run_on_ranks`` runs the distributed ones: they need
a module). The plots of the notebook are here too."""

import statistics
import time
import warnings

import torch
import torch.distributed as dist

from common.collectives import count_collectives
from common.gpt import GPT, next_token_loss
from common.moe import (
    ExpertParallelMoE,
    MoE,
    all_to_all,
    all_to_all_bytes,
    average_gradients,
    balance_loss,
    expert_parallel_gpt,
    moe_gpt,
    moe_layers,
    route,
)


def tokens_of_rank(rank: int, d_model: int, seed: int = 0) -> torch.Tensor:
    """Rank ``rank``'s tokens: ``3 + 4 rank`` rows of ``d_model``, fp64, all shifted along the first axis (so that
    the layer of ``empty_expert_moe`` never picks its last expert). Uneven on purpose: all-to-all splits differ."""
    generator = torch.Generator().manual_seed(seed + rank)
    X = torch.randn(3 + 4 * rank, d_model, generator=generator, dtype=torch.float64)
    X[:, 0] += 5.0
    return X


def empty_expert_moe(d_model: int, num_experts: int, top_k: int, seed: int = 0) -> MoE:
    """An fp64 ``MoE`` without capacity whose last expert no token of ``tokens_of_rank`` chooses: its router row is
    -10 along the first axis, where every token sits near +5."""
    torch.manual_seed(seed)
    moe = MoE(d_model, num_experts, top_k, hidden=2 * d_model, renormalize=top_k > 1).double()
    with torch.no_grad():
        moe.router.weight[-1] = 0.0
        moe.router.weight[-1, 0] = -10.0
    return moe


def expert_parallel_checks(
    env, num_experts: int = 4, top_k: int = 2, d_model: int = 8, layer=ExpertParallelMoE, move=all_to_all
) -> dict:
    """On every rank: the expert-parallel layer against the whole one on all the ranks' tokens (outputs, input
    gradients, every expert's gradient, the router's once summed), the all-to-alls' bytes against
    ``all_to_all_bytes``, the all-to-all's round trip, and ``AllToAll`` against torch's version, gradient included.
    ``layer`` and ``move``: the layer class and the all-to-all function to check (a lab's)."""
    world, rank = env.world_size, env.rank
    all_tokens = [tokens_of_rank(r, d_model) for r in range(world)]
    weights = [torch.linspace(-1, 1, X.numel(), dtype=torch.float64).view(X.shape) * (r + 1) for r, X in
               enumerate(all_tokens)]  # fmt: skip
    whole = empty_expert_moe(d_model, num_experts, top_k)
    X_whole = torch.cat(all_tokens).requires_grad_()
    out_whole = whole(X_whole)
    (out_whole * torch.cat(weights)).sum().backward()
    counts_whole = whole.routing.counts(num_experts)

    split = layer(empty_expert_moe(d_model, num_experts, top_k), rank, world)
    X = all_tokens[rank].clone().requires_grad_()
    with count_collectives() as log:
        out = split(X)
        (out * weights[rank]).sum().backward()
    first = sum(len(t) for t in all_tokens[:rank])
    local = num_experts // world
    experts = {
        name: (p.grad - dict(whole.experts[rank * local : (rank + 1) * local].named_parameters())[name].grad)
        .abs()
        .max()
        .item()
        for name, p in split.experts.named_parameters()
    }
    router_grad = split.router.weight.grad.clone()
    dist.all_reduce(router_grad)
    sent, received = int(split.routing.kept.sum()), int(split.received.sum())
    result = {
        "output": (out - out_whole[first : first + len(X)]).abs().max().item(),
        "input gradient": (X.grad - X_whole.grad[first : first + len(X)]).abs().max().item(),
        "experts": experts,
        "router": (router_grad - whole.router.weight.grad).abs().max().item(),
        "tokens per expert": counts_whole.tolist(),
        "calls": [call.name for call in log.calls],
        "bytes": log.bytes("all_to_all_single"),
        "formula": all_to_all_bytes(sent, received, d_model, 8, num_experts),
        "sent": sent,
        "received": received,
    }
    return result | round_trip(env, move)


def round_trip(env, move=all_to_all) -> dict:
    """Uneven rows out and back (rank r sends ``r + j + 1`` rows to rank j, none to itself on rank 0): the second
    all-to-all, splits swapped, gives back what the first took. ``AllToAll`` against
    ``torch.distributed.nn.functional.all_to_all_single``: the same rows and the same gradient."""
    from torch.distributed.nn.functional import all_to_all_single as torch_all_to_all

    world, rank = env.world_size, env.rank
    send = [0 if rank == j == 0 else rank + j + 1 for j in range(world)]
    receive = [0 if rank == j == 0 else j + rank + 1 for j in range(world)]  # what rank j sends to this one
    rows = torch.randn(sum(send), 3, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    mine = rows.clone().requires_grad_()
    arrived = move(mine, receive, send)
    back = move(arrived, send, receive)
    theirs = rows.clone().requires_grad_()
    out = torch.empty(sum(receive), 3, dtype=torch.float64)
    with warnings.catch_warnings():  # 2.14 points to torch.distributed._functional_collectives instead
        warnings.simplefilter("ignore", FutureWarning)
        torch_arrived = torch_all_to_all(out, theirs, receive, send)
    weight = torch.arange(arrived.numel(), dtype=torch.float64).view(arrived.shape)
    (arrived * weight).sum().backward()
    (torch_arrived * weight).sum().backward()
    return {
        "round trip": torch.equal(back, rows),
        "torch's rows": torch.equal(arrived, torch_arrived),
        "torch's gradient": torch.equal(mine.grad, theirs.grad),
    }


def mesh_checks(env, config: dict, num_experts: int = 4, batch: int = 2) -> dict:
    """Expert parallelism with data parallelism on a 2-D mesh (``dp`` x ``ep``, 2 x 2 on 4 ranks): the experts split
    over ``ep``, copied over ``dp``, every rank on its own batch. After one backward and ``average_gradients``,
    every gradient equals the whole MoE GPT's on all the batches, mean loss."""
    from torch.distributed.device_mesh import init_device_mesh

    ep = 2
    dp = env.world_size // ep
    mesh = init_device_mesh("cpu", (dp, ep), mesh_dim_names=("dp", "ep"))
    ep_rank = mesh.get_local_rank("ep")
    batches = [token_batch(config, batch, seed=r) for r in range(env.world_size)]
    whole = moe_reference(config, num_experts)
    losses = [next_token_loss(whole(tokens), targets) for tokens, targets in batches]
    torch.stack(losses).mean().backward()

    model = expert_parallel_gpt(moe_reference(config, num_experts), ep_rank, ep, mesh.get_group("ep"))
    tokens, targets = batches[env.rank]
    next_token_loss(model(tokens), targets).backward()
    average_gradients(model, env.world_size, mesh.get_group("dp"))
    local = num_experts // ep
    wholes = dict(whole.named_parameters())
    differences = {}
    for name, parameter in model.named_parameters():
        if ".experts." in name:  # experts.i here is expert ep_rank * local + i of the whole layer
            prefix, index, rest = name.partition(".experts.")[0], *name.partition(".experts.")[2].split(".", 1)
            name = f"{prefix}.experts.{ep_rank * local + int(index)}.{rest}"
        differences[name] = (parameter.grad - wholes[name].grad).abs().max().item()
    return {"coordinate": mesh.get_coordinate(), "gradients": differences}


def moe_reference(config: dict, num_experts: int, top_k: int = 2, seed: int = 0) -> GPT:
    """A fp64 ``GPT(**config)`` with MoE MLPs (no capacity, no dropout), the same on every rank."""
    torch.manual_seed(seed)
    return moe_gpt(GPT(**config), num_experts, top_k).double()


def token_batch(config: dict, batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens ``(batch, context)`` and their next tokens for ``seed``."""
    generator = torch.Generator().manual_seed(100 + seed)
    tokens = torch.randint(0, 256, (batch, config["context"] + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


# Measured in one process: routing over training, dropping, step time


def text_batches(text, batch: int, steps: int, seed: int = 0):
    """``steps`` random batches of ``text``'s training windows (a ``common.text.TextSplits``)."""
    generator = torch.Generator().manual_seed(seed)
    tokens, targets = text.train.tensors
    for _ in range(steps):
        pick = torch.randint(0, len(tokens), (batch,), generator=generator)
        yield tokens[pick], targets[pick]


def train_routing(text, config: dict, num_experts: int, top_k: int, alpha: float, steps: int, batch: int) -> dict:
    """Train a MoE GPT for ``steps`` steps with loss ``next_token_loss + alpha * balance_loss``: each step's tokens
    per expert (first layer, before the step), the balancing loss and the language-model loss."""
    torch.manual_seed(0)
    model = moe_gpt(GPT(**config), num_experts, top_k)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rows = []
    for tokens, targets in text_batches(text, batch, steps):
        loss = next_token_loss(model(tokens), targets)
        aux = balance_loss(model)
        optimizer.zero_grad()
        (loss + alpha * aux).backward()
        optimizer.step()
        first = moe_layers(model)[0]
        rows.append({"counts": first.routing.counts(num_experts).tolist(), "balance": aux.item(), "loss": loss.item()})
    return {"alpha": alpha, "steps": rows, "model": model}


def dropped_by_capacity(model, text, factors: list[float], batch: int) -> list[dict]:
    """For each capacity factor: the fraction of the first MoE layer's assignments dropped on one batch of
    ``text``, with ``model``'s router as it is (the routing of a trained model)."""
    tokens, _ = next(text_batches(text, batch, 1, seed=1))
    layer = moe_layers(model)[0]
    captured = []
    handle = layer.register_forward_pre_hook(lambda module, inputs: captured.append(inputs[0].detach()))
    with torch.no_grad():
        model.eval()
        model(tokens)
    handle.remove()
    X = captured[0].reshape(-1, captured[0].shape[-1])
    rows = []
    with torch.no_grad():
        for factor in factors:
            routing = route(layer.router(X), layer.top_k, factor, layer.renormalize)
            rows.append({"capacity factor": factor, "dropped": routing.dropped / routing.kept.numel()})
    return rows


def step_times(config: dict, variants: list[tuple[int, int]], batch: int, repeats: int) -> dict:
    """The median time of one forward and backward, ms, of the dense GPT and of MoE GPTs with ``(E, k)`` of
    ``variants`` (each expert as wide as the dense MLP: at k = 1 the same work per token), on random tokens; their
    parameters, and the parameters one token passes through (active)."""
    tokens, targets = token_batch(config, batch)
    out = {}
    for num_experts, top_k in [(0, 0), *variants]:
        torch.manual_seed(0)
        model = GPT(**config)
        mlp = sum(p.numel() for p in model.blocks[0].mlp.parameters()) * len(model.blocks)
        if num_experts:
            moe_gpt(model, num_experts, top_k)
        times = []
        for _ in range(repeats + 2):
            started = time.perf_counter()
            next_token_loss(model(tokens), targets).backward()
            times.append(time.perf_counter() - started)
        parameters = sum(p.numel() for p in model.parameters())
        active = parameters - (num_experts - top_k) * mlp if num_experts else parameters
        name = f"MoE, E={num_experts}, top-{top_k}" if num_experts else "dense"
        out[name] = {"ms": 1000 * statistics.median(times[2:]), "parameters": parameters, "active": active}
    return out


def plot_dropped(rows_by_run: dict, ax) -> None:
    """``dropped_by_capacity``'s rows for each run: the share dropped against the capacity factor."""
    for name, rows in rows_by_run.items():
        ax.plot([row["capacity factor"] for row in rows], [row["dropped"] for row in rows], "o-", label=name)
    ax.set_xlabel("capacity factor")
    ax.set_ylabel("assignments dropped")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)


def plot_tokens_per_expert(runs: list[dict], axes) -> None:
    """Each run's tokens per expert over training (``train_routing``), one panel per run."""
    for run, ax in zip(runs, axes):
        counts = torch.tensor([row["counts"] for row in run["steps"]], dtype=torch.float64)
        share = counts / counts.sum(1, keepdim=True)
        for expert in range(share.shape[1]):
            ax.plot(share[:, expert], label=f"expert {expert}")
        ax.set_title(f"balancing loss weight {run['alpha']}")
        ax.set_xlabel("training step")
        ax.set_ylim(0, 1)
    axes[0].set_ylabel("share of the tokens (layer 1)")
    axes[-1].legend(fontsize=8)
