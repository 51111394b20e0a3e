"""What ``DistributedDataParallel`` does, made visible (lesson 03).

Each function runs on every rank of a process group (``common.launch.run_on_ranks(fn, world_size, ...)``) and
returns what the lesson shows:

- ``weights_before_and_after_ddp``: DDP's constructor broadcasts rank 0's parameters and buffers;
- ``ddp_buckets``: the gradient buckets DDP all-reduces, step by step, and how its arguments change them;
- ``train_on_uneven_inputs``: ranks with different numbers of batches, with and without ``Join``.

They live in a module because a spawned process can only run what it can import: a function defined in a
notebook cell does not exist in the new interpreter.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms import Join
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from common.distributed import replicas_in_sync, set_seed
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


def ddp_buckets(env, configurations: dict, widths=(256,) * 7, steps: int = 2) -> dict:
    """Record the gradient buckets DDP all-reduces, step by step, for an MLP under each set of DDP arguments.

    The model is ``nn.Linear(widths[i], widths[i + 1])`` layers (256 x 256 floats: 257 KiB a layer). A
    communication hook sees every bucket as DDP hands it over: its index, its parameters (named as in
    ``model.named_parameters()``) and its bytes; the hook then all-reduces it as DDP would. For each
    configuration: ``{"steps": [[bucket, ...] per step, in the order DDP launched them], "ready_order": the
    parameters in the order their gradients were accumulated in the first backward, "bucket_cap_bytes"}``.
    """
    results = {}
    for name, ddp_kwargs in configurations.items():
        set_seed(0)
        model = nn.Sequential(*(nn.Linear(n_in, n_out) for n_in, n_out in zip(widths[:-1], widths[1:])))
        names = {parameter: key for key, parameter in model.named_parameters()}
        ready_order = []
        handles = [
            parameter.register_post_accumulate_grad_hook(lambda p: ready_order.append(names[p]))
            for parameter in model.parameters()
        ]
        net = DDP(model, **ddp_kwargs)
        buckets_per_step = []

        def record_then_all_reduce(state, bucket):
            buckets_per_step[-1].append(
                {
                    "index": bucket.index(),
                    "parameters": [names[p] for p in bucket.parameters()],
                    "bytes": bucket.buffer().numel() * bucket.buffer().element_size(),
                }
            )
            return allreduce_hook(None, bucket)  # the default group; divides by the world size, as DDP does

        net.register_comm_hook(None, record_then_all_reduce)
        for step in range(steps):
            buckets_per_step.append([])
            net(torch.randn(4, widths[0])).square().mean().backward()
            if step == 0:
                for handle in handles:
                    handle.remove()
        results[name] = {
            "steps": buckets_per_step,
            "ready_order": ready_order,
            "bucket_cap_bytes": net.bucket_bytes_cap,
        }
    return results


def uneven_batches(rank: int, batch_size: int = 8) -> list:
    """Rank ``rank``'s batches for the uneven-inputs demo: ``4 - rank`` random batches of LeNet inputs and labels."""
    generator = torch.Generator().manual_seed(rank)
    return [
        (
            torch.randn(batch_size, 1, 28, 28, generator=generator),
            torch.randint(0, 10, (batch_size,), generator=generator),
        )
        for _ in range(4 - rank)
    ]


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
