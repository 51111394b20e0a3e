"""Gradient compression, measured (lesson 10): bytes, time and accuracy of plain all-reduce, bf16 and PowerSGD.

    python benchmarks/gradient_compression.py        # 8 configurations x seeds 0 1 2: 24 runs, ~5 min on 2 CPU cores
    python benchmarks/gradient_compression.py --json runs/gradient_compression.json --plot runs/gradient_compression.png
    python benchmarks/gradient_compression.py --configs allreduce powersgd-r2 --seeds 0 --epochs 5   # a quick look

Every configuration trains solutions/11_powersgd.py (``--dataset digits --model mlp``) under ``torchrun --standalone``
on ``--nproc`` processes, once per seed; the figures come from the metrics file that global rank 0 writes:

- ``allreduce`` and ``bf16``: the by-hand hooks, every gradient sent in fp32, or in bf16 (half the bytes);
- ``powersgd-rR``: PowerSGD by hand at matrix rank R (1, 2, 4), with error feedback; ``powersgd-rR-no-ef``: the
  same without it. All of them warm-start (the last step's Q) and compress from step 10 (``--start-iter``).

The table, one row per configuration:

- MiB/step: what the step's all-reduces send, counted at step 10 (the first one PowerSGD compresses) by
  ``common.collectives.count_collectives``; ``fewer bytes``: the model's gradient bytes (what plain all-reduce
  sends) over that.
- ms/step: an epoch's training time (evaluation excluded) over its steps, from the second epoch on (the first
  holds start-up and first-touch allocations), averaged over the seeds.
- test accuracy: after the last epoch, mean +- sample standard deviation over the seeds; ``points vs plain``:
  its mean minus plain all-reduce's, in percentage points.

A last line judges the goal of lesson 10's issue for each PowerSGD rank with error feedback: at least 10x fewer
bytes than plain all-reduce for at most 2 points of accuracy lost (mean over the seeds).

What the CPU figures mean: gloo's all-reduce between local processes is memory copies on the same cores that run
the compute, and PowerSGD adds matrix products and an orthogonalisation per step. So on a CPU the time per step
says what compression costs in compute, not what it saves on a network: there, the bytes column is what counts.
"""

import argparse
import math
import statistics
import time
from pathlib import Path

from common.cli import argument_parser, positive_float, positive_int
from common.launch import run_for_json
from common.metrics import write_json
from common.reports import plot_accuracy_curves, run_header

SCRIPT = "solutions/11_powersgd.py"
DATASET, MODEL = "digits", "mlp"
RUN_TIMEOUT_S = 600  # one training run; a default one takes 10 to 15 s on 2 CPU cores
GOAL_RATIO, GOAL_POINTS = 10.0, 2.0  # the goal: >= 10x fewer bytes for <= 2 points of accuracy


def configurations() -> dict[str, list[str]]:
    """Each configuration's name and the options that give it to the solution."""
    configs = {"allreduce": ["--hook", "allreduce"], "bf16": ["--hook", "bf16"]}
    for error_feedback in (True, False):
        for rank in (1, 2, 4):
            name = f"powersgd-r{rank}" + ("" if error_feedback else "-no-ef")
            feedback = "--error-feedback" if error_feedback else "--no-error-feedback"
            configs[name] = ["--hook", "powersgd", "--matrix-rank", str(rank), feedback]
    return configs


CONFIGS = configurations()


def measure(name: str, seed: int, args) -> dict:
    """Train configuration ``name`` with ``seed``; its figures, per epoch and in all."""
    started = time.perf_counter()
    metrics = run_for_json(
        SCRIPT,
        *CONFIGS[name],
        *("--dataset", DATASET, "--model", MODEL, "--epochs", args.epochs, "--seed", seed),
        *("--batch-size", args.batch_size, "--lr", args.lr, "--num-workers", 0),  # digits lives in memory
        json_option="--metrics-file",
        nproc=args.nproc,
        timeout=RUN_TIMEOUT_S,
        link=args.link,
    )
    if "bytes_sent_per_step" not in metrics:
        raise RuntimeError(f"{name}, seed {seed}: the run ended before step 10, whose bytes are counted")
    history = metrics["history"]
    # Every rank runs the same number of batches (DistributedSampler pads); ``samples`` sums the ranks'.
    steps = [math.ceil(epoch["samples"] / args.nproc / args.batch_size) for epoch in history]
    timed = range(1, len(history)) if len(history) > 1 else range(1)
    return {
        "config": name,
        "seed": seed,
        "backend": metrics["backend"],
        "device": metrics["device"],
        "replicas_in_sync": metrics["replicas_in_sync"],
        "bytes_sent_per_step": metrics["bytes_sent_per_step"],
        "plain_bytes_per_step": metrics["plain_bytes_per_step"],
        "step_seconds": sum(history[i]["seconds"] for i in timed) / sum(steps[i] for i in timed),
        "steps_per_epoch": steps,
        "test_accuracy": [epoch["test_accuracy"] for epoch in history],
        "train_loss": [epoch["train_loss"] for epoch in history],
        "epoch_seconds": [epoch["seconds"] for epoch in history],
        "final_test_accuracy": metrics["final_test_accuracy"],
        "wall_seconds": time.perf_counter() - started,
    }


def summarise(name: str, runs: list[dict], plain: list[dict] | None) -> dict:
    """One configuration's row over its seeds; ``plain``, the all-reduce runs (``None`` if not measured)."""
    accuracies = [run["final_test_accuracy"] for run in runs]
    sent = statistics.mean(run["bytes_sent_per_step"] for run in runs)  # the same at every seed
    gradient_bytes = statistics.mean(run["plain_bytes_per_step"] for run in runs)
    mean = statistics.mean(accuracies)
    return {
        "config": name,
        "seeds": [run["seed"] for run in runs],
        "bytes_sent_per_step": sent,
        "fewer_bytes": gradient_bytes / sent,
        "step_seconds": statistics.mean(run["step_seconds"] for run in runs),
        "accuracy_mean": mean,
        "accuracy_std": statistics.stdev(accuracies) if len(accuracies) > 1 else None,
        "points_vs_plain": 100 * (mean - statistics.mean(run["final_test_accuracy"] for run in plain))
        if plain
        else None,
        "replicas_in_sync": all(run["replicas_in_sync"] for run in runs),
    }


def print_table(rows: list[dict]) -> None:
    print(
        f"\n{'configuration':<18} {'MiB/step':>9} {'fewer bytes':>11} {'ms/step':>8} {'test accuracy %':>16} "
        f"{'points vs plain':>15}"
    )
    for row in rows:
        spread = f"{100 * row['accuracy_std']:.2f}" if row["accuracy_std"] is not None else "-"
        accuracy = f"{100 * row['accuracy_mean']:.2f} +- {spread:>5}"
        versus = f"{row['points_vs_plain']:+.2f}" if row["points_vs_plain"] is not None else "-"
        print(
            f"{row['config']:<18} {row['bytes_sent_per_step'] / 2**20:>9.4f} {row['fewer_bytes']:>10.1f}x "
            f"{row['step_seconds'] * 1e3:>8.1f} {accuracy:>16} {versus:>15}"
        )


def judge_goal(rows: list[dict]) -> dict:
    """For each PowerSGD rank with error feedback: met or not, and why (``None`` where plain was not measured)."""
    verdicts = {}
    for row in rows:
        if not (row["config"].startswith("powersgd") and not row["config"].endswith("-no-ef")):
            continue
        if row["points_vs_plain"] is None:
            verdicts[row["config"]] = None
            continue
        verdicts[row["config"]] = {
            "met": row["fewer_bytes"] >= GOAL_RATIO and -row["points_vs_plain"] <= GOAL_POINTS,
            "fewer_bytes": row["fewer_bytes"],
            "points_vs_plain": row["points_vs_plain"],
        }
    return verdicts


def describe_goal(verdicts: dict) -> str:
    goal = f"goal, >= {GOAL_RATIO:g}x fewer bytes with <= {GOAL_POINTS:g} points accuracy cost"
    if not verdicts:
        return f"{goal}: no PowerSGD configuration with error feedback measured"
    parts = []
    for name, verdict in verdicts.items():
        if verdict is None:
            parts.append(f"{name} not judged (plain all-reduce not measured)")
        else:
            figures = f"{verdict['fewer_bytes']:.1f}x fewer bytes, accuracy {verdict['points_vs_plain']:+.2f} points"
            parts.append(f"{name} {'met' if verdict['met'] else 'NOT met'} ({figures})")
    return f"{goal} (mean over seeds): " + "; ".join(parts)


def plot(runs_by_config: dict[str, list[dict]], path: Path, args) -> None:
    """Test accuracy against the epoch, mean over the seeds: a colour per hook and rank, dashed without error
    feedback."""
    curves, styles = {}, {}
    colours = {"allreduce": "black", "bf16": "tab:gray", "r1": "tab:blue", "r2": "tab:orange", "r4": "tab:green"}
    for name, runs in runs_by_config.items():
        curves[name] = [statistics.mean(epoch) for epoch in zip(*(run["test_accuracy"] for run in runs))]
        key = name.removeprefix("powersgd-").removesuffix("-no-ef")
        styles[name] = {"color": colours[key], "linestyle": "--" if name.endswith("-no-ef") else "-"}
    seeds = " ".join(map(str, args.seeds))
    title = f"{MODEL} on {DATASET}, {args.nproc} processes: test accuracy, mean over seeds {seeds}"
    plot_accuracy_curves(curves, path, title, styles)


def main(args):
    print(run_header(), flush=True)
    print(
        f"{SCRIPT}: {DATASET}, {MODEL}, {args.nproc} processes, {args.epochs} epoch(s), batch {args.batch_size} per "
        f"process, lr {args.lr}, PowerSGD from step 10; seeds {' '.join(map(str, args.seeds))}; "
        + ("loopback" if args.link is None else f"two emulated nodes joined at {args.link}"),
        flush=True,
    )
    runs_by_config = {}
    for name in args.configs:
        runs_by_config[name] = []
        for seed in args.seeds:
            run = measure(name, seed, args)
            runs_by_config[name].append(run)
            print(
                f"  {name} seed {seed}: test accuracy {run['final_test_accuracy']:.2%}, "
                f"{run['step_seconds'] * 1e3:.1f} ms/step ({run['wall_seconds']:.0f} s)",
                flush=True,
            )
    first = runs_by_config[args.configs[0]][0]
    plain = runs_by_config.get("allreduce")
    rows = [summarise(name, runs, plain) for name, runs in runs_by_config.items()]
    print(
        f"\n{first['backend']} on {first['device']}; replicas identical after every run: "
        f"{all(row['replicas_in_sync'] for row in rows)}"
    )
    print_table(rows)
    verdicts = judge_goal(rows)
    print("\n" + describe_goal(verdicts))
    if args.json:
        setup = {key: value for key, value in vars(args).items() if key not in ("json", "plot")}
        setup.update(script=SCRIPT, dataset=DATASET, model=MODEL, backend=first["backend"], device=first["device"])
        runs = [run for runs in runs_by_config.values() for run in runs]
        write_json(args.json, {"setup": setup, "summary": rows, "goal": verdicts, "runs": runs})
    if args.plot:
        plot(runs_by_config, args.plot, args)
        print(f"plot: {args.plot}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=list(CONFIGS),
        default=list(CONFIGS),
        metavar="CONFIG",
        help=f"a subset of: {', '.join(CONFIGS)}",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--epochs",
        type=positive_int,
        default=20,
        help="plain all-reduce: 97%% from epoch 13, 98%% at 20 (mean of 3 seeds)",
    )
    parser.add_argument("--nproc", type=positive_int, default=2)
    parser.add_argument("--batch-size", type=positive_int, default=64, help="per process")
    parser.add_argument("--lr", type=positive_float, default=0.05)
    parser.add_argument(
        "--link",
        help="run on two emulated nodes joined at this rate, e.g. 1gbit (scripts/cluster.py; needs root)",
    )
    parser.add_argument("--json", type=Path, help="write every run's figures (per seed, per epoch) here")
    parser.add_argument("--plot", type=Path, help="plot test accuracy against the epoch to this PNG")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
