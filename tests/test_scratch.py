"""Data parallelism from scratch (lesson 01): correct on simulated devices, and the in-place pitfall."""

import torch
import torch.nn.functional as F

from common.models import LeNet
from common.scratch import (
    all_reduce_by_assignment,
    allreduce,
    get_params,
    init_lenet_params,
    lenet,
    sgd,
    split_batch,
    train_batch,
)

CPU = torch.device("cpu")


def test_functional_lenet_is_the_module_lenet():
    params = init_lenet_params(generator=torch.Generator().manual_seed(0))
    module = LeNet()
    with torch.no_grad():
        for target, source in zip(module.parameters(), params):
            target.copy_(source.T if source.dim() == 2 else source)  # nn.Linear stores (out, in)
    X = torch.randn(4, 1, 28, 28)
    torch.testing.assert_close(lenet(X, params), module(X))


def test_allreduce_writes_the_sum_into_every_tensor_it_was_given():
    data = [torch.full((3,), float(i)) for i in range(1, 4)]
    originals = list(data)
    allreduce(data)
    assert all(a is b for a, b in zip(data, originals))
    assert all(torch.equal(tensor, torch.full((3,), 6.0)) for tensor in originals)


def test_split_batch_cuts_one_slice_per_device_even_when_it_does_not_divide():
    X_shards, y_shards = split_batch(torch.arange(10.0), torch.arange(10), [CPU, CPU, CPU])
    assert [len(part) for part in X_shards] == [4, 3, 3] and torch.equal(torch.cat(y_shards), torch.arange(10))


def test_replicas_on_one_device_are_copies_not_aliases():
    params = init_lenet_params()
    first, second = get_params(params, CPU), get_params(params, CPU)
    # Three separate memories: each call's copies, and the original (a chained != would skip first against params).
    assert all(len({a.data_ptr(), b.data_ptr(), p.data_ptr()}) == 3 for a, b, p in zip(first, second, params))
    assert all(b.data_ptr() == p.data_ptr() for b, p in zip([q.detach().to(CPU) for q in params], params))  # why


def one_step(devices, all_reduce_fn, seed=0):
    params = init_lenet_params(generator=torch.Generator().manual_seed(seed))
    device_params = [get_params(params, device) for device in devices]
    generator = torch.Generator().manual_seed(1)
    X, y = torch.randn(12, 1, 28, 28, generator=generator), torch.randint(0, 10, (12,), generator=generator)
    train_batch(X, y, device_params, devices, lr=0.1, all_reduce=all_reduce_fn)
    return device_params, params, X, y


def test_a_step_on_simulated_devices_equals_one_step_on_the_whole_batch():
    device_params, params, X, y = one_step([CPU, CPU, CPU], allreduce)
    reference = get_params(params, CPU)
    F.cross_entropy(lenet(X, reference), y, reduction="sum").backward()
    sgd(reference, 0.1, len(y))
    for replica in device_params:
        torch.testing.assert_close(replica, reference)


def test_the_assignment_all_reduce_breaks_the_replicas_and_the_in_place_one_does_not():
    in_place, *_ = one_step([CPU, CPU], allreduce)
    by_assignment, *_ = one_step([CPU, CPU], all_reduce_by_assignment)
    assert all(torch.equal(a, b) for a, b in zip(in_place[0], in_place[1]))
    assert not all(torch.equal(a, b) for a, b in zip(by_assignment[0], by_assignment[1]))
    # Device 0 still got the full sum: the damage is to every other replica, silently.
    assert all(torch.equal(a, b) for a, b in zip(by_assignment[0], in_place[0]))
