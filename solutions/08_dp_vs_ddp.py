"""Lab 08 (lesson 02): DataParallel against DistributedDataParallel, same model, data and global batch.

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

import gc
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from common.cli import argument_parser, non_negative_int, positive_int
from common.data import NUM_CLASSES
from common.distributed import BACKENDS, is_main, print0, process_group, set_seed
from common.memory import peak_memory_mib

# BEGIN LAB: the timing loop
# Train on every (X, y) (cross-entropy, zero_grad, backward, step). After `warmup_steps` steps, synchronize and
# reset_peak_memory each of `device` and `other_devices`, then start the clock (time.perf_counter()). Count
# the timed steps and samples; with none, raise ValueError("... no step to time ..."). At the end synchronize
# the devices again, then read the clock and peak_memory_mib(device).
from common.metrics import time_training_steps  # isort: skip

# END LAB
from common.models import MODELS
from common.reports import comparison_result, describe_comparison, write_comparison

BATCH_SIZE_HELP = "per device: the global batch is this times the number of processes"
WARMUP_STEPS_HELP = (
    "untimed steps first: first allocations, library handles created on first use, DDP's bucket rebuild (in its step 2)"
)
RESULTS_DIR_HELP = "global rank 0 writes results.json, results.md and results.png here"


def parse_args(argv=None):
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="simplecnn")
    parser.add_argument("--batch-size", type=positive_int, default=64, help=BATCH_SIZE_HELP)
    parser.add_argument("--steps", type=positive_int, default=20, help="timed training steps per mode")
    parser.add_argument("--warmup-steps", type=non_negative_int, default=3, help=WARMUP_STEPS_HELP)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=BACKENDS, default="auto", help="auto: NCCL if every process has a GPU")
    parser.add_argument("--results-dir", type=Path, default=Path("runs/08_dp_vs_ddp"), help=RESULTS_DIR_HELP)
    return parser.parse_args(argv)


def main(args):
    with process_group(args.backend) as env:
        compare(args, env)


def compare(args, env):
    model_class = MODELS[args.model]
    global_batch = args.batch_size * env.world_size
    print0(
        f"{args.model}, {global_batch} samples per step ({args.batch_size} per device x {env.world_size}), "
        f"{args.warmup_steps} warm-up + {args.steps} timed steps"
    )
    # One global batch from a fixed generator: DDP rank r trains on slice r of it, DataParallel on all of it.
    generator = torch.Generator().manual_seed(args.seed)
    X = torch.randn(global_batch, *model_class.input_shape, generator=generator)
    y = torch.randint(0, NUM_CLASSES, (global_batch,), generator=generator)

    ddp = measure_ddp(model_class, X.chunk(env.world_size)[env.rank], y.chunk(env.world_size)[env.rank], args, env)
    results = [ddp]
    print0(describe_comparison(ddp))

    dist.barrier()  # DDP is done everywhere; from here on rank 0 works alone, so no more collectives
    if not is_main():
        return
    skipped = dataparallel_unavailable(env)
    if skipped:
        print(f"DataParallel skipped: {skipped}")
    else:
        gc.collect()  # free DDP's model and optimizer state, so they do not count in DataParallel's peak
        torch.cuda.empty_cache()
        dp = measure_dataparallel(model_class, X, y, list(range(env.world_size)), args)
        results.append(dp)
        print(describe_comparison(dp))
        print(f"DDP / DataParallel: {ddp['samples_per_second'] / dp['samples_per_second']:.2f}x the samples/s")
    setting = dict(model=args.model, batch_size_per_device=args.batch_size, global_batch_size=global_batch)
    setting.update(steps=args.steps, warmup_steps=args.warmup_steps, backend=env.backend)
    write_comparison(args.results_dir, results, skipped, setting, f"{env.backend} on {env.device.type}")
    print(f"table, figures and plot written to {args.results_dir}")


def measure_ddp(model_class, X, y, args, env) -> dict:
    """Train with DDP on this rank's slice of the global batch; global samples/s and every rank's peak memory."""
    set_seed(args.seed)
    model = model_class(num_classes=NUM_CLASSES).to(env.device)
    net = DDP(model, device_ids=env.device_ids)
    X, y = X.to(env.device), y.to(env.device)
    timing = time_training_steps(net, [(X, y)] * (args.warmup_steps + args.steps), env.device, args.warmup_steps)
    # The slowest rank sets the pace: every step waits for every rank's gradients. The tensor lives on this
    # process's device: NCCL reduces CUDA tensors only, and a CPU tensor here stops a GPU run.
    seconds = torch.tensor(timing["seconds"], device=env.device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    per_rank = [None] * env.world_size
    dist.all_gather_object(per_rank, (f"{env.device} (rank {env.rank})", timing["peak_memory_mib"]))
    devices, memory = [name for name, _ in per_rank], [mib for _, mib in per_rank]
    samples_per_second = timing["samples"] * env.world_size / seconds.item()
    return comparison_result("DDP", env.world_size, devices, samples_per_second, memory, env.device)


def dataparallel_unavailable(env) -> str | None:
    """Why DataParallel cannot run here, or None when it can: it needs one GPU per DDP process, at least 2."""
    gpus = torch.cuda.device_count()
    if env.device.type != "cuda" or env.world_size < 2 or gpus < env.world_size:
        return (
            f"it needs 2 or more CUDA devices, one per DDP process to compare with; found {gpus} CUDA "
            f"device(s) and {env.world_size} process(es). With N GPUs, run "
            f"`torchrun --nproc_per_node=N solutions/08_dp_vs_ddp.py`"
        )
    return None


def measure_dataparallel(model_class, X, y, device_ids, args) -> dict:
    """Train with ``nn.DataParallel`` on the whole global batch, one process driving every GPU."""
    set_seed(args.seed)
    # BEGIN LAB: wrap the model in nn.DataParallel over `device_ids` and call it `net`
    # DataParallel wants the module on device_ids[0]; every forward replicates it from there to the others.
    net = nn.DataParallel(model_class(num_classes=NUM_CLASSES).to(f"cuda:{device_ids[0]}"), device_ids=device_ids)
    # END LAB
    X, y = X.to(f"cuda:{device_ids[0]}"), y.to(f"cuda:{device_ids[0]}")  # the whole batch on GPU 0, as users do
    devices = [torch.device(f"cuda:{i}") for i in device_ids]
    batches = [(X, y)] * (args.warmup_steps + args.steps)
    timing = time_training_steps(net, batches, devices[0], args.warmup_steps, other_devices=devices[1:])
    memory = [timing["peak_memory_mib"]] + [peak_memory_mib(d) for d in devices[1:]]
    samples_per_second = timing["samples"] / timing["seconds"]
    return comparison_result("DataParallel", 1, [str(d) for d in devices], samples_per_second, memory, devices[0])


if __name__ == "__main__":
    main(parse_args())
