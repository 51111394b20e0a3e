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
    ``common.batchnorm``. Reports each one's BatchNorm buffers after training, and after one more forward in
    eval mode, without gradients, through the DDP wrapper (as ``common.metrics.evaluate(net, ...)`` runs it).
    Also reports the error of wrapping an ``nn.SyncBatchNorm`` on CPU in DDP.
    """
    variants = {"forward_sync_buffers=True": (True, False), "forward_sync_buffers=False": (False, False),
                "synchronized (common/batchnorm.py)": (True, True)}
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


def ddp_buckets(env, configurations: dict, widths=(256,) * 7, steps: int = 2) -> dict:
    """Record the gradient buckets DDP all-reduces, step by step, for an MLP under each set of DDP arguments.

    The model is ``nn.Linear(widths[i], widths[i + 1])`` layers (256 x 256 floats: 257 KiB a layer). A
    communication hook sees every bucket as DDP hands it over: its index, its parameters (named as in
    ``model.named_parameters()``) and its bytes; the hook then all-reduces it as DDP would. For each
    configuration: ``{"steps": [[bucket, ...] per step, in the order DDP launched them], "ready_order": the
    parameters in the order their gradients were accumulated in the first backward, "bucket_cap_bytes"}``.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    results = {}
    for name, ddp_kwargs in configurations.items():
        set_seed(0)
        model = nn.Sequential(*(nn.Linear(n_in, n_out) for n_in, n_out in zip(widths[:-1], widths[1:])))
        names = {parameter: key for key, parameter in model.named_parameters()}
        ready_order = []
        handles = [parameter.register_post_accumulate_grad_hook(lambda p: ready_order.append(names[p]))
                   for parameter in model.parameters()]
        net = DDP(model, **ddp_kwargs)
        buckets_per_step = []

        def record_then_all_reduce(state, bucket):
            buckets_per_step[-1].append({"index": bucket.index(),
                                         "parameters": [names[p] for p in bucket.parameters()],
                                         "bytes": bucket.buffer().numel() * bucket.buffer().element_size()})
            return allreduce_hook(None, bucket)  # the default group; divides by the world size, as DDP does

        net.register_comm_hook(None, record_then_all_reduce)
        for step in range(steps):
            buckets_per_step.append([])
            net(torch.randn(4, widths[0])).square().mean().backward()
            if step == 0:
                for handle in handles:
                    handle.remove()
        results[name] = {"steps": buckets_per_step, "ready_order": ready_order,
                         "bucket_cap_bytes": net.bucket_bytes_cap}
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


def collective_mistakes(env, timeout_s: float) -> dict:
    """Rank 1 gets a collective wrong three times, each on a new group whose collectives time out after
    ``timeout_s`` seconds; returns, per case, this rank's error message (``None`` if none) and the seconds it took.

    - ``"skipped"``: rank 1 never calls rank 0's all-reduce (it sleeps past the timeout instead), without the
      debug checks, then ``"skipped, DETAIL"`` with them;
    - ``"mismatched shapes, DETAIL"``: rank 0 all-reduces 4 numbers, rank 1 five, with the debug checks.

    The checks are what ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` turns on when ``torch.distributed`` is imported:
    every group created under that level is wrapped in a ``ProcessGroupWrapper``, which before each collective
    waits for all ranks at a monitored barrier and compares their collectives' fingerprints.
    """
    import time
    from datetime import timedelta

    import torch.distributed as dist

    results = {}
    for case, level in (("skipped", dist.DebugLevel.OFF), ("skipped, DETAIL", dist.DebugLevel.DETAIL),
                        ("mismatched shapes, DETAIL", dist.DebugLevel.DETAIL)):
        dist.set_debug_level(level)
        group = dist.new_group(timeout=timedelta(seconds=timeout_s))  # wrapped if the level is DETAIL
        started = time.monotonic()
        try:
            if case.startswith("mismatched"):
                dist.all_reduce(torch.ones(4 if env.rank == 0 else 5), group=group)
            elif env.rank == 0:
                dist.all_reduce(torch.ones(4), group=group)
            else:
                time.sleep(timeout_s + 2)  # alive, but never in the collective: rank 0 is left waiting
            error = None
        except RuntimeError as caught:
            error = str(caught)
        results[case] = {"error": error, "seconds": time.monotonic() - started}
    return results
