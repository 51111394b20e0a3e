"""Exact distributed evaluation, and the memory and timing figures that the benchmarks report.

``DistributedSampler`` pads a data set until it divides by the world size, by repeating the first indices of
its shuffled permutation (of the data set's first samples only with ``shuffle=False``):
11 test samples on 2 ranks become 12, one counted twice. Averaging per-rank accuracies counts the padding.
``evaluate`` gathers every rank's per-sample results with their data-set indices and keeps one result per
index, so each test sample counts exactly once.
"""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


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
        "world_size": env.world_size, "backend": env.backend, "device": str(env.device),
        "torch_version": torch.__version__,
        **details,
        "history": history,
    }


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has finished the work queued so far.

    CUDA kernels run asynchronously: without this, a clock read after a training step measures how fast
    Python queued the work, not how fast the GPU did it.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory measurement on a CUDA device (on a CPU the process peak cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory in MiB: tensors allocated on ``device`` by this process since the last reset (CUDA), or the
    peak resident memory of the whole process since it started (CPU), which includes Python and PyTorch."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource  # Unix only; PyTorch's CPU distributed backends are too

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


def memory_kind(device: torch.device) -> str:
    """What ``peak_memory_mib`` measures on ``device``, for table headers and plot labels."""
    return "CUDA max_memory_allocated" if device.type == "cuda" else "process peak RSS"
