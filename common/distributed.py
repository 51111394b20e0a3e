"""Process-group set-up, rank helpers, seeding and metric reduction.

One process per device. ``torchrun`` starts the processes and tells each who it is through environment
variables; ``setup_distributed`` reads them, joins the process group and picks the device:

    env = setup_distributed()           # RANK, LOCAL_RANK, WORLD_SIZE from torchrun, or a world of 1
    try:
        train(env)
    finally:
        teardown_distributed()          # on the error path too: leave the group, then exit

``process_group`` is those five lines as one ``with`` block, which the solutions use.

Every mean here is a SUM followed by a division: a mean over samples needs the sums anyway, and it works on
every backend and version (gloo had no ``ReduceOp.AVG`` until recent releases; 2.14 has it).
"""

import os
import random
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

BACKENDS = ("auto", "nccl", "gloo")


class ConfigurationError(SystemExit):
    """A mistake in how a script was called (bad option, missing data, no GPU for NCCL).

    It derives from ``SystemExit`` so that a script stops with this message and exit status 1, without a
    traceback: the message is the whole story. Code that wants to handle it can still catch it by name.
    """


@dataclass(frozen=True)
class DistEnv:
    """Who this process is: ``rank`` among all processes, ``local_rank`` on its machine, and its device."""

    rank: int
    local_rank: int
    world_size: int
    backend: str
    device: torch.device

    @property
    def device_ids(self) -> list[torch.device] | None:
        """What ``DistributedDataParallel(model, device_ids=...)`` takes: this process's one GPU, or ``None`` on a
        CPU, where DDP refuses a device list. With it, DDP's forward moves the inputs to that GPU too."""
        return [self.device] if self.device.type == "cuda" else None

    @property
    def summary(self) -> str:
        """How a run's first line names its set-up, e.g. ``2 process(es), backend gloo, device cpu``."""
        return f"{self.world_size} process(es), backend {self.backend}, device {self.device.type}"


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigurationError(f"error: environment variable {name}={value!r} is not an integer") from None


def choose_backend(requested: str = "auto", local_world_size: int = 1) -> str:
    """Pick the communication backend: NCCL when CUDA has a device for every local process, gloo otherwise.

    ``requested`` is ``auto``, ``nccl`` or ``gloo``. Asking for NCCL without enough GPUs is an error now,
    rather than a hang or a "Duplicate GPU detected" failure inside the first collective.
    """
    if requested not in BACKENDS:
        raise ConfigurationError(f"error: unknown backend {requested!r}; choose one of {', '.join(BACKENDS)}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "auto":
        return "nccl" if gpus >= local_world_size else "gloo"
    if requested == "nccl" and gpus < local_world_size:
        fix = f"launch at most {gpus} process(es) per node" if gpus else "run on a machine with NVIDIA GPUs"
        raise ConfigurationError(
            f"error: --backend nccl needs one CUDA device per process on this machine, but there are "
            f"{local_world_size} local process(es) and {gpus} CUDA device(s). Use --backend gloo (CPU), or {fix}."
        )
    return requested


def setup_distributed(
    backend: str = "auto", timeout: timedelta = timedelta(minutes=10), init_method: str | None = None
) -> DistEnv:
    """Join the process group described by torchrun's environment variables and pick this process's device.

    Run under ``torchrun`` it reads ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE``; run with
    plain ``python`` it forms a world of one, so the same script (DDP wrapper, collectives) works unchanged.
    ``timeout`` bounds how long a collective waits for the other ranks before failing instead of hanging.
    ``init_method`` (e.g. ``file:///tmp/store``) replaces the ``MASTER_ADDR``/``MASTER_PORT`` rendezvous.
    """
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    if not 0 <= rank < world_size:
        raise ConfigurationError(f"error: RANK={rank} is outside WORLD_SIZE={world_size}")
    backend = choose_backend(backend, local_world_size)

    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    kwargs = dict(backend=backend, rank=rank, world_size=world_size, timeout=timeout)
    if backend == "nccl":
        kwargs["device_id"] = device  # binds the communicator to this GPU now, not at the first collective
    if init_method is not None:
        kwargs["init_method"] = init_method
    elif "MASTER_ADDR" not in os.environ:
        if world_size != 1:
            raise ConfigurationError("error: WORLD_SIZE > 1 but no MASTER_ADDR: launch with torchrun")
        kwargs["store"] = dist.HashStore()  # a world of one needs no network rendezvous
    dist.init_process_group(**kwargs)
    return DistEnv(rank=rank, local_rank=local_rank, world_size=world_size, backend=backend, device=device)


def teardown_distributed() -> None:
    """Leave the process group, if this process is in one. Safe to call twice.

    Then sleep a moment, which releases the GIL. gloo's worker threads free each finished collective's tensors
    after the caller has its result, and freeing a tensor that Python created takes the GIL. If the script
    ends first, the interpreter is shutting down, a worker that asks for the GIL is stopped with pthread_exit,
    and the process aborts ("terminate called without an active exception") although all work is done. With
    PyTorch 2.14 a process group that DDP was built on stays alive after ``destroy_process_group``, so its
    workers are still there at shutdown.

    That the pause prevents the abort is not shown. The first count, 3 aborts in 40 three-process runs without
    it and 0 in 40 with it, is not significant (Fisher's exact test, p = 0.24). ``benchmarks/teardown_pause.py``
    (the two conditions alternating, 2-core CPU, gloo, PyTorch 2.14.1, a loaded machine) saw no abort in either:
    0 of 22 and 0 of 22 runs with 2 processes, 0 of 21 and 0 of 21 with 3. Kept because it is harmless and costs
    50 ms at exit.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
        time.sleep(0.05)


@contextmanager
def process_group(backend: str = "auto"):
    """``setup_distributed(backend)`` for the body of a ``with`` block, and ``teardown_distributed`` when it ends.

        with process_group(args.backend) as env:   # env: rank, local_rank, world_size, backend, device
            train(args, env)

    The teardown runs on errors too (a ``try/finally``): the process leaves the group before it exits, and the
    other ranks learn of the failure when its connections close.
    """
    env = setup_distributed(backend)
    try:
        yield env
    finally:
        teardown_distributed()


def get_rank() -> int:
    """Global rank of this process; 0 outside a process group."""
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    """Number of processes in the group; 1 outside a process group."""
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    """True on global rank 0: the one process that prints, writes checkpoints and writes metrics."""
    return get_rank() == 0


def print0(*args, **kwargs) -> None:
    """``print`` on global rank 0 only, flushed so that progress shows up at once under torchrun."""
    if is_main():
        print(*args, **kwargs, flush=True)


def rank_map(env: DistEnv) -> list[tuple[str, int, str]]:
    """Where every rank runs, in rank order: ``(node rank, local rank, host name)``. A collective: call on every rank.

    The node rank is torchrun's ``GROUP_RANK`` (``"0"`` without torchrun), which its rendezvous assigns.
    """
    me = (os.environ.get("GROUP_RANK", "0"), env.local_rank, socket.gethostname())
    where = [me] * env.world_size
    if dist.is_initialized():
        dist.all_gather_object(where, me)
    return where


@contextmanager
def main_process_first():
    """Run the body on global rank 0 first while the others wait, then on the others.

    For work that must happen once, such as downloading a data set: rank 0 downloads, the rest find the files.
    Every rank must enter the block, or the barrier waits for the missing one.
    """
    if not is_main():
        dist.barrier()
    try:
        yield
    finally:
        if is_main() and dist.is_initialized():
            dist.barrier()


def set_seed(seed: int, rank: int = 0) -> None:
    """Seed Python, NumPy and PyTorch (CPU and every GPU) with ``seed + rank``.

    Call ``set_seed(seed)`` before building the model, so every rank starts from the same weights, then
    ``set_seed(seed, rank)`` so each rank draws its own dropout masks and augmentations. The data order needs
    no per-rank seed: ``DistributedSampler`` shards one shared permutation, which must be the same everywhere.
    """
    seed = seed + rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def all_reduce_sum(values, device: torch.device | None = None) -> torch.Tensor:
    """Sum a number or tensor over all ranks; every rank gets the total. Works without a process group."""
    total = torch.as_tensor(values, dtype=torch.float64, device=device).clone()
    if dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total


def all_reduce_mean(values, device: torch.device | None = None) -> torch.Tensor:
    """Mean over ranks of a per-rank number or tensor: SUM, then divide by the world size."""
    return all_reduce_sum(values, device) / get_world_size()


def global_mean(total, count, device: torch.device | None = None) -> float:
    """The mean over every sample on every rank, from each rank's ``total`` and sample ``count``.

    Unlike the mean of per-rank means, it weighs each sample once even when ranks saw different numbers.
    """
    summed = all_reduce_sum([float(total), float(count)], device)
    return (summed[0] / summed[1]).item()


def replicas_in_sync(model: torch.nn.Module, group=None) -> bool:
    """True when every rank (of ``group``; None: the whole world) holds exactly the same parameters: the proof that
    gradients were synchronized.

    Compares the element-wise maximum and minimum over ranks (two all-reduces); call it on every rank of the
    group. Works for plain, DDP and FSDP2 models: a sharded (DTensor) parameter is gathered whole first, since its
    local shards differ by design.
    """
    if not dist.is_initialized():
        return True
    whole = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]  # gathers: collective
    flat = torch.cat([p.detach().reshape(-1) for p in whole]).double()
    highest, lowest = flat.clone(), flat.clone()
    dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=group)
    return bool(torch.equal(highest, lowest))
