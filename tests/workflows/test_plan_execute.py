"""plan_execute.yaml transition by transition, and scripted runs: the plan is structured output,
each step a react child run, a failed step re-plans the rest."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fsm_kernel.store import SqliteEventStore
from fsm_kernel.testing import ChildResult, ScriptedChatModel, WorkflowHarness, call
from tests.workflows._table import check_case, check_coverage

WORKFLOW = Path(__file__).resolve().parents[2] / "workflows" / "plan_execute.yaml"
HARNESS = WorkflowHarness(WORKFLOW)
PLAN = json.dumps({"steps": ["read a.txt", "say what it holds"]})
NOT_A_PLAN = {"last_reply": "1. read a.txt", "malformed_reason": "not JSON"}


def child(ok: bool) -> ChildResult:
    return ChildResult(
        run_id="c1",
        workflow="react",
        reason="final_answer" if ok else "tool_failures",
        ok=ok,
        answer="found it" if ok else "",
    )


CASES = [
    pytest.param("plan", {"last_reply": PLAN}, "execute", None, id="plan-then-execute"),
    pytest.param("plan", {**NOT_A_PLAN, "malformed_streak": 1}, "plan", None,
                 id="not-a-plan-asks-again"),
    pytest.param("plan", {**NOT_A_PLAN, "malformed_streak": 3}, "terminate", "malformed_output",
                 id="never-a-plan"),
    pytest.param("execute", {"children": [child(True), child(True)]}, "answer", None,
                 id="every-step-succeeded"),
    pytest.param("execute", {"children": [child(True), child(False)], "iteration": 40},
                 "terminate", "max_iterations", id="budget-spent-no-replan"),
    pytest.param("execute", {"children": [child(True), child(False)]}, "replan", None,
                 id="a-failed-step-replans"),
    pytest.param("execute", {"children": [child(False)], "vars": {"replans": 1}}, "replan", None,
                 id="a-second-replan"),
    pytest.param("execute", {"children": [child(False)], "vars": {"replans": 2}}, "terminate",
                 "steps_failed", id="two-replans-then-give-up"),
    pytest.param("replan", {"last_reply": PLAN}, "execute", None, id="replan-then-execute"),
    pytest.param("replan", {**NOT_A_PLAN, "malformed_streak": 1}, "replan", None,
                 id="not-a-new-plan-asks-again"),
    pytest.param("replan", {**NOT_A_PLAN, "malformed_streak": 3}, "terminate",
                 "malformed_output", id="never-a-new-plan"),
    pytest.param("answer", {"last_reply": "It says 42."}, "terminate", "final_answer",
                 id="answers"),
]  # fmt: skip


@pytest.mark.parametrize(("state", "ctx", "target", "reason"), CASES)
def test_transition(state: str, ctx: dict[str, Any], target: str, reason: str | None) -> None:
    check_case(HARNESS, state, ctx, target, reason)


def test_every_declared_transition_has_a_case() -> None:
    check_coverage(WORKFLOW, CASES)


def react_step(path: str, answer: str) -> list[Any]:
    """What one react child is scripted to say: a thought, a read_file call, a thought, then
    text (its think state) and the checked answer."""
    return [
        "I should read the file.",
        call("read_file", {"path": path}),
        "I have what I need.",
        answer,
        answer,
    ]


def test_each_step_runs_as_a_react_child_and_the_answer_comes_from_their_results(
    tmp_path: Path,
) -> None:
    (tmp_path / "a.txt").write_text("forty-two", encoding="utf-8")
    model = ScriptedChatModel(
        [
            json.dumps({"steps": ["read a.txt", "say what it holds"]}),
            *react_step("a.txt", "a.txt holds forty-two."),
            "I know it already.",
            "It is forty-two.",
            "It is forty-two.",
            "The file says forty-two.",
        ]
    )
    with SqliteEventStore(tmp_path / "runs.db") as store:
        result = HARNESS.run(
            "What does the file say?", model=model, workspace=tmp_path, store=store
        )
        children = [r for r in store.list_runs() if r.parent_run_id == result.run_id]

    assert (result.termination_reason, result.response) == (
        "final_answer",
        "The file says forty-two.",
    )
    model.assert_complete()
    assert [c.workflow for c in children] == ["react", "react"]
    plan_request = model.requests[0]
    assert plan_request.tools == ()
    first_step = model.requests[1].messages[1].content  # after react's system prompt
    assert first_step.startswith("The overall task: What does the file say?\n")
    assert 'The plan: ["read a.txt", "say what it holds"]' in first_step
    assert "Your part is step 1: read a.txt" in first_step
    answer_request = model.requests[-1]
    results = answer_request.messages[-2].content
    assert results.startswith("The workflow 'react' ran once per item (2 items):")
    assert "→ a.txt holds forty-two." in results
    assert "→ It is forty-two." in results


def test_a_failed_step_replans_the_rest(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("forty-two", encoding="utf-8")
    missing = call("read_file", {"path": "a.txt"})
    model = ScriptedChatModel(
        [
            json.dumps({"steps": ["read a.txt"]}),
            # the react child fails three times in a row: tool_failures
            "Read it.", missing, "Again.", missing, "Once more.", missing,
            json.dumps({"steps": ["read b.txt instead"]}),
            *react_step("b.txt", "b.txt holds forty-two."),
            "The file says forty-two.",
        ]
    )  # fmt: skip
    result = HARNESS.run("What does the file say?", model=model, workspace=tmp_path)

    assert result.termination_reason == "final_answer"
    model.assert_complete()
    replan = next(r for r in model.requests if "A step failed" in r.last_message.content)
    assert "(failed: tool_failures)" in replan.messages[-2].content
    states = [t.source for t in HARNESS.fired[-5:]]
    assert states == ["plan", "execute", "replan", "execute", "answer"]


def test_a_step_that_keeps_failing_ends_the_run_after_two_replans(tmp_path: Path) -> None:
    missing = call("read_file", {"path": "a.txt"})
    failing = ["Read it.", missing, "Again.", missing, "Once more.", missing]
    plan = json.dumps({"steps": ["read a.txt"]})
    model = ScriptedChatModel([plan, *failing, plan, *failing, plan, *failing])

    result = HARNESS.run("What does the file say?", model=model, workspace=tmp_path)

    assert result.termination_reason == "steps_failed"
    assert not result.ok
    model.assert_complete()
    assigned = [e.data["value"] for e in result.events if e.type.value == "vars.assigned"]
    assert assigned == [1, 2]
    taken = [
        (e.data["source"], e.data["target"], e.data["reason"])
        for e in result.events
        if e.type.value == "transition.taken"
    ]
    gave_up = ("execute", "terminate", "steps_failed")
    assert taken == [("plan", "execute", None), ("execute", "replan", None),
                     ("replan", "execute", None), ("execute", "replan", None),
                     ("replan", "execute", None), gave_up]  # fmt: skip
