"""examples/custom_guard end to end: a user's own guard, action and tool, imported by
`package.module:function` references, route a run driven by a scripted model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fsm_kernel.bootstrap import RunOptions, build_tools
from fsm_kernel.errors import WorkflowValidationError
from fsm_kernel.protocol import EventType
from fsm_kernel.testing import ScriptedChatModel, WorkflowHarness, call
from fsm_kernel.workflow.loader import load_workflow, load_workflow_text

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_guard"
GUARD = "ticket_agent:looks_like_ticket_id"
UNGUARDED = """
name: unguarded
initial: triage
states:
  triage: {action: agent.think}
  note_ticket: {action: "ticket_agent:note_ticket"}
  terminate: {final: true}
transitions:
  - {source: triage, target: note_ticket}
  - {source: note_ticket, target: terminate, reason: final_answer}
"""


@pytest.fixture
def harness(monkeypatch: pytest.MonkeyPatch) -> WorkflowHarness:
    monkeypatch.syspath_prepend(str(EXAMPLE))
    return WorkflowHarness(EXAMPLE / "workflow.yaml")


def test_the_custom_guard_routes_a_ticket_question_to_the_lookup(
    harness: WorkflowHarness,
) -> None:
    model = ScriptedChatModel(
        [
            "OPS-7",
            call("lookup_ticket", {"ticket_id": "OPS-7"}),
            "OPS-7 is closed: the fuser unit was replaced on 2024-05-02.",
        ]
    )
    result = harness.run("Was ticket OPS-7 about the printer fixed?", model=model)
    assert result.termination_reason == "final_answer"
    assert result.response == "OPS-7 is closed: the fuser unit was replaced on 2024-05-02."
    first = harness.fired[0]
    assert (first.source, first.target, first.guard) == ("triage", "note_ticket", GUARD)
    # the custom action's message reached the model, which was offered only the custom tool
    assert model.requests[1].last_message.content.startswith("Look up ticket OPS-7")
    assert model.requests[1].tool_names == ["lookup_ticket"]
    assert model.requests[0].tool_names == []
    # the custom tool ran and its result went back to the model
    assert result.tool_calls[0].result.is_error is False
    assert '"status": "closed"' in result.tool_calls[0].result.content
    added = [e for e in result.events if e.type is EventType.MESSAGE_ADDED]
    assert any("Look up ticket OPS-7" in e.data["message"]["content"] for e in added)
    model.assert_complete()


def test_without_a_ticket_the_run_answers_directly(harness: WorkflowHarness) -> None:
    model = ScriptedChatModel(["NONE", "Restart the router, then try again."])
    result = harness.run("My wifi is slow, any tips?", model=model)
    assert (result.termination_reason, result.response) == (
        "final_answer",
        "Restart the router, then try again.",
    )
    assert [(f.source, f.target) for f in harness.fired] == [
        ("triage", "answer"),
        ("answer", "terminate"),
    ]
    assert result.tool_calls == []
    model.assert_complete()


def test_an_unknown_ticket_goes_back_to_the_model_as_a_tool_error(
    harness: WorkflowHarness,
) -> None:
    model = ScriptedChatModel(
        [
            "OPS-99",
            call("lookup_ticket", {"ticket_id": "OPS-99"}),
            "I could not find ticket OPS-99.",
        ]
    )
    result = harness.run("What about OPS-99?", model=model)
    assert result.termination_reason == "final_answer"
    assert result.tool_calls[0].result.is_error
    assert "no ticket 'OPS-99'" in result.tool_calls[0].result.content
    model.assert_complete()


@pytest.mark.parametrize(
    ("reply", "expected"),
    [("OPS-7", "note_ticket"), ("It is HELPDESK-1024.", "note_ticket"), ("NONE", "answer"),
     ("ops-7", "answer"), (call("lookup_ticket", {"ticket_id": "OPS-7"}), "answer")],
)  # fmt: skip
def test_the_guard_decides_the_triage_step(
    harness: WorkflowHarness, reply: object, expected: str
) -> None:
    assert harness.step("triage", last_reply=reply).target == expected


def test_a_raising_custom_action_ends_the_run_as_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # The guard never lets a reply without an id reach note_ticket; a workflow that routes there
    # unconditionally shows what happens when a user's action raises.
    monkeypatch.syspath_prepend(str(EXAMPLE))
    broken = WorkflowHarness(load_workflow_text(UNGUARDED, path="unguarded.yaml"))
    model = ScriptedChatModel(["NONE"])
    result = broken.run("My wifi is slow", model=model)
    assert result.termination_reason == "error"
    assert "ValueError: note_ticket runs after a reply naming a ticket id" in (result.error or "")
    assert "(in state 'note_ticket')" in (result.error or "")
    model.assert_complete()


def test_the_example_needs_its_package_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLE))
    spec = load_workflow(EXAMPLE / "workflow.yaml")
    offered = build_tools(spec, RunOptions()).offered
    assert offered == ["lookup_ticket"]
    monkeypatch.delitem(sys.modules, "ticket_agent", raising=False)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(EXAMPLE)])
    with pytest.raises(WorkflowValidationError, match="cannot import module 'ticket_agent'"):
        load_workflow(EXAMPLE / "workflow.yaml")
