"""Why a transition fired (issue 28, part 4) at the compiler: `FiredTransition.tried` lists the
edges a step tried in the kernel's order (the compound states' edges first, then catch edges,
then the state's own), each with the checks the engine evaluated, up to the first false one,
and whether it passed: for `guard:`, `unless:` (`not <name>`), `when:`, `completed`, waiting
edges (`event`, `after`), agent.decide edges (`choice`, the fallback), catch edges and users'
guards; a decision taken again from the cache carries the same trace."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fsm_kernel.protocol import Completion, Message, ToolCall
from fsm_kernel.workflow.compiler import CompiledWorkflow, FiredTransition, compile_workflow
from fsm_kernel.workflow.context import CaughtError, RunContext
from fsm_kernel.workflow.loader import load_workflow, load_workflow_text
from fsm_kernel.workflow.spec import Limits

REPO = Path(__file__).resolve().parents[2]
HERE = "tests.unit.test_why_trace"


def flag(ctx: RunContext) -> bool:
    """A user's guard: the test sets `scratch["go"]`."""
    return bool(ctx.scratch.get("go"))


def _compiled(text: str) -> CompiledWorkflow:
    return compile_workflow(load_workflow_text(text))


def _stock(name: str) -> CompiledWorkflow:
    return compile_workflow(load_workflow(REPO / "workflows" / f"{name}.yaml"))


def _ctx(**values: Any) -> RunContext:
    ctx = RunContext(limits=Limits(max_iterations=10))
    for key, value in values.items():
        setattr(ctx, key, value)
    return ctx


def _tool_calls() -> Completion:
    call = ToolCall(id="c1", name="datetime", arguments={})
    return Completion(message=Message.assistant("", [call]), finish_reason="tool_calls")


def _edge(edge: int, target: str, passed: bool, *checks: tuple[str, bool]) -> dict[str, Any]:
    return {
        "edge": edge,
        "target": target,
        "checks": [{"check": c, "value": v} for c, v in checks],
        "passed": passed,
    }


def test_rejected_guards_then_the_edge_taken_with_each_check_value() -> None:
    default = _stock("default")
    ctx = _ctx(failure_streak=3)  # three tool failures in a row: max_tool_failures

    fired = default.instantiate(ctx, start="evaluate").step()

    assert fired.reason == "tool_failures"
    assert list(fired.tried) == [
        _edge(6, "terminate", False, ("done_called", False)),
        _edge(7, "terminate", False, ("fatal_tool_error", False)),
        _edge(8, "terminate", True, ("tool_failures", True)),
    ]
    assert fired.to_dict()["tried"] == list(fired.tried)


def test_unless_is_not_name_and_the_checks_stop_at_the_first_false_one() -> None:
    default = _stock("default")
    ctx = _ctx(last_completion=_tool_calls(), malformed_reason="bad json", malformed_streak=3)

    fired = default.instantiate(ctx, start="think").step()

    assert (fired.target, fired.reason) == ("terminate", "malformed_output")
    assert list(fired.tried) == [
        _edge(1, "act", False, ("has_tool_calls", False)),  # malformed: no usable tool calls
        _edge(2, "think", False, ("malformed_output", True), ("not retries_exhausted", False)),
        _edge(3, "terminate", True, ("malformed_output", True)),
    ]


def test_an_unguarded_edge_taken_has_no_checks() -> None:
    fired = _stock("default").instantiate(_ctx(), start="observe").step()

    assert list(fired.tried) == [_edge(0, "think", True)]


ROUTER = """\
name: router
variables:
  attempts: {type: integer, default: 0}
  plan: {type: array, items: {type: string}, default: []}
initial: think
states:
  think: {action: agent.think}
  more: {action: agent.think}
  done: {final: true}
transitions:
  - {source: think, target: done, when: "vars.attempts >= 3", reason: final_answer}
  - {source: think, target: more, guard: has_answer, when: "size(vars.plan) > 0"}
  - {source: think, target: more, when: "size(vars.plan) > 0"}
  - {source: think, target: done, reason: final_answer}
  - {source: more, target: think}
"""


def test_a_when_expression_is_labelled_with_its_text_after_the_guards_of_its_edge() -> None:
    ctx = _ctx(vars={"attempts": 1, "plan": ["a"]})  # no answer: has_answer is false

    fired = _compiled(ROUTER).instantiate(ctx, start="think").step()

    assert fired.index == 2
    assert list(fired.tried) == [
        _edge(0, "done", False, ("when: vars.attempts >= 3", False)),
        _edge(1, "more", False, ("has_answer", False)),  # the guard first: when: not evaluated
        _edge(2, "more", True, ("when: size(vars.plan) > 0", True)),
    ]


def test_a_compound_states_edges_are_tried_first_and_completed_is_a_check() -> None:
    research = compile_workflow(load_workflow(REPO / "tests" / "data" / "compound_research.yaml"))

    inside = research.instantiate(_ctx(last_completion=_tool_calls()), start="think").step()
    found = research.instantiate(_ctx(), start="found").step()

    assert list(inside.tried) == [
        _edge(0, "terminate", False, ("tool_failed", False)),  # research's, outermost first
        _edge(4, "report", False, ("completed", False)),
        _edge(1, "act", True, ("has_tool_calls", True)),  # then think's own
    ]
    assert list(found.tried) == [
        _edge(0, "terminate", False, ("tool_failed", False)),
        _edge(4, "report", True, ("completed", True)),  # found is research's final child
    ]


DECIDE = """\
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


def test_agent_decide_edges_are_checked_by_the_pick_and_the_fallback_by_none_offered() -> None:
    compiled = _compiled(DECIDE)
    picked = _ctx(offered_choices=("run the tools", "answer now"), choice="answer now")
    nothing = _ctx(offered_choices=(), choice=None)

    chosen = compiled.instantiate(picked, start="route").step()
    fallback = compiled.instantiate(nothing, start="route").step()

    assert list(chosen.tried) == [
        _edge(0, "act", False, ("choice run the tools", False)),
        _edge(1, "answer", True, ("choice answer now", True)),
    ]
    assert list(fallback.tried) == [
        _edge(0, "act", False, ("choice run the tools", False)),
        _edge(1, "answer", False, ("choice answer now", False)),
        _edge(2, "terminate", False, ("malformed_output", False)),
        _edge(3, "terminate", True, ("no choice offered", True)),
    ]


WAIT = """\
name: wait_ci
reasons:
  timed_out: {description: CI never answered}
initial: plan
states:
  plan: {action: agent.think}
  wait_for_ci: {description: waits for CI or gives up}
  deploy: {action: agent.think}
  done: {final: true}
  gave_up: {final: true}
transitions:
  - {source: plan, target: wait_for_ci}
  - {source: wait_for_ci, target: deploy, event: ci_passed}
  - {source: wait_for_ci, target: gave_up, after: 30m, reason: timed_out}
  - {source: deploy, target: done, reason: final_answer}
"""


def test_waiting_edges_are_checked_by_the_event_or_the_timer_that_woke_the_run() -> None:
    compiled = _compiled(WAIT)
    by_event, by_timer = _ctx(), _ctx()
    by_event.notes.trigger = ("event", "ci_passed")
    by_timer.notes.trigger = ("timer", 2)

    delivered = compiled.instantiate(by_event, start="wait_for_ci").step()
    timed_out = compiled.instantiate(by_timer, start="wait_for_ci").step()

    assert list(delivered.tried) == [_edge(1, "deploy", True, ("event ci_passed", True))]
    assert list(timed_out.tried) == [
        _edge(1, "deploy", False, ("event ci_passed", False)),
        _edge(2, "gave_up", True, ("after 30m", True)),
    ]


CATCH = """\
name: catching
initial: work
states:
  work:
    action: agent.think
    catch:
      - {error: agent_error, target: backup}
  backup: {action: agent.think}
  done: {final: true}
transitions:
  - {source: work, target: done, reason: final_answer}
  - {source: backup, target: done, reason: final_answer}
"""


def test_a_catch_edge_is_tried_before_the_states_own_edges() -> None:
    compiled = _compiled(CATCH)
    failed = _ctx()
    failed.notes.failure = CaughtError(
        state="work", error="agent_error", type="AgentServerError", message="down"
    )

    caught = compiled.instantiate(failed, start="work").step()
    fine = compiled.instantiate(_ctx(), start="work").step()

    assert (caught.index, caught.catch) == (2, "agent_error")
    assert list(caught.tried) == [_edge(2, "backup", True, ("catch agent_error", True))]
    assert list(fine.tried) == [
        _edge(2, "backup", False, ("catch agent_error", False)),
        _edge(0, "done", True),
    ]


USER = f"""\
name: user_guards
initial: start
states:
  start: {{action: agent.think}}
  middle: {{action: agent.think}}
  end: {{final: true}}
transitions:
  - {{source: start, target: end, guard: "{HERE}:flag", reason: final_answer}}
  - {{source: start, target: middle, unless: "{HERE}:flag"}}
  - {{source: start, target: end, reason: final_answer}}
  - {{source: middle, target: end, reason: final_answer}}
"""


def test_a_users_guard_is_labelled_as_written_and_traced_each_time() -> None:
    compiled = _compiled(USER)
    go, stay = _ctx(), _ctx()
    go.scratch["go"] = True

    taken = [compiled.instantiate(ctx, start="start").step() for ctx in (go, stay, stay)]

    assert list(taken[0].tried) == [_edge(0, "end", True, (f"{HERE}:flag", True))]
    assert list(taken[1].tried) == [
        _edge(0, "end", False, (f"{HERE}:flag", False)),
        _edge(1, "middle", True, (f"not {HERE}:flag", True)),
    ]
    assert taken[2].tried == taken[1].tried
    assert compiled.decisions == {}  # a user's guard is never decided from the cache


def test_a_decision_taken_from_the_cache_carries_the_trace_the_engine_recorded() -> None:
    default = _stock("default")
    first = default.instantiate(_ctx(failure_streak=3), start="evaluate")
    again = default.instantiate(_ctx(failure_streak=3), start="evaluate")

    engine = first.step()
    cached = again.step()

    assert again._sm is None  # decided without building the engine
    assert cached == engine
    assert list(cached.tried) == list(engine.tried)
    assert [t["edge"] for t in cached.tried] == [6, 7, 8]


def test_the_trace_is_not_part_of_a_steps_identity_and_an_old_one_has_none() -> None:
    bare = FiredTransition(4, "think", "terminate", "", "final_answer", True)
    traced = FiredTransition(
        4, "think", "terminate", "", "final_answer", True, tried=(_edge(4, "terminate", True),)
    )

    assert bare == traced
    assert "tried" not in bare.to_dict()
    assert traced.to_dict()["tried"] == [_edge(4, "terminate", True)]
