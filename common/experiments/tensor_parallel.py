"""What notebook 12 measures with common.tensor_parallel, run on every rank by common.launch.run_on_ranks (which
needs the functions in a module): a sharded block against the whole one, the all-reduces per step, timed steps of
tensor against data parallelism, DDP's bucket starts, and a plot of one step's timeline."""

import copy
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from common.tensor_parallel import TransformerBlock, mlp_all_reduce_bytes, parallelize_block, shard_block


def block_stack(d_model: int, num_heads: int, depth: int) -> nn.Sequential:
    """``depth`` whole ``TransformerBlock``\\ s, the same weights on every rank (seeded)."""
    torch.manual_seed(0)
    return nn.Sequential(*[TransformerBlock(d_model, num_heads) for _ in range(depth)])


def token_batch(batch: int, seq: int, d_model: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s activations ``(batch, seq, d_model)`` and regression targets, the same on every rank."""
    generator = torch.Generator().manual_seed(1000 + step)
    X = torch.randn(batch, seq, d_model, generator=generator)
    return X, torch.randn(batch, seq, d_model, generator=generator)


def sharded_against_full(env, d_model: int, num_heads: int, batch: int, seq: int) -> dict:
    """One forward and backward of a whole ``TransformerBlock`` and of this rank's ``shard_block`` of it (and of
    torch's ``parallelize_block``), on the same batch: the largest absolute differences of the outputs, of the
    input's gradients, and (by hand) of every parameter's gradient against this rank's slice of the whole one; the
    bytes of parameters this rank holds, and of the activations it saves for backward (whole and by hand).

    The slices of the whole gradients come from sharding them as if they were weights: ``shard_block`` on a copy
    of the block whose parameters hold the gradients cuts them exactly as it cut the weights.
    """
    from torch.distributed.device_mesh import init_device_mesh

    from common.pipeline import saved_activation_bytes

    full = block_stack(d_model, num_heads, 1)[0]
    X, target = token_batch(batch, seq, d_model)
    runs = {
        "whole": full,
        "by hand": shard_block(copy.deepcopy(full), env.rank, env.world_size),
        "torch": parallelize_block(copy.deepcopy(full), init_device_mesh("cpu", (env.world_size,))),
    }
    results = {}
    for name, block in runs.items():
        inputs = X.clone().requires_grad_()
        output = block(inputs)
        F.mse_loss(output, target).backward()
        results[name] = {"output": output.detach() + 0, "input_grad": inputs.grad}  # + 0: a plain tensor
        if name != "torch":  # DTensor's saved tensors are wrappers, whose storage this count cannot see
            results[name]["saved_bytes"] = saved_activation_bytes(block, X)
        results[name]["parameter_bytes"] = sum(
            (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in block.parameters()
        )
    whole_grads = copy.deepcopy(full)
    for holder, parameter in zip(whole_grads.parameters(), full.parameters()):
        holder.data = parameter.grad
    expected = dict(shard_block(whole_grads, env.rank, env.world_size).named_parameters())
    differences = {
        name: {
            "output": (result["output"] - results["whole"]["output"]).abs().max().item(),
            "input gradient": (result["input_grad"] - results["whole"]["input_grad"]).abs().max().item(),
        }
        for name, result in results.items()
        if name != "whole"
    }
    differences["by hand"]["parameter gradients"] = max(
        (p.grad - expected[name]).abs().max().item() for name, p in runs["by hand"].named_parameters()
    )
    return {
        "differences": differences,
        "parameter_bytes": {name: result["parameter_bytes"] for name, result in results.items()},
        "saved_bytes": {name: result["saved_bytes"] for name, result in results.items() if "saved_bytes" in result},
    }


def communication_per_step(env, d_model: int, num_heads: int, shapes: list[tuple[int, int]]) -> dict:
    """The all-reduces of one training step of a ``TransformerBlock``, for each ``(batch, seq)`` of ``shapes``:
    tensor-parallel (this rank's shard, the whole batch; ``count_collectives``, forward and backward apart); and
    once, data-parallel (DDP on the whole block; ``AllReduceCounter``), whose bytes are the gradients' whatever the
    batch."""
    from torch.nn.parallel import DistributedDataParallel

    from common.collectives import AllReduceCounter, count_collectives

    ddp = DistributedDataParallel(block_stack(d_model, num_heads, 1)[0])
    counter = AllReduceCounter.attach(ddp)
    X, target = token_batch(2, 8, d_model)
    F.mse_loss(ddp(X), target).backward()
    rows = []
    for batch, seq in shapes:
        X, target = token_batch(batch, seq, d_model)
        tp_block = shard_block(block_stack(d_model, num_heads, 1)[0], env.rank, env.world_size)
        with count_collectives() as forward_log:
            output = tp_block(X)
        with count_collectives() as backward_log:
            F.mse_loss(output, target).backward()
        rows.append(
            {
                "batch": batch,
                "seq": seq,
                "tp forward": [call.bytes for call in forward_log.calls],
                "tp backward": [call.bytes for call in backward_log.calls],
                "formula": mlp_all_reduce_bytes(batch, seq, d_model, X.element_size()),
            }
        )
    return {"rows": rows, "ddp": {"bytes": counter.bytes, "all-reduces": counter.calls}}


def time_steps(env, d_model: int, num_heads: int, depth: int, batch: int, seq: int, steps: int) -> dict:
    """``steps`` timed SGD steps of ``depth`` blocks, three ways on the same ranks, interleaved step by step: ``one
    process`` (every rank trains the whole model on the whole batch alone: the reference), ``tensor parallel``
    (the blocks split over the ranks, the whole batch on each), ``data parallel`` (DDP, ``batch / world_size``
    samples per rank). Each step runs from a barrier to a barrier; ``seconds`` per step, and for tensor
    parallelism each step's ``timeline``: when forward ended and when each all-reduce started and returned, in
    seconds from the step's start. Leave the first step out: it warms up."""
    from torch.nn.parallel import DistributedDataParallel

    from common.collectives import count_collectives

    models = {
        "one process": block_stack(d_model, num_heads, depth),
        "tensor parallel": nn.Sequential(
            *[shard_block(block, env.rank, env.world_size) for block in block_stack(d_model, num_heads, depth)]
        ),
        "data parallel": DistributedDataParallel(block_stack(d_model, num_heads, depth)),
    }
    optimizers = {name: torch.optim.SGD(model.parameters(), lr=0.01) for name, model in models.items()}
    results = {name: {"seconds": []} for name in models}
    results["tensor parallel"]["timeline"] = []
    for step in range(steps):
        X, target = token_batch(batch, seq, d_model, step)
        for name, model in models.items():
            if name == "data parallel":
                X_mine, target_mine = X.chunk(env.world_size)[env.rank], target.chunk(env.world_size)[env.rank]
            else:
                X_mine, target_mine = X, target
            dist.barrier()
            with count_collectives() as log:
                start = time.perf_counter()
                optimizers[name].zero_grad(set_to_none=True)
                output = model(X_mine)
                forward_end = time.perf_counter()
                F.mse_loss(output, target_mine).backward()
                optimizers[name].step()
                dist.barrier()
                end = time.perf_counter()
            results[name]["seconds"].append(end - start)
            if name == "tensor parallel":
                all_reduces = [(c.started - start, c.returned - start) for c in log.calls if c.name == "all_reduce"]
                timeline = {"forward_end": forward_end - start, "end": end - start, "all_reduces": all_reduces}
                results[name]["timeline"].append(timeline)
    results["data parallel"]["buckets"] = ddp_bucket_starts(env, d_model, num_heads, depth, batch, seq)
    return results


def ddp_bucket_starts(env, d_model: int, num_heads: int, depth: int, batch: int, seq: int) -> dict:
    """When DDP starts each bucket's all-reduce in a backward of ``depth`` blocks, and its bytes: a fresh DDP model
    with ``AllReduceCounter``'s hook, which notes each bucket and passes it to the default all-reduce. Two steps; the
    second's buckets (DDP rebuilds them after the first), in seconds from the start of ``backward()``, and how long
    ``backward()`` took (it returns once every bucket's all-reduce has finished)."""
    from torch.nn.parallel import DistributedDataParallel

    from common.collectives import AllReduceCounter

    model = DistributedDataParallel(block_stack(d_model, num_heads, depth))
    counter = AllReduceCounter.attach(model)
    for step in range(2):
        counter.reset()
        X, target = (tensor.chunk(env.world_size)[env.rank] for tensor in token_batch(batch, seq, d_model, step))
        loss = F.mse_loss(model(X), target)
        begin = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
    return {"backward": end - begin, "buckets": [(moment - begin, size) for moment, size in counter.starts]}


def plot_step_timeline(timelines: list[dict], ax, title: str = "") -> None:
    """One tensor-parallel step on matplotlib's ``ax``, a row per rank: computation light, the all-reduces dark
    (each from its call to its return: blocking, nothing else runs meanwhile), a line where forward ended."""
    for rank, timeline in enumerate(timelines):
        ax.broken_barh([(0, timeline["end"] * 1e3)], (rank - 0.4, 0.8), facecolors="#c6dbef")
        spans = [(start * 1e3, (end - start) * 1e3) for start, end in timeline["all_reduces"]]
        ax.broken_barh(spans, (rank - 0.4, 0.8), facecolors="#de2d26")
        ax.axvline(timeline["forward_end"] * 1e3, ymin=0, ymax=1, color="black", linestyle=":", linewidth=1)
    ax.set_yticks(range(len(timelines)), [f"rank {rank}" for rank in range(len(timelines))])
    ax.set_ylim(len(timelines) - 0.5, -0.5)
    ax.set_xlabel("ms since the step's start (dotted: forward ends; red: all-reduces; blue: the rest)")
    ax.set_title(title)
