"""The scripts' command lines: one kind of parser, and argument types whose bad values stop argparse with a one-line
message."""

import argparse

UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}  # binary: 1K is 1024 bytes


def argument_parser(description: str) -> argparse.ArgumentParser:
    """An argument parser whose ``--help`` starts with ``description`` and shows every option's default."""
    return argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)


def options_line(args: argparse.Namespace) -> str:
    """Every option as it was given or defaulted, as one command-line fragment (``--batch-size=32 --seed=0``): the
    first line a solution prints, so that a log says which run wrote it."""
    return " ".join(f"--{key.replace('_', '-')}={value}" for key, value in vars(args).items())


def positive_int(text: str) -> int:
    """An ``int`` of at least 1 (batch sizes, epochs)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """A ``float`` above 0 (learning rates)."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def non_negative_int(text: str) -> int:
    """An ``int`` of at least 0 (loader worker processes)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """A ``float`` of at least 0 (a latency)."""
    value = float(text)
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def parse_size(text: str) -> int:
    """'4K', '16M', '1G' or a plain number of bytes -> bytes."""
    scale = UNITS.get(text[-1].upper(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)
