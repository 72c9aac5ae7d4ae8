"""Compound states (issue 27, part 1) at the transition level: the issue's research/report
example, outer-first priority, `completed`, history, what validate rejects (file:line:col), the
flat engine, the schema, and the diagrams."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsm_kernel.diagram import RunOverlay, to_dot, to_mermaid
from fsm_kernel.errors import WorkflowError
from fsm_kernel.testing import ScriptedChatModel, WorkflowHarness, call
from fsm_kernel.workflow.compiler import compile_workflow
from fsm_kernel.workflow.loader import check_workflow_text, load_workflow, load_workflow_text
from tests.clikit import cli

DATA = Path(__file__).resolve().parents[1] / "data"
RESEARCH = DATA / "compound_research.yaml"
HISTORY = DATA / "compound_history.yaml"
FAILED = {"tool_results": [("read_file", "error: no such file", True)]}


@pytest.fixture(scope="module")
def research() -> WorkflowHarness:
    return WorkflowHarness(RESEARCH)


def test_the_issue_example_loads_with_every_state_by_id_and_its_place(
    research: WorkflowHarness,
) -> None:
    spec = research.spec
    assert list(spec.states) == ["research", "think", "act", "found", "report", "terminate"]
    assert [spec.state_path(s) for s in spec.states] == [
        "research", "research.think", "research.act", "research.found", "report", "terminate",
    ]  # fmt: skip
    assert spec.final_states() == ["terminate"]  # found only completes research
    assert spec.entry("research") == "think"
    assert spec.states["research"].history == "deep"


def test_a_parent_edge_fires_from_a_nested_state(research: WorkflowHarness) -> None:
    fired = research.step("act", **FAILED)
    assert (fired.index, fired.source, fired.target) == (0, "research", "terminate")
    assert (fired.reason, fired.final) == ("escalated", True)
    assert (fired.path_from, fired.path_to) == ("research.act", "terminate")


def test_the_parent_edge_is_tried_before_the_childs_own(research: WorkflowHarness) -> None:
    """think's own has_tool_calls edge would pass too: research's escalation wins (outer
    first); without a failed tool, think's edge fires."""
    reply = call("read_file", {"path": "a.txt"})
    assert research.step("think", last_reply=reply, **FAILED).target == "terminate"
    fired = research.step("think", last_reply=reply)
    assert (fired.source, fired.target, fired.path_to) == ("think", "act", "research.act")


def test_completed_holds_only_in_a_final_child(research: WorkflowHarness) -> None:
    into_found = research.step("think", last_reply="I found it.")
    assert (into_found.target, into_found.final, into_found.reason) == ("found", False, None)
    fired = research.step("found")
    assert (fired.source, fired.target, fired.guard) == ("research", "report", "completed")
    assert fired.path_from == "research.found"


def test_stepping_a_compound_state_starts_in_its_initial_child(
    research: WorkflowHarness,
) -> None:
    fired = research.step("research", last_reply=call("datetime", {}))
    assert (fired.source, fired.path_from, fired.path_to) == (
        "think",
        "research.think",
        "research.act",
    )
    with pytest.raises(ValueError, match="is final"):
        research.step("terminate")


def test_a_run_records_full_paths_and_takes_the_completed_edge(
    research: WorkflowHarness,
) -> None:
    result = research.run(
        "research then report",
        model=ScriptedChatModel([call("datetime", {}), "Found it.", "The report."]),
    )
    assert (result.termination_reason, result.response) == ("final_answer", "The report.")
    entered = [(e.state, e.data) for e in result.events if e.type.value == "state.entered"]
    assert entered == [
        ("think", {"path": "research.think"}),
        ("act", {"path": "research.act"}),
        ("think", {"path": "research.think"}),
        ("found", {"path": "research.found"}),
        ("report", {"path": "report"}),
    ]
    taken = [e.data for e in result.events if e.type.value == "transition.taken"]
    assert [(t["source"], t["target"], t["from"], t["to"]) for t in taken][-2:] == [
        ("research", "report", "research.found", "report"),
        ("report", "terminate", "report", "terminate"),
    ]


def test_history_returns_to_the_state_the_run_left() -> None:
    harness = WorkflowHarness(HISTORY)
    result = harness.run(
        "go",
        model=ScriptedChatModel(
            [call("read_file", {"path": "missing.txt"}), "Keep going.", "It is noon."]
        ),
    )
    assert result.termination_reason == "final_answer"
    paths = [e.data["path"] for e in result.events if e.type.value == "state.entered"]
    # left from work.act for check; back to work.act (its history), not work.plan
    assert paths == ["work.plan", "work.act", "check", "work.act", "work.plan", "work.finished"]
    assert harness.step("check", last_reply="ok").path_to == "work.plan"  # no history yet
    assert harness.step("check", history={"work": "act"}).path_to == "work.act"


NESTED = """\
name: nested
initial: outer
states:
  outer:
    initial: a
    history: shallow
    states:
      a: {action: agent.think}
      inner:
        initial: b
        history: deep
        states:
          b: {action: agent.think}
          c: {action: agent.think}
  away: {action: agent.think}
  end: {final: true}
transitions:
  - {source: outer, target: away, guard: tool_failed}
  - {source: a, target: inner, guard: has_tool_calls}
  - {source: a, target: end, reason: final_answer}
  - {source: b, target: c}
  - {source: c, target: end, reason: final_answer}
  - {source: away, target: inner, guard: has_tool_calls, enter: history}
  - {source: away, target: outer, enter: history}
"""


def test_shallow_history_enters_the_child_deep_history_the_state() -> None:
    harness = WorkflowHarness(load_workflow_text(NESTED, path="nested.yaml"))
    last = {"outer": "c", "inner": "c"}
    assert harness.step("away", history=last).path_to == "outer.inner.b"  # shallow: inner
    deep = harness.step("away", history=last, last_reply=call("datetime", {}))
    assert deep.path_to == "outer.inner.c"  # deep: c itself
    assert harness.step("away").path_to == "outer.a"  # never inside: the initial child


def _errors(text: str) -> list[str]:
    check = check_workflow_text(text, path="w.yaml")
    return [str(e) for e in check.errors]


def test_validate_rejects_a_duplicate_id_at_depth() -> None:
    text = NESTED.replace("c: {action: agent.think}", "a: {action: agent.think}")
    assert (
        "w.yaml:14:11: state id 'a' is declared twice: state ids are unique across the whole "
        "workflow, at any depth (the first is 'outer.a')"
    ) in _errors(text)


def test_validate_reports_a_child_edge_a_parent_edge_makes_unreachable() -> None:
    text = NESTED.replace(
        "  - {source: outer, target: away, guard: tool_failed}",
        "  - {source: outer, target: away}",
    )
    errors = _errors(text)
    assert (
        "w.yaml:20:5: transition never fires: the transition out of 'outer' (line 18) always "
        "fires first in every state it applies in (the edges of a compound state are tried "
        "before its children's)"
    ) in errors
    assert [e.split(": ")[0] for e in errors] == [
        "w.yaml:19:5",
        "w.yaml:20:5",
        "w.yaml:21:5",
        "w.yaml:22:5",
    ]


def test_validate_rejects_misused_compound_keys() -> None:
    text = """\
name: bad
initial: work
states:
  work:
    initial: nope
    action: agent.think
    states:
      plan: {action: agent.think}
      done: {final: true}
  lone: {action: agent.think, history: deep}
  end: {final: true}
transitions:
  - {source: plan, target: done, reason: final_answer}
  - {source: work, target: lone, guard: completed}
  - {source: lone, target: work, enter: history, guard: has_tool_calls}
  - {source: lone, target: end, reason: final_answer, guard: completed}
  - {source: lone, target: end, reason: done}
"""
    errors = _errors(text)
    for expected in [
        "w.yaml:5:14: initial state 'nope' of 'work' is not one of its children (plan, done)",
        "w.yaml:6:13: compound state 'work' cannot have 'action': its children act",
        "w.yaml:10:40: 'history' on state 'lone', which has no children",
        "w.yaml:13:42: 'reason' is only for edges into a top-level final state: 'done' is a "
        "final child of 'work' (it completes it; only top-level final states end a run)",
        "w.yaml:15:41: 'enter: history' needs 'work' to be a compound state that keeps its "
        "history ('history: shallow' or 'history: deep')",
        "w.yaml:16:62: 'completed' holds once the run reaches a final child of the edge's "
        "source; 'lone' has no final child",
    ]:
        assert expected in errors, errors


def test_a_final_child_without_a_completed_edge_is_reported() -> None:
    lines = RESEARCH.read_text().splitlines(keepends=True)
    text = "".join(line for line in lines if "guard: completed" not in line)
    assert (
        "w.yaml:16:7: state 'found' needs an unguarded fallback transition last (its own, or "
        "out of a state it is inside), so some transition always fires"
    ) in _errors(text)
    alone = text.replace("guard: tool_failed, reason: escalated", "reason: escalated")
    alone = alone.replace(
        "{source: research, target: terminate,", "{source: report, target: terminate,"
    )
    assert (
        "w.yaml:16:7: state 'found' has no transition out of it: add an edge out of 'research' "
        "guarded by 'completed'"
    ) in _errors(alone)


def test_the_engine_is_flat_and_tries_the_parents_edges_first() -> None:
    compiled = compile_workflow(load_workflow(RESEARCH))
    engine = {s.id for s in compiled.machine_class.states}
    assert engine == {"think", "act", "found", "report", "terminate"}  # no 'research'


def test_the_schema_covers_the_new_keys(capsys: pytest.CaptureFixture[str]) -> None:
    out = cli(capsys, "schema")  # what editors get from `fsm-kernel schema`
    assert out.code == 0
    schema = json.loads(out.out)
    state = schema["$defs"]["StateSpec"]["properties"]
    assert {"initial", "states", "history"} <= set(state)
    assert schema["$defs"]["TransitionSpec"]["properties"]["enter"]["enum"] == [
        "initial",
        "history",
    ]


def test_diagrams_draw_compound_states_as_clusters(research: WorkflowHarness) -> None:
    dot = to_dot(research.spec)
    assert "subgraph cluster_research {" in dot
    assert 'think -> terminate [label="1. [tool_failed] → escalated"' in dot
    assert "ltail=cluster_research" in dot
    assert "_start -> think [lhead=cluster_research]" in dot
    mermaid = to_mermaid(research.spec)
    assert "    state research {\n        think : agent.think\n" in mermaid
    assert "    research --> report : 5. [completed]\n" in mermaid
    assert "        found --> [*]\n" in mermaid


def test_a_run_overlay_says_the_full_path(research: WorkflowHarness) -> None:
    result = research.run(
        "go", model=ScriptedChatModel([call("datetime", {}), "Found it.", "The report."])
    )
    overlay = RunOverlay.from_events(result.events)
    assert (overlay.last_state, overlay.last_path) == ("terminate", "terminate")
    into_act = next(e.seq for e in result.events if e.data.get("path") == "research.act")
    in_flight = RunOverlay.from_events([e for e in result.events if e.seq <= into_act])
    assert (in_flight.last_state, in_flight.last_path) == ("act", "research.act")
    dot = to_dot(research.spec, overlay=in_flight)
    assert "not terminated (in flight or killed) after 1 transition, in research.act" in dot


def test_an_unknown_compound_error_never_crashes_loading() -> None:
    with pytest.raises(WorkflowError):
        load_workflow_text("name: x\ninitial: a\nstates:\n  a: {states: {}}\ntransitions: []\n")


def test_the_guide_example_is_valid_and_the_same_as_the_tests() -> None:
    page = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "compound-states.md"
    block = page.read_text(encoding="utf-8").split("```yaml\n")[1].split("```")[0]
    spec = load_workflow_text(block, path=str(page))
    tested = load_workflow(RESEARCH)
    assert [spec.state_path(s) for s in spec.states] == [
        tested.state_path(s) for s in tested.states
    ]
    assert spec.transitions == tested.transitions
