"""Does teardown_distributed's pause after destroy_process_group prevent the abort at exit? Count it.

    python benchmarks/teardown_pause.py --minutes 25            # as many runs as fit, the conditions alternating
    python benchmarks/teardown_pause.py --runs 10 --nproc 3     # 10 runs per condition, 3 processes each

Every run is a short DDP job under ``torchrun --standalone``: LeNet, a few SGD steps on random data, then
``replicas_in_sync`` (an all-reduce of Python-made tensors, as every course script ends), then the teardown.
"with pause" calls ``common.distributed.teardown_distributed`` (``destroy_process_group`` and a 50 ms sleep);
"without" calls ``destroy_process_group`` alone. The switch is this script's own environment variable
``TEARDOWN_PAUSE_BENCHMARK``, read only by the worker below: the course's scripts have no such option. A run
counts as an abort when any process's stderr says ``terminate called`` or a process died by a signal. The
conditions alternate run by run, so that a busy spell on the machine hits both alike.

Printed: counts, abort rates with exact (Clopper-Pearson) 95% intervals, Fisher's exact test (two-sided), and
the median wall time of a run per condition.
"""

import argparse
import os
import statistics
import time

from common.launch import launch
from common.reports import run_header

PAUSE_VARIABLE = "TEARDOWN_PAUSE_BENCHMARK"  # "1": teardown_distributed; "0": destroy_process_group alone
CONDITIONS = {"with pause": "1", "without": "0"}


def worker(steps: int) -> None:
    """One rank of the measured job; torchrun starts it with ``--worker``."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from common.distributed import replicas_in_sync, set_seed, setup_distributed, teardown_distributed
    from common.models import LeNet

    env = setup_distributed("gloo")
    set_seed(0)
    net = DDP(LeNet())
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    set_seed(0, env.rank)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(net(torch.randn(8, 1, 28, 28)), torch.randint(0, 10, (8,))).backward()
        optimizer.step()
    assert replicas_in_sync(net)
    if os.environ[PAUSE_VARIABLE] == "1":
        teardown_distributed()
    else:
        dist.destroy_process_group()  # the same teardown without the pause


def one_run(pause: str, args) -> tuple[str, float]:
    """Launch the job once; return its outcome ("clean", "abort" or "other failure") and its wall time."""
    start = time.monotonic()
    run = launch(
        __file__,
        "--worker",
        "--steps",
        args.steps,
        nproc=args.nproc,
        check=False,
        timeout=300,
        env_extra={PAUSE_VARIABLE: pause, "OMP_NUM_THREADS": "1"},
    )
    return outcome(run.returncode, run.stderr), time.monotonic() - start


def outcome(returncode: int, stderr: str) -> str:
    """ "abort" when a process aborted or died by a signal, else "clean" or "other failure" by the exit code."""
    # torchrun reports a child killed by a signal with a negative exit code: "exitcode  : -6 (pid: ...) (SIGABRT)".
    if "terminate called" in stderr or "exitcode  : -" in stderr:
        return "abort"
    return "clean" if returncode == 0 else "other failure"


def report(outcomes: dict, seconds: dict) -> None:
    from scipy.stats import binomtest, fisher_exact

    print(
        f"{'condition':<11} {'runs':>5} {'aborts':>6} {'other':>5} {'abort rate':>10} {'95% CI (exact)':>16} "
        f"{'median s/run':>12}"
    )
    table = []
    for name in CONDITIONS:
        runs, aborts = len(outcomes[name]), outcomes[name].count("abort")
        other = outcomes[name].count("other failure")
        interval = binomtest(aborts, runs).proportion_ci(confidence_level=0.95, method="exact")
        print(
            f"{name:<11} {runs:>5} {aborts:>6} {other:>5} {aborts / runs:>10.1%} "
            f"{f'{interval.low:.1%} - {interval.high:.1%}':>16} {statistics.median(seconds[name]):>12.2f}"
        )
        table.append([aborts, runs - aborts])
    print(f"Fisher's exact test, two-sided: p = {fisher_exact(table).pvalue:.3g}")


def main(args):
    print(run_header(), flush=True)
    print(
        f"{args.nproc} processes per run, gloo on CPU, {args.steps} DDP steps then replicas_in_sync, "
        f"conditions alternating run by run",
        flush=True,
    )
    outcomes = {name: [] for name in CONDITIONS}
    seconds = {name: [] for name in CONDITIONS}
    deadline = time.monotonic() + args.minutes * 60 if args.minutes else float("inf")
    pair = 0
    while (args.runs is None or pair < args.runs) and time.monotonic() < deadline:
        order = list(CONDITIONS) if pair % 2 == 0 else list(CONDITIONS)[::-1]  # who goes first alternates too
        for name in order:
            outcome, took = one_run(CONDITIONS[name], args)
            outcomes[name].append(outcome)
            seconds[name].append(took)
        pair += 1
        if args.progress and pair % args.progress == 0:
            print(
                f"after {pair} runs each: aborts with pause {outcomes['with pause'].count('abort')}, "
                f"without {outcomes['without'].count('abort')}",
                flush=True,
            )
    report(outcomes, seconds)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, help="runs per condition (default: until --minutes is spent)")
    parser.add_argument("--minutes", type=float, help="stop starting new runs after this many minutes")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--progress", type=int, default=10, help="print the counts every this many runs each")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.worker and args.runs is None and args.minutes is None:
        parser.error("give --runs, --minutes, or both")
    return args


if __name__ == "__main__":
    arguments = parse_args()
    worker(arguments.steps) if arguments.worker else main(arguments)
