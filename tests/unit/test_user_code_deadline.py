"""Users' plain guards and actions run off the event loop, under the run's deadline, and a reply
cannot make the kernel run an unbounded number of tool calls."""

from __future__ import annotations

import asyncio
import sys
import textwrap
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from fsm_kernel.kernel import Kernel
from fsm_kernel.protocol import Completion, EventType, Message, Tool, ToolCall
from fsm_kernel.tools import builtin_registry
from fsm_kernel.workflow.actions import in_thread
from fsm_kernel.workflow.compiler import compile_workflow
from fsm_kernel.workflow.loader import load_workflow_text

SLOW_MODULE = """
import threading
import time

release = threading.Event()
threads = []


def slow_guard(ctx):
    threads.append(threading.current_thread().name)
    release.wait(20)
    return True


def slow_action(ctx):
    threads.append(threading.current_thread().name)
    release.wait(20)


def quick_action(ctx):
    threads.append(threading.current_thread().name)
    ctx.scratch["quick"] = "ran"
"""

WORKFLOW = """
name: {name}
tools: [datetime]
limits: {{timeout_seconds: 1}}
initial: start
states:
  start: {{action: {action}}}
  think: {{action: agent.think}}
  end: {{final: true}}
transitions:
  - {{source: start, target: think, guard: {guard}}}
  - {{source: start, target: end, reason: done}}
  - {{source: think, target: end, reason: final_answer}}
"""


class Answer:
    """A model that answers at once."""

    def __init__(self, completion: Completion) -> None:
        self.completion = completion

    async def complete(self, messages: Sequence[Message], tools: Sequence[Tool]) -> Completion:
        return self.completion


@pytest.fixture
def slowmod(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    name = f"slowmod_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(SLOW_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = __import__(name)
    yield module
    module.release.set()  # let the stuck threads finish
    sys.modules.pop(name, None)


def kernel_for(module: object, *, action: str, guard: str) -> Kernel:
    name = module.__name__  # type: ignore[attr-defined]
    text = WORKFLOW.format(
        name=name,
        action=action.replace("@", f"{name}:"),
        guard=guard.replace("@", f"{name}:"),
    )
    spec = load_workflow_text(text, path=f"{name}_{action}_{guard}.yaml".replace(":", "_"))
    return Kernel(
        compile_workflow(spec),
        model=Answer(Completion(message=Message.assistant("ok"))),
        tools=builtin_registry("."),
    )


def timed_run(kernel: Kernel) -> tuple[str, float]:
    started = time.monotonic()
    result = kernel.run_sync("go")
    return result.termination_reason, time.monotonic() - started


def test_a_blocking_guard_cannot_overrun_the_timeout(slowmod: object) -> None:
    kernel = kernel_for(slowmod, action="@quick_action", guard="@slow_guard")

    reason, elapsed = timed_run(kernel)

    assert reason == "timeout"
    assert elapsed < 10  # the guard blocks for 20 s; the run's limit is 1 s
    assert slowmod.threads == ["fsm-kernel: quick_action", "fsm-kernel: Machine.step"]  # type: ignore[attr-defined]


def test_a_blocking_plain_action_cannot_overrun_the_timeout(slowmod: object) -> None:
    kernel = kernel_for(slowmod, action="@slow_action", guard="has_answer")

    reason, elapsed = timed_run(kernel)

    assert reason == "timeout"
    assert elapsed < 10


def test_a_plain_action_runs_in_a_thread_and_its_changes_are_kept(slowmod: object) -> None:
    kernel = kernel_for(slowmod, action="@quick_action", guard="has_answer")

    result = kernel.run_sync("go")

    # has_answer is false before any model call, so start → end with reason done.
    assert result.termination_reason == "done"
    assert slowmod.threads == ["fsm-kernel: quick_action"]  # type: ignore[attr-defined]
    assert threading.current_thread().name not in slowmod.threads  # type: ignore[attr-defined]


def test_built_in_guards_stay_on_the_loop(slowmod: object) -> None:
    kernel = kernel_for(slowmod, action="@quick_action", guard="has_answer")

    assert not kernel.workflow.user_guards
    assert kernel_for(slowmod, action="@quick_action", guard="@slow_guard").workflow.user_guards


def test_in_thread_returns_the_value_and_raises_the_error() -> None:
    def fail() -> None:
        raise ValueError("bad")

    assert asyncio.run(in_thread(lambda a, b: a + b, 2, 3)) == 5
    with pytest.raises(ValueError, match="bad"):
        asyncio.run(in_thread(fail))


# --- the per-reply cap on tool calls ---------------------------------------------------------

CAPPED = """
name: capped
tools: [datetime, done]
limits: {max_tool_calls_per_reply: 3, max_iterations: 1, max_tool_failures: 1}
initial: think
states:
  think: {action: agent.think}
  act: {action: tools.execute}
  end: {final: true}
transitions:
  - {source: think, target: act, guard: has_tool_calls}
  - {source: think, target: end, reason: final_answer}
  - {source: act, target: end, guard: tool_failures, reason: tool_failures}
  - {source: act, target: end, reason: done}
"""


def test_calls_beyond_the_cap_are_answered_with_an_error_not_run() -> None:
    calls = [ToolCall(id=f"c{i}", name="datetime", arguments={}) for i in range(10)]
    kernel = Kernel(
        compile_workflow(load_workflow_text(CAPPED, path="capped.yaml")),
        model=Answer(Completion(message=Message.assistant("", calls))),
        tools=builtin_registry("."),
    )

    result = kernel.run_sync("what time is it, ten times")

    started = [e for e in result.events if e.type == EventType.TOOL_STARTED]
    assert [e.data["call"]["id"] for e in started] == ["c0", "c1", "c2"]
    assert [r.call.id for r in result.tool_calls] == [f"c{i}" for i in range(10)]
    refused = result.tool_calls[3:]
    assert all(r.result.is_error for r in refused)
    assert "at most 3 tool calls" in refused[0].result.content
    assert not any(r.result.is_error for r in result.tool_calls[:3])
    # Refusals are not tool failures: with max_tool_failures 1 the run still ends `done`.
    assert result.termination_reason == "done"
