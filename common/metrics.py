"""Exact distributed evaluation, a run's summary and the JSON file it goes to, and timing.

``DistributedSampler`` pads a data set until it divides by the world size, by repeating the first indices of
its shuffled permutation (of the data set's first samples only with ``shuffle=False``):
11 test samples on 2 ranks become 12, one counted twice. Averaging per-rank accuracies counts the padding.
``evaluate`` gathers every rank's per-sample results with their data-set indices and keeps one result per
index, so each test sample counts exactly once.

Timing: ``synchronize`` waits for a device's queued work before a clock is read; ``slowest_rank_seconds`` times
one collective call as the slowest rank saw it; ``time_training_steps`` times training steps after a warm-up,
with the peak memory of the same steps.
"""

import json
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from common.checkpoint import atomic_write
from common.distributed import is_main
from common.memory import peak_memory_mib, reset_peak_memory


@torch.no_grad()
def evaluate(model: nn.Module, loader, device: torch.device) -> dict:
    """Loss and accuracy of ``model`` over the whole data set behind ``loader``, every sample once.

    Call it on every rank (it gathers): each rank runs its shard, and all ranks return the same numbers:
    ``{"loss", "accuracy", "count"}``, where ``count`` is the number of distinct samples scored.
    """
    was_training = model.training
    model.eval()
    losses, correct = [], []
    for X, y in loader:
        X, y = X.to(device), y.to(device)
        logits = model(X)
        losses.append(F.cross_entropy(logits, y, reduction="none").double())
        correct.append((logits.argmax(dim=1) == y).double())
    model.train(was_training)

    # The sampler yields this rank's data-set indices in the order the batches came out.
    indices = torch.tensor(list(loader.sampler), dtype=torch.long, device=device)
    results = torch.stack([torch.cat(losses), torch.cat(correct)])  # (2, samples on this rank)
    if dist.is_initialized() and dist.get_world_size() > 1:
        # Every rank holds the same number of samples (that is what the padding is for), so all_gather fits.
        world_size = dist.get_world_size()
        all_indices = [torch.empty_like(indices) for _ in range(world_size)]
        all_results = [torch.empty_like(results) for _ in range(world_size)]
        dist.all_gather(all_indices, indices)
        dist.all_gather(all_results, results)
        indices, results = torch.cat(all_indices), torch.cat(all_results, dim=1)

    size = len(loader.sampler.dataset)
    per_sample = torch.zeros(2, size, dtype=torch.float64, device=device)
    per_sample[:, indices] = results  # a padded duplicate lands on its original's slot: counted once
    seen = torch.zeros(size, dtype=torch.bool, device=device)
    seen[indices] = True
    count = int(seen.sum())
    loss, accuracy = (per_sample.sum(dim=1) / count).tolist()
    return {"loss": loss, "accuracy": accuracy, "count": count}


def run_summary(history: list[dict], env, **details) -> dict:
    """What a solution's ``--metrics-file`` holds: final figures, throughput, epoch times and where it ran.

    ``history`` has one dict per epoch trained in this run, with ``train_loss``, ``test_loss``,
    ``test_accuracy``, ``seconds`` and ``samples`` (over all ranks); ``details`` (data set, batch size...)
    are stored as given. A run that resumed with nothing left to train has no final figures: ``None``.
    """
    last = history[-1] if history else {}
    seconds = sum(epoch["seconds"] for epoch in history)
    return {
        "final_test_accuracy": last.get("test_accuracy"),
        "final_test_loss": last.get("test_loss"),
        "final_train_loss": last.get("train_loss"),
        "samples_per_second": sum(epoch["samples"] for epoch in history) / seconds if seconds else None,
        "epoch_times": [epoch["seconds"] for epoch in history],
        "epochs_run": [epoch["epoch"] for epoch in history],
        "world_size": env.world_size,
        "backend": env.backend,
        "device": str(env.device),
        "torch_version": torch.__version__,
        **details,
        "history": history,
    }


def write_json(path, data: dict) -> None:
    """Write ``data`` as indented JSON, atomically, from global rank 0 only."""
    if is_main():
        atomic_write(path, lambda file: file.write(json.dumps(data, indent=2).encode() + b"\n"))


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has finished the work queued so far.

    CUDA kernels run asynchronously: without this, a clock read after a training step measures how fast
    Python queued the work, not how fast the GPU did it.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def slowest_rank_seconds(operation, device: torch.device) -> float:
    """Seconds one call of ``operation()`` took on the slowest rank, all ranks starting together.

    A barrier first, so that one rank's lateness is not billed to the operation; ``synchronize`` before reading
    the clock; then the maximum over ranks (every rank returns it). Call on every rank.
    """
    dist.barrier()
    start = time.perf_counter()
    operation()
    synchronize(device)
    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def time_training_steps(net: nn.Module, batches, device: torch.device, warmup_steps: int, other_devices=()) -> dict:
    """Train ``net`` with SGD on ``batches``; time the steps after the first ``warmup_steps``.

    Returns ``{"seconds", "samples", "steps", "peak_memory_mib"}`` for the timed steps only; the peak memory is
    ``device``'s, measured from the first timed step. The peak of each of ``other_devices`` is reset at the same
    moment, so that ``peak_memory_mib(other)`` read afterwards covers the same steps.
    """
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    net.train()
    start, samples, steps = None, 0, 0
    for step, (X, y) in enumerate(batches):
        if step == warmup_steps:
            for each in (device, *other_devices):
                synchronize(each)  # CUDA is asynchronous: finish the warm-up before the clock starts
                reset_peak_memory(each)  # every device's peak from the same step on, warm-up left out
            start = time.perf_counter()
        loss = F.cross_entropy(net(X), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if start is not None:
            samples, steps = samples + len(y), steps + 1
    if start is None:
        raise ValueError(f"{len(batches)} batch(es) leave no step to time after {warmup_steps} warm-up step(s)")
    for each in (device, *other_devices):
        synchronize(each)  # the clock stops when the last kernel has run, not when Python queued it
    return {
        "seconds": time.perf_counter() - start,
        "samples": samples,
        "steps": steps,
        "peak_memory_mib": peak_memory_mib(device),
    }
