"""The run overlay: what one run did on its workflow (visits, fired transitions, where and why it
ended), folded from its events, and whether it fits a given spec; the heat overlay: what many
runs of a workflow did on it, added up. Draws nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from fsm_kernel.protocol import Event, EventType
from fsm_kernel.store import tokens_of
from fsm_kernel.workflow.spec import WorkflowSpec

__all__ = ["HeatOverlay", "RunOverlay", "fired_count", "overlay_problems"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RunOverlay:
    """What one run did on its workflow, derived from its events."""

    run_id: str = ""
    workflow: str | None = None
    """The workflow name the run recorded at its start."""
    workflow_hash: str | None = None
    """The workflow file's sha256 the run last ran under (a forced resume changes it)."""
    workflow_path: str | None = None
    """The workflow file the run was started from."""
    visits: dict[str, int] = field(default_factory=dict)
    """Times each state was entered (final states included)."""
    traversals: dict[int, int] = field(default_factory=dict)
    """Times each transition (by its index in the workflow's list) fired."""
    edges: dict[int, tuple[str, str]] = field(default_factory=dict)
    """(source, target) each fired transition index had in the run, to check against a spec."""
    path: tuple[int, ...] = ()
    """Transition indexes in the order they fired."""
    terminating: int | None = None
    """The transition into a final state that ended the run; None if the kernel ended it."""
    reason: str | None = None
    """The termination reason; None while the run is in flight (or was killed)."""
    error: str | None = None
    last_state: str | None = None
    """The state the run was in when it ended (or is in now)."""
    last_path: str | None = None
    """`last_state` with the compound states it is inside (research.think), as the run
    recorded it; `last_state` itself in a workflow without compound states."""
    waiting: bool = False
    """The run is suspended until a person answers (in `last_state`)."""

    @property
    def ended_by_kernel(self) -> bool:
        """The run terminated without taking a transition into a final state."""
        return self.reason is not None and self.terminating is None

    @classmethod
    def from_events(cls, events: Iterable[Event]) -> RunOverlay:
        """Build the overlay from one run's events (in seq order)."""
        builder = _OverlayBuilder()
        for event in sorted(events, key=lambda e: e.seq):
            builder.feed(event)
        return builder.build()


class _OverlayBuilder:
    """Folds events into the counters of a RunOverlay."""

    def __init__(self) -> None:
        self.run_id = ""
        self.started: dict[str, object] = {}
        self.visits: dict[str, int] = {}
        self.traversals: dict[int, int] = {}
        self.edges: dict[int, tuple[str, str]] = {}
        self.path: list[int] = []
        self.pending: int | None = None  # last transition whose target has not been entered
        self.state: str | None = None
        self.paths: dict[str, str] = {}  # state → its full path, as `state.entered` recorded
        self.reason: str | None = None
        self.error: str | None = None
        self.waiting = False

    def feed(self, event: Event) -> None:
        self.run_id = self.run_id or event.run_id
        if event.type is EventType.RUN_STARTED:
            self.started = dict(event.data)
        elif event.type is EventType.RUN_RESUMED:  # reopens an ending or a suspension
            self.reason = self.error = None
            self.waiting = False
            if event.data.get("workflow_hash"):
                self.started["workflow_hash"] = event.data["workflow_hash"]  # resume --force
        elif event.type is EventType.RUN_SUSPENDED:
            self.waiting = True
        elif event.type is EventType.STATE_ENTERED and event.state is not None:
            self._enter(event.state)
            if isinstance(event.data.get("path"), str):
                self.paths[event.state] = event.data["path"]
        elif event.type is EventType.TRANSITION_TAKEN:
            self._take(event.data)
        elif event.type is EventType.RUN_TERMINATED:
            self.reason = _text_or_none(event.data.get("reason"))
            self.error = _text_or_none(event.data.get("error"))

    def _enter(self, state: str) -> None:
        self.visits[state] = self.visits.get(state, 0) + 1
        self.state = state
        self.pending = None

    def _take(self, data: dict[str, object]) -> None:
        index = data.get("index")
        if not isinstance(index, int):
            logger.warning("transition event without an index: %r", data)
            return
        self.traversals[index] = self.traversals.get(index, 0) + 1
        self.edges[index] = (str(data.get("source")), str(data.get("target")))
        self.path.append(index)
        self.pending = index

    def build(self) -> RunOverlay:
        terminating = self.pending if self.reason is not None else None
        visits = dict(self.visits)
        state = self.state
        if terminating is not None:
            # The kernel does not record `state.entered` for the final state it stops in.
            state = self.edges[terminating][1]
            visits[state] = visits.get(state, 0) + 1
        return RunOverlay(
            run_id=self.run_id,
            workflow=_text_or_none(self.started.get("workflow")),
            workflow_hash=_text_or_none(self.started.get("workflow_hash")),
            workflow_path=_text_or_none(self.started.get("workflow_path")),
            visits=visits,
            traversals=dict(self.traversals),
            edges=dict(self.edges),
            path=tuple(self.path),
            terminating=terminating,
            reason=self.reason,
            error=self.error,
            last_state=state,
            last_path=self.paths.get(state, state) if state is not None else None,
            waiting=self.waiting and self.reason is None,
        )


def _text_or_none(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def overlay_problems(spec: WorkflowSpec, overlay: RunOverlay) -> list[str]:
    """Why `overlay` may not fit `spec` (another workflow, a changed file); empty if it fits."""
    problems = []
    if overlay.workflow and overlay.workflow != spec.name:
        problems.append(
            f"run {overlay.run_id} is of workflow {overlay.workflow!r}, not {spec.name!r}"
        )
    elif overlay.workflow_hash and spec.content_hash and overlay.workflow_hash != spec.content_hash:
        problems.append(f"the workflow file changed since run {overlay.run_id}")
    for index, (source, target) in sorted(overlay.edges.items()):
        if not _edge_matches(spec, index, source, target):
            problems.append(
                f"transition {index} ({source} -> {target}) is not in the workflow; it is not drawn"
            )
    return problems


def _edge_matches(spec: WorkflowSpec, index: int, source: str, target: str) -> bool:
    """Edge `index` of `spec` (a declared transition or a catch edge) goes source → target."""
    edge = spec.catch_edge(index)
    if edge is not None:
        return (edge.source, edge.target) == (source, target)
    if not 0 <= index < len(spec.transitions):
        return False
    t = spec.transitions[index]
    return (t.source, t.target) == (source, target)


def fired_count(spec: WorkflowSpec, overlay: RunOverlay, index: int) -> int:
    """How often transition `index` of `spec` fired in the run (0 if it does not match)."""
    if index not in overlay.edges:
        return 0
    source, target = overlay.edges[index]
    return overlay.traversals[index] if _edge_matches(spec, index, source, target) else 0


NOT_ENDED = "(not ended)"
"""The `reasons` key of runs still in flight, killed, or waiting for a person or an event."""


@dataclass(kw_only=True)
class HeatOverlay:
    """What many runs of one workflow did on it, added up (`fsm-kernel runs coverage`): drawn
    as heat, each edge as thick and as warm as it is often taken."""

    workflow: str
    runs: int = 0
    visits: dict[str, int] = field(default_factory=dict)
    """Times each state was entered, over all the runs."""
    traversals: dict[int, int] = field(default_factory=dict)
    """Times each edge of the spec (by index) fired; only transitions that match the spec's edge
    of that index count (a run recorded under another version may number them otherwise)."""
    unmatched: int = 0
    """Transitions recorded that match no edge of the spec (another version's): not counted."""
    reasons: dict[str, int] = field(default_factory=dict)
    """How many runs ended with each termination reason; NOT_ENDED for those that did not."""
    tokens: dict[str, int] = field(default_factory=dict)
    """Tokens the model used (prompt + completion, as the server reported them) per state."""

    def add_run(self, spec: WorkflowSpec, events: Iterable[Event]) -> None:
        """Fold one run's events (in seq order) in."""
        events = list(events)
        overlay = RunOverlay.from_events(events)
        self.runs += 1
        for state, n in overlay.visits.items():
            self.visits[state] = self.visits.get(state, 0) + n
        for index, (source, target) in overlay.edges.items():
            if _edge_matches(spec, index, source, target):
                self.traversals[index] = self.traversals.get(index, 0) + overlay.traversals[index]
            else:
                self.unmatched += overlay.traversals[index]
        reason = overlay.reason or NOT_ENDED
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        for e in events:
            used = tokens_of(e)
            if used and e.state:
                self.tokens[e.state] = self.tokens.get(e.state, 0) + used

    def edges(self, spec: WorkflowSpec) -> list[int]:
        """Every edge of `spec` by index: the declared transitions, then the catch edges."""
        return list(range(len(spec.transitions))) + [e.index for e in spec.catch_edges()]

    def never_taken(self, spec: WorkflowSpec) -> list[int]:
        """The edges of `spec` no run took."""
        return [i for i in self.edges(spec) if not self.traversals.get(i)]

    def heat(self, index: int) -> float:
        """How often edge `index` fired against the edge fired most: 0 (never) to 1."""
        most = max(self.traversals.values(), default=0)
        return self.traversals.get(index, 0) / most if most else 0.0
