"""default.yaml transition by transition, and the documentation every stock workflow carries."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from fsm_kernel.bootstrap import RunOptions, build_tools
from fsm_kernel.testing import (
    ScriptedChatModel,
    WorkflowHarness,
    bad_call,
    call,
)
from fsm_kernel.workflow.loader import load_workflow
from tests.workflows._table import check_case, check_coverage

WORKFLOWS = Path(__file__).resolve().parents[2] / "workflows"
HARNESS = WorkflowHarness(WORKFLOWS / "default.yaml")

CASES = [
    pytest.param("observe", {}, "think", None, id="observe-then-think"),
    pytest.param("think", {"last_reply": call("read_file", {"path": "a"})}, "act", None,
                 id="tool-call-acts"),
    pytest.param("think", {"last_reply": bad_call("read_file"), "malformed_reason": "bad JSON",
                           "malformed_streak": 1}, "think", None, id="malformed-retries"),
    pytest.param("think", {"last_reply": bad_call("read_file"), "malformed_reason": "bad JSON",
                           "malformed_streak": 3}, "terminate", "malformed_output",
                 id="malformed-budget-spent"),
    pytest.param("think", {"last_reply": "It is 42."}, "terminate", "final_answer",
                 id="text-answers"),
    pytest.param("think", {"last_reply": ""}, "terminate", "final_answer", id="empty-answers"),
    pytest.param("act", {}, "evaluate", None, id="act-then-evaluate"),
    pytest.param("evaluate", {"done_answer": "42"}, "terminate", "done", id="done"),
    pytest.param("evaluate", {"fatal_error": "db: gone"}, "terminate", "fatal_tool_error",
                 id="fatal"),
    pytest.param("evaluate", {"failure_streak": 3}, "terminate", "tool_failures",
                 id="failure-streak"),
    pytest.param("evaluate", {"repeat_count": 3}, "terminate", "no_progress", id="repeats"),
    pytest.param("evaluate", {"iteration": 10}, "terminate", "max_iterations", id="cap"),
    pytest.param("evaluate", {"iteration": 9, "failure_streak": 2, "repeat_count": 2},
                 "observe", None, id="below-every-limit-loops"),
    pytest.param("evaluate", {"done_answer": "42", "iteration": 10}, "terminate", "done",
                 id="done-wins-over-cap"),
    pytest.param("evaluate", {"iteration": 2, "limits": {"max_iterations": 2}}, "terminate",
                 "max_iterations", id="cap-from-limits"),
    pytest.param("evaluate", {"iteration": 1000, "limits": {"max_iterations": 0}}, "observe",
                 None, id="zero-cap-is-unlimited"),
]  # fmt: skip


@pytest.mark.parametrize(("state", "ctx", "target", "reason"), CASES)
def test_transition(state: str, ctx: dict[str, Any], target: str, reason: str | None) -> None:
    check_case(HARNESS, state, ctx, target, reason)


def test_every_declared_transition_has_a_case() -> None:
    check_coverage(WORKFLOWS / "default.yaml", CASES)


def test_run_reads_a_file_then_answers(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("the answer is 42", encoding="utf-8")
    model = ScriptedChatModel([call("read_file", {"path": "notes.txt"}), "42"])
    result = HARNESS.run("What is the answer?", model=model, workspace=tmp_path)
    assert (result.termination_reason, result.response) == ("final_answer", "42")
    assert model.requests[1].last_message.content == "the answer is 42"
    model.assert_complete()


# --- every stock workflow documents itself (the header comment `fsm-kernel workflows` users
# read before choosing one) ---------------------------------------------------------------------

STOCK = sorted(WORKFLOWS.glob("*.yaml"))


def _header(path: Path) -> str:
    lines = path.read_text(encoding="utf-8").splitlines()
    header = []
    for line in lines:
        if not line.startswith("#"):
            break
        header.append(line.lstrip("# "))
    return " ".join(header)


def test_the_five_stock_workflows_ship() -> None:
    names = {p.stem for p in STOCK}
    assert {"default", "react", "plan_execute", "reflect", "single_shot"} <= names


@pytest.mark.parametrize("path", STOCK, ids=[p.stem for p in STOCK])
def test_stock_workflow_header_names_its_actions_and_reasons(path: Path) -> None:
    spec = load_workflow(path)
    header = _header(path)
    assert header.startswith(f"{spec.name} — ")
    assert "Choose it" in header
    actions = re.search(r"Actions: (.*?)\.(?: |$)", header)
    assert actions is not None, "the header needs an 'Actions:' line"
    for state in spec.states.values():
        if state.action:
            assert state.action in actions.group(1)
    for final in spec.final_states():
        assert f"Terminal state: {final}" in header
    for t in spec.transitions:
        if t.reason:
            assert t.reason in header


@pytest.mark.parametrize("path", STOCK, ids=[p.stem for p in STOCK])
def test_stock_workflow_validates_with_its_tools(path: Path) -> None:
    spec = load_workflow(path)
    assert spec.description.strip()
    assert "\n" not in spec.description
    offered = build_tools(spec, RunOptions()).offered  # what `fsm-kernel validate` checks
    assert offered == spec.tool_names
