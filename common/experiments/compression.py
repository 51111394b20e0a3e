"""What notebook 10 and the tests of lesson 10 run with common.compression: a communication hook called without DDP
on a bucket built by hand, and error feedback at work on a constant gradient."""

import math

import torch
import torch.distributed as dist

from common.compression import PowerSGDByHand


class HandMadeBucket:
    """What a communication hook uses of DDP's ``GradBucket``, built by hand to call a hook without DDP: a flat
    buffer, views of it shaped as the gradients, the parameters (the same objects at every call: the hook's memory is
    keyed by them), and where the bucket stands among the step's ``count`` buckets."""

    def __init__(self, index: int, count: int, gradients: list[torch.Tensor]):
        self._index, self._count = index, count
        self._buffer = torch.cat([g.reshape(-1) for g in gradients])
        self._shapes = [g.shape for g in gradients]
        self._parameters = [torch.zeros(shape) for shape in self._shapes]

    def buffer(self):
        return self._buffer

    def gradients(self):
        views, offset = [], 0
        for shape in self._shapes:
            views.append(self._buffer[offset : offset + math.prod(shape)].view(shape))
            offset += math.prod(shape)
        return views

    def parameters(self):
        return self._parameters

    def index(self):
        return self._index

    def is_last(self):
        return self._index == self._count - 1


def constant_gradient_drift(env, hook, use_error_feedback: bool, steps: int, rank: int = 1) -> list[float]:
    """Error feedback at work: every step hands ``hook`` (a PowerSGD hook) the same full-rank 16 x 12 gradient, one
    per rank, to compress at ``rank`` with warm start from step 2. Returns, after each compressed step, how far the
    mean of what the hook has delivered is from the true mean gradient, relative to its norm. Without error
    feedback the same part is dropped every step and the distance stays; with it the distance shrinks like
    1/steps. Call on every rank (the hook all-reduces)."""
    gradient = torch.randn(16, 12, generator=torch.Generator().manual_seed(300 + env.rank))
    mean = gradient.clone()
    dist.all_reduce(mean)
    mean /= env.world_size
    state = PowerSGDByHand(None, rank, 2, 1, use_error_feedback, True, random_seed=0)
    bucket, delivered, distances = HandMadeBucket(0, 1, [gradient]), torch.zeros_like(gradient), []
    for step in range(steps + 2):
        bucket.buffer().copy_(gradient.reshape(-1))
        hook(state, bucket).wait()
        if step >= 2:  # the first two steps are plain all-reduce (start_powerSGD_iter=2)
            delivered += bucket.gradients()[0]
            distances.append(float((delivered / (step - 1) - mean).norm() / mean.norm()))
    return distances
