"""common/scaling.py: the alpha-beta fit, DDP's bucket sizes, scaling efficiency, all-reduce timing on 2 ranks."""

import random

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.ddp_by_hand import assign_buckets
from common.launch import run_on_ranks
from common.models import DeepMLP
from common.scaling import (
    bucket_bytes,
    bus_bandwidth_gb_s,
    fit_alpha_beta,
    fit_residuals,
    plot_scaling,
    predict_communication_seconds,
    scaling_efficiency,
    time_all_reduce,
    time_bucket_all_reduces,
)
from tests.conftest import REPO, load_script

SIZES = [4**k for k in range(1, 13)]  # 4 B to 16 MiB, as benchmarks/ddp_scaling.py fits
ALPHA, BETA = 50e-6, 1 / 2e9  # 50 us per call, 2 GB/s


def model_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def test_the_fit_recovers_alpha_and_beta_exactly_from_noise_free_times():
    fit = fit_alpha_beta(SIZES, [ALPHA + BETA * n for n in SIZES])
    assert fit["alpha_s"] == pytest.approx(ALPHA, rel=1e-9)
    assert fit["beta_s_per_byte"] == pytest.approx(BETA, rel=1e-9)
    assert fit["bandwidth_gb_s"] == pytest.approx(2.0, rel=1e-9)


def test_the_fit_is_within_a_few_percent_under_noise_and_small_sizes_still_count():
    rng = random.Random(0)
    sizes = SIZES * 3  # three noisy measurements per size
    seconds = [(ALPHA + BETA * n) * (1 + rng.uniform(-0.05, 0.05)) for n in sizes]  # +-5% on every time
    fit = fit_alpha_beta(sizes, seconds)
    assert fit["alpha_s"] == pytest.approx(ALPHA, rel=0.03)
    assert fit["beta_s_per_byte"] == pytest.approx(BETA, rel=0.03)
    # On absolute errors the 16 MiB times (8 ms, +-0.4 ms of noise) alone would set the line, and alpha
    # (50 us) would come out as noise: the relative weighting is what keeps it.
    absolute = torch.linalg.lstsq(
        torch.tensor([[1.0, n] for n in sizes], dtype=torch.float64), torch.tensor(seconds, dtype=torch.float64)
    ).solution.tolist()
    assert abs(absolute[0] - ALPHA) > 3 * abs(fit["alpha_s"] - ALPHA)


def test_the_fit_keeps_alpha_and_beta_non_negative():
    convex = [BETA * n**1.2 for n in SIZES]  # a line through these would cross zero at a negative intercept
    unconstrained = torch.linalg.lstsq(
        torch.tensor([[1 / t, n / t] for n, t in zip(SIZES, convex)], dtype=torch.float64),
        torch.ones(len(SIZES), dtype=torch.float64),
    ).solution.tolist()
    assert unconstrained[0] < 0
    fit = fit_alpha_beta(SIZES, convex)
    assert fit["alpha_s"] == 0.0 and fit["beta_s_per_byte"] > 0

    def relative_error(beta):
        return sum(((beta * n - t) / t) ** 2 for n, t in zip(SIZES, convex))

    # the best beta with alpha = 0, not the unconstrained fit's beta with its alpha cut off
    beta = fit["beta_s_per_byte"]
    assert relative_error(beta) < min(relative_error(beta * 0.99), relative_error(beta * 1.01))
    falling = [ALPHA * (1.2 - 0.02 * i) for i in range(len(SIZES))]  # slower for smaller sizes: a negative slope
    flat = fit_alpha_beta(SIZES, falling)
    assert flat["beta_s_per_byte"] == 0.0 and flat["bandwidth_gb_s"] == float("inf")
    assert flat["alpha_s"] == pytest.approx(ALPHA * 1.09, rel=0.05)


def test_residuals_are_one_on_the_line_and_show_the_size_the_fit_misses():
    seconds = [ALPHA + BETA * n for n in SIZES]
    seconds[7] *= 3  # one size took three times the line's time
    fit = fit_alpha_beta(SIZES, seconds)
    residuals = fit_residuals(SIZES, seconds, fit)
    assert max(range(len(SIZES)), key=residuals.__getitem__) == 7 and residuals[7] > 2
    exact = {"alpha_s": ALPHA, "beta_s_per_byte": BETA}
    assert fit_residuals(SIZES, [ALPHA + BETA * n for n in SIZES], exact) == pytest.approx([1.0] * len(SIZES))
    assert fit_residuals([1000], [2 * (ALPHA + BETA * 1000)], exact) == pytest.approx([2.0])
    with pytest.raises(ValueError, match="sizes but"):
        fit_residuals(SIZES, seconds[:-1], fit)


def test_bus_bandwidth_is_the_algorithm_bandwidth_times_2_n_minus_1_over_n():
    assert bus_bandwidth_gb_s(0.76, 2) == pytest.approx(0.76)  # 2 ranks: the same figure
    assert bus_bandwidth_gb_s(1.0, 4) == pytest.approx(1.5)
    assert bus_bandwidth_gb_s(1.0, 1) == 0.0  # one rank sends nothing
    with pytest.raises(ValueError):
        bus_bandwidth_gb_s(1.0, 0)


def test_predicted_communication_pays_alpha_once_per_bucket():
    fit = {"alpha_s": 1e-4, "beta_s_per_byte": 1e-9}
    assert predict_communication_seconds([1_000, 2_000_000], fit) == pytest.approx(2e-4 + 2_001_000e-9, rel=1e-12)
    assert predict_communication_seconds([], fit) == 0.0
    one, four = predict_communication_seconds([4_000_000], fit), predict_communication_seconds([1_000_000] * 4, fit)
    assert four - one == pytest.approx(3e-4, rel=1e-9)  # the same bytes in four buckets: three more alphas


def test_bucket_bytes_cover_every_trainable_parameter_once_and_follow_assign_buckets():
    model = DeepMLP()  # 5.8 MB of float32 parameters
    parameters = list(model.parameters())
    for cap_mb in (1, 2, 25):
        sizes = bucket_bytes(model, cap_mb)
        assert sum(sizes) == model_bytes(model)
        assert len(sizes) == len(assign_buckets(parameters, cap_mb * 2**20))
    assert len(bucket_bytes(model, 1)) == 5 and len(bucket_bytes(model, 25)) == 1
    # DDP's default: the first bucket (the last parameters) closes at 1 MiB, the rest at 25 MiB
    default = bucket_bytes(model)
    assert len(default) == 2 and 2**20 <= default[0] < 2 * 2**20 and sum(default) == model_bytes(model)
    model.stem[1].weight.requires_grad_(False)  # frozen: no gradient, no bucket
    assert sum(bucket_bytes(model, 1)) == model_bytes(model) < sum(p.numel() * 4 for p in model.parameters())


def test_scaling_efficiency_on_hand_made_throughputs():
    rows = [
        {"nproc": 1, "samples_per_second": 100.0},
        {"nproc": 2, "samples_per_second": 150.0},
        {"nproc": 4, "samples_per_second": 200.0},
    ]
    for mode in ("strong", "weak"):  # samples/s normalise the work: the same arithmetic, different experiments
        result = scaling_efficiency(rows, mode)
        assert [row["speedup"] for row in result] == pytest.approx([1.0, 1.5, 2.0])
        assert [row["efficiency"] for row in result] == pytest.approx([1.0, 0.75, 0.5])
        assert {row["mode"] for row in result} == {mode}
    # strong scaling in times: a fixed global batch of 64 takes 0.64 s, 0.4267 s, 0.32 s per step
    times = [64 / row["samples_per_second"] for row in rows]
    assert [times[0] / t / n for t, n in zip(times, (1, 2, 4))] == pytest.approx([1.0, 0.75, 0.5])
    assert "speedup" not in rows[0]  # the input is left alone
    # without a 1-process row, the smallest count is the baseline, taken as perfectly efficient
    two_and_four = [{"nproc": 2, "samples_per_second": 200.0}, {"nproc": 4, "samples_per_second": 300.0}]
    result = scaling_efficiency(two_and_four, "weak")
    assert [row["efficiency"] for row in result] == pytest.approx([1.0, 0.75])
    with pytest.raises(ValueError, match="mode"):
        scaling_efficiency(rows, "sideways")


def test_the_scaling_plot_is_written(tmp_path):
    rows = [{"nproc": 1, "samples_per_second": 100.0}, {"nproc": 2, "samples_per_second": 150.0}]
    rows = scaling_efficiency(rows, "weak")
    plot_scaling({"weak": rows, "strong": scaling_efficiency(rows, "strong")}, tmp_path / "plots" / "s.png", "test")
    assert (tmp_path / "plots" / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def timings_and_ddp_buckets(env):
    """On each rank: all-reduce times at 4 KiB and 4 MiB, a backward's buckets, and DDP's own rebuilt buckets."""
    small, large = 4 * 2**10, 4 * 2**20
    seconds = time_all_reduce([small, large], 21, env.device)  # medians of 21: stray slow calls on 2 shared cores
    buckets_alone = time_bucket_all_reduces([small, large], 5, env.device)
    ddp_sizes = {}
    for cap_mb in (None, 1):
        torch.manual_seed(0)
        net = DDP(DeepMLP(), bucket_cap_mb=cap_mb)
        X, y = torch.randn(2, *DeepMLP.input_shape), torch.randint(0, 10, (2,))
        for _ in range(3):  # DDP rebuilds its buckets after the first backward (in the order gradients came) and
            # logs their sizes in a later forward
            F.cross_entropy(net(X), y).backward()
        # Private but stable: the sizes DDP logs for its rebuilt buckets, "1071144, 4759552"
        logged = net._get_ddp_logging_data()["rebuilt_bucket_sizes"]
        ddp_sizes[str(cap_mb)] = [int(size) for size in logged.split(",")]
    return {"seconds": seconds, "buckets_alone": buckets_alone, "ddp_sizes": ddp_sizes}


@pytest.fixture(scope="module")
def two_ranks():
    return run_on_ranks(timings_and_ddp_buckets, 2, timeout=90)


@pytest.mark.timeout(120)
def test_all_reduce_times_are_positive_the_same_on_every_rank_and_grow_with_size(two_ranks):
    rank0, rank1 = two_ranks
    assert rank0["seconds"] == rank1["seconds"]  # the slowest rank's time, on every rank
    small, large = rank0["seconds"]
    assert 0 < small < large  # 4 MiB takes longer than 4 KiB: 1024 times the bytes
    assert rank0["buckets_alone"] > 0 and rank0["buckets_alone"] == rank1["buckets_alone"]


@pytest.mark.timeout(120)
def test_bucket_bytes_match_ddps_own_rebuilt_buckets(two_ranks):
    ddp_sizes = two_ranks[0]["ddp_sizes"]
    assert bucket_bytes(DeepMLP()) == ddp_sizes["None"]  # the 1 MiB first bucket of DDP's default
    assert bucket_bytes(DeepMLP(), 1) == ddp_sizes["1"]


@pytest.fixture(scope="module")
def benchmark():
    return load_script(REPO / "benchmarks" / "ddp_scaling.py")


def test_the_benchmark_refuses_a_strong_scaling_batch_that_does_not_divide(benchmark, capsys):
    for mode in ("strong", "both"):
        with pytest.raises(SystemExit) as refused:
            benchmark.parse_args(["--mode", mode, "--nproc", "1", "2", "3", "--batch-size", "64"])
        assert refused.value.code == 2
        assert "64 does not divide by 3" in capsys.readouterr().err
    assert benchmark.parse_args(["--mode", "weak", "--nproc", "3", "--batch-size", "64"]).nproc == [3]
    strong = benchmark.parse_args(["--mode", "strong", "--nproc", "1", "2", "4", "--batch-size", "64"])
    assert [benchmark.per_process_batch("strong", n, strong.batch_size) for n in strong.nproc] == [64, 32, 16]
    assert [benchmark.per_process_batch("weak", n, strong.batch_size) for n in strong.nproc] == [64, 64, 64]


def test_the_benchmark_splits_the_lost_time_into_measured_parts_not_a_fixed_rule(benchmark):
    """Hand-made figures where the old rule (the predicted all-reduce under half the lost time: "compute") was wrong:
    the fit predicted 1 ms of the 10 ms lost, but the buckets measured alone took 8 ms and one process alone with
    the same thread and batch (the control) only 1 ms more than the ideal. The parts come from the measurements
    and add up to the time lost; the largest names what to look at."""
    row = {"nproc": 2, "step_seconds": 0.020, "efficiency": 0.5, "batch_size_per_process": 64}
    communication = {"predicted_s": 0.001, "buckets_alone_s": 0.008}
    control = {"threads": 1, "step_seconds": 0.011, "batch_size_per_process": 64}
    parts = benchmark.step_parts(row, 0.010, communication, control)
    assert parts["lost"] == pytest.approx(0.010)
    assert parts["alone"] == pytest.approx(0.001) and parts["all_reduces"] == 0.008
    assert parts["together"] == pytest.approx(0.001) and parts["predicted"] == 0.001
    assert parts["alone"] + parts["all_reduces"] + parts["together"] == pytest.approx(parts["lost"])
    assert parts["largest"] == "all_reduces"
    sentence = benchmark.describe_parts(row, parts, control)
    assert "of the 10.00 ms lost per step" in sentence and "the all-reduces, measured alone 8.00 ms (80%)" in sentence
    assert sentence.endswith("largest: the all-reduces, measured alone")
    # The same step where the control took 19 ms alone: one thread per process explains the loss, not the network.
    slow_alone = benchmark.step_parts(
        row, 0.010, communication | {"buckets_alone_s": 0.0005}, {**control, "step_seconds": 0.019}
    )
    assert slow_alone["largest"] == "alone" and slow_alone["together"] == pytest.approx(0.0005)
    faster = {**row, "step_seconds": 0.008, "efficiency": 1.25}
    assert "nothing lost" in benchmark.describe_parts(
        faster, benchmark.step_parts(faster, 0.010, communication, control), control
    )


def test_the_benchmark_takes_its_control_with_the_threads_and_batch_of_one_of_the_processes(benchmark, monkeypatch):
    """2 processes x 1 thread: the control is 1 process x 1 thread at their batch; a 1-process scaling run with
    that thread and batch serves (--threads 1), otherwise one more launch (measure is replaced here: no training)."""
    launched = []
    monkeypatch.setattr(
        benchmark,
        "measure",
        lambda n, batch, args, threads=None: (
            launched.append((n, batch, threads)) or {"step_seconds": 1.0, "batch_size_per_process": batch}
        ),
    )
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    one = {"nproc": 1, "batch_size_per_process": 64}
    rows = {
        "weak": [one, {"nproc": 2, "batch_size_per_process": 64}],
        "strong": [one, {"nproc": 2, "batch_size_per_process": 32}],
    }
    benchmark.measure_controls(
        rows, {(1, 64): {"step_seconds": 0.5, "batch_size_per_process": 64}}, benchmark.parse_args(["--threads", "1"])
    )
    assert launched == [(1, 32, 1)]  # batch 64 with 1 thread was the 1-process run itself
    launched.clear()
    controls = benchmark.measure_controls(rows, {}, benchmark.parse_args([]))  # torchrun: 1 thread each of 2
    assert launched == [(1, 64, 1), (1, 32, 1)] and controls[2, 32]["threads"] == 1


def test_the_benchmark_prints_each_sizes_residual_and_the_buckets_and_the_bus_bandwidth(benchmark, capsys):
    """Hand-made timings on the line but one size, at three times it; the model's bucket twice its prediction."""
    sizes = [4, 4096, 1 << 20]
    seconds = [ALPHA + BETA * n for n in sizes]
    seconds[1] *= 3
    row = {"alpha_s": ALPHA, "beta_s_per_byte": BETA, "bandwidth_gb_s": 1 / BETA / 1e9, "sizes_bytes": sizes}
    row |= {"seconds": seconds, "bucket_bytes": [1000], "predicted_s": 0.001, "buckets_alone_s": 0.002}
    benchmark.print_residuals(4, row, benchmark.parse_args(["--model", "lenet"]))
    printed = capsys.readouterr().out
    assert "       4,096       0.156     0.052    3.00x" in printed  # 3 x (50 us + 2.048 us) against the line
    assert "           4       0.050     0.050    1.00x" in printed
    bucket = "lenet's 1 bucket(s), 1,000 bytes, back to back: measured 2.000 ms, fitted 1.000 ms, residual 2.00x"
    bus = "1/beta = 2.00 GB/s of the tensor's bytes (algorithm bandwidth); x 2(N-1)/N = 3.00 GB/s bus bandwidth"
    assert bucket in printed and bus in printed


def test_the_benchmark_refuses_communication_only_without_two_processes(benchmark):
    with pytest.raises(SystemExit, match="give --nproc 2 or more"):
        benchmark.main(benchmark.parse_args(["--nproc", "1", "--communication-only"]))
