"""nn.DataParallel's forward pass, by hand (common.data_parallel), against the whole batch on one device."""

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from common.data_parallel import data_parallel_forward
from common.models import LeNet


def batch(size=8):
    generator = torch.Generator().manual_seed(0)
    return torch.randn(size, 1, 28, 28, generator=generator), torch.randint(0, 10, (size,), generator=generator)


def loss_and_gradients(model, forward):
    model.zero_grad()
    X, y = batch()
    loss = F.cross_entropy(forward(X), y)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def count_forward_batches(model):
    sizes = []
    model.register_forward_pre_hook(lambda module, args: sizes.append(len(args[0])))
    return sizes


@pytest.mark.parametrize("replicas", [2, 3])
def test_replicas_gradients_sum_into_the_original_parameters(replicas):
    torch.manual_seed(0)
    model = LeNet()
    whole_loss, whole_grads = loss_and_gradients(model, model)
    sizes = count_forward_batches(model)
    # "cpu:0", "cpu:1", ... make real copies that autograd records, as between GPUs ("cpu" would share the
    # original tensors): the replicas' gradients must come back through those copies and add up in the original.
    devices = [f"cpu:{i}" for i in range(replicas)]
    loss, grads = loss_and_gradients(model, lambda X: data_parallel_forward(model, X, devices))
    # one replica per chunk (threads may start in any order)
    assert sorted(sizes) == sorted(len(chunk) for chunk in torch.arange(8).chunk(replicas))
    torch.testing.assert_close(loss, whole_loss)
    torch.testing.assert_close(grads, whole_grads)


class ScaleWhileTheOtherReplicaRuns(nn.Module):
    """``X * weight``, the weight read while both replicas' threads are inside ``forward``."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.tensor(3.0))

    def forward(self, X):
        BOTH_REPLICAS_INSIDE.wait(timeout=30)  # both threads have set up their replica and started
        weight = self.weight
        SEEN_WEIGHTS.append(weight)
        BOTH_REPLICAS_INSIDE.wait(timeout=30)  # neither thread has finished (and tidied up) before both read
        return X * weight


BOTH_REPLICAS_INSIDE = threading.Barrier(2)
SEEN_WEIGHTS = []


def test_two_replicas_run_at_once_in_threads_each_on_its_own_copy_of_the_parameters():
    # "cpu:0" and "cpu:1" make real copies, as two GPUs would: each replica must read its own copy of the weight,
    # not the other thread's nor the original, and the module must hold its own parameter afterwards.
    SEEN_WEIGHTS.clear()
    model = ScaleWhileTheOtherReplicaRuns()
    original = model.weight
    X = torch.arange(4.0)
    out = data_parallel_forward(model, X, ["cpu:0", "cpu:1"])
    out.sum().backward()
    assert model.weight is original, "the call left a replica's tensor in the module"
    assert len(SEEN_WEIGHTS) == 2 and SEEN_WEIGHTS[0] is not SEEN_WEIGHTS[1], "both replicas read the same tensor"
    assert all(weight is not original for weight in SEEN_WEIGHTS), "a replica read the original, not its copy"
    torch.testing.assert_close(out, X * 3.0)
    torch.testing.assert_close(original.grad, X.sum())  # both replicas' gradients reach the original


def test_a_wrong_gather_order_is_caught():
    # The same comparison must fail if outputs are concatenated in the wrong order.
    torch.manual_seed(0)
    model = LeNet()
    _, whole_grads = loss_and_gradients(model, model)
    _, grads = loss_and_gradients(model, lambda X: data_parallel_forward(model, X.flip(0), ["cpu", "cpu"]))
    with pytest.raises(AssertionError):
        torch.testing.assert_close(grads, whole_grads)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what DataParallel does on a machine without CUDA")
def test_without_gpus_dataparallel_calls_the_module_once_on_the_whole_batch():
    model = nn.Linear(4, 2)
    net = nn.DataParallel(model)
    sizes = count_forward_batches(model)
    net(torch.randn(6, 4))
    assert net.device_ids == [] and sizes == [6]


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nn.DataParallel needs 2 or more GPUs to split a batch")
def test_dataparallel_on_two_gpus_matches_the_by_hand_version_and_the_whole_batch():
    torch.manual_seed(0)
    model = LeNet().to("cuda:0")
    whole_loss, whole_grads = loss_and_gradients(model, lambda X: model(X.to("cuda:0")))
    _, dp_grads = loss_and_gradients(model, lambda X: nn.DataParallel(model, device_ids=[0, 1])(X.to("cuda:0")))
    _, hand_grads = loss_and_gradients(model, lambda X: data_parallel_forward(model, X, ["cuda:0", "cuda:1"]))
    torch.testing.assert_close(dp_grads, whole_grads)
    torch.testing.assert_close(hand_grads, whole_grads)
