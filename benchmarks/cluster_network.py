"""Lessons 07-12 measured where readers train: two nodes joined by a slow link (the emulated cluster), not loopback.

    python benchmarks/cluster_network.py --out results/cpu-amd-epyc-2core/cluster_network   # all parts, ~12 min
    python benchmarks/cluster_network.py --parts link allreduce --out /tmp/quick                   # a few of them

Every run goes through ``scripts/cluster.py`` (two network namespaces, each link capped by ``tbf``; it needs root),
and the same command on loopback is run beside it where the contrast teaches something. The parts:

- ``link``: the rate one TCP stream reaches on links set to 100 Mbit/s and 1 Gbit/s.
- ``allreduce``: ``solutions/07_ring_allreduce.py``, the hand-written ring and gloo's ``dist.all_reduce``, 1 KiB to
  64 MiB, one process per node, so every byte crosses the link; bus bandwidth as a fraction of the link's rate.
- ``fit``: lesson 09's alpha-beta fit of ``dist.all_reduce`` (``common.scaling.fit_all_reduce``) on 1 Gbit/s and
  200 Mbit/s links, its 1/beta against the link rate.
- ``ddp``: ``benchmarks/ddp_by_hand.py`` (lesson 08's builds and torch's DDP) on loopback, 1 Gbit/s and 200 Mbit/s.
- ``buckets``: ``solutions/06_profiling.py --model mlp`` at ``--bucket-cap-mb`` 0.01, 1, 4 and 25 over 1 Gbit/s:
  torch's DDP, its communication and how much of it backward hides, from the traces (lesson 09's table).
- ``compression``: ``benchmarks/gradient_compression.py``, plain all-reduce against PowerSGD ranks 1, 2 and 4, ms per
  step on loopback, 1 Gbit/s and 100 Mbit/s (lesson 10).
- ``tp``: ``solutions/13_tensor_parallel.py`` on 2 nodes x 2 processes over 1 Gbit/s, the same global batch split
  three ways: tensor parallelism across all 4 (its all-reduces cross the link), tensor parallelism inside each node
  with data parallelism across the nodes, and data parallelism over all 4 (lesson 12). Loopback beside it.

It writes ``OUT.txt`` (the machine, PyTorch, the date, then each part's commands and tables) and ``OUT.json``.
"""

import argparse
import datetime
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common.launch import REPO, cluster_command, torchrun_command

PYTHON = sys.executable
PARTS = ["link", "allreduce", "fit", "ddp", "buckets", "compression", "tp"]
FIT_SIZES = [4, 4096, 65536, 1 << 20, 4 << 20, 16 << 20]


def cluster_line(link: str, procs_per_node: int, script: list) -> list[str]:
    """The command that runs ``script`` on two emulated nodes joined at ``link``."""
    return cluster_command(*script, nproc=2 * procs_per_node, link=link)


def loopback_line(nproc: int, script: list) -> list[str]:
    return torchrun_command(*script, nproc=nproc)


def run(command: list[str], timeout: float = 1200) -> str:
    """Run ``command`` from the repository's folder; its standard output (a failure raises with the end of it)."""
    # One thread per process everywhere: torchrun gives that to several local processes but all the cores to a
    # single one, and the emulated nodes share this machine's cores.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(command)} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    return done.stdout


def shown(command: list[str]) -> str:
    """The command as a reader types it, relative to the repository, with .venv's Python."""
    text = shlex.join(command).replace(str(Path(PYTHON).parent) + "/", ".venv/bin/").replace(f"{REPO}/", "")
    return text.replace(".venv/bin/python3 ", ".venv/bin/python ")


def table_lines(text: str, header_start: str) -> list[str]:
    """The lines of ``text`` from the one starting with ``header_start`` to the next blank line, the emulator's own
    closing line (``cluster: exit codes ...``) or the end."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith(header_start))
    ends = (i for i in range(start + 1, len(lines)) if not lines[i].strip() or lines[i].startswith("cluster:"))
    return lines[start : next(ends, len(lines))]


def part_link(report: dict) -> list[str]:
    from common.cluster import EmulatedCluster, measure_link_rate

    out = ["configured  measured, one TCP stream (median of 3 runs of 2 s)  measured / configured"]
    rows = []
    for rate in ("100mbit", "1gbit"):
        with EmulatedCluster(nodes=2, rate=rate, name="mgcbench") as cluster:
            measured = statistics.median(measure_link_rate(cluster) for _ in range(3))
            rows.append({"rate": rate, "configured_bits": cluster.rate_bits, "measured_bits": measured})
        ratio = measured / rows[-1]["configured_bits"]
        out.append(f"{rate:>10} {measured / 1e6:>12.1f} Mbit/s {ratio:>44.3f}")
    report["link"] = rows
    return out


def part_allreduce(report: dict) -> list[str]:
    sizes = ["1K", "16K", "256K", "1M", "4M", "16M", "64M"]
    script = ["solutions/07_ring_allreduce.py", "--algorithms", "ring", "dist.all_reduce", "--sizes", *sizes]
    script += ["--iterations", "5"]
    out, rows = [], []
    for where, command in (("1gbit", cluster_line("1gbit", 1, script)), ("loopback", loopback_line(2, script))):
        printed = run(command)
        out += [f"$ {shown(command)}", *table_lines(printed, "size"), ""]
        for line in table_lines(printed, "size")[1:]:
            size, algorithm, ms, algbw, busbw = line.split()
            rows.append({"where": where, "size": size, "algorithm": algorithm, "ms": float(ms), "busbw": float(busbw)})
    link = 1e9 / 8 / 1e9  # 1 Gbit/s in GB/s
    out.append("bus bandwidth over 1gbit as a fraction of the link's 0.125 GB/s (the physical limit):")
    for row in rows:
        if row["where"] == "1gbit":
            row["fraction_of_link"] = row["busbw"] / link
            out.append(
                f"  {row['size']:>5} {row['algorithm']:>16}: {row['busbw']:.4f} GB/s = {row['fraction_of_link']:.0%}"
            )
    report["allreduce"] = rows
    return out


def fit_worker(json_path: Path) -> None:
    """Under torchrun: time dist.all_reduce at FIT_SIZES and fit alpha and beta (rank 0 writes the fit)."""
    from common.distributed import process_group
    from common.scaling import fit_all_reduce

    with process_group("gloo") as env:
        fit = fit_all_reduce(env, FIT_SIZES, 5)
        if env.rank == 0:
            json_path.write_text(json.dumps(fit))


def part_fit(report: dict) -> list[str]:
    out, rows = ["link     alpha ms   1/beta GB/s   link GB/s   1/beta / link"], []
    with tempfile.TemporaryDirectory() as tmp:
        for link, bits in (("1gbit", 1e9), ("200mbit", 2e8)):
            path = Path(tmp) / f"{link}.json"
            command = cluster_line(link, 1, ["benchmarks/cluster_network.py", "--fit-worker", path])
            run(command)
            fit = json.loads(path.read_text())
            inverse_beta = 1 / fit["beta_s_per_byte"] / 1e9 if fit["beta_s_per_byte"] else float("inf")
            rows.append({"link": link, **fit, "link_GBps": bits / 8 / 1e9})
            out.append(
                f"{link:>7} {fit['alpha_s'] * 1e3:>9.3f} {inverse_beta:>13.4f} {bits / 8 / 1e9:>11.4f} "
                f"{inverse_beta / (bits / 8 / 1e9):>15.2f}"
            )
            out.append(f"        (command: {shown(command)}; sizes {FIT_SIZES} bytes, 5 calls each)")
    report["fit"] = rows
    return out


def tables_by_link(links, command_for, header: str, read) -> tuple[list[str], dict]:
    """Run ``command_for(link, json_path)`` for each link ("loopback" or a rate): its printed table from the line
    starting with ``header``, under the command, and ``read(json_path)`` for each."""
    out, rows = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for where in links:
            path = Path(tmp) / f"{where}.json"
            command = command_for(where, path)
            printed = run(command, timeout=2400)
            out += [f"$ {shown(command)}", *table_lines(printed, header), ""]
            rows[where] = read(path)
    return out, rows


def part_ddp(report: dict) -> list[str]:
    def command_for(where, path):
        script = ["benchmarks/ddp_by_hand.py", "--json", path]
        return loopback_line(2, script) if where == "loopback" else cluster_line(where, 1, script)

    out, report["ddp"] = tables_by_link(
        ("loopback", "1gbit", "200mbit"), command_for, "build", lambda path: json.loads(path.read_text())
    )
    return out


def part_buckets(report: dict) -> list[str]:
    out = ["link   cap MiB | all-reduces per step | step ms | communication ms | exposed ms | hidden"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for link in ("1gbit",):
            for cap in (0.01, 1.0, 4.0, 25.0):
                folder = Path(tmp) / f"{link}-{cap}"
                script = ["solutions/06_profiling.py", "--model", "mlp", "--dataset", "digits", "--epochs", "2"]
                script += ["--max-batches-per-epoch", "12", "--num-workers", "0", "--bucket-cap-mb", cap]
                script += ["--trace-dir", folder / "traces", "--metrics-file", folder / "metrics.json"]
                command = cluster_line(link, 1, script)
                run(command)
                b = json.loads((folder / "metrics.json").read_text())["profile"]["trace_breakdown"]
                hidden = "-" if b["overlap"] is None else f"{b['overlap']:.0%}"
                rows.append({"link": link, "cap_mb": cap, **b})
                out.append(
                    f"{link:>5} {cap:>8.2f} | {b['all_reduces']:>20.0f} | {b['step_ms']:>7.1f} | "
                    f"{b['communication_ms']:>16.1f} | {b['exposed_communication_ms']:>10.1f} | {hidden:>6}"
                )
        out.append(f"(rank 0's trace, mean of 3 profiled steps; command for the 25 MiB run: {shown(command)})")
    report["buckets"] = rows
    return out


def part_compression(report: dict) -> list[str]:
    configs = ["allreduce", "powersgd-r1", "powersgd-r2", "powersgd-r4"]

    def command_for(where, path):
        command = [PYTHON, "benchmarks/gradient_compression.py", "--configs", *configs, "--seeds", "0"]
        return command + ["--epochs", "3", "--json", str(path)] + ([] if where == "loopback" else ["--link", where])

    out, report["compression"] = tables_by_link(
        ("loopback", "1gbit", "100mbit"), command_for, "configuration", lambda p: json.loads(p.read_text())["summary"]
    )
    return out


def part_tp(report: dict, rounds: int = 3) -> list[str]:
    layouts = [  # the same global batch of 64: replicas x batch per replica
        ("TP 4", 1, 64),
        ("TP 2 in a node x DP 2 across", 2, 32),
        ("DP 4", 4, 16),
    ]
    speeds = {}
    for _ in range(rounds):  # the runs take turns, so that a background load hits every layout alike
        for where in ("1gbit", "loopback"):
            for name, replicas, batch in layouts:
                script = ["solutions/13_tensor_parallel.py", "--dataset", "digits", "--epochs", "1"]
                script += ["--max-batches-per-epoch", "24", "--num-workers", "0", "--data-parallel", replicas]
                script += ["--batch-size", batch]
                command = loopback_line(4, script) if where == "loopback" else cluster_line(where, 2, script)
                printed = run(command)
                speed = float(re.search(r"\| ([\d,]+) samples/s \|", printed).group(1).replace(",", ""))
                speeds.setdefault((where, name), []).append(speed)
    out = [f"where     layout                          samples/s, median of {rounds} runs (min-max); 24 steps of 64"]
    rows = []
    for (where, name), runs in speeds.items():
        rows.append({"where": where, "layout": name, "samples_per_second": runs})
        middle = statistics.median(runs)
        out.append(f"{where:>8}  {name:<31} {middle:>9,.0f} ({min(runs):,.0f}-{max(runs):,.0f})")
    out.append(f"(command of the last run: {shown(command)})")
    report["tp"] = rows
    return out


def main(args) -> None:
    from common.reports import run_header

    head = [
        f"{run_header()} (this run; each part below is dated by its own run)",
        "two emulated nodes (scripts/cluster.py): network namespaces on a bridge, each link capped by tbf",
    ]
    print("\n".join(head), flush=True)  # run_header(): where and when
    # With --out, the parts not run now keep their earlier sections: each section names its own command and date.
    sections = read_sections(args.out) if args.out else {}
    report = json.loads(args.out.with_suffix(".json").read_text()) if args.out and sections else {}
    for part in args.parts:
        started = time.perf_counter()
        when = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
        lines = globals()[f"part_{part}"](report)
        command = shown([PYTHON, "benchmarks/cluster_network.py", "--parts", part])
        sections[part] = [f"== {part}: {when}, {time.perf_counter() - started:.0f} s, $ {command}", *lines]
        print("\n".join(sections[part]), flush=True)
        if args.out:  # after every part: a run cut short keeps what it measured
            args.out.parent.mkdir(parents=True, exist_ok=True)
            ordered = [sections[name] for name in PARTS if name in sections]
            args.out.with_suffix(".txt").write_text("\n\n".join("\n".join(lines) for lines in [head, *ordered]) + "\n")
            args.out.with_suffix(".json").write_text(json.dumps({**report, "setup": head}, indent=2) + "\n")


def read_sections(out: Path) -> dict[str, list[str]]:
    """The parts' sections of an earlier ``OUT.txt``: ``{part: its lines}``, each from its ``== part`` line on."""
    path = out.with_suffix(".txt")
    if not path.exists():
        return {}
    sections, current = {}, None
    for line in path.read_text().splitlines():
        if line.startswith("== "):
            current = line[3:].split(":")[0].split()[0]
            sections[current] = []
        if current is not None:
            sections[current].append(line)
    return {part: lines[:-1] if lines and not lines[-1].strip() else lines for part, lines in sections.items()}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=PARTS)
    parser.add_argument("--out", type=Path, help="write OUT.txt and OUT.json")
    parser.add_argument("--fit-worker", type=Path, help=argparse.SUPPRESS)  # the fit part's torchrun entry
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.fit_worker:
        fit_worker(arguments.fit_worker)
    else:
        main(arguments)
