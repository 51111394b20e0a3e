"""The planner checked against measurement (lesson 16): predicted and measured step time and memory, 2 nodes x 2.

    python benchmarks/planner_check.py --json results/cpu-amd-epyc-2core/planner_check.json   # about 4 min, root
    python benchmarks/planner_check.py --configs fsdp --steps 4                                 # the smallest run

First it measures this machine's inputs to the planner (``common.planner.measured_cluster``): the compute rate of
one process (the GPT's training step, one thread, the planner's own FLOP count over the median step time) and the
share of it each of 4 processes gets when all compute at once (2 cores, and whatever else the machine runs), the
intra-node link (two processes on loopback) and the inter-node link (two emulated nodes joined at --link), each an
alpha-beta fit of ``dist.all_reduce`` (``common.scaling.fit_all_reduce``, gloo), and the fixed cost of one collective
call as the composition issues it (``call_overhead``: FSDP2 on tiny blocks, 4 processes at once on the 2 nodes, so
that bytes cost nothing: the step's time beyond its compute, per call counted, less the link's alpha). Then it runs
each configuration of
solutions/17_composition.py's functions (``common.parallelize``) on 2 emulated nodes of 2 processes (scripts/cluster.py)
and sets what it measured beside what the planner predicts for the same mesh:

- step time: the median, over the steps after the first two, of rank 0's seconds from a barrier to the step's
  loss all-reduced (forward, backward, AdamW's step; ``global_mean_loss``'s small all-reduce is in it).
- collective calls: those of the step whose memory is counted, on each rank (torch's ``CommDebugMode``: FSDP's,
  tensor parallelism's and the loss's; the pipeline's point-to-point sends are not collectives and not counted),
  beside ``common.planner.collective_calls``.
- memory per rank: the model state that rank holds after the step (``common.memory.training_state_bytes``: the
  local shards of parameters, gradients and AdamW's states) plus the bytes autograd saves for backward during one
  step's forward passes (every micro-batch's: the schedule is GPipe, all forwards before any backward), parameters
  left out. Those are the planner's four parts, part by part. Process RSS is not used: Python and PyTorch's ~300
  MB would hide a model of a few MB. Taken after the step, the measurement cannot see FSDP's gathered blocks, which
  the planner adds under ZeRO-3 (two whole blocks, ``predict_memory``): the FSDP meshes' prediction is that much
  high. Communication buffers and the allocator are left out of both. The largest rank counts.

The tokens are random (the same global batch on every rank, from the step): time and memory do not depend on them.
Every process runs one thread (OMP_NUM_THREADS=1). The planner prices each mesh as the composition runs it: ZeRO-3,
HSDP where it has replicas, the GPipe schedule. It prints the table with each error, a reason beside each one over
25%, and writes --json: every part, predicted and measured, for lesson 16's pictures
(scripts/lesson_figures/l16_composition.py).
"""

import argparse
import contextlib
import copy
import dataclasses
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from common.launch import REPO, cluster_command, torchrun_command

FIT_SIZES = [4, 4096, 65536, 1 << 20, 4 << 20]
OVERHEAD_BLOCKS = 16  # tiny FSDP units in the call-overhead measurement: 3 calls each per step
# name: (pp, dp, replicas, tp, micro-batches); the same global batch, the same GPT
CONFIGS = {
    "fsdp": (1, 4, 1, 1, 1),
    "hsdp": (1, 4, 2, 1, 1),
    "dp2-tp2": (1, 2, 1, 2, 1),
    "tp4": (1, 1, 1, 4, 1),
    "pp2-dp2-m2": (2, 2, 1, 1, 2),
    "pp2-dp2-m4": (2, 2, 1, 1, 4),
    "pp2-tp2-m4": (2, 1, 1, 2, 4),
}
TOLERANCE = 0.25


def shapes(args) -> dict:
    return dict(layers=args.layers, hidden=args.d_model, heads=args.heads, seq=args.context, batch=args.batch_size)


def planner_model(args):
    """The composition's GPT as the planner sees it (``common.planner.gpt_model``): no dropout, its default."""
    from common.planner import gpt_model

    return gpt_model(256, args.context, args.d_model, args.heads, args.layers)


def run(command: list[str], timeout: float = 600) -> str:
    """Run ``command`` from the repository with one thread per process; its output (a failure raises with it)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    return done.stdout


# -- the machine's inputs ------------------------------------------------------------------------------------------


def time_steps(args, steps: int = 8) -> float:
    """The median seconds of the GPT's training step on the whole global batch, in this process, one thread."""
    import torch

    from common.gpt import GPT, next_token_loss

    torch.set_num_threads(1)
    torch.manual_seed(0)
    gpt = GPT(256, args.context, args.d_model, args.heads, args.layers, 0.0)
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=3e-3, foreach=False)
    tokens = torch.randint(0, 256, (args.batch_size, args.context + 1))
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        next_token_loss(gpt(tokens[:, :-1]), tokens[:, 1:]).backward()
        optimizer.step()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds[2:])


def compute_worker(args) -> None:
    """Under torchrun, no process group: each process times the step alone, all of them at once (the sharing)."""
    rank = os.environ["RANK"]
    (args.compute_worker / f"rank{rank}.json").write_text(json.dumps(time_steps(args)))


def measure_compute(args, tmp: Path) -> dict:
    """FLOP/s of one process alone (one thread: the planner's FLOPs of a global batch over the median step), and
    of each of 4 processes computing at once on this machine's shared cores, with whatever else runs on it."""
    from common.planner import model_flops_per_token

    flops = model_flops_per_token(planner_model(args)) * args.batch_size * args.context
    alone = time_steps(args)
    folder = tmp / "compute"
    folder.mkdir()
    script = [__file__, "--compute-worker", folder, "--layers", args.layers, "--d-model", args.d_model]
    script += ["--heads", args.heads, "--context", args.context, "--batch-size", args.batch_size]
    run(torchrun_command(*script, nproc=4))
    shared = statistics.mean(json.loads(path.read_text()) for path in folder.glob("rank*.json"))
    return {"flops_per_step": flops, "step_seconds": alone, "flops": flops / alone,
            "shared_step_seconds": shared, "shared_flops": flops / shared}  # fmt: skip


def fit_worker(path: Path) -> None:
    """Under torchrun: rank 0 writes the alpha-beta fit of ``dist.all_reduce`` at FIT_SIZES."""
    from common.distributed import process_group
    from common.scaling import fit_all_reduce

    with process_group("gloo") as env:
        fit = fit_all_reduce(env, FIT_SIZES, 5)
        if env.rank == 0:
            path.write_text(json.dumps(fit))


def measure_link(where: str, tmp: Path) -> dict:
    """The fit of a two-rank all-reduce on loopback (``where`` = "loopback") or across two nodes at rate ``where``."""
    path, script = tmp / f"fit-{where}.json", [__file__, "--fit-worker"]
    command = torchrun_command(*script, tmp / f"fit-{where}.json", nproc=2) if where == "loopback" else (
        cluster_command(*script, path, nproc=2, link=where))  # fmt: skip
    run(command)
    return json.loads(path.read_text())


def overhead_worker(path: Path) -> None:
    """Under scripts/cluster.py, 4 processes on 2 nodes: FSDP2 over each node's 2 ranks (both pairs at once), on
    OVERHEAD_BLOCKS linears of 8 x 8. Rank 0 writes the median step (forward and backward), the same step's compute
    unsharded, and the collective calls counted in one step."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from common.collectives import count_collectives
    from common.distributed import process_group

    torch.set_num_threads(1)
    with process_group("gloo") as env:
        mesh = init_device_mesh("cpu", (env.world_size // 2, 2), mesh_dim_names=("node", "shard"))["shard"]
        torch.manual_seed(0)
        blocks = nn.Sequential(*[nn.Linear(8, 8) for _ in range(OVERHEAD_BLOCKS)])
        plain, inputs = copy.deepcopy(blocks), torch.randn(2, 8)
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(blocks, mesh=mesh)

        def step_seconds(net, steps: int = 12) -> float:
            seconds = []
            for _ in range(steps):
                dist.barrier()
                started = time.perf_counter()
                net(inputs).sum().backward()
                seconds.append(time.perf_counter() - started)
            return statistics.median(seconds[2:])

        with count_collectives() as log:
            blocks(inputs).sum().backward()
        sharded, alone = step_seconds(blocks), step_seconds(plain)
        if env.rank == 0:
            path.write_text(json.dumps({"step_seconds": sharded, "compute_seconds": alone, "calls": log.count()}))


def measure_call_overhead(link: str, tmp: Path, intra: dict) -> dict:
    """Seconds of one collective call beyond the intra-node link's alpha (``overhead_worker``)."""
    path = tmp / "overhead.json"
    run(cluster_command(__file__, "--overhead-worker", path, nproc=4, link=link))
    measured = json.loads(path.read_text())
    per_call = (measured["step_seconds"] - measured["compute_seconds"]) / measured["calls"]
    alpha = intra["alpha_s"] / 2  # a 2-rank all-gather of a few bytes: one ring step (common.planner.ring_seconds)
    return {**measured, "per_call_seconds": per_call, "alpha_s": alpha, "call_overhead": max(per_call - alpha, 0.0)}


# -- one configuration, under torchrun on every rank ----------------------------------------------------------------


def saved_activation_bytes(log: dict):
    """A ``saved_tensors_hooks`` pack that adds to ``log`` (data pointer: bytes) every tensor autograd saves but a
    parameter or a view of one (FSDP's gathered weights, a linear's transposed weight); a DTensor counts its shard."""
    from torch import nn
    from torch.distributed.tensor import DTensor

    def pack(tensor):
        if not isinstance(tensor, nn.Parameter) and not isinstance(tensor._base, nn.Parameter):
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            key, nbytes = local.untyped_storage().data_ptr(), local.numel() * local.element_size()
            log[key] = max(log.get(key, 0), nbytes)
        return tensor

    return pack


def worker(args) -> None:
    """Train ``args.config`` for ``args.steps`` timed steps and one step whose saved tensors are counted; rank 0
    writes the step times and every rank's memory to ``args.worker``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    from common.distributed import process_group, set_seed
    from common.gpt import GPT
    from common.memory import training_state_bytes
    from common.parallelize import data_rank, forward_backward, global_mean_loss, make_mesh, make_schedule, parallelize

    pp, dp, replicas, tp, microbatches = CONFIGS[args.config]
    with process_group("gloo") as env:
        mesh = make_mesh("cpu", pp, dp, tp, env.world_size, replicas)
        set_seed(0)
        gpt = GPT(256, args.context, args.d_model, args.heads, args.layers, 0.0)
        model, _ = parallelize(gpt, mesh)
        schedule = make_schedule(model, mesh, microbatches, env.device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)
        index, share = data_rank(mesh)[0], args.batch_size // dp
        seconds, saved, comm = [], {}, CommDebugMode()
        for step in range(args.steps + 1):  # the last step is not timed: its saved tensors are counted
            generator = torch.Generator().manual_seed(step)
            batch = torch.randint(0, 256, (args.batch_size, args.context + 1), generator=generator)
            batch = batch[index * share : (index + 1) * share]
            dist.barrier()
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            counted = torch.autograd.graph.saved_tensors_hooks(saved_activation_bytes(saved), lambda tensor: tensor)
            last = step == args.steps
            with counted if last else contextlib.nullcontext(), comm if last else contextlib.nullcontext():
                local = forward_backward(model, schedule, mesh, batch[:, :-1], batch[:, 1:])  # no hooks when timed
            optimizer.step()
            global_mean_loss(local, mesh, env.device)
            seconds.append(time.perf_counter() - started)
        memory = {**training_state_bytes(model, optimizer), "activations": sum(saved.values())}
        memory["collective_calls"] = comm.get_total_counts()
        ranks = [None] * env.world_size
        dist.all_gather_object(ranks, memory)
        if env.rank == 0:
            args.worker.write_text(json.dumps({"seconds": seconds[:-1], "ranks": ranks}))


# -- predicted against measured ---------------------------------------------------------------------------------------


def predict(args, cluster, name: str) -> dict:
    from common.planner import Config, Training, collective_calls, predict_memory, predict_step_time

    pp, dp, replicas, tp, microbatches = CONFIGS[name]
    per_rank = args.batch_size // dp
    config = Config(dp=dp, tp=tp, pp=pp, micro_batch=per_rank // microbatches, micro_batches=microbatches, zero=3,
                    replicas=replicas, schedule="gpipe")  # fmt: skip  # as the composition runs it
    training = Training(args.batch_size, precision="fp32")
    model = planner_model(args)
    return {"time": predict_step_time(model, cluster, training, config),
            "memory": predict_memory(model, cluster, training, config),
            "calls": collective_calls(model, config)}  # fmt: skip


def reasons(name: str, time_error: float, memory_error: float) -> list[str]:
    """Why a prediction is off by more than TOLERANCE, from what this machine and the composition do that the
    planner does not price."""
    pp, dp, replicas, tp, microbatches = CONFIGS[name]
    found = []
    if time_error < -TOLERANCE:
        found.append("slower than predicted: the compute share was measured with 4 processes computing, but in a "
                      "step they also run Python, copy and wait on the same 2 cores")  # fmt: skip
        if dp > 1:
            found.append("FSDP copies each unit's parameters in and out of its flat buffers, bytes the call overhead "
                         "(measured on tiny blocks) does not include")  # fmt: skip
        if pp > 1:
            found.append(f"each of the {microbatches} micro-batches adds a schedule step in Python, and the "
                         "point-to-point sends are priced like collectives")  # fmt: skip
        if tp > 1:
            found.append("DTensor dispatches every operation on a weight in Python, not only the collectives")
    elif time_error > TOLERANCE:
        found.append("faster than predicted: the planner counts every collective as exposed, while gloo's threads "
                     "send while other processes compute on the shared cores")  # fmt: skip
    if abs(memory_error) > TOLERANCE:
        if memory_error > 0:
            found.append("the planner adds two gathered blocks for FSDP's prefetch; the measurement takes the "
                         "state after the step, when FSDP has freed them")  # fmt: skip
        if tp > 1 and memory_error < 0:
            found.append("the planner divides every saved tensor by tp; the tp ranks save more than that (the "
                         "JSON's measured_memory against predicted_memory)")  # fmt: skip
    return found


def main(args) -> None:
    from common.planner import measured_cluster
    from common.reports import run_header

    print(run_header(), flush=True)
    print(f"the GPT: {shapes(args)}, vocabulary 256, fp32, AdamW; {args.steps} steps (median of the last "
          f"{args.steps - 2}); 2 emulated nodes x 2 processes joined at {args.link}", flush=True)  # fmt: skip
    report = {"setup": {**shapes(args), "link": args.link, "steps": args.steps}}
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        compute = measure_compute(args, tmp)
        intra, inter = measure_link("loopback", tmp), measure_link(args.link, tmp)
        cores = len(os.sched_getaffinity(0))
        share = compute["shared_flops"] / compute["flops"]  # measured: the load of other jobs included
        overhead = measure_call_overhead(args.link, tmp, intra)
        cluster = measured_cluster("this machine, 2 x 2", 2, 2, 1e12, compute["flops"], intra, inter, cores, share,
                                   call_overhead=overhead["call_overhead"])  # fmt: skip
        report["inputs"] = {"compute": compute, "intra": intra, "inter": inter, "cores": cores, "share": share,
                            "overhead": overhead, "cluster": vars(cluster)}  # fmt: skip
        print("\nthe machine's inputs to the planner (common.planner.measured_cluster):")
        print(f"  compute, one process, one thread: {compute['flops'] / 1e9:.2f} GFLOP/s "
              f"({compute['flops_per_step'] / 1e9:.2f} GFLOP in {compute['step_seconds'] * 1e3:.0f} ms); "
              f"4 processes at once on {cores} cores: {compute['shared_flops'] / 1e9:.2f} GFLOP/s each, a share "
              f"of {share:.2f} (cores / processes: {min(1, cores / 4):.2f})")  # fmt: skip
        for label, fit in (("intra-node (loopback)", intra), (f"inter-node ({args.link})", inter)):
            print(f"  {label} all-reduce of 2 ranks: alpha {fit['alpha_s'] * 1e3:.3f} ms, 1/beta "
                  f"{fit['bandwidth_gb_s']:.3f} GB/s")  # fmt: skip
        print(f"  one collective call, FSDP2 on {OVERHEAD_BLOCKS} tiny blocks, 4 processes: "
              f"{overhead['per_call_seconds'] * 1e3:.2f} ms ({overhead['calls']} calls, "
              f"{overhead['step_seconds'] * 1e3:.1f} ms a step, {overhead['compute_seconds'] * 1e3:.1f} ms of it "
              f"compute); less the link's alpha {overhead['alpha_s'] * 1e3:.3f} ms: a call overhead of "
              f"{cluster.call_overhead * 1e3:.2f} ms")  # fmt: skip
        rows = []
        for name in args.configs:
            path = tmp / f"{name}.json"
            script = [__file__, "--worker", path, "--config", name, "--steps", args.steps]
            script += ["--layers", args.layers, "--d-model", args.d_model, "--heads", args.heads]
            script += ["--context", args.context, "--batch-size", args.batch_size]
            run(cluster_command(*script, nproc=4, link=args.link))
            measured = json.loads(path.read_text())
            step = statistics.median(measured["seconds"][2:])
            fullest = max(measured["ranks"], key=lambda rank: rank["total"] + rank["activations"])
            memory = fullest["total"] + fullest["activations"]
            predicted = predict(args, cluster, name)
            without = predict(args, dataclasses.replace(cluster, call_overhead=0.0), name)["time"]["total"]
            row = {"config": name, "measured_seconds": step, "predicted_seconds": predicted["time"]["total"],
                   "measured_bytes": memory, "predicted_bytes": predicted["memory"]["total"],
                   "measured_memory": fullest, "predicted_memory": predicted["memory"],
                   "predicted_time": predicted["time"], "step_seconds": measured["seconds"],
                   "predicted_seconds_without_call_overhead": without, "predicted_calls": predicted["calls"],
                   "measured_calls": max(rank["collective_calls"] for rank in measured["ranks"])}  # fmt: skip
            row["time_error"] = row["predicted_seconds"] / step - 1
            row["memory_error"] = row["predicted_bytes"] / memory - 1
            row["reasons"] = reasons(name, row["time_error"], row["memory_error"])
            rows.append(row)
            print(f"  ran {name}: {step * 1e3:.0f} ms per step (load average {os.getloadavg()[0]:.1f})", flush=True)
    report["rows"] = rows
    print_table(rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


def print_table(rows: list[dict]) -> None:
    print(
        "\nerror = predicted / measured - 1; (compute): the predicted compute, the rest is bubble and "
        "communication;\n(no call cost): the prediction without the call overhead; calls: collective calls per step "
        "on the busiest rank,\npredicted (common.planner.collective_calls, pipeline sends left out) and counted;\n"
        "memory: the fullest rank's parameters, gradients, AdamW states, saved activations"
    )
    print(f"{'config':<12} {'step ms: predicted':>18} {'(compute)':>9} {'(no call cost)':>14} {'measured':>9} "
          f"{'error':>7}   {'calls':>5} {'counted':>7}   {'MiB: predicted':>14} {'measured':>9} "
          f"{'error':>7}")  # fmt: skip
    for row in rows:
        compute, calls = row["predicted_time"]["compute"], row["predicted_calls"]
        print(f"{row['config']:<12} {row['predicted_seconds'] * 1e3:>18.0f} {compute * 1e3:>9.0f} "
              f"{row['predicted_seconds_without_call_overhead'] * 1e3:>14.0f} {row['measured_seconds'] * 1e3:>9.0f} "
              f"{row['time_error']:>+7.0%}   {calls['total'] - calls['pipeline p2p']:>5} {row['measured_calls']:>7}   "
              f"{row['predicted_bytes'] / 2**20:>14.2f} "
              f"{row['measured_bytes'] / 2**20:>9.2f} {row['memory_error']:>+7.0%}")  # fmt: skip
    print(f"\nwhere an error is over {TOLERANCE:.0%}, why:")
    for row in rows:
        for reason in row["reasons"]:
            print(f"  {row['config']}: {reason}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--link", default="1gbit", help="the emulated inter-node link (scripts/cluster.py)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per configuration; the first 2 warm up")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16, help="the global batch, sequences per step")
    parser.add_argument("--json", type=Path, help="write the inputs and the table here, for a picture")
    parser.add_argument("--config", choices=list(CONFIGS), help=argparse.SUPPRESS)  # the worker's configuration
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # under torchrun: one configuration
    parser.add_argument("--compute-worker", type=Path, help=argparse.SUPPRESS)  # under torchrun: compute alone
    parser.add_argument("--fit-worker", type=Path, help=argparse.SUPPRESS)  # under torchrun: one link's fit
    parser.add_argument("--overhead-worker", type=Path, help=argparse.SUPPRESS)  # under cluster.py: a call's cost
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.fit_worker:
        fit_worker(arguments.fit_worker)
    elif arguments.overhead_worker:
        overhead_worker(arguments.overhead_worker)
    elif arguments.compute_worker:
        compute_worker(arguments)
    elif arguments.worker:
        worker(arguments)
    else:
        main(arguments)
