"""The compiled machine: which transition `step()` fires from each state of default.yaml for
hand-made RunContext values, guard errors, the compile cache, and NoTransitionError."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
from statemachine import StateChart

from fsm_kernel.bootstrap import RunOptions, run_limits
from fsm_kernel.errors import NoTransitionError, WorkflowValidationError
from fsm_kernel.kernel import Kernel
from fsm_kernel.protocol import Completion, Message, ToolCall
from fsm_kernel.tools import builtin_registry
from fsm_kernel.workflow.compiler import CompiledWorkflow, Machine, compile_workflow
from fsm_kernel.workflow.context import RunContext
from fsm_kernel.workflow.loader import load_workflow, load_workflow_text
from fsm_kernel.workflow.spec import Limits, WorkflowSpec
from fsm_kernel.workflow.validate import IDENT, RESERVED_NAMES

REPO = Path(__file__).resolve().parents[2]
DEFAULT = REPO / "workflows" / "default.yaml"

GUARD_CALLS: list[str] = []
GUARD_THREADS: list[int] = []


def exploding_guard(ctx: RunContext) -> bool:
    raise ValueError("guard bug")


def counting_guard(ctx: RunContext) -> bool:
    GUARD_CALLS.append(ctx.current_state)
    GUARD_THREADS.append(threading.get_ident())
    return bool(ctx.scratch.get("go"))


def _answer(text: str = "It is noon.") -> Completion:
    return Completion(message=Message.assistant(text))


def _tool_calls() -> Completion:
    call = ToolCall(id="c1", name="datetime", arguments={})
    return Completion(message=Message.assistant("", [call]), finish_reason="tool_calls")


def _ctx(**values: Any) -> RunContext:
    ctx = RunContext(limits=Limits(max_iterations=10))
    for key, value in values.items():
        setattr(ctx, key, value)
    return ctx


@pytest.fixture(scope="module")
def default() -> CompiledWorkflow:
    return compile_workflow(load_workflow(DEFAULT))


# (source, context values, expected target, expected reason, why)
CASES: list[tuple[str, dict[str, Any], str, str | None, str]] = [
    ("observe", {}, "think", None, "always"),
    ("think", {"last_completion": _tool_calls()}, "act", None, "tool calls"),
    (
        "think",
        {"last_completion": _tool_calls(), "malformed_reason": "bad json", "malformed_streak": 1},
        "think",
        None,
        "malformed, retries left",
    ),
    (
        "think",
        {"last_completion": _tool_calls(), "malformed_reason": "bad json", "malformed_streak": 3},
        "terminate",
        "malformed_output",
        "malformed, retries exhausted",
    ),
    ("think", {"last_completion": _answer()}, "terminate", "final_answer", "an answer"),
    ("think", {"last_completion": _answer("")}, "terminate", "final_answer", "empty answer"),
    ("think", {}, "terminate", "final_answer", "no completion at all: the fallback"),
    ("act", {}, "evaluate", None, "always"),
    ("evaluate", {"done_answer": "42"}, "terminate", "done", "done called"),
    ("evaluate", {"fatal_error": "x: y"}, "terminate", "fatal_tool_error", "fatal"),
    ("evaluate", {"failure_streak": 3}, "terminate", "tool_failures", "three failures"),
    ("evaluate", {"repeat_count": 3}, "terminate", "no_progress", "three repeats"),
    ("evaluate", {"iteration": 10}, "terminate", "max_iterations", "cap reached"),
    ("evaluate", {"iteration": 11}, "terminate", "max_iterations", "cap passed"),
    ("evaluate", {}, "observe", None, "nothing to stop for"),
    (
        "evaluate",
        {"failure_streak": 2, "repeat_count": 2, "iteration": 9},
        "observe",
        None,
        "below",
    ),
    (
        "evaluate",
        {"done_answer": "a", "fatal_error": "b", "failure_streak": 3, "iteration": 10},
        "terminate",
        "done",
        "done wins: first in file order",
    ),
    (
        "evaluate",
        {"fatal_error": "b", "failure_streak": 3, "repeat_count": 3},
        "terminate",
        "fatal_tool_error",
        "fatal before failures",
    ),
    (
        "evaluate",
        {"failure_streak": 3, "repeat_count": 3, "iteration": 10},
        "terminate",
        "tool_failures",
        "failures before repeats",
    ),
    (
        "evaluate",
        {"repeat_count": 4, "iteration": 10},
        "terminate",
        "no_progress",
        "repeats before the cap",
    ),
]


@pytest.mark.parametrize(
    ("source", "values", "target", "reason", "why"), CASES, ids=[c[4] for c in CASES]
)
def test_step_picks_the_first_passing_transition(
    default: CompiledWorkflow,
    source: str,
    values: dict[str, Any],
    target: str,
    reason: str | None,
    why: str,
) -> None:
    ctx = _ctx(**values)
    machine = default.instantiate(ctx, start=source)

    fired = machine.step()

    assert (fired.source, fired.target, fired.reason) == (source, target, reason)
    assert machine.state == target
    assert ctx.current_state == target
    assert machine.is_final == (target == "terminate")
    assert fired.final == machine.is_final
    declared = default.spec.transitions[fired.index]
    assert (declared.source, declared.target, declared.reason) == (source, target, reason)
    first_passing = next(
        i
        for i, t in default.spec.transitions_from(source)
        if t.target == target and t.reason == reason
    )
    assert fired.index == first_passing
    assert "_fired" not in ctx.scratch


def test_every_declared_transition_has_a_case(default: CompiledWorkflow) -> None:
    fired: set[tuple[str, str, str]] = set()
    for source, values, _, _, _ in CASES:
        ctx = _ctx(**values)
        f = default.instantiate(ctx, start=source).step()
        fired.add((f.source, f.target, f.guard))
    assert fired == default.spec.transition_triples()


def test_iteration_cap_zero_never_fires(default: CompiledWorkflow) -> None:
    ctx = RunContext(limits=Limits(max_iterations=0), iteration=1000)

    fired = default.instantiate(ctx, start="evaluate").step()

    assert fired.target == "observe"


def test_limits_come_from_the_context(default: CompiledWorkflow) -> None:
    strict = RunContext(limits=Limits(max_tool_failures=1), failure_streak=1)
    lenient = RunContext(limits=Limits(max_tool_failures=5), failure_streak=4)

    assert default.instantiate(strict, start="evaluate").step().reason == "tool_failures"
    assert default.instantiate(lenient, start="evaluate").step().target == "observe"


def test_fired_transition_labels_and_dict(default: CompiledWorkflow) -> None:
    ctx = _ctx(last_completion=_tool_calls(), malformed_reason="x", malformed_streak=1)

    fired = default.instantiate(ctx, start="think").step()

    assert fired.guard == "malformed_output and not retries_exhausted"
    assert fired.to_dict() == {
        "index": 2,
        "source": "think",
        "target": "think",
        "guard": "malformed_output and not retries_exhausted",
        "reason": None,
        "tried": [
            {
                "edge": 1,
                "target": "act",
                "checks": [{"check": "has_tool_calls", "value": False}],
                "passed": False,
            },
            {
                "edge": 2,
                "target": "think",
                "checks": [
                    {"check": "malformed_output", "value": True},
                    {"check": "not retries_exhausted", "value": True},
                ],
                "passed": True,
            },
        ],
    }


def test_a_whole_run_of_steps(default: CompiledWorkflow) -> None:
    ctx = _ctx()
    machine = default.instantiate(ctx)
    assert machine.state == "observe"
    assert not machine.is_final

    path = [machine.step().target]
    ctx.last_completion = _tool_calls()
    path.append(machine.step().target)
    path.append(machine.step().target)
    path.append(machine.step().target)
    path.append(machine.step().target)
    ctx.last_completion = _answer()
    last = machine.step()
    path.append(last.target)

    assert path == ["think", "act", "evaluate", "observe", "think", "terminate"]
    assert last.reason == "final_answer"
    assert machine.is_final


def test_each_run_gets_its_own_machine(default: CompiledWorkflow) -> None:
    a, b = _ctx(), _ctx()
    first = default.instantiate(a)
    second = default.instantiate(b)

    first.step()

    assert first.state == "think"
    assert second.state == "observe"


def test_a_context_can_be_reused_by_a_new_machine(default: CompiledWorkflow) -> None:
    ctx = _ctx()
    default.instantiate(ctx).step()

    again = default.instantiate(ctx)

    assert again.state == "observe"
    assert again.step().target == "think"


def test_a_raising_guard_propagates() -> None:
    spec = load_workflow_text(
        """
name: raising
initial: start
states:
  start: {action: session.observe}
  end: {final: true}
transitions:
  - {source: start, target: end, guard: "tests.unit.test_workflow_compiler:exploding_guard",
     reason: done}
  - {source: start, target: end, reason: final_answer}
"""
    )
    machine = compile_workflow(spec).instantiate(_ctx())

    with pytest.raises(ValueError, match="guard bug"):
        machine.step()


def test_user_guard_reads_the_context_and_unless_negates() -> None:
    spec = load_workflow_text(
        """
name: custom
initial: start
states:
  start: {action: session.observe}
  middle: {action: session.observe}
  end: {final: true}
transitions:
  - {source: start, target: end, guard: "tests.unit.test_workflow_compiler:counting_guard",
     reason: done}
  - {source: start, target: middle, unless: "tests.unit.test_workflow_compiler:counting_guard"}
  - {source: start, target: end, reason: final_answer}
  - {source: middle, target: end, reason: final_answer}
"""
    )
    compiled = compile_workflow(spec)
    GUARD_CALLS.clear()

    go = _ctx(scratch={"go": True})
    stay = _ctx()

    assert compiled.instantiate(go).step().reason == "done"
    assert compiled.instantiate(stay).step().target == "middle"
    assert GUARD_CALLS == ["start", "start", "start"]


def test_compile_cache_returns_the_same_object() -> None:
    first = compile_workflow(load_workflow(DEFAULT))
    second = compile_workflow(load_workflow(DEFAULT))

    assert first is second
    assert first.machine_class is second.machine_class


def test_changed_content_compiles_anew(tmp_path: Path) -> None:
    text = DEFAULT.read_text(encoding="utf-8")
    path = tmp_path / "default.yaml"
    path.write_text(text, encoding="utf-8")
    before = compile_workflow(load_workflow(path))
    path.write_text(text.replace("max_iterations: 10", "max_iterations: 4"), encoding="utf-8")

    after = compile_workflow(load_workflow(path))

    assert after is not before
    assert after.spec.limits.max_iterations == 4
    assert compile_workflow(load_workflow(path)) is after


class _NoModel:
    async def complete(self, messages: object, tools: object) -> object:
        raise AssertionError("not called")


def test_limits_are_a_run_parameter_not_part_of_the_compiled_machine() -> None:
    # The CLI's --max-iterations/--timeout become the Kernel's limits: one compiled class.
    spec = load_workflow(DEFAULT)
    plain = compile_workflow(spec)
    tighter = run_limits(spec, RunOptions(max_iterations=1, timeout_seconds=5))

    kernel = Kernel(plain, model=_NoModel(), tools=builtin_registry("."), limits=tighter)

    assert compile_workflow(spec) is plain
    assert (kernel.limits.max_iterations, kernel.limits.timeout_seconds) == (1, 5)
    assert plain.spec.limits.max_iterations == 10
    assert not hasattr(plain, "with_spec")


def test_compiled_actions_are_resolved(default: CompiledWorkflow) -> None:
    assert {sid: a.name for sid, a in default.actions.items()} == {
        "observe": "session.observe",
        "think": "agent.think",
        "act": "tools.execute",
        "evaluate": "kernel.evaluate",
    }
    assert [sid for sid, a in default.actions.items() if a.calls_model] == ["think"]
    assert issubclass(default.machine_class, StateChart)


def test_instantiate_an_unknown_state_is_no_transition_error(default: CompiledWorkflow) -> None:
    with pytest.raises(NoTransitionError, match="unknown state 'nowhere'"):
        default.instantiate(_ctx(), start="nowhere")


def test_step_from_a_final_state_is_no_transition_error(default: CompiledWorkflow) -> None:
    machine = default.instantiate(_ctx(run_id="run-1"), start="terminate")
    assert machine.is_final

    with pytest.raises(NoTransitionError) as info:
        machine.step()

    assert info.value.run_id == "run-1"
    assert "'terminate'" in str(info.value)


def test_no_guard_passing_is_no_transition_error() -> None:
    # Validation forbids this; the compiler must still fail cleanly on a spec built directly.
    data = {
        "name": "stuck",
        "initial": "think",
        "states": {"think": {"action": "session.observe"}, "end": {"final": True}},
        "transitions": [
            {"source": "think", "target": "end", "guard": "has_answer", "reason": "final_answer"}
        ],
    }
    spec = WorkflowSpec.model_validate(data)
    machine = compile_workflow(spec).instantiate(_ctx(run_id="r9"))

    with pytest.raises(NoTransitionError) as info:
        machine.step()

    assert info.value.run_id == "r9"
    assert "no transition out of 'think'" in str(info.value)
    assert machine.state == "think"


def test_every_statechart_attribute_is_a_reserved_state_id() -> None:
    # A state id equal to one of these shadows the library's attribute (e.g. `prepare` crashes
    # every step, `catch_errors_as_events` silently swallows guard errors).
    public = {n for n in dir(StateChart) if not n.startswith("_") and IDENT.match(n)}

    assert public - RESERVED_NAMES == set()


@pytest.mark.parametrize(
    "name", ["prepare", "catch_errors_as_events", "start_configuration_values"]
)
def test_a_state_shadowing_the_library_is_rejected_at_load_time(name: str) -> None:
    text = f"""
name: shadow
initial: start
states:
  start: {{action: session.observe}}
  {name}: {{action: kernel.evaluate}}
  end: {{final: true}}
transitions:
  - {{source: start, target: {name}}}
  - {{source: {name}, target: end, reason: final_answer}}
"""
    with pytest.raises(WorkflowValidationError, match="reserved") as info:
        load_workflow_text(text, path="shadow.yaml")

    assert str(info.value).startswith("shadow.yaml:6:3: ")


# --- each situation is decided by the engine once ----------------------------------------------

LOOP = """
name: loopy
initial: think
states:
  think: {action: agent.think}
  act: {action: session.observe}
  end: {final: true}
transitions:
  - {source: think, target: act, guard: has_tool_calls}
  - {source: think, target: think, guard: malformed_output, unless: retries_exhausted}
  - {source: think, target: end, reason: final_answer}
  - {source: act, target: think, guard: "tests.unit.test_workflow_compiler:counting_guard"}
  - {source: act, target: think}
"""


def _fresh(text: str) -> CompiledWorkflow:
    """A compiled workflow of its own, whose engine has decided nothing yet (compile_workflow
    would hand back the one an earlier test, or an earlier pytest session in this process,
    taught). Read as data: these loops stand in for think/act with session.observe, a cycle
    `validate` refuses (nothing bounds it); the compiler does not care."""
    return CompiledWorkflow(load_workflow_text(text, import_code=False))


def _sends(monkeypatch: pytest.MonkeyPatch, compiled: CompiledWorkflow) -> list[str]:
    """Record every event the engine is sent through machines of `compiled`."""
    sent: list[str] = []
    original = compiled.machine_class.send

    def send(self: Any, event: str, *args: Any, **kwargs: Any) -> Any:
        sent.append(event)
        return original(self, event, *args, **kwargs)

    monkeypatch.setattr(compiled.machine_class, "send", send)
    return sent


def test_a_decision_is_taken_again_only_for_the_same_guard_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    compiled = _fresh(LOOP.replace("loopy", "loopy_a"))
    sent = _sends(monkeypatch, compiled)
    calls = _ctx(last_completion=_tool_calls())
    bad = _ctx(last_completion=_tool_calls(), malformed_reason="bad JSON")
    exhausted = _ctx(last_completion=_tool_calls(), malformed_reason="bad JSON", malformed_streak=3)

    first = [compiled.instantiate(c, start="think").step().target for c in (calls, bad)]
    again = [compiled.instantiate(c, start="think").step().target for c in (bad, calls)]

    assert first == ["act", "think"]
    assert again == ["think", "act"]  # each from its own guard values, never the other's
    assert len(sent) == 2  # the engine decided each situation once
    machine = compiled.instantiate(exhausted, start="think")
    fired = machine.step()
    assert (fired.target, fired.reason, fired.final, machine.is_final) == (
        "end",
        "final_answer",
        True,
        True,
    )
    assert len(sent) == 3  # new values: the engine decides


def test_a_taken_decision_leaves_the_machine_as_the_engine_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    compiled = _fresh(LOOP.replace("loopy", "loopy_b"))
    _sends(monkeypatch, compiled)
    for _ in range(2):  # the second pass takes the recorded decisions
        ctx = _ctx(last_completion=_tool_calls())
        machine = compiled.instantiate(ctx, start="think")
        fired = machine.step()
        assert (fired.index, fired.source, fired.target, fired.guard) == (
            0,
            "think",
            "act",
            "has_tool_calls",
        )
        assert (machine.state, ctx.current_state, ctx.notes.fired) == ("act", "act", 0)
        assert not machine.is_final
        ctx.last_completion = _answer()
        machine.step()  # act -> think (user guard), then think -> end: the engine's own path
        assert machine.step().final


PURE = """
name: pure
initial: observe
states:
  observe: {action: session.observe}
  think: {action: agent.think}
  act: {action: session.observe}
  end: {final: true}
transitions:
  - {source: observe, target: think}
  - {source: think, target: act, guard: has_tool_calls}
  - {source: think, target: think, guard: malformed_output, unless: retries_exhausted}
  - {source: think, target: end, reason: final_answer}
  - {source: act, target: think}
"""


def _engines(monkeypatch: pytest.MonkeyPatch, compiled: CompiledWorkflow) -> list[str]:
    """The state each engine built for a machine of `compiled` started at."""
    built: list[str] = []
    original = compiled.machine_class.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        built.append(kwargs["start_value"])
        original(self, *args, **kwargs)

    monkeypatch.setattr(compiled.machine_class, "__init__", init)
    return built


def _drive(compiled: CompiledWorkflow, *completions: Completion) -> tuple[Machine, list[str]]:
    """Step a machine from the start, giving the context each completion when it reaches think."""
    ctx = _ctx()
    machine = compiled.instantiate(ctx)
    left = list(completions)
    path = [machine.state]
    while not machine.is_final:
        if machine.state == "think":
            ctx.last_completion = left.pop(0)
        path.append(machine.step().target)
    return machine, path


def test_a_run_of_situations_decided_before_builds_no_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    compiled = _fresh(PURE)
    sent, built = _sends(monkeypatch, compiled), _engines(monkeypatch, compiled)

    _, first = _drive(compiled, _tool_calls(), _answer())
    assert (len(built), len(sent)) == (1, 4)  # the engine decided every situation once

    machine, again = _drive(compiled, _tool_calls(), _answer())
    assert again == first == ["observe", "think", "act", "think", "end"]
    assert (len(built), len(sent)) == (1, 4)  # decided before: no engine, nothing sent
    assert machine.is_final  # the edge into the final state was taken again too
    assert (machine.state, machine.ctx.current_state) == ("end", "end")


def test_an_engine_built_mid_run_starts_where_the_machine_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    compiled = _fresh(PURE.replace("pure", "pure_b"))
    _drive(compiled, _tool_calls(), _answer())
    built = _engines(monkeypatch, compiled)
    ctx = _ctx()
    machine = compiled.instantiate(ctx)
    for _ in range(3):  # observe -> think -> act -> think, all decided before
        ctx.last_completion = _tool_calls()
        machine.step()
    assert (machine.state, built) == ("think", [])
    ctx.malformed_reason = "bad JSON"  # a situation the engine has not seen

    fired = machine.step()

    assert built == ["think"]
    assert (fired.source, fired.target, fired.index) == ("think", "think", 2)
    assert (machine.state, machine.is_final) == ("think", False)
    ctx.malformed_reason, ctx.last_completion = None, _answer()
    fired = machine.step()  # by the engine it built
    assert (fired.target, fired.final, machine.is_final) == ("end", True, True)


def test_an_engine_follows_the_decisions_taken_again_after_it_was_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    compiled = _fresh(PURE.replace("pure", "pure_c"))
    _drive(compiled, _tool_calls(), _answer())
    ctx = _ctx(last_completion=_tool_calls())
    machine = compiled.instantiate(ctx)
    machine.step()  # observe -> think, decided before
    ctx.malformed_reason = "bad JSON"
    machine.step()  # think -> think: a new situation, so the engine is built
    ctx.malformed_reason = None

    assert machine.step().target == "act"  # decided before: taken again

    engine = machine._engine()
    assert engine.current_state_value == machine.state == "act"  # the engine moved with it


def test_an_engine_built_for_a_reused_context_starts_where_its_machine_does() -> None:
    compiled = _fresh(PURE.replace("pure", "pure_d"))
    ctx = _ctx(last_completion=_tool_calls())
    first = compiled.instantiate(ctx)
    first.step()
    first.step()  # the engine left its state on the context: act
    again = compiled.instantiate(ctx, start="think")
    ctx.malformed_reason = "bad JSON"  # not decided before: the engine is built

    fired = again.step()

    assert (fired.source, fired.target) == ("think", "think")


def test_a_users_guard_is_run_off_the_event_loops_thread_and_built_in_ones_on_it() -> None:
    users, built_in = (
        _fresh(LOOP.replace("loopy", "loopy_t")),
        _fresh(PURE.replace("pure", "pure_t")),
    )
    GUARD_THREADS.clear()

    fired = asyncio.run(users.instantiate(_ctx(scratch={"go": True}), start="act").advance())

    assert fired.target == "think"
    assert len(GUARD_THREADS) == 1
    assert GUARD_THREADS[0] != threading.get_ident()  # a slow guard cannot block the loop
    assert users.user_guards
    assert not built_in.user_guards  # nothing of the user's to wait for: no thread hand-off


def test_workflows_of_one_name_and_different_content_get_engine_classes_of_their_own() -> None:
    one = _fresh(PURE.replace("pure", "my-flow_x"))
    other = _fresh(PURE.replace("pure", "my-flow_x") + "# the same machine, said again\n")

    assert one.machine_class.__name__ == f"MyFlowX_{one.spec.content_hash[:12]}"
    assert other.machine_class.__name__ != one.machine_class.__name__


def test_workflows_built_in_code_are_compiled_once_per_content() -> None:
    spec = load_workflow_text(PURE.replace("pure", "inline_a"), import_code=False)
    built = [WorkflowSpec.model_validate(spec.model_dump()) for _ in range(2)]
    longer = WorkflowSpec.model_validate(
        {**spec.model_dump(), "limits": {**spec.limits.model_dump(), "max_iterations": 99}}
    )
    assert built[0].content_hash == ""  # no file, no text: nothing to hash

    first, again, other = (compile_workflow(s) for s in (*built, longer))

    assert first is again
    assert other is not first
    assert other.spec.limits.max_iterations == 99
    assert first.machine_class.__name__.endswith("_inline")


def test_a_state_with_a_users_guard_always_asks_the_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    compiled = _fresh(LOOP.replace("loopy", "loopy_c"))
    sent = _sends(monkeypatch, compiled)
    GUARD_CALLS.clear()

    for go in (True, True, False):
        compiled.instantiate(_ctx(scratch={"go": go}), start="act").step()

    assert len(sent) == 3
    assert GUARD_CALLS == ["act", "act", "act"]
    assert all(state != "act" for state, _ in compiled.decisions)


def test_a_workflow_the_engine_refuses_is_a_validation_error_naming_its_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from statemachine.exceptions import InvalidDefinition

    import fsm_kernel.workflow.compiler as compiler_module

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise InvalidDefinition("a state the engine cannot build")

    monkeypatch.setattr(compiler_module, "create_machine_class_from_definition", refuse)
    spec = load_workflow_text(
        "name: refused\ninitial: a\nstates:\n  a: {action: session.observe}\n"
        "  b: {final: true}\ntransitions:\n  - {source: a, target: b, reason: final_answer}\n",
        path="refused.yaml",
    )
    with pytest.raises(WorkflowValidationError) as refused:
        compile_workflow(spec)
    assert (
        str(refused.value)
        == "refused.yaml: cannot compile workflow: a state the engine cannot build"
    )
    assert isinstance(refused.value.__cause__, InvalidDefinition)
