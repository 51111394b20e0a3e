"""A data pipeline that starves training, and the loader options that feed it again, one at a time (lesson 09).

The data are scikit-learn's 1797 bundled digits, written once as PNG files in the layout that
``torchvision.datasets.ImageFolder`` reads (``<data_dir>/digits-png/{train,test}/<class>/<index>.png``), and read
back the way most image training reads: one file per sample, decoded by PIL, resized and augmented by a per-sample
``torchvision.transforms.v2`` pipeline in Python. ``read_latency_ms`` adds a sleep before every file is opened:
the time a sample takes to arrive from slow network storage (a shared file system, an object store).

Why a sleep: this machine has 2 cores and trains on 2 ranks, one core each. Worker processes cannot hide CPU work
here, decoding or augmenting, because there is no spare core for them to run on: what a worker decodes, its rank
does not compute meanwhile. What workers can hide on any machine is waiting, and the sleep is waiting. On a
machine with spare cores (a GPU server has dozens per GPU) the workers hide the decode too.

``LOADER_LADDER`` is the fix, step by step, as options of ``common.data.make_loader``; ``measure_loader`` times
one epoch of a loader against the training steps it feeds: where a step's time goes, waiting for data or
computing. ``benchmarks/data_loading.py`` climbs the ladder and prints a row per rung.
"""

import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from common.data import NUM_CLASSES, DataSplits, _read_digits, digits_test_mask
from common.distributed import ConfigurationError, main_process_first
from common.metrics import synchronize

FOLDER = "digits-png"
# Chosen by measurement (benchmarks/data_loading.py; LeNet, batch 64, one thread per process; 2 cores, shared with
# other work). A sample costs about 0.45 ms of decoding and augmenting, a step about 31 ms of computing alone
# (55 ms at 2 ranks, which share the cores). Without latency, the main process at 2 ranks waited 80 ms per step
# and computed 78: not clearly starved. With 2 ms per file it waits 190-230 ms against 75-90 ms of computing
# (71-72% of the step; 84% in one process). One worker then delivers a batch every 64 x (2 + 0.45) = ~160 ms;
# 6 workers deliver one every ~27 ms, faster than even one process computes (4 would need 40 ms). Measured at
# 2 ranks with 2, 4, 6 and 8 workers: 13, 4, 3 and 2 ms of waiting per step.
READ_LATENCY_MS = 2.0
WORKERS = 6

LOADER_LADDER = [
    ("decode in the main process", dict(num_workers=0)),
    ("+ worker processes", dict(num_workers=WORKERS, persistent_workers=False, prefetch_factor=2)),
    # Pinned (page-locked) host memory lets the copy to a GPU run asynchronously (non_blocking=True). Without an
    # accelerator, DataLoader (PyTorch 2.14.1) warns "'pin_memory' argument is set as true but no accelerator is
    # found" and does not pin: on a CPU this rung is the rung before it.
    (
        "+ pinned memory, non_blocking copies",
        dict(num_workers=WORKERS, persistent_workers=False, prefetch_factor=2, pin_memory=True),
    ),
    # Without persistent workers every epoch starts (forks) its workers anew and waits for their first batches.
    (
        "+ persistent workers",
        dict(num_workers=WORKERS, persistent_workers=True, prefetch_factor=2, pin_memory=True),
    ),
    # Each worker keeps 4 batches ready instead of 2: a cushion for the batches that happen to be slow.
    ("+ deeper prefetch", dict(num_workers=WORKERS, persistent_workers=True, prefetch_factor=4, pin_memory=True)),
]
"""The fix, rung by rung: ``(label, make_loader options)``, each rung adding one option to the one before."""


def digits_split() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The digits as ``(pixels, labels, is_test)``: pixels 0..16, shape (1797, 8, 8), and the test mask.

    The split is ``common.data``'s for ``load_data("digits")`` (``digits_test_mask``).
    """
    pixels, labels = _read_digits()
    is_test = digits_test_mask(torch.tensor(labels, dtype=torch.long))
    return pixels.reshape(-1, 8, 8), labels, is_test.numpy()


def write_digits_png(data_dir) -> Path:
    """Write the digits as 8-bit grayscale PNGs in ImageFolder's layout under ``data_dir``; return the folder.

    ``<data_dir>/digits-png/{train,test}/<class>/<index>.png``, where ``index`` is the digit's row in
    scikit-learn's file and the pixels 0..16 are scaled to 0..255. Written once: into a temporary folder, which
    is then renamed in one step, so a reader never sees half the files. A folder already there is kept as it is.
    """
    from PIL import Image

    root = Path(data_dir) / FOLDER
    if root.is_dir():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    pixels, labels, is_test = digits_split()
    tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{FOLDER}."))
    tmp.chmod(0o755)  # mkdtemp makes it private; once renamed it is a data set that every user may read
    try:
        for index, (image, label, test) in enumerate(zip(pixels, labels, is_test)):
            folder = tmp / ("test" if test else "train") / str(label)
            folder.mkdir(parents=True, exist_ok=True)
            gray = np.round(image * 255 / 16).astype(np.uint8)
            Image.fromarray(gray, mode="L").save(folder / f"{index}.png")
        try:
            os.rename(tmp, root)
        except OSError:
            if not root.is_dir():  # another process renamed its own copy first: keep that one
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


class SlowStorage:
    """ImageFolder's file loader with ``latency_ms`` of waiting before each file: slow storage, simulated.

    ``time.sleep`` holds no CPU, as waiting for a network file system would not: another process (a loader
    worker) runs meanwhile. Then PIL opens and decodes the file as 8-bit grayscale.
    """

    def __init__(self, latency_ms: float = 0.0):
        if not latency_ms >= 0:
            raise ConfigurationError(f"error: the read latency must be 0 ms or more, got {latency_ms}")
        self.latency_ms = latency_ms

    def __call__(self, path):
        from PIL import Image

        if self.latency_ms:
            time.sleep(self.latency_ms / 1000)
        with open(path, "rb") as file:
            return Image.open(file).convert("L")  # convert() reads the pixels before the file closes


def digits_transform(input_shape: tuple[int, int, int], train: bool):
    """The per-sample pipeline: PIL image -> resized (augmented when training) -> normalized float tensor."""
    from torchvision.transforms import v2

    channels, height, width = input_shape
    steps = [v2.Resize((height, width))]
    if train:
        # a small random rotation, shift and zoom: a different image every epoch, so it cannot be cached
        steps.append(v2.RandomAffine(degrees=10, translate=(0.1, 0.1), scale=(0.9, 1.1)))
    if channels != 1:
        steps.append(v2.Grayscale(num_output_channels=channels))
    steps += [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize([0.5] * channels, [0.5] * channels)]
    return v2.Compose(steps)


def image_folder_splits(data_dir, input_shape=(1, 28, 28), read_latency_ms: float = 0.0) -> DataSplits:
    """The digits read from PNG files by ``ImageFolder``, one file and one transform per sample.

    Writes the files first if they are not there (global rank 0 first, in a process group; every rank must call
    it). ``read_latency_ms`` is the simulated storage latency per file, for the training and the test set.
    """
    from torchvision.datasets import ImageFolder

    loader = SlowStorage(read_latency_ms)
    with main_process_first():
        root = write_digits_png(data_dir)
    return DataSplits(
        ImageFolder(root / "train", transform=digits_transform(input_shape, train=True), loader=loader),
        ImageFolder(root / "test", transform=digits_transform(input_shape, train=False), loader=loader),
        NUM_CLASSES,
    )


def measure_loader(loader, train_step, steps: int, device: torch.device) -> dict:
    """Time one pass over ``loader``, feeding ``train_step(X, y)``: how long each step waited for data, and computed.

    Data time is the wait for ``next()`` plus the copy to ``device`` (``non_blocking`` when the loader pins
    memory; on a GPU that asynchronous copy then finishes inside the compute time, which synchronizes the device
    before the clock is read). The first batch is start-up (workers forked, their first batches loaded) and is
    reported alone, as ``first_batch_ms``; the next ``steps`` batches are timed. Stop at the epoch's end or after
    them: leaving a persistent loader's epoch early makes its next epoch first take back what its workers had
    loaded ahead, so size the epoch to ``steps + 1`` batches.

    Returns ``data_ms`` and ``compute_ms`` (means per timed step), ``first_batch_ms``, ``steps`` timed,
    ``samples_per_s`` (timed samples over timed time) and ``data_share`` (data time / total time).
    """
    non_blocking = bool(getattr(loader, "pin_memory", False))
    data_seconds = compute_seconds = first_batch_seconds = 0.0
    timed_steps = samples = 0
    start = time.perf_counter()
    batches = iter(loader)  # creating the iterator starts non-persistent workers: part of the first batch
    for index in range(steps + 1):
        try:
            X, y = next(batches)
        except StopIteration:
            break
        X, y = X.to(device, non_blocking=non_blocking), y.to(device, non_blocking=non_blocking)
        fetched = time.perf_counter()
        train_step(X, y)
        synchronize(device)  # a GPU computes asynchronously: wait for it, or its time lands in the next wait
        done = time.perf_counter()
        if index == 0:
            first_batch_seconds = fetched - start
        else:
            data_seconds += fetched - start
            compute_seconds += done - fetched
            timed_steps += 1
            samples += len(y)
        start = done
    del batches  # a non-persistent loader's workers exit here, not at the next epoch
    total = data_seconds + compute_seconds
    per_step = 1000 / max(timed_steps, 1)
    return {
        "steps": timed_steps,
        "data_ms": data_seconds * per_step,
        "compute_ms": compute_seconds * per_step,
        "first_batch_ms": first_batch_seconds * 1000,
        "samples_per_s": samples / total if total else 0.0,
        "data_share": data_seconds / total if total else 0.0,
    }
