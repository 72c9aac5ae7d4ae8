"""Stored runs as a regression suite.

- `check_run`: does a recorded run re-decide identically under a definition (the one it
  recorded, or an edited file)? If not, its first divergence: the run (itself or a child), the
  step, both transitions and the check that decided differently. `resume --migrate` moves a
  run only when it does; `fsm-kernel replay --all` asks it of every stored run.
- `replay_all`: that check over the stored runs, streamed from the store a page at a time and
  replayed one at a time (nothing live: no model, no tools).
- `workflow_coverage`: a workflow's stored runs folded into a `HeatOverlay` (edges taken,
  termination reasons, tokens per state) for `fsm-kernel runs coverage`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from itertools import zip_longest
from typing import TYPE_CHECKING, Any, Literal

from fsm_kernel.bootstrap import load_spec, recorded_workflow
from fsm_kernel.errors import FsmKernelError, ResumeError
from fsm_kernel.protocol import Event, EventStore, RunFilter, RunSummary
from fsm_kernel.replay import (
    RecordedRun,
    ReplayReport,
    ReplayStep,
    replay_run,
    transition_label,
)
from fsm_kernel.store import AnyEventStore
from fsm_kernel.workflow.children import CallPool, draw_on
from fsm_kernel.workflow.compiler import CompiledWorkflow, compile_workflow
from fsm_kernel.workflow.loader import load_workflow_text
from fsm_kernel.workflow.migrations import Translation, translation_between
from fsm_kernel.workflow.spec import WorkflowSpec, edge_number

if TYPE_CHECKING:  # imported where used: the diagrams (and graphviz, ~30 ms) load on demand
    from fsm_kernel.diagram import HeatOverlay

__all__ = [
    "Divergence",
    "RunCheck",
    "Unreplayable",
    "Verdict",
    "check_run",
    "decided_differently",
    "first_divergence",
    "migration_check",
    "recorded_spec",
    "replay_all",
    "stored_runs",
    "workflow_coverage",
]

logger = logging.getLogger(__name__)

PAGE = 50
"""Runs read from the store at a time (a page of summaries; each run's events are read when it
is replayed, and let go after)."""

_COMPILED_KEPT = 8
"""Recorded definitions kept compiled while sweeping (runs of one version share one)."""


class Unreplayable(FsmKernelError):
    """A stored run that cannot be re-decided here (why: the message)."""


@dataclass(frozen=True, kw_only=True)
class Divergence:
    """Where a run first decided differently under another definition."""

    run_id: str
    """The run whose step differs: the run itself, or one of its child runs."""
    step: int | None
    """The 1-based transition that differs; None when every transition is the same and the
    run ends otherwise (another reason, another structured output)."""
    iteration: int | None = None
    recorded: str | None = None
    """The recorded transition (`think → act [has_tool_calls]`); None: the run took none there."""
    replayed: str | None = None
    """The transition the replay took; None: it took none there (it ended before)."""
    decided_by: str | None = None
    """What decided differently (see `decided_differently`): the check, when both events
    record the checks they tried; else the two transitions, each with its guard."""
    by_check: bool = False
    """`decided_by` names a check (both events recorded `tried`)."""
    recorded_reason: str | None = None
    replayed_reason: str | None = None
    error: str | None = None
    """What stopped the replay, when something did (it asked the model once more than the run
    did, called a tool the run did not...)."""

    def line(self) -> str:
        """One line: `at step 2 (iteration 1): recorded …, replay took …; decided by …`."""
        if self.step is None:
            text = f"ended {self.recorded_reason}, replay ended {self.replayed_reason}"
            if self.recorded_reason == self.replayed_reason:
                text = f"ended {self.recorded_reason} with another structured output"
        else:
            text = (
                f"at step {self.step} (iteration {self.iteration}): recorded "
                f"{self.recorded or '(nothing)'}, replay took {self.replayed or '(nothing)'}"
            )
            if self.by_check:  # else the two transitions above, with their guards, say it
                text += f"; decided by {self.decided_by}"
        if self.error:
            text += f" ({self.error})"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "step": self.step,
            "iteration": self.iteration,
            "recorded": self.recorded,
            "replayed": self.replayed,
            "decided_by": self.decided_by,
            "by_check": self.by_check,
            "recorded_reason": self.recorded_reason,
            "replayed_reason": self.replayed_reason,
            "error": self.error,
        }


@dataclass(frozen=True)
class RunCheck:
    """A run re-decided under a definition: the replay, and its first divergence (None when
    it decided identically)."""

    report: ReplayReport
    divergence: Divergence | None

    @property
    def identical(self) -> bool:
        return self.divergence is None


async def check_run(
    workflow: CompiledWorkflow | WorkflowSpec,
    store: EventStore,
    run_id: str,
    *,
    limits: Any = None,
    migrating: Translation | None = None,
) -> RunCheck:
    """Replay run `run_id` under `workflow` (nothing live) and say whether it re-decides
    identically: each recorded transition, its child runs', and the way it ended. `limits`:
    see `replay_run` (None: the ones the run recorded); `migrating`: read the log under a
    migration's new state names and edge numbers (see `migration_check`).

    Raises:
        RunNotFoundError: no such run, or its log has no start.
    """
    compiled = workflow if isinstance(workflow, CompiledWorkflow) else compile_workflow(workflow)
    report = await replay_run(compiled, store, run_id, limits=limits, migrating=migrating)
    return RunCheck(report, first_divergence(report))


async def migration_check(
    store: EventStore, run_id: str, new: WorkflowSpec, *, where: str | None = None
) -> Translation:
    """Whether run `run_id` may move to the definition `new` (`resume --migrate`): the check
    `replay --all` makes, on the run's log read under `new`'s names — its old state ids renamed
    as `new`'s `migrations:` declare, its edges matched to `new`'s. Returns the translation to
    resume it with (`resume_run(..., migrating=)`).

    Raises:
        ResumeError: the run ended for good, or `new` decides differently: the first
            divergence (step and both transitions) in one line; nothing is recorded.
    """
    run = RecordedRun.load(store, run_id)
    name = where or new.path
    run.refuse_if_ended("migrated")
    text = run.definition[1]
    old = load_workflow_text(text, path=name, import_code=False, calls=False) if text else None
    move = translation_between(old, new) if old is not None else Translation()
    check = await check_run(new, store, run.run_id, migrating=move)
    first, report = check.divergence, check.report
    if first is not None and first.step is not None and first.run_id == run.run_id:
        raise ResumeError(
            f"cannot migrate run {run.run_id} to {name}: at step {first.step} (iteration "
            f"{first.iteration}) it recorded {first.recorded or '(nothing)'}, the new definition "
            f"takes {first.replayed or '(nothing)'}; nothing was changed",
            run_id=run.run_id,
        )
    if first is not None:
        raise ResumeError(
            f"cannot migrate run {run.run_id} to {name}: its recorded steps ended "
            f"{report.recorded_reason}, under the new definition {report.replayed_reason}; "
            "nothing was changed",
            run_id=run.run_id,
        )
    return move


def first_divergence(report: ReplayReport) -> Divergence | None:
    """The first step of the run that differs; else the first of its children's (in the order
    it started them); else its ending, when that differs; None when the replay is identical."""
    if report.identical:
        return None
    step = report.first_divergence
    if step is not None:
        return _at_step(report, step)
    for child in report.children:
        found = first_divergence(child)
        if found is not None:
            return found
    return Divergence(
        run_id=report.run_id,
        step=None,
        recorded_reason=report.recorded_reason,
        replayed_reason=report.replayed_reason,
        error=report.error,
    )


def _at_step(report: ReplayReport, step: ReplayStep) -> Divergence:
    return Divergence(
        run_id=report.run_id,
        step=step.step,
        iteration=step.iteration,
        recorded=step.recorded,
        replayed=step.replayed,
        decided_by=decided_differently(step.recorded_event, step.replayed_event),
        by_check=_checks_recorded(step.recorded_event, step.replayed_event),
        recorded_reason=report.recorded_reason,
        replayed_reason=report.replayed_reason,
        error=report.error if step.replayed is None else None,
    )


# -- which check decided differently ---------------------------------------------------------


def decided_differently(recorded: Event | None, replayed: Event | None) -> str | None:
    """What decided the step otherwise, from two `transition.taken` events: with the `tried`
    lists both record (the edges tried in order, each with its checks and their values), the
    first check whose value (or label) differs, or the first edge tried differently; without
    them, the two transitions, each with its guard. None when there is nothing to compare
    (one side took no transition at that step: the replay ended or went on)."""
    if recorded is None or replayed is None:
        return None
    before, now = _tried(recorded), _tried(replayed)
    both = f"recorded {transition_label(recorded)}, replayed {transition_label(replayed)}"
    if before is None or now is None:
        return f"{both} (no checks recorded to compare)"
    return _first_tried_difference(before, now) or f"{both} (the same checks tried)"


def _checks_recorded(recorded: Event | None, replayed: Event | None) -> bool:
    """Both events record the checks they tried, and those differ somewhere."""
    if recorded is None or replayed is None:
        return False
    before, now = _tried(recorded), _tried(replayed)
    return (
        before is not None and now is not None and _first_tried_difference(before, now) is not None
    )


def _tried(event: Event) -> list[Mapping[str, Any]] | None:
    tried = event.data.get("tried")
    if not isinstance(tried, list):
        return None
    return [t for t in tried if isinstance(t, Mapping)]


def _first_tried_difference(
    before: Sequence[Mapping[str, Any]], now: Sequence[Mapping[str, Any]]
) -> str | None:
    """The first place two lists of tried edges part: an edge tried in place of another, a
    check with another value or label, a check one side evaluated and the other did not."""
    for old, new in zip_longest(before, now):
        if old is None or new is None:
            return _one_sided_edge(old, new)
        if old.get("edge") != new.get("edge"):
            return (
                f"the edge tried: the recorded run tried {_edge(old)} where the replay tried "
                f"{_edge(new)}"
            )
        found = _first_check_difference(old, new)
        if found is not None:
            return found
        if bool(old.get("passed")) != bool(new.get("passed")):
            return f"{_edge(new)}: {_passed(old)} in the recorded run, {_passed(new)} in the replay"
    return None


def _first_check_difference(old: Mapping[str, Any], new: Mapping[str, Any]) -> str | None:
    for was, now in zip_longest(_checks(old), _checks(new)):
        if was == now:
            continue
        where = _edge(new)
        if was is None:
            return f"{_check(now)} on {where} (the recorded run did not check it)"
        if now is None:
            return f"{where}: the recorded run also checked {_check(was)}, the replay did not"
        if was[0] == now[0]:
            was_then, is_now = _value(was[1]), _value(now[1])
            return f"{now[0]} on {where}: {was_then} in the recorded run, {is_now} now"
        return f"{where}: the recorded run checked {_check(was)}, the replay {_check(now)}"
    return None


def _checks(tried: Mapping[str, Any]) -> list[tuple[str, bool]]:
    checks = tried.get("checks") or ()
    return [(str(c.get("check")), bool(c.get("value"))) for c in checks if isinstance(c, Mapping)]


def _one_sided_edge(old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> str:
    if old is None and new is not None:
        return f"{_edge(new)}: the replay tried it too, the recorded run stopped before"
    assert old is not None
    return f"{_edge(old)}: the recorded run tried it, the replay stopped before"


def _edge(tried: Mapping[str, Any]) -> str:
    return f"edge {edge_number(tried.get('edge'))} → {tried.get('target')}"


def _check(check: tuple[str, bool]) -> str:
    return f"{check[0]}: {_value(check[1])}"


def _value(value: bool) -> str:
    return "true" if value else "false"


def _passed(tried: Mapping[str, Any]) -> str:
    return "passed" if tried.get("passed") else "did not pass"


# -- every stored run ------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """One stored run re-decided (its child runs within it)."""

    run_id: str
    workflow: str
    outcome: Literal["identical", "diverged", "unreplayable"]
    transitions: int = 0
    """Transitions compared (the run's and its children's)."""
    children: int = 0
    """Child runs replayed within it (at any depth)."""
    divergence: Divergence | None = None
    why: str | None = None
    """Why it could not be replayed (`unreplayable`)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "workflow": self.workflow,
            "outcome": self.outcome,
            "transitions": self.transitions,
            "children": self.children,
            "divergence": None if self.divergence is None else self.divergence.to_dict(),
            "why": self.why,
        }


def stored_runs(
    store: AnyEventStore, where: RunFilter | None = None, *, since: datetime | None = None
) -> Iterator[RunSummary]:
    """The runs `where` keeps, newest first, a page at a time (keyset paging: a page deep in a
    large store costs what the first one does), down to the first started before `since`."""
    before: str | None = None
    while True:
        page = store.list_runs(limit=PAGE, where=where, before=before)
        for run in page:
            if since is not None and run.started_at < since:
                return
            yield run
        if len(page) < PAGE:
            return
        before = page[-1].run_id


async def replay_all(
    store: AnyEventStore,
    *,
    workflow: WorkflowSpec | None = None,
    since: datetime | None = None,
) -> AsyncIterator[Verdict]:
    """Re-decide the stored runs, one at a time, newest first: without `workflow`, every
    top-level run under the definition it recorded (its child runs are replayed within it);
    with `workflow` (an edited file), the runs of that workflow (the `name:` they recorded is
    its name) under it and its limits, except the child runs of a run of it, which are
    replayed within their parent."""
    where = RunFilter(top_level=True) if workflow is None else RunFilter(workflow=workflow.name)
    sweep = _Sweep(store, workflow)
    for summary in stored_runs(store, where, since=since):
        if workflow is not None and sweep.inside_selected(summary):
            continue
        yield await sweep.verdict(summary)


class _Sweep:
    """What `replay_all` keeps between runs: the edited workflow compiled once, the recorded
    definitions compiled lately (by sha256), and the workflow of each parent looked up."""

    def __init__(self, store: AnyEventStore, workflow: WorkflowSpec | None) -> None:
        self.store = store
        self.edited = None if workflow is None else compile_workflow(workflow)
        self.compiled: dict[str, CompiledWorkflow] = {}
        self.parents: dict[str, str | None] = {}

    def inside_selected(self, summary: RunSummary) -> bool:
        """Whether the run is a child of a run of the same workflow (replayed within it)."""
        parent = summary.parent_run_id
        if not parent:
            return False
        if parent not in self.parents:
            events = self.store.read(parent)
            name = events[0].data.get("workflow") if events else None
            self.parents[parent] = str(name) if name else None
        return self.parents[parent] == summary.workflow

    async def verdict(self, summary: RunSummary) -> Verdict:
        run_id, workflow = summary.run_id, summary.workflow
        if summary.status == "running":  # the store saw a process hold its lock
            why = "still running (a process drives it now): replay it once it ends"
            return Verdict(run_id=run_id, workflow=workflow, outcome="unreplayable", why=why)
        try:
            check = await self._check(summary)
        except Exception as exc:  # one broken run must not stop the sweep: it is reported
            logger.debug("replay of %s failed", run_id, exc_info=True)
            why = str(exc) if isinstance(exc, FsmKernelError) else f"{type(exc).__name__}: {exc}"
            return Verdict(run_id=run_id, workflow=workflow, outcome="unreplayable", why=why)
        return Verdict(
            run_id=run_id,
            workflow=workflow,
            outcome="identical" if check.divergence is None else "diverged",
            transitions=_transitions(check.report),
            children=_children(check.report),
            divergence=check.divergence,
        )

    async def _check(self, summary: RunSummary) -> RunCheck:
        run = RecordedRun.load(self.store, summary.run_id)
        if self.edited is not None:
            workflow, limits = self.edited, self.edited.spec.limits
        else:
            workflow, limits = self._recorded(run), None
        # A child replayed on its own draws on the calls its map had left, as within its parent.
        drawn = run.terminated.data.get("shared_calls") if run.terminated else None
        draw_on(None if drawn is None or not run.parent_run_id else CallPool(int(drawn)))
        try:
            return await check_run(workflow, self.store, run.run_id, limits=limits)
        finally:
            draw_on(None)

    def _recorded(self, run: RecordedRun) -> CompiledWorkflow:
        digest = run.definition[0] or ""
        compiled = self.compiled.get(digest) if digest else None
        if compiled is None:
            compiled = compile_workflow(recorded_spec(run))
            if digest:
                if len(self.compiled) >= _COMPILED_KEPT:
                    self.compiled.pop(next(iter(self.compiled)))
                self.compiled[digest] = compiled
        return compiled


def recorded_spec(run: RecordedRun) -> WorkflowSpec:
    """The definition the run follows: the text it recorded (run.started, or the run.resumed
    that moved it), as if at its recorded path; for a log an older fsm-kernel wrote, the file
    at its recorded path, if that still has the recorded sha256.

    Raises:
        Unreplayable: no text, and no file with the recorded content.
        WorkflowError: the recorded definition no longer loads (e.g. a guard it names is gone).
    """
    try:
        found = recorded_workflow(run)
    except ResumeError as exc:
        raise Unreplayable(exc.message) from None
    if isinstance(found, WorkflowSpec):
        return found
    digest, path = run.definition[0], found
    spec = load_spec(path)
    if digest and spec.content_hash != digest:
        raise Unreplayable(
            f"run {run.run_id} recorded no workflow text and its file {path} changed since "
            f"(sha256 {digest[:12]} → {spec.content_hash[:12]}): replay it with --workflow"
        )
    return spec


def _transitions(report: ReplayReport) -> int:
    return len(report.steps) + sum(_transitions(child) for child in report.children)


def _children(report: ReplayReport) -> int:
    return sum(1 + _children(child) for child in report.children)


# -- coverage --------------------------------------------------------------------------------


def workflow_coverage(
    store: AnyEventStore, spec: WorkflowSpec, *, since: datetime | None = None
) -> HeatOverlay:
    """The stored runs of `spec`'s workflow (every run that recorded its name, child runs
    included), each read once and folded into one HeatOverlay: how often each edge of `spec`
    fired, how the runs ended, the tokens spent in each state."""
    from fsm_kernel.diagram import HeatOverlay

    heat = HeatOverlay(workflow=spec.name)
    for summary in stored_runs(store, RunFilter(workflow=spec.name), since=since):
        heat.add_run(spec, store.read(summary.run_id))
    return heat
