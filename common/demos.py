"""Functions that the notebooks run on several processes (``common.launch.run_on_ranks``).

They live here because a spawned process can only run what it can import: a function defined in a notebook
cell does not exist in the new interpreter.
"""

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from common.models import LeNet


def weights_before_and_after_ddp(env) -> dict:
    """Initialise LeNet with a different seed on each rank, wrap it in DDP, and report a few weights.

    DDP's constructor broadcasts rank 0's parameters and buffers, so after wrapping every rank holds rank 0's.
    """
    torch.manual_seed(env.rank)  # deliberately different on every rank
    model = LeNet()
    last_bias = model.classifier[-1].bias
    before = last_bias[:3].tolist()
    DDP(model)
    return {"before": before, "after": last_bias[:3].tolist()}


def hand_made_allreduces(env, size: int = 10) -> dict:
    """Run the naive and the ring allreduce on a tensor of ``size`` (need not divide by the world size) and
    report whether each equals ``dist.all_reduce``'s result."""
    import torch.distributed as dist

    from common.collectives import naive_all_reduce, ring_all_reduce

    data = torch.arange(size, dtype=torch.float64) * (env.rank + 1)
    expected = data.clone()
    dist.all_reduce(expected)
    return {"naive": torch.equal(naive_all_reduce(data.clone()), expected),
            "ring": torch.equal(ring_all_reduce(data.clone()), expected), "sum": expected[:4].tolist()}
