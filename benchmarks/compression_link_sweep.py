"""Where gradient compression stops paying (lesson 10): ms per step of plain all-reduce and PowerSGD, link by link.

    python benchmarks/compression_link_sweep.py          # loopback, 2, 3 and 4 Gbit/s, 3 rounds: about 5 min
    python benchmarks/compression_link_sweep.py --links loopback 2gbit --rounds 1

Each run is one of benchmarks/gradient_compression.py's (its ``measure``: solutions/11_powersgd.py, digits, DeepMLP,
2 processes, seed 0, PowerSGD from step 10; ms per step from the second epoch on). ``loopback`` runs both processes
under ``torchrun --standalone``; a rate such as ``2gbit`` runs them on two emulated nodes joined by a link of that rate
(scripts/cluster.py, one process per node; it needs root). Every round runs every link, and at each link every
configuration, in turn: a background load that comes and goes then hits every link and configuration alike. The
table gives, per link, each configuration's median ms per step over the rounds (lowest-highest) and which is faster.
Other jobs on the machine slow the runs they share it with: read the load average in the first line.
"""

import argparse
import os
import statistics
from pathlib import Path

from common.cli import argument_parser, positive_int
from common.launch import load_script
from common.reports import run_header

compression = load_script(Path(__file__).resolve().parent / "gradient_compression.py")


def medians(times: dict[tuple[str, str], list[float]]) -> list[dict]:
    """``{(link, config): [ms per step, one per round]}`` -> one row per link, in the order first measured: each
    configuration's median and range, and the faster configuration by median."""
    rows = {}
    for (link, config), values in times.items():
        row = rows.setdefault(link, {"link": link, "configs": {}})
        row["configs"][config] = {"median": statistics.median(values), "low": min(values), "high": max(values)}
    for row in rows.values():
        row["faster"] = min(row["configs"], key=lambda config: row["configs"][config]["median"])
    return list(rows.values())


def main(args) -> None:
    # One thread per process, on loopback and on the emulated nodes alike: torchrun gives that to two local
    # processes but all the cores to a node's single one, and the nodes share this machine's cores.
    os.environ["OMP_NUM_THREADS"] = "1"
    print(run_header(), flush=True)
    print(
        f"{compression.SCRIPT}: {compression.DATASET}, {compression.MODEL}, {args.nproc} processes, seed 0, "
        f"{args.epochs} epochs, {args.rounds} round(s) over links {' '.join(args.links)}",
        flush=True,
    )
    times = {}
    for round_ in range(1, args.rounds + 1):
        for link in args.links:
            options = argparse.Namespace(
                epochs=args.epochs, nproc=args.nproc, batch_size=64, lr=0.05, link=None if link == "loopback" else link
            )
            for config in args.configs:
                run = compression.measure(config, 0, options)
                times.setdefault((link, config), []).append(run["step_seconds"] * 1e3)
                print(
                    f"  round {round_} {link:>8} {config:<12} {run['step_seconds'] * 1e3:6.1f} ms/step "
                    f"(load average {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
    rows = medians(times)
    print(f"\nms per step, median of {args.rounds} round(s) (lowest-highest)")
    print(f"{'link':>8}  " + "  ".join(f"{config:>20}" for config in args.configs) + "  faster")
    for row in rows:
        cells = [row["configs"][config] for config in args.configs]
        shown = [f"{c['median']:6.1f} ({c['low']:.1f}-{c['high']:.1f})" for c in cells]
        print(f"{row['link']:>8}  " + "  ".join(f"{text:>20}" for text in shown) + f"  {row['faster']}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--links", nargs="+", default=["loopback", "2gbit", "3gbit", "4gbit"])
    parser.add_argument("--configs", nargs="+", choices=list(compression.CONFIGS), default=["allreduce", "powersgd-r2"])
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--epochs", type=positive_int, default=3, help="the first is not timed; PowerSGD from step 10")
    parser.add_argument("--nproc", type=positive_int, default=2)
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
