"""Functions that the notebooks run on several processes (``common.launch.run_on_ranks``).

They live here because a spawned process can only run what it can import: a function defined in a notebook
cell does not exist in the new interpreter.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from common.batchnorm import synchronize_batch_norms
from common.distributed import replicas_in_sync, set_seed
from common.models import LeNet, SimpleCNN


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
    ones of ``common.batchnorm`` ("synchronized"), and, when CUDA is available, with ``nn.SyncBatchNorm``
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
        device = torch.device("cuda", env.local_rank % torch.cuda.device_count()) if name == "sync_batchnorm" \
            else env.device
        set_seed(0)  # the same initial weights on every rank and for every variant
        model = convert(SimpleCNN()).to(device)
        features = model.features(X.to(device))  # training mode: BatchNorm normalises with batch statistics
        results[name] = {"features": features.detach().cpu(),
                         "buffers": {key: value.cpu() for key, value in model.named_buffers()}}
    return results


def uneven_batches(rank: int, batch_size: int = 8) -> list:
    """Rank ``rank``'s batches for the uneven-inputs demo: ``4 - rank`` random batches of LeNet inputs and labels."""
    generator = torch.Generator().manual_seed(rank)
    return [(torch.randn(batch_size, 1, 28, 28, generator=generator),
             torch.randint(0, 10, (batch_size,), generator=generator)) for _ in range(4 - rank)]


def train_on_uneven_inputs(env, use_join: bool, lr: float = 0.1) -> dict:
    """Train LeNet with DDP and SGD on ``uneven_batches(rank)``: rank 0 has one batch more than rank 1.

    With ``use_join`` the loop runs inside ``Join([model])``: a rank that runs out of batches keeps answering
    the others' gradient all-reduces (with zeros) until every rank is done. Without it, rank 0's last gradient
    all-reduce has no partner but the next collective of rank 1, the all-reduce of ``replicas_in_sync``: gloo
    pairs the two, finds different sizes and aborts rank 0, and rank 1 fails too. Reports the steps this rank
    ran, its parameters, and whether the replicas are in sync.
    """
    set_seed(0)
    model = DDP(LeNet())
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    steps = 0
    with Join([model], enable=use_join):
        for X, y in uneven_batches(env.rank):
            optimizer.zero_grad()
            F.cross_entropy(model(X), y).backward()  # DDP all-reduces the gradients here
            optimizer.step()
            steps += 1
    # replicas_in_sync is a collective too: called after the Join block, it runs on every rank at the same point.
    return {"steps": steps, "in_sync": replicas_in_sync(model), "params": [p.detach() for p in model.parameters()]}
