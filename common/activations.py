"""Where a transformer's activation memory goes (lesson 13): the formula per layer, and two ways to measure it.

Between forward and backward, autograd keeps the tensors that each operation needs for its gradient: a linear its
input, a softmax its output, a dropout its mask. Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models", https://arxiv.org/abs/2205.05198, section 4.1) add them up for one pre-norm layer of
sequence length s, micro-batch b, width h and a heads, in 16-bit with 1-byte dropout masks:

    s b h (34 + 5 a s / h) bytes

``activation_bytes_per_layer`` gives the same sum term by term, for any bytes per value and per mask. With
``value_bytes=2, mask_bytes=1, norm_statistics=False`` it is the paper's formula (``korthikanti_bytes``). On a CPU,
PyTorch 2.14's ``F.dropout`` keeps its mask as a tensor of the activation's dtype (it multiplies by a tensor of
0 and 1 / (1 - p); the fused kernel that keeps a 1-byte mask runs on accelerators only), so fp32 on a CPU has
``value_bytes=4, mask_bytes=4``. Each layer norm also keeps a mean and a 1/std per token, in fp32, which the paper
leaves out: ``norm_statistics`` counts them.

Two measurements, which agree where both apply:

- ``saved_tensors``: every tensor autograd saves, seen through ``torch.autograd.graph.saved_tensors_hooks``. The
  pack hook gets each tensor as it is saved; here it only notes its storage and hands it back unchanged.
- ``HeldMemory``: every tensor that operations create inside the block and that is still alive at its end, seen
  through a ``TorchDispatchMode`` that watches each new storage until it is freed. It also sees what autograd does
  not save in the usual way: the inputs kept by ``torch.utils.checkpoint`` and the outputs cached by its selective
  version (``common.recompute``).

Both count each piece of memory once (a view shares its tensor's storage) and leave parameters out.
"""

import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def activation_bytes_per_layer(
    seq: int,
    batch: int,
    hidden: int,
    heads: int,
    value_bytes: int = 4,
    mask_bytes: int = 4,
    dropout: bool = True,
    norm_statistics: bool = True,
) -> dict[str, dict[str, int]]:
    """The bytes one pre-norm transformer layer (``common.tensor_parallel.TransformerBlock``) keeps for backward,
    one entry per tensor, grouped by the module that keeps them: ``{"attention_norm": {...}, "attention": {...},
    "mlp_norm": {...}, "mlp": {...}}``. Korthikanti et al. 2022, section 4.1, with ``value_bytes`` per activation
    value and ``mask_bytes`` per dropout-mask value; without ``dropout`` there are no masks, and the attention's
    weighted sum keeps the softmax's output itself. ``norm_statistics``: each norm's mean and 1/std per token."""
    sbh, ass = seq * batch * hidden, heads * seq * seq * batch

    def norm():
        terms = {"its input": value_bytes * sbh}
        if norm_statistics:  # fp32 whatever the activations' dtype
            terms |= {"the mean of each token": 4 * seq * batch, "1/std of each token": 4 * seq * batch}
        return terms

    attention = {
        "q, k and v's input (the norm's output)": value_bytes * sbh,
        "the queries, for q k^T": value_bytes * sbh,
        "the keys, for q k^T": value_bytes * sbh,
        "the softmax's output": value_bytes * ass,
    }
    if dropout:
        attention |= {
            "dropout mask on the probabilities": mask_bytes * ass,
            "the probabilities after dropout, for the weighted sum": value_bytes * ass,
        }
    attention |= {
        "the values, for the weighted sum": value_bytes * sbh,
        "the output projection's input": value_bytes * sbh,
    }
    mlp = {
        "the first linear's input (the norm's output)": value_bytes * sbh,
        "GELU's input (4h wide)": 4 * value_bytes * sbh,
        "the second linear's input (4h wide)": 4 * value_bytes * sbh,
    }
    if dropout:
        attention["dropout mask on the output"] = mask_bytes * sbh
        mlp["dropout mask on the output"] = mask_bytes * sbh
    return {"attention_norm": norm(), "attention": attention, "mlp_norm": norm(), "mlp": mlp}


def layer_total(terms: dict[str, dict[str, int]]) -> int:
    """The sum of ``activation_bytes_per_layer``'s terms."""
    return sum(sum(part.values()) for part in terms.values())


def korthikanti_bytes(seq: int, batch: int, hidden: int, heads: int) -> float:
    """The paper's formula as printed: ``s b h (34 + 5 a s / h)`` bytes per layer, 16-bit values, 1-byte masks."""
    return seq * batch * hidden * (34 + 5 * heads * seq / hidden)


def storage_key(tensor: torch.Tensor) -> int:
    """Where a tensor's storage starts: views of one tensor share it."""
    return tensor.untyped_storage().data_ptr()


@dataclass
class SavedTensorLog:
    """What ``saved_tensors`` saw, one entry per piece of memory: ``{where its data starts: (shape, dtype,
    bytes)}``, the largest view seen there; ``bytes``, their sum."""

    excluded: set = field(default_factory=set)
    pieces: dict = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return sum(nbytes for _, _, nbytes in self.pieces.values())

    @property
    def tensors(self) -> list[tuple]:
        """``(shape, dtype, bytes)`` of each piece, in the order first saved."""
        return list(self.pieces.values())


@contextmanager
def saved_tensors(parameters=()):
    """Record every tensor that autograd saves for backward inside the block; ``parameters`` (their storages) are
    left out. The tensors are handed back unchanged: the model computes exactly what it computes without this.

        with saved_tensors(model.parameters()) as log:
            loss = model(X).sum()
        log.bytes, log.tensors

    A piece of memory is counted once, by where its data starts, at the size of the largest view saved there: a
    linear saves a 2-D view of its 3-D input, and a slice of a larger tensor (a batch of the data set) counts as the
    slice.
    """
    log = SavedTensorLog(excluded={storage_key(p) for p in parameters})

    def pack(tensor):
        if storage_key(tensor) not in log.excluded:
            start, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
            if nbytes > log.pieces.get(start, (None, None, -1))[2]:
                log.pieces[start] = (tuple(tensor.shape), tensor.dtype, nbytes)
        return tensor  # saved as it is

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield log


class HeldMemory(TorchDispatchMode):
    """The bytes of every storage that an operation allocates inside the block, for as long as it stays alive:
    ``bytes`` now, ``peak`` the most at once. An operation whose output shares the storage of one of its inputs (a
    view, a transpose of a weight, an in-place update) allocates nothing.

        with HeldMemory() as memory:
            loss = model(X).sum()
        memory.bytes   # what forward left alive for backward, the loss included

    A storage is watched with ``weakref.finalize``: PyTorch keeps one Python object per storage for as long as the
    storage lives, so the finalizer runs when the memory is freed, whoever held it (autograd's graph, a
    checkpoint's cache, a variable).
    """

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.bytes = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        existing = {storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and storage_key(tensor) not in existing:
                self._watch(tensor.untyped_storage())
        return out

    def _watch(self, storage) -> None:
        key = storage.data_ptr()
        if key in self.live or storage.nbytes() == 0:
            return
        self.live[key] = storage.nbytes()
        self.bytes += storage.nbytes()
        self.peak = max(self.peak, self.bytes)
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        self.bytes -= self.live.pop(key)
