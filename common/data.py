"""Data sets by name, converted to a model's input shape, and loaders that shard them over ranks.

- ``fashion-mnist``, ``cifar10``: torchvision, downloaded into ``data_dir`` by global rank 0 only.
- ``digits``: scikit-learn's bundled 8x8 handwritten digits (1797 images), resized: real data, no network.
- ``synthetic``: random tensors with random labels, for measuring throughput.

Every rank builds the same data set; ``DistributedSampler`` then gives each rank its own slice of it.
"""

from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from common.distributed import ConfigurationError, is_main, main_process_first

DATASETS = ("fashion-mnist", "cifar10", "digits", "synthetic")
NUM_CLASSES = 10  # all four data sets have ten classes
SYNTHETIC_SIZES = (4096, 1024)  # train, test


@dataclass
class DataSplits:
    """A train and a test set whose images have the shape the model takes."""

    train: Dataset
    test: Dataset
    num_classes: int = NUM_CLASSES


def load_data(name: str, data_dir: str = "./data", input_shape: tuple[int, int, int] = (1, 28, 28)) -> DataSplits:
    """Load data set ``name`` with images converted to ``input_shape`` (channels, height, width).

    In a process group, call it on every rank: global rank 0 downloads while the others wait, then the others
    read the files it wrote, so no two processes write the same file. A data set that can't be had raises
    ``ConfigurationError`` with a message that says what to do.
    """
    if name == "digits":
        return _digits(input_shape)
    if name == "synthetic":
        return _synthetic(input_shape)
    if name in ("fashion-mnist", "cifar10"):
        with main_process_first():
            return _torchvision(name, data_dir, input_shape, download=is_main())
    raise ConfigurationError(f"error: unknown data set {name!r}; choose one of {', '.join(DATASETS)}")


def _digits(input_shape) -> DataSplits:
    pixels, labels = _read_digits()
    X = torch.tensor(pixels, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0  # pixels are 0..16
    y = torch.tensor(labels, dtype=torch.long)
    is_test = digits_test_mask(y)
    X = _to_shape(X, input_shape)
    mean, std = X[~is_test].mean(), X[~is_test].std()  # statistics of the training split only
    X = (X - mean) / std
    return DataSplits(TensorDataset(X[~is_test], y[~is_test]), TensorDataset(X[is_test], y[is_test]))


def digits_test_mask(labels: torch.Tensor) -> torch.Tensor:
    """Which of the digits are test samples: a stratified 80/20 split, fixed once and for all (seed 0), 20% of
    every class in the test set. ``labels``: the 1797 labels in the file's order."""
    generator = torch.Generator().manual_seed(0)
    is_test = torch.zeros(len(labels), dtype=torch.bool)
    for digit in range(NUM_CLASSES):
        members = (labels == digit).nonzero().flatten()
        members = members[torch.randperm(len(members), generator=generator)]
        is_test[members[: round(0.2 * len(members))]] = True
    return is_test


def _read_digits():
    """The 1797 digits as (pixels, labels) NumPy arrays, read from the file that scikit-learn ships.

    Read directly rather than through ``sklearn.datasets.load_digits``: importing scikit-learn pulls SciPy and
    a second OpenMP runtime into every training process, which slows start-up, and in our runs it made gloo's
    abort at exit (see ``teardown_distributed``) more frequent: 2 of 30 two-process runs against 0 of 30.
    """
    import importlib.util

    spec = importlib.util.find_spec("sklearn")  # finds the installed package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ConfigurationError(
            "error: --dataset digits reads scikit-learn's bundled digits: pip install scikit-learn"
        )
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    table = np.loadtxt(path, delimiter=",")  # one row per image: 64 pixels, then the label
    return table[:, :-1], table[:, -1].astype(np.int64)


def _to_shape(X: torch.Tensor, input_shape) -> torch.Tensor:
    """Resize a (N, 1, h, w) batch to (N, C, H, W): bilinear resize, then the gray channel repeated C times."""
    channels, height, width = input_shape
    X = F.interpolate(X, size=(height, width), mode="bilinear", align_corners=False)
    return X.expand(-1, channels, -1, -1).contiguous()


def _synthetic(input_shape) -> DataSplits:
    # A fixed generator, not the global RNG: every rank must build exactly the same data set.
    generator = torch.Generator().manual_seed(0)

    def split(size):
        X = torch.randn(size, *input_shape, generator=generator)
        y = torch.randint(0, NUM_CLASSES, (size,), generator=generator)
        return TensorDataset(X, y)

    train_size, test_size = SYNTHETIC_SIZES
    return DataSplits(split(train_size), split(test_size))


def _torchvision(name, data_dir, input_shape, download) -> DataSplits:
    from torchvision import datasets, transforms

    dataset_class, natural_shape = {
        "fashion-mnist": (datasets.FashionMNIST, (1, 28, 28)),
        "cifar10": (datasets.CIFAR10, (3, 32, 32)),
    }[name]
    channels, height, width = input_shape
    steps = []
    if channels != natural_shape[0]:
        steps.append(transforms.Grayscale(num_output_channels=channels))
    if (height, width) != natural_shape[1:]:
        steps.append(transforms.Resize((height, width)))
    steps += [transforms.ToTensor(), transforms.Normalize([0.5] * channels, [0.5] * channels)]
    transform = transforms.Compose(steps)
    try:
        return DataSplits(
            dataset_class(data_dir, train=True, transform=transform, download=download),
            dataset_class(data_dir, train=False, transform=transform, download=download),
        )
    except (OSError, RuntimeError) as error:  # URLError is an OSError; torchvision raises RuntimeError too
        reason = " ".join(line.strip() for line in str(error).splitlines() if line.strip())[:300]
        not_downloading = (
            ""
            if download
            else " (only global rank 0 downloads: without a shared file system, "
            "put the files into --data-dir on every node)"
        )
        raise ConfigurationError(
            f"error: could not load data set {name!r} from --data-dir {data_dir!r}{not_downloading}: {reason}\n"
            f"If this machine is offline, train on scikit-learn's bundled digits with --dataset digits, "
            f"or copy the {name} files into --data-dir."
        ) from None


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` that can begin an epoch part-way, after the samples already trained, counted over all
    ranks: ``sampler.start = samples``, after ``set_epoch`` (which sets it back to 0).

    DistributedSampler deals one order of the data set out round-robin: the epoch's permutation (seed + epoch),
    padded with its first samples so that every rank gets as many, and rank r takes positions r, r + N, r + 2N...
    of it. So after k full batches of B samples on each of N ranks, the samples trained are exactly the first
    k x B x N positions of that order, whatever N is. ``start`` skips those positions and deals out the rest over
    the ranks of *this* world, which may be more or fewer than the world that trained them: a resume after an
    elastic change of world size trains every remaining sample once and none twice (padding aside). With
    ``start`` 0 it yields what DistributedSampler yields, and with the same world size, from ``start`` = k x B x N,
    what DistributedSampler yields after its first k x B samples.
    """

    start = 0

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.start = 0  # a new epoch starts at its beginning

    def __len__(self) -> int:
        if not self.start:
            return super().__len__()
        return -(-(len(self.dataset) - self.start) // self.num_replicas)  # the rest, shared out, rounded up

    def __iter__(self):
        if not self.start:
            return super().__iter__()
        size = len(self.dataset)
        if self.drop_last or not 0 <= self.start < size:
            raise ValueError(f"start {self.start} is not a position of the epoch's {size} samples (or drop_last)")
        if self.shuffle:  # the permutation DistributedSampler draws
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            indices = torch.randperm(size, generator=generator).tolist()
        else:
            indices = list(range(size))
        end = self.start + len(self) * self.num_replicas
        while len(indices) < end:  # padded as DistributedSampler pads: with the order's first samples
            indices += indices[: end - len(indices)]
        return iter(indices[self.start + self.rank : end : self.num_replicas])


class TensorBatchLoader:
    """Batches of in-memory tensors, each cut with one indexing operation per tensor.

    A ``DataLoader`` calls ``__getitem__`` once per sample and then stacks the samples; for a data set that is
    already a tensor in memory that per-sample work is pure overhead. Same interface as a ``DataLoader`` over
    a ``DistributedSampler``: iterate for ``(X, y)`` batches, ``len()`` for batches, ``.sampler.set_epoch()``.
    """

    def __init__(self, dataset: TensorDataset, batch_size: int, sampler: DistributedSampler):
        self.dataset = dataset
        self.batch_size = batch_size
        self.sampler = sampler

    def __len__(self):
        return -(-len(self.sampler) // self.batch_size)

    def __iter__(self):
        indices = torch.tensor(list(self.sampler), dtype=torch.long)
        for batch_indices in indices.split(self.batch_size):
            yield tuple(tensor[batch_indices] for tensor in self.dataset.tensors)


def make_loader(
    dataset: Dataset,
    batch_size: int,
    rank: int,
    world_size: int,
    train: bool,
    seed: int = 0,
    num_workers: int = 0,
    pin_memory: bool = False,
    persistent_workers: bool | None = None,
    prefetch_factor: int | None = None,
):
    """A loader over this rank's shard of ``dataset``, ``batch_size`` samples per batch on this rank.

    Training shuffles with ``seed``; call ``loader.sampler.set_epoch(epoch)`` every epoch, or every epoch
    repeats the same order. ``DistributedSampler`` pads the data set with repeated samples so that it divides
    by the world size: use ``common.metrics.evaluate`` for test metrics, which drops the padding.

    With ``num_workers > 0``: ``persistent_workers`` keeps the worker processes from one epoch to the next
    (``None``: kept, as without the option); ``prefetch_factor`` is how many batches each worker loads ahead
    (``None``: DataLoader's default, 2). Lesson 09 takes these options one by one (``common.data_loading``).
    """
    if batch_size < 1:
        raise ConfigurationError(f"error: the batch size must be at least 1, got {batch_size}")
    sampler = ResumableSampler(dataset, num_replicas=world_size, rank=rank, shuffle=train, seed=seed)
    if isinstance(dataset, TensorDataset):
        return TensorBatchLoader(dataset, batch_size, sampler)
    # A generator of the loader's own. Each new DataLoader iterator draws its workers' base seed from
    # `generator`, and without one from the global RNG: one hidden draw that shifts every dropout mask after
    # it. A run that resumes mid-training creates its iterator at another moment than an uninterrupted run
    # did (persistent workers draw once, at the first epoch iterated), so with the global RNG the two runs'
    # dropout masks differ from the resume on, and the resumed run cannot end bit-identical.
    generator = torch.Generator().manual_seed(seed + rank)  # per rank, as set_seed(seed, rank) would
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0 if persistent_workers is None else persistent_workers,
        # DataLoader refuses a prefetch_factor without workers: there is no one to prefetch
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
        generator=generator,
    )


class FirstBatches:
    """``loader`` cut short: the first ``max_batches`` batches of every epoch, or all of them when it is ``None``.

    For quick runs (``--max-batches-per-epoch``). It behaves like the loader it wraps: iterate it for the batches,
    ``len()`` counts what an epoch yields, ``.sampler.set_epoch(epoch)`` reshuffles.
    """

    def __init__(self, loader, max_batches: int | None = None):
        self.loader, self.max_batches = loader, max_batches
        self.sampler = loader.sampler

    def __len__(self):
        start = getattr(self.sampler, "start", 0)
        if self.max_batches is None or not start:
            return min(len(self.loader), self.max_batches or len(self.loader))
        # An epoch cut short covers the first max_batches x B x N positions of the sampler's order. A sampler that
        # starts part-way (ResumableSampler.start) has fewer of them left: the batches that reach that far.
        per_batch = self.loader.batch_size * self.sampler.num_replicas
        return min(len(self.loader), -(-max(0, self.max_batches * per_batch - start) // per_batch))

    def __iter__(self):
        return islice(self.loader, len(self))
