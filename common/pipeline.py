"""Pipeline parallelism by hand (lesson 11): a model cut into stages, one per rank, and three schedules.

A model that is a stack of layers is cut into ``p`` contiguous stages (``stage_bounds``, ``stage_module``); rank
``r`` holds stage ``r``. A batch flows forward from stage 0 to stage ``p - 1``, each stage sending its output
activations to the next with point-to-point messages, and the gradients flow back the same way. Three schedules
order that work, each one optimizer step's forward and backward:

- ``naive``: the whole batch goes through the stages one after the other, forward then backward. Only one stage
  works at a time: the others wait, a "bubble" of ``(p - 1) / p`` of the step.
- ``gpipe`` (GPipe, Huang et al. 2019, https://arxiv.org/abs/1811.06965): the batch is split into ``m``
  micro-batches; every stage runs all ``m`` forwards, then all ``m`` backwards, accumulating the gradients, and
  the caller takes one optimizer step. While stage 1 works on micro-batch 0, stage 0 works on micro-batch 1: the
  bubble shrinks to ``(p - 1) / (m + p - 1)`` (``bubble_fraction_formula``), but every stage holds the
  activations of all ``m`` micro-batches until their backwards.
- ``one_f_one_b`` (1F1B, the schedule of PipeDream-Flush, Narayanan et al. 2021,
  https://arxiv.org/abs/2104.04473): the same work in another order. Stage ``r`` runs ``p - r - 1`` warm-up
  forwards, then alternates one forward and one backward, then finishes the backwards left (cool-down). A
  micro-batch's activations are freed as soon as its backward has run, so stage ``r`` holds at most
  ``min(m, p - r)`` micro-batches instead of ``m``; the bubble is the same as GPipe's.

All three compute exactly the gradients of one process that trains on the whole batch with the whole model: each
micro-batch's loss is scaled by ``1 / m``, so the accumulated gradients are those of the whole batch's mean loss
(tests/test_pipeline.py checks the parameters after several steps).

Each schedule also returns what the lesson measures: a ``record`` of this rank's events in order (``"F"`` or
``"B"``, the micro-batch, when the computation started and ended), the peak number of micro-batches whose
activations the stage held at once, and the messages it sent. ``measured_bubble_fraction`` turns the records of
all ranks into the measured bubble. Records are plain dicts and lists, so that they travel back from
``common.launch.run_on_ranks``.

``torch.distributed.pipelining`` (``PipelineStage``, ``ScheduleGPipe``, ``Schedule1F1B``) does all of this for
real; this module writes it out so that the order of the messages and the memory it costs can be seen.
"""

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

FORWARD, BACKWARD = "F", "B"  # the kinds of a record's events


def stage_bounds(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """The ``(start, stop)`` layer indices of each stage: contiguous, balanced by the number of layers.

    The first ``num_layers % num_stages`` stages get one layer more, e.g. 10 layers on 4 stages:
    ``[(0, 3), (3, 6), (6, 8), (8, 10)]``. Balancing by count is the simplest rule; it balances the work only when
    the layers cost the same (DeepMLP's blocks do; its first and last layers do not quite).
    """
    if num_stages < 1:
        raise ValueError(f"a pipeline needs at least one stage, not {num_stages}")
    if num_layers < num_stages:
        raise ValueError(
            f"cannot cut {num_layers} layer(s) into {num_stages} stages: every stage needs at least one layer"
        )
    base, extra = divmod(num_layers, num_stages)
    bounds, start = [], 0
    for stage in range(num_stages):
        stop = start + base + (1 if stage < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def deep_mlp_layers(model) -> list[nn.Module]:
    """``common.models.DeepMLP``'s layers in the order its forward runs them: the stem, each block, the head.

    The modules are the model's own (no copy): ``nn.Sequential(*deep_mlp_layers(model))`` computes what ``model``
    computes, with the same parameters, and a stage built from a slice of the list trains the model's parameters.
    """
    return [model.stem, *model.blocks, model.head]


def stage_module(layers: list[nn.Module], rank: int, world_size: int) -> nn.Sequential:
    """Rank ``rank``'s stage: its contiguous slice of ``layers`` (``stage_bounds``) as one ``nn.Sequential``.

    Here every rank has built the whole model and keeps a slice, which is simple and gives every rank the same
    initial weights; a model too large for one device would be built on the ``meta`` device, or by each rank for
    its own layers only.
    """
    start, stop = stage_bounds(len(layers), world_size)[rank]
    return nn.Sequential(*layers[start:stop])


class Stage:
    """One rank's part of the pipeline: its layers, its neighbours, and the shapes of what it receives.

    A receiver has to allocate the tensor that ``dist.recv`` fills, so it must know the shape beforehand. At
    construction the shapes travel down the pipeline once: stage 0 knows the shape of one sample
    (``sample_shape``, e.g. ``(1, 28, 28)``), runs its layers on a zero sample under ``torch.no_grad`` to learn
    the shape of its output, and sends that shape to stage 1, which does the same, and so on. The micro-batch's
    first dimension is known to every rank from the batch size and the number of micro-batches.

    Built on every rank at the same time (the shapes are messages). ``batch_size`` is the whole batch's, split by
    each schedule into equal micro-batches.
    """

    def __init__(self, module: nn.Module, rank: int, world_size: int, sample_shape, batch_size: int):
        self.module = module
        self.rank = rank
        self.world_size = world_size
        self.batch_size = batch_size
        self.is_first = rank == 0
        self.is_last = rank == world_size - 1
        self.device = next(module.parameters()).device
        if self.is_first:
            self.input_sample_shape = tuple(sample_shape)
        else:
            self.input_sample_shape = _recv_shape(src=rank - 1)
        with torch.no_grad():
            sample = torch.zeros((1, *self.input_sample_shape), device=self.device)
            self.output_sample_shape = tuple(module(sample).shape[1:])
        if not self.is_last:
            _send_shape(self.output_sample_shape, dst=rank + 1)

    def microbatch_size(self, num_microbatches: int) -> int:
        """The rows of each micro-batch; the batch must split into equal ones (else the 1/m scaling is wrong)."""
        if num_microbatches < 1 or self.batch_size % num_microbatches:
            raise ValueError(f"a batch of {self.batch_size} does not split into {num_microbatches} equal micro-batches")
        return self.batch_size // num_microbatches


def _send_shape(shape, dst: int) -> None:
    # Two messages: first how many dimensions, then the dimensions, so that the receiver can allocate each.
    dist.send(torch.tensor([len(shape)]), dst=dst)
    dist.send(torch.tensor(shape, dtype=torch.int64), dst=dst)


def _recv_shape(src: int) -> tuple[int, ...]:
    ndim = torch.zeros(1, dtype=torch.int64)
    dist.recv(ndim, src=src)
    shape = torch.zeros(int(ndim), dtype=torch.int64)
    dist.recv(shape, src=src)
    return tuple(shape.tolist())


class _StepState:
    """What one schedule call keeps between its forwards and backwards on one rank.

    ``in_flight`` maps a micro-batch to what its backward needs: the input it received (whose ``.grad`` goes back to
    the previous stage) and its output (on the last stage, its scaled loss). Holding them is holding the
    micro-batch's activations, since the autograd graph from input to output keeps every intermediate tensor alive;
    their number is what GPipe and 1F1B differ in, so it is counted here, at the one place it changes.
    """

    def __init__(self, stage: Stage, num_microbatches: int, inputs, targets, loss_fn):
        self.stage = stage
        self.num_microbatches = num_microbatches
        rows = stage.microbatch_size(num_microbatches)
        self.microbatch_shape_in = (rows, *stage.input_sample_shape)
        self.microbatch_shape_out = (rows, *stage.output_sample_shape)
        if stage.is_first:
            if inputs is None or len(inputs) != stage.batch_size:
                raise ValueError(f"the first stage needs the batch's {stage.batch_size} inputs")
            self.input_chunks = inputs.chunk(num_microbatches)
        if stage.is_last:
            if targets is None or len(targets) != stage.batch_size:
                raise ValueError(f"the last stage needs the batch's {stage.batch_size} targets")
            self.target_chunks = targets.chunk(num_microbatches)
        self.loss_fn = loss_fn
        self.in_flight: dict[int, tuple] = {}
        self.peak_in_flight = 0
        self.events: list[dict] = []
        self.sends: list = []  # the isend handles, waited for at the end of the step
        self.messages_sent = {"activations": 0, "gradients": 0}
        self.loss = torch.zeros((), device=stage.device) if stage.is_last else None

    def send(self, tensor: torch.Tensor, dst: int, what: str) -> None:
        # isend, not send: gloo's blocking send waits until the peer posts the matching recv (measured: a send
        # returns only when the receiver gets to it). In 1F1B's steady state stage r sends an activation forward
        # while stage r + 1 sends a gradient back; two blocking sends facing each other would wait forever.
        # Receives stay blocking: a stage cannot compute before its input is there.
        self.sends.append(dist.isend(tensor, dst=dst))
        self.messages_sent[what] += 1

    def finish(self) -> tuple:
        for work in self.sends:
            work.wait()  # the tensors handed to isend must stay untouched until their sends complete
        record = {
            "rank": self.stage.rank,
            "num_microbatches": self.num_microbatches,
            "events": self.events,
            "peak_in_flight": self.peak_in_flight,
            "messages_sent": self.messages_sent,
        }
        return self.loss, record


def _forward(state: _StepState, microbatch: int) -> None:
    """Micro-batch ``microbatch`` through this stage: receive its input, compute, send the output on."""
    stage = state.stage
    if stage.is_first:
        X = state.input_chunks[microbatch]
    else:
        X = torch.empty(state.microbatch_shape_in, device=stage.device)
        dist.recv(X, src=stage.rank - 1)
        X.requires_grad_()  # its gradient is what this stage sends back to the previous one
    start = time.perf_counter()  # the event times computation only: waiting for a message is idle time
    output = stage.module(X)
    if stage.is_last:
        # Each micro-batch's mean loss divided by m: the sum over micro-batches is the whole batch's mean loss, so
        # the accumulated gradients are the whole batch's.
        output = state.loss_fn(output, state.target_chunks[microbatch]) / state.num_microbatches
        state.loss += output.detach()
    end = time.perf_counter()
    if not stage.is_last:
        # detach: the next stage gets the values; the graph to this output stays here, for the backward.
        state.send(output.detach(), dst=stage.rank + 1, what="activations")
    state.in_flight[microbatch] = (X, output)
    state.peak_in_flight = max(state.peak_in_flight, len(state.in_flight))
    state.events.append({"kind": FORWARD, "microbatch": microbatch, "start": start, "end": end})


def _backward(state: _StepState, microbatch: int) -> None:
    """Micro-batch ``microbatch``'s backward through this stage: receive the gradient of its output, backpropagate
    (which adds to the parameters' ``.grad``), send the gradient of its input back, and free its activations."""
    stage = state.stage
    X, output = state.in_flight.pop(microbatch)
    if stage.is_last:
        output_grad = None  # output is the scaled loss, a scalar: backward starts from 1
    else:
        output_grad = torch.empty(state.microbatch_shape_out, device=stage.device)
        dist.recv(output_grad, src=stage.rank + 1)
    start = time.perf_counter()
    torch.autograd.backward(output, grad_tensors=output_grad)
    end = time.perf_counter()
    if not stage.is_first:
        state.send(X.grad, dst=stage.rank - 1, what="gradients")
    state.events.append({"kind": BACKWARD, "microbatch": microbatch, "start": start, "end": end})


def naive(stage: Stage, inputs=None, targets=None, loss_fn=F.cross_entropy) -> tuple:
    """One step's forward and backward of the whole batch, one stage after the other (no micro-batches).

    Stage ``r`` waits for stage ``r - 1``'s activations, computes, sends; the last stage computes the loss and the
    gradients travel back the same way. At any moment one stage computes and ``p - 1`` wait. ``inputs``: the
    batch, on the first stage only; ``targets``: on the last stage only. Returns ``(loss, record)``: the batch's
    mean loss on the last stage (``None`` elsewhere) and this rank's record (see the module's docstring). The
    gradients are added to the parameters' ``.grad``: zero them before, step the optimizer after.
    """
    state = _StepState(stage, 1, inputs, targets, loss_fn)
    _forward(state, 0)
    _backward(state, 0)
    return state.finish()


def gpipe(stage: Stage, num_microbatches: int, inputs=None, targets=None, loss_fn=F.cross_entropy) -> tuple:
    """GPipe (Huang et al. 2019): all ``num_microbatches`` forwards, then all backwards, last micro-batch first.

    The gradients of the micro-batches accumulate in ``.grad`` and the caller steps once: the same update as the
    whole batch. Backwards run in reverse order because the last stage finishes the last micro-batch's forward
    last and can start its backward at once; the stages before it receive the gradients in that order. Every
    stage holds all ``m`` micro-batches' activations between its last forward and its first backward.
    Arguments and result as ``naive``.
    """
    state = _StepState(stage, num_microbatches, inputs, targets, loss_fn)
    # BEGIN LAB: every forward, then every backward, the last micro-batch's first
    # _forward(state, i) receives micro-batch i's input, computes and sends its output on; _backward(state, i)
    # receives the gradient of its output, backpropagates (adding to .grad) and sends its input's gradient back.
    for microbatch in range(num_microbatches):
        _forward(state, microbatch)
    for microbatch in reversed(range(num_microbatches)):
        _backward(state, microbatch)
    # END LAB
    return state.finish()


def one_f_one_b(stage: Stage, num_microbatches: int, inputs=None, targets=None, loss_fn=F.cross_entropy) -> tuple:
    """1F1B, the schedule of PipeDream-Flush (Narayanan et al. 2021): warm-up, one forward one backward, cool-down.

    Stage ``r`` of ``p`` first runs ``p - r - 1`` forwards (warm-up; fewer if there are fewer micro-batches): just
    enough that, when its next forward's output reaches the last stage, the gradient of its first micro-batch can
    come straight back. Then it alternates one forward and one backward (steady state), and ends with the
    backwards left (cool-down). The micro-batches' backwards run in order 0, 1, ...; a micro-batch's activations are
    freed by its backward, so stage ``r`` holds at most ``min(m, p - r)`` of them, where GPipe holds ``m``. The
    work and the one optimizer step are GPipe's, and so is the bubble. Arguments and result as ``naive``.
    """
    state = _StepState(stage, num_microbatches, inputs, targets, loss_fn)
    warmup = min(stage.world_size - stage.rank - 1, num_microbatches)
    for microbatch in range(warmup):
        _forward(state, microbatch)
    for microbatch in range(num_microbatches - warmup):
        _forward(state, warmup + microbatch)
        _backward(state, microbatch)
    for microbatch in range(num_microbatches - warmup, num_microbatches):
        _backward(state, microbatch)
    return state.finish()


SCHEDULES = {"naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b}
"""The schedules by name. ``naive`` takes no ``num_microbatches``: call it as ``naive(stage, inputs, targets)``."""


def bubble_fraction_formula(num_stages: int, num_microbatches: int) -> float:
    """The fraction of a pipelined step that each stage spends idle: ``(p - 1) / (m + p - 1)`` (GPipe's paper).

    With equal stages, a forward and a backward of one micro-batch take ``t`` on every stage; a stage works
    ``m * t`` of a step that lasts ``(m + p - 1) * t``: the first stage's last micro-batch needs ``p - 1`` more
    stage-times to reach the end, and its gradient as many to come back. The ``(p - 1) * t`` left over is idle.
    GPipe and 1F1B share it; ``m = 1`` is the naive schedule's ``(p - 1) / p``.
    """
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def measured_bubble_fraction(records: list[dict]) -> float:
    """The measured fraction of the step that the stages spent idle, from every rank's record of one step.

    The step's span runs from the first event's start on any rank to the last event's end on any rank. A rank's
    busy time is the sum of its events' durations (computation only: the events exclude waiting for messages, and
    sending is asynchronous); its idle fraction is ``1 - busy / span``. The result is the mean over ranks, which is
    what ``bubble_fraction_formula`` predicts when stages are equal and messages free. Real stages are not equal
    (DeepMLP's first and last stages hold the larger layers and the loss) and messages take time, so the measured
    fraction sits above the formula's, the more so as micro-batches shrink: each message costs about the same time
    however small, and a smaller micro-batch computes for less (on two CPU cores with gloo, DeepMLP width 1024 and a
    batch of 512 on 2 stages measured 0.50, 0.24 and 0.14 for the naive schedule, 1F1B with m = 4 and with m = 16,
    against the formula's 0.50, 0.20 and 0.06).

    The ranks' times are comparable because ``time.perf_counter`` reads the machine's monotonic clock on Linux,
    shared by the processes on one machine; records from several machines would not share a time axis.
    """
    events = [event for record in records for event in record["events"]]
    if not events:
        raise ValueError("the records hold no events")
    span = max(event["end"] for event in events) - min(event["start"] for event in events)
    idle = [1 - sum(event["end"] - event["start"] for event in record["events"]) / span for record in records]
    return sum(idle) / len(idle)
