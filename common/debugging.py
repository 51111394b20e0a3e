"""Collectives that ranks get wrong, and what ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` makes of them (lesson 07).

``collective_mistakes`` runs on every rank of a process group (``common.launch.run_on_ranks``): a spawned
process can only run a function it can import, so it lives in a module, not in a notebook or a test.
"""

import time
from datetime import timedelta

import torch
import torch.distributed as dist


def collective_mistakes(env, timeout_s: float) -> dict:
    """Rank 1 gets a collective wrong three times, each on a new group whose collectives time out after
    ``timeout_s`` seconds; returns, per case, this rank's error message (``None`` if none) and the seconds it took.

    - ``"skipped"``: rank 1 never calls rank 0's all-reduce (it sleeps past the timeout instead), without the
      debug checks, then ``"skipped, DETAIL"`` with them;
    - ``"mismatched shapes, DETAIL"``: rank 0 all-reduces 4 numbers, rank 1 five, with the debug checks.

    The checks are what ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` turns on when ``torch.distributed`` is imported:
    every group created under that level is wrapped in a ``ProcessGroupWrapper``, which before each collective
    waits for all ranks at a monitored barrier and compares their collectives' fingerprints.
    """
    results = {}
    for case, level in (
        ("skipped", dist.DebugLevel.OFF),
        ("skipped, DETAIL", dist.DebugLevel.DETAIL),
        ("mismatched shapes, DETAIL", dist.DebugLevel.DETAIL),
    ):
        dist.set_debug_level(level)
        group = dist.new_group(timeout=timedelta(seconds=timeout_s))  # wrapped if the level is DETAIL
        started = time.monotonic()
        try:
            if case.startswith("mismatched"):
                dist.all_reduce(torch.ones(4 if env.rank == 0 else 5), group=group)
            elif env.rank == 0:
                dist.all_reduce(torch.ones(4), group=group)
            else:
                time.sleep(timeout_s + 2)  # alive, but never in the collective: rank 0 is left waiting
            error = None
        except RuntimeError as caught:
            error = str(caught)
        results[case] = {"error": error, "seconds": time.monotonic() - started}
    return results
