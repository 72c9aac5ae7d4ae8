"""reflect.yaml transition by transition, and scripted runs through critique and revision."""

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

WORKFLOW = Path(__file__).resolve().parents[2] / "workflows" / "reflect.yaml"
HARNESS = WorkflowHarness(WORKFLOW)
MALFORMED = {"last_reply": bad_call("read_file"), "malformed_reason": "bad JSON"}

CASES = [
    pytest.param("draft", {"last_reply": call("datetime")}, "act", None, id="tool-call-acts"),
    pytest.param("draft", {**MALFORMED, "malformed_streak": 1}, "draft", None,
                 id="malformed-retries"),
    pytest.param("draft", {**MALFORMED, "malformed_streak": 3}, "terminate", "malformed_output",
                 id="malformed-budget-spent"),
    pytest.param("draft", {"last_reply": "Paris is the capital."}, "critique", None,
                 id="answer-goes-to-critique"),
    pytest.param("act", {}, "evaluate", None, id="act-then-evaluate"),
    pytest.param("evaluate", {"fatal_error": "db: gone"}, "terminate", "fatal_tool_error",
                 id="fatal"),
    pytest.param("evaluate", {"failure_streak": 3}, "terminate", "tool_failures",
                 id="failure-streak"),
    pytest.param("evaluate", {"repeat_count": 3}, "terminate", "no_progress", id="repeats"),
    pytest.param("evaluate", {"iteration": 12}, "terminate", "max_iterations", id="cap"),
    pytest.param("evaluate", {"done_answer": "ignored: no done tool here"}, "draft", None,
                 id="back-to-draft"),
    pytest.param("critique", {"last_reply": "PASS"}, "finalize", None, id="pass"),
    pytest.param("critique", {"last_reply": "**Pass.**"}, "finalize", None, id="pass-decorated"),
    pytest.param("critique", {"last_reply": "1. The year is wrong."}, "revise", None,
                 id="problems-revise"),
    pytest.param("critique", {"last_reply": "PASSABLE, but the year is wrong"}, "revise", None,
                 id="passable-is-not-pass"),
    pytest.param("revise", {"last_reply": "Better answer", "iteration": 12}, "terminate",
                 "max_iterations", id="cap-after-revision"),
    pytest.param("revise", {"last_reply": "Better answer", "iteration": 3}, "critique", None,
                 id="revision-is-critiqued"),
    pytest.param("finalize", {"last_reply": "Paris."}, "terminate", "final_answer",
                 id="final-answer"),
]  # fmt: skip


@pytest.mark.parametrize(("state", "ctx", "target", "reason"), CASES)
def test_transition(state: str, ctx: dict[str, Any], target: str, reason: str | None) -> None:
    check_case(HARNESS, state, ctx, target, reason)


def test_every_declared_transition_has_a_case() -> None:
    check_coverage(WORKFLOW, CASES)


def test_run_revises_until_the_critique_passes() -> None:
    model = ScriptedChatModel(
        [
            "The Eiffel Tower is 300 m tall.",
            "1. Give the height with its antennas.",
            "The Eiffel Tower is 330 m tall, antennas included.",
            "PASS",
            "The Eiffel Tower is 330 m tall, antennas included.",
        ]
    )
    result = HARNESS.run("How tall is the Eiffel Tower?", model=model)
    assert result.termination_reason == "final_answer"
    assert result.response == "The Eiffel Tower is 330 m tall, antennas included."
    assert [r.tool_names for r in model.requests[1:]] == [[], [], [], []]
    assert model.requests[1].last_message.content.startswith("Review your latest answer")
    assert model.requests[2].last_message.content.startswith("Rewrite your answer")
    assert model.requests[4].last_message.content.startswith("Your answer passed")
    model.assert_complete()


def test_run_that_never_passes_ends_after_a_revision() -> None:
    model = ScriptedChatModel(["draft", "1. wrong", "revision 1", "1. still wrong", "revision 2"])
    result = HARNESS.run("question", model=model, limits={"max_iterations": 5})
    assert (result.termination_reason, result.response) == ("max_iterations", "revision 2")
    model.assert_complete()
