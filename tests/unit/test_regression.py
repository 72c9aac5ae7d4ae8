"""fsm_kernel.regression on hand-made events and reports: which check decided a step
differently (with the `tried` lists transition.taken records, and without them), which
divergence comes first (the run's step, a child's, the ending), the one-line text, the heat
overlay's sums, and paging through a store."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from fsm_kernel import regression
from fsm_kernel.diagram import HeatOverlay, to_dot
from fsm_kernel.protocol import Event, EventType, RunFilter
from fsm_kernel.regression import Divergence, decided_differently, first_divergence, stored_runs
from fsm_kernel.replay import ReplayReport, ReplayStep, transition_label
from fsm_kernel.store import SqliteEventStore
from fsm_kernel.workflow.loader import load_workflow_text

T0 = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)


def _taken(
    source: str, target: str, *, guard: str = "", tried: list[dict[str, Any]] | None = None
) -> Event:
    data: dict[str, Any] = {"source": source, "target": target, "guard": guard, "index": 0}
    if tried is not None:
        data["tried"] = tried
    return Event(
        run_id="r1",
        seq=5,
        type=EventType.TRANSITION_TAKEN,
        timestamp=T0,
        iteration=1,
        state=source,
        data=data,
    )


def _edge(edge: int, target: str, *checks: tuple[str, bool]) -> dict[str, Any]:
    listed = [{"check": name, "value": value} for name, value in checks]
    return {"edge": edge, "target": target, "checks": listed, "passed": all(v for _, v in checks)}


# -- the check that decided differently -------------------------------------------------------


def test_without_tried_it_names_both_transitions_with_their_guards() -> None:
    recorded = _taken("think", "act", guard="has_tool_calls")
    replayed = _taken("think", "answer")

    assert decided_differently(recorded, replayed) == (
        "recorded think → act [has_tool_calls], replayed think → answer "
        "(no checks recorded to compare)"
    )


def test_with_tried_on_one_side_only_it_falls_back_to_the_transitions() -> None:
    recorded = _taken("think", "act", guard="has_tool_calls")  # an older log: no tried
    replayed = _taken("think", "answer", tried=[_edge(1, "act", ("has_tool_calls", False))])

    assert decided_differently(recorded, replayed) == (
        "recorded think → act [has_tool_calls], replayed think → answer "
        "(no checks recorded to compare)"
    )


def test_a_check_with_another_value_is_named_with_its_edge() -> None:
    recorded = _taken(
        "evaluate",
        "reason",
        tried=[_edge(6, "terminate", ("done_called", False)), _edge(11, "reason")],
    )
    replayed = _taken("evaluate", "terminate", tried=[_edge(6, "terminate", ("done_called", True))])

    assert decided_differently(recorded, replayed) == (
        "done_called on edge 7 → terminate: false in the recorded run, true now"
    )


def test_a_check_the_edit_added_is_named() -> None:
    recorded = _taken("think", "act", tried=[_edge(1, "act", ("has_tool_calls", True))])
    replayed = _taken(
        "think",
        "answer",
        tried=[
            _edge(1, "act", ("has_tool_calls", True), ("done_called", False)),
            _edge(4, "answer"),
        ],
    )

    assert decided_differently(recorded, replayed) == (
        "done_called: false on edge 2 → act (the recorded run did not check it)"
    )


def test_a_changed_expression_is_named_with_both_labels() -> None:
    recorded = _taken("check", "retry", tried=[_edge(2, "retry", ("when: vars.n < 3", True))])
    replayed = _taken(
        "check",
        "give_up",
        tried=[_edge(2, "retry", ("when: vars.n < 2", False)), _edge(3, "give_up")],
    )

    assert decided_differently(recorded, replayed) == (
        "edge 3 → retry: the recorded run checked when: vars.n < 3: true, the replay "
        "when: vars.n < 2: false"
    )


def test_a_check_the_edit_removed_is_named() -> None:
    recorded = _taken(
        "think",
        "answer",
        tried=[_edge(1, "act", ("has_tool_calls", True), ("done_called", False)), _edge(4, "a")],
    )
    replayed = _taken("think", "act", tried=[_edge(1, "act", ("has_tool_calls", True))])

    assert decided_differently(recorded, replayed) == (
        "edge 2 → act: the recorded run also checked done_called: false, the replay did not"
    )


def test_edges_tried_in_another_order_are_named() -> None:
    recorded = _taken("think", "act", tried=[_edge(1, "act", ("has_tool_calls", True))])
    replayed = _taken("think", "answer", tried=[_edge(2, "answer", ("has_answer", True))])

    assert decided_differently(recorded, replayed) == (
        "the edge tried: the recorded run tried edge 2 → act where the replay tried edge 3 → answer"
    )


def test_an_edge_only_one_side_reached_is_named() -> None:
    recorded = _taken("think", "act", tried=[_edge(1, "act", ("has_tool_calls", True))])
    replayed = _taken(
        "think",
        "answer",
        tried=[_edge(1, "act", ("has_tool_calls", True)), _edge(4, "answer")],
    )

    assert decided_differently(recorded, replayed) == (
        "edge 5 → answer: the replay tried it too, the recorded run stopped before"
    )


def test_no_difference_in_the_checks_says_so() -> None:
    tried = [_edge(1, "act", ("has_tool_calls", True))]
    recorded = _taken("think", "act", tried=tried)
    replayed = _taken("think", "act2", tried=tried)

    assert decided_differently(recorded, replayed) == (
        "recorded think → act, replayed think → act2 (the same checks tried)"
    )


def test_a_step_one_side_did_not_take_has_nothing_to_compare() -> None:
    assert decided_differently(_taken("a", "b"), None) is None
    assert decided_differently(None, _taken("a", "b")) is None


# -- the first divergence --------------------------------------------------------------------


def _step(n: int, recorded: Event | None, replayed: Event | None) -> ReplayStep:
    label = transition_label
    return ReplayStep(
        n,
        n,
        label(recorded) if recorded else None,
        label(replayed) if replayed else None,
        recorded_event=recorded,
        replayed_event=replayed,
    )


def _report(run_id: str, steps: list[ReplayStep], **kw: Any) -> ReplayReport:
    kw.setdefault("recorded_reason", "final_answer")
    kw.setdefault("replayed_reason", "final_answer")
    return ReplayReport(run_id, steps, model_calls=0, **kw)


def test_an_identical_replay_has_no_divergence() -> None:
    same = _taken("a", "b")
    assert first_divergence(_report("r1", [_step(1, same, same)])) is None


def test_the_runs_own_step_comes_first_with_the_check_that_decided() -> None:
    same = _taken("a", "b")
    recorded = _taken("b", "c", tried=[_edge(1, "c", ("g", True))])
    replayed = _taken("b", "d", tried=[_edge(1, "c", ("g", False)), _edge(2, "d")])
    child = _report("child", [_step(1, same, _taken("a", "x"))])
    report = _report("r1", [_step(1, same, same), _step(2, recorded, replayed)], children=[child])

    found = first_divergence(report)

    assert found is not None
    assert (found.run_id, found.step, found.recorded, found.replayed) == ("r1", 2, "b → c", "b → d")
    assert found.by_check
    assert found.line() == (
        "at step 2 (iteration 2): recorded b → c, replay took b → d; decided by g on edge 2 → c: "
        "true in the recorded run, false now"
    )


def test_a_child_that_diverged_is_named_when_the_run_itself_took_the_same_steps() -> None:
    same = _taken("a", "b")
    ok = _report("child1", [_step(1, same, same)])
    bad = _report("child2", [_step(1, same, same), _step(2, _taken("b", "c"), None)])
    report = _report("r1", [_step(1, same, same)], children=[ok, bad])

    found = first_divergence(report)

    assert found is not None
    assert (found.run_id, found.step, found.replayed, found.by_check) == ("child2", 2, None, False)
    assert found.line() == "at step 2 (iteration 2): recorded b → c, replay took (nothing)"


def test_the_same_steps_and_another_ending_is_the_divergence() -> None:
    same = _taken("a", "b")
    report = _report(
        "r1", [_step(1, same, same)], replayed_reason="error", error="the model was asked again"
    )

    found = first_divergence(report)

    assert found == Divergence(
        run_id="r1",
        step=None,
        recorded_reason="final_answer",
        replayed_reason="error",
        error="the model was asked again",
    )
    assert found.line() == "ended final_answer, replay ended error (the model was asked again)"


def test_another_structured_output_is_the_divergence() -> None:
    same = _taken("a", "b")
    report = _report("r1", [_step(1, same, same)], recorded_output={"n": 1}, replayed_output={})

    found = first_divergence(report)

    assert found is not None
    assert found.line() == "ended final_answer with another structured output"


# -- the heat overlay --------------------------------------------------------------------------

HEAT_YAML = """
name: heat
initial: think
states:
  think: {action: agent.think}
  act: {action: tools.execute}
  terminate: {final: true}
transitions:
  - {source: think, target: act, guard: has_tool_calls}
  - {source: think, target: terminate, reason: final_answer}
  - {source: act, target: think}
"""


def _run(run_id: str, path: list[tuple[int, str, str]], reason: str | None) -> list[Event]:
    events: list[Event] = []

    def add(kind: EventType, state: str | None, data: dict[str, Any]) -> None:
        seq = len(events) + 1
        events.append(
            Event(run_id=run_id, seq=seq, type=kind, timestamp=T0, state=state, data=data)
        )

    add(EventType.RUN_STARTED, None, {"workflow": "heat"})
    usage = {"prompt_tokens": 10, "completion_tokens": 5}
    for index, source, target in path:
        if source == "think":
            completion = {"message": {"role": "assistant"}, "usage": usage}
            add(EventType.MODEL_RESPONDED, source, {"completion": completion})
        add(
            EventType.TRANSITION_TAKEN, source, {"index": index, "source": source, "target": target}
        )
    if reason is not None:
        add(EventType.RUN_TERMINATED, None, {"reason": reason})
    return events


def test_heat_adds_up_edges_reasons_and_tokens_per_state() -> None:
    spec = load_workflow_text(HEAT_YAML)
    heat = HeatOverlay(workflow="heat")

    looped = [(0, "think", "act"), (2, "act", "think"), (1, "think", "terminate")]
    heat.add_run(spec, _run("a", looped, "final_answer"))
    heat.add_run(spec, _run("b", [(1, "think", "terminate")], "final_answer"))
    heat.add_run(spec, _run("c", [(0, "think", "act"), (7, "act", "nowhere")], None))

    assert heat.runs == 3
    assert heat.traversals == {0: 2, 1: 2, 2: 1}
    assert heat.unmatched == 1  # edge 7 is no edge of this spec
    assert heat.reasons == {"final_answer": 2, "(not ended)": 1}
    assert heat.tokens == {"think": 15 * 4}
    assert heat.never_taken(spec) == []
    assert heat.heat(0) == 1.0
    assert heat.heat(2) == 0.5


def test_heat_lists_the_edges_never_taken() -> None:
    spec = load_workflow_text(HEAT_YAML)
    heat = HeatOverlay(workflow="heat")

    heat.add_run(spec, _run("b", [(1, "think", "terminate")], "final_answer"))

    assert heat.never_taken(spec) == [0, 2]


def test_heat_is_drawn_warm_on_the_edges_taken_and_grey_dashed_elsewhere() -> None:
    spec = load_workflow_text(HEAT_YAML)
    heat = HeatOverlay(workflow="heat")
    heat.add_run(spec, _run("b", [(1, "think", "terminate")], "final_answer"))
    heat.add_run(spec, _run("c", [(1, "think", "terminate")], "final_answer"))

    dot = to_dot(spec, overlay=heat)

    assert "2 runs: final_answer 2" in dot
    taken = next(line for line in dot.splitlines() if "think -> terminate" in line)
    never = next(line for line in dot.splitlines() if "think -> act" in line)
    assert 'color="#dc2626"' in taken
    assert "×2" in taken
    assert "penwidth=5.2" in taken
    assert "style=dashed" in never
    assert "#b8c2cc" in never
    assert "30 tokens" in dot  # think's two model answers


# -- paging through a store ------------------------------------------------------------------


def _started(run_id: str, at: datetime) -> Event:
    data = {"workflow": "w", "goal": run_id}
    return Event(run_id=run_id, seq=1, type=EventType.RUN_STARTED, timestamp=at, data=data)


def test_stored_runs_pages_through_the_store_newest_first_down_to_since(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(regression, "PAGE", 2)  # five runs: three pages
    with SqliteEventStore(tmp_path / "runs.db") as store:
        for n in range(5):
            store.append([_started(f"run-{n}", T0 + timedelta(hours=n))])

        every = [r.run_id for r in stored_runs(store, RunFilter(workflow="w"))]
        recent = [r.run_id for r in stored_runs(store, since=T0 + timedelta(hours=2))]

    assert every == ["run-4", "run-3", "run-2", "run-1", "run-0"]
    assert recent == ["run-4", "run-3", "run-2"]


def test_an_edge_is_shown_with_the_number_its_diagram_label_has() -> None:
    from fsm_kernel.diagram import edge_label
    from fsm_kernel.workflow.loader import load_workflow
    from fsm_kernel.workflow.spec import edge_number

    spec = load_workflow(Path(__file__).parents[2] / "workflows" / "default.yaml")
    for index in range(len(spec.transitions)):
        label = edge_label(spec, index)
        if label[:1].isdigit():  # a state's only edge has no number on the diagram
            assert label.startswith(f"{edge_number(index)}. "), (index, label)
    assert edge_number(0) == 1
    assert edge_number(11) == 12
    assert edge_number(None) is None  # a hand-edited log: shown as it is
    assert edge_number("x") == "x"
    assert edge_number(True) is True  # not an index
