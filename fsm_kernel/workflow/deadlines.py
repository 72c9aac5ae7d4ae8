"""`after:` on a compound state: a deadline for the run's whole stay inside it.

```yaml
- {source: research, target: report, after: 10m, reason: ...}   # research is compound
```

The timer starts when the run enters the compound state (from outside it, or by an edge that
targets the compound state itself, which restarts it) and is cancelled when the run leaves it.
It is checked each time the run leaves a state inside it: once it is due, its edge (an edge of
an enclosing state, so tried first: see docs/explanation/semantics.md) fires instead of the
state's own. An action in flight is never cut short, nor skipped: a model call that began before the
deadline ends first. A waiting state inside the compound state waits for the deadline too (its
`waiting_for.due` is the earliest of both), and suspends like any waiting state.

Recorded like a waiting state's timers: `timer.set` (edge, after, due, state), `timer.fired`,
`timer.cancelled`. Whether a deadline fired is a decision the clock made, so a re-driven run
(resume, replay) takes it from the log: up to the last recorded step, a deadline fires exactly
at the steps where the log says it fired (`timer.fired` with `step`, the number of transitions
taken before it), never by the clock; past the log, the clock decides.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from fsm_kernel.protocol import Event, EventType
from fsm_kernel.workflow.context import RunContext
from fsm_kernel.workflow.spec import WorkflowSpec

__all__ = [
    "Deadline",
    "RecordedDeadlines",
    "deadline_edges",
    "due_deadline",
    "enter_and_leave",
    "pending_deadlines",
    "recorded_deadlines",
]

Record = Callable[[EventType, dict[str, Any]], Event | None]


@dataclass(frozen=True)
class Deadline:
    """The timer of one `after:` edge out of a compound state the run is inside."""

    edge: int
    due: datetime
    state: str


@dataclass(frozen=True)
class RecordedDeadlines:
    """What a run's log says of its deadlines: where each one fired (the number of transitions
    taken before it -> the edge), and how many transitions the log holds (up to there the log
    decides, not the clock)."""

    firings: Mapping[int, int]
    steps: int


def deadline_edges(spec: WorkflowSpec) -> dict[str, tuple[tuple[int, float], ...]]:
    """The compound states with `after:` edges: state -> (edge index, seconds), file order."""
    out: dict[str, list[tuple[int, float]]] = {}
    for index, t in enumerate(spec.transitions):
        state = spec.states.get(t.source)
        seconds = t.after_seconds
        if state is not None and state.is_compound and seconds is not None:
            out.setdefault(t.source, []).append((index, seconds))
    return {sid: tuple(edges) for sid, edges in out.items()}


def enter_and_leave(
    ctx: RunContext,
    spec: WorkflowSpec,
    edges: Mapping[str, tuple[tuple[int, float], ...]],
    record: Record,
    *,
    now_in: str,
    target: str | None = None,
    fired: int | None = None,
) -> None:
    """After a transition into `now_in` (declared `target`; `fired`: the edge just taken) or at
    the run's start: cancel the deadlines of the compound states left (or re-entered: the edge
    targets the compound state itself), and set those of the compound states entered."""
    if not edges:
        return
    active = ctx.notes.deadlines
    for deadlines in active.values():  # a deadline fires once
        deadlines[:] = [d for d in deadlines if d.edge != fired]
    for sid in [s for s in active if not spec.inside(now_in, s) or s == target]:
        for deadline in active.pop(sid):
            record(EventType.TIMER_CANCELLED, {"edge": deadline.edge})
    for sid in spec.ancestors(now_in):
        if sid in edges and sid not in active:
            active[sid] = [_set(ctx, sid, edge, seconds, record) for edge, seconds in edges[sid]]


def _set(ctx: RunContext, sid: str, edge: int, seconds: float, record: Record) -> Deadline:
    """Record one deadline; its due time is the log's when the run is re-driven."""
    due = (ctx.services.clock.now() + timedelta(seconds=seconds)).isoformat()
    event = record(EventType.TIMER_SET, {"edge": edge, "after": seconds, "due": due, "state": sid})
    recorded = event.data.get("due") if event is not None else None
    return Deadline(edge, datetime.fromisoformat(str(recorded or due)), sid)


def pending_deadlines(ctx: RunContext) -> list[Deadline]:
    """The deadlines of the compound states the run is inside, outermost state first."""
    return [d for deadlines in ctx.notes.deadlines.values() for d in deadlines]


def due_deadline(ctx: RunContext, step: int) -> Deadline | None:
    """The deadline that fires as the run leaves its current state, the `step`-th transition
    (0-based): the one the log says fired there, while the log lasts; then the earliest due."""
    pending = pending_deadlines(ctx)
    if not pending:
        return None
    recorded = ctx.services.recorded_deadlines
    if recorded is not None and step < recorded.steps:
        edge = recorded.firings.get(step)
        return next((d for d in pending if d.edge == edge), None)
    now = ctx.services.clock.now()
    due = [d for d in pending if d.due <= now]
    return min(due, key=lambda d: d.due) if due else None


def recorded_deadlines(events: list[Event]) -> RecordedDeadlines:
    """From a run's log: where its deadlines fired (`timer.fired` with a `step`)."""
    firings = {
        int(e.data["step"]): int(e.data["edge"])
        for e in events
        if e.type is EventType.TIMER_FIRED and e.data.get("step") is not None
    }
    steps = sum(1 for e in events if e.type is EventType.TRANSITION_TAKEN)
    return RecordedDeadlines(firings, steps)
