"""Lesson 08's ZeRO experiments: what a rank holds, measured, and what the stages cost in time.

``common.zero_by_hand`` holds the mechanism; this module measures it, for the tests, the notebook and
``benchmarks/zero_by_hand.py``:

- ``LiveTensorBytes``: the bytes of the tensors allocated inside a block that are still alive, and their peak, phase
  by phase: a count of live tensor storages, made by watching every ATen operator's outputs (a
  ``TorchDispatchMode``) and each output's lifetime (``weakref.finalize``), not an estimate.
"""

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorBytes(TorchDispatchMode):
    """Count the bytes of the tensor storages that operators allocate inside the block and that are still alive.

        with LiveTensorBytes() as live:
            live.phase("backward"); loss.backward()
            live.phase("step"); optimizer.step()
        live.peaks["backward"], live.peaks["step"], live.peak, live.live

    Every ATen operator called inside the block (in the autograd engine's backward too) passes through
    ``__torch_dispatch__``; an output that does not alias an input (its schema says so) is a new storage, counted
    until the last tensor that uses it (the output, or a view of it made inside the block) is freed. Tensors made
    before the block are not counted, nor memory that C++ code allocates without an operator (a backend's
    internal buffers). ``phase(name)`` closes the phase before (its peak: the most bytes alive at once during it)
    and opens ``name``; ``peaks`` maps each phase to its peak, ``peak`` is the block's, in bytes.
    """

    def __init__(self):
        super().__init__()
        self.storages = {}  # data pointer -> [tensors alive that use it, bytes]
        self.live, self.peak, self.peaks, self.current = 0, 0, {}, None  # bytes now, at most, per phase

    def phase(self, name: str) -> None:
        self.current = name
        self.peaks[name] = max(self.peaks.get(name, 0), self.live)

    def _release(self, key) -> None:
        entry = self.storages[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.storages[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        for position, tensor in enumerate(tree_flatten(out)[0]):
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key in self.storages:  # a view, or an in-place result, of a storage made inside the block
                self.storages[key][0] += 1
            elif position < len(returns) and returns[position].alias_info is not None or storage.nbytes() == 0:
                continue  # a view of a tensor made before the block: no new memory
            else:
                self.storages[key] = [1, storage.nbytes()]
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                if self.current is not None:
                    self.peaks[self.current] = max(self.peaks[self.current], self.live)
            weakref.finalize(tensor, self._release, key)
        return out
