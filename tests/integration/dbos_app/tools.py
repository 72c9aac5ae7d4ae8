"""The test application's tool: `work(n)` writes `start n` and `end n` to tools.log in the
folder FSM_KERNEL_TEST_DIR names, and in between waits while a file `slow-n` is there (at
most a minute), so a test can kill the process, or cancel the run, in the middle of the call."""

from __future__ import annotations

import os
import time
from pathlib import Path


def _log(line: str) -> None:
    with (Path(os.environ["FSM_KERNEL_TEST_DIR"]) / "tools.log").open("a") as f:
        f.write(line + "\n")


def work(n: int) -> str:
    """Do the n-th piece of work."""
    _log(f"start {n}")
    slow, deadline = Path(os.environ["FSM_KERNEL_TEST_DIR"]) / f"slow-{n}", time.time() + 60
    while slow.exists() and time.time() < deadline:
        time.sleep(0.05)
    _log(f"end {n}")
    return f"worked {n}"
