"""Public test kit: fake chat models and a transition-level harness for workflows, so users test
their own workflows (and their own actions and guards) without a model server.

It sits on top of the kernel (it drives real runs), so nothing inside fsm_kernel imports it
but the pytest plugin. Import every name from here; the private modules behind it are
_replies (reply shorthands), _models (fake chat models), _harness (WorkflowHarness) and
_coverage (transition coverage).

A transition test, then a whole run with a scripted model::

    from fsm_kernel.testing import ScriptedChatModel, WorkflowHarness, call

    harness = WorkflowHarness("react")                     # a path, a stock name or a spec
    fired = harness.step("think", last_reply=call("read_file", {"path": "a.txt"}))
    assert fired.target == "act"

    model = ScriptedChatModel(["I should read a.txt.", call("read_file", {"path": "a.txt"}),
                               "It says 42; I can answer.", "42", "a.txt says 42."])
    result = harness.run("What is in a.txt?", model=model, workspace=tmp_path)
    assert result.termination_reason == "final_answer"
    model.assert_complete()
"""

from fsm_kernel.testing._coverage import (
    CoverageCase,
    TransitionCoverage,
    assert_all_transitions_covered,
    uncovered_transitions,
)
from fsm_kernel.testing._generate import GeneratedSuite, generate_cases, witnesses
from fsm_kernel.testing._harness import DeclaredTransition, WorkflowHarness
from fsm_kernel.testing._models import (
    FunctionChatModel,
    ModelRequest,
    ScriptedChatModel,
    ScriptedHuman,
    ScriptExhaustedError,
    ScriptItem,
)
from fsm_kernel.testing._replies import (
    ReplyLike,
    as_completion,
    bad_call,
    call,
    calls,
    text_reply,
    tool_call,
)
from fsm_kernel.workflow.children import ChildResult

__all__ = [
    "ChildResult",
    "CoverageCase",
    "DeclaredTransition",
    "FunctionChatModel",
    "GeneratedSuite",
    "ModelRequest",
    "ReplyLike",
    "ScriptExhaustedError",
    "ScriptItem",
    "ScriptedChatModel",
    "ScriptedHuman",
    "TransitionCoverage",
    "WorkflowHarness",
    "as_completion",
    "assert_all_transitions_covered",
    "bad_call",
    "call",
    "calls",
    "generate_cases",
    "text_reply",
    "tool_call",
    "uncovered_transitions",
    "witnesses",
]
