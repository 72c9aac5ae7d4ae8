"""`fsm-kernel` over real HTTP against FakeOpenAIServer: every limit ends a run whose workflow
declares no transition for it (reason, error and exit code), stock workflows still end through
their own edges, a workflow's own reasons decide the exit code, and each request carries the
cap on each reply, a reply cut by it being recorded as such."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fsm_kernel.errors import ToolFatalError
from fsm_kernel.protocol import Event, EventType
from fsm_kernel.store import SqliteEventStore
from tests.clikit import Outcome, cli
from tests.fakes.openai_server import FakeOpenAIServer, Reply, call, text_reply, tool_reply

REPO = Path(__file__).resolve().parents[2]
DEFAULT = REPO / "workflows" / "default.yaml"

# No tool_failures, no_progress, fatal_tool_error, malformed-output cap or iteration_limit
# edge: whatever happens, these transitions never end the run for a limit.
BARE = """
name: bare
tools: [datetime, read_file, "tests.integration.test_limits_enforced:explode"]
limits: {max_iterations: 10, max_tokens: 0}
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


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


def workflow(tmp_path: Path, text: str, name: str = "flow.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def run(
    capsys: pytest.CaptureFixture[str],
    server: FakeOpenAIServer,
    tmp_path: Path,
    flow: Path,
) -> tuple[Outcome, list[Event]]:
    """`fsm-kernel run FLOW --json` against the fake server; the outcome and the run's log."""
    store = tmp_path / "runs.db"
    outcome = cli(
        capsys,
        [
            "run",
            str(flow),
            "--prompt",
            "go",
            "--base-url",
            server.base_url,
            "--store",
            str(store),
            "--workspace",
            str(tmp_path),
            "--json",
        ],
    )
    with SqliteEventStore(store) as events:
        return outcome, list(events.read(outcome.json()["run_id"]))


def of_type(events: list[Event], type_: EventType) -> list[dict[str, Any]]:
    return [e.data for e in events if e.type is type_]


def tokens(n: int) -> dict[str, int]:
    return {"prompt_tokens": n - 5, "completion_tokens": 5, "total_tokens": n}


# --- every limit, without its transition ---------------------------------------------------

LIMITS = [
    pytest.param(
        [tool_reply(call("read_file", {"path": f"{n}.txt"})) for n in "abc"],
        "",
        "tool_failures",
        "3 failed tool calls in a row (limits.max_tool_failures = 3); the last: read_file: ",
        id="tool_failures",
    ),
    pytest.param(
        [tool_reply(call("datetime", {})) for _ in range(3)],
        "",
        "no_progress",
        "datetime called with the same arguments 3 times in a row (limits.no_progress_repeats = 3)",
        id="no_progress",
    ),
    pytest.param(
        [tool_reply(call("explode", {"reason": "full"}))],
        "",
        "fatal_tool_error",
        "explode: disk is gone: full",
        id="fatal_tool_error",
    ),
    pytest.param(
        [tool_reply(call("datetime", "{not json")) for _ in range(3)],
        "",
        "malformed_output",
        "3 malformed model replies in a row (limits.max_malformed_outputs = 3)",
        id="malformed_output",
    ),
    pytest.param(
        [
            tool_reply(call("datetime", {"timezone": z}), usage=tokens(15))
            for z in ("UTC", "Asia/Tokyo", "Europe/Paris")
        ],
        "max_tokens: 40",
        "budget_exceeded",
        "the model calls used 45 tokens (30 prompt + 15 completion), reaching "
        "limits.max_tokens = 40",
        id="budget_exceeded",
    ),
]


@pytest.mark.parametrize(("replies", "limits", "reason", "error"), LIMITS)
def test_each_limit_ends_a_run_that_declares_no_transition_for_it(
    replies: list[Reply],
    limits: str,
    reason: str,
    error: str,
    server: FakeOpenAIServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server.enqueue(*replies)
    flow = workflow(tmp_path, BARE.replace("max_tokens: 0", limits or "max_tokens: 0"))

    outcome, events = run(capsys, server, tmp_path, flow)

    assert outcome.code == 1
    result = outcome.json()
    assert result["termination_reason"] == reason
    assert error in result["error"]
    assert len(server.requests) == len(replies)  # not one model call past the limit
    server.assert_complete()
    assert of_type(events, EventType.RUN_TERMINATED)[-1]["reason"] == reason
    assert all(t["target"] != "terminate" for t in of_type(events, EventType.TRANSITION_TAKEN))


def test_a_run_the_kernel_stopped_replays_identical(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(*[tool_reply(call("read_file", {"path": f"{n}.txt"})) for n in "abc"])
    outcome, _ = run(capsys, server, tmp_path, workflow(tmp_path, BARE))
    run_id = outcome.json()["run_id"]

    replay = cli(capsys, ["replay", run_id, "--store", str(tmp_path / "runs.db"), "--json"])

    assert replay.code == 0, replay.out
    report = replay.json()
    assert report["identical"] is True
    assert report["replayed_reason"] == "tool_failures"


def test_the_stock_workflow_still_ends_through_its_own_edge(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(*[tool_reply(call("read_file", {"path": f"{n}.txt"})) for n in "abc"])

    outcome, events = run(capsys, server, tmp_path, DEFAULT)

    assert outcome.code == 1
    assert outcome.json()["termination_reason"] == "tool_failures"
    last = of_type(events, EventType.TRANSITION_TAKEN)[-1]
    assert (last["source"], last["target"], last["reason"]) == (
        "evaluate",
        "terminate",
        "tool_failures",
    )
    server.assert_complete()


def test_a_budget_does_not_end_a_run_that_answers_within_it(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(
        tool_reply(call("datetime", {}), usage=tokens(15)),
        text_reply("It is noon.", usage=tokens(15)),
    )
    flow = workflow(tmp_path, BARE.replace("max_tokens: 0", "max_tokens: 31"))

    outcome, _ = run(capsys, server, tmp_path, flow)

    assert outcome.code == 0
    assert outcome.json()["termination_reason"] == "final_answer"
    assert outcome.json()["usage"]["total_tokens"] == 30


# --- the workflow's own reasons ------------------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "reason", "code"),
    [("PASS", "approved", 0), ("Someone should check the numbers.", "escalated", 1)],
)
def test_a_declared_reason_decides_the_exit_code(
    reply: str,
    reason: str,
    code: int,
    server: FakeOpenAIServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server.enqueue(text_reply(reply))

    outcome, events = run(capsys, server, tmp_path, workflow(tmp_path, REVIEW))

    assert outcome.code == code
    assert outcome.json()["termination_reason"] == reason
    assert ("error" in outcome.json()) is False
    assert of_type(events, EventType.TRANSITION_TAKEN)[-1]["reason"] == reason
    assert of_type(events, EventType.RUN_TERMINATED)[-1]["reason"] == reason


@pytest.mark.parametrize(
    ("reasons", "message"),
    [
        ("  done: {success: true}\n", "4:3: termination reason 'done' shadows the built-in"),
        ("  Approved: {success: true}\n", "4:3: termination reason 'Approved' must be snake_case"),
    ],
)
def test_validate_refuses_a_bad_reason_name(
    reasons: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = REVIEW.replace("  approved:  {success: true, description: the review passed}\n", reasons)
    flow = workflow(tmp_path, text)

    outcome = cli(capsys, ["validate", str(flow)])

    assert outcome.code == 2
    assert outcome.err.startswith(f"error: {flow}:{message}")
    assert outcome.out == ""


def test_validate_accepts_declared_reasons(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flow = workflow(tmp_path, REVIEW)

    outcome = cli(capsys, ["validate", str(flow)])

    assert outcome.code == 0, outcome.err
    assert outcome.out == f"{flow}: ok (2 states, 2 transitions)\n"


def test_the_schema_covers_reasons_and_both_token_caps(
    capsys: pytest.CaptureFixture[str],
) -> None:
    outcome = cli(capsys, ["schema"])

    assert outcome.code == 0
    schema = json.loads(outcome.out)  # indented, over many lines
    assert "reasons" in schema["properties"]
    assert "success" in schema["$defs"]["ReasonSpec"]["properties"]
    assert "max_tokens" in schema["$defs"]["Limits"]["properties"]
    assert "max_tokens" in schema["$defs"]["AgentBlock"]["properties"]


# --- the cap on each reply -----------------------------------------------------------------


def test_every_request_carries_the_default_reply_cap(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(tool_reply(call("datetime", {})), text_reply("noon"))

    outcome, _ = run(capsys, server, tmp_path, DEFAULT)

    assert outcome.code == 0
    assert [r["max_tokens"] for r in server.requests] == [4096, 4096]


def test_the_workflows_reply_cap_is_sent_and_recorded(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(text_reply("noon"))
    flow = workflow(tmp_path, BARE.replace("limits:", "agent: {max_tokens: 64}\nlimits:"))

    outcome, events = run(capsys, server, tmp_path, flow)

    assert outcome.code == 0
    assert server.requests[0]["max_tokens"] == 64
    assert of_type(events, EventType.RUN_STARTED)[0]["settings"]["max_tokens"] == 64


def test_an_answer_cut_by_the_cap_is_recorded_as_truncated(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(text_reply("It is twelve o'cl", finish_reason="length"))
    flow = workflow(tmp_path, BARE.replace("limits:", "agent: {max_tokens: 6}\nlimits:"))

    outcome, events = run(capsys, server, tmp_path, flow)

    assert outcome.code == 1
    result = outcome.json()
    assert (result["termination_reason"], result["response"]) == ("truncated", "It is twelve o'cl")
    assert "agent.max_tokens" in result["error"]
    (responded,) = of_type(events, EventType.MODEL_RESPONDED)
    assert responded["completion"]["finish_reason"] == "length"


def test_a_tool_call_cut_by_the_cap_is_malformed_and_retried(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(
        tool_reply(call("datetime", '{"timezone": "Euro'), finish_reason="length"),
        text_reply("It is noon."),
    )

    outcome, events = run(capsys, server, tmp_path, DEFAULT)

    assert outcome.code == 0
    assert outcome.json()["termination_reason"] == "final_answer"
    first, second = of_type(events, EventType.MODEL_RESPONDED)
    assert first["completion"]["finish_reason"] == "length"
    assert second["completion"]["finish_reason"] == "stop"
    decisions = [d["decision"] for d in of_type(events, EventType.ITERATION_COMPLETED)]
    assert decisions == ["malformed", "answer"]
    assert "not JSON" in server.requests[1]["messages"][-1]["content"]  # told to retry
