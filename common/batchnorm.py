"""Synchronized BatchNorm by hand: what ``nn.SyncBatchNorm`` computes, written with ``dist.all_reduce``.

In training, BatchNorm normalises each channel with the mean and variance of the batch it is given. Under DDP
a rank is given only its shard, so each rank normalises with different statistics. Its running averages are
no better: DDP (``forward_sync_buffers=True``, the default) broadcasts rank 0's buffers at the start of every
forward, so they are the averages of rank 0's shard, each other rank's moved by its own last batch
(``batch_norm_statistics_through_ddp`` shows it). ``nn.SyncBatchNorm`` combines the statistics of
all ranks first, so every rank normalises with those of the whole global batch, and keeps their running
averages, exactly as one process holding the whole batch would.

In PyTorch 2.14 ``nn.SyncBatchNorm`` runs on GPUs only: in training mode, with CPU tensors, whenever a process
group is initialised (a world of one included) its forward raises ``ValueError``. The functions here do the
same arithmetic on any device and backend, gloo included, so the course can show it on CPUs. For training on
GPUs, use the real layer:
``model = nn.SyncBatchNorm.convert_sync_batchnorm(model)`` before wrapping the model in DDP.

The last functions of this module are lesson 03's demonstrations, run on every rank with
``common.launch.run_on_ranks``: BatchNorm's statistics per rank, synchronized or not, and through DDP.
"""

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.distributed import set_seed
from common.models import SimpleCNN


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
            synchronized = SynchronizedBatchNorm2d(
                child.num_features, child.eps, child.momentum, child.affine, child.track_running_stats
            )
            synchronized.load_state_dict(child.state_dict(), assign=True)  # the same tensors, on their device
            synchronized.train(child.training)
            setattr(model, name, synchronized)
        else:
            synchronize_batch_norms(child)
    return model


# Lesson 03's demonstrations: BatchNorm on one batch split over ranks, and BatchNorm's buffers under DDP.


def batch_norm_batch() -> torch.Tensor:
    """The fixed batch of the BatchNorm demo: 16 random 3x32x32 images, the last 8 brighter by 2.

    Split over two ranks, rank 1 gets the bright half: the two halves have clearly different statistics.
    """
    X = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    X[8:] += 2
    return X


def batch_norm_across_ranks(env) -> dict:
    """Run SimpleCNN's convolutional layers, in training mode, on this rank's share of ``batch_norm_batch()``.

    Three times, from the same weights: with its plain BatchNorms ("plain"), with the hand-made synchronized
    ones of this module ("synchronized"), and, when CUDA is available, with ``nn.SyncBatchNorm``
    ("sync_batchnorm", on the GPU: PyTorch 2.14 has it for GPUs only). Reports each one's output and buffers.
    """
    X = batch_norm_batch().chunk(env.world_size)[env.rank]
    conversions = {"plain": lambda model: model, "synchronized": synchronize_batch_norms}
    if torch.cuda.is_available():
        conversions["sync_batchnorm"] = nn.SyncBatchNorm.convert_sync_batchnorm
        torch.backends.cudnn.conv.fp32_precision = "ieee"  # no TF32: the GPU's numbers must compare with the CPU's
    results = {}
    for name, convert in conversions.items():
        # run_on_ranks joins the ranks with gloo on CPU; gloo also carries CUDA tensors, so two processes can
        # share one GPU here.
        device = (
            torch.device("cuda", env.local_rank % torch.cuda.device_count()) if name == "sync_batchnorm" else env.device
        )
        set_seed(0)  # the same initial weights on every rank and for every variant
        model = convert(SimpleCNN()).to(device)
        features = model.features(X.to(device))  # training mode: BatchNorm normalises with batch statistics
        results[name] = {
            "features": features.detach().cpu(),
            "buffers": {key: value.cpu() for key, value in model.named_buffers()},
        }
    return results


def ddp_batch_norm_batch(rank: int, step: int) -> torch.Tensor:
    """Rank ``rank``'s input at ``step`` in the DDP BatchNorm demo: 4 random 2-channel 3x3 images, rank 1's
    brighter by 2, so that each rank's statistics are told apart at a glance."""
    return torch.randn(4, 2, 3, 3, generator=torch.Generator().manual_seed(100 * rank + step)) + 2 * rank


def running_statistics(batches, momentum: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """BatchNorm2d's ``running_mean`` and ``running_var`` after training-mode forwards on ``batches``, by hand.

    From the initial 0 and 1, each batch moves them ``momentum`` of the way to its per-channel mean and its
    unbiased variance (over the batch, height and width).
    """
    mean, var = torch.zeros(batches[0].shape[1]), torch.ones(batches[0].shape[1])
    for X in batches:
        mean = (1 - momentum) * mean + momentum * X.mean(dim=(0, 2, 3))
        var = (1 - momentum) * var + momentum * X.var(dim=(0, 2, 3), correction=1)
    return mean, var


def batch_norm_statistics_through_ddp(env, steps: int = 3) -> dict:
    """Train a lone ``nn.BatchNorm2d(2)`` with DDP for ``steps`` steps on ``ddp_batch_norm_batch(rank, step)``.

    Three ways: DDP's default ``forward_sync_buffers=True`` (at the start of every forward, DDP broadcasts rank
    0's buffers to every rank), ``forward_sync_buffers=False``, and the hand-made synchronized BatchNorm of
    this module. Reports each one's BatchNorm buffers after training, and after one more forward in
    eval mode, without gradients, through the DDP wrapper (as ``common.metrics.evaluate(net, ...)`` runs it).
    Also reports the error of wrapping an ``nn.SyncBatchNorm`` on CPU in DDP.
    """
    variants = {
        "forward_sync_buffers=True": (True, False),
        "forward_sync_buffers=False": (False, False),
        "synchronized (common/batchnorm.py)": (True, True),
    }
    results = {}
    for name, (forward_sync_buffers, synchronized) in variants.items():
        set_seed(0)
        model = nn.Sequential(nn.BatchNorm2d(2))
        if synchronized:
            synchronize_batch_norms(model)
        net = DDP(model, forward_sync_buffers=forward_sync_buffers)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(steps):
            optimizer.zero_grad()
            net(ddp_batch_norm_batch(env.rank, step)).square().mean().backward()
            optimizer.step()
        trained = {key: value.clone() for key, value in model[0].named_buffers()}
        net.eval()
        with torch.no_grad():
            net(ddp_batch_norm_batch(env.rank, steps))  # eval mode: BatchNorm reads its buffers, changes nothing
        results[name] = {"trained": trained, "evaluated_through_ddp": dict(model[0].named_buffers())}
    try:
        DDP(nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(2))))
        results["sync_batchnorm_on_cpu"] = "no error"
    except ValueError as error:
        results["sync_batchnorm_on_cpu"] = f"ValueError: {error}"
    return results
