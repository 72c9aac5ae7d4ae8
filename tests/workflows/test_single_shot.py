"""single_shot.yaml transition by transition, and its one-call runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fsm_kernel.testing import (
    ScriptedChatModel,
    WorkflowHarness,
    call,
)
from tests.workflows._table import check_case, check_coverage

WORKFLOW = Path(__file__).resolve().parents[2] / "workflows" / "single_shot.yaml"
HARNESS = WorkflowHarness(WORKFLOW)

CASES = [
    pytest.param("answer", {"last_reply": call("datetime"),
                            "malformed_reason": "tool 'datetime' was not offered"},
                 "terminate", "malformed_output", id="tool-call-is-malformed"),
    pytest.param("answer", {"last_reply": "Bonjour."}, "terminate", "final_answer", id="answer"),
    pytest.param("answer", {"last_reply": ""}, "terminate", "final_answer", id="empty-answer"),
]  # fmt: skip


@pytest.mark.parametrize(("state", "ctx", "target", "reason"), CASES)
def test_transition(state: str, ctx: dict[str, Any], target: str, reason: str | None) -> None:
    check_case(HARNESS, state, ctx, target, reason)


def test_every_declared_transition_has_a_case() -> None:
    check_coverage(WORKFLOW, CASES)


def test_the_workflow_offers_no_tools_and_one_call() -> None:
    assert HARNESS.spec.tools == []
    assert HARNESS.spec.limits.max_iterations == 1


def test_run_is_one_call_without_tools() -> None:
    model = ScriptedChatModel(["Bonjour."])
    result = HARNESS.run("Say hello in French.", model=model)
    assert (result.termination_reason, result.response) == ("final_answer", "Bonjour.")
    assert result.iterations == 1
    assert len(model.requests) == 1
    assert model.requests[0].tools == ()
    model.assert_complete()


def test_run_refuses_a_tool_call_and_ends() -> None:
    model = ScriptedChatModel([call("datetime")])
    result = HARNESS.run("What time is it?", model=model)
    assert result.termination_reason == "malformed_output"
    assert result.tool_calls[0].result.is_error
    assert len(model.requests) == 1
