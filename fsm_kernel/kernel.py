"""The kernel: drives one compiled workflow per run until a final state, enforces the limits in
code, records every step, and always ends with exactly one termination reason.

It owns the loop and nothing else: the model, the tools, the session and the store are
collaborators passed in (see bootstrap.py for building them from configuration).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from fsm_kernel.config import DEFAULT_MAX_TOKENS
from fsm_kernel.errors import AgentError, ConfigError, FsmKernelError, NoTransitionError
from fsm_kernel.protocol import (
    ChatModel,
    Clock,
    Event,
    EventStore,
    EventType,
    Message,
    SystemClock,
    ToolExecutor,
    Usage,
    new_id,
)
from fsm_kernel.recorder import RunRecorder
from fsm_kernel.redact import find_lone_surrogate
from fsm_kernel.session import InMemorySession
from fsm_kernel.streaming import TextDelta, deltas_to
from fsm_kernel.workflow.actions import ANSWER_SHOWN, is_truncated, iteration_record
from fsm_kernel.workflow.children import ChildResult, ChildRunner, take_shared_call
from fsm_kernel.workflow.compiler import CompiledWorkflow, FiredTransition, Machine
from fsm_kernel.workflow.context import RunContext, RunServices, Sleep, ToolCallRecord
from fsm_kernel.workflow.deadlines import (
    RecordedDeadlines,
    due_deadline,
    enter_and_leave,
    pending_deadlines,
)
from fsm_kernel.workflow.decide import undecided
from fsm_kernel.workflow.human import HumanChannel, OffTheClock, Suspended, SuspendingChannel
from fsm_kernel.workflow.limits import limit_reached
from fsm_kernel.workflow.output import as_json
from fsm_kernel.workflow.recovery import run_action
from fsm_kernel.workflow.spec import SUCCESS_REASONS, Limits, TerminationReason, as_reason
from fsm_kernel.workflow.waiting import AWAIT_IN_PROCESS, advance_past_deadline, wait_and_advance

__all__ = ["Kernel", "RunResult", "Watcher", "current_run_id"]

logger = logging.getLogger(__name__)

TRUNCATED_ERROR = (
    'the answer was cut off by the model\'s length limit (finish_reason "length"); raise '
    f"agent.max_tokens in the workflow (the cap on each reply, default {DEFAULT_MAX_TOKENS}) or "
    "the server's max tokens or context window (Ollama num_predict/num_ctx, vLLM "
    "--max-model-len, llama.cpp -n/-c)"
)
"""The error of a run that ended `truncated`: its response is the partial text."""

Watcher = Callable[[Event | TextDelta], None]
"""Sees a run as it happens: each Event once recorded, and the model's text as it streams."""

current_run_id: ContextVar[str] = ContextVar("fsm_kernel_run_id", default="-")
"""The id of the run the current task works for: log handlers put it on every line."""


@dataclass(kw_only=True)
class RunResult:
    """How a run ended, with everything it produced so far (also when it ended badly)."""

    run_id: str
    workflow: str
    termination_reason: TerminationReason | str | None
    """A built-in reason (a `TerminationReason`), or one the workflow declares under `reasons:`
    (a plain string). Both compare equal to the name as written. None while the run waits
    for a person (`status` "waiting"): it is not over."""
    response: str
    iterations: int
    """The run's own model calls."""
    child_iterations: int = 0
    """The model calls of its child runs (and theirs): `max_iterations` caps the sum."""
    output: Any = None
    """The structured output: the answer validated against the workflow's `output:` schema
    (an instance of the pydantic model it names, or the parsed JSON); None without one."""
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    error: str | None = None
    messages: list[Message] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    success_reasons: frozenset[str] = field(default=SUCCESS_REASONS, repr=False)
    """The reasons this run's workflow counts as success: `final_answer`, `done` and its own
    reasons declared with `success: true`."""
    waiting_for: dict[str, Any] | None = None
    """What a suspended run waits for: {"kind": "approval" | "input", "state", "tool_call"
    (approval: id, name, arguments) or "prompt" (input)}; None once it ended."""

    @property
    def status(self) -> str:
        """ "ended", or "waiting" for a person (resume it with the answer)."""
        return "waiting" if self.waiting_for is not None else "ended"

    @property
    def ok(self) -> bool:
        """The run succeeded (the CLI exits 0): it ended for a success reason."""
        return self.termination_reason is not None and self.termination_reason in (
            self.success_reasons
        )

    def as_child(self) -> ChildResult:
        """This run as its parent sees it (a workflow.call / workflow.map child)."""
        reason = self.termination_reason
        return ChildResult(
            run_id=self.run_id,
            workflow=self.workflow,
            reason=None if reason is None else str(reason),
            ok=self.ok,
            answer=self.response,
            output=as_json(self.output),
            iterations=self.iterations + self.child_iterations,
            usage=self.usage,
            error=self.error,
            waiting_for=self.waiting_for,
        )

    def to_dict(self) -> dict[str, Any]:
        reason = self.termination_reason
        d: dict[str, Any] = {
            "run_id": self.run_id,
            "workflow": self.workflow,
            "status": self.status,
            "termination_reason": None if reason is None else str(reason),
            "response": self.response,
            "output": as_json(self.output),
            "iterations": self.iterations,
            "tool_calls": [r.to_dict() for r in self.tool_calls],
            "usage": self.usage.to_dict(),
        }
        if self.child_iterations:
            d["child_iterations"] = self.child_iterations
        if self.error:
            d["error"] = self.error
        if self.waiting_for is not None:
            d["waiting_for"] = self.waiting_for
        return d


class _Stop(Exception):
    """The kernel itself ends the run (a limit in code, not a transition)."""

    def __init__(self, reason: TerminationReason, error: str | None = None) -> None:
        super().__init__(reason)
        self.reason, self.error = reason, error


class Kernel:
    """Runs a compiled workflow. Every collaborator is injectable."""

    def __init__(
        self,
        workflow: CompiledWorkflow,
        *,
        model: ChatModel,
        tools: ToolExecutor,
        store: EventStore | None = None,
        system_prompt: str = "",
        clock: Clock | None = None,
        settings: dict[str, Any] | None = None,
        on_event: Watcher | None = None,
        tool_names: Sequence[str] | None = None,
        limits: Limits | None = None,
        human: HumanChannel | None = None,
        approval_required: frozenset[str] = frozenset(),
        state_models: Mapping[str, ChatModel] | None = None,
        sleep: Sleep | None = None,
        children: ChildRunner | None = None,
        await_timers: float = AWAIT_IN_PROCESS,
    ) -> None:
        """Args:
        workflow: the compiled workflow (compiled once per content; limits are not part of it).
        model, tools: the default collaborators of a run (a run may be given its own).
        store: where events are appended; None keeps them in the RunResult only.
        on_event: watches every run: each Event as it is recorded, and the model's TextDelta
            pieces as they stream (deltas are never stored).
        limits: the runs' limits; default the workflow's `limits:`.
        human: how runs reach a person (approvals, `human.input`); default: they suspend.
        approval_required: the tools a person approves each call of (`approval: required`).
        state_models: the model of each state with its own `agent:` block (by state id).
        sleep: waits between a state's `retry:` attempts (default asyncio.sleep).
        children: runs the child runs of `workflow.call` / `workflow.map` states.
        await_timers: a waiting state's timer due within this many seconds is slept on in
            process rather than suspending the run (0: always suspend; a replay's).
        """
        self.tool_names = tuple(tool_names if tool_names is not None else workflow.spec.tool_names)
        self.human: HumanChannel = human or SuspendingChannel()
        self.approval_required = approval_required
        self.workflow = workflow
        self.spec = workflow.spec
        self.limits = limits or workflow.spec.limits
        self.model = model
        self.tools = tools
        self.store = store
        self.system_prompt = system_prompt
        self.clock = clock or SystemClock()
        self.settings = settings or {}
        self.on_event = on_event
        self.state_models: Mapping[str, ChatModel] = dict(state_models or {})
        self.sleep: Sleep = sleep or asyncio.sleep
        self.children = children
        self.await_timers = await_timers

    # -- public API ----------------------------------------------------------------------

    async def run(
        self,
        prompt: str,
        *,
        run_id: str | None = None,
        model: ChatModel | None = None,
        tools: ToolExecutor | None = None,
        watch: Watcher | None = None,
        recorded_failures: Mapping[tuple[str, int, int], Exception] | None = None,
        history: Sequence[Message] = (),
        continues: str | None = None,
        limits: Limits | None = None,
        parent_run_id: str | None = None,
        recorded_children: Sequence[str] = (),
        recorded_deadlines: RecordedDeadlines | None = None,
    ) -> RunResult:
        """Run the workflow on `prompt` until it terminates; never raises for run failures
        (ConfigError, before anything is recorded, for a prompt, a system prompt or a history
        that is not text: a lone surrogate such as "\\ud800", which no store can encode).

        `model` and `tools` replace the kernel's for this run only; `watch` sees this run's
        events and text deltas (besides `on_event`). Runs on one Kernel may go concurrently.
        `recorded_failures` is for replays (see `RunServices.recorded_failures`). `history`: the
        conversation the run continues (the prompt follows it), that of the run `continues`
        names (recorded in `run.started`, so resume and replay rebuild it from that run's log;
        without `continues`, `run.started` records the messages themselves). `limits` replace
        the kernel's for this run (a child run's, bounded by its parent's); `parent_run_id`
        links a child run to its parent (in `run.started`); `recorded_children` and
        `recorded_deadlines` are for replays.
        """
        run_id = run_id or new_id()
        limits = limits or self.limits
        started = self.started_data(prompt, limits)
        if parent_run_id is not None:
            started["parent_run_id"] = parent_run_id
        if continues is not None:
            started["continues"] = continues
            started["history_messages"] = len(history)
        elif history:  # given as messages: the log keeps them, for resume and replay
            started["history"] = [m.to_dict() for m in history]
        _require_text(started)  # before anything is recorded
        with self.lock(run_id):
            recorder = self.recorder(run_id, watch=watch)
            recorder.record(EventType.RUN_STARTED, started)
            ctx = self.new_context(
                run_id,
                prompt,
                recorder,
                model=model,
                tools=tools,
                recorded_failures=recorded_failures,
                history=history,
                limits=limits,
                recorded_children=recorded_children,
                recorded_deadlines=recorded_deadlines,
            )
            machine = self.workflow.instantiate(ctx)
            recorder.state = machine.state
            recorder.record(EventType.STATE_ENTERED, machine.entered_recorded())
            await recorder.flush()  # the run exists in the log before its first step
            return await self.drive(ctx, machine, recorder)

    def lock(self, run_id: str) -> AbstractContextManager[None]:
        """The run's exclusive lock in the store, held while the run is driven, so a `resume`
        of a live run is refused at once (RunLockedError); nothing to lock without a store."""
        return self.store.lock_run(run_id) if self.store is not None else nullcontext()

    def run_sync(self, prompt: str, *, run_id: str | None = None) -> RunResult:
        """`run` for code without an event loop."""
        return asyncio.run(self.run(prompt, run_id=run_id))

    def new_context(
        self,
        run_id: str,
        prompt: str,
        recorder: RunRecorder,
        *,
        model: ChatModel | None = None,
        tools: ToolExecutor | None = None,
        human: HumanChannel | None = None,
        state_models: Mapping[str, ChatModel] | None = None,
        recorded_failures: Mapping[tuple[str, int, int], Exception] | None = None,
        history: Sequence[Message] = (),
        limits: Limits | None = None,
        recorded_children: Sequence[str] = (),
        recorded_deadlines: RecordedDeadlines | None = None,
    ) -> RunContext:
        """A fresh context whose session holds the conversation it continues (`history`) and the
        user's prompt, with this run's collaborators
        (the kernel's unless given). A retry's wait is skipped while the run catches up with
        its log (a resume re-driving recorded failures)."""

        async def sleep(seconds: float) -> None:
            if not recorder.catching_up:
                await self.sleep(seconds)

        def record(type_: EventType, data: dict[str, Any]) -> None:
            recorder.iteration = ctx.iteration  # an action's events: of the iteration it is in
            recorder.record(type_, data)

        services = RunServices(
            model=model or self.model,
            tools=tools or self.tools,
            clock=self.clock,
            record=record,
            flush=recorder.flush,
            human=OffTheClock(human or self.human),
            state_models=self.state_models if state_models is None else state_models,
            sleep=sleep,
            recorded_failures=recorded_failures or {},
            children=self.children,
            recorded_children=recorded_children,
            recorded_deadlines=recorded_deadlines,
        )
        ctx = RunContext(
            run_id=run_id,
            goal=prompt,
            workflow_path=self.spec.path,
            system_prompt=self.system_prompt,
            limits=limits or self.limits,
            tool_names=self.tool_names,
            approval_required=self.approval_required,
            parallel_tool_calls=self.spec.parallel_tool_calls,
            context_window=self.spec.context,
            services=services,
            outputs=self.workflow.outputs,
            choices=self.workflow.choices,
            session=InMemorySession(),
        )
        for message in history:
            ctx.session.add(message)
        ctx.session.add(Message.user(prompt))
        return ctx

    async def drive(self, ctx: RunContext, machine: Machine, recorder: RunRecorder) -> RunResult:
        """Drive `machine` to a final state under the wall-clock timeout and cancellation."""
        named = current_run_id.set(ctx.run_id)  # log lines name this run while it goes ...
        try:
            return await self._drive(ctx, machine, recorder)
        finally:
            current_run_id.reset(named)  # ... and their caller's after (a child's parent)

    async def _drive(self, ctx: RunContext, machine: Machine, recorder: RunRecorder) -> RunResult:
        timeout = ctx.limits.timeout_seconds or None
        reason: TerminationReason | str = TerminationReason.ERROR
        error, resumable = None, False
        try:
            async with asyncio.timeout(timeout) as deadline:
                ctx.notes.deadline = deadline
                if isinstance(ctx.services.human, OffTheClock):
                    ctx.services.human.deadline = deadline
                with deltas_to(recorder.stream_sink):
                    reason = await self._loop(ctx, machine, recorder)
        except Suspended as suspended:  # not an ending: the run waits for a person
            result = self._suspend(ctx, recorder, suspended)
            await _until_done(recorder.flush())
            return result
        except _Stop as stop:
            reason, error = stop.reason, stop.error
        except TimeoutError:
            reason, error = TerminationReason.TIMEOUT, f"run timed out after {timeout:g}s"
        except asyncio.CancelledError:
            reason, error = TerminationReason.CANCELLED, "run cancelled"
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
        except AgentError as exc:  # unreachable or failing servers leave the run resumable
            reason, error, resumable = TerminationReason.AGENT_ERROR, str(exc), exc.retryable
        except FsmKernelError as exc:
            reason, error = TerminationReason.ERROR, str(exc)
        except Exception as exc:  # an action or guard is buggy: report, never crash the caller
            logger.debug("action raised in state %s", machine.state, exc_info=True)
            reason, error = TerminationReason.ERROR, _one_line(exc, machine.state)
        result = self._finish(ctx, recorder, reason, error, resumable=resumable)
        await _until_done(recorder.flush())  # the ending is recorded even if cancelled again
        return result

    # -- the loop ------------------------------------------------------------------------

    async def _loop(
        self, ctx: RunContext, machine: Machine, recorder: RunRecorder
    ) -> TerminationReason | str:
        transitions = 0
        deadlines = self.workflow.deadlines
        enter_and_leave(ctx, self.spec, deadlines, recorder.record, now_in=machine.state)
        while not machine.is_final:
            state = machine.state
            await self._act(ctx, state, recorder)
            fired = await self._advance(ctx, machine, recorder, transitions)
            _check_deadline(ctx)
            transitions += 1
            recorder.record(EventType.TRANSITION_TAKEN, fired.recorded)
            recorder.state = machine.state  # inside a compound target: where it entered
            enter_and_leave(ctx, self.spec, deadlines, recorder.record, now_in=machine.state,
                            target=fired.target, fired=fired.index)  # fmt: skip
            if fired.final:
                return as_reason(fired.reason or TerminationReason.FINAL_ANSWER)
            recorder.record(EventType.STATE_ENTERED, machine.entered_recorded())
            # committed before the run next waits; at once after a user's action
            action = self.workflow.actions.get(state)
            await recorder.end_step(at_once=action is not None and action.user_code)
            if transitions >= ctx.limits.max_transitions:
                raise _Stop(
                    TerminationReason.NO_PROGRESS,
                    f"{transitions} transitions without reaching a final state "
                    "(limits.max_transitions)",
                )
        return TerminationReason.FINAL_ANSWER

    async def _advance(
        self, ctx: RunContext, machine: Machine, recorder: RunRecorder, step: int
    ) -> FiredTransition:
        """The next transition (the `step`-th): a compound state's deadline's once it is due
        (workflow/deadlines.py); a waiting state's once its event or timer comes (see
        workflow/waiting.py: it may suspend the run)."""
        waits = self.workflow.waits.get(machine.state)
        if waits is not None:
            return await wait_and_advance(ctx, machine, waits, recorder.record,
                                          in_process=self.await_timers,
                                          deadlines=pending_deadlines(ctx))  # fmt: skip
        deadline = due_deadline(ctx, step)
        if deadline is not None:
            return await advance_past_deadline(ctx, machine, deadline, recorder.record, step)
        return await self._step(ctx, machine)

    async def _step(self, ctx: RunContext, machine: Machine) -> FiredTransition:
        """`machine.advance()`. An agent.decide state left without a pick (malformed replies
        until the retries or another limit ran out) whose edges do not route that ends the run
        for the limit reached: malformed_output, as agent.think's would before its next call."""
        state = machine.state
        try:
            return await machine.advance()
        except NoTransitionError:
            if not undecided(self.spec, state, ctx):
                raise
            hit = limit_reached(ctx, model_call_next=True)
            if hit is None:
                raise
            raise _Stop(hit.reason, hit.error) from None

    async def _act(self, ctx: RunContext, state: str, recorder: RunRecorder) -> None:
        """Run the action of `state`, unless a limit ends the run first (in code, whatever the
        transitions say; see `limit_reached` for when each limit is checked)."""
        recorder.state = state
        action = self.workflow.actions.get(state)
        calls_model = action is not None and action.calls_model
        if calls_model:
            self._complete_iteration(ctx, recorder, state)
        spends = calls_model or (action is not None and action.starts_children)
        hit = limit_reached(ctx, model_call_next=spends)
        if hit is not None:
            raise _Stop(hit.reason, hit.error)
        if calls_model:  # a map's children share their parent's cap
            spent = take_shared_call(ctx, recorded=recorder.catching_up)
            if spent is not None:
                raise _Stop(TerminationReason.MAX_ITERATIONS, spent)
        if action is not None:
            ctx.state_spec = self.spec.states[state]
            await run_action(ctx, action, ctx.state_spec)  # under its retry: and catch:
            recorder.iteration = ctx.iteration

    def _complete_iteration(
        self, ctx: RunContext, recorder: RunRecorder, next_state: str, error: str | None = None
    ) -> None:
        """Record the iteration that just ended (before the next model call or at the end)."""
        if ctx.iteration == 0 or ctx.notes.recorded_iteration == ctx.iteration:
            return
        ctx.notes.recorded_iteration = ctx.iteration
        record = _iteration_record(ctx, next_state, error)
        recorder.record(EventType.ITERATION_COMPLETED, record)
        ctx.summary = ""

    def _suspend(self, ctx: RunContext, recorder: RunRecorder, suspended: Suspended) -> RunResult:
        """Record what the run waits for; `resume` with the answer re-drives it from its log."""
        waiting_for = suspended.question.to_dict()
        recorder.record(EventType.RUN_SUSPENDED, {"waiting_for": waiting_for})
        logger.info("suspended: waiting for %s in state %s", waiting_for["kind"], ctx.current_state)
        return self._result(ctx, recorder, None, None, waiting_for=waiting_for)

    def _finish(
        self,
        ctx: RunContext,
        recorder: RunRecorder,
        reason: TerminationReason | str,
        error: str | None,
        *,
        resumable: bool = False,
    ) -> RunResult:
        if reason == TerminationReason.FATAL_TOOL_ERROR and error is None:
            error = ctx.fatal_error
        if self.spec.is_success(reason) and is_truncated(ctx):  # a cut-off answer is no success
            reason, error = TerminationReason.TRUNCATED, _truncated_error(ctx)
        elif self.spec.is_success(reason) and ctx.output_error is not None:  # nor a wrong one
            reason, error = TerminationReason.MALFORMED_OUTPUT, ctx.output_error
        if reason == TerminationReason.MALFORMED_OUTPUT and error is None:
            error = _malformed_error(ctx)  # the workflow's own edge ended it: say why
        self._complete_iteration(ctx, recorder, ctx.current_state, error)
        response = ctx.done_answer if ctx.done_answer is not None else ctx.answer
        data: dict[str, Any] = {
            "reason": str(reason),
            "answer": response,
            "iterations": ctx.iteration,
        }
        if ctx.output is not None:
            data["output"] = as_json(ctx.output)
        if error:
            data["error"] = error
        if resumable:
            data["resumable"] = True
        if ctx.child_iterations:
            data["child_iterations"] = ctx.child_iterations
        if ctx.notes.shared_calls is not None:
            data["shared_calls"] = ctx.notes.shared_calls
        recorder.record(EventType.RUN_TERMINATED, data)
        logger.info("terminated: %s%s", reason, f" ({error})" if error else "")
        return self._result(ctx, recorder, reason, error)

    def _result(
        self,
        ctx: RunContext,
        recorder: RunRecorder,
        reason: TerminationReason | str | None,
        error: str | None,
        *,
        waiting_for: dict[str, Any] | None = None,
    ) -> RunResult:
        return RunResult(
            run_id=ctx.run_id,
            workflow=self.spec.name,
            termination_reason=reason,
            response=ctx.done_answer if ctx.done_answer is not None else ctx.answer,
            iterations=ctx.iteration,
            child_iterations=ctx.child_iterations,
            output=ctx.output,
            tool_calls=list(ctx.tool_calls),
            usage=ctx.usage,
            error=error,
            messages=ctx.session.messages(),
            events=list(recorder.events),
            success_reasons=self.spec.success_reasons(),
            waiting_for=waiting_for,
        )

    # -- helpers ---------------------------------------------------------------------------

    def recorder(
        self,
        run_id: str,
        *,
        expected: Sequence[Event] = (),
        next_seq: int = 1,
        watch: Watcher | None = None,
    ) -> RunRecorder:
        """The recorder of one run: the kernel's store, its watcher and the run's own."""
        watchers = tuple(w for w in (self.on_event, watch) if w is not None)
        return RunRecorder(
            run_id,
            self.store,
            clock=self.clock,
            expected=expected,
            next_seq=next_seq,
            watchers=watchers,
        )

    def started_data(self, prompt: str, limits: Limits) -> dict[str, Any]:
        """What `run.started` records of a new run of `prompt` under `limits`: the workflow (its
        text, which resume and replay follow), the goal, the settings, limits and system prompt.
        For engines that start runs themselves (fsm_kernel.integrations.dbos)."""
        settings = dict(self.settings)
        if self.approval_required:  # a replay asks for approval where the run did
            settings.setdefault("approval", sorted(self.approval_required))
        return {
            "workflow": self.spec.name,
            "workflow_path": self.spec.path,
            "workflow_hash": self.spec.content_hash,
            "workflow_version": self.spec.version,
            "workflow_text": self.spec.text or None,  # resume and replay follow this text
            "goal": prompt,
            "settings": settings,
            "limits": limits.model_dump(),
            "system_prompt": self.system_prompt,
        }


async def _until_done(work: Awaitable[None]) -> None:
    """Await `work` to its end: a cancellation that arrives meanwhile waits for it."""
    task = asyncio.ensure_future(work)
    while True:
        try:
            await asyncio.shield(task)
            return
        except asyncio.CancelledError:
            if task.done():
                raise
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()


_TEXT_FIELDS = {"goal": "prompt", "system_prompt": "system prompt", "history": "history"}
"""The text a caller gives a run (`run.started`'s keys), by the names the caller knows."""


def _require_text(started: Mapping[str, Any]) -> None:
    """Refuse text that no store can encode (a lone surrogate), naming where it is."""
    for key, what in _TEXT_FIELDS.items():
        value = started.get(key)
        if value is None:
            continue
        text = value if isinstance(value, str) else _as_json(value)
        at = find_lone_surrogate(text)
        if at >= 0:
            where = f" at character {at}" if text is value else ""
            raise ConfigError(
                f"the {what} is not valid text: it holds {text[at]!a}{where}, a lone "
                "surrogate, which UTF-8 cannot encode (decode bytes with errors='replace')"
            )


def _as_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)


def _check_deadline(ctx: RunContext) -> None:
    """Raise TimeoutError if the run's deadline has passed. A step that kept the event loop
    busy (CPU-bound work, a blocking call) gives `asyncio.timeout` no chance to fire before it
    ends: the run still ends `timeout`, not as if it had finished in time."""
    deadline = ctx.notes.deadline
    when = deadline.when() if deadline is not None else None
    if when is not None and asyncio.get_running_loop().time() >= when:
        raise TimeoutError


def _one_line(exc: Exception, state: str) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    more = " …" if len(lines) > 1 else ""
    first = lines[0] if lines else ""
    return f"{type(exc).__name__}: {first}{more} (in state {state!r})"


def _truncated_error(ctx: RunContext) -> str:
    """TRUNCATED_ERROR, or the model's own `truncation_error` when it has one: the cap it
    applies itself (the local model's FSM_KERNEL_LOCAL_MAX_TOKENS, not agent.max_tokens)."""
    own = getattr(ctx.model, "truncation_error", None)
    return own if isinstance(own, str) and own else TRUNCATED_ERROR


def _malformed_error(ctx: RunContext) -> str | None:
    if ctx.malformed_reason is None:
        return None
    count = ctx.malformed_streak
    return (
        f"{count} malformed model repl{'y' if count == 1 else 'ies'} in a row; the last: "
        f"{ctx.malformed_reason}"
    )


def _iteration_record(ctx: RunContext, next_state: str, error: str | None) -> dict[str, Any]:
    completion = ctx.last_completion if ctx.completion_iteration == ctx.iteration else None
    calls = []  # this iteration's, the last ones (a scan of the whole run would grow with it)
    for record in reversed(ctx.tool_calls):
        if record.iteration != ctx.iteration:
            break
        calls.append(record)
    calls.reverse()
    if completion is None:
        decision = "failed"  # the model call of this iteration never answered
    elif ctx.malformed_reason is not None:
        decision = "malformed"
    elif completion is not None and completion.message.tool_calls:
        decision = "tool_calls"
    else:
        decision = "answer"
    errors = [f"{r.call.name}: {r.result.content[:200]}" for r in calls if r.result.is_error]
    caught = ctx.caught
    if completion is None and error is None and caught and caught.iteration == ctx.iteration:
        error = f"{caught.type}: {caught.message}"  # the failed call a catch: routed
    return iteration_record(
        ctx.iteration,
        decision,
        next_state=next_state,
        answer=completion.message.content[:ANSWER_SHOWN]
        if completion and decision == "answer"
        else "",
        tools=[
            {
                "id": r.call.id,
                "name": r.call.name,
                "input": r.call.arguments,
                "output": r.result.content[:200],
                "is_error": r.result.is_error,
            }
            for r in calls
        ],
        error=(ctx.malformed_reason if completion else error)
        or ("; ".join(errors) if errors else None),
        summary=ctx.summary,
    )
