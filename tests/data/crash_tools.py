"""A tool for crash tests: blocks while a marker file exists, so a test can kill the process
in the middle of a tool call and later let the re-executed call finish at once."""

from __future__ import annotations

import time
from pathlib import Path

from fsm_kernel.tools import tool


@tool
def block(path: str) -> str:
    """Wait while the file at `path` exists (at most 60 s), then report.

    Args:
        path: the marker file to wait on.
    """
    deadline = time.monotonic() + 60
    while Path(path).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return f"unblocked {Path(path).name}"
