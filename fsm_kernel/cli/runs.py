"""Subcommands over the event log: runs list/show/events/export, resume, replay."""

from __future__ import annotations

from typing import Any


def register(sub: Any) -> None:
    """Add the event-log subcommands."""
