"""Scaling (lesson 09): what an all-reduce costs by size, what DDP's buckets cost per step, and scaling efficiency.

- ``time_all_reduce``: ``dist.all_reduce`` timed at several sizes, as the slowest rank saw it;
  ``time_bucket_all_reduces``: one backward's worth of all-reduces (one per DDP bucket), back to back.
- ``fit_alpha_beta``: the latency-bandwidth (alpha-beta) model t(n) = alpha + beta * n fitted to such times;
  ``fit_residuals``: how far each measured time lies from the fitted line; ``bus_bandwidth_gb_s``: an
  algorithm bandwidth as a bus bandwidth (given the fit's 1/beta, the one that large messages approach);
  ``predict_communication_seconds``: what the model predicts for a step's buckets.
- ``bucket_bytes``: the sizes of DDP's gradient buckets for a model (lesson 08's rule, ``assign_buckets``).
- ``scaling_efficiency`` and ``plot_scaling``: speed-up and efficiency from throughputs at several process counts,
  for strong scaling (the global batch fixed) and weak scaling (the batch per process fixed).
"""

import statistics
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from common.ddp_by_hand import assign_buckets
from common.metrics import slowest_rank_seconds

DDP_BUCKET_CAP_MB = 25  # DistributedDataParallel's bucket_cap_mb when it is not given (PyTorch 2.14)
MODES = ("weak", "strong")


def _float32_tensor(size_bytes: int, device) -> torch.Tensor:
    # Zeros: summing them leaves them zeros, so repeated all-reduces never overflow; the time does not depend on
    # the values.
    return torch.zeros(max(1, size_bytes // 4), dtype=torch.float32, device=device)


def _median_seconds(operation, iterations: int, device) -> float:
    operation()  # warm-up: the first call at a size allocates the backend's buffers (NCCL also connects)
    return statistics.median(slowest_rank_seconds(operation, device) for _ in range(iterations))


def time_all_reduce(sizes_bytes: list[int], iterations: int, device) -> list[float]:
    """Seconds of one ``dist.all_reduce`` of a float32 tensor of each of ``sizes_bytes``, one figure per size.

    Each figure is the median over ``iterations`` calls of the slowest rank's time (``slowest_rank_seconds``: a
    barrier, the call, the maximum over ranks), after one warm-up call. Call on every rank; every rank returns the
    same list. A size that is not a multiple of 4 bytes is rounded down to whole float32 elements (at least one).
    """
    seconds = []
    for size in sizes_bytes:
        tensor = _float32_tensor(size, device)
        seconds.append(_median_seconds(lambda: dist.all_reduce(tensor), iterations, device))
    return seconds


def time_bucket_all_reduces(sizes_bytes: list[int], iterations: int, device) -> float:
    """Seconds of one all-reduce per size in ``sizes_bytes``, back to back: a backward's worth of DDP buckets.

    The communication of a step with nothing else running: no backward pass to overlap with or to compete with
    for the cores. Median over ``iterations`` of the slowest rank's time, after a warm-up. Call on every rank.
    """
    tensors = [_float32_tensor(size, device) for size in sizes_bytes]

    def all_buckets():
        for tensor in tensors:  # blocking, one after the other, as a step with no overlap would send them
            dist.all_reduce(tensor)

    return _median_seconds(all_buckets, iterations, device)


def fit_alpha_beta(sizes_bytes: list[int], seconds: list[float]) -> dict:
    """Fit t(n) = alpha + beta * n to the times ``seconds`` of messages of ``sizes_bytes`` bytes.

    Returns ``{"alpha_s", "beta_s_per_byte", "bandwidth_gb_s"}``; the bandwidth is 1 / beta in GB/s (10^9 bytes),
    infinite when beta is 0. alpha is the fixed cost of one call (latency, the backend's set-up), beta the cost of
    each byte. Least squares on the relative errors (t(n) - t) / t, so that every size counts alike: on absolute
    errors the largest sizes alone would set the line, and alpha, which only the small sizes see, would be noise.
    alpha and beta are both kept >= 0 (where the unconstrained fit is negative, the best fit on the boundary).
    ``benchmarks/allreduce_bandwidth.py`` fits point-to-point messages (t = a + n / B) by the same weighting,
    without the bounds.

    For a ring all-reduce of n bytes on N ranks the textbook model is 2(N-1) alpha_link + 2 (N-1)/N n / B_link
    (2(N-1) steps, each a message of n/N bytes over one link: Patarasuk and Yuan 2009; Thakur et al. 2005). This fit
    measures alpha and beta of the whole all-reduce for one world size directly, whatever algorithm the backend
    picked: fit again for another world size.
    """
    if len(sizes_bytes) != len(seconds) or len(sizes_bytes) < 2:
        raise ValueError(f"need two or more (size, seconds) pairs, got {len(sizes_bytes)} and {len(seconds)}")
    n = torch.tensor(sizes_bytes, dtype=torch.float64)
    t = torch.tensor(seconds, dtype=torch.float64)

    def relative_error(alpha: float, beta: float) -> float:
        return float((((alpha + beta * n) - t) / t).square().sum())

    # Dividing each row of the system alpha + beta * n = t by t weights the relative errors equally.
    design = torch.stack([1 / t, n / t], dim=1)
    alpha, beta = torch.linalg.lstsq(design, torch.ones_like(t)).solution.tolist()
    if alpha < 0 or beta < 0:
        # The best fit with alpha, beta >= 0 then lies on an edge: alpha = 0 or beta = 0, each solved in closed form.
        only_beta = (0.0, float((n / t).sum() / (n / t).square().sum()))
        only_alpha = (float((1 / t).sum() / (1 / t).square().sum()), 0.0)
        alpha, beta = min(only_beta, only_alpha, key=lambda fit: relative_error(*fit))
    return {"alpha_s": alpha, "beta_s_per_byte": beta, "bandwidth_gb_s": 1 / beta / 1e9 if beta > 0 else float("inf")}


def fit_residuals(sizes_bytes: list[int], seconds: list[float], fit: dict) -> list[float]:
    """Each measured time over the time ``fit`` (``fit_alpha_beta``'s dict) gives at its size: 1.0 on the line,
    2.0 where the measurement took twice the model's time, 0.5 where it took half. A least-squares line can sit
    close to every point on average and still miss one size by a wide factor: read these before trusting a
    prediction at a size between the measured ones."""
    if len(sizes_bytes) != len(seconds):
        raise ValueError(f"{len(sizes_bytes)} sizes but {len(seconds)} times")
    return [t / (fit["alpha_s"] + fit["beta_s_per_byte"] * n) for n, t in zip(sizes_bytes, seconds)]


def bus_bandwidth_gb_s(algorithm_gb_s: float, world_size: int) -> float:
    """The bus bandwidth of an all-reduce whose algorithm bandwidth (the tensor's bytes over the time) is
    ``algorithm_gb_s`` on ``world_size`` ranks: times 2(N-1)/N, the share of the tensor that each rank of a ring
    sends (nccl-tests' definition, lesson 01). The two are equal at 2 ranks. Given the fit's 1/beta, it is the bus
    bandwidth that large messages approach, once alpha is negligible: one message's bytes over its whole time,
    alpha included, is lower."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, not {world_size}")
    return algorithm_gb_s * 2 * (world_size - 1) / world_size


def fit_all_reduce(env, sizes_bytes: list[int], iterations: int) -> dict:
    """Time ``dist.all_reduce`` at ``sizes_bytes`` in ``env``'s process group and fit alpha and beta to the times
    (``fit_alpha_beta``'s dict, plus the sizes and seconds). Call on every rank, under ``run_on_ranks`` or torchrun."""
    seconds = time_all_reduce(sizes_bytes, iterations, env.device)
    return {"sizes_bytes": sizes_bytes, "seconds": seconds, **fit_alpha_beta(sizes_bytes, seconds)}


def predict_communication_seconds(bucket_bytes: list[int], fit: dict) -> float:
    """Seconds of one all-reduce per DDP bucket, by the alpha-beta ``fit``: the sum of alpha + beta * bytes.

    Each bucket pays alpha once: many small buckets cost more than a few large ones of the same total. This is
    the communication of one step if nothing overlaps it; DDP overlaps it with backward, so the step grows by less.
    """
    return sum(fit["alpha_s"] + fit["beta_s_per_byte"] * size for size in bucket_bytes)


def bucket_bytes(model: nn.Module, bucket_cap_mb: float | None = None) -> list[int]:
    """Bytes of each of DDP's gradient buckets for ``model``, in launch order (lesson 08's ``assign_buckets``).

    ``bucket_cap_mb`` as DDP takes it. Left at ``None``, DDP's default: 25 MiB per bucket, but the first bucket
    (the last parameters, whose gradients come first) is closed at 1 MiB (``dist._DEFAULT_FIRST_BUCKET_BYTES``)
    so that communication starts early; given, one cap for every bucket. Only parameters that require a gradient
    count. The sizes are those of DDP's rebuilt buckets where gradients arrive in reverse ``parameters()`` order
    (a sequential model of ``nn.Linear``: checked against DDP's own for ``DeepMLP`` in tests/test_scaling.py).
    """
    parameters = [p for p in model.parameters() if p.requires_grad]
    if bucket_cap_mb is None:
        first = assign_buckets(parameters, dist._DEFAULT_FIRST_BUCKET_BYTES)[0]
        rest = parameters[: min(first)]  # the parameters before the first bucket's, in parameters() order
        buckets = [first, *(assign_buckets(rest, DDP_BUCKET_CAP_MB * 2**20) if rest else [])]
    else:
        buckets = assign_buckets(parameters, int(bucket_cap_mb * 2**20))
    return [sum(parameters[i].numel() * parameters[i].element_size() for i in bucket) for bucket in buckets]


def scaling_efficiency(rows: list[dict], mode: str) -> list[dict]:
    """``rows`` (dicts with ``nproc`` and ``samples_per_second``) with ``mode``, ``speedup`` and ``efficiency`` added.

    - strong scaling (``"strong"``): the global batch is fixed, so N processes do the same work as one; speed-up
      = t_1 / t_N = thr_N / thr_1, efficiency = speed-up / N.
    - weak scaling (``"weak"``): the batch per process is fixed, so N processes do N times the work per step;
      speed-up (scaled) = thr_N / thr_1, efficiency = thr_N / (N * thr_1) = the time per step at 1 process over
      the time per step at N.

    In samples/s the two come to the same arithmetic: what differs is the experiment (the per-process batch shrinks
    under strong scaling, so each process's compute gets less efficient, and communication takes a larger share).
    thr_1 is the 1-process row's throughput; without one, the smallest count's divided by its count (that count
    taken as perfectly efficient). New dicts; ``rows`` is left as it is.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    smallest = min(rows, key=lambda row: row["nproc"])
    per_process = smallest["samples_per_second"] / smallest["nproc"]
    result = []
    for row in rows:
        speedup = row["samples_per_second"] / per_process
        result.append({**row, "mode": mode, "speedup": speedup, "efficiency": speedup / row["nproc"]})
    return result


def plot_scaling(rows_by_mode: dict[str, list[dict]], path, title: str) -> None:
    """Plot speed-up (against the ideal, N) and efficiency against the process count, one line per mode.

    ``rows_by_mode``: ``{"weak": rows, "strong": rows}`` (either or both), rows as ``scaling_efficiency`` returns
    them. Writes the PNG ``path`` (folders created). ``matplotlib.figure.Figure``, no ``pyplot``: no display needed.
    """
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 4), layout="tight")
    speedup_axes, efficiency_axes = figure.subplots(1, 2)
    counts = sorted({row["nproc"] for rows in rows_by_mode.values() for row in rows})
    speedup_axes.plot(counts, counts, linestyle="--", color="gray", label="ideal (N)")
    efficiency_axes.axhline(100, linestyle="--", color="gray", label="ideal (100%)")
    for mode, rows in rows_by_mode.items():
        rows = sorted(rows, key=lambda row: row["nproc"])
        nproc = [row["nproc"] for row in rows]
        speedup_axes.plot(nproc, [row["speedup"] for row in rows], marker="o", label=f"{mode} scaling")
        efficiency_axes.plot(nproc, [100 * row["efficiency"] for row in rows], marker="o", label=f"{mode} scaling")
    speedup_axes.set(xlabel="processes", ylabel="speed-up (samples/s over 1 process)", title=title)
    efficiency_axes.set(xlabel="processes", ylabel="efficiency (%)", ylim=(0, 110), title="efficiency")
    for axes in (speedup_axes, efficiency_axes):
        axes.set_xticks(counts)
        axes.grid(True, alpha=0.3)
        axes.legend()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
