"""Lesson 11's experiments around ``common.pipeline``: timed steps of DeepMLP under each schedule against DDP on
the same processes, one micro-batch's bytes per stage, torch's own pipelining against ``gpipe``, and a step's
records as a timeline. The notebook (notebooks/11_pipeline_parallelism.py) and the tests run them;
``common.launch.run_on_ranks`` needs the functions it spawns in a module, so they are here.

Two more for the lesson's later sections:

- ``replay``: when each event of a schedule would start and end, given each event's computation time and free
  (or fixed-cost) messages. It separates what a schedule's order costs on unequal stages from what the messages
  cost, and it draws the lesson's schedule pictures.
- torch's schedules with several stages per rank (``TORCH_SCHEDULES``: interleaved 1F1B, and the zero-bubble ones
  that split a backward into its input and weight gradients), built on the same cut of DeepMLP, with their
  gradients (``torch_schedule_gradients``) and their timed steps and events (``time_torch_schedules``).
"""

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
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
    schedule_order,
    stage_bounds,
    stage_module,
)

BACKWARD_INPUT, BACKWARD_WEIGHT = "I", "W"  # a backward split in two, as zero-bubble schedules run it (torch's names)


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


def time_runs(env, runs: list[tuple[str, int]], width: int, depth: int, batch: int, steps: int, torch_runs=()) -> dict:
    """A few timed SGD steps of DeepMLP (``width``, ``depth``, a batch of ``batch``) for each
    ``(schedule, num_microbatches)`` of ``runs``, on this rank: a dict by ``"schedule/m=M"`` of ``records`` (one per
    step, as ``common.pipeline`` describes) and ``step_seconds`` (each step's wall time, from a barrier before it to a
    barrier after its optimizer step). The schedule ``"ddp"`` is the whole model under DDP on the same ranks, each
    on ``batch / world_size`` rows of the same batch (``step_seconds`` only, under the name ``"ddp"``). Run it with
    ``common.launch.run_on_ranks``; the first step warms up the allocator and the connections: leave it out.

    The runs are interleaved: ``steps`` rounds of one step of each run, on one stage (and one DDP model) that
    they share. On a machine that other work also loads, a slow moment then slows one step of every run rather
    than every step of one, and the medians over steps compare the runs fairly. ``torch_runs``, ``(schedule, m)``
    pairs of ``TORCH_SCHEDULES``, join the same rounds, under the names ``"torch schedule/m=M"``
    (``time_torch_schedules`` says what they record).
    """
    stage = _deep_mlp_stage(env, width, depth, batch)
    optimizer = torch.optim.SGD(stage.module.parameters(), lr=0.01)
    names = ["ddp" if schedule == "ddp" else f"{schedule}/m={m}" for schedule, m in runs]
    results = {name: {"step_seconds": []} if name == "ddp" else {"records": [], "step_seconds": []} for name in names}
    model, ddp_optimizer = _data_parallel_model(width, depth) if "ddp" in names else (None, None)
    theirs = {f"torch {name}": step for name, step in _torch_steppers(env, torch_runs, width, depth, batch).items()}
    results |= {name: {"records": [], "step_seconds": []} for name in theirs}
    for step in range(steps):
        for name, (schedule, num_microbatches) in zip(names, runs):
            if schedule == "ddp":
                results[name]["step_seconds"].append(_timed_data_parallel_step(env, model, ddp_optimizer, batch, step))
            else:
                record, seconds = _timed_pipeline_step(stage, optimizer, schedule, num_microbatches, step)
                results[name]["records"].append(record)
                results[name]["step_seconds"].append(seconds)
        for name, torch_step in theirs.items():
            record, seconds = torch_step(step)
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


def replay(orders: list[list[tuple]], seconds: dict, message_seconds: float = 0.0) -> list[dict]:
    """When each event of a schedule would start and end: every rank runs its events in order, each as soon as
    what it needs is there, each taking the time ``seconds`` gives it, and each message between ranks
    ``message_seconds`` (free by default).

    ``orders[rank]`` lists the rank's events in order, as ``(kind, micro-batch)`` (one stage per rank: the stage is
    the rank) or ``(kind, micro-batch, stage)`` (``stage`` counts every stage of the pipeline, for schedules that
    give a rank several). Kinds: ``"F"``, ``"B"``, and a backward split in two, ``"I"`` (the gradient of the input,
    which the stage before waits for) and ``"W"`` (the gradient of the weights, which nobody waits for).
    ``seconds[kind][stage]``: one micro-batch's event of that kind on that stage. What an event needs:

    - a forward ``F(i, s)``: ``F(i, s - 1)``, the activation it receives;
    - a backward ``B(i, s)`` or ``I(i, s)``: its own ``F(i, s)``, and the gradient of its output, from ``B`` or
      ``I`` of ``(i, s + 1)``;
    - ``W(i, s)``: ``I(i, s)``.

    Returns one record per rank, as the schedules of ``common.pipeline`` return them (``rank``, ``events`` with
    ``kind``, ``microbatch``, ``stage``, ``start``, ``end``), so that ``measured_bubble_fraction`` reads them. An
    order whose events wait for each other forever raises ``ValueError``.
    """
    events = [
        [(*event, rank) if len(event) == 2 else tuple(event) for event in order] for rank, order in enumerate(orders)
    ]
    owner = {stage: rank for rank, order in enumerate(events) for _, _, stage in order}
    last_stage = max(owner)
    finished: dict[tuple, float] = {}  # (kind, micro-batch, stage): when it ended; ("G", i, s): its input's gradient
    clock, position = [0.0] * len(events), [0] * len(events)
    records = [{"rank": rank, "events": []} for rank in range(len(events))]
    while any(position[rank] < len(order) for rank, order in enumerate(events)):
        progressed = False
        for rank, order in enumerate(events):
            while position[rank] < len(order):
                kind, microbatch, stage = order[position[rank]]
                if kind == FORWARD:
                    needs = [((FORWARD, microbatch, stage - 1), stage - 1)] if stage > 0 else []
                elif kind in (BACKWARD, BACKWARD_INPUT):
                    needs = [((FORWARD, microbatch, stage), stage)]
                    needs += [(("G", microbatch, stage + 1), stage + 1)] if stage < last_stage else []
                elif kind == BACKWARD_WEIGHT:
                    needs = [(("G", microbatch, stage), stage)]
                else:
                    raise ValueError(f"unknown event kind {kind!r}")
                if any(key not in finished for key, _ in needs):
                    break  # this rank waits; another one can move on
                arrivals = [finished[key] + (message_seconds if owner[src] != rank else 0.0) for key, src in needs]
                start = max([clock[rank], *arrivals])
                end = start + seconds[kind][stage]
                finished[kind, microbatch, stage] = end
                if kind in (BACKWARD, BACKWARD_INPUT):
                    finished["G", microbatch, stage] = end
                event = {"kind": kind, "microbatch": microbatch, "stage": stage, "start": start, "end": end}
                records[rank]["events"].append(event)
                clock[rank], position[rank], progressed = end, position[rank] + 1, True
        if not progressed:
            waiting = {rank: order[position[rank]] for rank, order in enumerate(events) if position[rank] < len(order)}
            raise ValueError(f"the order deadlocks: every rank waits, at {waiting}")
    return records


def replay_schedule(schedule: str, num_stages: int, num_microbatches: int, seconds: dict, message_seconds=0.0):
    """``replay`` of one of ``common.pipeline``'s schedules (``schedule_order``) on ``num_stages`` ranks."""
    orders = [schedule_order(schedule, rank, num_stages, num_microbatches) for rank in range(num_stages)]
    return replay(orders, seconds, message_seconds)


def recorded_seconds(records_by_step: list[list[dict]]) -> dict:
    """The median time of each kind of event on each stage, over the steps' records (each a list over ranks):
    ``{kind: {stage: seconds}}``, what ``replay`` takes to replay the same run with free messages."""
    durations: dict = {}
    for records in records_by_step:
        for record in records:
            for event in record["events"]:
                stage = event.get("stage", record["rank"])
                durations.setdefault(event["kind"], {}).setdefault(stage, []).append(event["end"] - event["start"])
    return {
        kind: {stage: statistics.median(times) for stage, times in by_stage.items()}
        for kind, by_stage in durations.items()
    }


def recorded_orders(records: list[dict]) -> list[list[tuple]]:
    """Each rank's events of one step, in the order it ran them, as ``replay`` takes them."""
    return [
        [(event["kind"], event["microbatch"], event.get("stage", record["rank"])) for event in record["events"]]
        for record in records
    ]


TORCH_SCHEDULES = {
    "GPipe": (ScheduleGPipe, 1),
    "1F1B": (Schedule1F1B, 1),
    "Interleaved1F1B": (ScheduleInterleaved1F1B, 2),
    "InterleavedZeroBubble": (ScheduleInterleavedZeroBubble, 2),
    "ZBVZeroBubble": (ScheduleZBVZeroBubble, 2),
}
"""torch's schedules the lesson runs: ``{name: (class, stages per rank)}``. With 2 stages per rank the model is cut
into twice as many stages as there are ranks (``torch_stage_indices`` says which a rank holds)."""


def torch_stage_indices(schedule: str, rank: int, world_size: int) -> list[int]:
    """The stages rank ``rank`` holds under torch's ``schedule``: ``[rank]`` with one stage per rank; looped with
    several (``rank``, ``rank + p``, ...: the interleaved schedules); and a V for ``ZBVZeroBubble`` (``rank`` and
    ``2p - 1 - rank``: the first rank also holds the last stage)."""
    _, per_rank = TORCH_SCHEDULES[schedule]
    if schedule == "ZBVZeroBubble":
        return [rank, 2 * world_size - 1 - rank]
    return [rank + k * world_size for k in range(per_rank)]


def torch_schedule_order(schedule: str, num_ranks: int, num_microbatches: int) -> list[list[tuple]]:
    """The order of computations torch's multi-stage ``schedule`` gives each rank, as ``replay`` takes it:
    ``(kind, micro-batch, stage)``. Read from the schedule's own ``pipeline_order`` through torch's schedule
    visualizer (``torch.distributed.pipelining._schedule_visualizer``, a private module), without processes."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    _, per_rank = TORCH_SCHEDULES[schedule]
    if per_rank == 1:
        raise ValueError(f"{schedule}: use common.pipeline.schedule_order for one stage per rank")
    actions = get_schedule_ops(schedule, num_ranks, num_microbatches, num_stages_per_rank=per_rank)
    return [
        [(action.computation_type.value, action.microbatch_index, action.stage_index) for action in row if action]
        for row in actions
    ]


def _torch_stages(env, schedule: str, num_microbatches: int, width: int, depth: int, batch: int) -> tuple:
    """This rank's ``PipelineStage``s of ``DeepMLP(width, depth)`` (seed 0 on every rank) under torch's
    ``schedule``, and the schedule itself. The model is cut by ``stage_bounds`` into ``world_size x`` (stages per
    rank) stages; the last one's loss is the whole batch's mean cross-entropy (torch divides by m after the last
    backward)."""
    schedule_class, per_rank = TORCH_SCHEDULES[schedule]
    torch.manual_seed(0)
    layers = deep_mlp_layers(DeepMLP(width=width, depth=depth))
    num_stages = env.world_size * per_rank
    rows = batch // num_microbatches
    stages = []
    for index in torch_stage_indices(schedule, env.rank, env.world_size):
        start, stop = stage_bounds(len(layers), num_stages)[index]
        with torch.no_grad():  # the shape of one sample entering this stage
            sample_shape = nn.Sequential(*layers[:start])(torch.zeros(1, *DeepMLP.input_shape)).shape[1:]
        module = nn.Sequential(*layers[start:stop])
        example = torch.empty(rows, *sample_shape)
        stages.append(PipelineStage(module, index, num_stages, torch.device("cpu"), input_args=example))
    chosen = stages[0] if per_rank == 1 else stages
    return stages, schedule_class(chosen, num_microbatches, loss_fn=F.cross_entropy)


def _torch_step(stages, schedule, batch: int, step: int):
    """One forward and backward of torch's ``schedule`` on step ``step``'s batch: the loss on the rank that holds
    the last stage (the mean over micro-batches), ``None`` elsewhere."""
    X, y = deep_mlp_batch(batch, step)
    holds_first, holds_last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    losses = []
    args = (X,) if holds_first else ()
    kwargs = {"target": y, "losses": losses} if holds_last else {}
    schedule.step(*args, **kwargs)
    return torch.stack(losses).mean().detach() if holds_last else None


def torch_schedule_gradients(env, schedule: str, num_microbatches: int, width: int, depth: int, batch: int) -> dict:
    """One step of torch's ``schedule`` (a name in ``TORCH_SCHEDULES``): the loss (on the rank holding the last
    stage) and this rank's gradients, by ``"stage/parameter name"`` (``"2/0.1.weight"``: stage 2's first layer)."""
    stages, chosen = _torch_stages(env, schedule, num_microbatches, width, depth, batch)
    loss = _torch_step(stages, chosen, batch, 0)
    gradients = {
        f"{stage.stage_index}/{name}": p.grad.clone() for stage in stages for name, p in stage.submod.named_parameters()
    }
    return {"loss": loss, "gradients": gradients}


def _record_events(stage, events: list) -> None:
    """Make ``stage`` append an event (kind, micro-batch, stage, start, end) to ``events`` for each computation torch's
    schedule runs on it: a forward, a full backward ``B``, or a split one's ``I`` and ``W``. The receives are waited
    for before these calls, so, as in ``common.pipeline``, an event times computation only."""
    forward, backward, weight = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

    def timed(kind, call, microbatch, *args, **kwargs):
        start = time.perf_counter()
        result = call(microbatch, *args, **kwargs)
        end = time.perf_counter()
        events.append({"kind": kind, "microbatch": microbatch, "stage": stage.stage_index, "start": start, "end": end})
        return result

    def timed_backward(microbatch, *args, full_backward=True, **kwargs):
        kind = BACKWARD if full_backward else BACKWARD_INPUT
        return timed(kind, backward, microbatch, *args, full_backward=full_backward, **kwargs)

    stage.forward_one_chunk = lambda microbatch, *args, **kwargs: timed(FORWARD, forward, microbatch, *args, **kwargs)
    stage.backward_one_chunk = timed_backward
    stage.backward_weight_one_chunk = lambda microbatch, *a, **k: timed(BACKWARD_WEIGHT, weight, microbatch, *a, **k)


def _torch_steppers(env, runs, width: int, depth: int, batch: int) -> dict:
    """``{"schedule/m=M": step}`` for each ``(schedule, m)`` of ``runs``: ``step(i)`` runs one timed SGD step of torch's
    schedule on batch ``i`` and returns this rank's record and the step's seconds, as ``time_torch_schedules``
    describes. Each schedule has its own copy of the model (seed 0), cut for it."""
    steppers = {}
    for schedule, num_microbatches in runs:
        stages, chosen = _torch_stages(env, schedule, num_microbatches, width, depth, batch)
        events: list[dict] = []
        for stage in stages:
            _record_events(stage, events)
        parameters = [p for stage in stages for p in stage.submod.parameters()]
        optimizer = torch.optim.SGD(parameters, lr=0.01)

        def step(index, stages=stages, chosen=chosen, optimizer=optimizer, events=events):
            events.clear()
            dist.barrier()
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            _torch_step(stages, chosen, batch, index)
            optimizer.step()
            dist.barrier()
            return {"rank": env.rank, "events": list(events)}, time.perf_counter() - start

        steppers[f"{schedule}/m={num_microbatches}"] = step
    return steppers


def time_torch_schedules(env, runs: list[tuple[str, int]], width: int, depth: int, batch: int, steps: int) -> dict:
    """``time_runs`` for torch's schedules: ``steps`` rounds of one SGD step of each ``(schedule, m)`` of ``runs``,
    each on its own copy of ``DeepMLP(width, depth)`` (seed 0) cut for that schedule. A dict by ``"schedule/m=M"``
    of ``records`` (per step: this rank's events in the order run, each with its stage) and ``step_seconds`` (from
    a barrier before the step to one after its optimizer step). Leave the first step out: it also learns the shapes
    the stages exchange."""
    steppers = _torch_steppers(env, runs, width, depth, batch)
    results = {name: {"records": [], "step_seconds": []} for name in steppers}
    for index in range(steps):
        for name, step in steppers.items():
            record, seconds = step(index)
            results[name]["records"].append(record)
            results[name]["step_seconds"].append(seconds)
    return results


def ddp_buckets(env, width: int, depth: int, batch: int) -> list[dict]:
    """The buckets torch's DDP all-reduces in one step of ``DeepMLP(width, depth)`` (the notebook's ``"ddp"`` run),
    in the order it launches them, after the first step (when DDP rebuilds its buckets in the order the gradients
    became ready): each one's bytes and the names of the parameters it holds. A communication hook records them and
    then does what DDP does by default: an average over the ranks."""
    model, optimizer = _data_parallel_model(width, depth)
    names = {id(p): name for name, p in model.module.named_parameters()}
    launched: list[dict] = []

    def record_and_average(_, bucket):
        buffer = bucket.buffer()
        parameters = [names[id(p)] for p in bucket.parameters()]
        launched.append({"bytes": buffer.numel() * buffer.element_size(), "parameters": parameters})
        work = dist.all_reduce(buffer.div_(env.world_size), async_op=True)
        return work.get_future().then(lambda future: future.value()[0])

    model.register_comm_hook(None, record_and_average)
    for step in range(2):
        launched.clear()
        _timed_data_parallel_step(env, model, optimizer, batch, step)
    return launched


def pipeline_with_data_parallel(env, num_stages: int, num_microbatches: int, width: int, depth: int, batch: int):
    """A step of torch's ``Schedule1F1B`` with data parallelism: ``world_size / num_stages`` copies of a pipeline
    of ``num_stages`` stages of ``DeepMLP(width, depth)`` (seed 0), each copy on its share of the batch. Rank ``r``
    is stage ``r % num_stages`` of copy ``r // num_stages``. Each stage's module is wrapped in DDP over the ranks
    that hold the same stage, and torch's stage runs every backward but the last under ``no_sync()``.

    Two steps run on the same batch, without an optimizer step. The first one also learns the shapes the stages
    exchange, with a forward and a backward of its own. That forward runs the DDP module outside ``no_sync()``, so
    DDP prepares to reduce (``_post_forward``), and micro-batch 0's backward all-reduces too, though torch runs it
    under ``no_sync()`` (the shape-learning backward asks only for the input's gradient and reduces nothing). The
    second step's figures are returned: this rank's stage and copy, how many all-reduces its DDP ran (a
    communication hook counts them, then averages as DDP does; the first step's count too), its gradients by name,
    and the loss on a last stage (its copy's mean, else ``None``). DDP all-reduces once per bucket: a stage small
    enough for one bucket all-reduces once per step."""
    copies = env.world_size // num_stages
    stage_index, copy = env.rank % num_stages, env.rank // num_stages
    # Every rank creates every group, in the same order: a pipeline's stages, and each stage's copies.
    pipelines = [dist.new_group([c * num_stages + s for s in range(num_stages)]) for c in range(copies)]
    same_stage = [dist.new_group([c * num_stages + s for c in range(copies)]) for s in range(num_stages)]
    torch.manual_seed(0)
    layers = deep_mlp_layers(DeepMLP(width=width, depth=depth))
    module = stage_module(layers, stage_index, num_stages)
    replicated = DistributedDataParallel(module, process_group=same_stage[stage_index])
    all_reduces = []

    def count_and_average(_, bucket):
        all_reduces.append(bucket.buffer().numel())
        work = dist.all_reduce(bucket.buffer().div_(copies), group=same_stage[stage_index], async_op=True)
        return work.get_future().then(lambda future: future.value()[0])

    replicated.register_comm_hook(None, count_and_average)
    start, _ = stage_bounds(len(layers), num_stages)[stage_index]
    with torch.no_grad():
        sample_shape = nn.Sequential(*layers[:start])(torch.zeros(1, *DeepMLP.input_shape)).shape[1:]
    rows = batch // copies // num_microbatches
    example = torch.empty(rows, *sample_shape)
    pipe_stage = PipelineStage(
        replicated, stage_index, num_stages, torch.device("cpu"), input_args=example, group=pipelines[copy]
    )
    schedule = Schedule1F1B(pipe_stage, num_microbatches, loss_fn=F.cross_entropy)
    X, y = deep_mlp_batch(batch, 0)
    X, y = X.chunk(copies)[copy], y.chunk(copies)[copy]
    # All-reduces per step. The first step also learns the shapes: its shape-learning forward, outside no_sync,
    # makes micro-batch 0's backward all-reduce too.
    counts = []
    for _ in range(2):
        all_reduces.clear()
        module.zero_grad(set_to_none=True)
        losses = []
        if pipe_stage.is_first:
            schedule.step(X)
        elif pipe_stage.is_last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        counts.append(len(all_reduces))
    return {
        "stage": stage_index,
        "copy": copy,
        "all_reduces": counts[1],
        "first_step_all_reduces": counts[0],
        "gradients": {name: p.grad.clone() for name, p in module.named_parameters()},
        "loss": torch.stack(losses).mean().detach() if losses else None,
    }
