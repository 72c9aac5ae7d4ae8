"""The benchmark loop every contender runs, and the reference history it must end with.

The loop: a zero-latency scripted model that asks for one `echo` tool call per iteration
(`echo(text="ping i")`, call id `call_i`) for N iterations, then answers in text. Every contender
records the wall-clock time of each model call (for per-iteration cycle times) and ends with the
same conversation, which `normalize` turns into comparable tuples.

Standard library only: the workers import their framework besides this module.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

SYSTEM_PROMPT = "You are a careful agent. Use the tools you are given instead of guessing."
PROMPT = "Echo ping 0 to ping N-1, one call per step, then say done."

Row = tuple[str, str, tuple[tuple[str, str, str], ...], str]
"""A normalized message: (role, content, ((call id, name, arguments JSON), ...), tool_call_id)."""


def call_id(i: int) -> str:
    return f"call_{i}"


def call_args(i: int) -> dict[str, Any]:
    return {"text": f"ping {i}"}


def final_text(n: int) -> str:
    return f"done after {n} calls"


def echo(text: str) -> str:
    """Repeat the text.

    Args:
        text: what to repeat.
    """
    return text


def row(
    role: str,
    content: str = "",
    calls: Iterable[tuple[str, str, dict[str, Any]]] = (),
    tool_call_id: str = "",
) -> Row:
    return (
        role,
        content or "",
        tuple((cid, name, json.dumps(args, sort_keys=True)) for cid, name, args in calls),
        tool_call_id or "",
    )


def reference(n: int) -> list[Row]:
    """The conversation after N iterations (the system prompt left out: not every framework
    keeps it in its history)."""
    rows = [row("user", PROMPT)]
    for i in range(n):
        rows.append(row("assistant", "", [(call_id(i), "echo", call_args(i))]))
        rows.append(row("tool", f"ping {i}", tool_call_id=call_id(i)))
    rows.append(row("assistant", final_text(n)))
    return rows


def digest(rows: Sequence[Row]) -> str:
    return hashlib.sha256(json.dumps(list(rows)).encode()).hexdigest()[:16]


@dataclass
class Clock:
    """Times of the model calls of one run (perf_counter seconds)."""

    calls: list[float] = field(default_factory=list)
    io: list[tuple[int, int]] = field(default_factory=list)
    sample_io: bool = False

    def tick(self) -> int:
        """Record a model call; returns its index (the iteration about to start)."""
        self.calls.append(time.perf_counter())
        if self.sample_io:
            self.io.append(io_counters())
        return len(self.calls) - 1


def io_counters() -> tuple[int, int]:
    """(write_bytes, wchar) of this process: bytes it sent towards the disk (pages dirtied in
    the page cache, counted once per dirtying) and bytes passed to write system calls."""
    with open("/proc/self/io", "rb") as f:
        fields = dict(line.split(b": ") for line in f.read().splitlines())
    return int(fields[b"write_bytes"]), int(fields[b"wchar"])


def tree_bytes(paths: Iterable[str]) -> int:
    """Sizes of the files that exist among `paths`."""
    total = 0
    for p in paths:
        try:
            total += os.stat(p).st_size
        except FileNotFoundError:
            pass
    return total
