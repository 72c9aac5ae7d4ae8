"""Built-in action and guard behaviours that mutation testing found unpinned: what agent.decide
records for each request and each reply (the choices offered, the iteration's record with its
calls, error and next state) and what it tells the model after an illegal pick or a text reply;
and the `approved` guard, which holds only when every approval asked for was given."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsm_kernel.protocol import Completion, EventType
from fsm_kernel.testing import ScriptedChatModel, WorkflowHarness, call
from fsm_kernel.workflow.actions import BUILTIN_GUARDS
from fsm_kernel.workflow.human import HumanAnswer

ROUTE = Path(__file__).resolve().parents[1] / "data" / "decide_route.yaml"
LOOK, WRITE = "look something up", "write the answer now"


def pick(choice: str, id: str) -> Completion:
    return call("choose", {"choice": choice}, id=id)


def test_agent_decide_records_each_request_and_each_pick_and_says_why_a_pick_was_refused() -> None:
    harness = WorkflowHarness(ROUTE)
    model = ScriptedChatModel(
        [
            pick(WRITE, "c1"),  # not offered yet: write needs an answer first
            "I would look.",  # text, not a call of choose
            pick(LOOK, "c2"),
            "Paris is the capital.",
            pick(WRITE, "c3"),
            "Paris.",
        ]
    )

    result = harness.run("Capital?", model=model, limits={"max_malformed_outputs": 3})

    assert (result.termination_reason, result.response) == ("final_answer", "Paris.")
    requested = [e.data for e in result.events if e.type is EventType.MODEL_REQUESTED]
    assert requested == [
        {"messages": 3, "tools": ["choose"], "choices": [LOOK]},
        {"messages": 5, "tools": ["choose"], "choices": [LOOK]},
        {"messages": 7, "tools": ["choose"], "choices": [LOOK]},
        {"messages": 10, "tools": []},
        {"messages": 12, "tools": ["choose"], "choices": [LOOK, WRITE]},
        {"messages": 15, "tools": []},
    ]
    refused = f'"{WRITE}" is not one of the offered choices ("{LOOK}")'
    told = f'error: not accepted: {refused}. Call choose again with one of: "{LOOK}"'
    records = [e.data for e in result.events if e.type is EventType.ITERATION_COMPLETED]
    assert [r for r in records if r["decision"] != "answer"] == [
        {
            "step": 1, "decision": "malformed", "answer": "", "summary": "",
            "tools": [
                {"id": "c1", "name": "choose", "input": {"choice": WRITE}, "output": told,
                 "is_error": True},
            ],
            "error": refused, "next_state": "route", "choice": None,
        },
        {
            "step": 2, "decision": "malformed", "answer": "", "summary": "", "tools": [],
            "error": "the reply did not call choose (it answered in text)",
            "next_state": "route", "choice": None,
        },
        {
            "step": 3, "decision": "choice", "answer": "", "summary": "",
            "tools": [
                {"id": "c2", "name": "choose", "input": {"choice": LOOK},
                 "output": f"chosen: {LOOK}", "is_error": False},
            ],
            "error": None, "next_state": "research", "choice": LOOK,
        },
        {
            "step": 5, "decision": "choice", "answer": "", "summary": "",
            "tools": [
                {"id": "c3", "name": "choose", "input": {"choice": WRITE},
                 "output": f"chosen: {WRITE}", "is_error": False},
            ],
            "error": None, "next_state": "write", "choice": WRITE,
        },
    ]  # fmt: skip
    after_call, after_text = model.requests[1].messages[-1], model.requests[2].messages[-1]
    assert (after_call.role.value, after_call.content) == ("tool", told)
    assert (after_text.role.value, after_text.content) == (
        "user",
        "Your reply was not accepted: the reply did not call choose (it answered in text). "
        f'Call choose with one of: "{LOOK}"',
    )


@pytest.mark.parametrize(
    ("answers", "holds"),
    [
        ([], False),  # nobody was asked
        ([HumanAnswer.approve()], True),
        ([HumanAnswer.approve(), HumanAnswer.reject("no")], False),
        ([HumanAnswer.signal("ci_passed")], False),  # an event is no approval
        ([HumanAnswer.signal("ci_passed"), HumanAnswer.approve()], True),
    ],
)
def test_approved_holds_only_when_every_approval_asked_for_was_given(
    answers: list[HumanAnswer], holds: bool
) -> None:
    ctx = WorkflowHarness(ROUTE).context(answers=answers)
    assert BUILTIN_GUARDS["approved"](ctx) is holds
