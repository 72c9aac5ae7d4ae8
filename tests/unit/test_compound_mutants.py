"""Compound states (workflow/compound.py): the behaviours its mutation testing found unpinned.
What validate reports in a workflow with compound states (the message and its file:line:col),
which edges an agent.decide state inside one leaves reachable, and where deep history lands
two levels down. Each workflow is loaded inside its test, so the checks run every time."""

from __future__ import annotations

from fsm_kernel.testing import ScriptedChatModel, WorkflowHarness, call
from fsm_kernel.workflow.loader import check_workflow_text, load_workflow_text


def _errors(text: str) -> list[str]:
    return [str(e) for e in check_workflow_text(text, path="w.yaml").errors]


# A compound state whose final child completes it; the edges below are added per test.
BOX = """\
name: box
initial: a
states:
  a: {action: agent.think}
  b: {action: agent.think}
  box:
    initial: work
    states:
      work: {action: agent.think}
      finished: {final: true}
  done: {final: true}
transitions:
  - {source: a, target: box}
  - {source: work, target: finished}
"""


def test_an_edge_whose_completed_guard_and_unless_contradict_is_reported_where_it_is() -> None:
    """`guard: completed` is false in every child but the final one, where `unless: completed`
    is true: the edge can fire nowhere, and validate says so at its place."""
    text = BOX + (
        "  - {source: box, target: done, guard: completed, unless: completed, reason: done}\n"
        "  - {source: box, target: b, guard: completed}\n"
        "  - {source: b, target: done, reason: final_answer}\n"
    )
    assert _errors(text) == [
        "w.yaml:15:5: transition never fires: 'completed' holds only in a final child of "
        "'box', where this edge is not tried"
    ]


def test_a_second_completed_edge_after_one_that_always_fires_is_reported() -> None:
    """In the final child the first `completed` edge always fires; in the others `completed`
    is false: the second edge never fires in any state it applies in."""
    text = BOX + (
        "  - {source: box, target: b, guard: completed}\n"
        "  - {source: box, target: done, guard: [completed, has_answer], reason: done}\n"
        "  - {source: b, target: done, reason: final_answer}\n"
    )
    errors = _errors(text)
    assert [e.split(": ")[:2] for e in errors] == [["w.yaml:16:5", "transition never fires"]]


def test_a_completed_edge_that_fires_in_the_final_child_is_not_reported() -> None:
    text = BOX + (
        "  - {source: box, target: b, guard: completed}\n"
        "  - {source: b, target: done, reason: final_answer}\n"
    )
    assert _errors(text) == []


def test_a_guarded_edge_after_an_unguarded_one_of_the_same_state_is_reported() -> None:
    text = BOX + (
        "  - {source: box, target: b, guard: completed}\n"
        "  - {source: b, target: done, reason: final_answer}\n"
        "  - {source: b, target: done, guard: has_answer, reason: done}\n"
    )
    assert _errors(text) == [
        "w.yaml:17:5: transition never fires: the unguarded transition from 'b' above it "
        "always fires first"
    ]


def test_an_edge_a_parent_edge_shadows_names_the_parents_line() -> None:
    """The shadowing edge is not the file's first transition: its own line is named."""
    text = BOX + (
        "  - {source: box, target: b}\n"
        "  - {source: work, target: b, guard: has_answer}\n"
        "  - {source: b, target: done, reason: final_answer}\n"
    )
    assert (
        "w.yaml:16:5: transition never fires: the transition out of 'box' (line 15) always "
        "fires first in every state it applies in (the edges of a compound state are tried "
        "before its children's)"
    ) in _errors(text)


def test_a_leaf_without_any_transition_is_named_without_a_hint() -> None:
    text = BOX + (
        "  - {source: box, target: done, guard: completed, reason: final_answer}\n"
    )  # b is left without any edge out of it
    errors = _errors(text)
    assert "w.yaml:5:3: state 'b' has no transition out of it" in errors


def test_a_final_child_without_an_edge_is_told_to_add_a_completed_one() -> None:
    text = BOX + "  - {source: b, target: done, reason: final_answer}\n"
    assert (
        "w.yaml:10:7: state 'finished' has no transition out of it: add an edge out of 'box' "
        "guarded by 'completed'"
    ) in _errors(text)


def test_a_leaf_whose_own_edges_are_all_guarded_is_reported_at_its_last_edge() -> None:
    text = BOX + (
        "  - {source: box, target: b, guard: completed}\n"
        "  - {source: b, target: done, guard: has_answer, reason: final_answer}\n"
        "  - {source: b, target: a, guard: has_tool_calls}\n"
        "  - {source: b, target: box, guard: tool_failed}\n"
    )
    assert _errors(text) == [
        "w.yaml:18:5: state 'b' needs an unguarded fallback transition last, so some "
        "transition always fires"
    ]


def test_a_leaf_whose_last_edge_is_a_guarded_parent_edge_is_reported_at_the_leaf() -> None:
    text = BOX + (
        "  - {source: box, target: b, guard: tool_failed}\n"
        "  - {source: b, target: done, reason: final_answer}\n"
    )  # finished (a final child) tries box's edge only: it is guarded
    assert _errors(text) == [
        "w.yaml:10:7: state 'finished' needs an unguarded fallback transition last (its own, "
        "or out of a state it is inside), so some transition always fires"
    ]


DECIDE_IN_BOX = """\
name: decide_in_box
initial: box
states:
  box:
    initial: route
    states:
      route: {action: agent.decide, prompt: "What next?"}
      write: {action: agent.think}
      finished: {final: true}
  done: {final: true}
transitions:
  - {source: route, target: done, reason: no_progress}
  - {source: route, target: write, choice: write it, guard: has_answer}
  - {source: route, target: done, choice: stop now, when: "iteration < 3", reason: done}
  - {source: write, target: finished}
  - {source: box, target: done, guard: completed, reason: final_answer}
"""


def test_an_agent_decide_fallback_declared_first_leaves_its_choices_reachable() -> None:
    """An agent.decide state's unguarded edge fires only when no choice is offered, so the
    choice edges declared after it are live: validate accepts them and the model picks one."""
    assert _errors(DECIDE_IN_BOX) == []
    harness = WorkflowHarness(load_workflow_text(DECIDE_IN_BOX, path="d.yaml"))
    model = ScriptedChatModel([call("choose", {"choice": "stop now"})])
    result = harness.run("go", model=model)
    assert (result.termination_reason, result.iterations) == ("done", 1)
    assert harness.choices("route", iteration=3) == []
    fired = harness.step("route", iteration=3)  # nothing offered: the fallback, unasked
    assert (fired.index, fired.reason) == (0, "no_progress")


DEEP_TWO_LEVELS = """\
name: deep_two_levels
initial: away
states:
  away: {action: agent.think}
  outer:
    initial: a
    history: deep
    states:
      a: {action: agent.think}
      inner:
        initial: b
        states:
          b: {action: agent.think}
          c: {action: agent.think}
  end: {final: true}
transitions:
  - {source: away, target: outer, enter: history}
  - {source: outer, target: away, guard: tool_failed}
  - {source: a, target: inner}
  - {source: b, target: c}
  - {source: c, target: end, reason: final_answer}
"""


def test_deep_history_returns_to_the_state_two_levels_down_not_its_childs_entry() -> None:
    harness = WorkflowHarness(load_workflow_text(DEEP_TWO_LEVELS, path="h.yaml"))
    assert harness.step("away", history={"outer": "c"}).path_to == "outer.inner.c"
    assert harness.step("away").path_to == "outer.a"  # never inside: its initial child


SHALLOW_TWO_LEVELS = DEEP_TWO_LEVELS.replace("history: deep", "history: shallow")


def test_shallow_history_two_levels_down_enters_the_childs_entry() -> None:
    harness = WorkflowHarness(load_workflow_text(SHALLOW_TWO_LEVELS, path="h.yaml"))
    assert harness.step("away", history={"outer": "c"}).path_to == "outer.inner.b"


MISSHAPEN = """\
name: misshapen
initial: work
states:
  work:
    initial: plan
    states:
      plan: {action: agent.think}
      finished: {final: true}
  half: {initial: a}
  other: {action: agent.think, states: {x: {action: agent.think}}}
  empty: {initial: a, states: {}}
  ends_first:
    initial: f
    final: true
    states:
      f: {final: true}
      g: {action: agent.think}
  done: {final: true}
transitions:
  - {source: plan, target: finished}
  - {source: work, target: half, guard: completed}
  - {source: half, target: other}
  - {source: other, target: empty}
  - {source: empty, target: ends_first}
  - {source: ends_first, target: done, guard: completed, reason: final_answer}
  - {source: g, target: done, reason: final_answer}
"""


def test_validate_names_each_misshapen_compound_state_at_its_key() -> None:
    errors = _errors(MISSHAPEN)
    for expected in [
        "w.yaml:9:19: state 'half' has 'initial' but no 'states': a compound state needs both",
        "w.yaml:10:40: state 'other' has 'states' but no 'initial': a compound state needs both",
        "w.yaml:11:10: compound state 'empty' has no children",
        "w.yaml:13:14: initial state 'f' cannot be final",
        "w.yaml:14:12: compound state 'ends_first' cannot have 'final': its children act",
    ]:
        assert expected in errors, errors
    assert not any(e.startswith("w.yaml:2:") for e in errors)  # `work` is top-level


def test_validate_refuses_an_initial_state_inside_a_compound_one() -> None:
    errors = _errors(MISSHAPEN.replace("initial: work\n", "initial: plan\n", 1))
    assert errors[0] == (
        "w.yaml:2:10: initial state 'plan' is inside 'work': name a top-level state (a compound "
        "one enters its own initial child)"
    )
