"""agent.decide (workflow/decide.py): the behaviours its mutation testing found unpinned. What
the model is shown (the `choose` tool, why a pick is refused), which choices a guard with
`unless:` offers, validate's whole messages, and which edge ends a run that a workflow built
without validation leaves without a transition. Workflows are loaded inside each test, so the
checks run every time."""

from __future__ import annotations

import asyncio
from pathlib import Path

from fsm_kernel.errors import AgentConnectionError
from fsm_kernel.kernel import Kernel
from fsm_kernel.protocol import EventType
from fsm_kernel.testing import ScriptedChatModel, WorkflowHarness, call
from fsm_kernel.tools import builtin_registry
from fsm_kernel.workflow.compiler import compile_workflow
from fsm_kernel.workflow.decide import choose_tool, pick_of
from fsm_kernel.workflow.loader import check_workflow_text, load_workflow_text
from fsm_kernel.workflow.spec import Limits, StateSpec, TransitionSpec, WorkflowSpec

LOOK, WRITE = "look it up", "écrire la réponse"


def test_the_choose_tool_shows_the_choices_as_written_not_escaped() -> None:
    tool = choose_tool([LOOK, WRITE])
    assert tool.description == (
        'Choose what happens next: call this once with exactly one of: "look it up"; '
        '"écrire la réponse".'
    )
    assert tool.parameters["properties"]["choice"]["enum"] == [LOOK, WRITE]


def test_an_illegal_pick_is_quoted_as_written_beside_every_offered_choice() -> None:
    assert pick_of(call("choose", {"choice": "voler ✈"}), [LOOK, WRITE]) == (
        None,
        '"voler ✈" is not one of the offered choices ("look it up", "écrire la réponse")',
    )


def test_a_long_illegal_pick_is_cut_to_200_characters_in_the_reason() -> None:
    pick, why = pick_of(call("choose", {"choice": "x" * 300}), [LOOK])
    assert pick is None
    assert why == '"' + "x" * 199 + ' is not one of the offered choices ("look it up")'


UNLESS = """\
name: decide_unless
initial: route
states:
  route: {action: agent.decide, prompt: "What next?"}
  research: {action: agent.think, answer: false}
  write: {action: agent.think}
  terminate: {final: true}
transitions:
  - {source: route, target: research, choice: look it up, unless: has_answer}
  - {source: route, target: write, choice: write it, guard: has_answer}
  - {source: route, target: terminate, reason: no_progress}
  - {source: research, target: route}
  - {source: write, target: terminate, reason: final_answer}
"""


def test_a_choice_guarded_by_unless_is_offered_only_while_that_guard_is_false() -> None:
    harness = WorkflowHarness(load_workflow_text(UNLESS, path="u.yaml"))
    assert harness.choices("route") == ["look it up"]
    assert harness.choices("route", last_reply="Paris.") == ["write it"]
    pick_look, pick_write = (
        call("choose", {"choice": "look it up"}),
        call("choose", {"choice": "write it"}),
    )
    model = ScriptedChatModel([pick_look, "Paris.", pick_write, "Paris is the capital."])
    result = harness.run("Capital of France?", model=model)
    assert (result.termination_reason, result.response) == ("final_answer", "Paris is the capital.")
    offered = [r.tools[0].parameters["properties"]["choice"]["enum"] for r in model.requests[::2]]
    assert offered == [["look it up"], ["write it"]]


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
  - {source: route, target: lonely, choice: "  "}
  - {source: route, target: terminate, reason: done}
  - {source: route, target: terminate, reason: done}
  - {source: lonely, target: guarded}
  - {source: think, target: guarded}
  - {source: guarded, target: terminate, choice: stop, guard: has_answer, reason: done}
"""


def test_validate_says_how_to_fix_each_decide_error_in_full() -> None:
    check = check_workflow_text(BROKEN, path="b.yaml")
    assert [str(e) for e in check.errors] == [
        "b.yaml:4:40: 'tools' does nothing on state 'route': agent.decide offers the model its "
        "choices alone (the choose tool)",
        "b.yaml:5:20: state 'lonely' runs agent.decide but no transition out of it has a "
        "'choice:': add one edge per choice the model may make",
        "b.yaml:11:45: a choice needs a text: what the model is offered (e.g. 'look something up')",
        "b.yaml:13:5: transition never fires: the unguarded transition from 'route' above it is "
        "taken whenever no choice is offered",
        "b.yaml:16:5: every choice out of 'guarded' is guarded, so at times none is offered: add "
        "an unguarded transition without 'choice:' (last), taken then without asking the model",
    ]


def _unvalidated(limits: Limits) -> WorkflowSpec:
    """A workflow built in Python without validate: `think`'s only edge is guarded, so a text
    answer leaves it without a transition."""
    return WorkflowSpec(
        name="unvalidated",
        initial="think",
        limits=limits,
        states={"think": StateSpec(action="agent.think"), "end": StateSpec(final=True)},
        transitions=[
            TransitionSpec(source="think", target="end", guard=["has_tool_calls"], reason="done")
        ],
    )


def test_no_transition_out_of_a_state_that_does_not_decide_ends_the_run_as_error(
    tmp_path: Path,
) -> None:
    """Only an agent.decide state left without a pick ends for the limit reached; any other
    state without a transition is an error, even when a limit is reached at the same time."""
    kernel = Kernel(
        compile_workflow(_unvalidated(Limits(max_iterations=1))),
        model=ScriptedChatModel(["Paris."]),
        tools=builtin_registry(tmp_path),
    )
    result = asyncio.run(kernel.run("Capital of France?"))
    assert result.termination_reason == "error"
    assert result.error == "no transition out of 'think' had its guards pass"
    assert result.iterations == 1


CAUGHT = """\
name: decide_caught
reasons:
  unreachable: {success: false, description: the model server failed}
initial: route
states:
  route:
    action: agent.decide
    prompt: "What next?"
    catch: [{error: agent_error, target: terminate, reason: unreachable}]
  write: {action: agent.think}
  terminate: {final: true}
transitions:
  - {source: route, target: write, choice: write it}
  - {source: route, target: terminate, choice: stop now, reason: done}
  - {source: write, target: terminate, reason: final_answer}
"""


def test_an_agent_decide_state_with_a_catch_routes_a_failed_model_call() -> None:
    """A catch edge of an agent.decide state is no choice: the model is offered the two
    choices, and a failed call takes the catch edge."""
    harness = WorkflowHarness(load_workflow_text(CAUGHT, path="c.yaml"))
    assert harness.choices("route") == ["write it", "stop now"]
    failed = harness.run("go", model=ScriptedChatModel([AgentConnectionError("down")]))
    assert failed.termination_reason == "unreachable"
    picked = harness.run("go", model=ScriptedChatModel([call("choose", {"choice": "stop now"})]))
    assert picked.termination_reason == "done"


LAST_CALL = """\
name: decide_last_call
limits: {max_iterations: 1}
initial: route
states:
  route: {action: agent.decide, prompt: "What next?"}
  write: {action: agent.think}
  terminate: {final: true}
transitions:
  - {source: route, target: write, choice: write it, unless: iteration_limit}
  - {source: route, target: terminate, reason: no_progress}
  - {source: write, target: terminate, reason: final_answer}
"""


def test_a_pick_takes_its_edge_even_when_its_unless_turns_true_with_that_call() -> None:
    """A choice's guards are tested when it is offered; the model call that picks it uses up
    the last iteration, yet the picked edge is the one taken (then the limit ends the run)."""
    harness = WorkflowHarness(load_workflow_text(LAST_CALL, path="l.yaml"))
    result = harness.run("go", model=ScriptedChatModel([call("choose", {"choice": "write it"})]))
    taken = [
        (e.data["source"], e.data["target"])
        for e in result.events
        if e.type is EventType.TRANSITION_TAKEN
    ]
    assert taken == [("route", "write")]
    assert (result.termination_reason, result.iterations) == ("max_iterations", 1)
