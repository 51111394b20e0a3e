"""Lesson 09's input pipeline: the PNG files, the starving loader and the fixed one, and make_loader's new options."""

import json
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from common.data import ConfigurationError, make_loader
from common.data_loading import (
    LOADER_LADDER,
    READ_LATENCY_MS,
    SlowStorage,
    digits_split,
    image_folder_splits,
    measure_loader,
    write_digits_png,
)
from common.models import LeNet
from tests.conftest import PYTHON, REPO, run_command


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    write_digits_png(folder)
    return folder


def test_the_png_files_are_in_image_folder_layout_and_decode_back_to_the_digits(data_dir):
    pixels, labels, is_test = digits_split()
    files = sorted((data_dir / "digits-png").glob("*/*/*.png"))
    assert len(files) == len(labels) == 1797
    for path in files:
        index = int(path.stem)
        split, label = path.parent.parent.name, int(path.parent.name)
        assert split == ("test" if is_test[index] else "train")
        assert label == labels[index]
        with Image.open(path) as image:
            assert image.mode == "L" and image.size == (8, 8)
            decoded = np.asarray(image, dtype=np.float64) * 16 / 255
        np.testing.assert_allclose(decoded, pixels[index], atol=16 / 255 / 2)  # half an 8-bit step
    assert is_test.sum() == sum(1 for path in files if path.parts[-3] == "test") == 359  # 20% of each class


def test_writing_twice_keeps_the_files_and_leaves_no_temporary_folder(data_dir):
    root = data_dir / "digits-png"
    before = {path: path.stat().st_mtime_ns for path in root.rglob("*.png")}
    assert write_digits_png(data_dir) == root
    assert {path: path.stat().st_mtime_ns for path in root.rglob("*.png")} == before
    assert [path.name for path in data_dir.iterdir()] == ["digits-png"]  # the temporary folder was renamed


def test_image_folder_splits_give_model_shaped_tensors_with_the_files_labels(data_dir):
    splits = image_folder_splits(data_dir, (1, 28, 28))
    assert (len(splits.train), len(splits.test), splits.num_classes) == (1438, 359, 10)
    assert splits.train.class_to_idx == {str(digit): digit for digit in range(10)}
    X, y = splits.test[0]
    assert X.shape == (1, 28, 28) and X.dtype == torch.float32 and y == 0
    assert -1.0 <= X.min() < X.max() <= 1.0  # Normalize(0.5, 0.5) of 0..1
    torch.testing.assert_close(splits.test[0][0], X)  # no augmentation on the test set
    three_channels = image_folder_splits(data_dir, (3, 32, 32)).test[0][0]
    assert three_channels.shape == (3, 32, 32) and torch.equal(three_channels[0], three_channels[2])


def test_a_negative_read_latency_is_refused_with_a_clear_error(data_dir):
    with pytest.raises(ConfigurationError, match="read latency must be 0 ms or more, got -1"):
        image_folder_splits(data_dir, read_latency_ms=-1)
    with pytest.raises(ConfigurationError, match="got nan"):
        SlowStorage(float("nan"))


def test_make_loader_hands_persistent_workers_and_prefetch_factor_to_the_data_loader(data_dir):
    dataset = image_folder_splits(data_dir).test

    def loader(**options):
        return make_loader(dataset, 8, rank=0, world_size=1, train=False, **options)

    assert (loader().persistent_workers, loader().prefetch_factor) == (False, None)  # as before: no workers
    assert loader(num_workers=2).persistent_workers is True  # as before: workers persist unless told otherwise
    chosen = loader(num_workers=2, persistent_workers=False, prefetch_factor=4)
    assert (chosen.persistent_workers, chosen.prefetch_factor) == (False, 4)
    assert loader(num_workers=0, prefetch_factor=4).prefetch_factor is None  # nothing to prefetch without workers
    X, y = next(iter(chosen))
    assert X.shape == (8, 1, 28, 28) and y.tolist() == [0] * 8


@pytest.mark.skipif(torch.accelerator.is_available(), reason="what DataLoader does without an accelerator")
def test_without_an_accelerator_pin_memory_warns_and_pins_nothing(data_dir):
    loader = make_loader(image_folder_splits(data_dir).test, 8, rank=0, world_size=1, train=False, pin_memory=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        X, _ = next(iter(loader))
    assert any("no accelerator is found" in str(warning.message) for warning in caught)
    assert not X.is_pinned()


def test_the_ladder_adds_one_option_per_rung():
    labels = [label for label, _ in LOADER_LADDER]
    assert labels[0] == "decode in the main process" and len(labels) == 5
    for (_, before), (_, after) in zip(LOADER_LADDER[1:], LOADER_LADDER[2:]):
        changed = {key for key in after if before.get(key) != after[key]}
        assert len(changed) == 1, changed


@pytest.mark.timeout(60)
def test_the_starving_rung_is_data_bound_and_the_last_rung_is_not(data_dir):
    """One process, LeNet, batch 64, the default storage latency: measured, not assumed."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as under torchrun: one thread per training process
    try:
        splits = image_folder_splits(data_dir, LeNet.input_shape, READ_LATENCY_MS)
        torch.manual_seed(0)
        net = LeNet()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.01)

        def train_step(X, y):
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(net(X), y).backward()
            optimizer.step()

        results = {}
        for label, options in (LOADER_LADDER[0], LOADER_LADDER[-1]):
            chosen = torch.randperm(len(splits.train), generator=torch.Generator().manual_seed(0))[: 9 * 64]
            subset = torch.utils.data.Subset(splits.train, chosen.tolist())  # 9 batches: the first is start-up
            loader = make_loader(subset, 64, rank=0, world_size=1, train=True, **options)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # pin_memory without an accelerator; more workers than cores
                results[label] = measure_loader(loader, train_step, steps=8, device=torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
    starving, fixed = results.values()
    assert starving["steps"] == fixed["steps"] == 8
    # Waiting for storage alone is 128 ms per batch (64 files, 2 ms each): the starving rung waits at least that.
    assert starving["data_ms"] >= 64 * READ_LATENCY_MS, results
    assert starving["data_ms"] > 2 * starving["compute_ms"], results
    assert fixed["data_ms"] < 0.5 * fixed["compute_ms"], results
    assert fixed["samples_per_s"] > starving["samples_per_s"], results
    assert 0 < fixed["data_share"] < 0.5 < starving["data_share"] < 1, results
    assert fixed["first_batch_ms"] > 0 and starving["first_batch_ms"] > 0


@pytest.mark.slow  # 14 s: the rungs themselves are tested above in make test
@pytest.mark.timeout(120)
def test_the_benchmark_prints_a_row_per_rung_and_writes_its_figures(tmp_path):
    run = run_command(
        [
            PYTHON,
            REPO / "benchmarks/data_loading.py",
            "--data-dir",
            tmp_path / "data",
            "--steps",
            "2",
            "--json",
            tmp_path / "figures.json",
            "--plot",
            tmp_path / "plot.png",
        ],
        timeout=110,
        env_extra={"OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.output
    rows = [line for line in run.stdout.splitlines() if line[:2] in {f"{n}." for n in range(1, 6)}]
    assert [row.split("  ")[0] for row in rows] == [f"{n}. {label}" for n, (label, _) in enumerate(LOADER_LADDER, 1)]
    figures = json.loads((tmp_path / "figures.json").read_text())["rows"]
    assert [row["workers"] for row in figures] == [0] + [LOADER_LADDER[-1][1]["num_workers"]] * 4
    assert figures[0]["verdict"] == "data-bound" and figures[0]["data_ms"] >= 64 * READ_LATENCY_MS
    assert all(len(row["first_batch_ms"]) == 2 and row["samples_per_s"] > 0 for row in figures)  # 2 epochs per rung
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
