"""react.yaml transition by transition, and a scripted run through its reasoning steps."""

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

WORKFLOW = Path(__file__).resolve().parents[2] / "workflows" / "react.yaml"
HARNESS = WorkflowHarness(WORKFLOW)
MALFORMED = {"last_reply": bad_call("read_file"), "malformed_reason": "bad JSON"}

CASES = [
    pytest.param("reason", {"last_reply": "I should read a.txt."}, "think", None,
                 id="reasoning-then-act"),
    pytest.param("reason", {**MALFORMED, "malformed_streak": 1}, "think", None,
                 id="reasoning-that-calls-a-tool-still-acts"),
    pytest.param("think", {"last_reply": call("read_file", {"path": "a"})}, "act", None,
                 id="tool-call-acts"),
    pytest.param("think", {**MALFORMED, "malformed_streak": 1}, "think", None,
                 id="malformed-retries"),
    pytest.param("think", {**MALFORMED, "malformed_streak": 3}, "terminate", "malformed_output",
                 id="malformed-budget-spent"),
    pytest.param("think", {"last_reply": "It is 42."}, "answer", None,
                 id="text-goes-to-the-final-check"),
    pytest.param("act", {}, "evaluate", None, id="act-then-evaluate"),
    pytest.param("evaluate", {"done_answer": "42"}, "terminate", "done", id="done"),
    pytest.param("evaluate", {"fatal_error": "db: gone"}, "terminate", "fatal_tool_error",
                 id="fatal"),
    pytest.param("evaluate", {"failure_streak": 3}, "terminate", "tool_failures",
                 id="failure-streak"),
    pytest.param("evaluate", {"repeat_count": 3}, "terminate", "no_progress", id="repeats"),
    pytest.param("evaluate", {"iteration": 20}, "terminate", "max_iterations", id="cap"),
    pytest.param("evaluate", {"iteration": 19, "tool_results": [("read_file", "no", True)],
                              "failure_streak": 1}, "reason", None,
                 id="a-failed-tool-reasons-again"),
    pytest.param("answer", {"last_reply": "42"}, "terminate", "final_answer", id="final-answer"),
]  # fmt: skip


@pytest.mark.parametrize(("state", "ctx", "target", "reason"), CASES)
def test_transition(state: str, ctx: dict[str, Any], target: str, reason: str | None) -> None:
    check_case(HARNESS, state, ctx, target, reason)


def test_every_declared_transition_has_a_case() -> None:
    check_coverage(WORKFLOW, CASES)


def test_run_reasons_without_tools_before_each_action(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("forty-two", encoding="utf-8")
    model = ScriptedChatModel(
        [
            "The answer is in a.txt; read it.",
            call("read_file", {"path": "a.txt"}),
            "The file says forty-two; I can answer.",
            "forty-two",
            "The answer is 42.",
        ]
    )
    result = HARNESS.run("What does a.txt say?", model=model, workspace=tmp_path)
    assert (result.termination_reason, result.response) == ("final_answer", "The answer is 42.")
    offered = [r.tool_names for r in model.requests]
    assert offered[0] == offered[2] == offered[4] == []  # reasoning and the final check
    assert "read_file" in offered[1]
    assert offered[1] == offered[3]
    assert model.requests[0].last_message.content.startswith("Think about the next step")
    assert model.requests[4].last_message.content.startswith("Check your answer")
    model.assert_complete()


def test_run_ends_at_the_iteration_cap_mid_loop() -> None:
    model = ScriptedChatModel(["reasoning", call("datetime"), "more reasoning"])
    result = HARNESS.run("loop", model=model, limits={"max_iterations": 3})
    assert result.termination_reason == "max_iterations"
    assert result.iterations == 3
    model.assert_complete()
