"""Moving a run's log onto another version of its workflow (`resume --migrate`).

A run's log names states by id and edges by index. A newer definition may rename states (its
`migrations:` say so) and renumber edges (an edge inserted, moved or removed). A `Translation`
maps the old names and numbers onto the new ones; applied to the recorded events, the log reads
as if the run had followed the new definition from its start, so a re-drive under that
definition (resume's catch-up, replay) matches every recorded step.

The translation a migration used is recorded in its `run.resumed` event: whoever reads the log
later applies it to the events before that point (see `translate_log`), so resume and replay
stay exact after any number of migrations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fsm_kernel.protocol import Event, EventType
from fsm_kernel.workflow.spec import WorkflowSpec

__all__ = ["Translation", "translate_log", "translation_between"]

_STATE_KEYS = ("source", "target", "state")
"""Event data keys that hold a state id."""
_PATH_KEYS = ("from", "to", "path")
"""Event data keys that hold a full path (research.think)."""
_EDGE_KEY = {
    EventType.TRANSITION_TAKEN: "index",
    EventType.TIMER_SET: "edge",
    EventType.TIMER_FIRED: "edge",
    EventType.TIMER_CANCELLED: "edge",
}
"""Where an event names an edge by its index."""


@dataclass(frozen=True)
class Translation:
    """Old state ids and edge indexes -> the ones of the definition a run moved to."""

    states: Mapping[str, str] = field(default_factory=dict)
    edges: Mapping[int, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        """False when it changes nothing (no rename, every edge keeps its index)."""
        return any(a != b for a, b in self.states.items()) or any(
            a != b for a, b in self.edges.items()
        )

    def state(self, sid: str) -> str:
        return self.states.get(sid, sid)

    def path(self, dotted: str) -> str:
        return ".".join(self.state(part) for part in dotted.split("."))

    def edge(self, index: int) -> int:
        return self.edges.get(index, index)

    def event(self, e: Event) -> Event:
        """`e` with the states and edges it names translated (the same event when none)."""
        data = dict(e.data)
        for key in _STATE_KEYS:
            if isinstance(data.get(key), str):
                data[key] = self.state(data[key])
        for key in _PATH_KEYS:
            if isinstance(data.get(key), str):
                data[key] = self.path(data[key])
        edge_key = _EDGE_KEY.get(e.type)
        if edge_key is not None and isinstance(data.get(edge_key), int):
            data[edge_key] = self.edge(data[edge_key])
        waiting = data.get("waiting_for")
        if isinstance(waiting, dict) and isinstance(waiting.get("state"), str):
            data["waiting_for"] = {**waiting, "state": self.state(waiting["state"])}
        state = self.state(e.state) if e.state is not None else None
        if data == e.data and state == e.state:
            return e
        return dataclasses.replace(e, state=state, data=data)

    def to_dict(self) -> dict[str, Any]:
        """For the `run.resumed` event: only what changes."""
        return {
            "states": {a: b for a, b in self.states.items() if a != b},
            "edges": {str(a): b for a, b in self.edges.items() if a != b},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Translation:
        states = {str(a): str(b) for a, b in dict(data.get("states") or {}).items()}
        edges = {int(a): int(b) for a, b in dict(data.get("edges") or {}).items()}
        return cls(states, edges)


def renames(old: WorkflowSpec, new: WorkflowSpec) -> dict[str, str]:
    """The state renames `new`'s `migrations:` declare from `old`'s version on, composed in
    version order (a log without a version takes them all)."""
    since = old.version or 0
    out = {sid: sid for sid in old.states}
    for entry in sorted(new.migrations, key=lambda m: m.from_version):
        if entry.from_version < since:
            continue
        out = {sid: entry.rename_states.get(now, now) for sid, now in out.items()}
    return out


def translation_between(old: WorkflowSpec, new: WorkflowSpec) -> Translation:
    """How `old`'s state ids and edge indexes read under `new`: states by the declared
    renames; each edge to the edge of `new` with the same (renamed) source and target, guard
    label and reason — the n-th such edge of `old` to the n-th of `new`. An edge `new` no
    longer has gets a negative number no edge has (a run that took it cannot migrate: its
    replay diverges)."""
    states = renames(old, new)
    wanted: dict[tuple[Any, ...], list[int]] = {}
    for index, key in _edge_keys(new, {}):
        wanted.setdefault(key, []).append(index)
    edges: dict[int, int] = {}
    for index, key in _edge_keys(old, states):
        same = wanted.get(key)
        edges[index] = same.pop(0) if same else -1 - index  # gone: a number no edge has
    return Translation(states, edges)


def _edge_keys(
    spec: WorkflowSpec, states: Mapping[str, str]
) -> Iterable[tuple[int, tuple[Any, ...]]]:
    def name(sid: str) -> str:
        return states.get(sid, sid)

    for index, t in enumerate(spec.transitions):
        yield index, ("edge", name(t.source), name(t.target), t.label(), t.reason)
    for c in spec.catch_edges():
        yield c.index, ("catch", name(c.source), name(c.target), c.label(), c.reason)


def translate_log(events: Sequence[Event], extra: Translation | None = None) -> list[Event]:
    """The log as the definition the run follows now reads it: each `run.resumed` that recorded
    a migration's translation applies it to the events before it (then `extra`, a migration
    about to be made, to all of them)."""
    out = list(events)
    for i, e in enumerate(out):
        recorded = e.data.get("translation") if e.type is EventType.RUN_RESUMED else None
        if recorded:
            move = Translation.from_dict(recorded)
            out[:i] = [move.event(before) for before in out[:i]]
    if extra:
        out = [extra.event(e) for e in out]
    return out
