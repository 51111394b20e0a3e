"""Lab 06 (lesson 09): profile DDP training: where a step's time goes, what starves it, what each rank holds.

    # CPU, 2 processes (gloo), scikit-learn's digits: steps 3-5 profiled, one trace per rank in traces/
    torchrun --standalone --nproc_per_node=2 solutions/06_profiling.py --dataset digits --trace-dir traces

    # a loader that starves training: PNG files decoded and augmented per sample in the main process, from
    # (simulated) slow storage; then the same data with worker processes that prefetch
    torchrun --standalone --nproc_per_node=2 solutions/06_profiling.py --dataset digits --decode-png \
        --read-latency-ms 2 --num-workers 0
    torchrun --standalone --nproc_per_node=2 solutions/06_profiling.py --dataset digits --decode-png \
        --read-latency-ms 2 --num-workers 6 --prefetch-factor 4

    # DDP's buckets on a model with 1.5 M parameters: smaller buckets, more all-reduces per step; TensorBoard
    torchrun --standalone --nproc_per_node=2 solutions/06_profiling.py --dataset digits --model mlp \
        --bucket-cap-mb 1 --tensorboard runs/profiling
    tensorboard --logdir runs/profiling

    # 4 GPUs (NCCL) the same way; --memory-snapshot records CUDA allocations for https://pytorch.org/memory_viz
    torchrun --standalone --nproc_per_node=4 solutions/06_profiling.py --model simplecnn --dataset cifar10 \
        --memory-snapshot snapshot.pickle

Every step runs in four labelled regions (data, forward, backward, optimizer): ``torch.profiler`` records them
in each rank's trace (open it at https://ui.perfetto.dev), and a wall clock times them at every step. Rank 0
prints the profiler's costliest ops, each rank's step broken down from its trace (compute, communication, how
much of it backward hid, all-reduces per step against lesson 08's bucket arithmetic), the bottleneck, device
utilisation and memory from a background monitor, and peak memory per rank. On GPUs rank 0 also prints Holistic
Trace Analysis' view of every rank's trace (HTA, ``pip install holistictraceanalysis``; it reads GPU traces only).
"""

import importlib.util
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.cli import non_negative_float, non_negative_int, options_line, positive_float, positive_int
from common.data import FirstBatches, load_data, make_loader
from common.data_loading import image_folder_splits
from common.ddp_by_hand import assign_buckets
from common.distributed import ConfigurationError, print0, process_group, set_seed
from common.memory import memory_kind, peak_memory_mib
from common.models import MODELS
from common.monitoring import DeviceMonitor, TrainingLog, check_log_dir, format_summaries, gather_summaries
from common.profiling import (
    REGIONS,
    StepRegions,
    bottleneck,
    check_profile_settings,
    hta_breakdown,
    key_averages_table,
    load_trace,
    mean_breakdown,
)

# BEGIN LAB: the profiler: wait, warm up, record; one trace per rank
from common.profiling import step_breakdowns, training_profiler  # noqa: F401  # isort: skip

# END LAB
from common.training import TrainingHistory, finish_run, progress_bar, training_arguments


def parse_args(argv=None):
    parser = training_arguments(__doc__.splitlines()[0])
    parser.add_argument("--trace-dir", type=Path, default=Path("traces"), help="one Chrome trace per rank goes here")
    parser.add_argument("--profile-wait", type=non_negative_int, default=1, help="steps before the profiler starts")
    parser.add_argument("--profile-warmup", type=non_negative_int, default=1, help="steps it runs but discards")
    parser.add_argument("--profile-steps", type=positive_int, default=3, help="steps it records")
    parser.add_argument("--bucket-cap-mb", type=positive_float, default=25.0, help="DDP's gradient bucket size")
    parser.add_argument("--decode-png", action="store_true", help="read digits as PNG files, one sample at a time")
    parser.add_argument("--read-latency-ms", type=non_negative_float, default=0.0, help="simulated wait per file")
    parser.add_argument("--prefetch-factor", type=positive_int, help="batches each worker loads ahead (default 2)")
    parser.add_argument("--tensorboard", type=Path, help="global rank 0 logs scalars for TensorBoard here")
    parser.add_argument("--memory-snapshot", type=Path, help="CUDA only: rank 0's allocation history, a pickle")
    return parser.parse_args(argv)


def main(args):
    with process_group(args.backend) as env:
        train(args, env)


def make_data(args, env, model_class):
    """The data set, and this rank's train and test loaders. ``--decode-png`` reads the digits from PNG files
    through ``ImageFolder``: every sample opened, decoded and augmented in Python, the classic slow pipeline."""
    if args.decode_png:
        if args.dataset != "digits":
            raise ConfigurationError("error: --decode-png writes the digits as PNG files: add --dataset digits")
        data = image_folder_splits(args.data_dir, model_class.input_shape, args.read_latency_ms)
    elif args.read_latency_ms:
        raise ConfigurationError("error: --read-latency-ms slows down reading PNG files: add --decode-png")
    else:
        data = load_data(args.dataset, args.data_dir, model_class.input_shape)
    options = dict(rank=env.rank, world_size=env.world_size, seed=args.seed, num_workers=args.num_workers)
    if args.prefetch_factor and not args.num_workers:
        raise ConfigurationError("error: --prefetch-factor needs worker processes: add --num-workers N (N > 0)")
    # Pinned (page-locked) host memory lets a copy to the GPU run asynchronously (non_blocking=True below).
    train_iter = make_loader(
        data.train,
        args.batch_size,
        train=True,
        pin_memory=env.device.type == "cuda",
        prefetch_factor=args.prefetch_factor,
        **options,
    )
    test_iter = make_loader(data.test, 256, train=False, **options)
    return data, FirstBatches(train_iter, args.max_batches_per_epoch), test_iter


def train(args, env):
    print0(f"{env.summary} | {options_line(args)}")
    if args.memory_snapshot and env.device.type != "cuda":
        raise ConfigurationError("error: --memory-snapshot records CUDA allocations: it needs a GPU per process")
    log_dir = check_log_dir(args.tensorboard) if args.tensorboard else None
    model_class = MODELS[args.model]
    data, train_iter, test_iter = make_data(args, env, model_class)
    # Fail now, not after an epoch, when the profiler's schedule cannot fit the run or the traces cannot be written.
    steps_to_profile = (args.profile_wait, args.profile_warmup, args.profile_steps)
    trace_dir = check_profile_settings(args.trace_dir, *steps_to_profile, steps_available=args.epochs * len(train_iter))

    set_seed(args.seed)
    model = model_class(num_classes=data.num_classes).to(env.device)
    # bucket_cap_mb given: every bucket has that cap (left out, DDP's first bucket would get 1 MiB of its own)
    net = DDP(model, device_ids=env.device_ids, bucket_cap_mb=args.bucket_cap_mb)
    buckets = assign_buckets(list(model.parameters()), int(args.bucket_cap_mb * 2**20))
    set_seed(args.seed, env.rank)
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    if args.memory_snapshot and env.rank == 0:
        torch.cuda.memory._record_memory_history(max_entries=100_000)  # every allocation from here, with its stack

    regions = StepRegions(env.device)  # wall-clock time of each labelled region, at every step
    history = TrainingHistory(env, args.epochs)
    profiler = training_profiler(trace_dir, env.rank, *steps_to_profile, env.device)
    with DeviceMonitor(env.device) as monitor, TrainingLog(log_dir) as tensorboard, profiler:
        for epoch in range(args.epochs):
            train_iter.sampler.set_epoch(epoch)
            history.start_epoch()
            loss_sum, samples = train_one_epoch(net, train_iter, optimizer, env.device, regions, profiler, epoch, args)
            row = history.end_epoch(epoch + 1, net, loss_sum, samples, test_iter)
            timing = mean_breakdown(regions.rows[-len(train_iter) :])  # this epoch's steps
            tensorboard.log(
                epoch + 1,
                {
                    "loss/train": row["train_loss"],
                    "loss/test": row["test_loss"],
                    "accuracy/test": row["test_accuracy"],
                    "throughput/samples_per_s": row["samples"] / row["seconds"],
                    **{f"time_per_step_ms/{name}": timing[f"{name}_ms"] for name in (*REGIONS, "step")},
                    "memory/peak_mib": peak_memory_mib(env.device),
                },
            )
    if args.memory_snapshot and env.rank == 0:
        torch.cuda.memory._dump_snapshot(str(args.memory_snapshot))
        torch.cuda.memory._record_memory_history(enabled=None)
        print0(f"CUDA memory snapshot written to {args.memory_snapshot}: drop it on https://pytorch.org/memory_viz")

    report = profile_report(trace_dir, env, regions, buckets)
    report["monitor"] = monitor.summary()
    report["peak_memory_mib"] = peak_memory_mib(env.device)
    print_report(gather_summaries(report), profiler, env)
    if env.device.type == "cuda":  # HTA reads GPU traces only
        report["hta"] = hta_view(trace_dir, env)
    finish_run(net, history, args, profile=report, bucket_cap_mb=args.bucket_cap_mb)


def train_one_epoch(net, train_iter, optimizer, device, regions, profiler, epoch, args):
    """One pass over this rank's batches, each step in four labelled regions; the profiler steps with them."""
    net.train()
    loss_sum, samples = torch.zeros((), device=device), 0
    batches = iter(train_iter)
    for _ in progress_bar(range(len(train_iter)), f"epoch {epoch + 1}/{args.epochs}"):
        # BEGIN LAB: label the step's four regions: data, forward, backward, optimizer
        with regions("data"):  # waiting for the loader, then the copy to the device
            X, y = next(batches)
            X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with regions("forward"):
            loss = F.cross_entropy(net(X), y)
        with regions("backward"):
            loss.backward()  # DDP all-reduces each bucket as soon as its gradients are ready
        with regions("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        # END LAB
        regions.end_step()
        profiler.step()  # the schedule counts these calls: wait, warm up, record, then write the trace
        loss_sum += loss.detach() * len(y)  # no .item(): that would wait for the GPU at every step
        samples += len(y)
    return loss_sum, samples


def profile_report(trace_dir, env, regions, buckets) -> dict:
    """This rank's figures: its trace's step breakdown (profiled steps) and the wall clock's (every step)."""
    trace_path = trace_dir / f"rank{env.rank}.json"
    steps = step_breakdowns(load_trace(trace_path))
    trace = mean_breakdown(steps)
    timing = regions.summary()
    return {
        "rank": env.rank,
        "trace": str(trace_path),
        "trace_steps": steps,
        "trace_breakdown": trace,
        "trace_bottleneck": bottleneck(trace),
        "timing": timing,
        "timing_bottleneck": bottleneck(timing),
        "predicted_all_reduces": len(buckets),
    }


def print_report(reports: list[dict], profiler, env) -> None:
    """Rank 0 prints the costliest ops, then one row per rank: its trace's breakdown and its wall clock's."""
    print0(f"\nrank 0's costliest ops over the profiled steps:\n{key_averages_table(profiler, env.device)}")
    print0(
        f"traces: {', '.join(report['trace'] for report in reports)} (open them at https://ui.perfetto.dev)\n"
        "\nper profiled step, from each rank's trace (ms):\n"
        "rank |   step |   data | forward | backward | optimizer | other | comm. | exposed | hidden | all-reduces"
    )
    for report in reports:
        b = report["trace_breakdown"]
        hidden = "-" if b["overlap"] is None else f"{b['overlap']:.0%}"
        print0(
            f"{report['rank']:>4} | {b['step_ms']:6.2f} | {b['data_ms']:6.2f} | {b['forward_ms']:7.2f} | "
            f"{b['backward_ms']:8.2f} | {b['optimizer_ms']:9.2f} | {b['other_ms']:5.2f} | "
            f"{b['communication_ms']:5.2f} | {b['exposed_communication_ms']:7.2f} | {hidden:>6} | "
            f"{b['all_reduces']:.0f} (buckets: {report['predicted_all_reduces']})"
        )
    print0("\nper step over the whole run, by the wall clock (ms), and the bottleneck:")
    print0("rank |   step |   data | forward | backward | optimizer | bottleneck (trace / clock) | peak memory MiB")
    for report in reports:
        t = report["timing"]
        print0(
            f"{report['rank']:>4} | {t['step_ms']:6.2f} | {t['data_ms']:6.2f} | {t['forward_ms']:7.2f} | "
            f"{t['backward_ms']:8.2f} | {t['optimizer_ms']:9.2f} | "
            f"{report['trace_bottleneck'] + ' / ' + report['timing_bottleneck']:<26} | "
            f"{report['peak_memory_mib']:,.0f} ({memory_kind(env.device)})"
        )
    print0(f"\ndevice monitor:\n{format_summaries([report['monitor'] for report in reports])}")


def hta_view(trace_dir, env) -> dict | None:
    """Holistic Trace Analysis of every rank's GPU trace in ``trace_dir``, printed and returned by rank 0 (None on
    the other ranks, and where HTA is not installed): per rank, the share of the traced time its GPU sat idle, ran
    compute kernels and ran other kernels (communication, copies), and how much of its communication overlapped
    computation."""
    dist.barrier()  # HTA reads every rank's trace: wait until all of them are written
    if env.rank != 0:
        return None
    if importlib.util.find_spec("hta") is None:
        print0("HTA not installed (pip install holistictraceanalysis): its view skipped")
        return None
    view = hta_breakdown(trace_dir)
    print0("\nHolistic Trace Analysis of the traces (% of each GPU's traced time):")
    print0("rank |   idle | compute | other kernels | communication overlapped by compute")
    for rank, row in view.items():
        print0(
            f"{rank:>4} | {row['idle_time_pctg']:6.1f} | {row['compute_time_pctg']:7.1f} | "
            f"{row['non_compute_time_pctg']:13.1f} | {row['comp_comm_overlap_pctg']:.1f}"
        )
    return view


if __name__ == "__main__":
    main(parse_args())
