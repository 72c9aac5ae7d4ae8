"""WorkflowHarness: one workflow under test, its declared transitions, single steps fired with a
hand-made RunContext (no action runs), and whole runs through the real Kernel with a fake model.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import fields
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NamedTuple

import pydantic

from fsm_kernel.bootstrap import RunOptions, build_tools, load_spec
from fsm_kernel.errors import ConfigError
from fsm_kernel.kernel import Kernel, RunResult
from fsm_kernel.protocol import ChatModel, EventStore, EventType, ToolExecutor, ToolResult
from fsm_kernel.testing._models import FunctionChatModel, ScriptedChatModel
from fsm_kernel.testing._replies import ReplyLike, as_completion, tool_call
from fsm_kernel.workflow.children import ChildRequest, ChildResult, ChildRunner, bounded_limits
from fsm_kernel.workflow.compiler import CompiledWorkflow, FiredTransition, compile_workflow
from fsm_kernel.workflow.context import RunContext, ToolCallRecord
from fsm_kernel.workflow.decide import decides, legal_choices
from fsm_kernel.workflow.human import HumanChannel
from fsm_kernel.workflow.loader import find_workflow, load_workflow
from fsm_kernel.workflow.recovery import error_kind, failure_of, first_catch
from fsm_kernel.workflow.spec import Limits, WorkflowSpec, parse_duration
from fsm_kernel.workflow.waiting import AWAIT_IN_PROCESS

__all__ = [
    "DeclaredTransition",
    "StepListener",
    "WorkflowHarness",
    "build_case_tools",
    "declared_transitions",
    "run_child_in_turn",
]


class DeclaredTransition(NamedTuple):
    """A transition as the workflow file declares it."""

    index: int  # type: ignore[assignment]  # shadows tuple.index, named like FiredTransition's
    source: str
    target: str
    guard: str
    """The guard label, e.g. "malformed_output and not retries_exhausted"; "" when unguarded."""
    reason: str | None


StepListener = Callable[["WorkflowHarness", FiredTransition], None]

_CONTEXT_FIELDS = frozenset(f.name for f in fields(RunContext))
_SHORTCUTS = frozenset({"last_reply", "tool_results", "limits"})
_MISSING: Any = object()


class WorkflowHarness:
    """A workflow under test: its declared transitions, single steps with a hand-made context
    (no action runs), and whole runs through the real Kernel with a fake model.

    Args:
        workflow: a workflow file, a stock workflow's name ("react") or a WorkflowSpec.

    Example::

        harness = WorkflowHarness("workflows/default.yaml")
        assert harness.step("evaluate", iteration=10).reason == "max_iterations"
        assert harness.step("think", last_reply="42").target == "terminate"
    """

    def __init__(self, workflow: str | Path | WorkflowSpec) -> None:
        if isinstance(workflow, WorkflowSpec):
            self.spec = workflow
        else:
            self.spec = load_spec(str(workflow))  # its folder's modules import, as for `run`
        self.compiled: CompiledWorkflow = compile_workflow(self.spec)
        self.fired: list[FiredTransition] = []
        """Every transition this harness saw fire, by `step()` or `run()`, in order."""
        self._listeners: list[StepListener] = []

    def __repr__(self) -> str:
        return f"WorkflowHarness({self.spec.path!r})"

    @property
    def transitions(self) -> list[DeclaredTransition]:
        """The declared transitions, in file order, then the states' catch edges (guard
        label `catch agent_error`)."""
        return declared_transitions(self.spec)

    def add_listener(self, listener: StepListener) -> None:
        """Call `listener(harness, fired)` for every transition seen from now on."""
        self._listeners.append(listener)

    # -- contexts and steps ------------------------------------------------------------------

    def context(self, **values: Any) -> RunContext:
        """A RunContext for this workflow (its limits and tools), with shortcuts:

        * `last_reply="text"`, `last_reply=call(...)` (or any reply shorthand): the last model
          answer (`last_completion`; a text answer also becomes `answer`);
        * `tool_results=[("read_file", "output", False), ("datetime", "boom", True)]`: the
          last act step's results (`last_results` and `tool_calls`); items are
          (name, output[, is_error]) or ToolCallRecord;
        * `limits={"max_iterations": 2}` (overrides of the workflow's limits) or a Limits;
        * any RunContext field: `iteration=`, `failure_streak=`, `malformed_streak=`,
          `repeat_count=`, `done_answer=`, `fatal_error=`, `malformed_reason=`, `scratch=`,
          `answers=[HumanAnswer.reject("why")]` (for the approved/rejected guards)...

        Counters are never derived: a failed tool result does not raise `failure_streak`, and a
        malformed reply needs `malformed_reason=` (what the malformed_output guard reads).
        """
        unknown = set(values) - _SHORTCUTS - _CONTEXT_FIELDS
        if unknown:
            known = ", ".join(sorted(_SHORTCUTS | _CONTEXT_FIELDS))
            raise TypeError(
                f"unknown context field(s) {', '.join(sorted(unknown))} (known: {known})"
            )
        if "last_reply" in values and "last_completion" in values:
            raise TypeError("give last_reply or last_completion, not both")
        reply = values.pop("last_reply", _MISSING)
        results = values.pop("tool_results", None)
        values["limits"] = self._limits(values.get("limits"))
        values.setdefault("tool_names", tuple(self.spec.tool_names))
        values.setdefault("choices", self.compiled.choices)
        ctx = RunContext(**values)
        if reply is not _MISSING:
            _set_reply(ctx, reply, keep_answer="answer" in values)
        if results is not None:
            ctx.last_results = [_tool_record(item, ctx.iteration) for item in results]
            if "tool_calls" not in values:
                ctx.tool_calls = list(ctx.last_results)
        return ctx

    def step(
        self,
        state: str,
        /,
        *,
        context: RunContext | None = None,
        raised: BaseException | None = None,
        history: Mapping[str, str] | None = None,
        choice: str | None = None,
        event: str | None = None,
        data: Any = None,
        elapsed: float | str | None = None,
        **values: Any,
    ) -> FiredTransition:
        """Put a fresh machine in `state` with a context (`context=`, or built by `context()`
        from `values`), fire one step without running any action, and return the transition.

        `raised=exc` steps as if the state's action had failed with `exc` (after its retries):
        the first of the state's `catch:` entries that handles it fires, and the failure
        becomes `ctx.caught`. When none handles it, `exc` is raised, as a run would end with
        it (`agent_error` for an AgentError, else `error`).

        In a workflow with compound states, `state` may be a compound state (the step starts in
        its initial child, at any depth) or a final child (its parent's `completed` edges are
        tried); `history={"research": "act"}` says where the run last was inside a compound
        state, for edges with `enter: history`. The edges of the states `state` is inside are
        tried first, as in a run; `fired.path_to` is the full path of the state entered.

        In an agent.decide state, `choice="look something up"` is the model's pick: the choices
        whose guards hold in the context are what the model would be offered, and the pick must
        be one of them (ValueError otherwise). Without `choice=`, no choice edge fires: when
        none is offered the state's fallback edge does, else only an edge of its own guards
        (`malformed_output` with `malformed_reason=`, say), as after replies that never picked.

        In a waiting state (no action; `event:`/`after:` edges), `event="ci_passed"` (with its
        JSON `data=`, read by guards and templates as `event.data`) is the event delivered, and
        `elapsed=1800` (seconds, or "30m") is how long the run has waited: the earliest timer
        due by then fires, as a fake clock moved on that far would make it. Without either, only
        the state's guarded edges that need no event are tried (what it does before it waits).
        """
        if state not in self.spec.states:
            raise ValueError(f"unknown state {state!r} (states: {', '.join(self.spec.states)})")
        if self.spec.ends_run(state):
            raise ValueError(f"state {state!r} is final: no transition leaves it")
        if context is not None and values:
            raise TypeError("give context= or context fields, not both")
        ctx = context if context is not None else self.context(**values)
        state = self.spec.entry(state)  # a compound state: its initial child, at any depth
        ctx.state_spec = self.spec.states[state]
        if raised is not None:
            _fail_action(ctx, state, raised)
        machine = self.compiled.instantiate(ctx, start=state)
        machine.last_inside.update(history or {})
        if decides(self.spec, state):
            self._pick(ctx, state, choice)
        elif choice is not None:
            raise ValueError(f"choice= is for agent.decide states; {state!r} is not one")
        self._wake(ctx, state, event, data, elapsed)
        fired = machine.step()
        self._seen(fired)
        return fired

    def _wake(
        self, ctx: RunContext, state: str, event: str | None, data: Any, elapsed: float | str | None
    ) -> None:
        """What delivering `event`, or waiting `elapsed`, leaves in the context (see step)."""
        if event is None and elapsed is None:
            return
        if event is not None and elapsed is not None:
            raise TypeError("give event= or elapsed=, not both: one wakes a waiting state")
        waits = self.compiled.waits.get(state)
        if waits is None:
            raise ValueError(f"state {state!r} does not wait: it has an action or no event/timer")
        if event is not None:
            if event not in waits.events:
                awaited = ", ".join(waits.events) or "no event"
                raise ValueError(f"state {state!r} waits for {awaited}, not event {event!r}")
            ctx.event = {"name": event, "data": data}
            ctx.notes.trigger = ("event", event)
            return
        seconds = _seconds(elapsed)
        due = sorted((after, edge) for edge, after in waits.timers if after <= seconds)
        if not due:
            timers = ", ".join(f"{after:g} s" for _, after in waits.timers) or "none"
            raise ValueError(
                f"no timer of state {state!r} is due after {seconds:g} s (its timers: {timers})"
            )
        ctx.notes.trigger = ("timer", due[0][1])

    def choices(self, state: str, /, **values: Any) -> list[str]:
        """The choices agent.decide state `state` would offer the model in a context built by
        `context(**values)`: those whose edges' guards hold, in file order."""
        if not decides(self.spec, state):
            raise ValueError(f"state {state!r} does not run agent.decide")
        ctx = self.context(**values)
        ctx.current_state = state
        return list(legal_choices(ctx))

    def _pick(self, ctx: RunContext, state: str, choice: str | None) -> None:
        """What agent.decide leaves in the context when the model picks `choice`."""
        ctx.choices = self.compiled.choices
        offered = legal_choices(ctx)
        texts = [c.text for c in self.compiled.choices.get(state, ())]
        if choice is not None and choice not in texts:
            raise ValueError(f"state {state!r} has no choice {choice!r} (its choices: {texts})")
        if choice is not None and choice not in offered:
            raise ValueError(
                f"choice {choice!r} is not offered here: its edge's guards do not hold "
                f"(offered: {list(offered)})"
            )
        ctx.offered_choices, ctx.choice = offered, choice

    def _seen(self, fired: FiredTransition) -> None:
        self.fired.append(fired)
        for listener in self._listeners:
            listener(self, fired)

    def _limits(self, given: Limits | Mapping[str, Any] | None) -> Limits:
        if given is None:
            return self.spec.limits
        if isinstance(given, Limits):
            return given
        try:
            return Limits.model_validate({**self.spec.limits.model_dump(), **dict(given)})
        except pydantic.ValidationError as exc:
            problems = "; ".join(f"{e['loc'][0]}: {e['msg']}" for e in exc.errors())
            raise ConfigError(f"invalid limits {dict(given)!r}: {problems}") from exc

    # -- whole runs -------------------------------------------------------------------------

    def run(
        self,
        prompt: str,
        *,
        model: ChatModel,
        tools: ToolExecutor | Iterable[Callable[..., Any]] | None = None,
        workspace: str | Path | None = None,
        limits: Mapping[str, Any] | None = None,
        system_prompt: str | None = None,
        store: EventStore | None = None,
        human: HumanChannel | None = None,
        state_models: Mapping[str, ChatModel] | None = None,
        children: ChildRunner | None = None,
        fire_timers: bool = False,
    ) -> RunResult:
        """Run the whole workflow through the real Kernel (sync; see `arun` in async code).

        Args:
            prompt: the user's request.
            model: the ChatModel, usually a ScriptedChatModel or FunctionChatModel.
            tools: None for the built-in tools plus the workflow's own; a list of extra tool
                functions to add to those; or a ToolExecutor used as is (all its tools offered).
            workspace: the file tools' root (default: a fresh temporary directory).
            limits: overrides of the workflow's limits, e.g. {"max_iterations": 2}.
            system_prompt: instead of the workflow's (memory files are never loaded here).
            store: an EventStore to record into (default: none; events are in the result).
            human: answers a person would give (e.g. `ScriptedHuman([HumanAnswer.approve()])`);
                default: a run that asks suspends (its result's `status` is "waiting").
            state_models: a model per state id, for states with their own `agent:` block
                (default: every state asks `model`).
            children: runs the child runs of workflow.call / workflow.map states (default:
                real runs of the called workflows through the Kernel, asking the same `model`,
                with the same tools, workspace, store and `human`, one after another in the
                order they start).
            fire_timers: True: in a waiting state, once `human` has no event left to
                deliver, the earliest `after:` timer fires at once, on a fake clock moved on by
                its duration (timer.set and timer.fired are recorded as in a real run). False
                (default): a timer due in more than a minute suspends the run, as in production.

        Events are delivered by `human`: `ScriptedHuman([HumanAnswer.signal("ci_passed",
        {"sha": "abc"})])`. A state's `retry:` runs its action again at once: the backoff is not
        waited for (nor a timer).

        Raises:
            AssertionError: a ScriptedChatModel ran out of replies during the run
                (ScriptExhaustedError), or a FunctionChatModel's function failed an assertion.
        """
        return asyncio.run(
            self.arun(
                prompt,
                model=model,
                tools=tools,
                workspace=workspace,
                limits=limits,
                system_prompt=system_prompt,
                store=store,
                human=human,
                state_models=state_models,
                children=children,
                fire_timers=fire_timers,
            )
        )

    async def arun(
        self,
        prompt: str,
        *,
        model: ChatModel,
        tools: ToolExecutor | Iterable[Callable[..., Any]] | None = None,
        workspace: str | Path | None = None,
        limits: Mapping[str, Any] | None = None,
        system_prompt: str | None = None,
        store: EventStore | None = None,
        human: HumanChannel | None = None,
        state_models: Mapping[str, ChatModel] | None = None,
        children: ChildRunner | None = None,
        fire_timers: bool = False,
    ) -> RunResult:
        """`run` for async code (same arguments)."""
        spec = self.spec
        with _workspace(workspace) as root:
            registry, offered, approval = _build_tools(spec, tools, root)
            if children is None:
                children = _HarnessChildren(model, tools, root, store, human)
            clock = _TestClock()
            kernel = Kernel(
                compile_workflow(spec),
                model=model,
                tools=registry,
                store=store,
                system_prompt=spec.system_prompt if system_prompt is None else system_prompt,
                tool_names=offered,
                limits=self._limits(limits),
                human=human,
                approval_required=approval,
                state_models=state_models,
                sleep=clock.sleep,  # a test waits out neither a retry's backoff nor a timer
                clock=clock,
                await_timers=math.inf if fire_timers else AWAIT_IN_PROCESS,
                children=children,
            )
            result = await kernel.run(prompt)
        for event in result.events:
            if event.type is EventType.TRANSITION_TAKEN:
                self._seen(_fired_from_event(spec, event.data))
        if isinstance(model, ScriptedChatModel | FunctionChatModel) and model.failure is not None:
            raise model.failure
        return result


_IN_CHILD: ContextVar[bool] = ContextVar("fsm_kernel_harness_child", default=False)


class _HarnessChildren:
    """A harness run's child runs: real runs of the called workflows, asking the run's model
    (one child at a time, so a scripted model's replies go to them in the order they start)."""

    def __init__(
        self,
        model: ChatModel,
        tools: ToolExecutor | Iterable[Callable[..., Any]] | None,
        root: Path,
        store: EventStore | None,
        human: HumanChannel | None,
    ) -> None:
        self.model, self.tools, self.root, self.store, self.human = (
            model,
            tools,
            root,
            store,
            human,
        )
        self._one_at_a_time = asyncio.Lock()

    async def run(self, request: ChildRequest) -> ChildResult:
        spec = load_workflow(find_workflow(request.workflow, relative_to=request.caller))
        registry, offered, approval = _build_tools(spec, self.tools, self.root)
        kernel = Kernel(
            compile_workflow(spec),
            model=self.model,
            tools=registry,
            store=self.store,
            system_prompt=spec.system_prompt,
            tool_names=offered,
            human=self.human,
            approval_required=approval,
            sleep=_no_wait,
            children=self,
        )
        return await run_child_in_turn(kernel, spec, request, self._one_at_a_time)


async def run_child_in_turn(
    kernel: Kernel, spec: WorkflowSpec, request: ChildRequest, turn: asyncio.Lock
) -> ChildResult:
    """Run one child run on `kernel` under its parent's remaining limits, one child at a time
    (`turn`), so a scripted model's replies go to children in the order they start; a child's
    own children run inside its turn."""
    limits = bounded_limits(spec.limits, request.max_iterations, request.timeout_seconds)
    nested = _IN_CHILD.get()
    async with contextlib.nullcontext() if nested else turn:
        token = _IN_CHILD.set(True)
        try:
            result = await kernel.run(
                request.prompt,
                run_id=request.run_id,
                limits=limits,
                parent_run_id=request.parent_run_id,
            )
        finally:
            _IN_CHILD.reset(token)
    return result.as_child()


async def _no_wait(_seconds: float) -> None:
    return None


class _TestClock:
    """Wall time that starts now and moves on only when the run sleeps (a retry's backoff, a
    timer it waits for), by as long as it sleeps, at once."""

    def __init__(self) -> None:
        self._now = datetime.now(UTC)
        self._mono = 0.0

    def now(self) -> datetime:
        return self._now

    def monotonic(self) -> float:
        return self._mono

    async def sleep(self, seconds: float) -> None:
        self._now += timedelta(seconds=max(seconds, 0.0))
        self._mono += max(seconds, 0.0)


def declared_transitions(spec: WorkflowSpec) -> list[DeclaredTransition]:
    """The declared transitions of `spec`, in file order, then its catch edges."""
    declared = [
        DeclaredTransition(i, t.source, t.target, t.label(), t.reason)
        for i, t in enumerate(spec.transitions)
    ]
    declared += [
        DeclaredTransition(c.index, c.source, c.target, c.label(), c.reason)
        for c in spec.catch_edges()
    ]
    return declared


def _seconds(elapsed: float | str | None) -> float:
    """`elapsed=` in seconds: a number, or a duration such as "30m" (as `after:` takes)."""
    if isinstance(elapsed, int | float) and not isinstance(elapsed, bool):
        return float(elapsed)
    seconds = parse_duration(str(elapsed))
    if seconds is None:
        raise ValueError(f"elapsed={elapsed!r} is not a duration (seconds, or e.g. '30m')")
    return seconds


def _fail_action(ctx: RunContext, state: str, raised: BaseException) -> None:
    """Set the failure a catch edge of `state` routes, or raise it if none would."""
    kind = error_kind(raised)
    if kind is None or first_catch(ctx.state_spec, kind) is None:
        raise raised
    ctx.notes.failure = failure_of(raised, state=state, iteration=ctx.iteration)


def _set_reply(ctx: RunContext, reply: ReplyLike | None, *, keep_answer: bool) -> None:
    ctx.last_completion = None if reply is None else as_completion(reply)
    message = ctx.last_completion.message if ctx.last_completion else None
    if message is not None and not message.tool_calls and not keep_answer:
        ctx.answer = message.content


def _tool_record(item: ToolCallRecord | tuple[Any, ...], iteration: int) -> ToolCallRecord:
    if isinstance(item, ToolCallRecord):
        return item
    if not isinstance(item, tuple) or len(item) not in (2, 3):
        raise TypeError(
            f"a tool result is (name, output[, is_error]) or a ToolCallRecord, not {item!r}"
        )
    name, output = item[0], item[1]
    is_error = bool(item[2]) if len(item) == 3 else False
    result = ToolResult(content=str(output), is_error=is_error)
    return ToolCallRecord(iteration=iteration, call=tool_call(name), result=result)


@contextlib.contextmanager
def _workspace(given: str | Path | None) -> Iterator[Path]:
    if given is not None:
        yield Path(given)
        return
    with tempfile.TemporaryDirectory(prefix="fsm-kernel-test-") as tmp:
        yield Path(tmp)


@contextlib.contextmanager
def build_case_tools(
    spec: WorkflowSpec, files: Mapping[str, str] | None = None
) -> Iterator[tuple[ToolExecutor, list[str]]]:
    """The workflow's real tools (built-ins on a scratch workspace holding `files`, relative
    path -> text; its own tools) and the names it offers, for a scripted case to run the tools
    it does not script (see testing/_cases.py).

    Raises:
        ConfigError: a file's path is absolute or leaves the workspace.
    """
    with _workspace(None) as root:
        for name, text in (files or {}).items():
            target = (root / name).resolve()
            if Path(name).is_absolute() or not target.is_relative_to(root.resolve()):
                raise ConfigError(f"files: {name!r} is not a path inside the workspace")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
        registry, offered, _ = build_tools(spec, RunOptions(workspace=str(root)))
        yield registry, offered


def _build_tools(
    spec: WorkflowSpec, tools: ToolExecutor | Iterable[Callable[..., Any]] | None, root: Path
) -> tuple[ToolExecutor, list[str], frozenset[str]]:
    if isinstance(tools, ToolExecutor):
        names = [t.name for t in tools.list_tools()]
        return tools, names, frozenset(t.name for t in spec.tools if t.approval == "required")
    options = RunOptions(workspace=str(root), extra_tools=list(tools or ()))
    return build_tools(spec, options)


def _fired_from_event(spec: WorkflowSpec, data: Mapping[str, Any]) -> FiredTransition:
    target = str(data["target"])
    return FiredTransition(
        int(data["index"]),
        str(data["source"]),
        target,
        str(data.get("guard") or ""),
        data.get("reason"),
        spec.ends_run(target),
        catch=data.get("catch"),
        path_from=data.get("from"),
        path_to=data.get("to"),
        choice=data.get("choice"),
    )
