"""Lesson 11's experiments around ``common.pipeline``: timed steps of DeepMLP under each schedule against DDP on
the same processes, one micro-batch's bytes per stage, torch's own pipelining against ``gpipe``, and a step's
records as a timeline. The notebook (notebooks/11_pipeline_parallelism.py) and the tests run them;
``common.launch.run_on_ranks`` needs the functions it spawns in a module, so they are here.
"""

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.nn.parallel import DistributedDataParallel

from common.models import DeepMLP
from common.pipeline import (
    BACKWARD,
    FORWARD,
    SCHEDULES,
    Stage,
    deep_mlp_layers,
    gpipe,
    naive,
    saved_activation_bytes,
    stage_module,
)


def _deep_mlp_stage(env, width: int, depth: int, batch: int) -> Stage:
    """This rank's stage of ``DeepMLP(width=width, depth=depth)``, built with seed 0 on every rank."""
    torch.manual_seed(0)
    layers = deep_mlp_layers(DeepMLP(width=width, depth=depth))
    return Stage(stage_module(layers, env.rank, env.world_size), env.rank, env.world_size, DeepMLP.input_shape, batch)


def deep_mlp_batch(batch: int, step: int):
    """Step ``step``'s batch of random DeepMLP inputs and 10-class targets: the same in every process."""
    generator = torch.Generator().manual_seed(step)
    X = torch.randn(batch, *DeepMLP.input_shape, generator=generator)
    return X, torch.randint(0, 10, (batch,), generator=generator)


def _timed_pipeline_step(stage: Stage, optimizer, schedule: str, num_microbatches: int, step: int) -> tuple:
    """One SGD step of ``stage`` under ``schedule`` on step ``step``'s batch: ``(record, seconds)``, the seconds
    from a barrier before the step to a barrier after it, so that every rank's time covers the whole pipeline's."""
    X, y = deep_mlp_batch(stage.batch_size, step)
    inputs, targets = (X if stage.is_first else None), (y if stage.is_last else None)
    dist.barrier()
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    if schedule == "naive":
        _, record = naive(stage, inputs, targets)
    else:
        _, record = SCHEDULES[schedule](stage, num_microbatches, inputs, targets)
    optimizer.step()
    dist.barrier()
    return record, time.perf_counter() - start


def _timed_data_parallel_step(env, model, optimizer, batch: int, step: int) -> float:
    """One SGD step of the DDP-wrapped ``model`` on this rank's share of step ``step``'s batch: its seconds, timed
    as ``_timed_pipeline_step``'s."""
    X, y = deep_mlp_batch(batch, step)
    X, y = X.chunk(env.world_size)[env.rank], y.chunk(env.world_size)[env.rank]
    dist.barrier()
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    F.cross_entropy(model(X), y).backward()  # DDP all-reduces the gradients during the backward
    optimizer.step()
    dist.barrier()
    return time.perf_counter() - start


def _data_parallel_model(width: int, depth: int) -> tuple:
    torch.manual_seed(0)
    model = DistributedDataParallel(DeepMLP(width=width, depth=depth))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def time_runs(env, runs: list[tuple[str, int]], width: int, depth: int, batch: int, steps: int) -> dict:
    """A few timed SGD steps of DeepMLP (``width``, ``depth``, a batch of ``batch``) for each
    ``(schedule, num_microbatches)`` of ``runs``, on this rank: a dict by ``"schedule/m=M"`` of ``records`` (one per
    step, as ``common.pipeline`` describes) and ``step_seconds`` (each step's wall time, from a barrier before it to a
    barrier after its optimizer step). The schedule ``"ddp"`` is the whole model under DDP on the same ranks, each
    on ``batch / world_size`` rows of the same batch (``step_seconds`` only, under the name ``"ddp"``). Run it with
    ``common.launch.run_on_ranks``; the first step warms up the allocator and the connections: leave it out.

    The runs are interleaved: ``steps`` rounds of one step of each run, on one stage (and one DDP model) that
    they share. On a machine that other work also loads, a slow moment then slows one step of every run rather
    than every step of one, and the medians over steps compare the runs fairly.
    """
    stage = _deep_mlp_stage(env, width, depth, batch)
    optimizer = torch.optim.SGD(stage.module.parameters(), lr=0.01)
    names = ["ddp" if schedule == "ddp" else f"{schedule}/m={m}" for schedule, m in runs]
    results = {name: {"step_seconds": []} if name == "ddp" else {"records": [], "step_seconds": []} for name in names}
    model, ddp_optimizer = _data_parallel_model(width, depth) if "ddp" in names else (None, None)
    for step in range(steps):
        for name, (schedule, num_microbatches) in zip(names, runs):
            if schedule == "ddp":
                results[name]["step_seconds"].append(_timed_data_parallel_step(env, model, ddp_optimizer, batch, step))
            else:
                record, seconds = _timed_pipeline_step(stage, optimizer, schedule, num_microbatches, step)
                results[name]["records"].append(record)
                results[name]["step_seconds"].append(seconds)
    return results


class _LastStageAndLoss(nn.Module):
    """The last stage's forward as a schedule runs it: its layers, then the loss (whose 1/m scaling saves nothing)."""

    def __init__(self, stage: nn.Module, targets: torch.Tensor):
        super().__init__()
        self.stage, self.targets = stage, targets

    def forward(self, X):
        return F.cross_entropy(self.stage(X), self.targets)


def microbatch_bytes(width: int, depth: int, num_stages: int, rows: int) -> list[dict]:
    """Each stage's bytes for one micro-batch of ``rows`` rows of DeepMLP (``width``, ``depth``) cut into
    ``num_stages``, measured outside any schedule: ``"saved"``, what autograd saves for its backward
    (``saved_activation_bytes``, the loss's included on the last stage), and ``"input"`` and ``"output"``, the
    bytes of its input and output, the sizes of the gradients it sends back and receives."""
    layers = deep_mlp_layers(DeepMLP(width=width, depth=depth))
    X, y = deep_mlp_batch(rows, 0)
    sizes = []
    for rank in range(num_stages):
        stage = stage_module(layers, rank, num_stages)
        module = _LastStageAndLoss(stage, y) if rank == num_stages - 1 else stage
        saved = saved_activation_bytes(module, X)
        with torch.no_grad():
            output = stage(X)
        sizes.append(
            {"saved": saved, "input": X.numel() * X.element_size(), "output": output.numel() * output.element_size()}
        )
        X = output
    return sizes


def torch_pipelining_gradients(env, num_microbatches: int, width: int, depth: int, batch: int) -> dict:
    """One step of ``torch.distributed.pipelining``'s ``ScheduleGPipe`` on the stages ``stage_module`` cuts: this
    rank's loss (the last rank's; ``None`` elsewhere) and gradients, by parameter name.

    The ``PipelineStage`` is built by hand from this rank's ``nn.Sequential`` and one micro-batch's input shape
    (torch then learns the shapes it receives, as ``Stage`` does). The first rank feeds the batch, the last the
    targets; the schedule splits both into micro-batches and, with ``scale_grads``, divides the gradients by their
    number: the whole batch's mean loss, as ``gpipe`` computes.
    """
    stage = _deep_mlp_stage(env, width, depth, batch)
    rows = stage.microbatch_size(num_microbatches)
    pipe_stage = PipelineStage(
        stage.module,
        env.rank,
        env.world_size,
        torch.device("cpu"),
        input_args=torch.empty(rows, *stage.input_sample_shape),
    )
    schedule = ScheduleGPipe(pipe_stage, num_microbatches, loss_fn=F.cross_entropy)
    X, y = deep_mlp_batch(batch, 0)
    losses = []
    if stage.is_first:
        schedule.step(X)
    elif stage.is_last:
        schedule.step(target=y, losses=losses)
    else:
        schedule.step()
    loss = torch.stack(losses).mean().detach() if stage.is_last else None
    gradients = {name: p.grad.clone() for name, p in stage.module.named_parameters()}
    return {"loss": loss, "gradients": gradients}


def by_hand_gradients(env, num_microbatches: int, width: int, depth: int, batch: int) -> dict:
    """The same step as ``torch_pipelining_gradients`` with ``common.pipeline.gpipe``: loss and gradients by name."""
    stage = _deep_mlp_stage(env, width, depth, batch)
    X, y = deep_mlp_batch(batch, 0)
    loss, _ = gpipe(stage, num_microbatches, X if stage.is_first else None, y if stage.is_last else None)
    gradients = {name: p.grad.clone() for name, p in stage.module.named_parameters()}
    return {"loss": loss, "gradients": gradients}


def plot_timeline(records: list[dict], ax, title: str = "") -> None:
    """One step's timeline on matplotlib's ``ax``: a row per stage (stage 0 on top), a box per event from its start
    to its end, forwards light and backwards dark, labelled with the micro-batch. Times in milliseconds from the
    step's first event; the white between the boxes is the bubble (and the messages)."""
    origin = min(event["start"] for record in records for event in record["events"])
    colours = {FORWARD: "#9ecae1", BACKWARD: "#3182bd"}
    for record in records:
        row = record["rank"]
        for event in record["events"]:
            start, width = (event["start"] - origin) * 1e3, (event["end"] - event["start"]) * 1e3
            ax.broken_barh([(start, width)], (row - 0.4, 0.8), facecolors=colours[event["kind"]], edgecolor="black")
            label = f"{event['kind']}{event['microbatch']}"
            ax.text(start + width / 2, row, label, ha="center", va="center", fontsize=7, clip_on=True)
    ax.set_yticks(range(len(records)), [f"stage {record['rank']}" for record in records])
    ax.set_ylim(len(records) - 0.5, -0.5)
    ax.set_xlabel("ms since the step's first event")
    ax.set_title(title)
