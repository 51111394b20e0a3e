"""What notebook 13 measures with common.activations, common.recompute and common.sequence_parallel: one layer's
saved bytes against the formula, a training step's memory part by part, the recomputation table, and sequence
parallelism against tensor parallelism on every rank (``common.launch.run_on_ranks`` runs those: they need a
module). The plots of the notebook are here too."""

import copy
import statistics
import time

import torch
import torch.distributed as dist

from common.activations import HeldMemory, activation_bytes_per_layer, layer_total, saved_tensors
from common.collectives import count_collectives
from common.gpt import GPT, next_token_loss
from common.memory import local_bytes, optimizer_state_tensors
from common.recompute import RECOMPUTE_MODES, apply_recomputation
from common.sequence_parallel import SequenceParallelGPT, parallelize_gpt, shard_gpt
from common.tensor_parallel import TransformerBlock


def build_gpt(config: dict, seed: int = 0) -> GPT:
    """``GPT(**config)`` with the weights that ``seed`` gives: the same model on every rank."""
    torch.manual_seed(seed)
    return GPT(**config)


def token_batch(config: dict, batch: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s random tokens ``(batch, context)`` and their next tokens, the same on every rank."""
    generator = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 256, (batch, config["context"] + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def layer_saved_bytes(seq: int, batch: int, d_model: int, heads: int, dropout: float = 0.1) -> dict:
    """One forward of a ``TransformerBlock(causal=True, dropout)`` on random ``(batch, seq, d_model)`` activations:
    the bytes autograd saved, in all and by module (each module run on its own input), against
    ``activation_bytes_per_layer`` (fp32, masks as fp32: a CPU's ``F.dropout``)."""
    torch.manual_seed(0)
    block = TransformerBlock(d_model, heads, causal=True, dropout=dropout)
    X = torch.randn(batch, seq, d_model, requires_grad=True)
    terms = activation_bytes_per_layer(seq, batch, d_model, heads, dropout=dropout > 0)
    with saved_tensors(block.parameters()) as log:
        block(X)
    by_module = {}
    for name in terms:
        module = getattr(block, name)
        with saved_tensors(module.parameters()) as module_log:
            module(X.detach().requires_grad_())
        by_module[name] = {"measured": [nbytes for *_, nbytes in module_log.tensors], "formula": terms[name]}
    return {"measured": log.bytes, "formula": layer_total(terms), "by module": by_module}


def saved_bytes_sweep(d_model: int, heads: int, shapes: list[tuple[int, int]]) -> list[dict]:
    """``layer_saved_bytes`` for each ``(seq, batch)`` of ``shapes``, with the formula's part that grows with the
    square of the sequence (the attention's scores: softmax output, dropout mask, dropped probabilities)."""
    rows = []
    for seq, batch in shapes:
        measured = layer_saved_bytes(seq, batch, d_model, heads)
        quadratic = 12 * heads * seq * seq * batch  # (4 + 4 + 4) bytes per score, fp32 with fp32 masks
        rows.append({"seq": seq, "batch": batch, **measured, "quadratic": quadratic})
    return rows


def step_memory(config: dict, batch: int, recompute: str = "none") -> dict:
    """One AdamW training step of the GPT on one process: the bytes of parameters, gradients and AdamW's two
    states, and of the activations that forward leaves alive (``HeldMemory``: the kept tensors of every layer, the
    logits' softmax for the loss...), with ``recompute`` applied to every block."""
    model = apply_recomputation(build_gpt(config), recompute)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens, targets = token_batch(config, batch)
    with HeldMemory() as memory:
        loss = next_token_loss(model(tokens), targets)
    activations = memory.bytes
    loss.backward()
    optimizer.step()
    adam = [t for t in optimizer_state_tensors(optimizer) if t.dim()]  # exp_avg and exp_avg_sq; not the step count
    parameters = list(model.parameters())
    return {
        "parameters": local_bytes(parameters),
        "gradients": local_bytes(p.grad for p in parameters),
        "optimizer": local_bytes(adam),
        "activations": activations,
    }


def recomputation_table(config: dict, batch: int, steps: int) -> dict:
    """Each of ``RECOMPUTE_MODES`` on the same GPT and batches, a step of each in turn (so that a background load
    hits them alike), ``steps`` times: the activations kept after forward and the peak during the whole step
    (``HeldMemory``), the median step time of all steps but the first, and whether the loss and every gradient
    equal those without recomputation bit for bit (the same dropout masks included)."""
    models = {mode: apply_recomputation(build_gpt(config), mode) for mode in RECOMPUTE_MODES}
    optimizers = {mode: torch.optim.SGD(model.parameters(), lr=0.01) for mode, model in models.items()}
    results = {mode: {"seconds": [], "identical": True} for mode in RECOMPUTE_MODES}
    for step in range(steps):
        tokens, targets = token_batch(config, batch, step)
        reference = None
        for mode, model in models.items():
            optimizers[mode].zero_grad(set_to_none=True)
            torch.manual_seed(1000 + step)  # the same dropout masks for every mode
            start = time.perf_counter()
            with HeldMemory() as memory:
                loss = next_token_loss(model(tokens), targets)
                kept = memory.bytes
                loss.backward()
            results[mode]["seconds"].append(time.perf_counter() - start)
            result = [loss.detach(), *(p.grad for p in model.parameters())]
            reference = reference or result
            results[mode]["identical"] &= all(torch.equal(a, b) for a, b in zip(result, reference))
            results[mode] |= {"kept": kept, "peak": memory.peak}
            optimizers[mode].step()
    for result in results.values():
        result["median seconds"] = statistics.median(result["seconds"][1:] or result["seconds"])
    return results


def sequence_parallel_checks(env, config: dict, batch: int, recompute: str = "none") -> dict:
    """On every rank: one training step of the whole GPT (computed by every rank alone), of tensor parallelism
    by hand (``shard_gpt``), and of tensor and sequence parallelism by hand (``SequenceParallelGPT``, plain and with
    ``regather``), on the same batch, in float64 without dropout (so that the versions compute the same numbers).

    For each: the largest difference of the loss and of every gradient from the whole GPT's (this rank's slice of
    a split parameter's gradient), the collectives of forward and of backward (``count_collectives``: name and
    bytes), the bytes autograd saved (``saved_tensors``) and what forward left alive (``HeldMemory``)."""
    config = config | {"dropout": 0.0}
    tokens, targets = token_batch(config, batch)
    whole = build_gpt(config).double()
    builders = {
        "one process": lambda model: model,
        "tensor parallel": lambda model: shard_gpt(model, env.rank, env.world_size),
        "sequence parallel": lambda model: SequenceParallelGPT(model, env.rank, env.world_size),
        "sequence parallel, regather": lambda model: SequenceParallelGPT(
            model, env.rank, env.world_size, regather=True
        ),
    }
    whole_gradients = None
    results = {}
    for name, build in builders.items():
        net = apply_recomputation(build(copy.deepcopy(whole)), recompute)
        sequence = isinstance(net, SequenceParallelGPT)
        with saved_tensors(net.parameters()) as saved, HeldMemory() as held, count_collectives() as forward:
            loss = net.loss(tokens, targets) if sequence else next_token_loss(net(tokens), targets)
            kept = held.bytes
        with count_collectives() as backward:
            loss.backward()
            if sequence:
                net.finish_gradients()  # counted: the replicated parameters' gradients summed over the ranks
        if sequence:
            loss = loss.detach().clone()
            dist.all_reduce(loss)  # the ranks' shares of the mean, added up: for the comparison only
        got = {unwrapped(name): parameter.grad for name, parameter in net.named_parameters()}
        if whole_gradients is None:  # the first version is the whole GPT: its loss and gradients are the reference
            whole_loss, whole_gradients = loss.detach(), copy.deepcopy(whole)
            for holder_name, holder in whole_gradients.named_parameters():
                holder.data = got[holder_name]
        # This rank's slices of the whole gradients: cut by the same code that cut the weights.
        expected = dict(build(copy.deepcopy(whole_gradients)).named_parameters())
        results[name] = {
            "loss difference": (loss.detach() - whole_loss).abs().item(),
            "gradient difference": max((grad - expected[name]).abs().max().item() for name, grad in got.items()),
            "forward": [(call.name, call.bytes) for call in forward.calls],
            "backward": [(call.name, call.bytes) for call in backward.calls],
            "saved": saved.bytes,
            "kept": kept,
        }
    return results


def unwrapped(name: str) -> str:
    """A parameter's name without ``RecomputedBlock``'s ``.block`` (the gradients' copy is not wrapped)."""
    return name.replace(".block.", ".")


def torch_sequence_parallel(env, config: dict, batch: int, steps: int = 2) -> dict:
    """torch's tensor and sequence parallelism of the GPT (``parallelize_gpt``), ``steps`` AdamW steps under
    ``loss_parallel``, in float64 without dropout: the largest difference of the parameters from the whole GPT's
    after the same steps; what ``CommDebugMode`` counted in the first forward and backward, and in the first
    optimizer step; and the placements of the norms' gradients after backward (``Partial``: not yet summed)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import loss_parallel

    config = config | {"dropout": 0.0}
    tokens, targets = token_batch(config, batch)
    whole = build_gpt(config).double()
    optimizer = torch.optim.AdamW(whole.parameters(), lr=0.01)
    for _ in range(steps):
        optimizer.zero_grad()
        next_token_loss(whole(tokens), targets).backward()
        optimizer.step()
    split = parallelize_gpt(build_gpt(config).double(), init_device_mesh("cpu", (env.world_size,)))
    optimizer = torch.optim.AdamW(split.parameters(), lr=0.01, foreach=False)
    result = {}
    for step in range(steps):
        optimizer.zero_grad()
        with CommDebugMode() as passes, loss_parallel():
            next_token_loss(split(tokens), targets).backward()
        norm_gradients = {str(p.grad.placements) for name, p in split.named_parameters() if "norm" in name}
        with CommDebugMode() as optimizer_step:
            optimizer.step()
        if step == 0:
            result["passes"] = {str(op).split(".")[-1]: count for op, count in passes.get_comm_counts().items()}
            result["optimizer step"] = {
                str(op).split(".")[-1]: count for op, count in optimizer_step.get_comm_counts().items()
            }
            result["norm gradients"] = sorted(norm_gradients)
    wholes = dict(whole.named_parameters())
    result["parameter difference"] = max(
        (parameter.full_tensor() - wholes[name]).abs().max().item() for name, parameter in split.named_parameters()
    )
    return result


def memory_per_rank(env, config: dict, batch: int) -> dict:
    """What each rank holds for one AdamW step of the same GPT, five ways: one process without and with full
    recomputation, tensor parallelism (by hand), tensor and sequence parallelism (regather), and that with full
    recomputation. Model state (parameters, gradients, AdamW's two states: this rank's pieces) and activations
    (what forward leaves alive, ``HeldMemory``), in bytes."""
    ways = {
        "one process": (lambda model: model, "none"),
        "one process, recompute": (lambda model: model, "full"),
        "tensor parallel": (lambda model: shard_gpt(model, env.rank, env.world_size), "none"),
        "tensor + sequence parallel": (
            lambda model: SequenceParallelGPT(model, env.rank, env.world_size, regather=True),
            "none",
        ),
        "tensor + sequence parallel, recompute": (
            lambda model: SequenceParallelGPT(model, env.rank, env.world_size, regather=True),
            "full",
        ),
    }
    tokens, targets = token_batch(config, batch)
    results = {}
    for name, (build, recompute) in ways.items():
        net = apply_recomputation(build(build_gpt(config)), recompute)
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
        sequence = isinstance(net, SequenceParallelGPT)
        torch.manual_seed(env.rank if sequence else 0)
        with HeldMemory() as memory:
            loss = net.loss(tokens, targets) if sequence else next_token_loss(net(tokens), targets)
        activations = memory.bytes
        loss.backward()
        if sequence:
            net.finish_gradients()
        optimizer.step()
        parameters = list(net.parameters())
        adam = [t for t in optimizer_state_tensors(optimizer) if t.dim()]
        results[name] = {
            "model state": local_bytes(parameters) + local_bytes(p.grad for p in parameters) + local_bytes(adam),
            "activations": activations,
        }
    return results


def plot_layer_bytes(rows: list[dict], ax) -> None:
    """Measured bytes per layer against the sequence length, one line per batch size, with the formula's linear
    and quadratic parts for the largest batch."""
    for batch in sorted({row["batch"] for row in rows}):
        mine = [row for row in rows if row["batch"] == batch]
        ax.plot([r["seq"] for r in mine], [r["measured"] / 2**20 for r in mine], "o", label=f"measured, batch {batch}")
        ax.plot([r["seq"] for r in mine], [r["formula"] / 2**20 for r in mine], "k-", linewidth=0.8)
    largest = [row for row in rows if row["batch"] == max(r["batch"] for r in rows)]
    ax.plot(
        [r["seq"] for r in largest],
        [(r["formula"] - r["quadratic"]) / 2**20 for r in largest],
        "k--",
        linewidth=0.8,
        label="the formula without the attention's s^2 term",
    )
    ax.set(xlabel="sequence length s (tokens)", ylabel="MiB saved by one layer", xscale="log", yscale="log")
    ax.legend(fontsize=8)


def plot_memory_per_rank(results: dict, ax) -> None:
    """Stacked bars: model state and activations per rank, in MiB, for each way of ``memory_per_rank``."""
    names = list(results)
    state = [results[name]["model state"] / 2**20 for name in names]
    activations = [results[name]["activations"] / 2**20 for name in names]
    ax.barh(names, state, label="model state (parameters, gradients, AdamW)", color="#a1d99b")
    ax.barh(names, activations, left=state, label="activations kept for backward", color="#9ecae1")
    ax.invert_yaxis()
    ax.set_xlabel("MiB on one rank")
    ax.legend(fontsize=8)
