"""A run's status, as every store's summary and the run viewer fold it from the log: running
from its start or a resume, waiting from a suspension (the human-in-the-loop event, known here
by its value), and its termination reason from its end."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from fsm_kernel.protocol import Event, EventType
from fsm_kernel.store import RUN_SUSPENDED, status_after
from fsm_kernel.store._schema import summarize_batch

T0 = datetime(2026, 3, 1, tzinfo=UTC)


def event(kind: str, seq: int, **data: Any) -> Any:
    """An event of `kind`; one this code has no EventType for yet (run.suspended) is stood in
    for by an object with the same fields, as a log written by newer code would read."""
    fields = {"run_id": "r", "seq": seq, "timestamp": T0 + timedelta(seconds=seq),
              "iteration": 0, "state": "think", "data": data}  # fmt: skip
    try:
        return Event(type=EventType(kind), **fields)
    except ValueError:
        return SimpleNamespace(type=SimpleNamespace(value=kind), **fields)


@pytest.mark.parametrize(
    ("kinds", "status", "reason"),
    [
        (["run.started"], "running", None),
        (["run.started", RUN_SUSPENDED], "waiting", None),
        (["run.started", RUN_SUSPENDED, "human.answered"], "waiting", None),
        (["run.started", RUN_SUSPENDED, "human.answered", "run.resumed"], "running", None),
        (["run.started", RUN_SUSPENDED, "run.terminated"], "ended", "cancelled"),
        (["run.started", "run.terminated", "run.resumed"], "running", None),
        (["run.started", "state.entered", "tool.started"], "running", None),
    ],
)
def test_status_follows_the_last_event_that_says_it(
    kinds: list[str], status: str, reason: str | None
) -> None:
    events = [event(kind, n, reason="cancelled") for n, kind in enumerate(kinds, 1)]
    folded = "running"
    for e in events:
        folded = status_after(e) or folded
    assert folded == status
    (delta,) = summarize_batch(events)
    summary = delta.merge_into(None)
    assert (summary.status, summary.termination_reason) == (status, reason)
    assert summary.shown_status == (reason or status)
