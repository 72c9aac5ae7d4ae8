"""Catch edges outside the kernel: the transition harness steps them (`raised=`) and counts them
for coverage, whole harness runs route failures without waiting out backoffs, and the diagrams
draw catch edges in their own style, with the legend saying so and a run's catch on top."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fsm_kernel.diagram import RunOverlay, edge_label, overlay_problems, render, to_dot, to_mermaid
from fsm_kernel.errors import AgentServerError, AgentTimeoutError
from fsm_kernel.protocol import EventType
from fsm_kernel.testing import (
    DeclaredTransition,
    ScriptedChatModel,
    WorkflowHarness,
    assert_all_transitions_covered,
    uncovered_transitions,
)
from fsm_kernel.workflow.context import CaughtError
from fsm_kernel.workflow.loader import load_workflow, load_workflow_text

FALLBACK = """
name: fallback
description: a big model, and a small one when the big one's server fails
tools: [datetime]
initial: think
reasons:
  gave_up: {description: every model failed}
states:
  think:
    action: agent.think
    retry: {error: agent_error, max_attempts: 2, backoff_seconds: 30}
    catch:
      - {error: agent_error, target: backup}
      - {error: any, target: failed, reason: gave_up}
  backup:
    action: agent.think
    agent: {model: small}
  act: {action: tools.execute}
  done: {final: true}
  failed: {final: true}
transitions:
  - {source: think, target: act, guard: has_tool_calls}
  - {source: think, target: done, reason: final_answer}
  - {source: backup, target: act, guard: has_tool_calls}
  - {source: backup, target: done, reason: final_answer}
  - {source: act, target: backup, guard: caught}
  - {source: act, target: think}
"""
DOWN = AgentServerError("server failed with 500", status_code=500)


@pytest.fixture
def harness() -> WorkflowHarness:
    return WorkflowHarness(load_workflow_text(FALLBACK, path="fallback.yaml"))


def test_harness_lists_catch_edges_after_the_transitions(harness: WorkflowHarness) -> None:
    assert harness.transitions[6:] == [
        DeclaredTransition(6, "think", "backup", "catch agent_error", None),
        DeclaredTransition(7, "think", "failed", "catch any", "gave_up"),
    ]


def test_a_step_with_a_raised_error_takes_the_first_matching_catch_edge(
    harness: WorkflowHarness,
) -> None:
    fired = harness.step("think", raised=DOWN, iteration=3)

    assert (fired.index, fired.target, fired.guard, fired.catch) == (
        6,
        "backup",
        "catch agent_error",
        "agent_error",
    )
    other = harness.step("think", raised=ValueError("bad"), last_reply="ignored")
    assert (other.target, other.reason, other.catch, other.final) == (
        "failed",
        "gave_up",
        "any",
        True,
    )


def test_the_caught_failure_is_on_the_context_for_the_target(harness: WorkflowHarness) -> None:
    ctx = harness.context(iteration=2)

    harness.step("think", context=ctx, raised=AgentTimeoutError("no answer in 120s"))

    assert ctx.caught == CaughtError(
        state="think",
        error="agent_error",
        type="AgentTimeoutError",
        message="no answer in 120s",
        attempts=1,
        iteration=2,
    )
    assert ctx.notes.failure is None  # consumed by the catch edge


def test_the_caught_guard_reads_ctx_caught(harness: WorkflowHarness) -> None:
    caught = CaughtError(state="think", error="agent_error", type="AgentError", message="x")

    assert harness.step("act", caught=caught).target == "backup"
    assert harness.step("act").target == "think"


def test_a_failure_no_entry_handles_is_raised_as_the_run_would_end() -> None:
    text = FALLBACK.replace("      - {error: any, target: failed, reason: gave_up}\n", "")
    text = text.replace("  failed: {final: true}\n", "").replace("reasons:\n", "")
    text = text.replace("  gave_up: {description: every model failed}\n", "")
    harness = WorkflowHarness(load_workflow_text(text))

    with pytest.raises(ValueError, match=r"^bad$"):
        harness.step("think", raised=ValueError("bad"))


def test_coverage_counts_catch_edges(harness: WorkflowHarness) -> None:
    cases = [
        harness.step("think", last_reply="42"),
        harness.step("think", raised=DOWN),
        ("backup", "done", "else"),  # a triple matches the guard label…
    ]
    with pytest.raises(ValueError, match="matches no declared transition"):
        uncovered_transitions(harness, cases)
    cases[2] = ("backup", "done", "")  # …as the harness labels it
    missing = uncovered_transitions(harness, cases)

    assert [(t.index, t.guard) for t in missing] == [
        (0, "has_tool_calls"),
        (2, "has_tool_calls"),
        (4, "caught"),
        (5, ""),
        (7, "catch any"),
    ]
    with pytest.raises(AssertionError, match=r"5 of 8 declared transition\(s\)"):
        assert_all_transitions_covered(harness, cases)


def test_a_harness_run_routes_to_the_fallback_on_its_own_model(harness: WorkflowHarness) -> None:
    big = ScriptedChatModel([DOWN, DOWN, DOWN])
    small = ScriptedChatModel(["small model's answer"])

    result = harness.run("hi", model=big, state_models={"backup": small})  # no 30 s waits

    assert (result.termination_reason, result.response) == ("final_answer", "small model's answer")
    assert [f.guard for f in harness.fired] == ["catch agent_error", ""]
    assert harness.fired[0].catch == "agent_error"
    big.assert_complete()
    small.assert_complete()
    failed = [e.data["retry_in"] for e in result.events if e.type == EventType.ACTION_FAILED]
    assert failed == [30.0, 60.0]


# -- diagrams ----------------------------------------------------------------------------------


def test_dot_draws_catch_edges_dashed_with_their_own_colour(harness: WorkflowHarness) -> None:
    dot = to_dot(harness.spec)

    assert (
        'think -> backup [label="catch agent_error" color="#b45309" fontcolor="#b45309" '
        "style=dashed]" in dot
    )
    assert (
        'think -> failed [label="catch any → gave_up" color="#b45309" fontcolor="#b45309" '
        "style=dashed]" in dot
    )
    assert (
        "dashed catch edge: taken first when the state's action fails with that error (after "
        "its retries)" in dot
    )
    assert "retry agent_error: 2×, backoff 30s" in dot
    assert "model: small" in dot
    assert edge_label(harness.spec, 7) == "catch any → gave_up"


def test_a_workflow_without_catch_has_no_catch_legend() -> None:
    spec = load_workflow(Path(__file__).resolve().parents[2] / "workflows" / "default.yaml")

    assert "catch" not in to_dot(spec)
    assert "catch" not in to_mermaid(spec)


def test_mermaid_lists_catch_edges(harness: WorkflowHarness) -> None:
    text = to_mermaid(harness.spec)

    assert "    think --> backup : catch agent_error\n" in text
    assert "    think --> failed : catch any → gave_up\n" in text
    assert "%% catch edges are taken first when the state's action fails" in text


def test_a_run_overlay_shows_the_catch_it_took(harness: WorkflowHarness) -> None:
    result = harness.run(
        "hi",
        model=ScriptedChatModel([DOWN, DOWN, DOWN]),
        state_models={"backup": ScriptedChatModel(["ok"])},
    )
    overlay = RunOverlay.from_events(result.events)

    assert overlay.path == (6, 3)
    assert overlay.traversals == {6: 1, 3: 1}
    assert overlay_problems(harness.spec, overlay) == []
    dot = to_dot(harness.spec, overlay=overlay)
    line = next(ln for ln in dot.splitlines() if "think -> backup" in ln)
    assert 'label="catch agent_error  ×1"' in line
    assert "style=dashed" in line
    assert 'color="#1d4ed8"' in line
    assert "penwidth=2.5" in line
    assert "think --> backup : catch agent_error ×1" in to_mermaid(harness.spec, overlay=overlay)


@pytest.mark.skipif(shutil.which("dot") is None, reason="needs the Graphviz dot program")
def test_the_catch_diagram_renders(harness: WorkflowHarness, tmp_path: Path) -> None:
    out = render(to_dot(harness.spec), "svg", tmp_path / "fallback.svg")

    assert "catch agent_error" in out.read_text()
