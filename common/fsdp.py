"""Sharded data parallelism: the plumbing around FSDP2, sharded checkpoints, and lesson 06's measurements.

Lesson 06's subject itself, sharding a model (``fully_shard`` on every block, then the root), is written out
once, in ``solutions/03_fsdp.py`` (``shard_model``); the tests and the measurements here run that function
(``common.launch.load_script``), never a copy. The order matters, as in torchtitan's ``apply_fsdp``:

    net = shard_model(model, env, "full")             # on make_mesh(env): every block, then the root
    optimizer = torch.optim.Adam(net.parameters())    # AFTER sharding: it must see the DTensor shards

``fully_shard`` replaces each parameter by a DTensor that holds 1/N of it (rows split along dim 0) on each
rank. In forward and backward it all-gathers one block's parameters just before that block runs, and in
backward it reduce-scatters the gradients, so each rank keeps only the gradient of its own shard, averaged
over ranks.

Checkpoints stay sharded: ``save_sharded_checkpoint`` has every rank write its own shards with
``torch.distributed.checkpoint`` (DCP), and ``load_sharded_checkpoint`` reads them back at any world size.
``export_full_state_dict`` gathers a plain, unsharded ``state_dict`` for a model without any wrapper.
``report_model_state`` prints what each rank holds beside ZeRO's prediction (``common.memory``), and
``finish_sharded_run`` ends a run with it, as ``common.training.finish_run`` ends the DDP scripts' runs.
"""

import argparse
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from common.checkpoint import atomic_write, unwrap
from common.distributed import is_main, print0, replicas_in_sync
from common.launch import load_script
from common.memory import local_bytes, peak_memory_mib, reset_peak_memory, training_state_bytes, zero_bytes_per_rank
from common.models import DeepMLP
from common.training import TrainingHistory, write_metrics

SOLUTION = Path(__file__).resolve().parents[1] / "solutions" / "03_fsdp.py"  # lesson 06's shard_model and checkpoints
SHARDING = ("full", "grad-op", "none")  # the --sharding choices: FSDP2 with reshard_after_forward True, False; DDP
FSDP_PRECISIONS = ("fp32", "bf16")  # the --precision choices of lesson 06: FSDP2's param_dtype None or bfloat16
# What measure_model_state compares; the last is fsdp-full with the root forced to reshard after forward too
STRATEGIES = ("ddp", "zero1", "fsdp-grad-op", "fsdp-full", "fsdp-full-root-resharded")


def sharding_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add lesson 06's options to ``parser``: how to shard, in which precision, offloaded or not, and checkpoints."""
    parser.add_argument(
        "--sharding",
        choices=SHARDING,
        default="full",
        help="full (FSDP1's FULL_SHARD, ZeRO-3): free each block's gathered parameters after its "
        "forward; grad-op (SHARD_GRAD_OP): keep them until its backward; none: DDP, ZeRO stage 0",
    )
    parser.add_argument(
        "--precision",
        choices=FSDP_PRECISIONS,
        default="fp32",
        help="bf16: compute in bf16 (MixedPrecisionPolicy); shards and optimizer stay fp32",
    )
    parser.add_argument(
        "--cpu-offload",
        action="store_true",
        help="keep shards, gradients and Adam's states in CPU memory (CPUOffloadPolicy)",
    )
    parser.add_argument("--checkpoint-dir", type=Path, help="save a sharded (DCP) checkpoint here after every epoch")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    return parser


def check_sharding_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Return ``args``, or stop with a usage message (``parser.error``) where ``sharding_arguments``' options do not
    go together."""
    if args.resume and args.checkpoint_dir is None:
        parser.error("--resume needs --checkpoint-dir")
    if args.precision != "fp32" and args.sharding == "none":
        parser.error("--precision bf16 goes through FSDP2's MixedPrecisionPolicy: use --sharding full or grad-op")
    if args.cpu_offload and args.sharding == "none":
        parser.error("--cpu-offload goes through FSDP2's CPUOffloadPolicy: use --sharding full or grad-op")
    return args


def make_mesh(env) -> DeviceMesh:
    """A 1-D ``DeviceMesh`` over every rank of the process group, on this rank's device type (cuda or cpu).

    A mesh names the ranks that shard among themselves; a 2-D mesh (replicate x shard) would give HSDP.
    """
    return init_device_mesh(env.device.type, (env.world_size,), mesh_dim_names=("dp",))


def mixed_precision_policy(precision: str = "fp32") -> MixedPrecisionPolicy:
    """FSDP2's policy for ``precision`` ``fp32`` or ``bf16``.

    bf16: the all-gathered parameters, hence the forward and backward compute, are bf16; the gradients are
    reduce-scattered in fp32 (``reduce_dtype``), and the sharded parameters, gradients and optimizer states
    stay fp32. fp32: the default policy, which changes nothing.
    """
    if precision not in FSDP_PRECISIONS:
        raise ValueError(f"precision must be one of {FSDP_PRECISIONS}, not {precision!r}")
    if precision == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def force_sum_reduction(model: nn.Module) -> None:
    """Make every FSDP2 unit of ``model`` reduce gradients with SUM and then divide by N itself.

    By default FSDP2 reduce-scatters fp32 and bf16 gradients with ``ReduceOp.AVG`` and trusts the backend to
    divide. gloo's reduce-scatter once ignored AVG and summed (pytorch/pytorch#162338): gradients N times too
    large, silently. ``set_force_sum_reduction_for_comms`` is FSDP2's switch around that; it acts on one unit,
    so this calls it on each. Measured in PyTorch 2.14.1: both ways give DDP's gradients on gloo.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def reshard(model: nn.Module) -> None:
    """Free every gathered (unsharded) parameter of an FSDP2 model, keeping only the shards; else do nothing.

    A forward leaves the root's own parameters gathered until a backward reshards them (FSDP2's default for the
    root), and with ``reshard_after_forward=False`` every block's too. An evaluation runs forwards without a
    backward, so after it these stay gathered on every rank (under ``False`` the whole model: DDP's memory) until
    this is called or the next backward runs.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def full_tensor(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """The whole tensor: a DTensor's shards all-gathered (a collective: call on every rank); others as they are."""
    if isinstance(tensor, DTensor):
        return tensor.full_tensor()
    return tensor


def full_parameters(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter of ``model`` whole, detached; sharded ones are gathered (call on every rank)."""
    return [full_tensor(p.detach()) for p in model.parameters()]


def full_gradients(model: nn.Module) -> list[torch.Tensor | None]:
    """Every parameter's gradient whole; sharded ones are gathered (call on every rank)."""
    return [full_tensor(p.grad) for p in model.parameters()]


def epoch_checkpoint_dir(checkpoint_dir, epoch: int) -> Path:
    """The folder of the sharded checkpoint taken after ``epoch``: one file per rank plus ``.metadata``."""
    return Path(checkpoint_dir) / f"epoch-{epoch:04d}"


def latest_checkpoint(checkpoint_dir) -> Path | None:
    """The newest complete checkpoint folder in ``checkpoint_dir``, or ``None``."""
    found = sorted(
        path for path in Path(checkpoint_dir).glob("epoch-[0-9][0-9][0-9][0-9]") if (path / ".metadata").exists()
    )
    return found[-1] if found else None


def save_sharded_checkpoint(path, net: nn.Module, optimizer: torch.optim.Optimizer, epoch: int, step: int) -> None:
    """Every rank writes its own shards of model and optimizer into folder ``path`` (DCP), with the progress.

    Written under a temporary name that global rank 0 renames once all ranks are done: never half a checkpoint.
    Call on every rank.
    """
    partial = path.with_name(path.name + ".partial")
    if is_main():
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()
    model_state, optimizer_state = get_state_dict(net, optimizer)  # DTensor shards, keyed by parameter name
    dcp.save(
        {"model": model_state, "optimizer": optimizer_state, "progress": {"epoch": epoch, "step": step}},
        checkpoint_id=partial,
    )
    dist.barrier()  # all shards are on disk
    if is_main():
        shutil.rmtree(path, ignore_errors=True)
        os.replace(partial, path)
    dist.barrier()


def load_sharded_checkpoint(path, net: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Load ``save_sharded_checkpoint``'s folder into the sharded ``net`` and ``optimizer``; return the progress.

    Any world size: each rank asks DCP for the slices that its own shards cover, whichever ranks wrote them.
    """
    model_state, optimizer_state = get_state_dict(net, optimizer)  # the sharded layout for DCP to fill
    state = {"model": model_state, "optimizer": optimizer_state, "progress": {"epoch": 0, "step": 0}}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(net, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return state["progress"]


def export_full_state_dict(path, model: nn.Module) -> None:
    """Gather the whole model into one plain ``state_dict`` and have global rank 0 save it to ``path``.

    The result loads into the unwrapped model class with ``load_state_dict`` and no ``torch.distributed`` at
    all. The gathering is a collective: call on every rank, never inside ``if rank == 0``. ``cpu_offload``
    moves each gathered tensor to CPU memory, on rank 0 only, so no GPU ever holds the whole model.
    """
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if is_main():
        atomic_write(path, lambda file: torch.save(state, file))
    dist.barrier()


def report_model_state(env, num_parameters: int, sharding: str, state_bytes: dict | None) -> dict:
    """Gather every rank's model-state bytes and peak memory, and have rank 0 print them beside ZeRO's prediction.

    ``state_bytes``: this rank's ``training_state_bytes`` after its last step, plus ``parameters_after_forward``
    (the parameter bytes the modules pointed to between a forward and its backward: a gathered unit whole, a
    resharded one as its shard; FSDP2 keeps a gathered unit's shard as well, which this leaves out); ``None`` when
    the run trained nothing.
    ``sharding`` is the solution's ``--sharding``: ``none`` (DDP) is ZeRO stage 0, ``full`` and ``grad-op`` stage
    3, since between steps both hold shards only. Call on every rank (it gathers). Returns what the metrics file
    keeps: ``{"predicted_bytes_per_rank", "memory_per_rank"}``.
    """
    mine = {"rank": env.rank, **(state_bytes or {}), "peak_memory_mib": peak_memory_mib(env.device)}
    per_rank = [None] * env.world_size
    dist.all_gather_object(per_rank, mine)
    stage = 0 if sharding == "none" else 3
    predicted = zero_bytes_per_rank(num_parameters, env.world_size, stage)
    print0(
        f"{num_parameters:,} parameters; model state per rank, MB (predicted for ZeRO stage {stage}: "
        f"{predicted['total'] / 1e6:.2f})"
    )
    for row in per_rank if state_bytes else []:  # a resumed run with no epoch left trained nothing
        print0(
            f"  rank {row['rank']}: parameters {row['parameters'] / 1e6:.2f}, gradients "
            f"{row['gradients'] / 1e6:.2f}, optimizer {row['optimizer'] / 1e6:.2f}, total {row['total'] / 1e6:.2f}"
            f" | held between forward and backward {row['parameters_after_forward'] / 1e6:.2f}"
        )
    return {"predicted_bytes_per_rank": predicted, "memory_per_rank": per_rank}


def finish_sharded_run(net: nn.Module, history: TrainingHistory, args, state_bytes: dict | None) -> None:
    """Lesson 06's ``finish_run`` (call on every rank): check that the gathered parameters are identical on every
    rank, print each rank's model state beside ZeRO's prediction (``report_model_state``, with ``state_bytes``),
    then ``write_metrics`` with the run's sharding, precision and parameter count."""
    env = history.env
    num_parameters = sum(p.numel() for p in net.parameters())  # a DTensor's numel() is the whole tensor's
    in_sync = replicas_in_sync(net)  # gathers the shards: a collective
    print0(f"full parameters identical on all {env.world_size} rank(s): {in_sync}")
    memory = report_model_state(env, num_parameters, args.sharding, state_bytes)  # every rank's, and ZeRO's
    setting = dict(sharding=args.sharding, precision=args.precision, num_parameters=num_parameters)
    write_metrics(history, args, **setting, parameters_in_sync=in_sync, **memory)


def measure_model_state(
    env, strategy: str, script=SOLUTION, width: int = 512, depth: int = 4, batch_size: int = 32
) -> dict:
    """Apply ``strategy`` to a ``DeepMLP``, take one Adam step, and return what this rank holds and gathers.

    ``strategy``: ``ddp`` (every rank a replica, ZeRO stage 0), ``zero1`` (DDP with
    ``ZeroRedundancyOptimizer``: optimizer states partitioned), ``fsdp-grad-op`` and ``fsdp-full`` (FSDP2 with
    the blocks' ``reshard_after_forward`` False and True; the root keeps FSDP2's default), and
    ``fsdp-full-root-resharded`` (``fsdp-full``, the root set to reshard after forward as well). The model is
    wrapped by ``shard_model`` of ``script``: lesson 06's solution, or your ``labs/03_fsdp.py``. The result has
    ``training_state_bytes``'s keys (bytes after the step), plus ``after_forward`` and ``backward_start`` (the
    parameter bytes the modules point to between the forward and the backward, and once backward has begun: the
    root's pre-backward has run; a gathered unit counts whole, a resharded one as its shard, and the shard FSDP2
    keeps beside a gathered unit is not counted), ``all_gathers`` (all-gather calls in the step, counted by
    ``CommDebugMode``) and, on a GPU, ``cuda_peak_mib`` (``torch.cuda.max_memory_allocated`` over the step,
    activations included). The FSDP2 model measured here outlives this call (seen on CPU under ``CommDebugMode``,
    even after ``gc.collect()``), so a later call's ``cuda_peak_mib`` in the same process includes it: measure one
    strategy per process to compare peaks. Call on every rank of a process group, for example through
    ``common.launch.run_on_ranks``.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, not {strategy!r}")
    shard_model = load_script(script).shard_model
    reset_peak_memory(env.device)
    torch.manual_seed(0)
    model = DeepMLP(width=width, depth=depth).to(env.device)
    net = shard_model(model, env, {"fsdp-grad-op": "grad-op", "ddp": "none", "zero1": "none"}.get(strategy, "full"))
    if strategy == "fsdp-full-root-resharded":
        net.set_reshard_after_forward(True, recurse=False)  # the root unit alone; the blocks are set already
    if strategy == "zero1":
        optimizer = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.Adam)
    else:
        optimizer = torch.optim.Adam(net.parameters())
    torch.manual_seed(env.rank)
    X = torch.randn(batch_size, *DeepMLP.input_shape, device=env.device)
    y = torch.randint(0, 10, (batch_size,), device=env.device)
    held = {}
    with warnings.catch_warnings(), CommDebugMode() as comm:
        # CommDebugMode's module tracker makes module outputs views, and FSDP2 warns about views (an in-place op
        # on one would skip its all-gather); nothing here writes to them.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")

        def sample(grad):  # when the gradient reaches the head's input: the head's backward, the first, has run
            held.setdefault("backward_start", local_bytes(net.parameters()))

        def hook_the_input(module, args):
            args[0].register_hook(sample)

        unwrap(net).head.register_forward_pre_hook(hook_the_input)
        output = net(X)
        held["after_forward"] = local_bytes(net.parameters())  # gathered units count whole, resharded as shards
        F.cross_entropy(output, y).backward()
        optimizer.step()
    result = {
        **training_state_bytes(net, optimizer),
        **held,
        "all_gathers": comm.get_comm_counts()[torch.ops.c10d._allgather_base_],
    }
    if env.device.type == "cuda":
        result["cuda_peak_mib"] = torch.cuda.max_memory_allocated(env.device) / 2**20
    return result


def measure_strategies(env, strategies=STRATEGIES, script=SOLUTION) -> dict:
    """``measure_model_state`` for each of ``strategies`` in turn, in one process group: ``{strategy: figures}``."""
    return {strategy: measure_model_state(env, strategy, script) for strategy in strategies}
