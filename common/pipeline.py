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
- ``one_f_one_b`` (1F1B, the schedule of PipeDream-Flush, Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel
  DNN Training", https://arxiv.org/abs/2006.09503): the same work in another order. Stage ``r`` runs ``p - r - 1``
  warm-up forwards, then alternates one forward and one backward, then finishes the backwards left (cool-down). A
  micro-batch's activations are freed as soon as its backward has run, so stage ``r`` holds at most ``min(m, p -
  r)`` micro-batches instead of ``m``. On equal stages the bubble is the same as GPipe's; on unequal stages 1F1B
  can idle less (lesson 11, section 3). That takes waiting for each send before its micro-batch's backward: a
  send's handle keeps the tensor it sends.

All three compute the gradients of one process that trains on the whole batch with the whole model (up to float
rounding: the sums run in another order): each
micro-batch's loss is scaled by ``1 / m``, so the accumulated gradients are those of the whole batch's mean loss
(tests/test_pipeline.py checks the parameters after several steps).

Each schedule also returns what the lesson measures: a ``record`` of this rank's events in order (``"F"`` or
``"B"``, the micro-batch, when the computation started and ended), the peak number of micro-batches whose
backward was pending at once, the peak bytes of activations the stage held (``ActivationMemory``: the tensors
autograd saved and the message buffers still referenced), and the messages it sent. ``measured_bubble_fraction``
turns the records of all ranks into the measured bubble. Records are plain dicts and lists, so that they travel
back from ``common.launch.run_on_ranks``.

``torch.distributed.pipelining`` (``PipelineStage``, ``ScheduleGPipe``, ``Schedule1F1B``) does all of this for
real; this module writes it out so that the order of the messages and the memory it costs can be seen.
"""

import time
import weakref

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


def transformer_stage_blocks(num_blocks: int, num_stages: int) -> list[int]:
    """How many of a transformer's ``num_blocks`` blocks each of ``num_stages`` pipeline stages holds, first to last.
    The first stage also holds the embeddings and the last the final norm and the head, so Llama 3's rule applies
    (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.2: 126 layers on 16 stages, 7 + 14 x 8 + 7):

    - ``num_stages`` divides ``num_blocks``: every stage holds ``num_blocks / num_stages``;
    - else, when ``num_stages`` > 2 divides ``num_blocks + 2``: the two end stages hold one block fewer, which leaves
      room for the embeddings and the head (6 blocks on 4 stages: 1, 2, 2, 1), as long as they keep a block;
    - else ``stage_bounds``' count balance, the first stages one block more (5 on 4: 2, 1, 1, 1).

    The one layout of the course's GPT: ``common.parallelize.pipeline_split`` cuts by it, and the planner
    (``common.planner``, which prices only the first two cases) counts by it."""
    balanced = [stop - start for start, stop in stage_bounds(num_blocks, num_stages)]  # a ValueError for bad input
    middle, spare = divmod(num_blocks + 2, num_stages)
    if num_blocks % num_stages and num_stages > 2 and spare == 0 and middle >= 2:
        return [middle - 1] + [middle] * (num_stages - 2) + [middle - 1]
    return balanced


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


class ActivationMemory:
    """The bytes of activations a stage holds, measured: what autograd saved for the backward, and message buffers.

    A tensor is counted from the moment something takes hold of it until its holder is garbage (``hold``; the
    holder is watched with ``weakref.finalize``), and each piece of memory once, by where its data starts, however
    many hold it: a ReLU's output is saved by the ReLU and by the next Linear, and is also the activation the stage
    sends; a flattened input is a view of the input. A tensor's own bytes are counted, not its storage's: a
    micro-batch that is a slice of the batch holds its rows (the batch is the caller's). Parameters are left out.

    Two kinds of holders: inside ``saving()``, every tensor autograd saves for the backward is packed into a
    ``_Saved`` that the graph keeps until the backward has used it (``torch.autograd.graph.saved_tensors_hooks``);
    and a message buffer is its own holder: ``hold(tensor, tensor)``. A tensor handed to ``dist.isend`` stays alive
    as long as the send's handle does (gloo's send work keeps the tensor, even after ``wait()``, and a C++
    reference keeps the Python tensor alive with it: c10/core/impl/PyObjectSlot.h), so a buffer is counted until
    the last of the schedule, the graph and the send lets go of it. ``peak_bytes`` is the most held at once.
    """

    def __init__(self, parameters=()):
        self.parameter_starts = {parameter.data_ptr() for parameter in parameters}
        self.bytes_at: dict[int, int] = {}  # where a held tensor's data starts: its bytes (the largest view's)
        self.holders_at: dict[int, int] = {}  # ...: how many holders are alive
        self.held_bytes = 0
        self.peak_bytes = 0

    def hold(self, tensor: torch.Tensor, holder) -> None:
        """Count ``tensor``'s bytes until ``holder`` (an object that keeps ``tensor`` alive) is garbage."""
        start = tensor.data_ptr()
        if start in self.parameter_starts:
            return
        size = tensor.numel() * tensor.element_size()
        self.held_bytes += max(size - self.bytes_at.get(start, 0), 0)
        self.bytes_at[start] = max(size, self.bytes_at.get(start, 0))
        self.holders_at[start] = self.holders_at.get(start, 0) + 1
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        weakref.finalize(holder, self._release, start)

    def _release(self, start: int) -> None:
        self.holders_at[start] -= 1
        if self.holders_at[start] == 0:
            del self.holders_at[start]
            self.held_bytes -= self.bytes_at.pop(start)

    def saving(self):
        """A context in which every tensor that autograd saves for the backward is held until the backward has
        used it (or the graph is dropped)."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _Saved.unpack)

    def _pack(self, tensor: torch.Tensor) -> "_Saved":
        saved = _Saved(tensor)
        self.hold(tensor, saved)
        return saved


class _Saved:
    """A tensor saved for the backward, as the autograd graph keeps it: freed with the graph's saved tensors."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def unpack(self) -> torch.Tensor:
        return self.tensor


def saved_activation_bytes(module: nn.Module, inputs: torch.Tensor) -> int:
    """The bytes of the tensors autograd saves for ``module``'s backward on ``inputs``: what one micro-batch in
    flight holds on this stage (its received input included, which a Linear saves), parameters left out, each piece
    of memory counted once (``ActivationMemory``)."""
    memory = ActivationMemory(module.parameters())
    with memory.saving():
        output = module(inputs.detach().requires_grad_())
    held = memory.held_bytes  # read while ``output`` keeps the graph, and with it the saved tensors, alive
    del output
    return held


class _StepState:
    """What one schedule call keeps between its forwards and backwards on one rank.

    ``in_flight`` maps a micro-batch to what its backward needs: the input it received (whose ``.grad`` goes back to
    the previous stage) and its output (on the last stage, its scaled loss). Holding them is holding the
    micro-batch's activations, since the autograd graph from input to output keeps every intermediate tensor alive;
    their number is what GPipe and 1F1B differ in, so it is counted here, at the one place it changes, and the
    bytes they hold are measured by ``memory``.
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
        self.memory = ActivationMemory(stage.module.parameters())
        self.events: list[dict] = []
        self.pending_sends: dict[tuple[str, int], dist.Work] = {}  # (what, micro-batch): the isend's handle
        self.messages_sent = {"activations": 0, "gradients": 0}
        self.loss = torch.zeros((), device=stage.device) if stage.is_last else None

    def send(self, tensor: torch.Tensor, dst: int, what: str, microbatch: int) -> None:
        # isend, not send: gloo's blocking send waits until the peer posts the matching recv (tests/test_pipeline.py
        # times a send to a receiver that sleeps first). In 1F1B's steady state stage r sends an activation forward
        # while stage r + 1 sends a gradient back; two blocking sends facing each other would wait forever.
        # Receives stay blocking: a stage cannot compute before its input is there.
        self.memory.hold(tensor, tensor)
        self.pending_sends[what, microbatch] = dist.isend(tensor, dst=dst)
        self.messages_sent[what] += 1

    def wait_for_send(self, what: str, microbatch: int) -> None:
        """Wait until a send has completed, and drop its handle. gloo's send work keeps the tensor it sends until
        the handle goes, even after ``wait()``: a handle kept to the end of the step is a boundary tensor kept, m
        of them in all, where 1F1B means to hold ``p - r`` micro-batches. The tensor must stay untouched until the
        send completes."""
        self.pending_sends.pop((what, microbatch)).wait()

    def wait_for_sends(self, what: str) -> None:
        for kind, microbatch in [key for key in self.pending_sends if key[0] == what]:
            self.wait_for_send(kind, microbatch)

    def finish(self) -> tuple:
        for what in ("activations", "gradients"):
            self.wait_for_sends(what)
        record = {
            "rank": self.stage.rank,
            "num_microbatches": self.num_microbatches,
            "events": self.events,
            "peak_in_flight": self.peak_in_flight,
            "peak_activation_bytes": self.memory.peak_bytes,
            "messages_sent": self.messages_sent,
        }
        return self.loss, record


def _synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued work, so that a clock read after it times the computation, not its launch. A
    no-op on the CPU, where operations run when called."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _forward(state: _StepState, microbatch: int) -> None:
    """Micro-batch ``microbatch`` through this stage: receive its input, compute, send the output on."""
    stage = state.stage
    if stage.is_first:
        X = state.input_chunks[microbatch]
    else:
        X = torch.empty(state.microbatch_shape_in, device=stage.device)
        dist.recv(X, src=stage.rank - 1)
        state.memory.hold(X, X)
        X.requires_grad_()  # its gradient is what this stage sends back to the previous one
    _synchronize(stage.device)
    start = time.perf_counter()  # the event times computation only: waiting for a message is idle time
    with state.memory.saving():
        output = stage.module(X)
        if stage.is_last:
            # Each micro-batch's mean loss divided by m: the sum over micro-batches is the whole batch's mean loss,
            # so the accumulated gradients are the whole batch's.
            output = state.loss_fn(output, state.target_chunks[microbatch]) / state.num_microbatches
            state.loss += output.detach()
    _synchronize(stage.device)
    end = time.perf_counter()
    if not stage.is_last:
        # detach: the next stage gets the values; the graph to this output stays here, for the backward.
        state.send(output.detach(), dst=stage.rank + 1, what="activations", microbatch=microbatch)
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
        # The next stage must receive this micro-batch's activations before their gradient can come back, so
        # waiting for that send here adds no dependency; it drops the send's hold on them before the backward frees
        # the rest. torch's Schedule1F1B waits no later: every forward send has finished before its next backward
        # (in steady state it batches the latest forward's send, a later micro-batch's, with this backward's
        # gradient receive and waits for both).
        state.wait_for_send("activations", microbatch)
        output_grad = torch.empty(state.microbatch_shape_out, device=stage.device)
        dist.recv(output_grad, src=stage.rank + 1)
        state.memory.hold(output_grad, output_grad)
    _synchronize(stage.device)
    start = time.perf_counter()
    torch.autograd.backward(output, grad_tensors=output_grad)
    _synchronize(stage.device)
    end = time.perf_counter()
    if not stage.is_first:
        # One gradient send pending at a time: the previous one had this backward's computation to complete
        # (torch's Schedule1F1B waits no later: in steady state before the next forward, in cool-down here).
        state.wait_for_sends("gradients")
        state.send(X.grad, dst=stage.rank - 1, what="gradients", microbatch=microbatch)
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
    work and the one optimizer step are GPipe's, and so is the bubble on equal stages; on unequal stages 1F1B can
    idle less (lesson 11, section 3). Arguments and result as ``naive``.
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


def schedule_order(schedule: str, rank: int, num_stages: int, num_microbatches: int = 1) -> list[tuple[str, int]]:
    """The events rank ``rank`` runs under ``schedule`` (a name in ``SCHEDULES``), in order, as ``(kind,
    micro-batch)`` pairs: what the schedule functions above do, written down without running them.

    ``naive``: ``[("F", 0), ("B", 0)]``. ``gpipe``: every forward, then every backward, the last micro-batch's
    first. ``1f1b``: ``min(p - r - 1, m)`` warm-up forwards, then one forward and one backward in turn, then the
    backwards left. The figures and the replay of a schedule (``common.experiments.pipeline.replay``) read it; a
    test checks it against the events that the schedules record.
    """
    if schedule == "naive":
        return [(FORWARD, 0), (BACKWARD, 0)]
    forwards = [(FORWARD, microbatch) for microbatch in range(num_microbatches)]
    if schedule == "gpipe":
        return forwards + [(BACKWARD, microbatch) for microbatch in reversed(range(num_microbatches))]
    if schedule != "1f1b":
        raise ValueError(f"unknown schedule {schedule!r}: pick one of {sorted(SCHEDULES)}")
    warmup = min(num_stages - rank - 1, num_microbatches)
    order = forwards[:warmup]
    for microbatch in range(num_microbatches - warmup):
        order += [forwards[warmup + microbatch], (BACKWARD, microbatch)]
    return order + [(BACKWARD, microbatch) for microbatch in range(num_microbatches - warmup, num_microbatches)]


def bubble_fraction_formula(num_stages: int, num_microbatches: int, stages_per_rank: int = 1) -> float:
    """The fraction of a pipelined step that each stage spends idle: ``(p - 1) / (m + p - 1)`` (GPipe's paper).

    With equal stages, a micro-batch's forward taking ``t_f`` and its backward ``t_b`` on every stage (messages
    free), a stage is busy ``m (t_f + t_b)`` per step; stage r waits ``r t_f`` at the start, ``(p - 1 - r)(t_f +
    t_b)`` in the middle and ``r t_b`` at the end, ``(p - 1)(t_f + t_b)`` in all (Narayanan et al. 2021, "Efficient
    Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", section 2.2.1), so the step lasts
    ``(m + p - 1)(t_f + t_b)``, whatever the ratio of ``t_b`` to ``t_f``. GPipe and 1F1B share it on equal stages;
    ``m = 1`` is the naive schedule's ``(p - 1) / p``. ``num_stages`` is ``p``, the number of ranks in the pipeline.

    ``stages_per_rank`` (``v``): interleaved 1F1B (the same paper, section 2.2.2) gives each rank ``v`` smaller
    stages, so filling and draining the pipeline takes ``(p - 1)(t_f + t_b) / v``: idle ``(p - 1) / (v m)`` of the
    work, the paper's figure, and ``(p - 1) / (v m + p - 1)`` of the step, returned here.
    """
    fill_and_drain = (num_stages - 1) / stages_per_rank
    return fill_and_drain / (num_microbatches + fill_and_drain)


def measured_bubble_fraction(records: list[dict]) -> float:
    """The measured fraction of the step that the stages spent idle, from every rank's record of one step.

    The step's span runs from the first event's start on any rank to the last event's end on any rank. A rank's
    busy time is the sum of its events' durations (computation only: the events exclude waiting for messages, and
    sending is asynchronous); its idle fraction is ``1 - busy / span``. The result is the mean over ranks, which is
    what ``bubble_fraction_formula`` predicts when stages are equal and messages free. Real stages are not equal
    (DeepMLP's first and last stages hold the larger layers and the loss) and messages take time, so the measured
    fraction usually sits above the formula's, the more so as micro-batches shrink: each message costs about the
    same time however small, and a smaller micro-batch computes for less (notebooks/11_pipeline_parallelism.ipynb
    measures it for m = 1 to 16 on two CPU cores with gloo). Unequal stages can also bring 1F1B's below it: with a
    slower first stage, 1F1B at m = 2 measured 0.30 against the formula's 0.33 there.

    The ranks' times are comparable because ``time.perf_counter`` reads the machine's monotonic clock on Linux,
    shared by the processes on one machine; records from several machines would not share a time axis.
    """
    events = [event for record in records for event in record["events"]]
    if not events:
        raise ValueError("the records hold no events")
    span = max(event["end"] for event in events) - min(event["start"] for event in events)
    idle = [1 - sum(event["end"] - event["start"] for event in record["events"]) / span for record in records]
    return sum(idle) / len(idle)
