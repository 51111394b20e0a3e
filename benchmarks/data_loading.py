"""A starving input pipeline fixed one loader option at a time: waiting for data against computing, per rung.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 benchmarks/data_loading.py
    OMP_NUM_THREADS=1 python benchmarks/data_loading.py --json runs/data_loading.json --plot runs/data_loading.png

Every rank trains DDP(LeNet) with SGD on the digits read from PNG files (``common.data_loading``: ImageFolder, PIL
decode, resize and random affine per sample, ``--read-latency-ms`` of simulated storage latency per file), climbing
``LOADER_LADDER``: decode in the main process, + worker processes, + pinned memory, + persistent workers, + deeper
prefetch. Each rung runs ``--epochs`` short epochs of ``--steps`` + 1 batches per rank (the first batch of an epoch
is start-up, timed alone), so that re-spawning workers every epoch shows. Rank 0 prints a row per rung: samples/s
over all ranks, then per step and averaged over ranks the time spent waiting for the batch (and copying it to the
device) and computing, the last epoch's first-batch wait, the data share, and the verdict: data-bound when a step
waits longer than it computes.

This machine has 2 cores, one per rank: workers cannot take decoding off a rank here, only the waiting for storage.
On a CPU, DataLoader ignores pin_memory (with a warning, silenced here): rung 3 measures the same loader as rung 2.
DataLoader also warns that 6 workers per rank are more than the 2 cores it suggests (silenced too): these workers
spend most of their time waiting for storage, which takes no core.
"""

import json
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Subset

from common.cli import argument_parser, non_negative_float, positive_int
from common.data import make_loader
from common.data_loading import LOADER_LADDER, READ_LATENCY_MS, image_folder_splits, measure_loader
from common.distributed import BACKENDS, all_reduce_mean, all_reduce_sum, is_main, print0, process_group, set_seed
from common.models import LeNet
from common.reports import run_header


def parse_args(argv=None):
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="./data", help="the PNG files go to DATA_DIR/digits-png")
    parser.add_argument("--read-latency-ms", type=non_negative_float, default=READ_LATENCY_MS, help="per file")
    parser.add_argument("--batch-size", type=positive_int, default=64, help="per rank")
    parser.add_argument("--steps", type=positive_int, default=10, help="timed batches per epoch and rank")
    parser.add_argument("--epochs", type=positive_int, default=2, help="per rung")
    parser.add_argument("--backend", choices=BACKENDS, default="auto")
    parser.add_argument("--json", type=Path, help="rank 0 writes the figures to this file")
    parser.add_argument("--plot", type=Path, help="rank 0 draws data and compute ms per step to this PNG")
    return parser.parse_args(argv)


def climb(args, env) -> list[dict]:
    """Every rung of ``LOADER_LADDER`` for ``--epochs`` epochs; one row per rung, averaged over ranks."""
    splits = image_folder_splits(args.data_dir, LeNet.input_shape, args.read_latency_ms)
    # A fixed random subset, the same on every rank, sized so that an epoch is steps + 1 batches per rank.
    size = min(len(splits.train), (args.steps + 1) * args.batch_size * env.world_size)
    chosen = torch.randperm(len(splits.train), generator=torch.Generator().manual_seed(0))[:size]
    train_set = Subset(splits.train, chosen.tolist())

    set_seed(0)  # the same initial weights on every rank
    net = DDP(LeNet().to(env.device), device_ids=env.device_ids)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

    def train_step(X, y):
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(net(X), y).backward()  # DDP all-reduces the gradients here
        optimizer.step()

    rows = []
    for label, options in LOADER_LADDER:
        loader = make_loader(train_set, args.batch_size, env.rank, env.world_size, train=True, **options)
        epochs = []
        for epoch in range(args.epochs):
            loader.sampler.set_epoch(epoch)
            epochs.append(measure_loader(loader, train_step, args.steps, env.device))
        del loader  # persistent workers exit with their loader
        steps = sum(epoch["steps"] for epoch in epochs)
        mean = {key: sum(epoch[key] * epoch["steps"] for epoch in epochs) / steps for key in ("data_ms", "compute_ms")}
        data_ms, compute_ms = all_reduce_mean([mean["data_ms"], mean["compute_ms"]]).tolist()
        rows.append(
            {
                "rung": label,
                "options": options,
                "workers": options.get("num_workers", 0),
                "samples_per_s": all_reduce_sum(sum(e["samples_per_s"] * e["steps"] for e in epochs) / steps).item(),
                "data_ms": data_ms,
                "compute_ms": compute_ms,
                "first_batch_ms": all_reduce_mean([epoch["first_batch_ms"] for epoch in epochs]).tolist(),
                "data_share": data_ms / (data_ms + compute_ms),
                "verdict": "data-bound" if data_ms > compute_ms else "compute-bound",
            }
        )
    return rows


def plot(rows: list[dict], path: Path, title: str) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 3.5), layout="tight")
    axes = figure.subplots()
    labels = [f"{number}. {row['rung']}" for number, row in enumerate(rows, 1)][::-1]
    data = [row["data_ms"] for row in rows][::-1]
    compute = [row["compute_ms"] for row in rows][::-1]
    axes.barh(labels, data, label="waiting for data")
    axes.barh(labels, compute, left=data, label="computing")
    axes.set(xlabel="ms per step (mean over ranks)", title=title)
    axes.grid(True, axis="x", alpha=0.3)
    axes.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def main(args):
    # Two warnings the docstring explains once: no accelerator, so no pinning (at every epoch); and more workers
    # than cores, which DataLoader suspects of being slow: workers that mostly wait for storage need no core each.
    warnings.filterwarnings("ignore", message="'pin_memory' argument is set as true but no accelerator")
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    with process_group(args.backend) as env:
        rows = climb(args, env)
        title = (
            f"DDP(LeNet), {env.world_size} rank(s), {env.backend} on {env.device.type}, batch {args.batch_size} "
            f"per rank; {args.read_latency_ms:g} ms storage latency per file"
        )
        print0(run_header())
        print0(title)
        print0(
            f"{'rung':<38} {'workers':>7} {'samples/s':>9} {'data ms':>8} {'compute ms':>10} "
            f"{'1st batch ms':>12} {'data share':>10}  verdict"
        )
        for number, row in enumerate(rows, 1):
            print0(
                f"{number}. {row['rung']:<35} {row['workers']:>7} {row['samples_per_s']:>9,.0f} "
                f"{row['data_ms']:>8.1f} {row['compute_ms']:>10.1f} {row['first_batch_ms'][-1]:>12.1f} "
                f"{row['data_share']:>10.0%}  {row['verdict']}"
            )
        print0("data/compute ms: per step, mean over ranks; 1st batch ms: the last epoch's first batch")
        if is_main() and args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"setup": title, "rows": rows}, indent=2))
        if is_main() and args.plot:
            plot(rows, args.plot, title.replace("; ", "\n"))


if __name__ == "__main__":
    main(parse_args())
