"""Mixed precision by name: ``--precision {fp32,bf16,fp16}`` to an autocast dtype, and a check that it can run.

``torch.autocast`` and ``torch.amp.GradScaler`` do not fail when asked for something the device cannot do: they
warn and disable themselves, and the run goes on in fp32 (or in fp16 without loss scaling). ``check_precision``
turns that into a ``ConfigurationError`` before training starts, so ``--precision fp16`` never silently means
something else.
"""

import argparse
import warnings

import torch

from common.distributed import ConfigurationError

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The ``--precision`` choices and the dtype that autocast runs its low-precision ops in (fp32: autocast off)."""


def precision_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add lesson 05's option to ``parser``: ``--precision``, the autocast dtype of the forward pass."""
    parser.add_argument(
        "--precision",
        choices=list(PRECISIONS),
        default="fp32",
        help="autocast dtype of the forward pass; fp16 adds loss scaling",
    )
    return parser


def check_precision(precision: str, device: torch.device) -> None:
    """Raise ``ConfigurationError`` unless this PyTorch can autocast to ``precision`` on ``device`` and, for fp16,
    scale the loss there with ``torch.amp.GradScaler``. fp32 always passes: it needs neither."""
    if precision not in PRECISIONS:
        raise ConfigurationError(f"error: unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    if precision == "fp32":
        return
    dtype = PRECISIONS[precision]
    supported = torch.amp.is_autocast_available(device.type)
    if supported:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the warning says "disabling"; the error below says what to do
            try:
                with torch.autocast(device_type=device.type, dtype=dtype):
                    supported = (
                        torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type) == dtype
                    )
            except RuntimeError:  # some devices refuse a dtype outright (bf16 on a pre-Ampere GPU, in some versions)
                supported = False
            if supported and precision == "fp16":
                supported = torch.amp.GradScaler(device.type).is_enabled()
    if not supported:
        fallback = "bf16 or fp32" if precision == "fp16" else "fp32"
        raise ConfigurationError(
            f"error: --precision {precision} is not supported on {device.type} by PyTorch {torch.__version__} "
            f"(autocast to {dtype}{' with GradScaler' if precision == 'fp16' else ''}); use --precision {fallback}"
        )
