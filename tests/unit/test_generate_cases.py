"""The test generator (issue 28, part 2): it reaches every declared edge of each stock
workflow with short scripts, names a case after the edge it was made for, writes `limits:`
only where a case needs them, tries the texts a Python guard declares with `@witnesses`, and
reports the edges no script reaches."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fsm_kernel.testing import WorkflowHarness
from fsm_kernel.testing._generate import generate_cases
from fsm_kernel.workflow.loader import load_workflow_text

STOCK = ["default", "react", "reflect", "approve_tools", "plan_execute", "single_shot"]

REVIEW = """\
name: review
tools: []
initial: draft
states:
  draft: {action: agent.think}
  review: {action: agent.think, answer: false}
  done: {final: true}
transitions:
  - {source: draft, target: review}
  - source: review
    target: done
    guard: tests.data.generate.guards:reviewer_approved
    reason: final_answer
  - {source: review, target: done, guard: tests.data.generate.guards:never, reason: done}
  - {source: review, target: draft}
"""


@pytest.mark.parametrize("name", STOCK)
def test_every_edge_of_a_stock_workflow_is_reached(name: str) -> None:
    harness = WorkflowHarness(name)

    suite = generate_cases(harness, workflow_ref=name)

    assert suite.unreached == []
    expected = {d.index for d in harness.transitions}
    reasons = {case["expect"].get("reason") for case in suite.cases.values()}
    assert len(suite.cases) <= len(expected)
    assert None not in reasons or name == "approve_tools"  # a case may end waiting
    document = yaml.safe_load(suite.to_yaml())
    assert document["workflow"] == name
    assert set(document["cases"]) == set(suite.cases)


def test_a_case_needs_lowered_limits_only_to_reach_a_limit_edge() -> None:
    suite = generate_cases(WorkflowHarness("default"), workflow_ref="default")

    answered = suite.cases["think_to_terminate_final_answer"]
    failing = suite.cases["evaluate_to_terminate_tool_failures"]

    assert answered == {
        "prompt": "Generated case",
        "model": [{"text": "The answer."}],
        "expect": {"path": ["observe", "think", "terminate"], "reason": "final_answer"},
    }
    assert failing["limits"]["max_tool_failures"] == 2
    assert failing["tools"] == {"datetime": [{"error": "failure 0"}, {"error": "failure 1"}]}
    assert failing["expect"]["reason"] == "tool_failures"


def test_witness_texts_are_tried_and_an_edge_no_script_reaches_is_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    harness = WorkflowHarness(load_workflow_text(REVIEW, path="review.yaml"))

    suite = generate_cases(harness, workflow_ref="review.yaml")

    assert suite.unreached == ["review → done [tests.data.generate.guards:never]"]
    approved = suite.cases["review_to_done_final_answer"]
    assert approved["model"] == [{"text": "The answer."}, {"text": "LGTM"}]
    assert "not reached: review → done [tests.data.generate.guards:never]" in suite.to_yaml()
