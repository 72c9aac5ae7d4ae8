"""Per-state `retry:` and `catch:` (issue 10, section 2) through the real Kernel with scripted
models: attempts and their events, backoff waits (an injected sleep, never a real wait), which
failures each entry handles, `ctx.caught` and the `caught` guard, per-state models, iteration
accounting, and what is never retried or caught (cancellation, the run's timeout, the kernel's
own errors)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from fsm_kernel.errors import (
    AgentConnectionError,
    AgentServerError,
    ReplayDivergenceError,
)
from fsm_kernel.kernel import Kernel, RunResult
from fsm_kernel.protocol import ChatModel, EventType
from fsm_kernel.testing import ScriptedChatModel
from fsm_kernel.tools import builtin_registry
from fsm_kernel.workflow.compiler import compile_workflow
from fsm_kernel.workflow.context import CaughtError, RunContext
from fsm_kernel.workflow.loader import load_workflow_text

SERVER_DOWN = AgentServerError("model server failed with 500", status_code=500)

# -- users' own actions and guards, referenced as tests.unit.test_recovery:NAME ----------------

FAILURES: list[BaseException] = []
"""What `flaky` raises, one per call, before it succeeds."""
SEEN: list[Any] = []


def flaky(ctx: RunContext) -> None:
    SEEN.append(("flaky", ctx.attempt))
    if FAILURES:
        raise FAILURES.pop(0)


def record_caught(ctx: RunContext) -> None:
    SEEN.append(ctx.caught)


async def swallow_cancel(ctx: RunContext) -> None:
    """Turns the run's cancellation into an ordinary exception: still never caught."""
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        raise RuntimeError("cancelled, badly handled") from None


async def wait_forever(ctx: RunContext) -> None:
    await asyncio.Event().wait()


def diverge(ctx: RunContext) -> None:
    raise ReplayDivergenceError("the workflow asked the model more often")


@pytest.fixture(autouse=True)
def _reset() -> None:
    FAILURES.clear()
    SEEN.clear()


HERE = "tests.unit.test_recovery"


class Sleeps:
    """An injected sleep: remembers every wait, waits for none."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)


def run(
    text: str,
    model: ChatModel,
    *,
    state_models: dict[str, ChatModel] | None = None,
    sleep: Sleeps | None = None,
    timeout: float = 0,
) -> RunResult:
    spec = load_workflow_text(text)
    kernel = Kernel(
        compile_workflow(spec),
        model=model,
        tools=builtin_registry("."),
        state_models=state_models,
        sleep=sleep or Sleeps(),
        limits=spec.limits.model_copy(update={"timeout_seconds": timeout}),
    )
    return asyncio.run(kernel.run("hi"))


def of_type(result: RunResult, type_: EventType) -> list[dict[str, Any]]:
    return [e.data for e in result.events if e.type == type_]


def taken(result: RunResult) -> list[tuple[str, str, str]]:
    return [
        (d["source"], d["target"], d["guard"]) for d in of_type(result, EventType.TRANSITION_TAKEN)
    ]


RETRY_THINK = """
name: retry_think
initial: think
states:
  think:
    action: agent.think
    prompt: Answer briefly.
    retry: {error: agent_error, max_attempts: 3, backoff_seconds: 1.5, backoff_rate: 2,
            max_backoff_seconds: 4}
  done: {final: true}
transitions:
  - {source: think, target: done, reason: final_answer}
"""


def test_retry_runs_the_model_call_again_with_backoff_in_one_iteration() -> None:
    model = ScriptedChatModel([SERVER_DOWN, SERVER_DOWN, SERVER_DOWN, "42"])
    sleeps = Sleeps()

    result = run(RETRY_THINK, model, sleep=sleeps)

    assert (result.termination_reason, result.response, result.iterations) == (
        "final_answer",
        "42",
        1,
    )
    assert sleeps.waits == [1.5, 3.0, 4.0]  # ×2 each time, capped by max_backoff_seconds
    failed = of_type(result, EventType.ACTION_FAILED)
    assert [(d["attempt"], d["retry_in"], d["kind"]) for d in failed] == [
        (1, 1.5, "agent_error"),
        (2, 3.0, "agent_error"),
        (3, 4.0, "agent_error"),
    ]
    assert failed[0]["error"]["type"] == "AgentServerError"
    assert failed[0]["error"]["status_code"] == 500
    assert {d["visit"] for d in failed} == {1}
    assert {d["max_attempts"] for d in failed} == {3}
    requested = of_type(result, EventType.MODEL_REQUESTED)
    assert [d.get("attempt") for d in requested] == [None, 2, 3, 4]
    # The state's prompt was added once: every attempt sends the same conversation.
    assert [len(r.messages) for r in model.requests] == [2, 2, 2, 2]
    assert [m.content for m in model.requests[3].messages] == ["hi", "Answer briefly."]
    assert len(of_type(result, EventType.MODEL_FAILED)) == 3
    model.assert_complete()


def test_spent_retries_end_the_run_with_the_last_failure() -> None:
    model = ScriptedChatModel([SERVER_DOWN] * 4)
    sleeps = Sleeps()

    result = run(RETRY_THINK, model, sleep=sleeps)

    assert result.termination_reason == "agent_error"
    assert result.error == "model server failed with 500"
    assert len(model.requests) == 4  # the first attempt and 3 retries
    assert [d["attempt"] for d in of_type(result, EventType.ACTION_FAILED)] == [1, 2, 3]
    assert of_type(result, EventType.ERROR_CAUGHT) == []


def test_retry_only_handles_its_kind_of_error() -> None:
    FAILURES.append(ValueError("bad input"))
    text = f"""
name: retry_kind
initial: work
states:
  work: {{action: "{HERE}:flaky", retry: {{error: agent_error, backoff_seconds: 0}}}}
  done: {{final: true}}
transitions:
  - {{source: work, target: done, reason: final_answer}}
"""
    result = run(text, ScriptedChatModel())

    assert result.termination_reason == "error"
    assert result.error == "ValueError: bad input (in state 'work')"
    assert SEEN == [("flaky", 1)]
    assert of_type(result, EventType.ACTION_FAILED) == []


def test_a_retried_custom_action_sees_its_attempt_number() -> None:
    FAILURES.extend([KeyError("k"), OSError("disk")])
    text = f"""
name: retry_custom
initial: work
states:
  work: {{action: "{HERE}:flaky", retry: {{max_attempts: 2, backoff_seconds: 0}}}}
  done: {{final: true}}
transitions:
  - {{source: work, target: done, reason: final_answer}}
"""
    sleeps = Sleeps()
    result = run(text, ScriptedChatModel(), sleep=sleeps)

    assert result.termination_reason == "final_answer"
    assert SEEN == [("flaky", 1), ("flaky", 2), ("flaky", 3)]
    assert sleeps.waits == []  # backoff_seconds 0: nothing to wait for
    assert [d["error"] for d in of_type(result, EventType.ACTION_FAILED)] == [
        {"type": "KeyError", "message": "'k'"},
        {"type": "OSError", "message": "disk"},
    ]


FALLBACK = f"""
name: fallback
initial: think
states:
  think:
    action: agent.think
    catch:
      - {{error: agent_error, target: backup}}
  backup:
    action: agent.think
    agent: {{model: small}}
  report: {{action: "{HERE}:record_caught"}}
  done: {{final: true}}
transitions:
  - {{source: think, target: done, reason: final_answer}}
  - {{source: backup, target: report, guard: caught}}
  - {{source: backup, target: done, reason: final_answer}}
  - {{source: report, target: done, reason: final_answer}}
"""


def test_catch_routes_a_model_failure_to_a_fallback_state_on_its_own_model() -> None:
    primary = ScriptedChatModel([AgentConnectionError("cannot reach http://big/v1")])
    small = ScriptedChatModel(["the fallback's answer"])

    result = run(FALLBACK, primary, state_models={"backup": small})

    assert (result.termination_reason, result.response) == ("final_answer", "the fallback's answer")
    assert taken(result) == [
        ("think", "backup", "catch agent_error"),
        ("backup", "report", "caught"),
        ("report", "done", ""),
    ]
    edge = of_type(result, EventType.TRANSITION_TAKEN)[0]
    assert (edge["index"], edge["catch"], edge["reason"]) == (4, "agent_error", None)
    caught = of_type(result, EventType.ERROR_CAUGHT)
    assert len(caught) == 1
    assert {k: caught[0][k] for k in ("kind", "visit", "attempts", "catch", "target")} == {
        "kind": "agent_error",
        "visit": 1,
        "attempts": 1,
        "catch": 0,
        "target": "backup",
    }
    assert caught[0]["error"]["type"] == "AgentConnectionError"
    assert SEEN == [
        CaughtError(
            state="think",
            error="agent_error",
            type="AgentConnectionError",
            message="cannot reach http://big/v1",
            attempts=1,
            iteration=1,
        )
    ]
    assert (len(primary.requests), len(small.requests)) == (1, 1)
    # The failed call is an iteration of its own ("failed"), the fallback's answer the next.
    steps = of_type(result, EventType.ITERATION_COMPLETED)
    assert [(s["step"], s["decision"], s["error"]) for s in steps] == [
        (1, "failed", "AgentConnectionError: cannot reach http://big/v1"),
        (2, "answer", None),
    ]
    assert result.iterations == 2


def test_without_a_failure_the_catch_edge_never_fires() -> None:
    result = run(
        FALLBACK, ScriptedChatModel(["fine"]), state_models={"backup": ScriptedChatModel()}
    )

    assert taken(result) == [("think", "done", "")]
    assert of_type(result, EventType.ERROR_CAUGHT) == []


CATCH_KINDS = f"""
name: catch_kinds
initial: work
states:
  work:
    action: "{HERE}:flaky"
    retry: {{error: error, max_attempts: 1, backoff_seconds: 2}}
    catch:
      - {{error: agent_error, target: on_agent}}
      - {{error: any, target: on_other}}
  on_agent: {{action: "{HERE}:record_caught"}}
  on_other: {{action: "{HERE}:record_caught"}}
  agent_failed: {{final: true}}
  other_failed: {{final: true}}
reasons:
  step_failed: {{description: the step's own code failed}}
transitions:
  - {{source: work, target: other_failed, reason: final_answer}}
  - {{source: on_agent, target: agent_failed, reason: agent_error}}
  - {{source: on_other, target: other_failed, reason: step_failed}}
"""


@pytest.mark.parametrize(
    ("failures", "route", "reason", "waits"),
    [
        ([SERVER_DOWN], "on_agent", "agent_error", []),  # retry: is for `error` only
        ([ValueError("x"), ValueError("y")], "on_other", "step_failed", [2.0]),
    ],
)
def test_the_first_matching_catch_entry_routes(
    failures: list[Exception], route: str, reason: str, waits: list[float]
) -> None:
    FAILURES.extend(failures)
    sleeps = Sleeps()

    result = run(CATCH_KINDS, ScriptedChatModel(), sleep=sleeps)

    assert result.termination_reason == reason
    assert taken(result)[0][1] == route
    assert sleeps.waits == waits
    caught = SEEN[-1]
    assert isinstance(caught, CaughtError)
    assert (caught.state, caught.type, caught.attempts) == (
        "work",
        type(failures[-1]).__name__,
        len(failures),
    )


def test_an_error_entry_does_not_catch_a_model_failure() -> None:
    text = """
name: error_only
initial: think
states:
  think:
    action: agent.think
    catch: [{error: error, target: done, reason: final_answer}]
  done: {final: true}
transitions:
  - {source: think, target: done, reason: final_answer}
"""
    result = run(text, ScriptedChatModel([SERVER_DOWN]))

    assert result.termination_reason == "agent_error"
    assert of_type(result, EventType.ERROR_CAUGHT) == []


def test_catch_into_a_final_state_ends_with_its_reason() -> None:
    FAILURES.append(RuntimeError("boom"))
    text = f"""
name: catch_final
initial: work
states:
  work:
    action: "{HERE}:flaky"
    catch: [{{error: any, target: failed, reason: step_failed}}]
  failed: {{final: true}}
  done: {{final: true}}
reasons:
  step_failed: {{}}
transitions:
  - {{source: work, target: done, reason: final_answer}}
"""
    result = run(text, ScriptedChatModel())

    assert (result.termination_reason, result.ok) == ("step_failed", False)
    assert taken(result) == [("work", "failed", "catch any")]


def _never_caught(action: str, *, timeout: float = 0, cancel: bool = False) -> RunResult:
    text = f"""
name: never
initial: work
states:
  work:
    action: "{HERE}:{action}"
    retry: {{max_attempts: 5, backoff_seconds: 0}}
    catch: [{{error: any, target: done, reason: final_answer}}]
  done: {{final: true}}
transitions:
  - {{source: work, target: done, reason: final_answer}}
"""
    spec = load_workflow_text(text)
    kernel = Kernel(
        compile_workflow(spec),
        model=ScriptedChatModel(),
        tools=builtin_registry("."),
        limits=spec.limits.model_copy(update={"timeout_seconds": timeout}),
    )

    async def go() -> RunResult:
        task = asyncio.ensure_future(kernel.run("hi"))
        if cancel:
            await asyncio.sleep(0.05)  # let the action start waiting
            task.cancel()
        return await task

    return asyncio.run(go())


@pytest.mark.parametrize(
    ("action", "kwargs", "reason"),
    [
        ("wait_forever", {"cancel": True}, "cancelled"),
        ("wait_forever", {"timeout": 0.1}, "timeout"),
        # An action that turns the cancellation into an exception ends the run with it, as
        # without catch: (its task is being cancelled: nothing retries or routes it).
        ("swallow_cancel", {"cancel": True}, "error"),
        ("swallow_cancel", {"timeout": 0.1}, "error"),
        ("diverge", {}, "error"),
    ],
)
def test_cancellation_timeouts_and_kernel_errors_are_never_retried_or_caught(
    action: str, kwargs: dict[str, Any], reason: str
) -> None:
    result = _never_caught(action, **kwargs)

    assert result.termination_reason == reason
    assert of_type(result, EventType.ACTION_FAILED) == []
    assert of_type(result, EventType.ERROR_CAUGHT) == []


def test_a_retry_backoff_counts_against_the_run_timeout() -> None:
    text = """
name: slow_retry
initial: think
states:
  think: {action: agent.think, retry: {backoff_seconds: 3600}}
  done: {final: true}
transitions:
  - {source: think, target: done, reason: final_answer}
"""
    spec = load_workflow_text(text)
    kernel = Kernel(
        compile_workflow(spec),
        model=ScriptedChatModel([SERVER_DOWN, "never asked"]),
        tools=builtin_registry("."),
        limits=spec.limits.model_copy(update={"timeout_seconds": 0.2}),
    )  # the real asyncio.sleep

    result = asyncio.run(kernel.run("hi"))

    assert result.termination_reason == "timeout"
    assert [d["retry_in"] for d in of_type(result, EventType.ACTION_FAILED)] == [3600.0]


class Named:
    """A model that answers its own name."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def complete(self, messages: Sequence[Any], tools: Sequence[Any]) -> Any:
        from fsm_kernel.protocol import Completion, Message

        return Completion(message=Message.assistant(self.name))


def test_each_state_asks_its_own_model() -> None:
    text = """
name: two_models
initial: draft
states:
  draft: {action: agent.think, answer: false}
  polish: {action: agent.think, agent: {model: other}}
  done: {final: true}
transitions:
  - {source: draft, target: polish}
  - {source: polish, target: done, reason: final_answer}
"""
    result = run(text, Named("run's model"), state_models={"polish": Named("polish's model")})

    answers = [
        d["completion"]["message"]["content"] for d in of_type(result, EventType.MODEL_RESPONDED)
    ]
    assert answers == ["run's model", "polish's model"]
    assert result.response == "polish's model"
