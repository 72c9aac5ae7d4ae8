"""What the viewer's pages show, read from the event store (and the scheduler's queue): a page
of runs, one run (header, waiting question, diagram, timeline), the workflows. Every text that
came from a run is redacted here, once, before any template sees it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

from fsm_kernel.diagram import RunOverlay
from fsm_kernel.errors import StoreError
from fsm_kernel.protocol import Event, EventType, RunFilter, RunSummary
from fsm_kernel.redact import redact, redact_data
from fsm_kernel.replay import pinning, recorded_definition
from fsm_kernel.scheduler import Dispatch
from fsm_kernel.store import (
    ENDED,
    INTERRUPTED,
    RUN_SUSPENDED,
    RUNNING,
    WAITING,
    AnyEventStore,
    status_after,
)
from fsm_kernel.ui._diagrams import (
    Diagram,
    DiagramRenderer,
    LoadedWorkflow,
    load_recorded,
    load_recorded_text,
    load_stock,
    under_roots,
)
from fsm_kernel.ui._dispatches import DispatchReader
from fsm_kernel.ui._timeline import Timeline, build_timeline
from fsm_kernel.workflow.spec import SUCCESS_REASONS, TERMINATION_REASONS

__all__ = [
    "PAGE_SIZE",
    "RecentWorkflow",
    "RunView",
    "RunsPage",
    "UiReader",
    "WaitingFor",
    "status_class",
    "stock_workflows",
]

PAGE_SIZE = 50
_RECENT_RUNS = 300
"""Runs looked at for the filter menus and the recently used workflows."""
_LIVE = frozenset({RUNNING, WAITING})


def status_class(status: str) -> str:
    """The CSS class of a status badge: running, waiting, interrupted, ok, failed or ended."""
    if status in _LIVE or status == INTERRUPTED:
        return status
    if status in SUCCESS_REASONS:
        return "ok"
    if status in TERMINATION_REASONS:
        return "failed"
    return "ended"  # a workflow's own reason: success or not is the workflow's to say


@dataclass(frozen=True)
class ChildLink:
    """A child run as its parent's page lists it."""

    run_id: str
    workflow: str
    item: int | None
    """Its item's number (from 1) in a workflow.map; None for a workflow.call."""
    reason: str | None
    """How it ended, once the parent recorded it (child.finished)."""


def _children(events: Sequence[Event]) -> list[ChildLink]:
    started: dict[str, ChildLink] = {}
    for e in events:
        if e.type == EventType.CHILD_STARTED:
            item = e.data.get("item")
            run_id = str(e.data.get("run_id"))
            started[run_id] = ChildLink(
                run_id,
                str(e.data.get("workflow") or ""),
                None if item is None else int(item) + 1,
                None,
            )
        elif e.type == EventType.CHILD_FINISHED and str(e.data.get("run_id")) in started:
            link = started[str(e.data["run_id"])]
            reason = e.data.get("reason")
            started[link.run_id] = ChildLink(
                link.run_id, link.workflow, link.item, str(reason) if reason else "not started"
            )
    return list(started.values())


@dataclass(frozen=True)
class RunsPage:
    """One page of the runs table."""

    runs: list[RunSummary]
    total: int
    where: RunFilter
    newer: str | None
    """The run id to page back from (`?after=`), None on the first page."""
    older: str | None
    """The run id to page on from (`?before=`), None on the last page."""
    workflows: list[str]
    statuses: list[str]


@dataclass(frozen=True)
class WaitingFor:
    """What a waiting run asks a person (from its last `run.suspended` event)."""

    kind: str
    """`approval` (of `tool_call`), `input` (an answer to `prompt`) or `event` (one of
    `events`, or its timer once `due`: a waiting state)."""
    state: str | None
    tool_call: dict[str, Any] | None
    prompt: str | None
    seq: int
    """The `run.suspended` event's seq: an answer names the question it answers."""
    events: tuple[str, ...] = ()
    due: str | None = None

    @classmethod
    def from_event(cls, event: Event) -> WaitingFor:
        waiting = event.data.get("waiting_for")
        waiting = waiting if isinstance(waiting, dict) else {}
        call = waiting.get("tool_call")
        prompt, due = waiting.get("prompt"), waiting.get("due")
        return cls(
            events=tuple(str(e) for e in waiting.get("events") or () if isinstance(e, str)),
            due=due if isinstance(due, str) else None,
            kind=str(waiting.get("kind") or "input"),
            state=waiting.get("state") if isinstance(waiting.get("state"), str) else None,
            tool_call=call if isinstance(call, dict) else None,
            prompt=prompt if isinstance(prompt, str) else None,
            seq=event.seq,
        )


@dataclass(frozen=True)
class RunView:
    """Everything the run page shows."""

    run_id: str
    seq: int
    """The last event's seq: the page asks for a fresh view when the log passes it."""
    status: str
    """running, interrupted, waiting, or the termination reason (RunSummary.shown_status)."""
    workflow: str
    goal: str
    model: str
    started_at: datetime
    last_event_at: datetime
    iterations: int
    reason: str | None
    answer: str | None
    error: str | None
    resumable: bool
    parent_run_id: str | None
    children: list[ChildLink]
    """The child runs it started (workflow.call, workflow.map), in the order it started them."""
    dispatch: Dispatch | None
    """The scheduler dispatch this run came from, when known (once it finished)."""
    waiting: WaitingFor | None
    current_state: str | None
    overlay: RunOverlay
    diagram: Diagram | None
    timeline: Timeline
    workflow_path: str | None
    definition: str = ""
    """Which workflow version the run is pinned to, and whether its file changed since."""

    @property
    def is_live(self) -> bool:
        return self.status in _LIVE

    @property
    def duration_s(self) -> float:
        return (self.last_event_at - self.started_at).total_seconds()


@dataclass(frozen=True)
class RecentWorkflow:
    name: str
    path: str | None
    last_run: str
    runs: int
    """Runs among the most recent ones."""


def _last(events: list[Event], kind: str) -> Event | None:
    return next((e for e in reversed(events) if e.type.value == kind), None)


def _model_line(settings: dict[str, Any]) -> str:
    local = settings.get("local")
    where = (
        f"in-process llama.cpp, {local.get('model')}"
        if isinstance(local, dict)
        else (str(settings.get("base_url") or ""))
    )
    return f"{settings.get('model') or '?'} ({where})" if settings else ""


class UiReader:
    """The store (opened read-only), the scheduler's queue and the diagram renderer, behind the
    questions the pages ask."""

    def __init__(
        self,
        store: AnyEventStore,
        dispatches: DispatchReader | None = None,
        *,
        location: str | None = None,
        roots: Sequence[Path] = (),
    ) -> None:
        self.store = store
        self.dispatches = dispatches
        self.location = location
        """Where `store` is (a POST that writes, such as an answer to a waiting run, opens its
        own read-write store there: this one may be read-only)."""
        self.roots = tuple(roots)
        """The folders whose workflow files the viewer may show (see load_recorded)."""
        self.renderer = DiagramRenderer()
        self._started: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def close(self) -> None:
        self.store.close()
        if self.dispatches is not None:
            self.dispatches.close()

    # -- runs ---------------------------------------------------------------------------------

    def runs_page(
        self, where: RunFilter, *, before: str | None = None, after: str | None = None
    ) -> RunsPage:
        """A page of runs, newest first; going back past the newest gives the first page."""
        store = self.store
        runs = store.list_runs(limit=PAGE_SIZE + 1, where=where, before=before, after=after)
        first_page = before is None and (after is None or len(runs) <= PAGE_SIZE)
        if after is not None and first_page:
            runs = store.list_runs(limit=PAGE_SIZE + 1, where=where)
        if after is not None and not first_page:
            runs = runs[1:]  # the extra one is the newer side's
            more_older = True
        else:
            more_older = len(runs) > PAGE_SIZE
            runs = runs[:PAGE_SIZE]
        recent = store.list_runs(limit=_RECENT_RUNS)
        return RunsPage(
            runs=[_redacted_summary(r) for r in runs],
            total=store.count_runs(where=where),
            where=where,
            newer=None if first_page or not runs else runs[0].run_id,
            older=runs[-1].run_id if runs and more_older else None,
            workflows=_workflow_names(recent),
            statuses=_statuses(recent),
        )

    def head(self, run_id: str) -> int:
        """The run's last seq (0 for none): cheap, asked every second by a live run's page."""
        return self.store.next_seq(run_id) - 1

    def find(self, prefix: str) -> str:
        return self.store.find_run(prefix)

    def short_id(self, run_id: str) -> str:
        """The shortest prefix (8 characters at least) that names the run alone in the store,
        as the CLI accepts it; the full id when the store cannot say."""
        try:
            return self.store.short_id(str(run_id))
        except StoreError:
            return str(run_id)

    def waits_on(self, run_id: str, seq: int) -> bool:
        """Whether the run still waits for the answer to the question of seq `seq` (its log
        is still the `run.suspended` of that seq: nothing was recorded after it)."""
        return self.head(run_id) == seq

    def event(self, run_id: str, seq: int) -> Event | None:
        found = next((e for e in self.store.read(run_id) if e.seq == seq), None)
        return None if found is None else _redacted(found)

    def run(self, run_id: str) -> RunView:
        """One run's view; RunNotFoundError when it has no events."""
        events = [_redacted(e) for e in self.store.read(run_id)]
        if not events:
            from fsm_kernel.errors import RunNotFoundError

            raise RunNotFoundError(f"no run with id {run_id!r}", run_id=run_id)
        return self._view(run_id, events)

    def _view(self, run_id: str, events: list[Event]) -> RunView:
        started = events[0].data if events[0].type is EventType.RUN_STARTED else {}
        status = RUNNING
        for event in events:
            status = status_after(event) or status
        end = _last(events, EventType.RUN_TERMINATED.value)
        resumed = _last(events, EventType.RUN_RESUMED.value)
        if end is not None and resumed is not None and resumed.seq > end.seq:
            end = None  # a resume reopened it
        if status == ENDED:
            status = (_text(end.data.get("reason")) if end else None) or ENDED
        elif status == RUNNING and not self.store.is_running(run_id):
            status = INTERRUPTED  # no process drives it: it died before the run ended
        suspended = _last(events, RUN_SUSPENDED)
        overlay = RunOverlay.from_events(events)
        # the full path inside compound states (research.think), as the run recorded it
        current = (overlay.last_path or overlay.last_state) if status in _LIVE else None
        pinned_text = recorded_definition(events)[1]  # the text the run follows, if recorded
        loaded = (
            load_recorded_text(pinned_text, _text(started.get("workflow_path")))
            if pinned_text
            else load_recorded(
                _text(started.get("workflow_path")),
                _text(started.get("workflow")),
                overlay.workflow_hash or _text(started.get("workflow_hash")),
                self.roots,
            )
        )
        diagram = None
        if loaded is not None and loaded.spec is not None:
            diagram = self.renderer.draw(loaded.spec, overlay, current=current)
        elif loaded is not None:
            diagram = Diagram(None, loaded.error, (), loaded.path)
        iterations = max((e.iteration for e in events), default=0)
        return RunView(
            run_id=run_id,
            seq=events[-1].seq,
            status=status,
            workflow=_text(started.get("workflow")) or "",
            goal=str(started.get("goal") or ""),
            model=_model_line(started.get("settings") or {}),
            started_at=events[0].timestamp,
            last_event_at=events[-1].timestamp,
            iterations=iterations,
            reason=_text(end.data.get("reason")) if end else None,
            answer=_text(end.data.get("answer")) if end else None,
            error=_text(end.data.get("error")) if end else None,
            resumable=end is None or bool(end.data.get("resumable")),
            parent_run_id=_text(started.get("parent_run_id")),
            children=_children(events),
            dispatch=self._dispatch_of(run_id),
            waiting=WaitingFor.from_event(suspended) if suspended and status == WAITING else None,
            current_state=current,
            overlay=overlay,
            diagram=diagram,
            timeline=build_timeline(events),
            workflow_path=_text(started.get("workflow_path")),
            definition=pinning(events, may_read=lambda p: under_roots(p, self.roots))["line"],
        )

    def _dispatch_of(self, run_id: str) -> Dispatch | None:
        if self.dispatches is None:
            return None
        return self.dispatches.for_run(run_id)

    # -- workflows ----------------------------------------------------------------------------

    def recent_workflows(self) -> list[RecentWorkflow]:
        """The workflows of the most recent runs, each with the file its latest run used."""
        latest: dict[str, RunSummary] = {}
        counts: dict[str, int] = {}
        for run in self.store.list_runs(limit=_RECENT_RUNS):
            if not run.workflow:
                continue
            latest.setdefault(run.workflow, run)
            counts[run.workflow] = counts.get(run.workflow, 0) + 1
        return [
            RecentWorkflow(
                name=name,
                path=_text(self.started_data(run.run_id).get("workflow_path")),
                last_run=run.run_id,
                runs=counts[name],
            )
            for name, run in latest.items()
        ]

    def started_data(self, run_id: str) -> dict[str, Any]:
        """The run's `run.started` data (redacted), remembered: it never changes."""
        with self._lock:
            if run_id in self._started:
                return self._started[run_id]
        events = self.store.read(run_id)
        first = events[0] if events else None
        data = _redacted(first).data if first and first.type is EventType.RUN_STARTED else {}
        with self._lock:
            self._started[run_id] = data
            while len(self._started) > 256:
                self._started.popitem(last=False)
        return data

    def workflow_of_run(self, run_id: str) -> LoadedWorkflow | None:
        data = self.started_data(run_id)
        return load_recorded(
            _text(data.get("workflow_path")), _text(data.get("workflow")),
            _text(data.get("workflow_hash")), self.roots,
        )  # fmt: skip

    def stock_workflow(self, name: str) -> LoadedWorkflow | None:
        return load_stock(name)


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _redacted(event: Event) -> Event:
    return replace(event, data=redact_data(event.data))


def _redacted_summary(run: RunSummary) -> RunSummary:
    return replace(run, goal=redact(run.goal), workflow=redact(run.workflow))


@cache
def stock_workflows() -> tuple[tuple[str, str], ...]:
    """(name, description) of the stock workflows: read once, they ship with fsm-kernel."""
    from fsm_kernel.bootstrap import list_stock_workflows

    return tuple(list_stock_workflows())


def _workflow_names(recent: list[RunSummary]) -> list[str]:
    names = {name for name, _ in stock_workflows()}
    names |= {r.workflow for r in recent if r.workflow}
    return sorted(names)


def _statuses(recent: list[RunSummary]) -> list[str]:
    """The statuses to filter by: running, interrupted, waiting, ended (any ending), every
    built-in reason, and the workflows' own reasons seen lately."""
    known = [RUNNING, INTERRUPTED, WAITING, ENDED, *(str(r) for r in TERMINATION_REASONS)]
    return known + sorted({r.shown_status for r in recent} - set(known))
