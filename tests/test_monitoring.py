"""``common.monitoring``: the sampling thread measures what the process does and stops cleanly, an NVML failure ends
sampling with a note instead of an exception, summaries travel to every rank, and TensorBoard scalars come from
rank 0 only and read back exactly."""

import time
from types import SimpleNamespace

import psutil
import pynvml
import pytest
import torch

from common import monitoring
from common.distributed import ConfigurationError
from common.launch import run_on_ranks
from common.monitoring import (
    MIB,
    DeviceMonitor,
    TrainingLog,
    check_log_dir,
    format_summaries,
    gather_summaries,
    read_scalars,
)


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(1000))


def phase(monitor, action) -> tuple[list[dict], float]:
    """The samples taken during ``action()``, less the first, which may straddle the previous phase, and the CPU
    share that the process really used meanwhile (% of all cores), from the kernel's count of its CPU time."""
    first, cpu, wall = len(monitor.samples), time.process_time(), time.perf_counter()
    action()
    share = 100 * (time.process_time() - cpu) / (time.perf_counter() - wall) / psutil.cpu_count()
    return monitor.samples[first + 1 :], share


@pytest.mark.timeout(30)
def test_the_cpu_monitor_sees_a_busy_loop_and_the_memory_it_holds_then_stops_cleanly():
    with DeviceMonitor(torch.device("cpu"), interval_s=0.1) as monitor:
        idle, _ = phase(monitor, lambda: time.sleep(1.2))
        held = []
        busy_samples, busy_share = phase(monitor, lambda: (held.append(torch.ones(64 * MIB // 4)), busy(1.2)))
        rss_mib = psutil.Process().memory_info().rss / MIB
        assert monitor.running
    count = len(monitor.samples)

    assert len(idle) >= 5 and len(busy_samples) >= 5, monitor.samples
    for sample in monitor.samples:
        assert sample["kind"] == "cpu" and 0 <= sample["utilization_percent"] <= 100
    # One busy Python thread is up to 100 / cores percent of the machine (less on cores shared with other work,
    # which the kernel's count shows too); sleeping, close to nothing.
    idle_mean, busy_mean = (sum(s["utilization_percent"] for s in part) / len(part) for part in (idle, busy_samples))
    assert busy_mean > max(2 * idle_mean, idle_mean + 2), (idle, busy_samples)
    assert abs(busy_mean - busy_share) < 3 + 0.3 * busy_share, (busy_mean, busy_share)
    assert busy_samples[-1]["memory_mib"] > max(s["memory_mib"] for s in idle) + 50  # the 64 MiB tensor, touched
    assert abs(busy_samples[-1]["memory_mib"] - rss_mib) < 0.1 * rss_mib
    times = [sample["time_s"] for sample in monitor.samples]
    assert times == sorted(times) and times[-1] >= 2.4  # the last reading was taken on exit

    assert not monitor.running
    time.sleep(0.3)
    assert len(monitor.samples) == count  # nothing sampled after exit
    summary = monitor.summary()
    assert summary["kind"] == "cpu" and summary["samples"] == count and "NVML" in summary["note"]
    assert summary["max_utilization_percent"] >= summary["mean_utilization_percent"] > 0
    assert summary["peak_memory_mib"] == max(s["memory_mib"] for s in monitor.samples)


@pytest.mark.timeout(20)
def test_leaving_the_block_stops_the_thread_at_once_and_takes_a_last_sample():
    with DeviceMonitor(torch.device("cpu"), interval_s=30) as monitor:
        busy(0.3)
        assert monitor.samples == []  # the first reading is due in 30 s
        leaving = time.perf_counter()
    assert time.perf_counter() - leaving < 2 and not monitor.running  # no waiting out the interval
    [last] = monitor.samples
    assert 0.3 <= last["time_s"] < 2 and last["utilization_percent"] > 1  # the busy 0.3 s, read on exit


def nvml_starts() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


@pytest.mark.skipif(nvml_starts(), reason="NVML works here: the fallback needs a machine without an NVIDIA driver")
@pytest.mark.timeout(20)
def test_without_an_nvidia_driver_a_cuda_device_is_monitored_through_the_process_and_the_note_says_why():
    with DeviceMonitor(torch.device("cuda", 0), interval_s=0.05) as monitor:
        time.sleep(0.3)
    summary = monitor.summary()
    assert summary["kind"] == "cpu" and summary["samples"] >= 2 and summary["peak_memory_mib"] > 0
    assert summary["note"].startswith("no NVIDIA driver (NVML library not found)")


def test_the_gpu_is_found_by_its_uuid_not_by_an_index_that_nvml_numbers_differently(monkeypatch):
    """CUDA's device 0 is the GPU whose UUID torch reports; NVML is asked for that UUID, with NVML's "GPU-" prefix
    added where torch leaves it out, and never for an index (NVML counts GPUs in PCI order, CUDA after
    CUDA_VISIBLE_DEVICES)."""
    asked = []
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByUUID", lambda uuid: asked.append(uuid) or f"handle of {uuid}")
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda index: pytest.fail(f"asked for index {index}"))
    for reported, expected in [
        ("1b2c3d4e-0000-1111-2222-333344445555", "GPU-1b2c3d4e-0000-1111-2222-333344445555"),
        ("GPU-1b2c3d4e-0000-1111-2222-333344445555", "GPU-1b2c3d4e-0000-1111-2222-333344445555"),
        ("MIG-9f8e7d6c-0000-1111-2222-333344445555", "MIG-9f8e7d6c-0000-1111-2222-333344445555"),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid=reported))
        assert monitoring._nvml_handle(torch.device("cuda", 0)) == f"handle of {expected}"
    assert asked[-1] == "MIG-9f8e7d6c-0000-1111-2222-333344445555" and len(asked) == 3


@pytest.mark.timeout(20)
def test_an_nvml_failure_mid_run_ends_sampling_with_a_note_and_training_goes_on(monkeypatch):
    readings = iter([37, 38, 39])

    def utilization(handle):
        assert handle == "gpu-handle"
        reading = next(readings, None)
        if reading is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return SimpleNamespace(gpu=reading)

    shutdowns = []
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: shutdowns.append(True))
    monkeypatch.setattr(monitoring, "_nvml_handle", lambda device: "gpu-handle")
    monkeypatch.setattr(pynvml, "nvmlDeviceGetUtilizationRates", utilization)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", lambda handle: SimpleNamespace(used=1000 * MIB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 250 * MIB)

    with DeviceMonitor(torch.device("cuda", 0), interval_s=0.02) as monitor:
        deadline = time.monotonic() + 5
        while monitor.running and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not monitor.running  # the thread ended by itself, while "training" went on

    assert [s["utilization_percent"] for s in monitor.samples] == [37, 38, 39]  # no last sample after a failure
    assert {(s["kind"], s["memory_mib"], s["allocated_mib"]) for s in monitor.samples} == {("gpu", 1000, 250)}
    summary = monitor.summary()
    assert summary["kind"] == "gpu" and summary["mean_utilization_percent"] == 38 and summary["peak_memory_mib"] == 1000
    assert summary["note"].count("sampling ended") == 1 and "NVMLError_GpuIsLost: GPU is lost" in summary["note"]
    assert shutdowns == [True]


def monitor_gather_and_log(env, log_root):
    with DeviceMonitor(env.device, interval_s=0.05) as monitor:
        busy(0.3)
    with TrainingLog(log_root / f"rank{env.rank}") as log:  # a folder per rank: which ones wrote?
        for step in range(3):
            log.log(step, {"loss/train": 2.0 - step / 2, "throughput/samples_per_s": 100.0 * (step + 1)})
    return {"own": monitor.summary(), "gathered": gather_summaries(monitor.summary())}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    log_root = tmp_path_factory.mktemp("logs")
    return log_root, run_on_ranks(monitor_gather_and_log, 2, log_root, timeout=90)


@pytest.mark.timeout(120)
def test_every_rank_receives_every_ranks_summary(two_ranks):
    _, results = two_ranks
    own = [result["own"] for result in results]
    assert all(summary["kind"] == "cpu" and summary["samples"] >= 3 for summary in own)
    assert results[0]["gathered"] == own and results[1]["gathered"] == own
    table = format_summaries(own).splitlines()
    assert table[1].split()[:3] == ["0", "cpu", str(own[0]["samples"])]
    assert table[2].split()[:3] == ["1", "cpu", str(own[1]["samples"])]
    assert table[3] == f"rank 0, 1: {own[0]['note']}"  # the same note once, with both ranks


@pytest.mark.timeout(120)
def test_only_rank_0_writes_scalars(two_ranks):
    log_root, _ = two_ranks
    assert list((log_root / "rank0").glob("events.out.tfevents.*"))
    assert not (log_root / "rank1").exists()
    assert read_scalars(log_root / "rank0") == {
        "loss/train": [(0, 2.0), (1, 1.5), (2, 1.0)],
        "throughput/samples_per_s": [(0, 100.0), (1, 200.0), (2, 300.0)],
    }


def test_scalars_read_back_are_the_ones_written(tmp_path):
    values = [(step, 0.1 * step + 1 / 3) for step in range(0, 50, 5)]  # not exact in float32
    with TrainingLog(tmp_path / "run") as log:
        for step, value in values:
            log.log(step, {"loss/train": value, "memory/peak_mib": 512.0})
    scalars = read_scalars(tmp_path / "run")
    assert sorted(scalars) == ["loss/train", "memory/peak_mib"]
    assert [step for step, _ in scalars["loss/train"]] == [step for step, _ in values]
    expected = [torch.tensor(value, dtype=torch.float32).item() for _, value in values]  # event files hold float32
    assert [value for _, value in scalars["loss/train"]] == expected
    assert scalars["memory/peak_mib"] == [(step, 512.0) for step, _ in values]


def test_without_a_log_folder_logging_does_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with TrainingLog(None) as log:
        log.log(0, {"loss/train": 1.0})
        assert log.writer is None
    assert list(tmp_path.iterdir()) == []


def test_an_unusable_log_folder_is_refused_at_once(tmp_path):
    assert check_log_dir(tmp_path / "a" / "b") == tmp_path / "a" / "b" and (tmp_path / "a" / "b").is_dir()
    file = tmp_path / "file"
    file.write_text("")
    with pytest.raises(ConfigurationError, match="is a file"):
        check_log_dir(file)
    with pytest.raises(ConfigurationError, match="cannot create log folder"):
        TrainingLog(file / "run")  # a folder inside a file


def test_without_a_process_group_the_summary_is_gathered_alone():
    summary = {"kind": "cpu", "samples": 0}
    assert gather_summaries(summary) == [summary]
