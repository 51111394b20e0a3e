"""Torchvision data sets written in their real on-disk format, for tests that cannot download anything.

``write_fashion_mnist(data_dir)`` writes the four IDX files that ``torchvision.datasets.FashionMNIST`` reads from
``data_dir/FashionMNIST/raw/``. torchvision finds them, skips the download, and the scripts take the same path
as with the real files: ``DataLoader`` with worker processes, per-sample ``ToTensor``/``Normalize``.
"""

import struct
from pathlib import Path

import numpy as np

IDX_UBYTE = 0x08  # the IDX type code for unsigned bytes


def write_idx(path: Path, array: np.ndarray) -> None:
    """One IDX file: 2 zero bytes, the type code, the number of dimensions, each dimension (big-endian), data."""
    header = struct.pack(">HBB", 0, IDX_UBYTE, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def write_fashion_mnist(data_dir, train_size: int = 512, test_size: int = 128, seed: int = 0) -> Path:
    """28x28 gray images whose class shows as a bright horizontal band (learnable), plus noise; returns the folder."""
    raw = Path(data_dir) / "FashionMNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for prefix, size in (("train", train_size), ("t10k", test_size)):
        labels = rng.integers(0, 10, size)
        images = rng.integers(0, 80, (size, 28, 28))
        for row, label in enumerate(labels):
            images[row, 2 + 2 * label : 4 + 2 * label, :] = 255  # class k lights rows 2k+2 and 2k+3
        write_idx(raw / f"{prefix}-images-idx3-ubyte", images)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)
    return raw
