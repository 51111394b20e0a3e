"""Profiling a training step (lesson 09): where its time goes, and how much of its communication is hidden.

Every step is cut into four labelled regions, ``REGIONS``, each inside ``torch.profiler.record_function``:

    regions = StepRegions(device)
    profiler = training_profiler(trace_dir, rank, wait=1, warmup=1, active=3, device=device)
    with profiler:
        for X, y in batches:
            with regions("data"): ...          # next batch, copy to the device
            with regions("forward"): ...
            with regions("backward"): ...      # DDP all-reduces its buckets during this
            with regions("optimizer"): ...
            regions.end_step()
            profiler.step()

- ``StepRegions`` times the regions with a wall clock, every step, for almost nothing: ``summary()``.
- ``training_profiler`` records a few steps and writes one Chrome trace per rank (``rank0.json``...), which
  https://ui.perfetto.dev, chrome://tracing and HTA open; ``check_profile_settings`` refuses, before training,
  settings that would leave no trace.
- ``step_breakdowns`` reads a trace back: per step the regions, the communication, and the part of it that
  nothing hid (exposed), and the computation's busy time. ``bottleneck`` names the largest of data loading,
  exposed communication, compute and overhead (the rest: idle gaps, launches).
- ``hta_breakdown``: Holistic Trace Analysis' view of GPU traces (HTA reads no CPU-only trace).
- ``training_flops``, ``profiled_flops`` and ``model_flops_utilization``: how much arithmetic a step does, by the
  6 x parameters x tokens estimate or by the profiler's count, and what share of the device's peak that is (MFU).
"""

import gzip
import json
import os
from contextlib import contextmanager
from pathlib import Path
from time import perf_counter

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from common.data import ConfigurationError
from common.metrics import synchronize

REGIONS = ("data", "forward", "backward", "optimizer")
COMMUNICATION_MARKS = ("gloo", "nccl", "c10d::", "record_param_comms")  # names of the process group's work


class StepRegions:
    """Wall-clock time of each region of every training step, and of the whole step.

    ``regions(name)`` is a context manager: the region shows in a profiler trace under ``name`` and its time
    (``time.perf_counter``) adds to this step's. ``end_step()`` closes the step. ``rows`` holds one dict per step:
    ``data_ms``..., ``step_ms`` (from the previous ``end_step``, or from the first region of the first step) and
    ``other_ms`` (the step minus its regions: the loop itself, ``profiler.step()``, waiting for the device).
    """

    def __init__(self, device, skip_steps: int = 1):
        self.device = torch.device(device)
        self.skip_steps = skip_steps  # the first steps pay for warm-up (allocations, DDP's bucket rebuild)
        self.rows = []
        self._seconds = dict.fromkeys(REGIONS, 0.0)
        self._step_start = None

    @contextmanager
    def __call__(self, name: str):
        if name not in REGIONS:
            raise ValueError(f"unknown region {name!r}; the regions are {', '.join(REGIONS)}")
        start = perf_counter()
        if self._step_start is None:
            self._step_start = start
        with record_function(name):
            yield
        self._seconds[name] += perf_counter() - start

    def end_step(self) -> None:
        """Close this step: wait for the device (CUDA runs behind Python), record the step's times."""
        synchronize(self.device)
        now = perf_counter()
        row = {f"{name}_ms": 1000 * seconds for name, seconds in self._seconds.items()}
        start = now if self._step_start is None else self._step_start  # a step with no region: 0 ms
        row["step_ms"] = 1000 * (now - start)
        row["other_ms"] = row["step_ms"] - sum(row[f"{name}_ms"] for name in REGIONS)
        self.rows.append(row)
        self._seconds = dict.fromkeys(REGIONS, 0.0)
        self._step_start = now

    def summary(self) -> dict:
        """Mean milliseconds per step of each region, ``step_ms`` and ``other_ms``, over the steps after the first
        ``skip_steps`` (over every step while there are no more); ``steps`` says how many."""
        rows = self.rows[self.skip_steps :] or self.rows
        if not rows:
            raise ValueError("no step to summarize: call end_step() after each step")
        return mean_breakdown(rows)


def check_profile_settings(trace_dir, wait: int, warmup: int, active: int, steps_available: int) -> Path:
    """Refuse at once, before any training, profiler settings that cannot give a trace; return ``trace_dir``,
    created. ``steps_available``: the steps this run will train, on every rank."""
    if active < 1:
        raise ConfigurationError(f"error: the profiler must record at least 1 step, not {active}")
    if wait < 0 or warmup < 0:
        raise ConfigurationError(f"error: the profiler's wait ({wait}) and warm-up ({warmup}) steps cannot be < 0")
    needed = wait + warmup + active
    if needed > steps_available:
        raise ConfigurationError(
            f"error: the profiler needs {needed} steps ({wait} wait + {warmup} warm-up + {active} recorded), the run "
            f"has only {steps_available}: lower --profile-steps or raise --max-batches-per-epoch/--epochs"
        )
    trace_dir = Path(trace_dir)
    if trace_dir.is_file():
        raise ConfigurationError(f"error: the trace folder {trace_dir} is a file; name a folder")
    probe = trace_dir / f".write-probe-{os.getpid()}"  # one per process: ranks probe the same folder together
    try:
        trace_dir.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise ConfigurationError(f"error: cannot write traces to {trace_dir}: {error}") from None
    return trace_dir


def training_profiler(trace_dir, rank: int, wait: int, warmup: int, active: int, device) -> profile:
    """A ``torch.profiler.profile`` that skips ``wait`` steps, runs unrecorded for ``warmup`` (its own start-up
    costs), records ``active`` steps once, and writes them to ``trace_dir/rank{rank}.json``. Call
    ``profiler.step()`` after every step. CUDA activity (kernels) is recorded too on a GPU."""
    activities = [ProfilerActivity.CPU]
    if torch.device(device).type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    path = Path(trace_dir) / f"rank{rank}.json"
    return profile(
        activities=activities,
        schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
        on_trace_ready=lambda profiler: profiler.export_chrome_trace(str(path)),
    )


def load_trace(path) -> dict:
    """A Chrome trace (``.json`` or ``.json.gz``) as a dict; its events are under ``"traceEvents"``."""
    with (gzip.open if str(path).endswith(".gz") else open)(path, "rt") as file:
        return json.load(file)


def step_breakdowns(trace: dict) -> list[dict]:
    """One dict per profiled step of ``trace``: where its time went, in milliseconds.

    A step is one data, forward, backward, optimizer sequence of ``StepRegions``' labels on the thread that
    carries them. ``step_ms`` runs from the start of its data region to the end of its optimizer region;
    ``data_ms``... are the labels' durations; ``other_ms`` is the step minus the four. Within the step:

    - ``communication_ms``: the time during which at least one communication was running (the union of their
      intervals). On a CPU, gloo's ``gloo:*`` spans on its own threads, within the backward region (DDP's
      backward returns only once every bucket's all-reduce has completed: the step waits for nothing after);
      on a GPU, NCCL kernels, within the step.
    - ``exposed_communication_ms``: the part of that time during which no computation ran, the time that
      communication added to the step. Computation, on a CPU: any op of the main thread other than communication
      and waiting, outside the communication calls it encloses (``c10d::allreduce_`` enqueues an all-reduce, and
      the autograd node whose hook called it is not computing meanwhile); on a GPU: any kernel other than NCCL's.
    - ``overlap``: 1 - exposed / communication, the share of communication hidden (None without communication).
    - ``compute_ms``: the time computation ran in the step (the union of its intervals, as above), outside the
      data region; ``bottleneck`` calls what is left after data, exposed communication and this "overhead".
    - ``all_reduces``: on a CPU, ``c10d::allreduce_`` calls (DDP: one per bucket); on a GPU, NCCL AllReduce kernels.
    - ``device``: ``"cuda"`` when the trace holds kernels, else ``"cpu"``.

    On a GPU the regions are still the CPU's labels (the time to queue their work, plus any wait), and a step
    ends when its optimizer label does or when the last kernel that started before the next step ends, if later
    (``StepRegions.end_step`` waits for it). Timestamps are in microseconds in the trace.
    """
    events = [event for event in trace["traceEvents"] if event.get("ph") == "X" and "dur" in event]
    on_gpu = any(event.get("cat") == "kernel" for event in events)
    labels = [event for event in events if event.get("cat") == "user_annotation" and event["name"] in REGIONS]
    if not labels:
        raise ValueError(f"no {'/'.join(REGIONS)} labels in this trace: time the steps with StepRegions")
    main_thread = labels[0]["tid"]
    labels = sorted((event for event in labels if event["tid"] == main_thread), key=lambda event: event["ts"])
    steps = [labels[i : i + 4] for i in range(len(labels) - 3)]
    steps = [step for step in steps if tuple(event["name"] for event in step) == REGIONS]

    if on_gpu:
        kernels = [event for event in events if event.get("cat") == "kernel"]
        nccl = [kernel for kernel in kernels if "nccl" in kernel["name"].lower()]
        communication = [_interval(kernel) for kernel in nccl]
        computation = [_interval(kernel) for kernel in kernels if "nccl" not in kernel["name"].lower()]
        all_reduce_starts = [kernel["ts"] for kernel in nccl if "allreduce" in kernel["name"].lower()]
    else:
        main_ops = [event for event in events if event.get("cat") == "cpu_op" and event["tid"] == main_thread]
        communication = [_interval(event) for event in events if event["name"].startswith("gloo:")]
        # An op that encloses an enqueue or a wait (the autograd node whose hook started a bucket) computes only
        # outside it: the main thread's communication calls are cut out of the computation.
        computation = _subtract(
            _union(_interval(op) for op in main_ops if not _is_communication(op["name"])),
            _union(_interval(op) for op in main_ops if _is_communication(op["name"])),
        )
        all_reduce_starts = [op["ts"] for op in main_ops if op["name"] == "c10d::allreduce_"]

    rows = []
    for i, step in enumerate(steps):
        start, end = step[0]["ts"], _interval(step[-1])[1]
        if on_gpu:  # the device may still be running the step's kernels when its optimizer label ends
            before_next = steps[i + 1][0]["ts"] if i + 1 < len(steps) else float("inf")
            end = max([end] + [e for s, e in computation + communication if start <= s < before_next])
        row = {"step_ms": (end - start) / 1000}
        row.update({f"{event['name']}_ms": event["dur"] / 1000 for event in step})
        row["other_ms"] = row["step_ms"] - sum(event["dur"] for event in step) / 1000
        # On a CPU the step waits for communication only inside backward: DDP's backward returns once every
        # bucket's all-reduce has completed; gloo's span may go on after (the rank has its result by then).
        window = (start, end) if on_gpu else _interval(step[2])
        # BEGIN LAB: communication in the step, the part no computation hid
        # _clip to the window, _union the intervals, _covered: how much of one union lies inside another
        communicating = _union(_clip(communication, *window))
        hidden = _covered(communicating, _union(_clip(computation, *window)))
        row["communication_ms"] = _length(communicating) / 1000
        row["exposed_communication_ms"] = (_length(communicating) - hidden) / 1000
        row["overlap"] = hidden / _length(communicating) if communicating else None
        # END LAB
        # The computation's own busy time in the step, outside the data region (which data_ms counts): the step's
        # time that is neither this, data nor exposed communication is idle gaps and overhead (launching kernels,
        # Python between ops), which a wall clock alone cannot tell from computing.
        data_region = [_interval(event) for event in step if event["name"] == "data"]
        row["compute_ms"] = _length(_subtract(_union(_clip(computation, start, end)), data_region)) / 1000
        row["all_reduces"] = sum(start <= ts < end for ts in all_reduce_starts)
        row["device"] = "cuda" if on_gpu else "cpu"
        rows.append(row)
    return rows


def _is_communication(name: str) -> bool:
    name = name.lower()
    return "wait" in name or any(mark in name for mark in COMMUNICATION_MARKS)


def _interval(event: dict) -> tuple[float, float]:
    return event["ts"], event["ts"] + event["dur"]


def _clip(intervals, start: float, end: float) -> list[tuple[float, float]]:
    return [(max(s, start), min(e, end)) for s, e in intervals if s < end and e > start]


def _union(intervals) -> list[tuple[float, float]]:
    """Sorted, non-overlapping intervals covering exactly the same time as ``intervals``."""
    merged = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def _subtract(intervals, cut) -> list[tuple[float, float]]:
    """The parts of ``intervals`` outside ``cut`` (both unions)."""
    left = []
    for s, e in intervals:
        for cs, ce in cut:
            if cs < e and ce > s:  # the cut overlaps what is left of (s, e): keep the piece before it
                if cs > s:
                    left.append((s, cs))
                s = max(s, ce)
        if s < e:
            left.append((s, e))
    return left


def _length(intervals) -> float:
    return sum(e - s for s, e in intervals)


def _covered(intervals, cover) -> float:
    """How much of ``intervals`` lies inside ``cover`` (both unions)."""
    return sum(max(0.0, min(e, ce) - max(s, cs)) for s, e in intervals for cs, ce in cover)


def mean_breakdown(rows: list[dict]) -> dict:
    """The mean of every numeric key over ``rows``, and ``steps``: how many. ``overlap`` is recomputed from the
    mean communication and exposed communication, so that long steps weigh more than short ones."""
    keys = [key for key, value in rows[0].items() if isinstance(value, (int, float)) and key != "overlap"]
    mean = {key: sum(row[key] for row in rows) / len(rows) for key in keys}
    if "communication_ms" in mean:
        communicating = mean["communication_ms"]
        mean["overlap"] = 1 - mean["exposed_communication_ms"] / communicating if communicating else None
    return {**mean, "steps": len(rows)}


def bottleneck(breakdown: dict) -> str:
    """``"data loading"``, ``"communication"``, ``"compute"`` or ``"overhead"``: which takes the most of a step.

    Communication counts only where exposed. With ``compute_ms`` (a ``step_breakdowns`` row or their
    ``mean_breakdown``: the ops or kernels measured busy), compute is that, and overhead the rest of the step:
    idle gaps, kernel launches, Python between ops, the device waiting for the host. Without it
    (``StepRegions.summary()``: a wall clock, no communication measured either), compute is the whole rest of the
    step, overhead included: the clock cannot tell them apart."""
    data = breakdown["data_ms"]
    communication = breakdown.get("exposed_communication_ms", 0.0)
    rest = breakdown["step_ms"] - data - communication
    parts = {"data loading": data, "communication": communication, "compute": rest}
    if "compute_ms" in breakdown:
        parts["compute"] = min(breakdown["compute_ms"], rest)
        parts["overhead"] = rest - parts["compute"]
    return max(parts, key=parts.get)


def hta_breakdown(trace_dir) -> dict:
    """Holistic Trace Analysis on the GPU traces in ``trace_dir`` (one per rank, the rank in their
    ``distributedInfo``, as ``training_profiler`` writes them): per rank, HTA's temporal breakdown (idle,
    compute and non-compute kernel time, in us and %) and its communication/computation overlap (%)."""
    paths = sorted(Path(trace_dir).glob("*.json")) + sorted(Path(trace_dir).glob("*.json.gz"))
    if not paths:
        raise ValueError(f"no trace (.json, .json.gz) in {trace_dir}")
    if not any(any(e.get("cat") == "kernel" for e in load_trace(path)["traceEvents"]) for path in paths):
        raise ValueError(
            f"no GPU kernel in the traces in {trace_dir}: HTA analyses GPU traces; use step_breakdowns for CPU/gloo"
        )
    from hta.trace_analysis import TraceAnalysis

    # HTA leaves out the last ProfilerStep by default; the steps training_profiler records are all complete
    analysis = TraceAnalysis(trace_dir=str(trace_dir), include_last_profiler_step=True)
    temporal = analysis.get_temporal_breakdown(visualize=False).set_index("rank")
    overlap = analysis.get_comm_comp_overlap(visualize=False).set_index("rank")
    return {
        int(rank): {key: float(value) for key, value in {**temporal.loc[rank], **overlap.loc[rank]}.items()}
        for rank in temporal.index
    }


def training_flops(parameters: int, tokens: int) -> int:
    """The usual estimate of the floating-point operations of one training step: 6 x parameters x tokens.

    Forward multiplies every weight by every input once and adds the product: 2 operations per parameter and token.
    Backward does it twice: once for the gradient of the input, once for the gradient of the weight, 4 more (Kaplan
    et al. 2020, "Scaling laws for neural language models", section 2.1). It counts the matrix products of dense
    (Linear) layers only, each weight used once per token: for an MLP a sample is one token. It does not hold for
    a convolution, which uses each weight once per output position: count 2 x weights x output positions per
    sample for its forward, and 3 times that for a step. Attention's own products (scores, weighted values) are
    left out too. The first layer's input needs no gradient, so a profiler's count of an MLP comes out slightly
    lower (tests/test_profiling.py shows by how much).
    """
    return 6 * parameters * tokens


def profiled_flops(profiler: profile) -> int:
    """The floating-point operations the profiler counted over the steps it recorded: the sum of ``flops`` over
    ``key_averages()``. Needs ``profile(..., with_flops=True)``. PyTorch 2.14.1 has a formula for aten::mm, addmm,
    bmm and baddbmm, for aten::conv2d's forward, and for aten::mul and aten::add (one per element); every other op
    counts zero, convolution backward among them. So on a CNN this misses the backward's convolutions: take the
    forward's count times 3 for a step instead."""
    return sum(event.flops for event in profiler.key_averages())


def model_flops_utilization(flops_per_step: float, step_seconds: float, peak_flops_per_second: float) -> float:
    """Model FLOPs utilisation (MFU, as Chowdhery et al. 2022, "PaLM", define it): the achieved rate, flops per step
    over seconds per step, as a share of the device's peak rate for the precision used (the vendor's data sheet:
    dense, not the sparse figure). 0.4 means 40% of the peak. Throughput and MFU rise together; a GPU that NVML
    reports 100% busy can still be at a few percent MFU."""
    if step_seconds <= 0 or peak_flops_per_second <= 0:
        raise ValueError(f"step_seconds ({step_seconds}) and the peak ({peak_flops_per_second}) must be positive")
    return flops_per_step / step_seconds / peak_flops_per_second


def key_averages_table(profiler: profile, device, rows: int = 12) -> str:
    """The profiled ops that took the most time, one line each: sorted by self time on the device on a GPU
    (kernels run asynchronously: their CPU time is only the launch), by self CPU time on a CPU."""
    on_gpu = torch.device(device).type == "cuda"
    sort_by = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    return profiler.key_averages().table(sort_by=sort_by, row_limit=rows)


def plot_breakdown(rows_by_label: dict, path, title: str = "Mean time per training step, by region") -> None:
    """A stacked horizontal bar per label (a rank, a setting) of ``data``, ``forward``, ``backward``, ``optimizer``
    and ``other`` ms, to the PNG ``path``. Exposed communication, when measured, is hatched at the end of the backward
    bar: its length is measured, its place is only a convention (in a real step it can fall anywhere in backward)."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 1.2 + 0.5 * len(rows_by_label)), layout="constrained")
    axes = figure.subplots()
    labels, rows = list(rows_by_label), list(rows_by_label.values())
    left = [0.0] * len(rows)
    for part in (*REGIONS, "other"):
        widths = [row[f"{part}_ms"] for row in rows]
        axes.barh(labels, widths, left=left, label=part)
        left = [start + width for start, width in zip(left, widths)]
        if part == "backward":
            exposed = [min(row.get("exposed_communication_ms", 0.0), width) for row, width in zip(rows, widths)]
            ends_at = [end - width for end, width in zip(left, exposed)]
            axes.barh(labels, exposed, left=ends_at, fill=False, hatch="//", label="exposed communication")
    axes.set(xlabel="ms per step", title=title)
    axes.invert_yaxis()  # the first label on top
    axes.legend(loc="upper left", bbox_to_anchor=(1, 1))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
