"""Data parallelism from scratch, in one process, the d2l way (lesson 01).

A functional LeNet whose parameters are a plain list, copied to every device; each device computes gradients
on its slice of the batch; the gradients are summed across devices and every replica takes the same step.
With no GPU, "devices" are CPU tensors standing in for GPUs: that shows the algorithm is correct, not that it
is fast.

The functions keep the names of d2l's chapter, which lesson 01 reproduces (``allreduce``, ``split_batch``,
``train_batch``); what this course adds is spelled as PyTorch spells it, ``all_reduce``.
"""

import torch
import torch.nn.functional as F


def init_lenet_params(in_channels: int = 1, num_classes: int = 10, scale: float = 0.01, generator=None):
    """LeNet's weights and biases as a list: conv 20@3x3, conv 50@5x5, fc 800->128, fc 128->classes."""

    def normal(*shape):
        return torch.randn(*shape, generator=generator) * scale

    return [
        normal(20, in_channels, 3, 3),
        torch.zeros(20),
        normal(50, 20, 5, 5),
        torch.zeros(50),
        normal(800, 128),
        torch.zeros(128),
        normal(128, num_classes),
        torch.zeros(num_classes),
    ]


def lenet(X, params):
    """LeNet's forward pass on 1x28x28 images, with its weights passed in (no nn.Module)."""
    h = F.avg_pool2d(F.relu(F.conv2d(X, params[0], params[1])), kernel_size=2, stride=2)
    h = F.avg_pool2d(F.relu(F.conv2d(h, params[2], params[3])), kernel_size=2, stride=2)
    h = F.relu(h.reshape(h.shape[0], -1) @ params[4] + params[5])
    return h @ params[6] + params[7]


def get_params(params, device):
    """A copy of ``params`` on ``device``, each tensor a leaf that collects gradients.

    ``copy=True`` matters: ``p.to(device)`` returns ``p`` itself when it already lives there, so replicas on one
    device (simulated devices on the CPU, or two replicas on one GPU) would silently share a single tensor.
    """
    return [p.detach().to(device, copy=True).requires_grad_() for p in params]


def allreduce(data):
    """Sum the tensors in ``data`` (one per device) and write the sum back INTO each of them.

    In place matters: ``data`` holds the very tensors the replicas' parameters point at (their ``.grad``).
    ``data[i] = total`` would only rebind a list slot; the replica would keep its own partial gradient.
    """
    for i in range(1, len(data)):
        data[0][:] += data[i].to(data[0].device)
    for i in range(1, len(data)):
        data[i][:] = data[0].to(data[i].device)


def all_reduce_by_assignment(data):
    """The broken variant, kept to show why it breaks: the broadcast assigns to list slots instead of writing.

    Device 0 gets the full sum; every other replica keeps its own partial gradient, and the replicas drift.
    """
    for i in range(1, len(data)):
        data[0][:] += data[i].to(data[0].device)
    for i in range(1, len(data)):
        data[i] = data[0].to(data[i].device)  # rebinds the slot; replica i's .grad is untouched


def split_batch(X, y, devices):
    """Cut a batch into one slice per device (sizes differ by at most one) and move each slice there."""
    return (
        [part.to(device) for part, device in zip(X.tensor_split(len(devices)), devices)],
        [part.to(device) for part, device in zip(y.tensor_split(len(devices)), devices)],
    )


def sgd(params, lr, batch_size):
    """Minibatch SGD on gradients of a SUMMED loss: divide by the batch size here (as d2l.sgd does)."""
    with torch.no_grad():
        for param in params:
            param -= lr * param.grad / batch_size
            param.grad.zero_()


def train_batch(X, y, device_params, devices, lr, all_reduce=allreduce):
    """One data-parallel step: forward and backward on every device's slice, sum the gradients, update."""
    X_shards, y_shards = split_batch(X, y, devices)
    losses = [
        F.cross_entropy(lenet(X_shard, params), y_shard, reduction="sum")
        for X_shard, y_shard, params in zip(X_shards, y_shards, device_params)
    ]
    for loss in losses:  # each device's backward fills its own replica's .grad
        loss.backward()
    with torch.no_grad():
        for i in range(len(device_params[0])):  # one allreduce per parameter tensor
            all_reduce([params[i].grad for params in device_params])
    for params in device_params:  # every replica applies the same summed gradient
        sgd(params, lr, X.shape[0])
