"""Lab 08 (lesson 02): DataParallel against DistributedDataParallel, same model, data and global batch.

YOUR TASK: fill in the two TODOs below: the timing loop ``measure`` (warm-up steps off the clock, the clock
read only after the device has finished its work, peak memory from the first timed step), and the
``nn.DataParallel`` wrap in ``measure_dataparallel``. Check your work with

    LAB_TARGET=labs .venv/bin/python -m pytest tests/labs/test_08_dp_vs_ddp.py

The DataParallel part runs only on a machine with 2 or more GPUs; the tests check the rest on any machine.

DDP runs first, one process per device, each on its slice of the global batch. Then global rank 0 alone runs
``nn.DataParallel`` over as many GPUs as there were DDP processes, on the whole global batch, which it
scatters from GPU 0 as DataParallel does. Both report samples/s and peak memory per device; global rank 0
writes a table (``results.md``), the figures (``results.json``) and a plot (``results.png``).

    # 4 GPUs: DDP on 4 processes, then DataParallel on the same 4 GPUs
    torchrun --standalone --nproc_per_node=4 solutions/08_dp_vs_ddp.py

    # CPU, 2 processes (gloo): DDP alone; DataParallel needs 2 or more GPUs and is reported as skipped
    torchrun --standalone --nproc_per_node=2 solutions/08_dp_vs_ddp.py --model lenet

On CPUs, memory is each process's peak resident memory (Python and PyTorch included), not a device figure.
"""

import argparse
import gc
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from common.checkpoint import write_json
from common.cli import non_negative_int, positive_int
from common.distributed import BACKENDS, print0, set_seed, setup_distributed, teardown_distributed
from common.metrics import memory_kind, peak_memory_mib, reset_peak_memory, synchronize
from common.models import MODELS

NUM_CLASSES = 10


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="simplecnn")
    parser.add_argument("--batch-size", type=positive_int, default=64,
                        help="per device: the global batch is this times the number of processes")
    parser.add_argument("--steps", type=positive_int, default=20, help="timed training steps per mode")
    parser.add_argument("--warmup-steps", type=non_negative_int, default=3,
                        help="untimed steps first: first allocations, library handles created on first use, "
                             "DDP's one-time bucket rebuild (in its second step)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=BACKENDS, default="auto", help="auto: NCCL if every process has a GPU")
    parser.add_argument("--results-dir", type=Path, default=Path("runs/08_dp_vs_ddp"),
                        help="global rank 0 writes results.json, results.md and results.png here")
    return parser.parse_args(argv)


def main(args):
    env = setup_distributed(args.backend)
    try:
        compare(args, env)
    finally:
        teardown_distributed()


def compare(args, env):
    model_class = MODELS[args.model]
    global_batch = args.batch_size * env.world_size
    print0(f"{args.model}, {global_batch} samples per step ({args.batch_size} per device x {env.world_size}), "
           f"{args.warmup_steps} warm-up + {args.steps} timed steps")
    # One global batch from a fixed generator: DDP rank r trains on slice r of it, DataParallel on all of it.
    generator = torch.Generator().manual_seed(args.seed)
    X = torch.randn(global_batch, *model_class.input_shape, generator=generator)
    y = torch.randint(0, NUM_CLASSES, (global_batch,), generator=generator)

    ddp = measure_ddp(model_class, X.chunk(env.world_size)[env.rank], y.chunk(env.world_size)[env.rank], args, env)
    results = [ddp]
    print0(describe(ddp))

    dist.barrier()  # DDP is done everywhere; from here on rank 0 works alone, so no more collectives
    if env.rank != 0:
        return
    skipped = dataparallel_unavailable(env)
    if skipped:
        print(f"DataParallel skipped: {skipped}")
    else:
        gc.collect()  # free DDP's model and optimizer state, so they do not count in DataParallel's peak
        torch.cuda.empty_cache()
        dp = measure_dataparallel(model_class, X, y, list(range(env.world_size)), args)
        results.append(dp)
        print(describe(dp))
        print(f"DDP / DataParallel: {ddp['samples_per_second'] / dp['samples_per_second']:.2f}x the samples/s")
    write_results(args.results_dir, results, skipped, args, env)
    print(f"table, figures and plot written to {args.results_dir}")


def measure_ddp(model_class, X, y, args, env) -> dict:
    """Train with DDP on this rank's slice of the global batch; global samples/s and every rank's peak memory."""
    set_seed(args.seed)
    model = model_class(num_classes=NUM_CLASSES).to(env.device)
    net = DDP(model, device_ids=[env.device] if env.device.type == "cuda" else None)
    X, y = X.to(env.device), y.to(env.device)
    timing = measure(net, [(X, y)] * (args.warmup_steps + args.steps), env.device, args.warmup_steps)
    # The slowest rank sets the pace: every step waits for every rank's gradients. The tensor lives on this
    # process's device: NCCL reduces CUDA tensors only, and a CPU tensor here stops a GPU run.
    seconds = torch.tensor(timing["seconds"], device=env.device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    per_rank = [None] * env.world_size
    dist.all_gather_object(per_rank, (f"{env.device} (rank {env.rank})", timing["peak_memory_mib"]))
    return {"mode": "DDP", "processes": env.world_size, "devices": [device for device, _ in per_rank],
            "samples_per_second": timing["samples"] * env.world_size / seconds.item(),
            "peak_memory_mib": [memory for _, memory in per_rank], "memory_kind": memory_kind(env.device)}


def dataparallel_unavailable(env) -> str | None:
    """Why DataParallel cannot run here, or None when it can: it needs one GPU per DDP process, at least 2."""
    gpus = torch.cuda.device_count()
    if env.device.type != "cuda" or env.world_size < 2 or gpus < env.world_size:
        return (f"it needs 2 or more CUDA devices, one per DDP process to compare with; found {gpus} CUDA "
                f"device(s) and {env.world_size} process(es). With N GPUs, run "
                f"`torchrun --nproc_per_node=N solutions/08_dp_vs_ddp.py`")
    return None


def measure_dataparallel(model_class, X, y, device_ids, args) -> dict:
    """Train with ``nn.DataParallel`` on the whole global batch, one process driving every GPU."""
    set_seed(args.seed)
    # DataParallel wants the module on device_ids[0]; every forward replicates it from there to the others.
    # TODO: build the model, move it to the first of `device_ids`, and wrap it in nn.DataParallel over
    # `device_ids`; call the result `net`.
    raise NotImplementedError("TODO: wrap the model in DataParallel")
    X, y = X.to(f"cuda:{device_ids[0]}"), y.to(f"cuda:{device_ids[0]}")  # the whole batch on GPU 0, as users do
    devices = [torch.device(f"cuda:{i}") for i in device_ids]
    timing = measure(net, [(X, y)] * (args.warmup_steps + args.steps), devices[0], args.warmup_steps,
                     other_devices=devices[1:])
    return {"mode": "DataParallel", "processes": 1, "devices": [str(device) for device in devices],
            "samples_per_second": timing["samples"] / timing["seconds"],
            "peak_memory_mib": [timing["peak_memory_mib"]] + [peak_memory_mib(d) for d in devices[1:]],
            "memory_kind": memory_kind(devices[0])}


def measure(net, batches, device, warmup_steps: int, other_devices=()) -> dict:
    """Train ``net`` with SGD on ``batches``; time the steps after the first ``warmup_steps``.

    Returns ``{"seconds", "samples", "steps", "peak_memory_mib"}`` for the timed steps only; the peak memory is
    ``device``'s, measured from the first timed step. The peak of each of ``other_devices`` is reset at the same
    moment, so that ``peak_memory_mib(other)`` read afterwards covers the same steps.
    """
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    net.train()
    # TODO: train on every (X, y) in `batches` (cross-entropy, zero_grad, backward, step). When the first
    # `warmup_steps` steps are done, wait for `device` and every one of `other_devices` (`synchronize`), reset
    # the peak memory of each of them (`reset_peak_memory`) and start the clock (time.perf_counter()). Count the
    # timed steps and their samples. Raise a ValueError saying "no step to time" if there is none. At the end wait
    # for the devices again, then stop the clock and read `peak_memory_mib(device)`.
    raise NotImplementedError("TODO: the timing loop")


def describe(result: dict) -> str:
    memory = ", ".join(f"{mib:,.0f}" for mib in result["peak_memory_mib"])
    return (f"{result['mode']:>12}: {result['processes']} process(es) on {len(result['devices'])} device(s), "
            f"{result['samples_per_second']:,.0f} samples/s, peak memory per device [{memory}] MiB "
            f"({result['memory_kind']})")


def write_results(folder: Path, results: list[dict], skipped: str | None, args, env) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    setting = {"model": args.model, "batch_size_per_device": args.batch_size,
               "global_batch_size": args.batch_size * env.world_size, "steps": args.steps,
               "warmup_steps": args.warmup_steps, "backend": env.backend, "torch_version": torch.__version__,
               "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    write_json(folder / "results.json", {**setting, "results": results, "dataparallel_skipped": skipped})

    lines = ["| mode | processes | devices | samples/s | peak memory per device (MiB) | memory measured as |",
             "|---|---|---|---|---|---|"]
    for r in results:
        memory = ", ".join(f"{mib:,.0f}" for mib in r["peak_memory_mib"])
        lines.append(f"| {r['mode']} | {r['processes']} | {', '.join(r['devices'])} | "
                     f"{r['samples_per_second']:,.0f} | {memory} | {r['memory_kind']} |")
    if skipped:
        lines.append(f"\nDataParallel skipped: {skipped}")
    (folder / "results.md").write_text("\n".join(lines) + "\n")
    plot(results, folder / "results.png", f"{args.model}, global batch {setting['global_batch_size']}, "
         f"{env.backend} on {env.device.type}", skipped)


def plot(results: list[dict], path: Path, title: str, skipped: str | None) -> None:
    from matplotlib.figure import Figure  # no pyplot: nothing to display, no global figure state

    figure = Figure(figsize=(10, 3.8), layout="constrained")
    speed_axes, memory_axes = figure.subplots(1, 2)
    modes = [r["mode"] for r in results]
    speed_axes.bar(modes, [r["samples_per_second"] for r in results], color=["tab:blue", "tab:orange"][:len(modes)])
    if skipped:
        speed_axes.bar(["DataParallel"], [0], color="tab:orange")
        speed_axes.text(1, 0, "skipped:\nneeds 2+ GPUs", ha="center", va="bottom")
    speed_axes.set(ylabel="samples/s", title="throughput")
    width = 0.8 / len(results)
    devices = max(len(r["peak_memory_mib"]) for r in results)
    for i, r in enumerate(results):
        positions = [device + (i - (len(results) - 1) / 2) * width for device in range(len(r["peak_memory_mib"]))]
        memory_axes.bar(positions, r["peak_memory_mib"], width=width, label=r["mode"])
    memory_axes.set_xticks(range(devices))
    memory_axes.set(xlabel="device (DDP: the rank's device)", ylabel=f"MiB, {results[0]['memory_kind']}",
                    title="peak memory per device")
    memory_axes.legend(loc="lower right")
    figure.suptitle(title)
    figure.savefig(path, dpi=100)


if __name__ == "__main__":
    main(parse_args())
