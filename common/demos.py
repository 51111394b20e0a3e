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
