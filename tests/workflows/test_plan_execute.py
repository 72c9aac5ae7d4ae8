"""plan_execute.yaml transition by transition, and scripted runs that re-plan."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fsm_kernel.testing import (
    ScriptedChatModel,
    WorkflowHarness,
    bad_call,
    call,
)
from tests.workflows._table import check_case, check_coverage

WORKFLOW = Path(__file__).resolve().parents[2] / "workflows" / "plan_execute.yaml"
HARNESS = WorkflowHarness(WORKFLOW)
MALFORMED = {"last_reply": bad_call("read_file"), "malformed_reason": "bad JSON"}
FAILED = [("read_file", "'a.txt' does not exist", True)]

CASES = [
    pytest.param("plan", {"last_reply": "1. read a.txt\n2. answer"}, "execute", None,
                 id="plan-then-execute"),
    pytest.param("execute", {"last_reply": call("read_file", {"path": "a"})}, "act", None,
                 id="tool-call-acts"),
    pytest.param("execute", {**MALFORMED, "malformed_streak": 1}, "execute", None,
                 id="malformed-retries"),
    pytest.param("execute", {**MALFORMED, "malformed_streak": 3}, "terminate",
                 "malformed_output", id="malformed-budget-spent"),
    pytest.param("execute", {"last_reply": "It is 42."}, "terminate", "final_answer",
                 id="text-answers"),
    pytest.param("act", {}, "evaluate", None, id="act-then-evaluate"),
    pytest.param("evaluate", {"done_answer": "42"}, "terminate", "done", id="done"),
    pytest.param("evaluate", {"fatal_error": "db: gone"}, "terminate", "fatal_tool_error",
                 id="fatal"),
    pytest.param("evaluate", {"tool_results": FAILED, "failure_streak": 3}, "terminate",
                 "tool_failures", id="failure-streak-beats-replanning"),
    pytest.param("evaluate", {"repeat_count": 3}, "terminate", "no_progress", id="repeats"),
    pytest.param("evaluate", {"tool_results": FAILED, "failure_streak": 1, "iteration": 15},
                 "terminate", "max_iterations", id="cap-beats-replanning"),
    pytest.param("evaluate", {"tool_results": FAILED, "failure_streak": 1}, "replan", None,
                 id="failed-step-replans"),
    pytest.param("evaluate", {"tool_results": [("read_file", "42", False)]}, "execute", None,
                 id="good-step-continues"),
    pytest.param("replan", {"last_reply": "1. list the folder\n2. answer"}, "execute", None,
                 id="replan-then-execute"),
]  # fmt: skip


@pytest.mark.parametrize(("state", "ctx", "target", "reason"), CASES)
def test_transition(state: str, ctx: dict[str, Any], target: str, reason: str | None) -> None:
    check_case(HARNESS, state, ctx, target, reason)


def test_every_declared_transition_has_a_case() -> None:
    check_coverage(WORKFLOW, CASES)


def test_run_replans_after_a_failed_step(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("forty-two", encoding="utf-8")
    model = ScriptedChatModel(
        [
            "1. read a.txt\n2. answer",
            call("read_file", {"path": "a.txt"}),
            "1. read b.txt instead\n2. answer",
            call("read_file", {"path": "b.txt"}),
            "b.txt says forty-two.",
        ]
    )
    result = HARNESS.run("What does the file say?", model=model, workspace=tmp_path)
    assert (result.termination_reason, result.response) == ("final_answer", "b.txt says forty-two.")
    assert [r.result.is_error for r in result.tool_calls] == [True, False]
    assert model.requests[0].tools == model.requests[2].tools == ()  # planning offers no tools
    assert model.requests[2].last_message.content.startswith("A step failed")
    model.assert_complete()


def test_run_stops_after_too_many_failures_in_a_row() -> None:
    model = ScriptedChatModel(
        [
            "plan",
            call("read_file", {"path": "a.txt"}),
            "new plan",
            call("read_file", {"path": "b.txt"}),
            "newer plan",
            call("read_file", {"path": "c.txt"}),
        ]
    )
    result = HARNESS.run("read it", model=model)
    assert result.termination_reason == "tool_failures"
    assert len(result.tool_calls) == 3
    model.assert_complete()
