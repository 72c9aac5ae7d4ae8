"""Running workflow test files: each case is a whole run through the real kernel with the model,
tools, people, events, timers and child runs it scripts (no model server, no network), checked
against its `expect:`, the first difference named.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fsm_kernel.errors import (
    AgentAuthError,
    AgentBadRequestError,
    AgentConnectionError,
    AgentError,
    AgentHTTPError,
    AgentRateLimitError,
    AgentServerError,
    ConfigError,
    FsmKernelError,
)
from fsm_kernel.kernel import RunResult
from fsm_kernel.protocol import Completion, EventType, Message, Tool, ToolCall, ToolResult, Usage
from fsm_kernel.testing._casefile import (
    AnswerSpec,
    CaseSpec,
    ChildSpec,
    ExpectSpec,
    LoadedTests,
    ReplySpec,
    ToolResultSpec,
)
from fsm_kernel.testing._harness import WorkflowHarness, build_case_tools
from fsm_kernel.workflow.children import ChildRequest, ChildResult
from fsm_kernel.workflow.human import HumanAnswer, Question, Suspended
from fsm_kernel.workflow.spec import TERMINATION_REASONS

__all__ = [
    "CaseChildren",
    "CaseResult",
    "human_answer",
    "reply_completion",
    "run_case",
    "run_test_file",
]


@dataclass
class CaseResult:
    """What one case did: passed, failed (the first difference), or broken (the case cannot
    run as written: a tool the workflow does not offer, limits it rejects...)."""

    file: str
    name: str
    location: str
    passed: bool
    difference: str | None = None
    broken: bool = False
    seconds: float = 0.0
    run: RunResult | None = field(default=None, repr=False)

    @property
    def outcome(self) -> str:
        return "passed" if self.passed else "broken" if self.broken else "failed"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "file": self.file,
            "case": self.name,
            "location": self.location,
            "outcome": self.outcome,
            "seconds": round(self.seconds, 4),
        }
        if self.difference is not None:
            d["difference"] = self.difference
        if self.run is not None:
            d["reason"] = (
                None if self.run.termination_reason is None else str(self.run.termination_reason)
            )
            d["run_id"] = self.run.run_id
        return d


def run_test_file(
    loaded: LoadedTests, harness: WorkflowHarness, *, only: Iterable[str] | None = None
) -> list[CaseResult]:
    """Every case of `loaded` (or those named in `only`), in file order."""
    wanted = None if only is None else set(only)
    return [
        run_case(loaded, harness, name, case)
        for name, case in loaded.spec.cases.items()
        if wanted is None or name in wanted
    ]


def run_case(
    loaded: LoadedTests, harness: WorkflowHarness, name: str, case: CaseSpec
) -> CaseResult:
    """Run one case and compare what it did with its `expect:`."""
    where = str(loaded.where(name))
    impossible = _impossible_reason(harness, case.expect.reason)
    if impossible:
        at = loaded.locations.get(("cases", name, "expect", "reason"))
        where = str(at or where)
        return CaseResult(str(loaded.path), name, where, False, impossible, broken=True)
    started = time.perf_counter()
    try:
        result, unused = asyncio.run(_run(harness, case))
    except (CaseError, ConfigError) as exc:
        message = exc.message if isinstance(exc, FsmKernelError) else str(exc)
        return CaseResult(str(loaded.path), name, where, False, message, broken=True)
    seconds = time.perf_counter() - started
    difference = first_difference(harness, case.expect, result) or unused
    return CaseResult(
        str(loaded.path), name, where, difference is None, difference, seconds=seconds, run=result
    )


def _impossible_reason(harness: WorkflowHarness, reason: str | None) -> str | None:
    """Why `expect: reason:` names a reason no run of the workflow can end with (a typo, or
    a reason of another workflow): the case is broken, whatever the run does."""
    spec = harness.spec
    named = set(spec.edge_reasons())
    possible = set(TERMINATION_REASONS) | set(spec.reasons) | named
    if reason is None or reason in possible:
        return None
    own = sorted(set(spec.reasons) | named)
    return (
        f"expect: reason: {reason!r} is no reason this workflow can end with "
        f"(its own: {', '.join(own) or 'none'}; or one of the kernel's)"
    )


class CaseError(Exception):
    """The case cannot run as written (reported as broken, not failed)."""

    @property
    def message(self) -> str:
        return str(self)


async def _run(harness: WorkflowHarness, case: CaseSpec) -> tuple[RunResult, str | None]:
    """The case's run, and what it scripted that the run never used (a case that scripts
    more than happens says something untrue about the run)."""
    with build_case_tools(harness.spec, case.files) as (real, names):
        unknown = sorted(set(case.tools) - set(names))
        if unknown:
            raise CaseError(
                f"tools: {', '.join(unknown)} not offered by the workflow "
                f"(it offers: {', '.join(sorted(names)) or 'none'})"
            )
        tools = _CaseTools(real, names, case.tools)
        model = _CaseModel(case.model)
        answers = _CaseAnswers([human_answer(harness, a) for a in case.answers])
        result = await harness.arun(
            case.prompt,
            model=model,
            tools=tools,
            human=answers,
            limits=case.limits or None,
            children=None if case.children is None else CaseChildren(case.children),
        )
    return result, _unused(model, tools, answers)


def _unused(model: _CaseModel, tools: _CaseTools, answers: _CaseAnswers) -> str | None:
    if model.asked < len(model.replies):
        return f"model: {len(model.replies) - model.asked} scripted reply(ies) never asked for"
    for name, script in tools.scripts.items():
        if tools.attempts.get(name, 0) < len(script):
            left = len(script) - tools.attempts.get(name, 0)
            return f"tools: {name}: {left} scripted result(s) never used"
    if answers.answers:
        return f"answers: {len(answers.answers)} scripted answer(s) never asked for"
    return None


# -- the scripted collaborators ------------------------------------------------------------


class _CaseModel:
    """The case's replies in order; the last one repeats (a model that keeps calling the same
    tool). A case with no replies fails the run at the first model call."""

    def __init__(self, replies: Sequence[ReplySpec]) -> None:
        self.replies = list(replies)
        self.asked = 0

    async def complete(
        self, messages: Sequence[Message], tools: Sequence[Tool], **_: Any
    ) -> Completion:
        if not self.replies:
            raise CaseModelError("the model was asked, but the case scripts no `model:` reply")
        reply = self.replies[min(self.asked, len(self.replies) - 1)]
        self.asked += 1
        if reply.error is not None:
            raise _failure(reply)
        return reply_completion(reply, f"call_{self.asked}")


class CaseModelError(FsmKernelError):
    """The case's model has nothing to answer."""


def _failure(reply: ReplySpec) -> AgentError:
    """The model server's failure a reply scripts (`error:`, with `status:` an HTTP one)."""
    message, status = str(reply.error), reply.status
    if status is None:
        return AgentConnectionError(message)
    kind: type[AgentHTTPError] = AgentBadRequestError
    if status >= 500 or status in (408, 409):
        kind = AgentServerError
    elif status == 429:
        kind = AgentRateLimitError
    elif status in (401, 403):
        kind = AgentAuthError
    return kind(message, status_code=status)


def reply_completion(reply: ReplySpec, ids: str) -> Completion:
    """A scripted reply as the model's answer; its tool calls get the ids IDS_0, IDS_1..."""
    calls = [_call(c.name, c.arguments, f"{ids}_{i}") for i, c in enumerate(reply.tool_calls or ())]
    text = reply.text if reply.text is not None else ""
    if "json_value" in reply.model_fields_set:
        text = json.dumps(reply.json_value, ensure_ascii=False)
    message = Message.assistant(text, calls)
    finish = reply.finish_reason or ("tool_calls" if calls else "stop")
    return Completion(message=message, finish_reason=finish, usage=Usage())


def _call(name: str, arguments: dict[str, Any] | str, call_id: str) -> ToolCall:
    if isinstance(arguments, dict):
        return ToolCall(id=call_id, name=name, arguments=arguments)
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError as exc:
        return ToolCall(id=call_id, name=name, raw_arguments=arguments, arguments_error=str(exc))
    if isinstance(parsed, dict):
        return ToolCall(id=call_id, name=name, arguments=parsed)
    return ToolCall(
        id=call_id, name=name, raw_arguments=arguments, arguments_error="not a JSON object"
    )


class _CaseTools:
    """The workflow's tools, those the case scripts answering from their script (by attempt,
    the last result repeating), the others running for real in a scratch workspace."""

    def __init__(
        self, real: Any, offered: Sequence[str], scripts: Mapping[str, Sequence[ToolResultSpec]]
    ) -> None:
        self.real, self.offered = real, list(offered)
        self.scripts = {name: list(results) for name, results in scripts.items()}
        self.attempts: dict[str, int] = {}

    def list_tools(self, names: Sequence[str] | None = None) -> list[Tool]:
        tools: list[Tool] = self.real.list_tools(self.offered if names is None else names)
        return tools

    async def execute(self, call: ToolCall) -> ToolResult:
        script = self.scripts.get(call.name)
        if not script:
            result: ToolResult = await self.real.execute(call)
            return result
        n = self.attempts.get(call.name, 0)
        self.attempts[call.name] = n + 1
        scripted = script[min(n, len(script) - 1)]
        if scripted.error is not None:
            return ToolResult(content=scripted.error, is_error=True, fatal=scripted.fatal)
        value = scripted.returns
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        return ToolResult(content=text)


class _CaseAnswers:
    """A person's answers and the outside world's events and timers, in order; once they run
    out the run suspends (its status is then `waiting`)."""

    def __init__(self, answers: list[HumanAnswer]) -> None:
        self.answers = answers

    async def ask(self, question: Question) -> HumanAnswer:
        if not self.answers:
            raise Suspended(question)
        return self.answers.pop(0)


class CaseChildren:
    """Child runs that end as the case says, in the order they start."""

    def __init__(self, children: Sequence[ChildSpec]) -> None:
        self.children = list(children)
        self.started = 0

    async def run(self, request: ChildRequest) -> ChildResult:
        if self.started >= len(self.children):
            raise CaseModelError(
                f"child run {self.started + 1} ({request.workflow}) started, but the case "
                f"scripts {len(self.children)} under `children:`"
            )
        child = self.children[self.started]
        self.started += 1
        return ChildResult(
            run_id=request.run_id,
            workflow=request.workflow,
            reason=child.reason or ("final_answer" if child.ok else "error"),
            ok=child.ok,
            answer=child.answer,
            output=child.output,
            iterations=child.iterations,
        )


def human_answer(harness: WorkflowHarness, a: AnswerSpec) -> HumanAnswer:
    """A scripted answer as the run receives it."""
    if a.approve:
        return HumanAnswer.approve(by=a.by)
    if a.reject is not None:
        return HumanAnswer.reject(a.reject, by=a.by)
    if a.input is not None:
        return HumanAnswer.input(a.input, by=a.by)
    if a.event is not None:
        return HumanAnswer.signal(a.event, a.data, by=a.by)
    return HumanAnswer.timer_fired(_timer_edge(harness, a.timer))


def _timer_edge(harness: WorkflowHarness, timer: int | str | None) -> int:
    """The `after:` edge a timer answer names: by index, or by its duration as written."""
    spec = harness.spec
    if isinstance(timer, int):
        if 0 <= timer < len(spec.transitions) and spec.transitions[timer].after is not None:
            return timer
        raise CaseError(f"answers: timer {timer}: transition {timer} has no `after:`")
    for index, t in enumerate(spec.transitions):
        if t.after is not None and t.after == timer:
            return index
    raise CaseError(f"answers: timer {timer!r}: no transition has `after: {timer}`")


# -- comparing ---------------------------------------------------------------------------


def run_path(harness: WorkflowHarness, result: RunResult) -> list[tuple[str, str]]:
    """(leaf id, full path) of each state the run was in, in order, ending with the final one
    (which records no state.entered)."""
    spec = harness.spec
    out = [
        (str(e.state), str(e.data.get("path") or e.state))
        for e in result.events
        if e.type is EventType.STATE_ENTERED
    ]
    taken = [e for e in result.events if e.type is EventType.TRANSITION_TAKEN]
    if result.status == "ended" and taken:
        last = str(taken[-1].data["target"])
        if spec.ends_run(last):
            out.append((last, spec.state_path(last)))
    return out


def first_difference(harness: WorkflowHarness, expect: ExpectSpec, result: RunResult) -> str | None:
    """What the run did first that the case does not expect, in one line; None when it did
    everything the case expects."""
    if expect.path is not None:
        found = _path_difference(expect.path, run_path(harness, result))
        if found is not None:
            return found
    for check in _CHECKS:
        found = check(expect, result)
        if found is not None:
            return found
    return None


def _path_difference(expected: Sequence[str], actual: Sequence[tuple[str, str]]) -> str | None:
    for i, want in enumerate(expected):
        if i >= len(actual):
            last = actual[-1][1] if actual else "(nothing)"
            return f"step {i + 1}: expected state {want}, but the run ended in {last}"
        leaf, full = actual[i]
        got = full if "." in want else leaf
        if got != want:
            return f"step {i + 1}: expected state {want}, got {got}"
    if len(actual) > len(expected):
        extra = actual[len(expected)]
        return f"step {len(expected) + 1}: expected the run to have ended, it went on to {extra[1]}"
    return None


def _reason(expect: ExpectSpec, result: RunResult) -> str | None:
    got = None if result.termination_reason is None else str(result.termination_reason)
    if expect.reason is None or expect.reason == got:
        return None
    why = f" ({result.error})" if result.error else ""
    return f"reason: expected {expect.reason}, got {got or result.status}{why}"


def _status(expect: ExpectSpec, result: RunResult) -> str | None:
    if expect.status is None or expect.status == result.status:
        return None
    return f"status: expected {expect.status}, got {result.status}"


def _response(expect: ExpectSpec, result: RunResult) -> str | None:
    if expect.response is not None and result.response != expect.response:
        return f"response: expected {expect.response!r}, got {_cut(result.response)!r}"
    if expect.response_contains is not None and expect.response_contains not in result.response:
        return (
            f"response: expected it to contain {expect.response_contains!r}, got "
            f"{_cut(result.response)!r}"
        )
    return None


def _output(expect: ExpectSpec, result: RunResult) -> str | None:
    if "output" not in expect.model_fields_set or expect.output == result.output:
        return None
    return f"output: expected {json.dumps(expect.output)}, got {json.dumps(result.output)}"


def _tools_called(expect: ExpectSpec, result: RunResult) -> str | None:
    if expect.tools_called is None:
        return None
    called = [record.call.name for record in result.tool_calls]
    if called == expect.tools_called:
        return None
    return f"tools called: expected {expect.tools_called}, got {called}"


def _error(expect: ExpectSpec, result: RunResult) -> str | None:
    if expect.error_contains is None or expect.error_contains in (result.error or ""):
        return None
    return f"error: expected it to contain {expect.error_contains!r}, got {result.error!r}"


def _iterations(expect: ExpectSpec, result: RunResult) -> str | None:
    if expect.iterations is None or expect.iterations == result.iterations:
        return None
    return f"iterations: expected {expect.iterations}, got {result.iterations}"


def _vars(expect: ExpectSpec, result: RunResult) -> str | None:
    if expect.vars is None:
        return None
    final = dict(_assigned(result))
    for name, want in expect.vars.items():
        if name not in final or final[name] != want:
            got = json.dumps(final[name]) if name in final else "never assigned"
            return f"vars.{name}: expected {json.dumps(want)}, got {got}"
    return None


def _waiting(expect: ExpectSpec, result: RunResult) -> str | None:
    got = (result.waiting_for or {}).get("kind")
    if expect.waiting_for is None or expect.waiting_for == got:
        return None
    return f"waiting_for: expected {expect.waiting_for}, got {got or 'nothing (it ended)'}"


def _assigned(result: RunResult) -> Iterator[tuple[str, Any]]:
    for e in result.events:
        if e.type is EventType.VARS_ASSIGNED:
            yield str(e.data["name"]), e.data.get("value")


_CHECKS = (
    _status,
    _reason,
    _error,
    _waiting,
    _response,
    _output,
    _tools_called,
    _iterations,
    _vars,
)


def _cut(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
