"""Helpers for tests that run the course's scripts for real, as a reader would."""

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from common.launch import REPO, TORCHRUN, load_script, torchrun_command  # noqa: F401  (tests import them from here)

PYTHON = sys.executable

# Point urllib at a closed local port: a download fails at once, online or offline, so tests of the
# "data set missing" path are the same on every machine.
NO_NETWORK = {
    "http_proxy": "http://127.0.0.1:9",
    "https_proxy": "http://127.0.0.1:9",
    "HTTP_PROXY": "http://127.0.0.1:9",
    "HTTPS_PROXY": "http://127.0.0.1:9",
    "no_proxy": "",
    "NO_PROXY": "",
}


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def run_command(args, timeout: float, cwd=REPO, env_extra=None) -> Run:
    """Run a command to completion within ``timeout`` seconds (a hang fails the test) and capture its output."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    start = time.monotonic()
    completed = subprocess.run(
        [str(arg) for arg in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    return Run(completed.returncode, completed.stdout, completed.stderr, time.monotonic() - start)


def torchrun(script, *args, nproc: int = 2, timeout: float = 180, env_extra=None) -> Run:
    """``torchrun --standalone --nproc_per_node=nproc script args``, as the README tells readers to run it."""
    return run_command(torchrun_command(REPO / script, *args, nproc=nproc), timeout=timeout, env_extra=env_extra)


def lab_path(name: str) -> Path:
    """The file that lab tests check: ``solutions/NAME.py``, or ``labs/NAME.py`` with ``LAB_TARGET=labs``."""
    target = os.environ.get("LAB_TARGET", "solutions")
    if target not in ("solutions", "labs"):
        raise ValueError(f"LAB_TARGET must be 'solutions' or 'labs', not {target!r}")
    return REPO / target / f"{name}.py"


def cluster_unavailable() -> str | None:
    """Why the emulated cluster cannot run here (not root, no network namespaces), or None if it can."""
    if os.geteuid() != 0:
        return "not root: creating network namespaces needs root (run the tests with sudo to include them)"
    probe = subprocess.run(["ip", "netns", "add", "mgcprobe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"this machine refuses network namespaces: `ip netns add` said {probe.stderr.strip()!r}"
    subprocess.run(["ip", "netns", "delete", "mgcprobe"], capture_output=True)
    return None


def pytest_collection_modifyitems(config, items):
    """Skip the tests marked ``cluster`` with one reason where the emulated cluster cannot run."""
    marked = [item for item in items if item.get_closest_marker("cluster")]
    reason = cluster_unavailable() if marked else None
    if reason:
        skip = pytest.mark.skip(reason=f"emulated cluster tests skipped: {reason}")
        for item in marked:
            item.add_marker(skip)
