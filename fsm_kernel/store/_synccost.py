"""How long a store's durable commits take: whether one may be made on the event loop."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["INLINE_SYNC_MAX", "SyncCost"]

INLINE_SYNC_MAX = 0.002
"""A durable commit is made on the event loop only while they average less than this."""


class SyncCost:
    """A moving average of a store's durable commits (the wait for the disk included).

    The run recorder makes a lone run's durable commits on the event loop, sparing a thread
    hand-off each (about as long as the sync itself on a fast disk), only while this average
    stays under INLINE_SYNC_MAX, so the loop is never held longer than a fast disk takes. A
    slow commit (a slow disk, a busy one) raises the average past it at once, and the commits
    go back to a thread until fast ones bring it down again. Nothing is inline before the
    first durable commit, made in a thread, has been measured."""

    _WEIGHT = 0.25
    """Of the newest commit in the average."""

    def __init__(self) -> None:
        self.average: float | None = None

    def add(self, seconds: float) -> None:
        if self.average is None:
            self.average = seconds
        else:
            self.average += (seconds - self.average) * self._WEIGHT

    @property
    def cheap(self) -> bool:
        """Whether a durable commit may be made on the event loop."""
        return self.average is not None and self.average < INLINE_SYNC_MAX

    @contextmanager
    def timing(self, durable: bool) -> Iterator[None]:
        """Time the enclosed commit into the average when it is durable."""
        started = time.perf_counter()
        try:
            yield
        finally:
            if durable:
                self.add(time.perf_counter() - started)
