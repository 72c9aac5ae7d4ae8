"""The test application's tool: `work(n)` writes `start n` and `end n` to tools.log in the
folder FSM_KERNEL_TEST_DIR names, and sleeps in between while a file `slow-n` is there (so a
test can kill the process in the middle of the call)."""

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
    if (Path(os.environ["FSM_KERNEL_TEST_DIR"]) / f"slow-{n}").exists():
        time.sleep(60)
    _log(f"end {n}")
    return f"worked {n}"
