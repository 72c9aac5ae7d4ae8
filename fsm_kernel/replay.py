"""Resume and replay, both built on one idea: re-drive the workflow from the start of the run
with the model's answers and the tools' outputs served from the event log.

- resume: when the log runs out, the real model and tools take over and recording goes live, so
  the run continues from its last recorded step (the step in flight at a crash is redone).
- replay: nothing live at all (no network, no tool side effects); the transitions taken are
  compared, step by step, with the recorded ones.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fsm_kernel.errors import AgentError, ReplayDivergenceError, ResumeError, RunNotFoundError
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
from fsm_kernel.workflow.compiler import CompiledWorkflow
from fsm_kernel.workflow.output import as_json
from fsm_kernel.workflow.spec import Limits

__all__ = [
    "RecordedChatModel",
    "RecordedRun",
    "RecordedToolExecutor",
    "ReplayReport",
    "ReplayStep",
    "replay_run",
    "resume_run",
]

logger = logging.getLogger(__name__)

_CONFIG_KEYS = ("settings", "limits", "system_prompt")
_NOT_REPRODUCED = LIVE_ONLY_EVENTS | {EventType.RUN_STARTED, EventType.RUN_RESUMED}
"""What a re-drive does not record again: the run's markers and the live model's failures."""
"""What `run.started` records of how the run runs, and `run.resumed` may change."""
_EXTERNAL_ENDINGS = frozenset({"timeout", "cancelled"})
"""Endings decided by the clock or the user, not by the workflow: a replay (which takes no
time) reproduces the steps recorded before them and reports the recorded ending."""


class RecordedChatModel:
    """Serves the recorded model answers in order; then the live model, if there is one, or
    the recorded failure that ended the run (a replay of an `agent_error` run fails where the
    run did)."""

    def __init__(
        self,
        completions: Sequence[Completion],
        live: ChatModel | None = None,
        *,
        failure: AgentError | None = None,
    ) -> None:
        self._queue = list(completions)
        self.live = live
        self.failure = failure
        self.served = 0

    async def complete(
        self, messages: Sequence[Message], tools: Sequence[Tool], **options: Any
    ) -> Completion:
        if self._queue:
            self.served += 1
            return self._queue.pop(0)
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
    completions: list[Completion] = field(default_factory=list)
    results: dict[str, ToolResult] = field(default_factory=dict)
    unfinished: dict[str, int] = field(default_factory=dict)

    @classmethod
    def load(cls, store: EventStore, run_id: str) -> RecordedRun:
        run_id = store.find_run(run_id)
        events = store.read(run_id)
        if not events or events[0].type != EventType.RUN_STARTED:
            raise RunNotFoundError(f"run {run_id} has no run.started event", run_id=run_id)
        run = cls(run_id, events, events[0], None)
        started: dict[str, int] = {}
        for e in events:
            if e.type == EventType.MODEL_RESPONDED:
                run.completions.append(Completion.from_dict(e.data["completion"]))
            elif e.type == EventType.TOOL_STARTED:
                started[e.data["call"]["id"]] = e.seq
            elif e.type == EventType.TOOL_FINISHED and not e.data.get("malformed"):
                run.results[e.data["call"]["id"]] = ToolResult.from_dict(e.data["result"])
            elif e.type == EventType.RUN_TERMINATED:
                run.terminated = e
            elif e.type == EventType.RUN_RESUMED:
                run.terminated = None  # a resumable ending (agent_error) that a resume reopened
        run.unfinished = {cid: seq for cid, seq in started.items() if cid not in run.results}
        return run

    @property
    def goal(self) -> str:
        return str(self.started.data.get("goal", ""))

    @property
    def resumable(self) -> bool:
        """Killed (no ending), or ended by a model server that could not be reached or kept
        failing: the run can go on from its last completed step."""
        return self.terminated is None or bool(self.terminated.data.get("resumable"))

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
            if e.type in _NOT_REPRODUCED:
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
) -> RunResult:
    """Continue a run from its last recorded step: one that was killed, or one that ended
    because the model server could not be reached or kept failing (a resumable `agent_error`).

    Build `kernel` from the run's recorded settings (`RecordedRun.config`); `overrides` (what the
    caller changed, e.g. the flags given to `fsm-kernel resume`) are recorded in `run.resumed`.

    Raises:
        RunNotFoundError: no such run.
        RunLockedError: another process (or task) is running or resuming it.
        ResumeError: it already terminated, or its workflow file changed (unless `force`).
    """
    with store.lock_run(store.find_run(run_id)):  # before reading: two resumes cannot both start
        return await _resume_locked(kernel, store, run_id, force=force, overrides=overrides or {})


async def _resume_locked(
    kernel: Kernel, store: EventStore, run_id: str, *, force: bool, overrides: Mapping[str, Any]
) -> RunResult:
    run = RecordedRun.load(store, run_id)
    if not run.resumable:
        reason = run.terminated.data.get("reason") if run.terminated else None
        raise ResumeError(
            f"run {run.run_id} already terminated ({reason}); only a killed run, or one that "
            "ended because the model server could not be reached, can be resumed",
            run_id=run.run_id,
        )
    reopened, run.terminated = run.terminated, None
    recorded_hash = run.started.data.get("workflow_hash")
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
        "settings": kernel.settings,
        "limits": kernel.limits.model_dump(),
        "system_prompt": kernel.system_prompt,
        "overrides": dict(overrides),
        "reopened": reopened.data.get("reason") if reopened is not None else None,
        "rerun_tool_calls": sorted(run.unfinished),
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
    # This run's own collaborators: recorded answers first, then the kernel's live ones.
    ctx = kernel.new_context(
        run.run_id,
        run.goal,
        recorder,
        model=RecordedChatModel(run.completions, kernel.model),
        tools=RecordedToolExecutor(run.results, kernel.tools, unfinished=run.unfinished),
    )
    machine = kernel.workflow.instantiate(ctx)
    recorder.state = machine.state
    recorder.record(EventType.STATE_ENTERED, {})
    return await kernel.drive(ctx, machine, recorder)


@dataclass(frozen=True)
class ReplayStep:
    step: int
    iteration: int
    recorded: str | None
    replayed: str | None

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

    @property
    def identical(self) -> bool:
        if not all(s.same for s in self.steps):
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
        }


def _label(event: Event) -> str:
    d = event.data
    guard = f" [{d['guard']}]" if d.get("guard") else ""
    reason = f" → {d['reason']}" if d.get("reason") else ""
    return f"{d['source']} → {d['target']}{guard}{reason}"


async def replay_run(
    workflow: CompiledWorkflow,
    store: EventStore,
    run_id: str,
    *,
    limits: Limits | None = None,
) -> ReplayReport:
    """Re-run `workflow` on the recorded answers (no model, no tools) and compare transitions.

    `limits` default to the ones the run last ran under (its log), so the replay reproduces it;
    a what-if with an edited workflow passes that workflow's own."""
    run = RecordedRun.load(store, run_id)
    model = RecordedChatModel(run.completions, failure=_recorded_failure(run))
    recorded = run.config().get("limits")
    kernel = Kernel(
        workflow,
        model=model,
        tools=RecordedToolExecutor(run.results),
        tool_names=run.started.data.get("settings", {}).get("tools"),
        limits=limits or (Limits.model_validate(recorded) if recorded else None),
    )
    result = await kernel.run(run.goal, run_id=run.run_id)
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
            )
        )
    return ReplayReport(
        run.run_id,
        steps,
        recorded_reason,
        recorded_reason if external and recorded_reason else result.termination_reason,
        model.served,
        result.error,
        recorded_output=run.terminated.data.get("output") if run.terminated else None,
        replayed_output=as_json(result.output),
    )


def _recorded_failure(run: RecordedRun) -> AgentError | None:
    """The model failure that ended the run, to fail the replay at the same call."""
    ended = run.terminated
    if ended is None or ended.data.get("reason") != "agent_error":
        return None
    return AgentError(str(ended.data.get("error") or "the model server failed"))
