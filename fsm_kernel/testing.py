"""Public test kit: fake chat models and a transition-level harness for workflows, so users test
their own workflows (and their own actions and guards) without a model server.

It sits on top of the kernel (it drives real runs), so nothing inside fsm_kernel imports it.

A transition test, then a whole run with a scripted model::

    from fsm_kernel.testing import ScriptedChatModel, WorkflowHarness, call

    harness = WorkflowHarness("react")                     # a path, a stock name or a spec
    fired = harness.step("think", last_reply=call("read_file", {"path": "a.txt"}))
    assert fired.target == "act"

    model = ScriptedChatModel(["I should read a.txt.", call("read_file", {"path": "a.txt"}),
                               "It says 42; I can answer.", "42", "a.txt says 42."])
    result = harness.run("What is in a.txt?", model=model, workspace=tmp_path)
    assert result.termination_reason == "final_answer"
    model.assert_complete()
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import logging
import tempfile
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, NamedTuple

import pydantic

from fsm_kernel.bootstrap import RunOptions, build_tools, resolve_workflow
from fsm_kernel.errors import ConfigError
from fsm_kernel.kernel import Kernel, RunResult
from fsm_kernel.protocol import (
    ChatModel,
    Completion,
    EventStore,
    EventType,
    Message,
    Role,
    Tool,
    ToolCall,
    ToolExecutor,
    ToolResult,
    Usage,
)
from fsm_kernel.workflow.compiler import CompiledWorkflow, FiredTransition, compile_workflow
from fsm_kernel.workflow.context import RunContext, ToolCallRecord
from fsm_kernel.workflow.loader import load_workflow
from fsm_kernel.workflow.spec import Limits, WorkflowSpec

__all__ = [
    "CoverageCase",
    "DeclaredTransition",
    "FunctionChatModel",
    "ModelRequest",
    "ReplyLike",
    "ScriptExhaustedError",
    "ScriptItem",
    "ScriptedChatModel",
    "TransitionCoverage",
    "WorkflowHarness",
    "as_completion",
    "assert_all_transitions_covered",
    "bad_call",
    "call",
    "calls",
    "text_reply",
    "tool_call",
    "uncovered_transitions",
]

logger = logging.getLogger(__name__)

ReplyLike = Completion | Message | str
"""What a fake model may answer: a Completion, an assistant Message, or a str (a text answer)."""
ScriptItem = ReplyLike | BaseException
"""A ScriptedChatModel's script item: a reply, or an exception instance to raise."""
ModelFn = Callable[[list[Message], list[Tool]], ReplyLike | Awaitable[ReplyLike]]

_call_ids = itertools.count(1)


# --- replies -------------------------------------------------------------------------------


def tool_call(
    name: str, arguments: Mapping[str, Any] | None = None, *, id: str | None = None
) -> ToolCall:
    """One tool call (an id like `call_7` is made up when none is given)."""
    return ToolCall(id=id or f"call_{next(_call_ids)}", name=name, arguments=dict(arguments or {}))


def text_reply(
    content: str, *, reasoning: str | None = None, usage: Usage | None = None
) -> Completion:
    """A plain answer (what a bare str in a script means)."""
    message = Message(role=Role.ASSISTANT, content=content, reasoning=reasoning)
    return Completion(message=message, finish_reason="stop", usage=usage or Usage())


def call(
    name: str,
    arguments: Mapping[str, Any] | None = None,
    *,
    id: str | None = None,
    content: str = "",
) -> Completion:
    """A reply asking for one tool call: `call("read_file", {"path": "a.txt"})`."""
    return calls(tool_call(name, arguments, id=id), content=content)


def calls(
    *items: ToolCall | Completion | tuple[str, Mapping[str, Any]], content: str = ""
) -> Completion:
    """A reply asking for several tool calls at once (parallel calls).

    Each item is a ToolCall, a `call(...)` reply (its calls are taken) or a `(name, arguments)`
    pair: `calls(("datetime", {}), call("read_file", {"path": "a.txt"}))`.
    """
    tool_calls: list[ToolCall] = []
    for item in items:
        if isinstance(item, ToolCall):
            tool_calls.append(item)
        elif isinstance(item, Completion):
            tool_calls.extend(item.message.tool_calls)
        elif isinstance(item, tuple) and len(item) == 2:
            tool_calls.append(tool_call(item[0], item[1]))
        else:
            raise TypeError(f"calls() takes ToolCall, call(...) or (name, arguments), not {item!r}")
    message = Message.assistant(content, tool_calls)
    return Completion(message=message, finish_reason="tool_calls")


def bad_call(name: str, raw_arguments: str = "{not json", *, id: str | None = None) -> Completion:
    """A reply whose tool call has arguments that are not JSON: `agent.think` flags it as
    malformed output (what a model server's broken tool call turns into)."""
    broken = ToolCall(
        id=id or f"call_{next(_call_ids)}",
        name=name,
        raw_arguments=raw_arguments,
        arguments_error="Expecting property name enclosed in double quotes",
    )
    return Completion(message=Message.assistant("", [broken]), finish_reason="tool_calls")


def as_completion(item: ReplyLike) -> Completion:
    """A Completion from any reply shorthand (TypeError for anything else)."""
    if isinstance(item, Completion):
        return item
    if isinstance(item, str):
        return text_reply(item)
    if isinstance(item, Message):
        finish = "tool_calls" if item.tool_calls else "stop"
        return Completion(message=item, finish_reason=finish)
    raise TypeError(
        f"a reply must be a Completion, an assistant Message or a str, not {type(item).__name__}"
    )


# --- fake models -----------------------------------------------------------------------------


class ScriptExhaustedError(AssertionError):
    """A ScriptedChatModel was asked for more replies than its script holds."""


@dataclass(frozen=True)
class ModelRequest:
    """One call a fake model received."""

    messages: tuple[Message, ...]
    tools: tuple[Tool, ...]
    tool_choice: str | None = None
    """The state's `tool_choice:`, when it set one."""

    @property
    def tool_names(self) -> list[str]:
        return [t.name for t in self.tools]

    @property
    def last_message(self) -> Message | None:
        return self.messages[-1] if self.messages else None


class ScriptedChatModel:
    """A ChatModel answering from a script, in order; it records every request.

    Script items: a str (a text answer), `call(...)` / `calls(...)` (tool calls), a Completion
    or assistant Message, or an exception instance, which is raised (e.g.
    `AgentConnectionError("down")` ends a run as `agent_error`)::

        model = ScriptedChatModel([call("datetime"), "It is Monday."])
        ...
        assert model.requests[1].last_message.role == "tool"
        model.assert_complete()

    Asked once more than scripted, it raises ScriptExhaustedError (an AssertionError) and keeps
    it in `failure`; `WorkflowHarness.run` raises it again so the test fails with that message.
    """

    def __init__(self, replies: Iterable[ScriptItem] = ()) -> None:
        self._script: deque[Completion | BaseException] = deque()
        self.requests: list[ModelRequest] = []
        self.failure: ScriptExhaustedError | None = None
        """Set when the script ran out (inside a run the kernel turns the raise into an `error`
        termination; `WorkflowHarness.run` raises it again)."""
        self.add(*replies)

    def add(self, *replies: ScriptItem) -> None:
        """Append replies to the script."""
        for item in replies:
            self._script.append(item if isinstance(item, BaseException) else as_completion(item))

    @property
    def remaining(self) -> int:
        """Replies not used yet."""
        return len(self._script)

    async def complete(
        self, messages: Sequence[Message], tools: Sequence[Tool], *, tool_choice: str | None = None
    ) -> Completion:
        self.requests.append(ModelRequest(tuple(messages), tuple(tools), tool_choice))
        if not self._script:
            self.failure = ScriptExhaustedError(self._exhausted_message())
            logger.warning("scripted model: %s", self.failure)
            raise self.failure
        item = self._script.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    def _exhausted_message(self) -> str:
        used = len(self.requests) - 1
        last = self.requests[-1].last_message
        preview = (
            f"; the last message was {last.role.value}: {last.content[:120]!r}" if last else ""
        )
        return (
            f"the scripted model got request #{used + 1} but only {used} reply(ies) were "
            f"scripted{preview}"
        )

    def assert_complete(self) -> None:
        """AssertionError if scripted replies were never requested."""
        __tracebackhide__ = True
        if self._script:
            raise AssertionError(
                f"{len(self._script)} scripted reply(ies) never requested "
                f"(the model was asked {len(self.requests)} time(s))"
            )


class FunctionChatModel:
    """A ChatModel whose replies a function builds from the request: for answers that depend
    on the conversation. `fn(messages, tools)` returns a reply shorthand (str, Completion, ...)
    and may be async; what it raises propagates like a model error::

        def echo(messages, tools):
            return f"you said: {messages[-1].content}"

        harness.run("hello", model=FunctionChatModel(echo))
    """

    def __init__(self, fn: ModelFn) -> None:
        self._fn = fn
        self.requests: list[ModelRequest] = []
        self.failure: AssertionError | None = None
        """The first AssertionError `fn` raised (a failed check inside the model function would
        otherwise only end the run as `error`; `WorkflowHarness.run` raises it again)."""

    async def complete(
        self, messages: Sequence[Message], tools: Sequence[Tool], *, tool_choice: str | None = None
    ) -> Completion:
        self.requests.append(ModelRequest(tuple(messages), tuple(tools), tool_choice))
        try:
            result = self._fn(list(messages), list(tools))
            if inspect.isawaitable(result):
                result = await result
        except AssertionError as exc:
            self.failure = self.failure or exc
            raise
        return as_completion(result)


# --- the harness -----------------------------------------------------------------------------


class DeclaredTransition(NamedTuple):
    """A transition as the workflow file declares it."""

    index: int  # type: ignore[assignment]  # shadows tuple.index, named like FiredTransition's
    source: str
    target: str
    guard: str
    """The guard label, e.g. "malformed_output and not retries_exhausted"; "" when unguarded."""
    reason: str | None


CoverageCase = FiredTransition | DeclaredTransition | tuple[str, str, str]
"""A transition a test exercised: what `step()` returned, or (source, target, guard label)."""
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
            self.spec = load_workflow(resolve_workflow(workflow))
        self.compiled: CompiledWorkflow = compile_workflow(self.spec)
        self.fired: list[FiredTransition] = []
        """Every transition this harness saw fire, by `step()` or `run()`, in order."""
        self._listeners: list[StepListener] = []

    def __repr__(self) -> str:
        return f"WorkflowHarness({self.spec.path!r})"

    @property
    def transitions(self) -> list[DeclaredTransition]:
        """The declared transitions, in file order."""
        return [
            DeclaredTransition(i, t.source, t.target, t.label(), t.reason)
            for i, t in enumerate(self.spec.transitions)
        ]

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
          `repeat_count=`, `done_answer=`, `fatal_error=`, `malformed_reason=`, `scratch=`...

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
        values.setdefault("tool_names", tuple(self.spec.tools))
        ctx = RunContext(**values)
        if reply is not _MISSING:
            _set_reply(ctx, reply, keep_answer="answer" in values)
        if results is not None:
            ctx.last_results = [_tool_record(item, ctx.iteration) for item in results]
            if "tool_calls" not in values:
                ctx.tool_calls = list(ctx.last_results)
        return ctx

    def step(
        self, state: str, /, *, context: RunContext | None = None, **values: Any
    ) -> FiredTransition:
        """Put a fresh machine in `state` with a context (`context=`, or built by `context()`
        from `values`), fire one step without running any action, and return the transition.
        """
        if state not in self.spec.states:
            raise ValueError(f"unknown state {state!r} (states: {', '.join(self.spec.states)})")
        if self.spec.states[state].final:
            raise ValueError(f"state {state!r} is final: no transition leaves it")
        if context is not None and values:
            raise TypeError("give context= or context fields, not both")
        ctx = context if context is not None else self.context(**values)
        ctx.state_spec = self.spec.states[state]
        fired = self.compiled.instantiate(ctx, start=state).step()
        self._seen(fired)
        return fired

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
    ) -> RunResult:
        """`run` for async code (same arguments)."""
        spec = self.spec
        with _workspace(workspace) as root:
            registry, offered = _build_tools(spec, tools, root)
            kernel = Kernel(
                compile_workflow(spec),
                model=model,
                tools=registry,
                store=store,
                system_prompt=spec.system_prompt if system_prompt is None else system_prompt,
                tool_names=offered,
                limits=self._limits(limits),
            )
            result = await kernel.run(prompt)
        for event in result.events:
            if event.type is EventType.TRANSITION_TAKEN:
                self._seen(_fired_from_event(spec, event.data))
        if isinstance(model, ScriptedChatModel | FunctionChatModel) and model.failure is not None:
            raise model.failure
        return result


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


def _build_tools(
    spec: WorkflowSpec, tools: ToolExecutor | Iterable[Callable[..., Any]] | None, root: Path
) -> tuple[ToolExecutor, list[str]]:
    if isinstance(tools, ToolExecutor):
        return tools, [t.name for t in tools.list_tools()]
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
        spec.states[target].final,
    )


# --- coverage --------------------------------------------------------------------------------


def _spec_of(workflow: WorkflowHarness | WorkflowSpec) -> WorkflowSpec:
    return workflow.spec if isinstance(workflow, WorkflowHarness) else workflow


def _case_indexes(spec: WorkflowSpec, case: CoverageCase) -> set[int]:
    """The declared transitions a case stands for; ValueError if it matches none."""
    if isinstance(case, FiredTransition | DeclaredTransition):
        index, source, target = case.index, case.source, case.target
        if 0 <= index < len(spec.transitions):
            declared = spec.transitions[index]
            if (declared.source, declared.target) == (source, target):
                return {index}
        raise ValueError(f"transition #{index} {source} -> {target} is not from {spec.path}")
    source, target, guard = case
    found = {
        i
        for i, t in enumerate(spec.transitions)
        if (t.source, t.target, t.label()) == (source, target, guard)
    }
    if not found:
        raise ValueError(f"case {case!r} matches no declared transition of {spec.path}")
    return found


def uncovered_transitions(
    workflow: WorkflowHarness | WorkflowSpec, cases: Iterable[CoverageCase]
) -> list[DeclaredTransition]:
    """The declared transitions none of `cases` exercised."""
    spec = _spec_of(workflow)
    covered: set[int] = set()
    for case in cases:
        covered |= _case_indexes(spec, case)
    return [
        DeclaredTransition(i, t.source, t.target, t.label(), t.reason)
        for i, t in enumerate(spec.transitions)
        if i not in covered
    ]


def _describe(t: DeclaredTransition) -> str:
    guard = f" [{t.guard}]" if t.guard else ""
    reason = f" ({t.reason})" if t.reason else ""
    return f"  #{t.index} {t.source} -> {t.target}{guard}{reason}"


def assert_all_transitions_covered(
    workflow: WorkflowHarness | WorkflowSpec, cases: Iterable[CoverageCase]
) -> None:
    """Fail listing every declared transition that no case exercised.

    `cases` are the FiredTransitions your tests observed (`harness.fired`, or what `step()`
    returned) or (source, target, guard label) triples; a triple that matches no declared
    transition is a ValueError, so a typo cannot pass unnoticed::

        assert_all_transitions_covered(harness, [harness.step(s, **ctx) for s, ctx in CASES])
    """
    __tracebackhide__ = True
    missing = uncovered_transitions(workflow, cases)
    if missing:
        spec = _spec_of(workflow)
        lines = "\n".join(_describe(t) for t in missing)
        raise AssertionError(
            f"{len(missing)} of {len(spec.transitions)} declared transition(s) of {spec.path} "
            f"never exercised:\n{lines}"
        )


class TransitionCoverage:
    """Collects the transitions that watched harnesses fire, per workflow, and checks that each
    workflow had all of its declared transitions exercised (the pytest plugin keeps one per test
    module)::

        coverage = TransitionCoverage()
        harness = coverage.watch(WorkflowHarness("react"))
        ...                                    # steps and runs
        coverage.assert_all_covered()          # every watched workflow
    """

    def __init__(self) -> None:
        self._specs: dict[tuple[str, str, str], WorkflowSpec] = {}
        self._fired: dict[tuple[str, str, str], list[FiredTransition]] = {}

    def watch(self, harness: WorkflowHarness) -> WorkflowHarness:
        """Record what `harness` fires from now on; returns it."""
        self._entry(harness.spec)
        harness.add_listener(self.record)
        return harness

    def record(self, harness: WorkflowHarness, fired: FiredTransition) -> None:
        self._fired[self._entry(harness.spec)].append(fired)

    def _entry(self, spec: WorkflowSpec) -> tuple[str, str, str]:
        key = _workflow_key(spec)
        self._specs.setdefault(key, spec)
        self._fired.setdefault(key, [])
        return key

    def fired(self, workflow: str | Path | WorkflowSpec | WorkflowHarness) -> list[FiredTransition]:
        """The transitions recorded for one workflow."""
        return list(self._fired.get(_workflow_key(_as_spec(workflow)), []))

    def assert_all_covered(
        self, workflow: str | Path | WorkflowSpec | WorkflowHarness | None = None
    ) -> None:
        """Fail listing uncovered transitions of `workflow` (default: every watched one)."""
        __tracebackhide__ = True
        if workflow is not None:
            spec = _as_spec(workflow)
            assert_all_transitions_covered(spec, self._fired.get(_workflow_key(spec), []))
            return
        if not self._specs:
            raise AssertionError("no workflow was watched: nothing to check")
        problems = []
        for key, spec in self._specs.items():
            try:
                assert_all_transitions_covered(spec, self._fired[key])
            except AssertionError as exc:
                problems.append(str(exc))
        if problems:
            raise AssertionError("\n".join(problems))


def _workflow_key(spec: WorkflowSpec) -> tuple[str, str, str]:
    return (
        spec.name,
        str(Path(spec.path).resolve()) if spec.path != "<string>" else "",
        spec.content_hash,
    )


def _as_spec(workflow: str | Path | WorkflowSpec | WorkflowHarness) -> WorkflowSpec:
    if isinstance(workflow, WorkflowHarness):
        return workflow.spec
    if isinstance(workflow, WorkflowSpec):
        return workflow
    return load_workflow(resolve_workflow(workflow))
