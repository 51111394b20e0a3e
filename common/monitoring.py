"""Watch a run from the side (lesson 09): device use sampled by a thread, per-rank summaries, TensorBoard scalars.

A profiler explains a few steps in detail; monitoring watches the whole run cheaply. ``DeviceMonitor`` samples,
every ``interval_s``, how busy the device is and how much memory it holds, from a daemon thread, so that the
training loop only pays for the cheap reads:

    with DeviceMonitor(env.device) as monitor:
        train(...)
    print0(format_summaries(gather_summaries(monitor.summary())))   # a collective: every rank calls it

On a GPU it asks NVML (``nvidia-ml-py``, ``import pynvml``, what ``nvidia-smi`` reads): the share of time a kernel
ran and the memory used on the whole GPU (other processes' too, and the caching allocator's reserve), beside what
this process's tensors hold (``torch.cuda.memory_allocated``; the allocator's statistics sit behind a lock, so
reading them from another thread is safe). On a CPU, or where NVML cannot start, it samples this process with
psutil: CPU use as a share of all the machine's cores, and resident memory. ``TrainingLog`` writes scalars for
TensorBoard from global rank 0 only; ``read_scalars`` reads them back.
"""

import contextlib
import os
import threading
import time
from pathlib import Path

import psutil
import pynvml
import torch
import torch.distributed as dist

from common.distributed import ConfigurationError, is_main

MIB = 2**20
CPU_INSTEAD = "monitoring this process's CPU use and memory instead"


def _nvml_handle(device: torch.device):
    """NVML's handle for a CUDA device, found by its UUID: CUDA numbers the GPUs it sees after
    ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER``, NVML numbers all of them, in PCI order."""
    uuid = str(torch.cuda.get_device_properties(device).uuid)  # PyTorch prints it without NVML's "GPU-"
    return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")


class DeviceMonitor:
    """Sample ``device``'s utilisation and memory every ``interval_s`` seconds, in a daemon thread, inside a ``with``.

    ``samples`` holds one dict per reading: ``time_s`` (since entering), ``utilization_percent`` (0-100),
    ``memory_mib``, ``kind`` (``"gpu"``: NVML; ``"cpu"``: this process, psutil) and, on a GPU,
    ``allocated_mib``. ``note`` says what is measured when it is not the GPU, and why sampling stopped early if
    it did: a failing read ends the sampling, never the training.
    """

    def __init__(self, device: torch.device, interval_s: float = 0.5):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, not {interval_s}")
        self.device = torch.device(device)
        self.interval_s = interval_s
        self.samples: list[dict] = []
        self.kind = "cpu"
        self.note = ""
        self._handle = None
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread = None
        self._failed = False
        self._start = 0.0  # perf_counter() on entering: samples' time_s counts from there

    def __enter__(self) -> "DeviceMonitor":
        if self.device.type == "cuda":
            self._start_nvml()
        else:
            self.note = "device cpu: this process's CPU use and memory (NVML measures NVIDIA GPUs only)"
        if self.kind == "cpu":
            self._process.cpu_percent()  # the first call only starts the count: it returns 0.0
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="DeviceMonitor", daemon=True)
        self._thread.start()
        return self

    def _start_nvml(self) -> None:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound:
            self.note = f"no NVIDIA driver (NVML library not found): {CPU_INSTEAD}"
            return
        except pynvml.NVMLError as error:
            self.note = f"NVML did not start ({error}): {CPU_INSTEAD}"
            return
        try:
            self._handle = _nvml_handle(self.device)
            self.kind = "gpu"
        except Exception as error:  # NVML found no such GPU, or CUDA cannot say which one it is
            pynvml.nvmlShutdown()
            self.note = f"NVML has no handle for {self.device} ({error}): {CPU_INSTEAD}"

    def _run(self) -> None:
        # wait() returns True when __exit__ sets the event: stop at once instead of sleeping out the interval.
        while not self._stop.wait(self.interval_s) and self._sample():
            pass

    def _sample(self) -> bool:
        """Append one reading; on failure, record why in ``note`` and return False (sampling ends)."""
        now = time.perf_counter() - self._start
        try:
            if self.kind == "gpu":
                reading = {
                    "utilization_percent": float(pynvml.nvmlDeviceGetUtilizationRates(self._handle).gpu),
                    "memory_mib": pynvml.nvmlDeviceGetMemoryInfo(self._handle).used / MIB,
                    "allocated_mib": torch.cuda.memory_allocated(self.device) / MIB,
                }
            else:
                with self._process.oneshot():  # one read of /proc for both figures
                    share = self._process.cpu_percent() / psutil.cpu_count()  # cpu_percent: % of ONE core
                    rss = self._process.memory_info().rss
                reading = {"utilization_percent": min(share, 100.0), "memory_mib": rss / MIB}
        except Exception as error:  # a monitor must never take the training down with it
            self._failed = True
            self._add_note(f"sampling ended after {now:.1f} s ({type(error).__name__}: {error})")
            return False
        self.samples.append({"time_s": now, **reading, "kind": self.kind})
        return True

    def _add_note(self, text: str) -> None:
        self.note = f"{self.note}; {text}" if self.note else text

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)  # it wakes at once from its wait; a sample takes microseconds
        if self._thread.is_alive():  # stuck in a driver call: leave the daemon thread, and NVML, alone
            self._add_note("the sampling thread did not stop")
            return
        if not self._failed:
            self._sample()  # the stretch since the last reading
        if self.kind == "gpu":
            with contextlib.suppress(pynvml.NVMLError):  # a lost GPU may refuse this too; the run is over anyway
                pynvml.nvmlShutdown()

    @property
    def running(self) -> bool:
        """True while the sampling thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def summary(self) -> dict:
        """``kind``, ``device``, ``samples`` (count), mean and max ``utilization_percent``, ``peak_memory_mib``
        and ``note``; the figures are ``None`` without samples."""
        samples = list(self.samples)  # a copy: the thread may append meanwhile
        utilization = [sample["utilization_percent"] for sample in samples]
        return {
            "kind": self.kind,
            "device": str(self.device),
            "samples": len(samples),
            "mean_utilization_percent": sum(utilization) / len(samples) if samples else None,
            "max_utilization_percent": max(utilization, default=None),
            "peak_memory_mib": max((sample["memory_mib"] for sample in samples), default=None),
            "note": self.note,
        }


def gather_summaries(summary: dict) -> list[dict]:
    """Every rank's ``summary``, in rank order, on every rank (a collective: call it on all ranks).
    Without a process group: ``[summary]``."""
    if not (dist.is_available() and dist.is_initialized()):
        return [summary]
    summaries = [None] * dist.get_world_size()
    dist.all_gather_object(summaries, summary)
    return summaries


def format_summaries(summaries: list[dict]) -> str:
    """A table of ``gather_summaries``' result, one row per rank, then each different note once with its ranks."""

    def number(value):
        return "-" if value is None else f"{value:.1f}"

    lines = [f"{'rank':>4}  {'kind':<4}  {'samples':>7}  {'mean util %':>11}  {'max util %':>10}  {'peak MiB':>9}"]
    for rank, s in enumerate(summaries):
        lines.append(
            f"{rank:>4}  {s['kind']:<4}  {s['samples']:>7}  {number(s['mean_utilization_percent']):>11}  "
            f"{number(s['max_utilization_percent']):>10}  {number(s['peak_memory_mib']):>9}"
        )
    notes = {}  # each different note once, with the ranks that gave it
    for rank, s in enumerate(summaries):
        notes.setdefault(s["note"], []).append(str(rank))
    lines += [f"rank {', '.join(ranks)}: {note}" for note, ranks in notes.items() if note]
    return "\n".join(lines)


def check_log_dir(path) -> Path:
    """Create the folder ``path`` if needed and return it; a ``ConfigurationError`` now if it cannot be written,
    rather than an error at the first scalar, minutes into a run."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigurationError(f"error: log folder {path} is a file; choose a folder for TensorBoard's event files")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigurationError(f"error: cannot create log folder {path}: {error}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigurationError(f"error: log folder {path} is not writable; choose another one")
    return path


class TrainingLog:
    """Scalars for TensorBoard (``tensorboard --logdir LOG_DIR``), written by global rank 0 only.

    On other ranks, and when ``log_dir`` is ``None``, every call does nothing, so a script calls it on every rank
    without an ``if``. Log figures that are already the same on every rank (all-reduced), or rank 0's own.

        with TrainingLog(args.log_dir) as log:
            log.log(step, {"loss/train": loss, "throughput/samples_per_s": rate})
    """

    def __init__(self, log_dir: Path | None):
        self.writer = None
        if log_dir is not None and is_main():
            from torch.utils.tensorboard import SummaryWriter  # only where it writes: it is slow to import

            self.writer = SummaryWriter(log_dir=str(check_log_dir(log_dir)))

    def log(self, step: int, values: dict[str, float]) -> None:
        """Write each ``{tag: value}`` at ``step``; a tag's ``/`` groups its charts (``loss/train``, ``loss/test``)."""
        if self.writer is not None:
            for tag, value in values.items():
                self.writer.add_scalar(tag, float(value), global_step=step)

    def close(self) -> None:
        """Flush the events to disk and close the file. Safe to call twice."""
        if self.writer is not None:
            self.writer.close()  # flushes first
            self.writer = None

    def __enter__(self) -> "TrainingLog":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def read_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar under ``log_dir``, read back through TensorBoard's own reader: ``{tag: [(step, value), ...]}``.
    Values come back as float32, which is how event files store them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every point, not a sample
    events.Reload()
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
