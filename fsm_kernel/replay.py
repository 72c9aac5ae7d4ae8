"""Resume and replay, both built on one idea: re-drive the workflow from the start of the run
with the model's answers and the tools' outputs served from the event log.

- resume: when the log runs out, the real model and tools take over and recording goes live, so
  the run continues from its last recorded step (the step in flight at a crash is redone).
- replay: nothing live at all (no network, no tool side effects); the transitions taken are
  compared, step by step, with the recorded ones.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from fsm_kernel import errors
from fsm_kernel.errors import (
    AgentError,
    AnswerError,
    ReplayDivergenceError,
    ResumeError,
    RunNotFoundError,
)
from fsm_kernel.kernel import Kernel, RunResult
from fsm_kernel.protocol import (
    LIVE_ONLY_EVENTS,
    ChatModel,
    Completion,
    Event,
    EventStore,
    EventType,
    Message,
    Tool,
    ToolCall,
    ToolExecutor,
    ToolResult,
)
from fsm_kernel.recorder import RunRecorder
from fsm_kernel.workflow.children import CallPool, ChildRequest, ChildResult, draw_on
from fsm_kernel.workflow.compiler import CompiledWorkflow, compile_workflow
from fsm_kernel.workflow.deadlines import recorded_deadlines
from fsm_kernel.workflow.human import AnsweringChannel, HumanAnswer, kind_text
from fsm_kernel.workflow.loader import find_workflow, load_workflow
from fsm_kernel.workflow.migrations import Translation, translate_log
from fsm_kernel.workflow.output import as_json
from fsm_kernel.workflow.spec import Limits

__all__ = [
    "RecordedChatModel",
    "RecordedRun",
    "RecordedToolExecutor",
    "ReplayChildren",
    "ReplayReport",
    "ReplayStep",
    "recorded_conversation",
    "replay_run",
    "resume_run",
    "transition_label",
]

logger = logging.getLogger(__name__)

_CONFIG_KEYS = ("settings", "limits", "system_prompt")
"""What `run.started` records of how the run runs, and `run.resumed` may change."""
_NOT_REPRODUCED = LIVE_ONLY_EVENTS | {
    EventType.RUN_STARTED,
    EventType.RUN_RESUMED,
    EventType.RUN_SUSPENDED,
}
"""What a re-drive does not record again: the run's markers (started, resumed, suspended
until an answer: a re-drive with the answer goes past that point) and the live model's
failures."""
_RECOVERED = (EventType.ACTION_FAILED, EventType.ERROR_CAUGHT)
"""The events of a failure a state's `retry:` or `catch:` handled."""
_EXTERNAL_ENDINGS = frozenset({"timeout", "cancelled"})
"""Endings decided by the clock or the user, not by the workflow: a replay (which takes no
time) reproduces the steps recorded before them and reports the recorded ending."""


class _Served:
    """The recorded model outcomes a re-drive serves in order, shared by the models of all
    states (the log holds one sequence of calls, whichever state made them)."""

    def __init__(self, outcomes: Sequence[Completion | AgentError]) -> None:
        self.queue = list(outcomes)
        self.count = 0


class RecordedChatModel:
    """Serves the recorded model outcomes in order: answers, and the failures a state's
    `retry:` or `catch:` handled (raised again, so the re-drive retries or catches where the
    run did); then the live model, if there is one, or the recorded failure that ended the run
    (a replay of an `agent_error` run fails where the run did)."""

    def __init__(
        self,
        completions: Sequence[Completion | AgentError],
        live: ChatModel | None = None,
        *,
        failure: AgentError | None = None,
    ) -> None:
        self._served = _Served(completions)
        self.live = live
        self.failure = failure

    @property
    def served(self) -> int:
        """Recorded outcomes served so far (by this model and those sharing its log)."""
        return self._served.count

    def sharing(self, live: ChatModel | None) -> RecordedChatModel:
        """A model serving from the same recorded outcomes, then handing over to `live` (the
        live model of a state with its own `agent:` block)."""
        twin = RecordedChatModel((), live, failure=self.failure)
        twin._served = self._served
        return twin

    async def complete(
        self, messages: Sequence[Message], tools: Sequence[Tool], **options: Any
    ) -> Completion:
        if self._served.queue:
            self._served.count += 1
            outcome = self._served.queue.pop(0)
            if isinstance(outcome, AgentError):
                raise outcome
            return outcome
        if self.live is None:
            if self.failure is not None:
                raise self.failure
            raise ReplayDivergenceError(
                "the workflow asked the model more often than the recorded run did"
            )
        return await self.live.complete(messages, tools, **options)


class RecordedToolExecutor:
    """Serves recorded tool results by call id; re-executes calls the log has no result for."""

    def __init__(
        self,
        results: dict[str, ToolResult],
        live: ToolExecutor | None = None,
        *,
        unfinished: dict[str, int] | None = None,
    ) -> None:
        self.results = results
        self.live = live
        self.unfinished = unfinished or {}

    def list_tools(self, names: Sequence[str] | None = None) -> list[Tool]:
        if self.live is not None:
            return self.live.list_tools(names)
        return [Tool(name=n) for n in names or ()]

    async def execute(self, call: ToolCall) -> ToolResult:
        if call.id in self.results:
            return self.results[call.id]
        if self.live is None:
            raise ReplayDivergenceError(
                f"the workflow called tool {call.name!r} (id {call.id}) that the recorded run "
                "did not"
            )
        if call.id in self.unfinished:
            logger.warning(
                "re-executing tool %s (call %s): it started at seq %d but no result was recorded",
                call.name,
                call.id,
                self.unfinished[call.id],
            )
        return await self.live.execute(call)


@dataclass
class RecordedRun:
    """What the log holds of a run."""

    run_id: str
    events: list[Event]
    started: Event
    terminated: Event | None
    completions: list[Completion | AgentError] = field(default_factory=list)
    """The model's outcomes in order: its answers, and the failures the run recovered from
    (retried or caught)."""
    results: dict[str, ToolResult] = field(default_factory=dict)
    unfinished: dict[str, int] = field(default_factory=dict)
    answers: list[HumanAnswer] = field(default_factory=list)
    """A person's recorded answers, in order."""
    waiting_for: dict[str, Any] | None = None
    """What the run waits for, when its log ends suspended (see `status`)."""
    action_failures: dict[tuple[str, int, int], Exception] = field(default_factory=dict)
    """Failures of actions (other than the model's) the run retried or caught, by (state,
    visit, attempt): a re-drive raises them instead of running the action again."""
    handled: set[int] = field(default_factory=set)
    """The seqs of `model.failed` events the run recovered from: a re-drive reproduces them."""
    children: list[str] = field(default_factory=list)
    """The ids of its child runs (workflow.call, workflow.map), in the order it started them."""

    @classmethod
    def load(
        cls, store: EventStore, run_id: str, *, migrating: Translation | None = None
    ) -> RecordedRun:
        """The run's log, read under the definition it follows now (the translations of the
        migrations it went through applied; `migrating`, one about to be made, on top)."""
        run_id = store.find_run(run_id)
        events = translate_log(store.read(run_id), migrating)
        if not events or events[0].type != EventType.RUN_STARTED:
            raise RunNotFoundError(f"run {run_id} has no run.started event", run_id=run_id)
        run = cls(run_id, events, events[0], None)
        started: dict[str, int] = {}
        failed: Event | None = None  # the last model failure, until it is known to be handled
        for e in events:
            if e.type in _RECOVERED:
                run._recovered(e, failed)
            if e.type in (EventType.MODEL_FAILED, *_RECOVERED, EventType.MODEL_REQUESTED):
                failed = e if e.type == EventType.MODEL_FAILED else None
            if e.type == EventType.MODEL_RESPONDED:
                run.completions.append(Completion.from_dict(e.data["completion"]))
            elif e.type == EventType.TOOL_STARTED:
                started[e.data["call"]["id"]] = e.seq
            elif e.type == EventType.CHILD_STARTED:
                run.children.append(str(e.data["run_id"]))
            elif e.type == EventType.TOOL_FINISHED and not e.data.get("malformed"):
                run.results[e.data["call"]["id"]] = ToolResult.from_dict(e.data["result"])
            else:
                run._person_or_life_cycle(e)
        run.unfinished = {cid: seq for cid, seq in started.items() if cid not in run.results}
        return run

    def _person_or_life_cycle(self, e: Event) -> None:
        """A person's answer, or where the run stands: suspended, ended, reopened."""
        if e.type == EventType.HUMAN_ANSWERED:
            self.answers.append(HumanAnswer.from_dict(e.data))
        elif e.type == EventType.EVENT_DELIVERED:  # answers too: served in order on a re-drive
            self.answers.append(HumanAnswer.from_dict({"kind": "event", **e.data}))
        elif e.type == EventType.TIMER_FIRED and e.data.get("step") is None:
            # a waiting state's timer (a compound state's deadline fired between steps: its
            # `step` places it, see recorded_deadlines)
            self.answers.append(HumanAnswer.timer_fired(int(e.data["edge"])))
        elif e.type == EventType.RUN_SUSPENDED:
            self.waiting_for = dict(e.data.get("waiting_for") or {})
        elif e.type == EventType.RUN_TERMINATED:
            self.terminated, self.waiting_for = e, None
        elif e.type == EventType.RUN_RESUMED:
            # a resumable ending (agent_error) or a suspension that a resume reopened
            self.terminated, self.waiting_for = None, None

    def _recovered(self, event: Event, model_failed: Event | None) -> None:
        """A failure a state retried or caught: the model's (its `model.failed` just before)
        joins the model's outcomes; any other is kept to be raised where the action ran."""
        data = event.data
        if data.get("kind") == "agent_error" and model_failed is not None:
            self.completions.append(_agent_error(model_failed.data.get("error") or data["error"]))
            self.handled.add(model_failed.seq)
            return
        attempt = int(data.get("attempt", data.get("attempts", 1)))
        where = (str(event.state), int(data.get("visit", 1)), attempt)
        self.action_failures[where] = _action_error(data.get("kind"), data.get("error") or {})

    def refuse_if_ended(self, action: str = "resumed", detail: str = "") -> None:
        """Raise ResumeError when the run ended for good (`detail` is added to why).

        Raises:
            ResumeError: it ended, and not because its model server failed.
        """
        if self.resumable:
            return
        reason = self.terminated.data.get("reason") if self.terminated else None
        raise ResumeError(
            f"run {self.run_id} already terminated ({reason}){detail}; only a killed run, a run "
            "that waits for a person or an event, or one that ended because the model server "
            f"could not be reached can be {action}",
            run_id=self.run_id,
        )

    @property
    def goal(self) -> str:
        return str(self.started.data.get("goal", ""))

    @property
    def parent_run_id(self) -> str | None:
        """The run that started this one as its child (workflow.call, workflow.map), if any."""
        value = self.started.data.get("parent_run_id")
        return str(value) if value else None

    @property
    def engine(self) -> str | None:
        """The engine whose workflow drives this run (`settings.engine.name` in its
        `run.started`, e.g. "dbos"; a child of such a run records it too), or None: fsm-kernel
        itself."""
        settings = self.started.data.get("settings")
        engine = settings.get("engine") if isinstance(settings, dict) else None
        name = engine.get("name") if isinstance(engine, dict) else None
        return str(name) if name else None

    def root_run_id(self, store: EventStore) -> str:
        """The run at the top of this run's chain of parents (itself when it has none): the
        one an engine such as DBOS drives, a child run being a step of it."""
        run = self
        while run.parent_run_id:
            run = RecordedRun.load(store, run.parent_run_id)
        return run.run_id

    @property
    def continues(self) -> str | None:
        """The run whose conversation this one continues (`run --continue`), if any."""
        value = self.started.data.get("continues")
        return str(value) if value else None

    def history(self, store: EventStore) -> list[Message]:
        """The conversation this run began with: the one it continues, rebuilt from the log
        (or the messages `run.started` recorded)."""
        if self.continues:
            return recorded_conversation(store, self.continues)
        return [Message.from_dict(m) for m in self.started.data.get("history") or ()]

    @property
    def status(self) -> str:
        """`waiting` (for a person), `running` (in flight, or killed) or `ended`."""
        if self.waiting_for is not None:
            return "waiting"
        return "running" if self.terminated is None else "ended"

    @property
    def resumable(self) -> bool:
        """Killed (no ending), or ended by a model server that could not be reached or kept
        failing: the run can go on from its last completed step."""
        return self.terminated is None or bool(self.terminated.data.get("resumable"))

    @property
    def definition(self) -> tuple[str | None, str | None]:
        """(sha256, text) of the workflow the run follows now (see recorded_definition)."""
        digest, text, _ = recorded_definition(self.events)
        return digest, text

    def config(self) -> dict[str, Any]:
        """What the run last ran with: `run.started`'s settings (server, model, timeouts,
        retries, workspace, tools), limits and system prompt, updated by each `run.resumed`."""
        config = {k: self.started.data.get(k) for k in _CONFIG_KEYS}
        for e in self.events:
            if e.type == EventType.RUN_RESUMED:
                config.update({k: e.data[k] for k in _CONFIG_KEYS if e.data.get(k) is not None})
        return config

    def replayable_events(self) -> list[Event]:
        """The events a re-drive reproduces: everything but the run's start/resume markers and
        the endings a resume reopened (with the failed iteration that led to each)."""
        out: list[Event] = []
        for e in self.events:
            if e.type in _NOT_REPRODUCED and e.seq not in self.handled:
                continue
            if e.type == EventType.RUN_TERMINATED and e is not self.terminated:
                if out and out[-1].type == EventType.ITERATION_COMPLETED:
                    if out[-1].data.get("decision") == "failed":
                        out.pop()
                continue
            out.append(e)
        return out

    def transitions(self) -> list[Event]:
        return [e for e in self.events if e.type == EventType.TRANSITION_TAKEN]


async def resume_run(
    kernel: Kernel,
    store: EventStore,
    run_id: str,
    *,
    force: bool = False,
    overrides: Mapping[str, Any] | None = None,
    answer: HumanAnswer | None = None,
    migrating: Translation | None = None,
) -> RunResult:
    """Continue a run from its last recorded step: one that was killed, one that ended
    because the model server could not be reached or kept failing (a resumable `agent_error`),
    or one suspended until a person answers (`answer`, recorded as `human.answered`).

    Build `kernel` from the run's recorded settings (`RecordedRun.config`); `overrides` (what the
    caller changed, e.g. the flags given to `fsm-kernel resume`) are recorded in `run.resumed`.
    `migrating` (see `migration_check`) moves the run onto `kernel`'s definition under new state
    names and edge numbers; it is recorded in `run.resumed`, so later reads translate the log.

    Raises:
        RunNotFoundError: no such run.
        RunLockedError: another process (or task) is running or resuming it.
        ResumeError: it already terminated, or its workflow file changed (unless `force`).
        AnswerError: it waits for a person and `answer` is missing or of the wrong kind, or
            `answer` was given for a run that waits for nobody.
    """
    with store.lock_run(store.find_run(run_id)):  # before reading: two resumes cannot both start
        return await _resume_locked(
            kernel,
            store,
            run_id,
            force=force,
            overrides=overrides or {},
            answer=answer,
            migrating=migrating,
        )


def check_answer(
    run: RecordedRun, answer: HumanAnswer | None, *, now: datetime | None = None
) -> HumanAnswer | None:
    """An answer is given exactly when the run waits for one, and of the kind it waits for;
    an approval answers the call the run showed (`waiting_for`), which must be the call its
    log asks about. Returns the answer bound to that call (see `HumanAnswer.bound_to`).
    A run waiting for an event takes one it awaits, before its timer is due, or no answer
    once the timer is due (`now`: the run's clock; without it the due time is not checked).

    Raises:
        AnswerError: otherwise, naming what the run waits for and how to answer.
    """
    waiting = run.waiting_for
    if waiting is None:
        if answer is not None:
            raise AnswerError(
                f"run {run.run_id} does not wait for a person ({run.status}); resume it "
                f"without {answer.flag}",
                run_id=run.run_id,
            )
        return None
    kind = str(waiting.get("kind"))
    if kind == "event":
        return _check_event(run, waiting, answer, now)
    if answer is None or answer.kind != kind:
        given = "no answer" if answer is None else answer.flag
        raise AnswerError(
            f"run {run.run_id} waits for {kind_text(kind)} {_question_text(waiting)}; "
            f"{given} given",
            run_id=run.run_id,
        )
    shown = waiting.get("tool_call")
    if not isinstance(shown, Mapping):
        return answer
    if not answer.answers(shown):
        given_for = (
            "the same call with other arguments"
            if answer.tool_call_id == str(shown.get("id"))
            else f"call {answer.tool_call_id}"
        )
        raise AnswerError(
            f"run {run.run_id} waits for approval {_question_text(waiting)} (call "
            f"{shown.get('id')}); this {answer.flag} was given for {given_for}: refused, "
            "nothing was run",
            run_id=run.run_id,
        )
    answer = answer.bound_to(shown)
    if not waiting.get("child_run_id"):  # a child's log holds its calls: its resume checks
        _check_asked(run, shown, answer)
    return answer


def _check_event(
    run: RecordedRun, waiting: Mapping[str, Any], answer: HumanAnswer | None, now: datetime | None
) -> HumanAnswer | None:
    """An event the waiting state awaits, given before its timer is due; or none (a resume)
    once the timer is due."""
    events = [str(e) for e in waiting.get("events") or ()]
    due_text = waiting.get("due")
    due = datetime.fromisoformat(str(due_text)) if due_text else None
    is_due = due is not None and now is not None and due <= now
    where = f"in state {waiting.get('state')!r}"
    awaited = ", ".join(events) or "no event"
    if answer is None:
        if is_due or (due is not None and now is None):
            return None
        later = f"; its timer is due at {due_text}" if due_text else ""
        raise AnswerError(
            f"run {run.run_id} waits for an event {where} ({awaited}){later}: deliver one "
            f"with fsm-kernel signal {run.run_id} NAME, or resume it once the timer is due",
            run_id=run.run_id,
        )
    if answer.kind != "event" or answer.event not in events:
        given = answer.flag if answer.kind != "event" else f"event {answer.event!r}"
        raise AnswerError(
            f"run {run.run_id} waits {where} for {awaited}, not {given}: refused, nothing "
            "was recorded",
            run_id=run.run_id,
        )
    if is_due:
        raise AnswerError(
            f"run {run.run_id}'s timer {where} was due at {due_text}, before this event: "
            f"resume it (the timer fires); event {answer.event!r} refused, nothing was recorded",
            run_id=run.run_id,
        )
    return answer


def _check_asked(run: RecordedRun, shown: Mapping[str, Any], answer: HumanAnswer) -> None:
    """The call a run showed for approval is the one its log asks about: the call of that id
    in its model's recorded replies, with the same name and the arguments `answer` (bound to
    the call shown) approves."""
    call_id = str(shown.get("id"))
    asked = next(
        (
            call
            for outcome in reversed(run.completions)
            if isinstance(outcome, Completion)
            for call in outcome.message.tool_calls
            if call.id == call_id
        ),
        None,
    )
    if asked is None or asked.name != shown.get("name") or not answer.answers(asked):
        found = "no such call" if asked is None else f"{asked.name}({_cut(asked.arguments_json())})"
        raise AnswerError(
            f"run {run.run_id} showed {shown.get('name')} call {call_id} for approval, but its "
            f"log now asks about {found}: the log was changed after the run suspended; "
            f"{answer.flag} refused, nothing was run",
            run_id=run.run_id,
        )


def _cut(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _question_text(waiting: Mapping[str, Any]) -> str:
    call = waiting.get("tool_call")
    if isinstance(call, Mapping):
        arguments = json.dumps(call.get("arguments"), ensure_ascii=False, sort_keys=True)
        return f"of {call.get('name')}({arguments}) in state {waiting.get('state')!r}"
    return f"to {str(waiting.get('prompt') or '')!r} in state {waiting.get('state')!r}"


async def _resume_locked(
    kernel: Kernel,
    store: EventStore,
    run_id: str,
    *,
    force: bool,
    overrides: Mapping[str, Any],
    answer: HumanAnswer | None,
    migrating: Translation | None = None,
) -> RunResult:
    run = RecordedRun.load(store, run_id, migrating=migrating)
    run.refuse_if_ended()
    answer = check_answer(run, answer, now=kernel.clock.now())  # bound to the call shown
    reopened, run.terminated = run.terminated, None
    recorded_hash = run.definition[0]  # the last definition it ran under
    new_hash = kernel.spec.content_hash
    if recorded_hash != new_hash and not force:
        raise ResumeError(
            f"the workflow changed since run {run.run_id} started (sha256 {str(recorded_hash)[:12]}"
            f" → {new_hash[:12]}); resume with --force to continue under the new file",
            run_id=run.run_id,
        )
    for call_id, seq in run.unfinished.items():
        logger.warning(
            "tool call %s started (seq %d) without a result: it will run again", call_id, seq
        )
    next_seq = max(e.seq for e in run.events) + 1
    resumed: dict[str, Any] = {
        "workflow_hash": new_hash,
        "forced": recorded_hash != new_hash,
        "workflow_text": (kernel.spec.text or None) if recorded_hash != new_hash else None,
        "workflow_version": kernel.spec.version,
        "settings": kernel.settings,
        "limits": kernel.limits.model_dump(),
        "system_prompt": kernel.system_prompt,
        "overrides": dict(overrides),
        "reopened": reopened.data.get("reason")
        if reopened is not None
        else ("waiting" if run.waiting_for is not None else None),
        "rerun_tool_calls": sorted(run.unfinished),
        "translation": migrating.to_dict() if migrating else None,
        "iteration": max((e.iteration for e in run.events), default=0),
    }
    watchers = (kernel.on_event,) if kernel.on_event is not None else ()
    marker = RunRecorder(
        run.run_id, store, clock=kernel.clock, next_seq=next_seq, watchers=watchers
    )
    marker.record(EventType.RUN_RESUMED, resumed)
    await marker.flush()
    recorder = RunRecorder(
        run.run_id,
        store,
        clock=kernel.clock,
        expected=run.replayable_events(),
        next_seq=next_seq + 1,
        watchers=watchers,
    )
    # This run's own collaborators: recorded answers first, then the kernel's live ones (each
    # state's own model for the states with an `agent:` block).
    model = RecordedChatModel(run.completions, kernel.model)
    ctx = kernel.new_context(
        run.run_id,
        run.goal,
        recorder,
        model=model,
        tools=RecordedToolExecutor(run.results, kernel.tools, unfinished=run.unfinished),
        human=AnsweringChannel(run.answers, given=answer, live=kernel.human),
        state_models={sid: model.sharing(live) for sid, live in kernel.state_models.items()},
        recorded_failures=run.action_failures,
        history=run.history(store),
        recorded_children=run.children,
        recorded_deadlines=recorded_deadlines(run.events),
    )
    machine = kernel.workflow.instantiate(ctx)
    recorder.state = machine.state
    recorder.record(EventType.STATE_ENTERED, machine.entered_data())
    return await kernel.drive(ctx, machine, recorder)


@dataclass(frozen=True)
class ReplayStep:
    step: int
    iteration: int
    recorded: str | None
    replayed: str | None
    recorded_event: Event | None = field(default=None, compare=False, repr=False)
    """The recorded `transition.taken` (its `tried` says which checks decided), if any."""
    replayed_event: Event | None = field(default=None, compare=False, repr=False)
    """The replay's `transition.taken` at this step, if any."""

    @property
    def same(self) -> bool:
        return self.recorded == self.replayed

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "iteration": self.iteration,
            "recorded": self.recorded,
            "replayed": self.replayed,
            "same": self.same,
        }


@dataclass
class ReplayReport:
    run_id: str
    steps: list[ReplayStep]
    recorded_reason: str | None
    replayed_reason: str
    model_calls: int
    error: str | None = None
    recorded_output: Any = None
    """The structured output the run ended with (JSON data), None without one."""
    replayed_output: Any = None
    """The structured output the replay ended with, parsed again from the recorded answers."""
    children: list[ReplayReport] = field(default_factory=list)
    """The replays of its child runs, in the order it started them."""

    @property
    def identical(self) -> bool:
        if not all(s.same for s in self.steps):
            return False
        if not all(child.identical for child in self.children):
            return False
        if self.recorded_reason is None or self.recorded_reason in _EXTERNAL_ENDINGS:
            return True  # killed, timed out, cancelled: the recorded steps are what counts
        return (
            self.recorded_reason == self.replayed_reason
            and self.recorded_output == self.replayed_output
        )

    @property
    def first_divergence(self) -> ReplayStep | None:
        return next((s for s in self.steps if not s.same), None)

    def to_dict(self) -> dict[str, Any]:
        first = self.first_divergence
        return {
            "run_id": self.run_id,
            "identical": self.identical,
            "first_divergence": first.to_dict() if first else None,
            "recorded_reason": self.recorded_reason,
            "replayed_reason": self.replayed_reason,
            "model_calls_served": self.model_calls,
            "steps": [s.to_dict() for s in self.steps],
            "error": self.error,
            "recorded_output": self.recorded_output,
            "replayed_output": self.replayed_output,
            "children": [child.to_dict() for child in self.children],
        }


def _label(event: Event) -> str:
    d = event.data
    guard = f" [{d['guard']}]" if d.get("guard") else ""
    reason = f" → {d['reason']}" if d.get("reason") else ""
    # full paths where recorded (compound states): which state the run left and entered
    return f"{d.get('from') or d['source']} → {d.get('to') or d['target']}{guard}{reason}"


def transition_label(event: Event) -> str:
    """A `transition.taken` as one line, as replay prints it: `think → act [has_tool_calls]`."""
    return _label(event)


async def replay_run(
    workflow: CompiledWorkflow,
    store: EventStore,
    run_id: str,
    *,
    limits: Limits | None = None,
    migrating: Translation | None = None,
) -> ReplayReport:
    """Re-run `workflow` on the recorded answers (no model, no tools) and compare transitions.

    `limits` default to the ones the run last ran under (its log), so the replay reproduces it;
    a what-if with an edited workflow passes that workflow's own. Its child runs are replayed
    too, each with the workflow its log names (`report.children`). `migrating` reads the log
    under a migration's new state names and edge numbers (see `migration_check`)."""
    report, _ = await _replay(workflow, store, run_id, limits, migrating)
    return report


class ReplayChildren:
    """A replay's child runs: each replayed from its own log (its workflow file as its
    `run.started` names it), nothing live."""

    def __init__(self, store: EventStore) -> None:
        self.store = store
        self.reports: dict[int, ReplayReport] = {}
        self._asked = 0
        self._compiled: dict[str, CompiledWorkflow] = {}

    async def run(self, request: ChildRequest) -> ChildResult:
        order = self._asked
        self._asked += 1
        try:
            child = RecordedRun.load(self.store, request.run_id)
        except RunNotFoundError:
            raise ReplayDivergenceError(
                f"the workflow started a child run ({request.run_id}) that the recorded run "
                "never ran"
            ) from None
        path = str(child.started.data.get("workflow_path") or request.workflow)
        workflow = self._compiled.get(path)
        if workflow is None:  # once per file: a map's children share it
            spec = load_workflow(find_workflow(path, relative_to=request.caller))
            workflow = self._compiled[path] = compile_workflow(spec)
        drawn = child.terminated.data.get("shared_calls") if child.terminated else None
        draw_on(None if drawn is None else CallPool(int(drawn)))  # refused where it was
        report, result = await _replay(workflow, self.store, child.run_id, None)
        self.reports[order] = report
        return result.as_child()


async def _replay(
    workflow: CompiledWorkflow,
    store: EventStore,
    run_id: str,
    limits: Limits | None,
    migrating: Translation | None = None,
) -> tuple[ReplayReport, RunResult]:
    run = RecordedRun.load(store, run_id, migrating=migrating)
    children = ReplayChildren(store)
    model = RecordedChatModel(run.completions, failure=_recorded_failure(run))
    config = run.config()
    recorded = config.get("limits")
    settings = run.started.data.get("settings", {})
    kernel = Kernel(
        workflow,
        model=model,
        system_prompt=str(config.get("system_prompt") or ""),  # the requests as they were made
        tools=RecordedToolExecutor(run.results),
        tool_names=settings.get("tools"),
        limits=limits or (Limits.model_validate(recorded) if recorded else None),
        human=AnsweringChannel(run.answers),  # then it suspends where the run did
        approval_required=frozenset(settings.get("approval") or ()),
        sleep=_no_wait,  # a replay takes no time: a retry's backoff is not waited for
        children=children,
        await_timers=0,  # nor fires a timer the run did not: it suspends where the run did
    )
    result = await kernel.run(
        run.goal,
        run_id=run.run_id,
        recorded_failures=run.action_failures,
        history=run.history(store),
        continues=run.continues,
        parent_run_id=run.parent_run_id,
        recorded_children=run.children,
        recorded_deadlines=recorded_deadlines(run.events),
    )
    replayed = [e for e in result.events if e.type == EventType.TRANSITION_TAKEN]
    recorded = run.transitions()
    recorded_reason = run.terminated.data.get("reason") if run.terminated else None
    external = recorded_reason is None or recorded_reason in _EXTERNAL_ENDINGS
    if external:  # killed, timed out or cancelled: compare the part that was recorded
        replayed = replayed[: len(recorded)]
    steps = []
    for i in range(max(len(recorded), len(replayed))):
        rec = recorded[i] if i < len(recorded) else None
        rep = replayed[i] if i < len(replayed) else None
        anchor = rec or rep
        steps.append(
            ReplayStep(
                step=i + 1,
                iteration=anchor.iteration if anchor else 0,
                recorded=_label(rec) if rec else None,
                replayed=_label(rep) if rep else None,
                recorded_event=rec,
                replayed_event=rep,
            )
        )
    report = ReplayReport(
        run.run_id,
        steps,
        recorded_reason,
        recorded_reason
        if external and recorded_reason
        else str(result.termination_reason or result.status),
        model.served,
        result.error,
        recorded_output=run.terminated.data.get("output") if run.terminated else None,
        replayed_output=as_json(result.output),
        children=[children.reports[i] for i in sorted(children.reports)],
    )
    return report, result


async def _no_wait(_seconds: float) -> None:
    return None


def _agent_error(data: Mapping[str, Any]) -> AgentError:
    """The AgentError a `model.failed` event recorded (its class and attributes), to raise
    again."""
    cls = getattr(errors, str(data.get("type", "")), None)
    if not (isinstance(cls, type) and issubclass(cls, AgentError)):
        cls = AgentError
    error = cls.__new__(cls)
    message = str(data.get("message") or "the model server failed")
    errors.FsmKernelError.__init__(error, message)
    error.base_url = ""
    error.__dict__.update({k: v for k, v in data.items() if k not in ("type", "message")})
    return error


def _action_error(kind: object, data: Mapping[str, Any]) -> Exception:
    """A recorded failure of an action, as an exception of the recorded class name."""
    message = str(data.get("message") or "")
    if kind == "agent_error":
        return _agent_error(data)
    name = str(data.get("type") or "Exception")
    recorded: type[Exception] = type(name, (Exception,), {"__module__": __name__})
    return recorded(message)


def _recorded_failure(run: RecordedRun) -> AgentError | None:
    """The model failure that ended the run, to fail the replay at the same call."""
    ended = run.terminated
    if ended is None or ended.data.get("reason") != "agent_error":
        return None
    return AgentError(str(ended.data.get("error") or "the model server failed"))


def recorded_conversation(store: EventStore, run_id: str) -> list[Message]:
    """A run's whole conversation, as its model saw it last, rebuilt from the log alone: the
    conversations it continues (`run.started`'s `continues`, followed back to the first run),
    then its prompt, the messages it added, the model's replies and the tools' results (each
    reply's results in the order of its calls, as the run gave them to the model).

    Raises:
        RunNotFoundError: a run of the chain is not in the store.
    """
    chain: list[list[Event]] = []
    seen: set[str] = set()
    next_id: str | None = store.find_run(run_id)
    while next_id is not None:  # back to the first run (no recursion: chats get long)
        if next_id in seen:
            raise ResumeError(f"run {next_id} continues itself", run_id=next_id)
        seen.add(next_id)
        events = store.read(next_id)
        if not events or events[0].type != EventType.RUN_STARTED:
            raise RunNotFoundError(f"run {next_id} has no run.started event", run_id=next_id)
        chain.append(events)
        previous = events[0].data.get("continues")
        next_id = str(previous) if previous else None
    messages: list[Message] = []
    for events in reversed(chain):
        started = events[0].data
        messages.extend(Message.from_dict(m) for m in started.get("history") or ())
        messages.append(Message.user(str(started.get("goal", ""))))
        messages.extend(_conversation_of(events))
    return messages


def _conversation_of(events: Sequence[Event]) -> list[Message]:
    out: list[Message] = []
    order: dict[str, int] = {}  # the call ids of the last reply, in its order
    pending: list[Message] = []  # tool results after that reply, as recorded
    for e in events:
        if e.type == EventType.TOOL_FINISHED:
            call = ToolCall.from_dict(e.data["call"])
            pending.append(Message.tool(call, ToolResult.from_dict(e.data["result"])))
            continue
        if e.type not in (EventType.MESSAGE_ADDED, EventType.MODEL_RESPONDED):
            continue
        out.extend(sorted(pending, key=lambda m: order.get(m.tool_call_id or "", len(order))))
        pending = []
        if e.type == EventType.MESSAGE_ADDED:
            out.append(Message.from_dict(e.data["message"]))
        else:
            message = Completion.from_dict(e.data["completion"]).message
            order = {c.id: i for i, c in enumerate(message.tool_calls)}
            out.append(message)
    out.extend(sorted(pending, key=lambda m: order.get(m.tool_call_id or "", len(order))))
    return out


def recorded_definition(events: Sequence[Event]) -> tuple[str | None, str | None, Any]:
    """(sha256, text, version) of the workflow a run follows now: `run.started`'s, or the file
    a `resume --force` moved it to (that run.resumed records the new text). The text is None
    for a log an older fsm-kernel wrote: the file on disk is checked against the hash."""
    digest: str | None = None
    text: str | None = None
    version: Any = None
    for e in events:
        if e.type not in (EventType.RUN_STARTED, EventType.RUN_RESUMED):
            continue
        if e.type == EventType.RUN_RESUMED and "workflow_hash" not in e.data:
            continue  # a resume that recorded no definition (older logs) kept the run's own
        recorded, new = e.data.get("workflow_text"), e.data.get("workflow_hash")
        if isinstance(recorded, str) and recorded:
            text, version = recorded, e.data.get("workflow_version")
        elif new != digest:
            text, version = None, None
        digest = new if isinstance(new, str) else None
    return digest, text, version


def pinning(events: Sequence[Event], *, may_read: Callable[[Path], bool]) -> dict[str, Any]:
    """Which definition a run follows (the version and sha256 it last recorded) and what the
    file at its recorded path says now (read only when `may_read(path)`), with a line saying
    so: "pinned to version 1 (sha256 …); the file now says version 2 (sha256 …)"."""
    digest, _, version = recorded_definition(events)
    path = events[0].data.get("workflow_path") if events else None
    now = _file_now(Path(path)) if isinstance(path, str) and may_read(Path(path)) else None
    out: dict[str, Any] = {"version": version, "workflow_hash": digest}
    out["file_version"], out["file_hash"] = now if now is not None else (None, None)
    out["file_changed"] = None if now is None else now[1] != digest
    out["line"] = _pinning_line(out)
    return out


def _file_now(path: Path) -> tuple[Any, str] | None:
    """(version, sha256) of the workflow file at `path` now; None when it cannot be read."""
    from fsm_kernel.workflow.loader import parse_yaml_with_locations, read_yaml_file

    try:
        text = read_yaml_file(path)
        data = parse_yaml_with_locations(text, str(path))[0]
    except Exception:  # gone, unreadable or not YAML any more: nothing to compare
        return None
    version = data.get("version") if isinstance(data, dict) else None
    return version, hashlib.sha256(text.encode()).hexdigest()


def _pinning_line(p: Mapping[str, Any]) -> str:
    if not p["workflow_hash"]:
        return ""
    pinned = f"version {p['version']}" if p["version"] is not None else "no version"
    line = f"pinned to {pinned} (sha256 {str(p['workflow_hash'])[:12]})"
    if p["file_changed"] is None:
        return f"{line}; its file cannot be read here"
    if not p["file_changed"]:
        return f"{line}; the file is unchanged"
    now = f"version {p['file_version']}" if p["file_version"] is not None else "no version"
    return f"{line}; the file now says {now} (sha256 {str(p['file_hash'])[:12]})"
