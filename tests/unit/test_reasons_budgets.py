"""A workflow's own termination reasons (`reasons:`), the token budget (`limits.max_tokens`), the
cap on each reply (`agent.max_tokens`) and the kernel's enforcement of every limit in code,
whatever the transitions say. Scripted models and httpx.MockTransport: no sockets."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from fsm_kernel.agent import HttpChatModel
from fsm_kernel.bootstrap import RunOptions, agent_settings
from fsm_kernel.config import DEFAULT_MAX_TOKENS, AgentSettings
from fsm_kernel.errors import (
    AgentBadRequestError,
    ConfigError,
    ToolFatalError,
    WorkflowValidationError,
)
from fsm_kernel.kernel import TRUNCATED_ERROR, RunResult
from fsm_kernel.protocol import Completion, EventType, Message, Usage
from fsm_kernel.testing import (
    ScriptedChatModel,
    WorkflowHarness,
    bad_call,
    call,
    text_reply,
)
from fsm_kernel.workflow.context import RunContext
from fsm_kernel.workflow.limits import LimitHit, limit_reached, tokens_used
from fsm_kernel.workflow.loader import load_workflow_text
from fsm_kernel.workflow.spec import (
    SUCCESS_REASONS,
    TERMINATION_REASONS,
    Limits,
    TerminationReason,
    WorkflowSpec,
)

# A tool loop that declares none of the limits' transitions: no tool_failures, no_progress,
# fatal_tool_error, malformed-output cap or iteration_limit edge. Only the kernel can stop it.
BARE = """
name: bare
tools: [datetime, read_file, done]
limits: {max_iterations: 10}
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
  - {source: think,    target: think,     guard: malformed_output}
  - {source: think,    target: terminate, reason: final_answer}
  - {source: act,      target: evaluate}
  - {source: evaluate, target: terminate, guard: done_called, reason: done}
  - {source: evaluate, target: observe}
"""

REVIEW = """
name: review
reasons:
  approved:  {success: true, description: the review passed}
  escalated: {success: false, description: a person has to look at it}
initial: review
states:
  review: {action: agent.think}
  finish: {final: true}
transitions:
  - {source: review, target: finish, guard: critique_passed, reason: approved}
  - {source: review, target: finish, reason: escalated}
"""


def explode(reason: str) -> str:
    """Give up on the whole run.

    Args:
        reason: Why.
    """
    raise ToolFatalError(f"disk is gone: {reason}")


def usage(prompt: int, completion: int, total: int) -> Usage:
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=total)


def costing(reply: Completion, prompt: int, completion: int) -> Completion:
    """`reply` with the usage a server would report for it."""
    return replace(reply, usage=usage(prompt, completion, prompt + completion))


def run_bare(
    replies: list[Completion], tmp_path: Path, text: str = BARE, **limits: Any
) -> RunResult:
    """A run of `text` that fails (ScriptExhaustedError) if it asks for more replies."""
    model = ScriptedChatModel(replies)
    harness = WorkflowHarness(load_workflow_text(text))
    result = harness.run("go", model=model, tools=[explode], workspace=tmp_path, limits=limits)
    model.assert_complete()
    return result


def transitions(result: RunResult) -> list[dict[str, Any]]:
    return [e.data for e in result.events if e.type is EventType.TRANSITION_TAKEN]


def missing(name: str) -> Completion:
    return call("read_file", {"path": f"{name}.txt"})


# --- each limit without its transition -----------------------------------------------------


LIMIT_CASES = [
    pytest.param(
        [missing("a"), missing("b"), missing("c")],
        {},
        "tool_failures",
        "3 failed tool calls in a row (limits.max_tool_failures = 3)",
        id="tool_failures",
    ),
    pytest.param(
        [call("datetime"), call("datetime"), call("datetime")],
        {},
        "no_progress",
        "datetime called with the same arguments 3 times in a row (limits.no_progress_repeats = 3)",
        id="no_progress",
    ),
    pytest.param(
        [call("explode", {"reason": "full"})],
        {},
        "fatal_tool_error",
        "explode: ",
        id="fatal_tool_error",
    ),
    pytest.param(
        [bad_call("datetime"), bad_call("datetime"), bad_call("datetime")],
        {},
        "malformed_output",
        "3 malformed model replies in a row (limits.max_malformed_outputs = 3); the last: tool "
        "call 'datetime' has arguments that are not JSON",
        id="malformed_output",
    ),
    pytest.param(
        [
            costing(call("datetime", {"timezone": "UTC"}), 6, 4),
            costing(call("datetime", {"timezone": "Asia/Tokyo"}), 6, 4),
            costing(call("datetime", {"timezone": "Europe/Paris"}), 6, 4),
        ],
        {"max_tokens": 25},
        "budget_exceeded",
        "the model calls used 30 tokens (18 prompt + 12 completion), reaching "
        "limits.max_tokens = 25",
        id="budget_exceeded",
    ),
    pytest.param(
        [call("datetime", {"timezone": z}) for z in ("UTC", "Asia/Tokyo")],
        {"max_iterations": 2},
        "max_iterations",
        None,
        id="max_iterations",
    ),
]


@pytest.mark.parametrize(("replies", "limits", "reason", "error"), LIMIT_CASES)
def test_each_limit_ends_a_run_without_its_transition(
    replies: list[Completion],
    limits: dict[str, Any],
    reason: str,
    error: str | None,
    tmp_path: Path,
) -> None:
    result = run_bare(replies, tmp_path, **limits)

    assert result.termination_reason == reason
    assert isinstance(result.termination_reason, TerminationReason)
    assert not result.ok  # exit code 1
    assert result.iterations == len(replies)  # no model call past the limit
    if error is None:
        assert result.error is None
    else:
        assert result.error is not None
        assert error in result.error
    ended = result.events[-1]
    assert ended.type is EventType.RUN_TERMINATED
    assert ended.data["reason"] == reason
    assert all(t["target"] != "terminate" for t in transitions(result))  # the kernel ended it


def test_a_fatal_tool_error_names_the_tool_and_its_message(tmp_path: Path) -> None:
    result = run_bare([call("explode", {"reason": "full"})], tmp_path)

    assert result.error == "explode: disk is gone: full"


def test_the_budget_stops_the_run_before_the_tools_of_the_reply_that_used_it(
    tmp_path: Path,
) -> None:
    replies = [
        costing(call("datetime", {"timezone": "UTC"}), 8, 2),
        costing(call("datetime", {"timezone": "Asia/Tokyo"}), 9, 3),
    ]

    result = run_bare(replies, tmp_path, max_tokens=20)

    assert result.termination_reason == "budget_exceeded"
    assert [r.call.arguments for r in result.tool_calls] == [{"timezone": "UTC"}]
    assert result.usage == usage(17, 5, 22)


def test_an_answer_in_the_call_that_used_the_budget_still_ends_the_run(tmp_path: Path) -> None:
    result = run_bare([costing(text_reply("It is noon."), 50, 10)], tmp_path, max_tokens=20)

    assert (result.termination_reason, result.ok) == ("final_answer", True)
    assert result.response == "It is noon."


def test_a_budget_of_zero_is_no_cap(tmp_path: Path) -> None:
    replies = [
        costing(call("datetime", {"timezone": "UTC"}), 10**6, 10**5),
        costing(text_reply("noon"), 10**6, 10**5),
    ]

    result = run_bare(replies, tmp_path, max_tokens=0)

    assert result.termination_reason == "final_answer"
    assert Limits().max_tokens == 0


def test_a_workflow_may_end_the_run_for_the_budget_through_its_own_edge(tmp_path: Path) -> None:
    text = BARE.replace(
        "  - {source: think,    target: act,       guard: has_tool_calls}\n",
        "  - {source: think,    target: terminate, guard: budget_exceeded, reason: "
        "budget_exceeded}\n"
        "  - {source: think,    target: act,       guard: has_tool_calls}\n",
    )
    replies = [costing(call("datetime"), 30, 5)]

    result = run_bare(replies, tmp_path, text=text, max_tokens=20)

    assert result.termination_reason == "budget_exceeded"
    last = transitions(result)[-1]
    assert (last["source"], last["target"], last["reason"]) == (
        "think",
        "terminate",
        "budget_exceeded",
    )


def test_a_limit_does_not_end_a_run_that_answers_first(tmp_path: Path) -> None:
    # Two failures (the cap is 3), then an answer: the limit never stops a healthy run.
    replies = [missing("a"), missing("b"), text_reply("Neither file exists.")]

    result = run_bare(replies, tmp_path)

    assert (result.termination_reason, result.response) == (
        "final_answer",
        "Neither file exists.",
    )


# --- stock workflows still end through their declared edges -------------------------------


STOCK_CASES = [
    pytest.param([missing("a"), missing("b"), missing("c")], "tool_failures", id="tool_failures"),
    pytest.param([call("datetime") for _ in range(3)], "no_progress", id="no_progress"),
    pytest.param([call("explode", {"reason": "x"})], "fatal_tool_error", id="fatal_tool_error"),
    pytest.param([bad_call("datetime") for _ in range(3)], "malformed_output", id="malformed"),
]


def stock_script(workflow: str, steps: list[Completion], reason: str) -> list[Completion | str]:
    """The replies `workflow` asks for around `steps` (its tool-calling replies, in order): react
    reasons before each (no tools). A malformed reply is retried in the same state, with nothing
    in between."""
    first = {"react": ["I will look."]}.get(workflow, [])
    between: list[str] = []
    if workflow == "react" and reason != "malformed_output":
        between = ["Look again."]
    replies: list[Completion | str] = list(first)
    for i, step in enumerate(steps):
        replies += between if i else []
        replies.append(step)
    return replies


@pytest.mark.parametrize("workflow", ["default", "react", "reflect"])
@pytest.mark.parametrize(("steps", "reason"), STOCK_CASES)
def test_stock_workflows_end_through_their_own_edge(
    workflow: str, steps: list[Completion], reason: str, tmp_path: Path
) -> None:
    model = ScriptedChatModel(stock_script(workflow, steps, reason))

    result = WorkflowHarness(workflow).run("go", model=model, tools=[explode], workspace=tmp_path)

    model.assert_complete()
    assert result.termination_reason == reason
    last = transitions(result)[-1]
    assert (last["target"], last["reason"]) == ("terminate", reason)  # the edge, not the kernel


# --- limit_reached, the one function the kernel asks -------------------------------------


def ctx_with(**state: Any) -> RunContext:
    limits = Limits(max_tokens=state.pop("max_tokens", 0), max_iterations=5)
    ctx = RunContext(limits=limits)
    for key, value in state.items():
        setattr(ctx, key, value)
    return ctx


@pytest.mark.parametrize(
    ("state", "reason"),
    [
        ({}, None),
        ({"failure_streak": 2, "repeat_count": 2, "malformed_streak": 2}, None),
        ({"fatal_error": "t: broken", "failure_streak": 3}, "fatal_tool_error"),
        ({"failure_streak": 3, "repeat_count": 3}, "tool_failures"),
        ({"repeat_count": 3, "malformed_streak": 3}, "no_progress"),
        ({"malformed_streak": 3, "iteration": 5}, "malformed_output"),
        ({"usage": usage(5, 5, 10), "max_tokens": 10, "iteration": 5}, "budget_exceeded"),
        ({"usage": usage(5, 4, 9), "max_tokens": 10}, None),
        ({"iteration": 5}, "max_iterations"),
    ],
)
def test_limit_reached_before_a_model_call(state: dict[str, Any], reason: str | None) -> None:
    hit = limit_reached(ctx_with(**state), model_call_next=True)

    assert (hit.reason if hit else None) == reason


def test_between_other_steps_only_the_budget_is_checked() -> None:
    spent = ctx_with(usage=usage(10, 0, 10), max_tokens=10, failure_streak=3, iteration=5)
    failing = ctx_with(failure_streak=3, fatal_error="x", repeat_count=9, iteration=5)

    assert limit_reached(spent, model_call_next=False) == LimitHit(
        TerminationReason.BUDGET_EXCEEDED,
        "the model calls used 10 tokens (10 prompt + 0 completion), reaching "
        "limits.max_tokens = 10",
    )
    assert limit_reached(failing, model_call_next=False) is None


def test_tokens_used_counts_prompt_and_completion_or_the_servers_total() -> None:
    assert tokens_used(usage(3, 2, 5)) == 5
    assert tokens_used(usage(3, 2, 0)) == 5  # no total reported
    assert tokens_used(usage(0, 0, 40)) == 40  # only a total reported
    assert tokens_used(Usage()) == 0


def test_max_tokens_is_a_whole_number_of_tokens() -> None:
    with pytest.raises(WorkflowValidationError, match="max_tokens"):
        load_workflow_text(BARE.replace("{max_iterations: 10}", "{max_tokens: -1}"))


# --- the workflow's own reasons ------------------------------------------------------------


def review(reply: Completion | str) -> RunResult:
    model = ScriptedChatModel([reply])
    result = WorkflowHarness(load_workflow_text(REVIEW)).run("check it", model=model)
    model.assert_complete()
    return result


def test_a_declared_success_reason_is_ok() -> None:
    result = review("PASS: all good")

    assert result.termination_reason == "approved"
    assert type(result.termination_reason) is str  # a custom reason is a plain string
    assert result.ok
    assert result.to_dict()["termination_reason"] == "approved"
    assert json.loads(json.dumps(result.to_dict()))["termination_reason"] == "approved"
    assert result.events[-1].data["reason"] == "approved"
    assert result.error is None


def test_a_declared_failure_reason_is_not_ok() -> None:
    result = review("It needs a second pair of eyes.")

    assert (result.termination_reason, result.ok) == ("escalated", False)
    assert result.events[-1].data["reason"] == "escalated"


def test_a_cut_off_reply_is_never_a_success_even_for_a_declared_reason() -> None:
    cut = Completion(message=Message.assistant("PASS, because the fi"), finish_reason="length")

    result = review(cut)

    assert (result.termination_reason, result.ok) == ("truncated", False)
    assert result.error == TRUNCATED_ERROR


def test_a_cut_off_reply_keeps_a_declared_failure_reason() -> None:
    cut = Completion(message=Message.assistant("This is not rig"), finish_reason="length")

    assert review(cut).termination_reason == "escalated"


def test_the_spec_says_which_reasons_succeed() -> None:
    spec = load_workflow_text(REVIEW)

    assert spec.is_success("approved")
    assert not spec.is_success("escalated")
    assert spec.is_success("final_answer")
    assert spec.is_success("done")
    assert not spec.is_success("max_iterations")
    assert not spec.is_success("never_declared")
    assert spec.success_reasons() == SUCCESS_REASONS | {"approved"}
    assert spec.reasons["escalated"].description == "a person has to look at it"


def test_a_result_without_a_workflow_knows_the_built_in_successes() -> None:
    result = RunResult(
        run_id="r", workflow="w", termination_reason="done", response="", iterations=0
    )

    assert result.ok
    assert not replace(result, termination_reason="approved").ok


def bad_review(reasons: str) -> str:
    return REVIEW.replace(
        "reasons:\n  approved:  {success: true, description: the review passed}\n",
        f"reasons:\n{reasons}",
    )


@pytest.mark.parametrize(
    ("reasons", "message"),
    [
        (
            "  done: {success: true}\n",
            "<string>:4:3: termination reason 'done' shadows the built-in reason of that name",
        ),
        (
            "  budget_exceeded: {success: true}\n",
            "<string>:4:3: termination reason 'budget_exceeded' shadows the built-in reason",
        ),
        ("  Approved: {success: true}\n", "<string>:4:3: termination reason 'Approved' must be"),
        ("  approved-now: {}\n", "<string>:4:3: termination reason 'approved-now' must be"),
    ],
)
def test_declared_reasons_are_snake_case_and_never_a_built_in(reasons: str, message: str) -> None:
    with pytest.raises(WorkflowValidationError) as info:
        load_workflow_text(bad_review(reasons))

    assert str(info.value).startswith(message)


def test_success_must_be_a_real_boolean() -> None:
    with pytest.raises(WorkflowValidationError) as info:
        load_workflow_text(REVIEW.replace("{success: true,", "{success: yes,"))

    assert str(info.value) == "<string>:4:24: success: Input should be a valid boolean"


def test_an_edge_may_not_use_an_undeclared_reason() -> None:
    text = REVIEW.replace("reason: approved", "reason: accepted")

    with pytest.raises(WorkflowValidationError) as info:
        load_workflow_text(text)

    message = str(info.value)
    assert message.startswith("<string>:11:70: ")
    assert "unknown termination reason 'accepted'" in message
    assert "approved, escalated; declare your own under 'reasons:'" in message


def test_budget_exceeded_is_a_built_in_failure_reason() -> None:
    assert TerminationReason("budget_exceeded") is TerminationReason.BUDGET_EXCEEDED
    assert "limits.max_tokens" in TERMINATION_REASONS[TerminationReason.BUDGET_EXCEEDED]
    assert TerminationReason.BUDGET_EXCEEDED not in SUCCESS_REASONS


def test_the_json_schema_covers_reasons_and_token_caps() -> None:
    schema = WorkflowSpec.model_json_schema()
    defs = schema["$defs"]

    reasons = schema["properties"]["reasons"]
    assert reasons["propertyNames"]["pattern"] == "^[a-z][a-z0-9_]*$"
    assert set(reasons["propertyNames"]["not"]["enum"]) == set(TERMINATION_REASONS)
    assert reasons["additionalProperties"] == {"$ref": "#/$defs/ReasonSpec"}
    assert "exits 0" in defs["ReasonSpec"]["properties"]["success"]["description"]
    assert defs["ReasonSpec"]["additionalProperties"] is False
    assert "budget_exceeded" in defs["Limits"]["properties"]["max_tokens"]["description"]
    assert "4096" in defs["AgentBlock"]["properties"]["max_tokens"]["description"]


# --- the cap on each reply (agent.max_tokens) ----------------------------------------------

BASE = "http://model.test/v1"
ANSWER = {
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}

Handler = Callable[[dict[str, Any]], httpx.Response]


def answering(body: dict[str, Any]) -> httpx.Response:
    return httpx.Response(200, json={**ANSWER, "model": body["model"]})


def refusing(message: str, *, then: Handler = answering) -> Callable[..., httpx.Response]:
    """Answer the first request 400 with `message` (OpenAI-shaped), the rest with `then`."""
    count = 0

    def handle(body: dict[str, Any]) -> httpx.Response:
        nonlocal count
        count += 1
        if count == 1:
            error = {"message": message, "type": "invalid_request_error", "code": None}
            return httpx.Response(400, json={"error": error})
        return then(body)

    return handle


def ask(
    handler: Handler, *, times: int = 1, **settings: Any
) -> tuple[list[Completion], list[dict[str, Any]]]:
    """`times` model calls through one HttpChatModel; the answers and the request bodies."""
    bodies: list[dict[str, Any]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        return handler(body)

    options = {"base_url": BASE, "model": "m", "max_retries": 0, "stream": False, **settings}

    async def go() -> list[Completion]:
        model = HttpChatModel(AgentSettings(**options), transport=httpx.MockTransport(handle))
        async with model:
            return [await model.complete([Message.user("hi")], []) for _ in range(times)]

    return asyncio.run(go()), bodies


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_every_request_carries_the_default_cap(stream: bool) -> None:
    _, bodies = ask(answering, stream=stream)

    assert bodies[0]["max_tokens"] == DEFAULT_MAX_TOKENS == 4096
    assert "max_completion_tokens" not in bodies[0]


def test_the_workflows_cap_is_sent() -> None:
    _, bodies = ask(answering, max_tokens=256)

    assert bodies[0]["max_tokens"] == 256


def test_a_cap_of_zero_sends_none() -> None:
    _, bodies = ask(answering, max_tokens=0)

    assert "max_tokens" not in bodies[0]
    assert "max_completion_tokens" not in bodies[0]


def test_a_server_that_wants_max_completion_tokens_gets_it_from_then_on() -> None:
    openai = (
        "Unsupported parameter: 'max_tokens' is not supported with this model. Use "
        "'max_completion_tokens' instead."
    )

    answers, bodies = ask(refusing(openai), times=2, max_tokens=300)

    assert [a.message.content for a in answers] == ["hi", "hi"]
    assert bodies[0]["max_tokens"] == 300
    for body in bodies[1:]:
        assert body["max_completion_tokens"] == 300
        assert "max_tokens" not in body
    assert len(bodies) == 3  # one refusal, then each call once


VLLM_TOO_LARGE = (
    "'max_tokens' or 'max_completion_tokens' is too large: 4096. This model's maximum context "
    "length is 4096 tokens and your request has 812 input tokens (4096 > 4096 - 812). None"
)


def test_a_server_refusing_the_default_cap_is_asked_without_it() -> None:
    answers, bodies = ask(refusing(VLLM_TOO_LARGE), times=2)

    assert len(answers) == 2
    assert bodies[0]["max_tokens"] == DEFAULT_MAX_TOKENS
    assert all("max_tokens" not in body for body in bodies[1:])
    assert len(bodies) == 3


def test_a_cap_the_user_set_is_never_dropped() -> None:
    with pytest.raises(AgentBadRequestError, match="too large"):
        ask(refusing(VLLM_TOO_LARGE), max_tokens=8000)


def test_another_bad_request_is_not_taken_for_a_cap_problem() -> None:
    bodies: list[dict[str, Any]] = []

    def refuse(body: dict[str, Any]) -> httpx.Response:
        bodies.append(body)
        return httpx.Response(400, json={"error": {"message": "messages: field required"}})

    with pytest.raises(AgentBadRequestError, match="field required"):
        ask(refuse)
    assert len(bodies) == 1


def test_a_reply_cut_by_the_cap_says_so() -> None:
    def cut(body: dict[str, Any]) -> httpx.Response:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": "It is twelve o'cl"},
            "finish_reason": "length",
        }
        return httpx.Response(200, json={"choices": [choice]})

    (answer,), bodies = ask(cut, max_tokens=5)

    assert bodies[0]["max_tokens"] == 5
    assert answer.finish_reason == "length"


@pytest.mark.parametrize("value", [-1, True, 2.5, "4096"])
def test_max_tokens_setting_is_checked(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"agent\.max_tokens in the workflow"):
        AgentSettings(max_tokens=value)


def test_the_agent_block_sets_the_cap() -> None:
    spec = load_workflow_text(BARE.replace("limits:", "agent: {max_tokens: 300}\nlimits:"))

    settings = agent_settings(spec, RunOptions(), environ={})

    assert settings.max_tokens == 300
    assert agent_settings(load_workflow_text(BARE), RunOptions(), environ={}).max_tokens is None
    assert settings.public_dict()["max_tokens"] == 300  # recorded in run.started


@pytest.mark.parametrize("value", ["-5", "true", "'many'"])
def test_the_agent_blocks_cap_is_a_whole_number(value: str) -> None:
    with pytest.raises(WorkflowValidationError, match="max_tokens"):
        load_workflow_text(BARE.replace("limits:", f"agent: {{max_tokens: {value}}}\nlimits:"))


# --- the limits' defaults and bounds ------------------------------------------------------------

LIMIT_BOUNDS = [
    # field, default, the lowest value accepted, the highest (None: no cap)
    ("max_iterations", 10, 0, None),
    ("max_transitions", 1000, 1, None),
    ("timeout_seconds", 600.0, 0, None),
    ("max_tool_failures", 3, 1, None),
    ("no_progress_repeats", 3, 2, None),  # 1 would stop a run at its first tool call
    ("max_malformed_outputs", 3, 1, None),
    ("max_tool_calls_per_reply", 16, 1, 1000),
    ("max_parallel_tool_calls", 4, 1, 64),
    ("max_tokens", 0, 0, None),
]


@pytest.mark.parametrize(("field", "default", "lowest", "highest"), LIMIT_BOUNDS)
def test_each_limit_has_its_default_and_bounds(
    field: str, default: float, lowest: float, highest: float | None
) -> None:
    assert getattr(Limits(), field) == default
    assert getattr(Limits(**{field: lowest}), field) == lowest
    with pytest.raises(ValueError, match=field):
        Limits(**{field: lowest - 1})
    if highest is not None:
        assert getattr(Limits(**{field: highest}), field) == highest
        with pytest.raises(ValueError, match=field):
            Limits(**{field: highest + 1})


def test_the_bounds_table_names_every_limit() -> None:
    assert {row[0] for row in LIMIT_BOUNDS} == set(Limits.model_fields)
