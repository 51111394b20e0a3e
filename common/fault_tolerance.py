"""Checkpoints for runs that crash and restart: numbered, verified files, the newest valid one, and RNG states.

A run under ``torchrun --max-restarts`` loses every worker when one fails, and the restarted workers begin
again from the top of the script. They can only continue where the run stopped if it left behind, often
enough, a checkpoint that holds *everything* the next steps depend on, and if they can tell a good
checkpoint from a damaged one. This module does the file side of that:

- ``step_00000120.pt`` holds the state after optimizer step 120; ``step_00000120.pt.sha256`` holds the
  SHA-256 of its bytes. Both are written atomically (temporary file + ``os.replace``), the digest last: it
  is the commit marker. A checkpoint without a digest was interrupted between the two writes; one whose
  bytes do not match its digest was damaged afterwards. ``torch.load`` alone catches a truncated file but
  loads a file with a flipped byte in a tensor without complaint (tested), hence the digest.
- ``newest_valid_checkpoint`` walks the checkpoints from the newest down and returns the first that passes.

Who writes (global rank 0 only) and what goes into the state is the training script's business:
``solutions/05_multi_node.py`` shows both. ``fault_tolerance_arguments`` adds that script's options, and
``record`` is torchrun's ``@record`` with its error file written atomically (see ``AtomicErrorHandler``).
"""

import argparse
import hashlib
import io
import json
import os
import random
import re
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import errors

from common.checkpoint import atomic_write
from common.cli import positive_int

NAME = re.compile(r"^step_(\d{8})\.pt$")


def fault_tolerance_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add lesson 07's options to ``parser``: where and how often to checkpoint, how many checkpoints to keep, and
    the fault drill's hook."""
    parser.add_argument("--checkpoint-dir", help="saved here; a (re)start resumes from here (on a cluster: shared)")
    parser.add_argument("--checkpoint-every", type=positive_int, default=50, help="optimizer steps between saves")
    parser.add_argument("--keep-checkpoints", type=positive_int, default=2, help="the newest N are kept")
    parser.add_argument("--fail-at-step", type=positive_int, help="test hook: the last rank fails here, first attempt")
    return parser


class AtomicErrorHandler(errors.ErrorHandler):
    """torchrun's error handler, with the worker's error file written atomically (temporary file + ``os.replace``).

    ``@record`` writes a failing worker's traceback as JSON to the file named by ``TORCHELASTIC_ERROR_FILE``, and
    torchrun's agent reads it when the worker has exited. When one worker fails, its peers fail too (their
    collectives lose a member), and the agent sends SIGTERM to those still running. A peer killed between opening
    its error file (which truncates it) and finishing the write leaves an empty or partial file, and torch's
    ``ProcessFailure`` then raises ``JSONDecodeError`` inside the agent: torchrun itself crashes, and
    ``--max-restarts`` never restarts anything (seen once in this course's CI, PyTorch 2.14.1). Written here to a
    temporary file and renamed, the error file is either whole or absent; the agent handles an absent one.
    """

    def record_exception(self, e: BaseException) -> None:
        path = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if not path:  # not under torchrun: torch's handler logs the error instead
            return super().record_exception(e)
        # The layout torch's ErrorHandler writes and ProcessFailure reads: a message with its traceback and time.
        data = {
            "message": {
                "message": f"{type(e).__name__}: {e}",
                "extraInfo": {"py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))},
            }
        }
        atomic_write(path, lambda file: file.write(json.dumps(data).encode()))


def record(fn):
    """torchrun's ``@record`` (a failing worker's traceback goes to the agent, whose summary names the rank), with
    ``AtomicErrorHandler``'s atomic error file."""
    return errors.record(fn, error_handler=AtomicErrorHandler())


class CorruptCheckpoint(Exception):
    """A checkpoint file that is incomplete, truncated or does not match its digest."""


def step_checkpoint_file(folder, step: int) -> Path:
    """The file that holds the state after optimizer step ``step``: ``folder/step_00000120.pt``."""
    return Path(folder) / f"step_{step:08d}.pt"


def list_checkpoints(folder) -> list[Path]:
    """Checkpoint files in ``folder``, newest (highest step) first; temporary files are not listed."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [path for path in folder.iterdir() if NAME.match(path.name)]
    return sorted(found, key=lambda path: int(NAME.match(path.name).group(1)), reverse=True)


def write_verified(path, state: dict) -> None:
    """Write ``state`` with ``torch.save`` to ``path``, then its SHA-256 to ``path.sha256``, both atomically.

    Call it from one process (global rank 0). A crash at any moment leaves either no file, or a file with no
    digest (skipped as incomplete), or both: never a half-written file under the checkpoint's name.
    """
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    atomic_write(path, lambda file: file.write(data))
    digest = hashlib.sha256(data).hexdigest()
    atomic_write(f"{path}.sha256", lambda file: file.write(digest.encode() + b"\n"))  # the commit marker


def read_verified(path, map_location="cpu") -> dict:
    """Load a checkpoint written by ``write_verified`` after checking its digest; ``CorruptCheckpoint`` if bad.

    ``weights_only=True``: a checkpoint holds tensors, numbers, strings, lists and dicts, and cannot run code.
    """
    path = Path(path)
    marker = Path(f"{path}.sha256")
    if not marker.exists():
        raise CorruptCheckpoint(f"{path.name}: no digest file, the save did not finish")
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != marker.read_text().strip():
        raise CorruptCheckpoint(f"{path.name}: its bytes do not match its SHA-256 (truncated or damaged)")
    try:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except Exception as error:  # a file that matches its digest but still fails: written wrongly
        raise CorruptCheckpoint(f"{path.name}: {error}") from error


def newest_valid_checkpoint(folder, log=print) -> Path | None:
    """The newest checkpoint in ``folder`` that passes ``read_verified``, or ``None``; ``log`` names each skip."""
    for path in list_checkpoints(folder):
        try:
            read_verified(path)
            return path
        except CorruptCheckpoint as error:
            log(f"skipping checkpoint {error}")
    return None


def prune_checkpoints(folder, keep: int) -> None:
    """Delete all but the ``keep`` newest checkpoints (and their digests): the old ones are fallbacks no more."""
    for path in list_checkpoints(folder)[keep:]:
        Path(f"{path}.sha256").unlink(missing_ok=True)  # the marker first: a file without one is never used
        path.unlink(missing_ok=True)


def rng_state() -> dict:
    """This process's random-number generators (Python, NumPy, PyTorch CPU and CUDA), in a form that
    ``torch.load(weights_only=True)`` accepts: tensors, numbers, lists."""
    kind, keys, position, has_gauss, cached = np.random.get_state()
    version, python_state, gauss = random.getstate()
    return {
        "python": [version, list(python_state), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state`` returned, so that dropout masks and augmentations continue where they were."""
    version, python_state, gauss = state["python"]
    random.setstate((version, tuple(python_state), gauss))
    kind, keys, position, has_gauss, cached = state["numpy"]
    # .cpu(): a checkpoint loaded with map_location="cuda" (as the scripts load it, onto their device) brings every
    # tensor to the GPU, these too, and NumPy reads host memory only.
    np.random.set_state((kind, keys.cpu().numpy().astype(np.uint32), position, has_gauss, cached))
    torch.set_rng_state(state["torch"].cpu())
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def gather_rng_states() -> list[dict]:
    """Every rank's ``rng_state()``, in rank order, on every rank (a collective: call it on all ranks).

    Each rank draws its own random numbers (``set_seed(seed, rank)``), so rank 0's state alone would restore
    rank 0 only.
    """
    if not dist.is_initialized():
        return [rng_state()]
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, rng_state())
    return states


def restart_attempt(device: torch.device | str = "cpu") -> int:
    """Which attempt of the run this is: 0 at first, 1 after the first restart... the same on every rank.

    ``TORCHELASTIC_RESTART_COUNT`` is counted by each node's agent (max restarts minus its remaining ones): when
    one node's worker fails, that agent restarts its workers with count 1, while another node's agent that finds
    its workers still running when the failed node rejoins restarts them as a membership change, which spends no
    restart: count 0 (``SimpleElasticAgent._invoke_run``, PyTorch 2.14.1). The maximum over all ranks is the
    run's attempt number.
    Call it on every rank (it all-reduces).
    """
    count = torch.tensor(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), device=device)
    if dist.is_initialized():
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count)
