"""Real text without a network, for lessons 13-16: files read as bytes, cut into windows for next-byte prediction.

The default text is the Python source of the installed PyTorch's ``torch/nn/modules/`` (``DEFAULT_TEXT``): its
``.py`` files in sorted order, joined. That is about 0.9 MB, and the same bytes for a given wheel. A reader can pass
any file instead (``--text FILE``). The vocabulary is the 256 byte values, so no tokenizer is needed.

The split is contiguous: the first 90% of the bytes train, the last 10% validate, so no window holds bytes of
both. Each sample is a window of ``context + 1`` bytes, the windows side by side without overlap: the input is the
first ``context`` bytes, the target the same bytes shifted by one (at every position, the byte that follows). Both
splits are ``TensorDataset``\\ s, so ``common.data.make_loader`` shards them over ranks like the image sets.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from common.distributed import ConfigurationError

VOCAB_SIZE = 256  # bytes
VALIDATION_FRACTION = 0.1


def default_text_files() -> list[Path]:
    """The files of the default text: ``torch/nn/modules/*.py`` of the installed PyTorch, sorted by name."""
    return sorted((Path(torch.__file__).parent / "nn" / "modules").glob("*.py"))


DEFAULT_TEXT = "torch/nn/modules/*.py of the installed PyTorch"


@dataclass
class TextSplits:
    """The training and validation windows of one text, and where it came from."""

    train: TensorDataset
    validation: TensorDataset
    source: str
    num_bytes: int
    context: int
    vocab_size: int = VOCAB_SIZE


def read_text_bytes(path: str | Path | None = None) -> tuple[torch.Tensor, str]:
    """The bytes of ``path`` (``None``: the default text) as a 1-D uint8 tensor, and a description of the source.
    A missing or empty file is a ``ConfigurationError`` that says what to pass instead."""
    if path is None:
        files = default_text_files()
        data = b"".join(file.read_bytes() for file in files)
        source = f"{DEFAULT_TEXT} ({len(files)} files)"
    else:
        path = Path(path)
        if not path.is_file():
            raise ConfigurationError(
                f"error: no text file at {str(path)!r}: pass --text an existing file, or leave --text out to train "
                f"on {DEFAULT_TEXT}"
            )
        data, source = path.read_bytes(), str(path)
    if not data:
        raise ConfigurationError(f"error: the text {source!r} is empty")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8), source


def windows(data: torch.Tensor, context: int) -> TensorDataset:
    """Side-by-side windows of ``context + 1`` bytes of ``data``: inputs ``(n, context)`` and next-byte targets
    ``(n, context)``, as int64 token ids. The bytes after the last whole window are left out."""
    count = (len(data) - 1) // context
    if count < 1:
        raise ConfigurationError(f"error: {len(data)} bytes hold no window of {context + 1}: a longer text, please")
    rows = data[: count * context + 1].long().unfold(0, context + 1, context)  # window i starts at byte i * context
    return TensorDataset(rows[:, :-1].contiguous(), rows[:, 1:].contiguous())


def load_text(path: str | Path | None = None, context: int = 128) -> TextSplits:
    """The text of ``path`` (``None``: the default), split 90/10 into training and validation windows of
    ``context`` tokens. Every rank builds the same splits."""
    if context < 1:
        raise ConfigurationError(f"error: the context must be at least 1 token, not {context}")
    data, source = read_text_bytes(path)
    boundary = int(len(data) * (1 - VALIDATION_FRACTION))
    return TextSplits(windows(data[:boundary], context), windows(data[boundary:], context), source, len(data), context)


def encode(text: str) -> torch.Tensor:
    """``text`` as byte token ids ``(1, length)``: UTF-8 bytes."""
    return torch.tensor([list(text.encode())], dtype=torch.long)


def decode(tokens: torch.Tensor) -> str:
    """Byte token ids back to text; bytes that are not valid UTF-8 become the replacement character."""
    return bytes(tokens.flatten().tolist()).decode(errors="replace")
