"""Synchronized BatchNorm by hand: what ``nn.SyncBatchNorm`` computes, written with ``dist.all_reduce``.

In training, BatchNorm normalises each channel with the mean and variance of the batch it is given. Under DDP
a rank is given only its shard, so each rank normalises with different statistics. Its running averages are
no better: DDP (``forward_sync_buffers=True``, the default) broadcasts rank 0's buffers at the start of every
forward, so they are the averages of rank 0's shard, each other rank's moved by its own last batch
(``common.demos.batch_norm_statistics_through_ddp`` shows it). ``nn.SyncBatchNorm`` combines the statistics of
all ranks first, so every rank normalises with those of the whole global batch, and keeps their running
averages, exactly as one process holding the whole batch would.

In PyTorch 2.14 ``nn.SyncBatchNorm`` runs on GPUs only: in training mode, with CPU tensors, whenever a process
group is initialised (a world of one included) its forward raises ``ValueError``. The functions here do the same arithmetic on any device and backend, gloo
included, so the course can show it on CPUs. For training on GPUs, use the real layer:
``model = nn.SyncBatchNorm.convert_sync_batchnorm(model)`` before wrapping the model in DDP.
"""

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import functional as F


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks in forward, and in backward too: every rank's output depends on every rank's input."""

    @staticmethod
    def forward(ctx, tensor):
        tensor = tensor.clone()
        dist.all_reduce(tensor)  # SUM
        return tensor

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


def sum_over_ranks(tensor: Tensor) -> Tensor:
    """The sum of ``tensor`` over all ranks, differentiable (the gradient is summed over ranks as well).

    Without a process group, or in a world of one, it is ``tensor`` itself. Call it on every rank.
    """
    if dist.is_initialized() and dist.get_world_size() > 1:
        return _AllReduceSum.apply(tensor)
    return tensor


def synchronized_batch_norm(x: Tensor, bn: nn.modules.batchnorm._BatchNorm) -> Tensor:
    """Apply ``bn`` to ``x`` in training mode with the mean and variance of the batches of all ranks together.

    Two all-reduces per call: the per-channel sum with the element count gives the global mean; then the sum
    of squared deviations from that mean gives the global (biased) variance. The single pass E[x^2] - E[x]^2
    would need one all-reduce only, but it loses digits when the mean is large next to the spread.
    ``nn.SyncBatchNorm`` also gets away with one collective: it all-gathers each rank's mean, inverse
    standard deviation and count.

    ``bn``'s running statistics are updated as BatchNorm updates them: ``momentum`` (or the cumulative average
    when it is ``None``), the unbiased variance, ``num_batches_tracked``. Gradients flow through the
    all-reduces, so the backward pass matches a single process too. Call it on every rank. In eval mode it
    normalises with the running statistics, as BatchNorm does: no communication.
    """
    if not bn.training:
        return F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, training=False, eps=bn.eps)
    dims = [0, *range(2, x.dim())]  # every dimension but the channels
    shape = [1, -1] + [1] * (x.dim() - 2)  # a per-channel vector, shaped to broadcast over x
    local_count = torch.tensor([x.numel() / x.shape[1]], dtype=x.dtype, device=x.device)  # values per channel
    total_and_count = sum_over_ranks(torch.cat([x.sum(dims), local_count]))
    count = total_and_count[-1]
    mean = total_and_count[:-1] / count
    var = sum_over_ranks(((x - mean.view(shape)) ** 2).sum(dims)) / count  # biased: what normalisation uses

    if bn.track_running_stats:
        with torch.no_grad():
            bn.num_batches_tracked += 1
            momentum = 1 / bn.num_batches_tracked.item() if bn.momentum is None else bn.momentum
            bn.running_mean.lerp_(mean, momentum)
            bn.running_var.lerp_(var * count / (count - 1), momentum)  # unbiased, as BatchNorm keeps it

    y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + bn.eps)
    return y * bn.weight.view(shape) + bn.bias.view(shape) if bn.affine else y


class SynchronizedBatchNorm2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` whose training-mode forward is ``synchronized_batch_norm``: the hand-made SyncBatchNorm."""

    def forward(self, x: Tensor) -> Tensor:
        return synchronized_batch_norm(x, self)


def synchronize_batch_norms(model: nn.Module) -> nn.Module:
    """Replace every ``nn.BatchNorm2d`` in ``model`` by a ``SynchronizedBatchNorm2d`` with the same state.

    The hand-made counterpart of ``nn.SyncBatchNorm.convert_sync_batchnorm(model)``: call it before wrapping
    the model in DDP. Returns ``model``, changed in place.
    """
    for name, child in model.named_children():
        if type(child) is nn.BatchNorm2d:
            synchronized = SynchronizedBatchNorm2d(child.num_features, child.eps, child.momentum, child.affine,
                                                   child.track_running_stats)
            synchronized.load_state_dict(child.state_dict(), assign=True)  # the same tensors, on their device
            synchronized.train(child.training)
            setattr(model, name, synchronized)
        else:
            synchronize_batch_norms(child)
    return model
