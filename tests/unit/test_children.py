"""workflow.call / workflow.map on their own: templates, the budget a child gets, what the
parent records and absorbs, fail_fast, a waiting child, with a fake ChildRunner (the end-to-end
behaviour is in tests/integration/test_child_runs.py)."""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Callable
from typing import Any

import pydantic
import pytest

from fsm_kernel.protocol import EventType, Usage
from fsm_kernel.workflow.children import (
    CallPool,
    ChildRequest,
    ChildResult,
    ChildRunError,
    TemplateError,
    bounded_limits,
    charge_shared_calls,
    child_failed,
    child_succeeded,
    draw_on,
    render,
    take_shared_call,
    template_names,
    workflow_call,
    workflow_map,
)
from fsm_kernel.workflow.context import RunContext, RunServices
from fsm_kernel.workflow.human import Suspended
from fsm_kernel.workflow.limits import MAX_CALL_DEPTH
from fsm_kernel.workflow.spec import Limits, StateSpec, TransitionSpec, WorkflowSpec


def result(run_id: str, *, ok: bool = True, answer: str = "", **more: Any) -> ChildResult:
    reason = more.pop("reason", "final_answer" if ok else "tool_failures")
    return ChildResult(run_id=run_id, workflow="step", reason=reason, ok=ok, answer=answer, **more)


class FakeRunner:
    """Answers each request with `decide(request)`, after `delay`; counts children at once."""

    def __init__(self, decide: Callable[[ChildRequest], ChildResult], delay: float = 0.0):
        self.decide = decide
        self.delay = delay
        self.requests: list[ChildRequest] = []
        self.active = 0
        self.peak = 0

    async def run(self, request: ChildRequest) -> ChildResult:
        self.requests.append(request)
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            await asyncio.sleep(self.delay)
            return self.decide(request)
        finally:
            self.active -= 1


def placed(state: StateSpec, *, routed: bool) -> StateSpec:
    """`state` as the state `work` of a workflow, whose edges route on its children's outcome
    (`routed`) or not."""
    edge: dict[str, Any] = {"source": "work", "target": "end", "reason": "final_answer"}
    edges = [{**edge, "guard": ["child_failed"]}, edge] if routed else [edge]
    spec = WorkflowSpec(
        name="parent",
        initial="work",
        states={"work": state, "end": StateSpec(final=True)},
        transitions=[TransitionSpec.model_validate(e) for e in edges],
    )
    return spec.states["work"]


def context(
    runner: Any,
    *,
    state: StateSpec,
    recorded: tuple[str, ...] = (),
    limits: Limits | None = None,
    routed: bool = True,
    **values: Any,
) -> tuple[RunContext, list[tuple[EventType, dict[str, Any]]]]:
    """A parent's context in state `work` (by default one that routes `child_failed`)."""
    state = placed(state, routed=routed)
    events: list[tuple[EventType, dict[str, Any]]] = []
    services = RunServices(
        record=lambda t, d: events.append((t, d)), children=runner, recorded_children=recorded
    )
    ctx = RunContext(
        run_id="parent",
        goal="build a shed",
        workflow_path="/flows/parent.yaml",
        limits=limits or Limits(max_iterations=10, timeout_seconds=0),
        services=services,
        state_spec=state,
        current_state="work",
        **values,
    )
    return ctx, events


# --- templates ------------------------------------------------------------------------------


class Plan(pydantic.BaseModel):
    steps: list[str]


def test_render_fills_each_placeholder_from_the_run() -> None:
    ctx, _ = context(None, state=StateSpec(), answer="42", scratch={"who": "ann"})
    ctx.last_output = {"steps": ["a", {"x": 1}], "n": 3}
    ctx.children = [result("c1", answer="done", output={"k": "v"})]

    text = render(
        "{goal}|{answer}|{output.steps.0}|{output.steps.1}|{output.n}|{child.answer}|"
        "{child.output.k}|{children}|{scratch.who}|{item}|{index}",
        ctx,
        {"item": None, "index": 2},
    )

    assert text == 'build a shed|42|a|{"x": 1}|3|done|v|["done"]|ann||2'
    assert template_names("{goal} {output.steps} {item}") == ["goal", "output", "item"]


def test_render_reads_a_pydantic_output_and_the_runs_output_when_the_last_has_none() -> None:
    ctx, _ = context(None, state=StateSpec())
    ctx.output = Plan(steps=["only"])
    assert render("{output.steps.0}", ctx) == "only"
    ctx.last_output = Plan(steps=["newer"])
    assert render("{output.steps}", ctx) == '["newer"]'


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{output.missing}", "{output.missing} names nothing in the run (no 'missing')"),
        ("{output.steps.5}", "{output.steps.5} names nothing in the run (no '5')"),
        ("{goal.x}", "{goal.x} names nothing in the run (no 'x')"),
    ],
)
def test_a_placeholder_with_no_value_is_a_clear_error(template: str, message: str) -> None:
    ctx, _ = context(None, state=StateSpec())
    ctx.last_output = {"steps": ["a"]}
    with pytest.raises(TemplateError) as info:
        render(template, ctx)
    assert str(info.value) == message


# --- the budget a child gets -------------------------------------------------------------


@pytest.mark.parametrize(
    ("own", "iterations", "seconds", "expected"),
    [
        ({"max_iterations": 0, "timeout_seconds": 0}, 5, 2.5, (5, 2.5)),
        ({"max_iterations": 3, "timeout_seconds": 600}, 5, 30.0, (3, 30.0)),
        ({"max_iterations": 10, "timeout_seconds": 10}, 4, 30.0, (4, 10.0)),
        ({"max_iterations": 7, "timeout_seconds": 9}, None, None, (7, 9.0)),
    ],
)
def test_a_child_gets_its_own_limits_capped_by_what_the_parent_has_left(
    own: dict[str, Any], iterations: int | None, seconds: float | None, expected: tuple[int, float]
) -> None:
    limits = Limits(**own)
    bounded = bounded_limits(limits, iterations, seconds)
    assert (bounded.max_iterations, bounded.timeout_seconds) == expected
    assert bounded.max_tool_failures == limits.max_tool_failures
    if iterations is None and seconds is None:
        assert bounded is limits


def test_the_request_carries_the_parents_remaining_iterations_and_time() -> None:
    runner = FakeRunner(lambda r: result(r.run_id))
    state = StateSpec(action="workflow.call", workflow="step.yaml")

    async def go(limits: Limits, used: int, children: int) -> ChildRequest:
        ctx, _ = context(runner, state=state, limits=limits, iteration=used)
        ctx.child_iterations = children
        async with asyncio.timeout(30) as deadline:
            ctx.notes.deadline = deadline
            await workflow_call(ctx)
        return runner.requests[-1]

    first = asyncio.run(go(Limits(max_iterations=10), 3, 4))
    assert first.max_iterations == 3
    assert first.timeout_seconds is not None
    assert 29 < first.timeout_seconds <= 30
    assert first.parent_run_id == "parent"
    assert first.caller == "/flows/parent.yaml"
    assert first.workflow == "step.yaml"
    spent = asyncio.run(go(Limits(max_iterations=10), 6, 6))
    assert spent.max_iterations == 1  # never 0, which would mean no cap
    uncapped = asyncio.run(go(Limits(max_iterations=0), 6, 6))
    assert uncapped.max_iterations is None


# --- workflow.call -----------------------------------------------------------------------


def test_a_call_records_the_child_absorbs_it_and_answers_with_it() -> None:
    usage = Usage(prompt_tokens=7, completion_tokens=3, total_tokens=10)
    runner = FakeRunner(lambda r: result(r.run_id, answer="a roof", iterations=4, usage=usage))
    state = StateSpec(action="workflow.call", workflow="step.yaml", input="Plan: {goal}")
    ctx, events = context(runner, state=state, recorded=("c-recorded",))

    asyncio.run(workflow_call(ctx))

    assert [t for t, _ in events] == [
        EventType.CHILD_STARTED,
        EventType.CHILD_FINISHED,
        EventType.MESSAGE_ADDED,
    ]
    assert events[0][1] == {
        "run_id": "c-recorded",
        "workflow": "step.yaml",
        "input": "Plan: build a shed",
    }
    assert events[1][1]["run_id"] == "c-recorded"
    assert events[1][1]["answer"] == "a roof"
    assert "item" not in events[1][1]
    assert runner.requests[0].run_id == "c-recorded"  # the recorded id, on a re-drive
    assert runner.requests[0].prompt == "Plan: build a shed"
    assert ctx.answer == "a roof"
    assert ctx.child_iterations == 4
    assert ctx.usage == usage
    assert [c.run_id for c in ctx.children] == ["c-recorded"]
    assert ctx.session.messages()[-1].content == (
        "The workflow 'step.yaml' (run c-recorded) was asked: Plan: build a shed\n"
        "It answered: a roof"
    )
    assert child_succeeded(ctx)
    assert not child_failed(ctx)


def test_a_failed_call_is_no_answer_and_answer_false_keeps_the_parents() -> None:
    failing = FakeRunner(lambda r: result(r.run_id, ok=False, error="3 failed tool calls"))
    ctx, _ = context(
        failing, state=StateSpec(action="workflow.call", workflow="w"), answer="before"
    )
    asyncio.run(workflow_call(ctx))
    assert ctx.answer == "before"
    assert ctx.session.messages()[-1].content.endswith(
        "It answered: (failed: tool_failures) 3 failed tool calls"
    )
    assert child_failed(ctx)
    assert not child_succeeded(ctx)

    fine = FakeRunner(lambda r: result(r.run_id, answer="new"))
    quiet, _ = context(
        fine, state=StateSpec(action="workflow.call", workflow="w", answer=False), answer="old"
    )
    asyncio.run(workflow_call(quiet))
    assert quiet.answer == "old"
    assert quiet.children[0].answer == "new"


def test_guards_without_children() -> None:
    ctx, _ = context(None, state=StateSpec())
    assert not child_succeeded(ctx)
    assert not child_failed(ctx)


def test_a_waiting_child_suspends_its_parent_with_its_question() -> None:
    waiting = {
        "kind": "approval",
        "state": "act",
        "tool_call": {"id": "t1", "name": "rm", "arguments": {"path": "/"}},
    }
    runner = FakeRunner(lambda r: result(r.run_id, ok=False, reason=None, waiting_for=waiting))
    ctx, events = context(runner, state=StateSpec(action="workflow.call", workflow="w"))

    with pytest.raises(Suspended) as info:
        asyncio.run(workflow_call(ctx))

    question = info.value.question
    assert question.kind == "approval"
    assert question.state == "work"
    assert question.child_run_id == runner.requests[0].run_id
    assert question.tool_call is not None
    assert (question.tool_call.id, question.tool_call.name) == ("t1", "rm")
    assert question.tool_call.arguments == {"path": "/"}
    assert question.to_dict()["child_run_id"] == runner.requests[0].run_id
    assert events[-1][0] is EventType.CHILD_FINISHED  # recorded before the parent waits
    asked = FakeRunner(
        lambda r: result(r.run_id, ok=False, reason=None,
                         waiting_for={"kind": "input", "state": "ask", "prompt": "Which?"})
    )  # fmt: skip
    other, _ = context(asked, state=StateSpec(action="workflow.call", workflow="w"))
    with pytest.raises(Suspended) as second:
        asyncio.run(workflow_call(other))
    assert (second.value.question.kind, second.value.question.prompt) == ("input", "Which?")
    assert second.value.question.tool_call is None


# --- workflow.map ------------------------------------------------------------------------


def test_a_map_runs_each_item_at_most_n_at_a_time_and_answers_in_item_order() -> None:
    runner = FakeRunner(lambda r: result(r.run_id, answer=f"did {r.prompt}", iterations=2), 0.01)
    state = StateSpec(
        action="workflow.map",
        workflow="step.yaml",
        items="output.steps",
        input="{index}: {item}",
        max_concurrency=2,
    )
    ctx, events = context(runner, state=state, recorded=("r1", "r2"))
    ctx.last_output = {"steps": ["a", "b", "c", "d", "e"]}

    asyncio.run(workflow_map(ctx))

    assert runner.peak == 2
    started = [d for t, d in events if t is EventType.CHILD_STARTED]
    assert [d["item"] for d in started] == [0, 1, 2, 3, 4]
    assert [d["input"] for d in started] == ["1: a", "2: b", "3: c", "4: d", "5: e"]
    ids = [d["run_id"] for d in started]
    assert ids[:2] == ["r1", "r2"]  # recorded ids first (a re-drive), new ones after
    assert len(set(ids)) == 5
    types = [t for t, _ in events]
    assert types == [EventType.CHILD_STARTED] * 5 + [EventType.CHILD_FINISHED] * 5 + [
        EventType.MESSAGE_ADDED
    ]
    assert [c.run_id for c in ctx.children] == ids
    assert ctx.child_iterations == 10
    assert ctx.session.messages()[-1].content == (
        "The workflow 'step.yaml' ran once per item (5 items):\n"
        "1. 1: a\n   → did 1: a\n2. 2: b\n   → did 2: b\n3. 3: c\n   → did 3: c\n"
        "4. 4: d\n   → did 4: d\n5. 5: e\n   → did 5: e"
    )
    assert ctx.answer == ""  # a map's answers are in the conversation, not the answer


def test_a_map_default_runs_four_at_a_time_on_item_itself() -> None:
    runner = FakeRunner(lambda r: result(r.run_id, answer="ok"), 0.01)
    state = StateSpec(action="workflow.map", workflow="w", items="scratch.todo")
    ctx, _ = context(runner, state=state, scratch={"todo": [{"n": i} for i in range(6)]})

    asyncio.run(workflow_map(ctx))

    assert runner.peak == 4
    assert sorted(r.prompt for r in runner.requests) == [f'{{"n": {i}}}' for i in range(6)]


def test_items_must_be_a_list() -> None:
    state = StateSpec(action="workflow.map", workflow="w", items="output")
    ctx, events = context(FakeRunner(lambda r: result(r.run_id)), state=state)
    ctx.last_output = {"steps": "one long string"}
    with pytest.raises(TemplateError) as info:
        asyncio.run(workflow_map(ctx))
    assert str(info.value) == 'items \'output\' is not a list (it is {"steps": "one long string"})'
    assert events == []  # nothing started


def test_one_failed_item_fails_only_itself_unless_fail_fast() -> None:
    def decide(request: ChildRequest) -> ChildResult:
        if request.prompt == "b":
            return result(request.run_id, ok=False, error="broke")
        return result(request.run_id, answer="fine")

    state = StateSpec(action="workflow.map", workflow="w", items="scratch.xs", max_concurrency=1)
    ctx, _ = context(FakeRunner(decide), state=state, scratch={"xs": ["a", "b", "c", "d"]})
    asyncio.run(workflow_map(ctx))
    assert [c.ok for c in ctx.children] == [True, False, True, True]
    assert child_failed(ctx)

    fast = state.model_copy(update={"fail_fast": True})
    runner = FakeRunner(decide)
    ctx2, events = context(runner, state=fast, scratch={"xs": ["a", "b", "c", "d"]})
    asyncio.run(workflow_map(ctx2))
    assert [r.prompt for r in runner.requests] == ["a", "b"]
    assert [c.ok for c in ctx2.children] == [True, False, False, False]
    assert [c.reason for c in ctx2.children][2:] == [None, None]
    assert all("fail_fast" in str(c.error) for c in ctx2.children[2:])
    finished = [d for t, d in events if t is EventType.CHILD_FINISHED]
    assert sorted(d["item"] for d in finished) == [0, 1, 2, 3]
    assert "(failed: did not end) not started: an earlier item failed (fail_fast)" in (
        ctx2.session.messages()[-1].content
    )


def test_fail_fast_cancels_the_items_still_running() -> None:
    async def slow_or_failing(request: ChildRequest) -> ChildResult:
        if request.prompt == "bad":
            return result(request.run_id, ok=False, error="broke")
        await asyncio.sleep(30)
        return result(request.run_id, answer="late")

    class Mixed(FakeRunner):
        async def run(self, request: ChildRequest) -> ChildResult:
            self.requests.append(request)
            return await slow_or_failing(request)

    state = StateSpec(
        action="workflow.map", workflow="w", items="scratch.xs", max_concurrency=3, fail_fast=True
    )
    runner = Mixed(lambda r: result(r.run_id))
    ctx, _ = context(runner, state=state, scratch={"xs": ["slow1", "bad", "slow2"]})

    async def go() -> None:
        async with asyncio.timeout(10):
            await workflow_map(ctx)

    asyncio.run(go())  # ends at once: the running one is cancelled, the last never starts
    reasons = [c.reason for c in ctx.children]
    assert reasons == ["cancelled", "tool_failures", None]
    assert ctx.children[0].error == "cancelled: another item failed (fail_fast)"
    assert ctx.children[2].error == "not started: an earlier item failed (fail_fast)"
    ids = [r.run_id for r in runner.requests]
    assert [c.run_id for c in ctx.children[:2]] == ids[:2]  # each under its own id
    assert ctx.children[2].run_id not in ids  # never asked for, yet recorded under its id
    assert [(c.workflow, c.ok) for c in ctx.children] == [
        ("w", False),
        ("step", False),
        ("w", False),
    ]


def test_a_runner_that_raises_fails_the_map_with_its_error() -> None:
    def breaks(request: ChildRequest) -> ChildResult:
        if request.prompt == "b":
            raise RuntimeError("the runner broke")
        return result(request.run_id)

    state = StateSpec(action="workflow.map", workflow="w", items="scratch.xs")
    ctx, _ = context(FakeRunner(breaks), state=state, scratch={"xs": ["a", "b"]})
    with pytest.raises(RuntimeError, match="the runner broke"):
        asyncio.run(workflow_map(ctx))


# --- the details a run reads back ----------------------------------------------------------


def test_a_child_result_as_recorded_and_as_templates_see_it() -> None:
    usage = Usage(prompt_tokens=2, completion_tokens=1, total_tokens=3)
    plain = ChildResult(run_id="c", workflow="w", reason="done", ok=True, answer="a",
                        output={"k": 1}, iterations=2, usage=usage)  # fmt: skip
    assert plain.to_dict() == {
        "run_id": "c",
        "workflow": "w",
        "reason": "done",
        "ok": True,
        "answer": "a",
        "output": {"k": 1},
        "iterations": 2,
        "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
    }
    waiting = {"kind": "input", "state": "s"}
    odd = ChildResult(run_id="d", workflow="w", reason=None, ok=False, error="e",
                      waiting_for=waiting)  # fmt: skip
    assert odd.to_dict()["error"] == "e"
    assert odd.to_dict()["waiting_for"] == waiting
    assert plain.view() == {
        "run_id": "c",
        "workflow": "w",
        "reason": "done",
        "ok": True,
        "answer": "a",
        "output": {"k": 1},
        "error": None,
    }
    ctx, _ = context(None, state=StateSpec())
    ctx.children = [odd]
    assert render(
        "{child.run_id} {child.workflow} {child.reason} {child.ok} {child.error}", ctx
    ) == ("d w  false e")


class Dated(pydantic.BaseModel):
    on: datetime.date


def test_templates_write_json_as_json_keeps_non_ascii_and_reads_braced_items() -> None:
    ctx, _ = context(None, state=StateSpec())
    ctx.last_output = Dated(on=datetime.date(2026, 1, 2))
    assert render("{output.on} {output}", ctx) == '2026-01-02 {"on": "2026-01-02"}'
    ctx.last_output = {"steps": [{"name": "café"}]}
    assert render("{output.steps}", ctx) == '[{"name": "café"}]'
    runner = FakeRunner(lambda r: result(r.run_id, answer="ok"))
    state = StateSpec(action="workflow.map", workflow="w", items="{output.steps}")
    mapped, _ = context(runner, state=state)
    mapped.last_output = {"steps": ["x", "y"]}
    asyncio.run(workflow_map(mapped))
    assert sorted(r.prompt for r in runner.requests) == ["x", "y"]
    long, _ = context(runner, state=StateSpec(action="workflow.map", workflow="w", items="output"))
    long.last_output = {"text": "é" * 300}
    with pytest.raises(TemplateError) as info:
        asyncio.run(workflow_map(long))
    shown = str(info.value).split("(it is ", 1)[1]
    assert shown == ('{"text": "' + "é" * 300)[:120] + ")"


def test_a_call_defaults_to_the_goal_and_records_its_message() -> None:
    runner = FakeRunner(lambda r: result(r.run_id, ok=False, answer=""))
    ctx, events = context(runner, state=StateSpec(action="workflow.call", workflow="w"))
    asyncio.run(workflow_call(ctx))
    assert runner.requests[0].prompt == "build a shed"
    kind, data = events[-1]
    assert kind is EventType.MESSAGE_ADDED
    assert data["message"]["content"].endswith("It answered: (failed: tool_failures) no answer")


def test_what_a_map_records_for_items_that_never_ran() -> None:
    def decide(request: ChildRequest) -> ChildResult:
        return result(request.run_id, ok=request.prompt != "b", error="broke")

    state = StateSpec(action="workflow.map", workflow="w", items="scratch.xs", max_concurrency=1,
                      fail_fast=True)  # fmt: skip
    ctx, events = context(FakeRunner(decide), state=state, scratch={"xs": ["a", "b", "c"]},
                          recorded=("i1", "i2", "i3"))  # fmt: skip
    asyncio.run(workflow_map(ctx))
    never = ctx.children[2]
    assert (never.run_id, never.workflow, never.ok, never.reason) == ("i3", "w", False, None)
    finished = {d["item"]: d for t, d in events if t is EventType.CHILD_FINISHED}
    assert finished[2]["run_id"] == "i3"
    assert events[-1][0] is EventType.MESSAGE_ADDED
    assert "message" in events[-1][1]


def test_a_waiting_item_suspends_the_map_after_every_item_ended() -> None:
    def decide(request: ChildRequest) -> ChildResult:
        if request.prompt == "ask":
            question = {"kind": "input", "state": "q", "prompt": "Which?"}
            return result(request.run_id, ok=False, reason=None, waiting_for=question)
        return result(request.run_id, answer="ok")

    state = StateSpec(action="workflow.map", workflow="w", items="scratch.xs")
    ctx, events = context(FakeRunner(decide), state=state, scratch={"xs": ["a", "ask", "c"]})
    with pytest.raises(Suspended) as info:
        asyncio.run(workflow_map(ctx))
    assert info.value.question.child_run_id == ctx.children[1].run_id
    assert sum(1 for t, _ in events if t is EventType.CHILD_FINISHED) == 3


def test_an_empty_list_starts_no_child_and_neither_guard_passes() -> None:
    runner = FakeRunner(lambda r: result(r.run_id))
    state = StateSpec(action="workflow.map", workflow="w", items="scratch.xs")
    ctx, events = context(runner, state=state, scratch={"xs": []})

    asyncio.run(workflow_map(ctx))

    assert runner.requests == []
    assert [t for t, _ in events] == [EventType.MESSAGE_ADDED]
    assert ctx.session.messages()[-1].content == (
        "The workflow 'w' had no items to run (the list was empty)."
    )
    assert not child_succeeded(ctx)
    assert not child_failed(ctx)


# --- the calls a map's children share ------------------------------------------------------


def test_a_pool_gives_its_calls_then_names_itself_spent() -> None:
    pool = CallPool(2)
    assert pool.take() is None
    assert pool.take() is None
    assert pool.take() is pool
    assert pool.spent == 2  # a refused take takes nothing


def test_a_pool_inside_another_draws_on_both_and_stops_at_the_first_spent() -> None:
    outer = CallPool(3)
    inner = CallPool(5, outer)
    assert [inner.take() for _ in range(4)] == [None, None, None, outer]
    assert (inner.spent, outer.spent) == (3, 3)
    other = CallPool(1, outer)  # a sibling map's pool, inside the same spent outer one
    assert other.take() is outer
    assert other.spent == 0


def test_charges_count_calls_made_without_asking_in_every_pool_around() -> None:
    outer = CallPool(4)
    inner = CallPool(10, outer)
    inner.charge(3)
    assert (inner.spent, outer.spent) == (3, 3)
    assert inner.take() is None
    assert inner.take() is outer


def test_outside_a_map_every_call_is_free() -> None:
    ctx = RunContext()
    charge_shared_calls(5, ctx)  # no pool: nothing to count against
    assert all(take_shared_call(ctx) is None for _ in range(100))
    assert ctx.notes.shared_calls is None  # and nothing for its ending to record


def test_a_run_counts_what_it_drew_on_its_maps_pool_refused_call_aside() -> None:
    async def in_a_map() -> tuple[list[str | None], int | None, int]:
        pool = CallPool(3)
        draw_on(pool)
        ctx = RunContext()
        charge_shared_calls(1, ctx)  # a context summary's call
        taken = [take_shared_call(ctx) for _ in range(3)]
        return taken, ctx.notes.shared_calls, pool.spent

    taken, drawn, spent = asyncio.run(in_a_map())
    assert taken[:2] == [None, None]
    assert taken[2] == (
        "the 3 model call(s) its parent had left are spent: the children of a workflow.map "
        "share them"
    )
    assert (drawn, spent) == (3, 3)


def _taking_all(request: ChildRequest) -> ChildResult:
    """A child that makes model calls until its own cap stops it or the shared pool refuses
    one."""
    own = RunContext()
    taken = 0
    while taken < (request.max_iterations or 100) and take_shared_call(own) is None:
        taken += 1
    assert own.notes.shared_calls == taken
    return result(request.run_id, ok=False, reason="max_iterations", iterations=taken)


def test_the_children_of_a_map_share_what_the_parent_had_left() -> None:
    runner = FakeRunner(_taking_all, 0.01)
    state = StateSpec(action="workflow.map", workflow="w", items="scratch.todo", max_concurrency=3)
    ctx, _ = context(runner, state=state, scratch={"todo": list("abcde")}, iteration=6)

    asyncio.run(workflow_map(ctx))

    assert [r.max_iterations for r in runner.requests] == [4] * 5  # each alone: what is left
    assert ctx.child_iterations == 4  # together too (each would have made 4: 20)
    assert ctx.iterations_used == ctx.limits.max_iterations
    assert take_shared_call(ctx) is None  # the parent's own calls are not the pool's


def test_a_map_without_a_cap_shares_none_and_a_nested_one_draws_on_its_parents() -> None:
    state = StateSpec(action="workflow.map", workflow="w", items="scratch.todo")
    seen: list[str | None] = []

    def one_call(request: ChildRequest) -> ChildResult:
        seen.append(take_shared_call(RunContext()))
        return result(request.run_id, iterations=1)

    uncapped, _ = context(
        FakeRunner(one_call),
        state=state,
        scratch={"todo": [1, 2]},
        limits=Limits(max_iterations=0, timeout_seconds=0),
    )
    asyncio.run(workflow_map(uncapped))
    assert seen == [None, None]

    async def in_a_child_of_a_map_with_two_calls_left() -> int:
        ctx, _ = context(FakeRunner(_taking_all), state=state, scratch={"todo": [1, 2, 3]})

        async def child() -> None:
            draw_on(CallPool(2))  # as its parent's map set it
            await workflow_map(ctx)  # its own map: 10 left of its own, 2 of its parent's

        await asyncio.ensure_future(child())
        return ctx.child_iterations

    assert asyncio.run(in_a_child_of_a_map_with_two_calls_left()) == 2


def test_a_context_summary_is_a_call_drawn_on_the_maps_pool() -> None:
    from fsm_kernel.protocol import Completion, Message
    from fsm_kernel.workflow.actions import _summarize

    class Condenses:
        async def complete(self, messages: Any, tools: Any, **options: Any) -> Completion:
            return Completion(message=Message.assistant("in short: nothing yet"))

    async def in_a_map() -> tuple[int, int | None, int]:
        pool = CallPool(5)
        draw_on(pool)
        ctx = RunContext(services=RunServices(model=Condenses()))
        await _summarize(ctx, [Message.user("an old turn")])
        return pool.spent, ctx.notes.shared_calls, ctx.iteration

    assert asyncio.run(in_a_map()) == (1, 1, 1)


def test_a_call_the_log_already_holds_is_counted_never_refused() -> None:
    async def a_resumed_child_catching_up() -> tuple[str | None, int, int | None, str | None]:
        pool = CallPool(1)
        draw_on(pool)
        ctx = RunContext()
        assert take_shared_call(ctx) is None  # the one call there was
        caught_up = take_shared_call(ctx, recorded=True)  # its sibling's, made before a crash
        return caught_up, pool.spent, ctx.notes.shared_calls, take_shared_call(ctx)

    caught_up, spent, drawn, live = asyncio.run(a_resumed_child_catching_up())
    assert (caught_up, spent, drawn) == (None, 2, 2)
    assert live is not None
    assert "are spent" in live


# --- bounds: max_items, MAX_CALL_DEPTH, a failure nobody routes ----------------------------


def test_a_map_over_max_items_records_no_child_and_starts_none() -> None:
    runner = FakeRunner(lambda r: result(r.run_id))
    state = StateSpec(action="workflow.map", workflow="w", items="scratch.xs")
    default, events = context(runner, state=state, scratch={"xs": list(range(101))})
    with pytest.raises(ChildRunError, match=r"given 101 items \(scratch.xs\), more than its "
                                            r"max_items = 100: no child was started$"):  # fmt: skip
        asyncio.run(workflow_map(default))
    assert (events, runner.requests, default.notes.children_started) == ([], [], 0)

    own = StateSpec(action="workflow.map", workflow="w", items="scratch.xs", max_items=2)
    small, _ = context(runner, state=own, scratch={"xs": ["a", "b"]})
    asyncio.run(workflow_map(small))
    assert len(runner.requests) == 2


@pytest.mark.parametrize("action", ["workflow.call", "workflow.map"])
def test_calls_nest_at_most_max_call_depth_deep(action: str) -> None:
    """Each child run starts another (a call, or a map of one item) until one is refused."""
    levels: list[int] = []
    refusal: list[BaseException] = []

    async def deeper(request: ChildRequest) -> ChildResult:
        levels.append(len(levels) + 1)
        state = StateSpec(action=action, workflow="w", items="scratch.xs")
        ctx, events = context(runner, state=state, scratch={"xs": ["one"]})
        try:
            await (workflow_call if action == "workflow.call" else workflow_map)(ctx)
        except ChildRunError as exc:
            refusal.append(exc)
            assert events == []  # refused before the child was recorded
        return result(request.run_id)

    runner = type("Deeper", (), {"run": staticmethod(deeper)})()
    top, _ = context(runner, state=StateSpec(action=action, workflow="w", items="scratch.xs"),
                     scratch={"xs": ["one"]})  # fmt: skip
    asyncio.run((workflow_call if action == "workflow.call" else workflow_map)(top))

    assert levels[-1] == MAX_CALL_DEPTH  # the runs at depths 1 … 32 ran; none deeper
    (error,) = refusal
    assert str(error).endswith(
        "this run is already 32 workflow calls deep, the most calls may nest (MAX_CALL_DEPTH = 32)"
    )


def test_a_failed_child_fails_a_state_that_does_not_route_on_it() -> None:
    failing = FakeRunner(lambda r: result(r.run_id, ok=False, error="x" * 5000))
    ctx, events = context(failing, state=StateSpec(action="workflow.call", workflow="w"),
                          routed=False)  # fmt: skip
    with pytest.raises(ChildRunError) as info:
        asyncio.run(workflow_call(ctx))
    run_id = failing.requests[0].run_id
    assert str(info.value) == (
        "state 'work': its child did not succeed and no edge of the state routes child_failed; "
        f"the child run {run_id} (step) ended tool_failures: …" + "x" * 600
    )
    assert EventType.CHILD_FINISHED in [t for t, _ in events]  # its outcome is recorded first
    assert ctx.session.messages()[-1].content.startswith("The workflow 'w'")

    some = FakeRunner(lambda r: result(r.run_id, ok=r.prompt != "b", error="b broke"))
    state = StateSpec(action="workflow.map", workflow="w", items="scratch.xs")
    mapped, _ = context(some, state=state, scratch={"xs": ["a", "b", "c"]}, routed=False)
    with pytest.raises(ChildRunError, match=r"1 of 3 children did not succeed .* b broke$"):
        asyncio.run(workflow_map(mapped))
    routed, _ = context(some, state=state, scratch={"xs": ["a", "b", "c"]})
    asyncio.run(workflow_map(routed))
    assert child_failed(routed)
