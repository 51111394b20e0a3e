"""Lesson 08's ZeRO experiments: what a rank holds, measured, and what the stages cost in time.

``common.zero_by_hand`` holds the mechanism; this module measures it, for the tests, the notebook and
``benchmarks/zero_by_hand.py``:

- ``LiveTensorBytes``: the bytes of the tensors allocated inside a block that are still alive, and their peak, phase
  by phase: a count of live tensor storages, made by watching every ATen operator's outputs (a
  ``TorchDispatchMode``) and each output's lifetime (``weakref.finalize``), not an estimate.
- ``phase_peaks``: peak bytes per rank in forward, backward and step, for DDP and each ZeRO build (spawned).
- ``zero3_step_seconds``: ZeRO-3's step time with prefetch and without, taking turns (spawned).
"""

import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from common.metrics import slowest_rank_seconds
from common.models import DeepMLP
from common.zero_by_hand import FlatZeRO1Optimizer, ZeRO1Optimizer, ZeRO2Optimizer, ZeRO3Model


class LiveTensorBytes(TorchDispatchMode):
    """Count the bytes of the tensor storages that operators allocate inside the block and that are still alive.

        with LiveTensorBytes() as live:
            live.phase("backward"); loss.backward()
            live.phase("step"); optimizer.step()
        live.peaks["backward"], live.peaks["step"], live.peak, live.live

    Every ATen operator called inside the block (in the autograd engine's backward too) passes through
    ``__torch_dispatch__``; an output that does not alias an input (its schema says so) has a new storage, counted from
    then until the storage is freed (``weakref.finalize`` on the storage: PyTorch keeps one Python object per storage,
    so it fires when the last tensor or view on it goes, or when ``p.data = ...`` drops it). Tensors made before the
    block are not counted, nor memory that C++ code allocates without an ATen operator (a backend's own buffers); what
    C++ allocates with one is (DDP's buckets, gloo's copy of what it reduce-scatters). ``phase(name)`` opens phase
    ``name``; ``peaks`` maps each phase to the most bytes alive at once during it, ``peak`` is the block's, ``live`` the
    bytes alive now."""

    def __init__(self):
        super().__init__()
        self.sizes = {}  # id of each live storage counted -> its bytes
        self.live, self.peak, self.peaks, self.current = 0, 0, {}, None

    def phase(self, name: str) -> None:
        self.current = name
        self.peaks[name] = max(self.peaks.get(name, 0), self.live)

    def _freed(self, key) -> None:
        self.live -= self.sizes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        for position, tensor in enumerate(tree_flatten(out)[0]):
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                continue
            if position < len(returns) and returns[position].alias_info is not None:
                continue  # a view or an in-place result: no new storage
            storage = tensor.untyped_storage()
            if id(storage) in self.sizes or storage.nbytes() == 0:
                continue
            self.sizes[id(storage)] = storage.nbytes()
            weakref.finalize(storage, self._freed, id(storage))
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            if self.current is not None:
                self.peaks[self.current] = max(self.peaks[self.current], self.live)
        return out


# The builds whose memory lesson 08 measures, in the order of its table.
BUILDS = ("DDP", "ZeRO-1, broadcasts", "ZeRO-1, flat", "ZeRO-2", "ZeRO-3")
STAGE_OF_BUILD = {"DDP": 0, "ZeRO-1, broadcasts": 1, "ZeRO-1, flat": 1, "ZeRO-2": 2, "ZeRO-3": 3}


def build(name: str, model: nn.Module, bucket_cap_mb: float, prefetch: bool = True, lr: float = 1e-3):
    """``(net, optimizer)`` for one of ``BUILDS`` around ``model``, with Adam: torch's DDP; lesson 08's ZeRO-1 under
    torch's DDP (``ZeroRedundancyOptimizer``'s design); ``FlatZeRO1Optimizer``; ``ZeRO2Optimizer``; ``ZeRO3Model``
    with the model's ``blocks`` as units. DDP and the flat stages cut their buckets at ``bucket_cap_mb``."""
    if name == "DDP":
        return DDP(model, bucket_cap_mb=bucket_cap_mb), torch.optim.Adam(model.parameters(), lr=lr)
    if name == "ZeRO-1, broadcasts":
        net = DDP(model, bucket_cap_mb=bucket_cap_mb)
        return net, ZeRO1Optimizer(net.parameters(), torch.optim.Adam, lr=lr)
    if name in ("ZeRO-1, flat", "ZeRO-2"):
        flat_class = FlatZeRO1Optimizer if name == "ZeRO-1, flat" else ZeRO2Optimizer
        return model, flat_class(model, torch.optim.Adam, bucket_cap_mb=bucket_cap_mb, lr=lr)
    net = ZeRO3Model(model, units=list(model.blocks), prefetch=prefetch)
    return net, torch.optim.Adam(net.parameters(), lr=lr)  # after wrapping: it must see the shards


def phase_peaks(env, width: int = 512, depth: int = 4, batch_size: int = 32, bucket_cap_mb: float = 1.0) -> dict:
    """Per build of ``BUILDS``, this rank's memory for one Adam step of ``DeepMLP(width, depth)``, in bytes, all
    counted by ``LiveTensorBytes`` from before the model is made: ``held``, the tensors alive as the step begins
    (parameters, optimizer states, DDP's buckets, ZeRO's flat buffers...: whatever the build keeps between steps),
    and for each phase (``forward``, ``backward``, ``step``) the most bytes alive at once during it. Two steps
    first: Adam makes its states in its first, DDP rebuilds its buckets after its first."""
    results = {}
    generator = torch.Generator().manual_seed(env.rank)
    X = torch.randn(batch_size, *DeepMLP.input_shape, generator=generator)
    y = torch.randint(0, 10, (batch_size,), generator=generator)
    for name in BUILDS:
        with LiveTensorBytes() as live:
            torch.manual_seed(0)
            net, optimizer = build(name, DeepMLP(width=width, depth=depth), bucket_cap_mb)
            for step in range(3):
                optimizer.zero_grad(set_to_none=True)
                if step == 2:  # the measured one
                    held = live.live
                    live.phase("forward")
                loss = F.cross_entropy(net(X), y)
                if step == 2:
                    live.phase("backward")
                loss.backward()
                if step == 2:
                    live.phase("step")
                optimizer.step()
                del loss
        results[name] = {"held": held, **live.peaks}
    return results


def zero3_step_seconds(env, width: int, depth: int, batch_size: int, steps: int, rounds: int, warmup: int = 2):
    """ZeRO-3's step time with prefetch and without, on ``DeepMLP(width, depth)``, the two taking turns round
    after round: per setting, the seconds of ``steps`` steps on the slowest rank, one figure per round."""
    generator = torch.Generator().manual_seed(env.rank)
    X = torch.randn(batch_size, *DeepMLP.input_shape, generator=generator)
    y = torch.randint(0, 10, (batch_size,), generator=generator)
    settings = {}
    for prefetch in (True, False):
        torch.manual_seed(0)
        settings[prefetch] = build("ZeRO-3", DeepMLP(width=width, depth=depth), 25.0, prefetch=prefetch)

    def train(net, optimizer, count):
        for _ in range(count):
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(net(X), y).backward()
            optimizer.step()

    for net, optimizer in settings.values():
        train(net, optimizer, warmup)
    seconds = {"prefetch": [], "no prefetch": []}
    for _ in range(rounds):
        for prefetch, (net, optimizer) in settings.items():
            time = slowest_rank_seconds(lambda: train(net, optimizer, steps), X.device)
            seconds["prefetch" if prefetch else "no prefetch"].append(time)
    return seconds
