"""fsm_kernel.diagram: DOT and Mermaid text from a spec, the run overlay, render(), and the golden
check that diagrams/ matches workflows/."""

from __future__ import annotations

import re
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from fsm_kernel.diagram import (
    KERNEL_REASONS,
    RunOverlay,
    edge_label,
    overlay_problems,
    render,
    render_svg,
    to_dot,
    to_mermaid,
)
from fsm_kernel.errors import ConfigError
from fsm_kernel.protocol import Event, EventType
from fsm_kernel.workflow.loader import load_workflow, load_workflow_text
from fsm_kernel.workflow.spec import WorkflowSpec

REPO = Path(__file__).resolve().parents[2]
WORKFLOWS = sorted((REPO / "workflows").glob("*.yaml"))
DEFAULT = REPO / "workflows" / "default.yaml"
T0 = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
HAS_DOT = shutil.which("dot") is not None

LOOP_YAML = """
name: loop
description: a small loop with prompts and tools
tools: [datetime, done]
initial: think
states:
  think:
    action: agent.think
    prompt: "Plan; then act: think hard about the whole task first."
    tools: [datetime]
  act: {action: tools.execute}
  evaluate: {action: kernel.evaluate}
  finish: {final: true}
transitions:
  - {source: think, target: act, guard: has_tool_calls}
  - {source: think, target: think, guard: malformed_output, unless: retries_exhausted}
  - {source: think, target: finish, guard: malformed_output, reason: malformed_output}
  - {source: think, target: finish, reason: final_answer}
  - {source: act, target: evaluate}
  - {source: evaluate, target: finish, guard: done_called, reason: done}
  - {source: evaluate, target: think}
"""


@pytest.fixture(scope="module")
def loop() -> WorkflowSpec:
    return load_workflow_text(LOOP_YAML, path="loop.yaml")


@pytest.fixture(scope="module")
def default() -> WorkflowSpec:
    return load_workflow(DEFAULT)


class EventLog:
    """Builds a run's events the way the kernel records them."""

    def __init__(self, spec: WorkflowSpec, run_id: str = "0190aaaa-bbbb-7ccc-8ddd-eeeeffff0000"):
        self.spec = spec
        self.run_id = run_id
        self.events: list[Event] = []
        self.state: str | None = None
        self.add(
            EventType.RUN_STARTED,
            workflow=spec.name,
            workflow_path=spec.path,
            workflow_hash=spec.content_hash,
            goal="g",
        )
        self.enter(spec.initial)

    def add(self, type_: EventType, **data: Any) -> None:
        self.events.append(
            Event(
                run_id=self.run_id,
                seq=len(self.events) + 1,
                type=type_,
                timestamp=T0,
                state=self.state,
                data=data,
            )
        )

    def enter(self, state: str) -> None:
        self.state = state
        self.add(EventType.STATE_ENTERED)

    def take(self, *indexes: int) -> EventLog:
        for index in indexes:
            t = self.spec.transitions[index]
            self.add(
                EventType.TRANSITION_TAKEN,
                index=index,
                source=t.source,
                target=t.target,
                guard=t.label(),
                reason=t.reason,
            )
            if self.spec.states[t.target].final:
                self.state = t.target  # the kernel records no state.entered for a final state
            else:
                self.enter(t.target)
        return self

    def end(self, reason: str, error: str | None = None) -> list[Event]:
        data: dict[str, Any] = {"reason": reason, "answer": None, "iterations": 2}
        if error:
            data["error"] = error
        self.add(EventType.RUN_TERMINATED, **data)
        return self.events


def node_line(dot: str, node: str) -> str:
    match = re.search(rf"^\t+{node} \[.*$", dot, re.MULTILINE)
    assert match, f"no node statement for {node}"
    return match.group(0)


def edge_lines(dot: str, source: str, target: str) -> list[str]:
    return re.findall(rf"^\t{source} -> {target}\b.*$", dot, re.MULTILINE)


# -- the static diagram -------------------------------------------------------------------------


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_dot_shows_every_state_action_guard_and_reason(path: Path) -> None:
    spec = load_workflow(path)
    dot = to_dot(spec)
    for sid, state in spec.states.items():
        assert f"<B>{sid}</B>" in node_line(dot, sid)
        if state.action:
            assert state.action in node_line(dot, sid)
    for t in spec.transitions:
        assert edge_lines(dot, t.source, t.target)
        for name in [*t.guard, *t.unless]:
            assert name in dot
        if t.reason:
            assert f"→ {t.reason}" in dot


def test_dot_marks_initial_and_final_states(default: WorkflowSpec) -> None:
    dot = to_dot(default)
    assert re.search(r"^\t_start \[.*shape=circle.*style=filled", dot, re.MULTILINE)
    assert edge_lines(dot, "_start", "observe")
    assert "peripheries=2" in node_line(dot, "terminate")
    assert "peripheries" not in node_line(dot, "think")


def test_edge_labels_number_guards_else_and_reasons(default: WorkflowSpec) -> None:
    labels = [edge_label(default, i) for i in range(len(default.transitions))]
    assert labels[0] == ""  # observe -> think: the only, unguarded edge of observe
    assert labels[1] == "2. [has_tool_calls]"  # numbers: places in transitions:
    assert labels[2] == "3. [malformed_output and not retries_exhausted]"
    assert labels[3] == "4. [malformed_output] → malformed_output"
    assert labels[4] == "5. [else] → final_answer"
    assert labels[5] == ""  # act -> evaluate: alone, so unnumbered
    assert labels[6] == "7. [done_called] → done"
    assert labels[11] == "12. [else]"


def test_dot_groups_parallel_edges_and_breaks_long_guards(default: WorkflowSpec) -> None:
    dot = to_dot(default)
    (evaluate_terminate,) = edge_lines(dot, "evaluate", "terminate")
    for reason in ("done", "fatal_tool_error", "tool_failures", "no_progress", "max_iterations"):
        assert f"→ {reason}" in evaluate_terminate
    (self_loop,) = edge_lines(dot, "think", "think")
    assert "[malformed_output\\nand not retries_exhausted]" in self_loop


def test_dot_shows_prompt_and_tools_hints_short(loop: WorkflowSpec) -> None:
    think = node_line(to_dot(loop), "think")
    assert "agent.think" in think
    assert 'prompt: "Plan; then act: think hard…"' in think  # cut at a word boundary
    assert "tools: datetime" in think


def test_long_tool_lists_say_how_many_more() -> None:
    spec = load_workflow_text(
        "name: t\ntools: [datetime, read_file, list_directory, done]\ninitial: go\nstates:\n"
        "  go: {action: agent.think, tools: [datetime, read_file, list_directory, done]}\n"
        "  quiet: {action: agent.think, tools: []}\n"
        "  end_here: {final: true}\ntransitions:\n"
        "  - {source: go, target: quiet, guard: has_tool_calls}\n"
        "  - {source: go, target: end_here, reason: final_answer}\n"
        "  - {source: quiet, target: end_here, reason: final_answer}\n"
    )
    dot = to_dot(spec)
    assert "tools: datetime, read_file +2" in node_line(dot, "go")
    assert "tools: none" in node_line(dot, "quiet")


def test_legend_explains_notation_and_kernel_reasons(default: WorkflowSpec) -> None:
    legend = node_line(to_dot(default), "_legend")
    assert "double border" in legend
    assert "[else]" in legend
    assert "the kernel may end any run with: " + ", ".join(KERNEL_REASONS) in legend
    assert "max_iterations: 10 model calls" in legend
    assert "cluster_legend" in to_dot(default)


def test_dot_is_deterministic() -> None:
    first = to_dot(load_workflow(DEFAULT))
    second = to_dot(load_workflow(DEFAULT))
    assert first.encode() == second.encode()
    assert "\t_start -> observe\n" in first


def test_dot_is_valid_graphviz_syntax(default: WorkflowSpec, tmp_path: Path) -> None:
    if not HAS_DOT:
        pytest.skip("the dot program is not installed")
    events = EventLog(default).take(0, 1, 5, 11, 0, 4).end("final_answer")
    out = render(to_dot(default, overlay=RunOverlay.from_events(events)), "svg", tmp_path / "x.svg")
    assert "<svg" in out.read_text(encoding="utf-8")


# -- Mermaid ------------------------------------------------------------------------------------


def test_mermaid_structure(default: WorkflowSpec) -> None:
    text = to_mermaid(default)
    lines = text.splitlines()
    assert lines[0] == "stateDiagram-v2"
    assert "    [*] --> observe" in lines
    assert "    terminate --> [*]" in lines
    assert "    observe --> think" in lines
    assert "    think --> act : 2. [has_tool_calls]" in lines
    assert "    evaluate --> terminate : 7. [done_called] → done" in lines
    assert "    think : agent.think" in lines
    assert sum(1 for line in lines if " --> " in line and "[*]" not in line) == len(
        default.transitions
    )
    assert text == to_mermaid(load_workflow(DEFAULT))


def test_mermaid_labels_hold_no_separator_characters(loop: WorkflowSpec) -> None:
    for line in to_mermaid(loop).splitlines():
        if line.strip().startswith("%%") or " : " not in line:
            continue
        label = line.split(" : ", 1)[1]
        assert ":" not in label, line
        assert ";" not in label, line


def test_mermaid_renames_keyword_state_ids() -> None:
    spec = load_workflow_text(
        "name: k\ninitial: go\nstates:\n  go: {action: session.observe}\n  end: {final: true}\n"
        "transitions:\n  - {source: go, target: end, reason: final_answer}\n"
    )
    text = to_mermaid(spec)
    assert "    go --> end_ : → final_answer" in text
    assert "    end_ --> [*]" in text


# -- the run overlay ----------------------------------------------------------------------------


def test_overlay_counts_path_and_terminating_edge(default: WorkflowSpec) -> None:
    events = EventLog(default).take(0, 1, 5, 11, 0, 2, 1, 5, 6).end("done")
    overlay = RunOverlay.from_events(reversed(events))  # order comes from seq
    assert overlay.visits == {"observe": 2, "think": 3, "act": 2, "evaluate": 2, "terminate": 1}
    assert overlay.traversals == {0: 2, 1: 2, 5: 2, 11: 1, 2: 1, 6: 1}
    assert overlay.path == (0, 1, 5, 11, 0, 2, 1, 5, 6)
    assert overlay.terminating == 6
    assert overlay.reason == "done"
    assert overlay.last_state == "terminate"
    assert not overlay.ended_by_kernel
    assert overlay.workflow == "default"
    assert overlay_problems(default, overlay) == []


def test_dot_overlay_counts_bold_taken_and_dims_the_rest(default: WorkflowSpec) -> None:
    events = EventLog(default).take(0, 1, 5, 11, 0, 2, 1, 5, 6).end("done")
    dot = to_dot(default, overlay=RunOverlay.from_events(events))
    assert "think  ×3" in node_line(dot, "think")
    (taken,) = edge_lines(dot, "think", "act")
    assert "×2" in taken
    assert "penwidth=2.5" in taken
    (ending,) = edge_lines(dot, "evaluate", "terminate")
    assert "7. [done_called] → done  ×1  ■ ended here" in ending
    assert "penwidth=3" in ending
    assert 'color="#15803d"' in ending
    assert 'COLOR="#b8c2cc">8. [fatal_tool_error]' in ending  # the untaken rows are grey
    (untaken,) = edge_lines(dot, "think", "terminate")
    assert 'color="#b8c2cc"' in untaken
    assert "run 0190aaaa-bbbb-7ccc-8ddd-eeeeffff0000: done after 9 transitions" in dot
    assert dot == to_dot(default, overlay=RunOverlay.from_events(events))


def test_unvisited_state_is_dimmed(loop: WorkflowSpec) -> None:
    events = EventLog(loop).take(3).end("final_answer")
    overlay = RunOverlay.from_events(events)
    assert overlay.visits == {"think": 1, "finish": 1}
    dot = to_dot(loop, overlay=overlay)
    assert 'color="#b8c2cc"' in node_line(dot, "act")
    assert 'COLOR="#b8c2cc"><B>act</B>' in node_line(dot, "act")
    assert "×1" in node_line(dot, "finish")


def test_kernel_ended_run_is_shown_where_it_stopped(default: WorkflowSpec) -> None:
    events = EventLog(default).take(0, 1, 5, 11, 0).end("max_iterations")
    overlay = RunOverlay.from_events(events)
    assert overlay.terminating is None
    assert overlay.ended_by_kernel
    assert overlay.reason == "max_iterations"
    assert overlay.last_state == "think"
    assert "terminate" not in overlay.visits
    dot = to_dot(default, overlay=overlay)
    think = node_line(dot, "think")
    assert "■ ended here: max_iterations" in think
    assert 'color="#c0392b"' in think
    assert "ended by the kernel in think: max_iterations after 5 transitions" in dot
    assert "■ ended here" not in "".join(edge_lines(dot, "evaluate", "terminate"))
    mermaid = to_mermaid(default, overlay=overlay)
    assert "    class think ended" in mermaid
    assert (
        "note right of think : run 0190aaaa-bbbb-7ccc-8ddd-eeeeffff0000 — ended by the kernel in "
        "think" in mermaid
    )


def test_a_cut_off_final_answer_shows_truncated_on_its_edge(default: WorkflowSpec) -> None:
    # The final_answer edge fired, but the kernel ended the run `truncated` (a cut-off reply).
    events = EventLog(default).take(0, 4).end("truncated", error="cut off by the length limit")
    overlay = RunOverlay.from_events(events)
    assert overlay.terminating == 4
    dot = to_dot(default, overlay=overlay)
    (ending,) = edge_lines(dot, "think", "terminate")
    assert "[else] → final_answer  ×1  ■ ended here: truncated" in ending
    assert 'color="#c0392b"' in ending
    assert "run 0190aaaa-bbbb-7ccc-8ddd-eeeeffff0000: truncated after 2 transitions" in dot
    mermaid = to_mermaid(default, overlay=overlay)
    assert "→ final_answer ×1 ■ ended here — truncated" in mermaid


def test_a_state_that_is_not_the_answer_says_so() -> None:
    spec = load_workflow(REPO / "workflows" / "reflect.yaml")
    dot = to_dot(spec)
    assert "answer: false" in node_line(dot, "critique")
    assert "answer: false" not in node_line(dot, "revise")
    assert "    critique : answer — false" in to_mermaid(spec)


def test_overlay_shows_the_error_of_a_failed_run(default: WorkflowSpec) -> None:
    events = EventLog(default).take(0).end("agent_error", error="server said 503")
    dot = to_dot(default, overlay=RunOverlay.from_events(events))
    assert "error: server said 503" in dot
    assert "ended here: agent_error" in node_line(dot, "think")


def test_run_in_flight_has_no_reason(default: WorkflowSpec) -> None:
    overlay = RunOverlay.from_events(EventLog(default).take(0, 1).events)
    assert overlay.reason is None
    assert overlay.terminating is None
    assert not overlay.ended_by_kernel
    assert overlay.last_state == "act"
    assert "not terminated (in flight or killed) after 2 transitions, in act" in to_dot(
        default, overlay=overlay
    )


def test_mermaid_overlay(default: WorkflowSpec) -> None:
    events = EventLog(default).take(0, 1, 5, 6).end("done")
    text = to_mermaid(default, overlay=RunOverlay.from_events(events))
    assert "    evaluate --> terminate : 7. [done_called] → done ×1 ■ ended here" in text
    assert "    think --> act : 2. [has_tool_calls] ×1" in text
    assert "    class terminate ended" in text
    assert "    class act visited" in text
    assert "    think : ×1" in text


def test_overlay_problems_name_a_mismatched_run(default: WorkflowSpec, loop: WorkflowSpec) -> None:
    overlay = RunOverlay.from_events(EventLog(loop).take(0, 4).end("done"))
    problems = overlay_problems(default, overlay)
    assert (
        problems[0] == "run 0190aaaa-bbbb-7ccc-8ddd-eeeeffff0000 is of workflow 'loop', "
        "not 'default'"
    )
    assert any("transition 4 (act -> evaluate) is not in the workflow" in p for p in problems)
    dot = to_dot(default, overlay=overlay)
    assert "×" not in "".join(edge_lines(dot, "act", "evaluate"))  # index 4 is think->terminate


def test_overlay_problems_notice_a_changed_file(default: WorkflowSpec) -> None:
    log = EventLog(default)
    log.events[0] = Event(
        run_id=log.run_id,
        seq=1,
        type=EventType.RUN_STARTED,
        timestamp=T0,
        data={"workflow": "default", "workflow_hash": "0" * 64},
    )
    overlay = RunOverlay.from_events(log.take(0).end("timeout"))
    assert overlay_problems(default, overlay) == [
        f"the workflow file changed since run {log.run_id}"
    ]


def test_forced_resume_hash_counts(default: WorkflowSpec) -> None:
    log = EventLog(default)
    log.events[0] = Event(
        run_id=log.run_id,
        seq=1,
        type=EventType.RUN_STARTED,
        timestamp=T0,
        data={"workflow": "default", "workflow_hash": "0" * 64},
    )
    log.add(EventType.RUN_RESUMED, workflow_hash=default.content_hash, forced=True)
    overlay = RunOverlay.from_events(log.take(0).end("timeout"))
    assert overlay.workflow_hash == default.content_hash
    assert overlay_problems(default, overlay) == []


# -- render -------------------------------------------------------------------------------------


def test_render_without_dot_names_the_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match=r"apt-get install graphviz .*brew install graphviz"):
        render("digraph {}", "svg", tmp_path / "x.svg")
    assert not (tmp_path / "x.svg").exists()


def test_render_rejects_other_formats(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="choose one of svg, png"):
        render("digraph {}", "pdf", tmp_path / "x.pdf")


@pytest.mark.skipif(not HAS_DOT, reason="the dot program is not installed")
def test_render_png_and_dot_errors(default: WorkflowSpec, tmp_path: Path) -> None:
    out = render(to_dot(default), "png", tmp_path / "sub" / "default.png")
    assert out.read_bytes().startswith(b"\x89PNG")
    with pytest.raises(ConfigError, match=r"^dot failed: .*syntax error"):
        render("digraph { a -> }", "svg", tmp_path / "bad.svg")


def test_the_legend_can_be_left_out(default: WorkflowSpec) -> None:
    with_legend, without = to_dot(default), to_dot(default, legend=False)
    assert "_legend" in with_legend
    assert "_legend" not in without
    assert "cluster" not in without
    assert without == with_legend[: with_legend.index("\tsubgraph cluster_legend")] + "}\n"


@pytest.mark.skipif(not HAS_DOT, reason="the dot program is not installed")
def test_render_svg_returns_the_text(default: WorkflowSpec) -> None:
    svg = render_svg(to_dot(default))
    assert svg.lstrip().startswith("<?xml")
    assert "<title>think&#45;&gt;act</title>" in svg
    with pytest.raises(ConfigError, match=r"^dot failed: .*syntax error"):
        render_svg("digraph { a -> }")


def test_render_svg_without_dot_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="apt-get install graphviz"):
        render_svg("digraph {}")


# -- diagrams/ is in sync with workflows/ --------------------------------------------------------


def test_workflows_exist() -> None:
    assert DEFAULT in WORKFLOWS


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_diagrams_folder_matches_workflows(path: Path) -> None:
    golden = REPO / "diagrams" / f"{path.stem}.dot"
    fix = "run `fsm-kernel diagram --all workflows/ -o diagrams/` and commit diagrams/"
    assert golden.is_file(), f"diagrams/{golden.name} is missing: {fix}"
    expected = to_dot(load_workflow(path))
    assert golden.read_text(encoding="utf-8") == expected, (
        f"diagrams/{golden.name} is out of date with workflows/{path.name}: {fix}"
    )


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_no_two_edges_share_a_number(path: Path) -> None:
    """plan_execute drew `execute → replan` and `replan → execute` both as "3. [else]"."""
    spec = load_workflow(path)
    numbers = [edge_label(spec, i).partition(". ")[0] for i in range(len(spec.transitions))]
    numbered = [n for n in numbers if n.isdigit()]
    assert len(numbered) == len(set(numbered))
    for i, t in enumerate(spec.transitions):  # the number is the transition's place in the file
        if len(spec.transitions_from(t.source)) > 1:
            assert numbers[i] == str(i + 1)


def test_plan_executes_two_else_edges_are_told_apart() -> None:
    spec = load_workflow(REPO / "workflows" / "plan_execute.yaml")
    labels = {(t.source, t.target): edge_label(spec, i) for i, t in enumerate(spec.transitions)}

    assert labels["plan", "execute"] == "3. [else]"
    assert labels["execute", "replan"] == "7. [else] / replans = vars.replans + 1"
    assert labels["replan", "execute"] == "10. [else]"
