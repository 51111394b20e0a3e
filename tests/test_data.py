import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from common.data import FirstBatches, TensorBatchLoader, _read_digits, _torchvision, load_data, make_loader
from common.distributed import ConfigurationError
from tests.conftest import NO_NETWORK, PYTHON, run_command
from tests.fake_datasets import write_idx


@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32)])
def test_digits_are_resized_to_the_model_input_and_split_80_20_per_class(shape):
    data = load_data("digits", input_shape=shape)
    X, y = data.train.tensors
    assert X.shape == (1438, *shape) and len(data.test) == 359
    test_share = torch.bincount(data.test.tensors[1]) / (torch.bincount(y) + torch.bincount(data.test.tensors[1]))
    assert torch.allclose(test_share, torch.full((10,), 0.2), atol=0.01)  # stratified: 20% of every class
    assert set(y.tolist()) == set(range(10)) and set(data.test.tensors[1].tolist()) == set(range(10))
    assert abs(X.mean().item()) < 1e-4 and abs(X.std().item() - 1) < 1e-3  # standardised on the train split
    assert torch.equal(X, load_data("digits", input_shape=shape).train.tensors[0])  # every rank gets the same


def test_digits_are_scikit_learns_bundled_digits():
    from sklearn.datasets import load_digits

    pixels, labels = _read_digits()
    reference = load_digits()
    assert np.array_equal(pixels, reference.data) and np.array_equal(labels, reference.target)


def test_loading_digits_does_not_import_scikit_learn():
    code = (
        "import sys; from common.data import load_data; load_data('digits'); "
        "print(sorted(name for name in ('sklearn', 'scipy') if name in sys.modules))"
    )
    run = run_command([PYTHON, "-c", code], timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.output


def test_digits_are_real_images_not_noise():
    X, y = load_data("digits").train.tensors
    # Images of one class resemble each other more than images of different classes do.
    zeros, ones = X[y == 0].flatten(1), X[y == 1].flatten(1)
    same = torch.cdist(zeros, zeros).mean()
    different = torch.cdist(zeros, ones).mean()
    assert same < 0.8 * different


def test_synthetic_has_the_shape_and_is_identical_on_every_call():
    first, second = load_data("synthetic", input_shape=(3, 32, 32)), load_data("synthetic", input_shape=(3, 32, 32))
    assert first.train.tensors[0].shape == (4096, 3, 32, 32) and len(first.test) == 1024
    assert torch.equal(first.train.tensors[0], second.train.tensors[0])


def test_unknown_data_set_is_a_clear_error():
    with pytest.raises(ConfigurationError, match="unknown data set 'imagenet'.*digits"):
        load_data("imagenet")


@pytest.mark.parametrize("name", ["fashion-mnist", "cifar10"])
def test_download_failure_says_what_to_do(name, tmp_path, monkeypatch):
    for variable, value in NO_NETWORK.items():
        monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigurationError) as caught:
        load_data(name, data_dir=str(tmp_path))
    message = str(caught.value)
    assert f"could not load data set '{name}'" in message and str(tmp_path) in message
    assert "--dataset digits" in message and "--data-dir" in message


def test_ranks_that_do_not_download_say_so_when_the_files_are_missing(tmp_path):
    with pytest.raises(ConfigurationError, match="(?s)only global rank 0 downloads.*on every node.*--dataset digits"):
        _torchvision("fashion-mnist", str(tmp_path), (1, 28, 28), download=False)


def test_fashion_mnist_files_in_data_dir_load_without_network_in_the_model_shape(tmp_path, monkeypatch):
    for variable, value in NO_NETWORK.items():
        monkeypatch.setenv(variable, value)
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for split, size in (("train", 6), ("t10k", 4)):
        write_idx(raw / f"{split}-images-idx3-ubyte", torch.randint(0, 256, (size, 28, 28)).numpy())
        write_idx(raw / f"{split}-labels-idx1-ubyte", (torch.arange(size) % 10).numpy())
    data = load_data("fashion-mnist", data_dir=str(tmp_path), input_shape=(3, 32, 32))
    X, label = data.train[5]
    assert (len(data.train), len(data.test)) == (6, 4) and label == 5
    assert X.shape == (3, 32, 32) and -1 <= X.min() and X.max() <= 1  # grey to RGB, resized, in [-1, 1]


def shard_labels(loader):
    return torch.cat([y for _, y in loader]).tolist()


def test_shards_are_disjoint_and_cover_the_data_set_with_padding():
    dataset = TensorDataset(torch.randn(10, 2), torch.arange(10))
    shards = [shard_labels(make_loader(dataset, 3, rank, 3, train=True)) for rank in range(3)]
    assert [len(shard) for shard in shards] == [4, 4, 4]  # 10 samples padded to 12 for 3 ranks
    everything = sum(shards, [])
    assert set(everything) == set(range(10))
    assert len(everything) - len(set(everything)) == 2  # only the two padding samples repeat


def test_training_padding_repeats_the_first_indices_of_the_shuffled_permutation_not_of_the_data_set():
    world_size, seed = 3, 0
    shards = [
        torch.cat(
            [X for (X,) in make_loader(TensorDataset(torch.arange(10)), 4, rank, world_size, train=True, seed=seed)]
        ).tolist()
        for rank in range(world_size)
    ]
    # DistributedSampler draws randperm with the generator seeded by seed + epoch (epoch 0 here).
    permutation = torch.randperm(10, generator=torch.Generator().manual_seed(seed)).tolist()
    padded = [shards[position % world_size][position // world_size] for position in range(12)]
    assert padded == permutation + permutation[:2]
    assert permutation[:2] != [0, 1]  # so the repeated samples are not the data set's first two


def test_set_epoch_reshuffles_and_the_same_epoch_repeats_its_order():
    loader = make_loader(TensorDataset(torch.arange(64)), 8, rank=0, world_size=2, train=True, seed=3)
    orders = {}
    for epoch in (0, 1, 0):
        loader.sampler.set_epoch(epoch)
        order = torch.cat([X for (X,) in loader]).tolist()
        assert orders.setdefault(epoch, order) == order
    assert orders[0] != orders[1]


def test_test_loaders_keep_the_data_set_order():
    loader = make_loader(TensorDataset(torch.arange(7)), 2, rank=1, world_size=2, train=False)
    assert torch.cat([X for (X,) in loader]).tolist() == [1, 3, 5, 0]  # every 2nd index; 0 is padding


def test_tensor_batches_equal_those_of_a_dataloader_on_the_same_sampler():
    dataset = TensorDataset(torch.randn(50, 3), torch.arange(50))
    fast = make_loader(dataset, 8, rank=1, world_size=2, train=True, seed=1)
    assert isinstance(fast, TensorBatchLoader) and len(fast) == 4  # 25 samples: 3 full batches and 1 of 1
    slow = DataLoader(dataset, batch_size=8, sampler=DistributedSampler(dataset, 2, 1, shuffle=True, seed=1))
    for epoch in (0, 1):
        fast.sampler.set_epoch(epoch)
        slow.sampler.set_epoch(epoch)
        pairs = list(zip(fast, slow, strict=True))
        assert all(torch.equal(a, b) for fast_batch, slow_batch in pairs for a, b in zip(fast_batch, slow_batch))


def samples_of(loader, start=0):
    """The samples one rank's loader yields in epoch 1, its sampler started after ``start`` samples."""
    loader.sampler.set_epoch(1)
    loader.sampler.start = start
    return torch.cat([X for (X,) in loader]).tolist() if len(loader) else []


@pytest.mark.parametrize("old_world", [1, 2, 3, 4])
@pytest.mark.parametrize("new_world", [1, 2, 3, 4])
def test_a_sampler_started_part_way_deals_out_exactly_the_samples_not_yet_trained_at_any_world_size(
    old_world, new_world
):
    # 50 samples, 4 per batch: k full batches on each of old_world ranks, then a resume on new_world ranks.
    dataset = TensorDataset(torch.arange(50))
    for batches in (1, 2, 3):
        start = batches * 4 * old_world
        if start >= 50:
            continue
        old = [make_loader(dataset, 4, rank, old_world, train=True, seed=5) for rank in range(old_world)]
        trained = [sample for loader in old for sample in samples_of(loader)[: batches * 4]]
        new = [make_loader(dataset, 4, rank, new_world, train=True, seed=5) for rank in range(new_world)]
        rest = [samples_of(loader, start) for loader in new]
        assert len({len(shard) for shard in rest}) == 1  # every rank takes as many steps: no rank waits alone
        flat = [sample for shard in rest for sample in shard]
        assert len(set(trained)) == len(trained) == start
        assert set(flat) >= set(range(50)) - set(trained)  # every sample not yet trained comes...
        assert len(flat) - (50 - start) < new_world  # ...once, and only the padding of the last step repeats
        if new_world == old_world:  # the same world: the rest of each rank's own shard, as an uninterrupted run
            assert rest == [samples_of(loader)[batches * 4 :] for loader in old]


def test_an_epoch_cut_short_counts_the_samples_its_sampler_skips():
    dataset = TensorDataset(torch.arange(100))
    loader = FirstBatches(make_loader(dataset, 4, 0, 2, train=True, seed=5), 5)  # 5 batches x 4 x 2 ranks = 40
    assert len(loader) == 5
    for start, left in ((8, 4), (16, 3), (36, 1), (40, 0), (48, 0)):
        loader.sampler.start = start
        assert len(loader) == left and len(list(loader)) == left, start


class Squares(Dataset):
    def __len__(self):
        return 9

    def __getitem__(self, index):
        return torch.tensor([float(index)]), index * index


def test_other_data_sets_get_a_dataloader_with_a_distributed_sampler():
    loader = make_loader(Squares(), 2, rank=0, world_size=3, train=False)
    assert isinstance(loader, DataLoader) and isinstance(loader.sampler, DistributedSampler)
    assert shard_labels(loader) == [0, 9, 36]


def test_batch_size_below_one_is_a_clear_error():
    with pytest.raises(ConfigurationError, match="batch size must be at least 1"):
        make_loader(TensorDataset(torch.arange(4)), 0, rank=0, world_size=1, train=True)


def global_rng_states():
    return torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()


@pytest.mark.parametrize(
    "dataset, num_workers",
    [(Squares(), 0), (Squares(), 2), (TensorDataset(torch.zeros(9, 1), torch.arange(9)), 0)],
    ids=["DataLoader-0-workers", "DataLoader-2-workers", "TensorBatchLoader"],
)
def test_creating_and_iterating_a_loader_draws_nothing_from_the_global_rngs(dataset, num_workers):
    # A DataLoader iterator draws its workers' base seed from the loader's generator, or from the global RNG
    # without one. Dropout draws from the global RNG too, so a hidden draw there would shift every mask after
    # it, and a resumed run (whose iterator starts at another moment) could not end bit-identical.
    torch.manual_seed(0)
    before = global_rng_states()
    loader = make_loader(dataset, 2, rank=1, world_size=2, train=True, num_workers=num_workers)
    for epoch in (0, 1):  # persistent workers start at the first epoch; a new iterator each epoch without them
        loader.sampler.set_epoch(epoch)
        assert len(shard_labels(loader)) == 5  # 9 samples padded to 10, half of them on rank 1
    after = global_rng_states()
    assert torch.equal(after[0], before[0]), "the loader drew from torch's global RNG"
    assert np.array_equal(after[1], before[1]) and after[2] == before[2]


class RandomlyJittered(Dataset):
    """8 samples, each with a random number drawn where the sample is loaded: as a random augmentation would."""

    def __len__(self):
        return 8

    def __getitem__(self, index):
        return torch.rand(()), index


def test_random_augmentations_in_loader_workers_restart_from_their_seed_in_a_resumed_run():
    # No checkpoint holds the workers' RNGs: a restarted process builds its loader anew, and its workers are
    # seeded as they were at the start of the run, so the draws repeat instead of continuing.
    def jitter(loader, epoch):
        loader.sampler.set_epoch(epoch)
        return torch.cat([X for X, _ in loader])

    uninterrupted = make_loader(RandomlyJittered(), 2, rank=0, world_size=1, train=True, num_workers=2)
    first_epoch, second_epoch = jitter(uninterrupted, 0), jitter(uninterrupted, 1)
    resumed = make_loader(RandomlyJittered(), 2, rank=0, world_size=1, train=True, num_workers=2)
    resumed_second_epoch = jitter(resumed, 1)
    assert not torch.equal(resumed_second_epoch, second_epoch)
    assert torch.equal(resumed_second_epoch, first_epoch)  # the first epoch's draws, again
