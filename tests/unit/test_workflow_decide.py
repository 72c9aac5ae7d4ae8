"""agent.decide at the transition level and in whole runs with a scripted model: the model is
offered exactly the choices whose guards hold, its pick is the edge taken, an illegal pick is
malformed output (retried, then malformed_output unless the workflow routes it), no legal
choice takes the fallback without asking, validate's rules, the diagram's labels, and a replay
that takes the same edges without a model."""

from __future__ import annotations

import asyncio
import subprocess
import threading
from pathlib import Path

import pytest

from fsm_kernel.diagram import edge_label, to_dot, to_mermaid
from fsm_kernel.errors import NoTransitionError, WorkflowValidationError
from fsm_kernel.protocol import EventType, Tool
from fsm_kernel.replay import replay_run
from fsm_kernel.store import JsonlEventStore
from fsm_kernel.testing import (
    ReplyLike,
    ScriptedChatModel,
    WorkflowHarness,
    as_completion,
    bad_call,
    call,
    calls,
)
from fsm_kernel.workflow.compiler import compile_workflow
from fsm_kernel.workflow.context import RunContext
from fsm_kernel.workflow.decide import choose_tool, pick_of
from fsm_kernel.workflow.loader import check_workflow_text, load_workflow_text
from fsm_kernel.workflow.spec import WorkflowSpec

REPO = Path(__file__).resolve().parents[2]
ROUTE = REPO / "tests" / "data" / "decide_route.yaml"
LOOK, WRITE = "look something up", "write the answer now"

FALLBACK = """\
name: decide_fallback
initial: route
states:
  route: {action: agent.decide, prompt: "Which tool?"}
  act: {action: tools.execute}
  answer: {action: agent.think, prompt: Answer.}
  terminate: {final: true}
transitions:
  - {source: route, target: act, choice: run the tools, guard: has_tool_calls}
  - {source: route, target: answer, choice: answer now, guard: has_answer}
  - {source: route, target: terminate, guard: malformed_output, reason: malformed_output}
  - {source: route, target: terminate, reason: no_progress}
  - {source: act, target: answer}
  - {source: answer, target: terminate, reason: final_answer}
"""


GUARD_THREADS: list[int] = []


def notes_taken(ctx: RunContext) -> bool:
    """A user's guard: it must run off the event loop's thread."""
    GUARD_THREADS.append(threading.get_ident())
    return bool(ctx.scratch.get("notes"))


def offered(tools: tuple[Tool, ...]) -> list[str]:
    """The choices a request's one tool, `choose`, offers."""
    (tool,) = tools
    assert tool.name == "choose"
    enum: list[str] = tool.parameters["properties"]["choice"]["enum"]
    return enum


@pytest.fixture(scope="module")
def route() -> WorkflowHarness:
    return WorkflowHarness(ROUTE)


def fallback_spec() -> WorkflowSpec:
    return load_workflow_text(FALLBACK, path="fallback.yaml")


# --- the transition level -------------------------------------------------------------------


def test_only_the_choices_whose_guards_hold_are_offered(route: WorkflowHarness) -> None:
    assert route.choices("route") == [LOOK]  # has_answer is false: no reply yet
    assert route.choices("route", last_reply="Paris is the capital.") == [LOOK, WRITE]


def test_the_pick_is_the_edge_taken(route: WorkflowHarness) -> None:
    fired = route.step("route", choice=LOOK)
    assert (fired.target, fired.choice, fired.index) == ("research", LOOK, 0)
    fired = route.step("route", choice=WRITE, last_reply="Paris is the capital.")
    assert (fired.target, fired.choice, fired.index) == ("write", WRITE, 1)
    assert fired.guard == f'choice "{WRITE}" and has_answer'
    assert fired.to_dict()["choice"] == WRITE


def test_a_pick_the_model_would_not_be_offered_is_refused(route: WorkflowHarness) -> None:
    with pytest.raises(ValueError, match="is not offered here: its edge's guards do not hold"):
        route.step("route", choice=WRITE)  # no answer yet: has_answer is false
    with pytest.raises(ValueError, match="has no choice 'fly away'"):
        route.step("route", choice="fly away")
    with pytest.raises(ValueError, match=r"choice= is for agent\.decide states"):
        route.step("research", choice=LOOK)


def test_no_pick_takes_no_choice_edge(route: WorkflowHarness) -> None:
    with pytest.raises(NoTransitionError):
        route.step("route")  # a choice was offered and none picked: no edge of its own


def test_no_legal_choice_takes_the_fallback_and_a_malformed_pick_is_routed() -> None:
    harness = WorkflowHarness(fallback_spec())
    assert harness.choices("route") == []
    fired = harness.step("route")
    assert (fired.target, fired.reason, fired.choice) == ("terminate", "no_progress", None)
    assert fired.guard == ""
    fired = harness.step(
        "route", last_reply="42", malformed_reason="not a choice", malformed_streak=3
    )
    assert (fired.target, fired.reason) == ("terminate", "malformed_output")
    assert harness.step("route", last_reply="42", choice="answer now").target == "answer"


def test_the_reply_must_be_one_call_of_choose_with_an_offered_choice() -> None:
    legal = [LOOK, WRITE]
    assert pick_of(call("choose", {"choice": LOOK}), legal) == (LOOK, None)
    assert pick_of(call("choose", {"choice": f"  {LOOK}\n"}), legal) == (LOOK, None)
    cases: dict[str, ReplyLike] = {
        "the reply did not call choose": "I will look it up.",
        "is not one of the offered choices": call("choose", {"choice": "fly away"}),
        "null is not one of the offered choices": call("choose", {}),
        "tool 'search' was not offered (offered: choose)": call("search", {"q": "x"}),
        "has arguments that are not JSON": bad_call("choose"),
    }
    for problem, reply in cases.items():
        pick, why = pick_of(as_completion(reply), legal)
        assert pick is None
        assert problem in str(why), (problem, why)
    two = calls(("choose", {"choice": LOOK}), ("choose", {"choice": WRITE}))
    assert pick_of(two, legal) == (None, "the reply made 2 tool calls; call choose once")


def test_the_tool_is_one_enum_argument() -> None:
    tool = choose_tool([LOOK, WRITE])
    assert tool.parameters == {
        "type": "object",
        "properties": {
            "choice": {
                "type": "string",
                "enum": [LOOK, WRITE],
                "description": "The choice, exactly as offered",
            }
        },
        "required": ["choice"],
        "additionalProperties": False,
    }
    assert f'"{LOOK}"; "{WRITE}"' in tool.description


# --- whole runs -----------------------------------------------------------------------------


def test_a_run_offers_only_the_legal_choices_and_takes_the_picks(route: WorkflowHarness) -> None:
    model = ScriptedChatModel(
        [
            call("choose", {"choice": LOOK}),
            "Paris is the capital.",
            call("choose", {"choice": WRITE}),
            "Paris.",
        ]
    )
    result = route.run("Capital of France?", model=model)

    assert (result.termination_reason, result.response, result.iterations) == (
        "final_answer",
        "Paris.",
        4,
    )
    first, _, third, _ = model.requests
    assert offered(first.tools) == [LOOK]
    assert offered(third.tools) == [LOOK, WRITE]
    assert first.tool_choice == third.tool_choice == "choose"
    assert first.last_message is not None
    assert first.last_message.content == "What next?"
    taken = [e.data for e in result.events if e.type is EventType.TRANSITION_TAKEN]
    assert [(t["target"], t.get("choice")) for t in taken] == [
        ("research", LOOK),
        ("route", None),
        ("write", WRITE),
        ("terminate", None),
    ]
    picks = [e.data for e in result.events if e.type is EventType.ITERATION_COMPLETED]
    assert [(p["step"], p["decision"], p.get("choice"), p["next_state"]) for p in picks] == [
        (1, "choice", LOOK, "research"),
        (2, "answer", None, "route"),
        (3, "choice", WRITE, "write"),
        (4, "answer", None, "terminate"),
    ]
    model.assert_complete()


def test_an_illegal_pick_is_retried_then_the_run_ends_malformed_output(
    route: WorkflowHarness,
) -> None:
    model = ScriptedChatModel([call("choose", {"choice": WRITE}), "I would look it up."])
    result = route.run("Capital of France?", model=model)

    assert result.termination_reason == "malformed_output"
    assert result.error == (
        "2 malformed model replies in a row (limits.max_malformed_outputs = 2); the last: the "
        "reply did not call choose (it answered in text)"
    )
    assert result.iterations == 2
    _, second = model.requests
    assert offered(second.tools) == [LOOK]
    told = second.messages[-1]
    assert told.role.value == "tool"
    assert told.content.startswith(
        f'error: not accepted: "{WRITE}" is not one of the offered choices ("{LOOK}")'
    )
    assert not [e for e in result.events if e.type is EventType.TRANSITION_TAKEN]


def test_an_illegal_then_legal_pick_goes_on(route: WorkflowHarness) -> None:
    model = ScriptedChatModel(
        [call("choose", {"choice": "fly"}), call("choose", {"choice": LOOK}), "Paris.", "x"]
    )
    result = route.run("Capital of France?", model=model, limits={"max_iterations": 3})
    assert result.termination_reason == "max_iterations"
    taken = [e.data for e in result.events if e.type is EventType.TRANSITION_TAKEN]
    assert taken[0]["choice"] == LOOK
    decisions = [
        e.data["decision"] for e in result.events if e.type is EventType.ITERATION_COMPLETED
    ]
    assert decisions == ["malformed", "choice", "answer"]


def test_no_legal_choice_takes_the_fallback_without_asking() -> None:
    harness = WorkflowHarness(fallback_spec())
    model = ScriptedChatModel(["Hello.", "no", "no", "no"])
    result = harness.run("hi", model=model, limits={"max_malformed_outputs": 2})
    # answer: not offered (no reply yet); no choice legal → the fallback, no model call
    assert (result.termination_reason, result.iterations) == ("no_progress", 0)
    assert model.requests == []


def test_a_malformed_pick_the_workflow_routes_ends_by_its_edge() -> None:
    spec = load_workflow_text(
        FALLBACK.replace("initial: route", "initial: first")
        .replace("states:\n", "states:\n  first: {action: agent.think, prompt: Go.}\n")
        .replace("transitions:\n", "transitions:\n  - {source: first, target: route}\n"),
        path="f.yaml",
    )
    harness = WorkflowHarness(spec)
    model = ScriptedChatModel(["Hello.", "no", "still no"])
    result = harness.run("hi", model=model, limits={"max_malformed_outputs": 2})
    assert result.termination_reason == "malformed_output"
    taken = [e.data for e in result.events if e.type is EventType.TRANSITION_TAKEN]
    assert [(t["source"], t["target"], t["guard"]) for t in taken][-1] == (
        "route",
        "terminate",
        "malformed_output",
    )
    assert offered(model.requests[1].tools) == ["answer now"]


def test_replay_takes_the_same_edges_without_a_model(
    route: WorkflowHarness, tmp_path: Path
) -> None:
    store = JsonlEventStore(tmp_path / "runs")
    model = ScriptedChatModel(
        [
            call("choose", {"choice": "x"}),
            call("choose", {"choice": LOOK}),
            "Paris.",
            call("choose", {"choice": WRITE}),
            "Paris.",
        ]
    )
    result = route.run("Capital of France?", model=model, store=store)
    assert result.termination_reason == "final_answer"

    report = asyncio.run(replay_run(compile_workflow(route.spec), store, result.run_id))

    assert report.identical, report.to_dict()
    assert report.model_calls == 5
    assert report.steps[0].recorded == f'route → research [choice "{LOOK}"]'


# --- validate ---------------------------------------------------------------------------------

BROKEN = """\
name: decide_broken
initial: route
states:
  route: {action: agent.decide, tools: [datetime]}
  lonely: {action: agent.decide}
  think: {action: agent.think}
  guarded: {action: agent.decide}
  terminate: {final: true}
transitions:
  - {source: route, target: think, choice: go}
  - {source: route, target: think, choice: go}
  - {source: route, target: lonely, choice: " padded"}
  - {source: route, target: terminate, reason: done}
  - {source: route, target: terminate, reason: done}
  - {source: lonely, target: guarded}
  - {source: think, target: guarded, choice: never}
  - {source: think, target: terminate, reason: final_answer}
  - {source: guarded, target: terminate, choice: stop, guard: has_answer, reason: done}
"""
BROKEN_ERRORS = [
    (4, 40, "'tools' does nothing on state 'route': agent.decide offers the model its choices"),
    (5, 20, "state 'lonely' runs agent.decide but no transition out of it has a 'choice:'"),
    (11, 44, "choice 'go' is offered twice out of 'route' (transitions[0] has it)"),
    (12, 45, "choice ' padded' starts or ends with spaces"),
    (14, 5, "transition never fires: the unguarded transition from 'route' above it"),
    (16, 46, "'choice:' only on edges out of an agent.decide state; 'think' runs agent.think"),
    (18, 5, "every choice out of 'guarded' is guarded, so at times none is offered"),
]


def test_validate_reports_every_decide_error_at_its_place() -> None:
    check = check_workflow_text(BROKEN, path="broken.yaml")
    found = [(e.location.line, e.location.col, e.message) for e in check.errors]
    assert len(found) == len(BROKEN_ERRORS), found
    for (line, col, message), (eline, ecol, expected) in zip(found, BROKEN_ERRORS, strict=True):
        assert (line, col) == (eline, ecol), (message, expected)
        assert message.startswith(expected), message


def test_a_decide_state_with_an_unguarded_choice_needs_no_fallback() -> None:
    spec = load_workflow_text(ROUTE.read_text(encoding="utf-8"), path="r.yaml")
    assert [t.choice for t in spec.transitions][:2] == [LOOK, WRITE]
    with pytest.raises(WorkflowValidationError, match="every choice out of 'route' is guarded"):
        load_workflow_text(
            ROUTE.read_text(encoding="utf-8").replace(
                "choice: look something up}", "choice: look something up, unless: has_answer}"
            ),
            path="r.yaml",
        )


def test_a_decide_state_inside_a_compound_state() -> None:
    text = """\
name: decide_nested
initial: work
states:
  work:
    initial: route
    states:
      route: {action: agent.decide}
      think: {action: agent.think}
  terminate: {final: true}
transitions:
  - {source: work, target: terminate, guard: iteration_limit, reason: max_iterations}
  - {source: route, target: think, choice: think}
  - {source: route, target: terminate, choice: stop, reason: done}
  - {source: think, target: route}
"""
    harness = WorkflowHarness(load_workflow_text(text, path="nested.yaml"))
    assert harness.step("route", choice="stop").reason == "done"
    fired = harness.step("route", choice="think", iteration=10, limits={"max_iterations": 10})
    assert fired.reason == "max_iterations"  # the parent's edge is tried first
    model = ScriptedChatModel(
        [call("choose", {"choice": "think"}), "hm", call("choose", {"choice": "stop"})]
    )
    result = harness.run("go", model=model)
    assert result.termination_reason == "done"


# --- diagrams -------------------------------------------------------------------------------


def test_diagrams_draw_the_choice_text_on_its_edge(route: WorkflowHarness) -> None:
    assert edge_label(route.spec, 0) == f"1. “{LOOK}”"
    assert edge_label(route.spec, 1) == f"2. “{WRITE}” [has_answer]"
    mermaid = to_mermaid(route.spec)
    assert f"route --> research : 1. “{LOOK}”" in mermaid
    assert f"route --> write : 2. “{WRITE}” [has_answer]" in mermaid
    fallback = fallback_spec()
    assert edge_label(fallback, 3) == "4. [else] → no_progress"
    dot = to_dot(route.spec)
    assert f'route -> research [label="1. “{LOOK}”"' in dot


def test_a_choice_with_quotes_draws_valid_dot() -> None:
    text = ROUTE.read_text(encoding="utf-8").replace(
        "choice: look something up}", """choice: 'say "hi"; then: go'}"""
    )
    spec = load_workflow_text(text, path="q.yaml")
    assert edge_label(spec, 0) == '1. “say "hi"; then: go”'
    proc = subprocess.run(
        ["dot", "-Tsvg"], input=to_dot(spec), capture_output=True, text=True, check=False
    )
    if proc.returncode == 127:  # pragma: no cover - Graphviz missing
        pytest.skip("needs the dot program")
    assert proc.returncode == 0, proc.stderr
    assert "say &quot;hi&quot;; then: go" in proc.stdout
    assert 'route --> research : 1. “say "hi", then — go”' in to_mermaid(spec)


def test_the_guide_example_offers_write_only_after_a_model_call() -> None:
    page = REPO / "docs" / "how-to" / "decide.md"
    block = page.read_text(encoding="utf-8").split("```yaml\n")[1].split("```")[0]
    harness = WorkflowHarness(load_workflow_text(block, path=str(page)))

    assert harness.choices("route") == [LOOK]  # when: "iteration > 0" is false at first
    assert harness.choices("route", iteration=2) == [LOOK, WRITE]
    model = ScriptedChatModel(
        [call("choose", {"choice": LOOK}), "Paris.", call("choose", {"choice": WRITE}), "Paris."]
    )
    result = harness.run("Capital of France?", model=model)
    assert result.termination_reason == "final_answer"
    assert [offered(r.tools) for r in model.requests if r.tools] == [[LOOK], [LOOK, WRITE]]


def test_a_users_guard_on_a_choice_is_tested_off_the_loop() -> None:
    text = ROUTE.read_text(encoding="utf-8").replace(
        "guard: has_answer}", "guard: tests.unit.test_workflow_decide:notes_taken}"
    )
    harness = WorkflowHarness(load_workflow_text(text, path="user.yaml"))
    assert harness.choices("route", scratch={"notes": True}) == [LOOK, WRITE]
    GUARD_THREADS.clear()
    model = ScriptedChatModel([call("choose", {"choice": LOOK}), "Paris.", "x"])
    loop_threads: list[int] = []

    async def run() -> None:
        loop_threads.append(threading.get_ident())
        await harness.arun("Capital of France?", model=model, limits={"max_iterations": 2})

    asyncio.run(run())
    assert GUARD_THREADS
    assert loop_threads[0] not in GUARD_THREADS
    assert offered(model.requests[0].tools) == [LOOK]  # scratch has no notes: not offered
