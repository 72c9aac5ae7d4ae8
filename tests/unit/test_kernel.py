"""Kernel: every termination reason reached through a scripted ChatModel and the real tool
registry, each reported with the partial result, and the event log each run leaves behind."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pydantic
import pytest

from fsm_kernel.errors import AgentConnectionError, ToolFatalError
from fsm_kernel.kernel import Kernel, RunResult
from fsm_kernel.protocol import (
    ChatModel,
    Completion,
    Event,
    EventType,
    Message,
    Role,
    Tool,
    ToolCall,
    Usage,
)
from fsm_kernel.store import SqliteEventStore
from fsm_kernel.tools import ToolRegistry, builtin_registry
from fsm_kernel.workflow.compiler import compile_workflow
from fsm_kernel.workflow.context import RunContext
from fsm_kernel.workflow.loader import load_workflow, load_workflow_text
from fsm_kernel.workflow.spec import WorkflowSpec

REPO = Path(__file__).resolve().parents[2]
DEFAULT = REPO / "workflows" / "default.yaml"
_ids = itertools.count(1)

Step = Completion | BaseException | Callable[[], Awaitable[Completion]]


# --- test doubles -----------------------------------------------------------------------------


@dataclass
class Request:
    messages: list[Message]
    tools: list[str]


@dataclass
class ScriptedModel:
    """Each `complete` takes the next scripted step: a Completion, an exception to raise, or a
    coroutine function to await (for a model that hangs)."""

    steps: list[Step]
    requests: list[Request] = field(default_factory=list)

    async def complete(self, messages: Sequence[Message], tools: Sequence[Tool]) -> Completion:
        self.requests.append(Request(list(messages), [t.name for t in tools]))
        if not self.steps:
            raise AssertionError(f"the script ran out at request #{len(self.requests)}")
        step = self.steps.pop(0)
        if isinstance(step, Completion):
            return step
        if isinstance(step, BaseException):
            raise step
        return await step()


class Hang:
    """A model step that blocks until released; `entered` says the kernel is waiting on it."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self) -> Completion:
        self.entered.set()
        await self.release.wait()
        return answer("too late")


def tool_call(name: str, arguments: dict[str, Any] | None = None) -> ToolCall:
    return ToolCall(id=f"call_{next(_ids)}", name=name, arguments=dict(arguments or {}))


def answer(text: str) -> Completion:
    usage = Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5)
    return Completion(message=Message.assistant(text), usage=usage)


def calls(*tool_calls: ToolCall) -> Completion:
    usage = Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5)
    return Completion(
        message=Message.assistant("", tool_calls), finish_reason="tool_calls", usage=usage
    )


def bad_json(name: str = "datetime") -> Completion:
    raw = '{"timezone": "UTC"'
    call = ToolCall(
        id=f"call_{next(_ids)}",
        name=name,
        raw_arguments=raw,
        arguments_error="Expecting ',' delimiter: line 1 column 20 (char 19)",
    )
    return calls(call)


def boom(ctx: RunContext) -> None:
    """A user action with a bug."""
    raise RuntimeError("boom went the action")


def boom_validation(ctx: RunContext) -> None:
    """A user action whose bug is a pydantic ValidationError (a multi-line str())."""
    pydantic.TypeAdapter(int).validate_python("not a number")


def exploding_guard(ctx: RunContext) -> bool:
    raise ValueError("the guard is broken")


def failing_registry(workspace: Path) -> ToolRegistry:
    """The built-ins plus tools that fail in the ways the kernel must tell apart."""
    registry = builtin_registry(workspace)

    def explode(reason: str) -> str:
        """Give up on the whole run.

        Args:
            reason: Why.
        """
        raise ToolFatalError(f"disk is gone: {reason}")

    def flaky(n: int) -> str:
        """Always fails.

        Args:
            n: Any number.
        """
        raise OSError(f"flaky failed on {n}")

    registry.register(explode)
    registry.register(flaky)
    return registry


def default_spec() -> WorkflowSpec:
    return load_workflow(DEFAULT)


def spec_with_limits(max_iterations: int) -> WorkflowSpec:
    """default.yaml with another iteration cap (inline text: the file stays as it is)."""
    text = DEFAULT.read_text(encoding="utf-8")
    assert "  max_iterations: 10\n" in text
    return load_workflow_text(
        text.replace("  max_iterations: 10\n", f"  max_iterations: {max_iterations}\n")
    )


# Without an iteration_limit transition: only the kernel's own cap can stop it.
NO_CAP_TRANSITION = """
name: nocap
tools: [datetime, done]
limits: {max_iterations: 3}
initial: observe
states:
  observe:   {action: session.observe}
  think:     {action: agent.think}
  act:       {action: tools.execute}
  evaluate:  {action: kernel.evaluate}
  terminate: {final: true}
transitions:
  - {source: observe,  target: think}
  - {source: think,    target: act,       guard: has_tool_calls}
  - {source: think,    target: terminate, reason: final_answer}
  - {source: act,      target: evaluate}
  - {source: evaluate, target: terminate, guard: done_called, reason: done}
  - {source: evaluate, target: observe}
"""

BOOM = """
name: boom
tools: [datetime]
initial: observe
states:
  observe:   {action: session.observe}
  think:     {action: agent.think}
  crash:     {action: "tests.unit.test_kernel:boom"}
  terminate: {final: true}
transitions:
  - {source: observe, target: think}
  - {source: think,   target: crash,     guard: has_tool_calls}
  - {source: think,   target: terminate, reason: final_answer}
  - {source: crash,   target: terminate, reason: final_answer}
"""

BAD_GUARD = """
name: badguard
tools: [datetime]
initial: observe
states:
  observe:   {action: session.observe}
  think:     {action: agent.think}
  terminate: {final: true}
transitions:
  - {source: observe, target: think}
  - {source: think,   target: terminate, guard: "tests.unit.test_kernel:exploding_guard",
     reason: done}
  - {source: think,   target: terminate, reason: final_answer}
"""

# A loop that never calls the model, bounded only by a counter far above the transition cap
# (validate refuses a loop nothing bounds): limits.max_transitions ends it first.
SPIN = """
name: spin
limits: {max_transitions: 7}
variables: {n: {type: integer, default: 0}}
initial: observe
states:
  observe:   {action: session.observe}
  evaluate:  {action: kernel.evaluate}
  terminate: {final: true}
transitions:
  - {source: observe,  target: terminate, guard: has_answer, reason: final_answer}
  - {source: observe,  target: evaluate}
  - {source: evaluate, target: observe, when: "vars.n < 1000", assign: {n: "vars.n + 1"}}
  - {source: evaluate, target: terminate, reason: final_answer}
"""

SLOW = """
name: slow
tools: [datetime]
limits: {timeout_seconds: 0.05}
initial: observe
states:
  observe:   {action: session.observe}
  think:     {action: agent.think}
  terminate: {final: true}
transitions:
  - {source: observe, target: think}
  - {source: think,   target: terminate, reason: final_answer}
"""


def make_kernel(
    model: ChatModel,
    workspace: Path,
    *,
    spec: WorkflowSpec | None = None,
    tools: ToolRegistry | None = None,
    tool_names: Sequence[str] | None = None,
    store: SqliteEventStore | None = None,
) -> Kernel:
    return Kernel(
        compile_workflow(spec or default_spec()),
        model=model,
        tools=tools or builtin_registry(workspace),
        store=store,
        system_prompt="be brief",
        tool_names=tool_names,
    )


def run(kernel: Kernel, prompt: str = "What time is it?") -> RunResult:
    return asyncio.run(kernel.run(prompt))


def events_of(result: RunResult, type_: EventType) -> list[Event]:
    return [e for e in result.events if e.type == type_]


def assert_log_shape(result: RunResult) -> None:
    """seq 1..n, run.started first, run.terminated last (once), one iteration.completed each."""
    events = result.events
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert events[0].type == EventType.RUN_STARTED
    assert events[-1].type == EventType.RUN_TERMINATED
    assert len(events_of(result, EventType.RUN_TERMINATED)) == 1
    terminated = events[-1].data
    assert terminated["reason"] == result.termination_reason
    assert terminated["iterations"] == result.iterations
    assert terminated["answer"] == result.response
    steps = [e.data["step"] for e in events_of(result, EventType.ITERATION_COMPLETED)]
    assert steps == list(range(1, result.iterations + 1))
    assert len({e.run_id for e in events}) == 1
    assert all(e.timestamp.tzinfo is not None for e in events)


# --- successful endings -----------------------------------------------------------------------


def test_final_answer_after_one_tool_call_takes_two_iterations(tmp_path: Path) -> None:
    first = tool_call("datetime", {"timezone": "UTC"})
    model = ScriptedModel([calls(first), answer("It is noon UTC.")])

    result = run(make_kernel(model, tmp_path))

    assert result.termination_reason == "final_answer"
    assert result.ok
    assert result.response == "It is noon UTC."
    assert result.iterations == 2
    assert result.error is None
    assert [(r.iteration, r.call.name, r.result.is_error) for r in result.tool_calls] == [
        (1, "datetime", False)
    ]
    assert result.tool_calls[0].result.content.startswith("utc: ")
    assert result.usage == Usage(prompt_tokens=6, completion_tokens=4, total_tokens=10)
    assert [m.role for m in result.messages] == [
        Role.USER,
        Role.ASSISTANT,
        Role.TOOL,
        Role.ASSISTANT,
    ]
    assert result.messages[2].tool_call_id == first.id
    assert not model.steps
    assert_log_shape(result)


def test_model_sees_system_prompt_tools_and_tool_result(tmp_path: Path) -> None:
    first = tool_call("datetime")
    model = ScriptedModel([calls(first), answer("noon")])

    run(make_kernel(model, tmp_path))

    initial, second = model.requests
    assert [m.role for m in initial.messages] == [Role.SYSTEM, Role.USER]
    assert initial.messages[0].content == "be brief"
    assert initial.messages[1].content == "What time is it?"
    assert initial.tools == ["datetime", "read_file", "list_directory", "done"]
    assert second.messages[-1].role == Role.TOOL
    assert second.messages[-1].tool_call_id == first.id
    assert second.messages[-1].content.startswith("utc: ")


def test_done_tool_answer_is_the_response(tmp_path: Path) -> None:
    model = ScriptedModel([calls(tool_call("done", {"answer": "42, finally"}))])

    result = run(make_kernel(model, tmp_path))

    assert result.termination_reason == "done"
    assert result.ok
    assert result.response == "42, finally"
    assert result.iterations == 1
    assert [r.call.name for r in result.tool_calls] == ["done"]
    assert_log_shape(result)


def test_done_without_an_answer_is_a_failed_call_and_the_run_goes_on(tmp_path: Path) -> None:
    model = ScriptedModel([calls(tool_call("done", {})), answer("42, after all")])

    result = run(make_kernel(model, tmp_path))

    assert result.termination_reason == "final_answer"  # not "done": the call failed
    assert result.response == "42, after all"
    (record,) = result.tool_calls
    assert record.result.is_error
    assert "answer" in record.result.content  # what the model has to fix
    assert len(model.requests) == 2
    assert_log_shape(result)


def test_parallel_tool_calls_run_in_order_within_one_iteration(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("alpha", encoding="utf-8")
    both = calls(tool_call("read_file", {"path": "a.txt"}), tool_call("datetime"))
    model = ScriptedModel([both, answer("read it")])

    result = run(make_kernel(model, tmp_path))

    assert result.termination_reason == "final_answer"
    assert result.iterations == 2
    assert [(r.iteration, r.call.name) for r in result.tool_calls] == [
        (1, "read_file"),
        (1, "datetime"),
    ]
    assert result.tool_calls[0].result.content == "alpha"
    started = [e.data["call"]["name"] for e in events_of(result, EventType.TOOL_STARTED)]
    assert started == ["read_file", "datetime"]


# --- limits -----------------------------------------------------------------------------------


def test_max_iterations_from_the_workflow_transition(tmp_path: Path) -> None:
    spec = spec_with_limits(max_iterations=2)
    model = ScriptedModel(
        [
            calls(tool_call("datetime", {"timezone": "UTC"})),
            calls(tool_call("datetime", {"timezone": "Europe/Paris"})),
        ]
    )

    result = run(make_kernel(model, tmp_path, spec=spec))

    assert result.termination_reason == "max_iterations"
    assert not result.ok
    assert result.iterations == 2
    assert len(result.tool_calls) == 2
    assert len(model.requests) == 2
    assert_log_shape(result)


def test_max_iterations_is_enforced_in_code_without_a_transition(tmp_path: Path) -> None:
    spec = load_workflow_text(NO_CAP_TRANSITION)
    zones = ["UTC", "Europe/Paris", "Asia/Tokyo", "America/Lima"]
    model = ScriptedModel([calls(tool_call("datetime", {"timezone": z})) for z in zones])

    result = run(make_kernel(model, tmp_path, spec=spec))

    assert result.termination_reason == "max_iterations"
    assert result.iterations == 3
    assert len(model.requests) == 3, "the kernel must not make a 4th model call"
    assert [r.iteration for r in result.tool_calls] == [1, 2, 3]
    assert_log_shape(result)


def test_max_iterations_zero_means_unlimited(tmp_path: Path) -> None:
    text = NO_CAP_TRANSITION.replace("max_iterations: 3", "max_iterations: 0")
    spec = load_workflow_text(text)
    zones = ["UTC", "Europe/Paris"] * 7
    steps: list[Step] = [calls(tool_call("datetime", {"timezone": z})) for z in zones]
    model = ScriptedModel([*steps, answer("fourteen calls later")])

    result = run(make_kernel(model, tmp_path, spec=spec))

    assert result.termination_reason == "final_answer"
    assert result.iterations == 15
    assert result.response == "fourteen calls later"


def test_max_iterations_zero_with_the_default_workflow(tmp_path: Path) -> None:
    spec = spec_with_limits(max_iterations=0)
    zones = ["UTC", "Asia/Tokyo"] * 6
    steps: list[Step] = [calls(tool_call("datetime", {"timezone": z})) for z in zones]
    model = ScriptedModel([*steps, answer("ok")])

    result = run(make_kernel(model, tmp_path, spec=spec))

    assert result.termination_reason == "final_answer"
    assert result.iterations == 13


def test_answer_on_the_last_allowed_iteration_is_a_final_answer(tmp_path: Path) -> None:
    spec = spec_with_limits(max_iterations=2)
    model = ScriptedModel([calls(tool_call("datetime")), answer("just in time")])

    result = run(make_kernel(model, tmp_path, spec=spec))

    assert result.termination_reason == "final_answer"
    assert result.response == "just in time"


def test_transition_cap_ends_a_loop_that_never_calls_the_model(tmp_path: Path) -> None:
    model = ScriptedModel([])

    # validate refuses this cycle (nothing bounds it); the cap guards specs it never checked
    spin = load_workflow_text(SPIN, import_code=False)
    result = run(make_kernel(model, tmp_path, spec=spin))

    assert result.termination_reason == "no_progress"
    assert result.error is not None
    assert "max_transitions" in result.error
    assert result.iterations == 0
    assert model.requests == []
    transitions = events_of(result, EventType.TRANSITION_TAKEN)
    assert len(transitions) == 7
    assert_log_shape(result)


# --- tool problems ----------------------------------------------------------------------------


def test_fatal_tool_error_ends_the_run(tmp_path: Path) -> None:
    model = ScriptedModel([calls(tool_call("explode", {"reason": "full"})), answer("unused")])
    kernel = make_kernel(
        model, tmp_path, tools=failing_registry(tmp_path), tool_names=["explode", "datetime"]
    )

    result = run(kernel)

    assert result.termination_reason == "fatal_tool_error"
    assert result.iterations == 1
    assert len(model.steps) == 1, "no model call after a fatal tool error"
    (record,) = result.tool_calls
    assert record.result.is_error
    assert record.result.fatal
    assert "disk is gone: full" in record.result.content
    assert result.error == f"explode: {record.result.content}"  # the tool, then its message
    (ended,) = events_of(result, EventType.RUN_TERMINATED)
    assert ended.data["error"] == result.error
    assert_log_shape(result)


def test_the_same_call_with_its_arguments_in_another_order_is_no_progress(
    tmp_path: Path,
) -> None:
    registry = ToolRegistry()

    def pair(a: str, b: str) -> str:
        """Join two words.

        Args:
            a: the first.
            b: the second.
        """
        return a + b

    registry.register(pair)
    orders = [{"a": "x", "b": "y"}, {"b": "y", "a": "x"}, {"a": "x", "b": "y"}]
    model = ScriptedModel([calls(tool_call("pair", args)) for args in orders])

    result = run(make_kernel(model, tmp_path, tools=registry, tool_names=["pair"]))

    assert result.termination_reason == "no_progress"
    assert result.iterations == 3


def test_no_progress_same_call_repeated(tmp_path: Path) -> None:
    model = ScriptedModel([calls(tool_call("datetime", {"timezone": "UTC"})) for _ in range(3)])

    result = run(make_kernel(model, tmp_path))

    assert result.termination_reason == "no_progress"
    assert result.iterations == 3
    assert len(result.tool_calls) == 3
    assert not any(r.result.is_error for r in result.tool_calls)
    assert_log_shape(result)


def test_same_tool_with_other_arguments_is_progress(tmp_path: Path) -> None:
    zones = ["UTC", "UTC", "Asia/Tokyo", "UTC", "UTC"]
    steps: list[Step] = [calls(tool_call("datetime", {"timezone": z})) for z in zones]
    model = ScriptedModel([*steps, answer("done looking")])

    result = run(make_kernel(model, tmp_path, spec=spec_with_limits(max_iterations=0)))

    assert result.termination_reason == "final_answer"
    assert result.iterations == 6


def test_tool_failures_in_a_row(tmp_path: Path) -> None:
    paths = ["nope1.txt", "nope2.txt", "nope3.txt"]
    model = ScriptedModel([calls(tool_call("read_file", {"path": p})) for p in paths])

    result = run(make_kernel(model, tmp_path))

    assert result.termination_reason == "tool_failures"
    assert result.iterations == 3
    assert [r.result.is_error for r in result.tool_calls] == [True, True, True]
    assert "does not exist" in result.tool_calls[0].result.content
    assert_log_shape(result)


def test_a_success_resets_the_failure_streak(tmp_path: Path) -> None:
    steps: list[Step] = [
        calls(tool_call("read_file", {"path": "x1"})),
        calls(tool_call("read_file", {"path": "x2"})),
        calls(tool_call("datetime")),
        calls(tool_call("read_file", {"path": "x3"})),
        calls(tool_call("read_file", {"path": "x4"})),
        answer("gave up on files"),
    ]
    model = ScriptedModel(steps)

    result = run(make_kernel(model, tmp_path))

    assert result.termination_reason == "final_answer"
    assert result.iterations == 6


def test_a_handler_exception_is_a_tool_failure_not_a_crash(tmp_path: Path) -> None:
    model = ScriptedModel([calls(tool_call("flaky", {"n": i})) for i in range(3)])
    kernel = make_kernel(model, tmp_path, tools=failing_registry(tmp_path), tool_names=["flaky"])

    result = run(kernel)

    assert result.termination_reason == "tool_failures"
    assert "flaky failed on 0" in result.tool_calls[0].result.content


def test_schema_invalid_arguments_are_tool_failures_not_malformed(tmp_path: Path) -> None:
    model = ScriptedModel([calls(tool_call("read_file", {"wrong": i})) for i in range(3)])

    result = run(make_kernel(model, tmp_path))

    assert result.termination_reason == "tool_failures"
    assert result.iterations == 3
    assert [r.result.error_type for r in result.tool_calls] == ["ToolArgumentsError"] * 3
    decisions = [e.data["decision"] for e in events_of(result, EventType.ITERATION_COMPLETED)]
    assert decisions == ["tool_calls"] * 3


# --- malformed output -------------------------------------------------------------------------


def test_malformed_output_ends_after_the_retry_budget(tmp_path: Path) -> None:
    model = ScriptedModel([bad_json(), bad_json(), bad_json(), answer("unused")])

    result = run(make_kernel(model, tmp_path))

    assert result.termination_reason == "malformed_output"
    assert result.iterations == 3
    assert len(model.steps) == 1
    assert len(result.tool_calls) == 3
    assert all(r.result.is_error for r in result.tool_calls)
    assert result.tool_calls[0].to_dict()["arguments"] == '{"timezone": "UTC"'
    decisions = [e.data["decision"] for e in events_of(result, EventType.ITERATION_COMPLETED)]
    assert decisions == ["malformed"] * 3
    assert not events_of(result, EventType.TOOL_STARTED), "a malformed call is never executed"
    assert_log_shape(result)


def test_malformed_reply_goes_back_to_the_model_which_recovers(tmp_path: Path) -> None:
    broken = bad_json()
    model = ScriptedModel([broken, calls(tool_call("datetime")), answer("noon")])

    result = run(make_kernel(model, tmp_path))

    assert result.termination_reason == "final_answer"
    assert result.response == "noon"
    assert result.iterations == 3
    retry = model.requests[1].messages
    assert retry[-2].role == Role.ASSISTANT
    assert retry[-1].role == Role.TOOL
    assert retry[-1].tool_call_id == broken.message.tool_calls[0].id
    assert "not JSON" in retry[-1].content
    assert_log_shape(result)


def test_malformed_streak_resets_after_a_good_reply(tmp_path: Path) -> None:
    steps: list[Step] = [
        bad_json(),
        bad_json(),
        calls(tool_call("datetime")),
        bad_json(),
        bad_json(),
        answer("there"),
    ]
    model = ScriptedModel(steps)

    result = run(make_kernel(model, tmp_path))

    assert result.termination_reason == "final_answer"
    assert result.iterations == 6


def test_a_tool_not_offered_is_malformed_output(tmp_path: Path) -> None:
    model = ScriptedModel([calls(tool_call("rm_rf", {"path": "/"})) for _ in range(3)])

    result = run(make_kernel(model, tmp_path))

    assert result.termination_reason == "malformed_output"
    assert result.iterations == 3
    assert "'rm_rf' was not offered" in result.tool_calls[0].result.content
    assert not events_of(result, EventType.TOOL_STARTED)


def test_a_registered_tool_outside_the_offer_is_malformed(tmp_path: Path) -> None:
    model = ScriptedModel([calls(tool_call("read_file", {"path": "x"})), answer("fine")])
    kernel = make_kernel(model, tmp_path, tool_names=["datetime"])

    result = run(kernel)

    assert model.requests[0].tools == ["datetime"]
    assert result.termination_reason == "final_answer"
    assert not events_of(result, EventType.TOOL_STARTED), "read_file was not offered"
    assert result.tool_calls[0].result.error_type == "MalformedOutput"


# --- cut-off answers --------------------------------------------------------------------------


def test_a_cut_off_answer_ends_the_run_truncated(tmp_path: Path) -> None:
    cut = Completion(message=Message.assistant("It is twelve o'cl"), finish_reason="length")
    model = ScriptedModel([calls(tool_call("datetime")), cut])

    result = run(make_kernel(model, tmp_path))

    assert result.termination_reason == "truncated"
    assert not result.ok
    assert result.response == "It is twelve o'cl"
    assert result.error is not None
    assert "cut off by the model's length limit" in result.error
    assert result.iterations == 2
    finish = [
        e.data["completion"]["finish_reason"] for e in events_of(result, EventType.MODEL_RESPONDED)
    ]
    assert finish == ["tool_calls", "length"]
    assert_log_shape(result)


# --- failures around the loop -----------------------------------------------------------------


def test_agent_error_keeps_the_partial_result(tmp_path: Path) -> None:
    refused = AgentConnectionError(
        "cannot reach model server at http://127.0.0.1:9/v1", base_url="http://127.0.0.1:9/v1"
    )
    model = ScriptedModel([calls(tool_call("datetime")), refused])

    result = run(make_kernel(model, tmp_path))

    assert result.termination_reason == "agent_error"
    assert not result.ok
    assert result.error is not None
    assert "cannot reach model server" in result.error
    assert result.iterations == 2
    assert [r.call.name for r in result.tool_calls] == ["datetime"]
    assert [m.role for m in result.messages] == [Role.USER, Role.ASSISTANT, Role.TOOL]
    assert result.events[-1].data["error"] == result.error
    assert_log_shape(result)


def test_the_failed_iteration_is_recorded_as_failed(tmp_path: Path) -> None:
    model = ScriptedModel([calls(tool_call("datetime")), AgentConnectionError("server gone")])

    result = run(make_kernel(model, tmp_path))

    records = [e.data for e in events_of(result, EventType.ITERATION_COMPLETED)]
    assert [r["step"] for r in records] == [1, 2]
    failed = records[1]
    assert failed["tools"] == []
    assert failed["decision"] != "tool_calls", "step 2 never got a reply; it asked for no tools"
    assert failed["error"] is not None
    assert "server gone" in failed["error"]


def test_cancelling_the_task_ends_the_run_as_cancelled(tmp_path: Path) -> None:
    async def scenario() -> tuple[RunResult, bool]:
        hang = Hang()
        model = ScriptedModel([calls(tool_call("datetime")), hang])
        task = asyncio.create_task(make_kernel(model, tmp_path).run("What time is it?"))
        await hang.entered.wait()
        task.cancel()
        result = await task
        return result, task.cancelled()

    result, task_cancelled = asyncio.run(scenario())

    assert not task_cancelled
    assert result.termination_reason == "cancelled"
    assert result.error == "run cancelled"
    assert result.iterations == 2
    assert len(result.tool_calls) == 1
    assert_log_shape(result)


def test_a_cancelled_run_leaves_its_task_free_to_go_on(tmp_path: Path) -> None:
    """The kernel takes the cancellation it turned into the `cancelled` ending off the task
    (uncancel): the caller's code after `run` in the same task, a timeout say, works as if
    no cancel had come."""

    async def scenario() -> tuple[RunResult, int, str]:
        hang = Hang()
        model = ScriptedModel([hang])
        kernel = make_kernel(model, tmp_path)

        async def caller() -> tuple[RunResult, int, str]:
            result = await kernel.run("What time is it?")
            me = asyncio.current_task()
            assert me is not None
            pending = me.cancelling()
            async with asyncio.timeout(5):  # a task still marked cancelling would misread it
                await asyncio.sleep(0)
            return result, pending, "went on"

        task = asyncio.create_task(caller())
        await hang.entered.wait()
        task.cancel()
        return await task

    result, pending, after = asyncio.run(scenario())

    assert result.termination_reason == "cancelled"
    assert pending == 0
    assert after == "went on"


def test_timeout_ends_a_run_whose_model_hangs(tmp_path: Path) -> None:
    async def scenario() -> RunResult:
        model = ScriptedModel([Hang()])
        return await make_kernel(model, tmp_path, spec=load_workflow_text(SLOW)).run("hi")

    result = asyncio.run(scenario())

    assert result.termination_reason == "timeout"
    assert result.error is not None
    assert "timed out" in result.error
    assert result.iterations == 1
    assert_log_shape(result)


def test_a_raising_action_ends_the_run_as_error_with_one_line(tmp_path: Path) -> None:
    model = ScriptedModel([calls(tool_call("datetime"))])

    result = run(make_kernel(model, tmp_path, spec=load_workflow_text(BOOM)))

    assert result.termination_reason == "error"
    assert result.error is not None
    assert "RuntimeError" in result.error
    assert "boom went the action" in result.error
    assert "crash" in result.error
    assert "\n" not in result.error
    assert result.iterations == 1
    assert_log_shape(result)


def test_a_kernel_error_inside_the_loop_ends_the_run_with_its_own_message(
    tmp_path: Path,
) -> None:
    """An FsmKernelError says what is wrong in words for the user: the run ends `error` with
    that text as it is, not the one-line traceback summary a buggy action gets."""
    kernel = Kernel(
        compile_workflow(default_spec()),
        model=None,
        tools=builtin_registry(tmp_path),
        system_prompt="be brief",
    )

    result = run(kernel)

    assert result.termination_reason == "error"
    assert result.error == "agent.think needs a model, but the run has none"
    assert result.events[-1].type is EventType.RUN_TERMINATED
    assert result.events[-1].data == {
        "reason": "error",
        "error": result.error,
        "answer": "",
        "iterations": 0,
    }  # not resumable: no "resumable" key


def test_an_action_error_with_a_multiline_message_is_reported_on_one_line(
    tmp_path: Path,
) -> None:
    model = ScriptedModel([calls(tool_call("datetime"))])
    spec = load_workflow_text(BOOM.replace("test_kernel:boom", "test_kernel:boom_validation"))

    result = run(make_kernel(model, tmp_path, spec=spec))

    assert result.termination_reason == "error"
    assert result.error is not None
    assert "ValidationError" in result.error
    assert "\n" not in result.error
    assert result.events[-1].data["error"] == result.error


def test_a_raising_guard_ends_the_run_as_error(tmp_path: Path) -> None:
    model = ScriptedModel([answer("hello")])

    result = run(make_kernel(model, tmp_path, spec=load_workflow_text(BAD_GUARD)))

    assert result.termination_reason == "error"
    assert result.error is not None
    assert "the guard is broken" in result.error
    assert result.response == "hello"


def test_every_termination_reason_is_covered_here() -> None:
    from fsm_kernel.workflow.spec import TERMINATION_REASONS

    covered = {
        "final_answer",
        "done",
        "max_iterations",
        "fatal_tool_error",
        "no_progress",
        "tool_failures",
        "malformed_output",
        "agent_error",
        "cancelled",
        "timeout",
        "error",
        "truncated",
        "budget_exceeded",  # its runs: tests/unit/test_reasons_budgets.py
    }
    assert set(TERMINATION_REASONS) == covered


# --- the event log ----------------------------------------------------------------------------


def test_events_reach_the_store_in_order(tmp_path: Path) -> None:
    model = ScriptedModel([calls(tool_call("datetime")), answer("noon")])
    with SqliteEventStore(tmp_path / "runs.db") as store:
        result = run(make_kernel(model, tmp_path, store=store))
        stored = store.read(result.run_id)

    assert [e.to_dict() for e in stored] == [e.to_dict() for e in result.events]
    types = [e.type for e in stored]
    assert types[:3] == [EventType.RUN_STARTED, EventType.STATE_ENTERED, EventType.TRANSITION_TAKEN]
    assert types.count(EventType.MODEL_REQUESTED) == 2
    assert types.count(EventType.MODEL_RESPONDED) == 2
    assert types.count(EventType.TOOL_STARTED) == 1
    assert types.count(EventType.TOOL_FINISHED) == 1
    assert types.count(EventType.ITERATION_COMPLETED) == 2
    assert types[-2:] == [EventType.ITERATION_COMPLETED, EventType.RUN_TERMINATED]
    started = stored[0].data
    assert started["workflow"] == "default"
    assert started["goal"] == "What time is it?"
    assert started["workflow_hash"] == default_spec().content_hash


def test_iteration_records_say_what_happened(tmp_path: Path) -> None:
    model = ScriptedModel([calls(tool_call("datetime", {"timezone": "UTC"})), answer("noon")])

    result = run(make_kernel(model, tmp_path))

    first, second = (e.data for e in events_of(result, EventType.ITERATION_COMPLETED))
    assert first["decision"] == "tool_calls"
    assert first["tools"][0]["name"] == "datetime"
    assert first["tools"][0]["input"] == {"timezone": "UTC"}
    assert first["error"] is None
    assert second["decision"] == "answer"
    assert second["answer"] == "noon"


def test_transitions_follow_the_machine(tmp_path: Path) -> None:
    model = ScriptedModel([calls(tool_call("datetime")), answer("noon")])

    result = run(make_kernel(model, tmp_path))

    path = [
        (e.data["source"], e.data["target"]) for e in events_of(result, EventType.TRANSITION_TAKEN)
    ]
    assert path == [
        ("observe", "think"),
        ("think", "act"),
        ("act", "evaluate"),
        ("evaluate", "observe"),
        ("observe", "think"),
        ("think", "terminate"),
    ]
    entered = [e.state for e in events_of(result, EventType.STATE_ENTERED)]
    assert entered == ["observe", "think", "act", "evaluate", "observe", "think"]
    assert result.events[-1].state == "terminate"


def test_on_event_sees_every_event(tmp_path: Path) -> None:
    seen: list[Event] = []
    model = ScriptedModel([answer("hi")])
    kernel = make_kernel(model, tmp_path)
    kernel.on_event = seen.append

    result = run(kernel)

    assert seen == result.events


def test_run_ids_are_distinct_and_can_be_given(tmp_path: Path) -> None:
    kernel = make_kernel(ScriptedModel([answer("a"), answer("b")]), tmp_path)

    first = run(kernel)
    second = asyncio.run(kernel.run("again", run_id="my-run"))

    assert first.run_id != second.run_id
    assert second.run_id == "my-run"
    assert {e.run_id for e in second.events} == {"my-run"}


def test_concurrent_runs_share_a_compiled_workflow(tmp_path: Path) -> None:
    async def scenario() -> tuple[RunResult, RunResult]:
        gate = asyncio.Event()

        async def wait_then_answer() -> Completion:
            await gate.wait()
            return answer("slow one")

        async def answer_then_open() -> Completion:
            gate.set()
            return answer("fast one")

        slow = make_kernel(
            ScriptedModel([calls(tool_call("datetime")), wait_then_answer]), tmp_path
        )
        fast = make_kernel(ScriptedModel([calls(tool_call("done", {"answer": "x"}))]), tmp_path)
        fast_two = make_kernel(ScriptedModel([answer_then_open]), tmp_path)
        assert slow.workflow is fast.workflow is fast_two.workflow
        first, _, second = await asyncio.gather(
            slow.run("one"), fast.run("two"), fast_two.run("three")
        )
        return first, second

    first, second = asyncio.run(scenario())

    assert (first.termination_reason, first.response, first.iterations) == (
        "final_answer",
        "slow one",
        2,
    )
    assert (second.termination_reason, second.response, second.iterations) == (
        "final_answer",
        "fast one",
        1,
    )
    assert first.run_id != second.run_id
    assert_log_shape(first)
    assert_log_shape(second)


def test_result_to_dict_is_json(tmp_path: Path) -> None:
    model = ScriptedModel([calls(tool_call("datetime")), AgentConnectionError("down")])

    result = run(make_kernel(model, tmp_path))
    d = json.loads(json.dumps(result.to_dict()))

    assert set(d) == {
        "run_id",
        "workflow",
        "status",
        "termination_reason",
        "response",
        "output",
        "iterations",
        "tool_calls",
        "usage",
        "error",
    }
    assert d["output"] is None  # the workflow has no output schema
    assert d["termination_reason"] == "agent_error"
    assert set(d["tool_calls"][0]) == {"iteration", "id", "name", "arguments", "result", "is_error"}


@pytest.mark.parametrize("reply", ["", "   "])
def test_an_empty_answer_still_terminates(tmp_path: Path, reply: str) -> None:
    result = run(make_kernel(ScriptedModel([answer(reply)]), tmp_path))

    assert result.termination_reason == "final_answer"
    assert result.iterations == 1


def test_run_sync_works_without_a_loop(tmp_path: Path) -> None:
    kernel = make_kernel(ScriptedModel([answer("sync")]), tmp_path)

    result = kernel.run_sync("hello")

    assert result.response == "sync"
    assert result.termination_reason == "final_answer"


@dataclass
class KeepingModel:
    """Keeps each request's `messages` exactly as given (no copy) with its length then."""

    steps: list[Completion]
    kept: list[tuple[Sequence[Message], int, list[Message]]] = field(default_factory=list)

    async def complete(self, messages: Sequence[Message], tools: Sequence[Tool]) -> Completion:
        self.kept.append((messages, len(messages), list(messages)))
        return self.steps.pop(0)


def test_the_messages_a_model_keeps_stay_as_they_were_sent(tmp_path: Path) -> None:
    # The kernel hands the model a snapshot of the history (no copy per call): a model that
    # keeps it sees it unchanged after the run goes on, system prompt first.
    model = KeepingModel([calls(tool_call("datetime")), calls(tool_call("datetime")), answer("ok")])
    result = run(make_kernel(model, tmp_path))
    assert result.termination_reason == "final_answer"
    assert [n for _, n, _ in model.kept] == [2, 4, 6]  # system+user, then +call+result each
    for messages, n, then in model.kept:
        assert len(messages) == n
        assert list(messages) == then
        assert messages[0] == Message.system("be brief")
        assert messages[1] == Message.user("What time is it?")
    requested = [e.data["messages"] for e in events_of(result, EventType.MODEL_REQUESTED)]
    assert requested == [2, 4, 6]
    assert list(model.kept[-1][0])[:4] == list(model.kept[1][0])
    assert result.messages[: len(model.kept[-1][0]) - 1] == list(model.kept[-1][0])[1:]
