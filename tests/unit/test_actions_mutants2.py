"""More built-in action behaviours that mutation testing found unpinned, each driven on a
RunContext whose model, clock and event log the test holds: what a context summary asks the
model and records (and that it draws on a map's shared calls); what agent.decide records and
charges when it asks again, fails or is retried; which calls of a parallel batch run, are
refused or cancelled, and how long each took; what a malformed reply is answered with; how a
request is fitted to the window; and the critique_passed guard, references, and the thread a
user's plain code runs on."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest

from fsm_kernel.errors import AgentConnectionError, FsmKernelError
from fsm_kernel.protocol import Completion, EventType, Message, ToolCall, ToolResult, Usage
from fsm_kernel.testing import ScriptedChatModel, ScriptedHuman, as_completion, call
from fsm_kernel.workflow import actions
from fsm_kernel.workflow.children import CallPool, draw_on
from fsm_kernel.workflow.context import RunContext, RunServices
from fsm_kernel.workflow.decide import Choice
from fsm_kernel.workflow.human import HumanAnswer
from fsm_kernel.workflow.output import OutputSchema
from fsm_kernel.workflow.spec import ContextSpec, Limits, StateSpec
from fsm_kernel.workflow.window import Summary, estimate_tokens

STEP = 0.01234
"""How far the test clock moves at each reading: every call lasts 12.34 ms, recorded 12.3."""
LATENCY = 12.3
USED = Usage(prompt_tokens=7, completion_tokens=3, total_tokens=10)


class TickingClock:
    """A clock whose monotonic time moves on by STEP seconds each time it is read."""

    def __init__(self) -> None:
        self.mono = 100.0

    def now(self) -> Any:
        raise AssertionError("actions time their calls with monotonic()")

    def monotonic(self) -> float:
        self.mono += STEP
        return self.mono - STEP


class Log:
    """The events a run records, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[EventType, dict[str, Any]]] = []

    def __call__(self, type_: EventType, data: dict[str, Any]) -> None:
        self.events.append((type_, data))

    def of(self, type_: EventType) -> list[dict[str, Any]]:
        return [data for t, data in self.events if t is type_]


def context(model: Any, log: Log, **values: Any) -> RunContext:
    services = RunServices(model=model, clock=TickingClock(), record=log)
    return RunContext(services=services, current_state="work", **values)


def run_in(pool: CallPool | None, action: Coroutine[Any, Any, Any]) -> Any:
    """Run an action in a task drawing on `pool` (as a map's child does)."""

    async def main() -> Any:
        draw_on(pool)
        return await action

    return asyncio.run(main())


# --- context summaries ---------------------------------------------------------------------

OLDER = [
    Message.user("Find the café's address."),
    Message.assistant(
        "",
        [
            ToolCall(id="s1", name="search", arguments={"q": "café Zoë"}),
            ToolCall(id="o1", name="open", arguments={"n": 2}),
        ],
    ),
    Message.tool(ToolCall(id="s1", name="search"), ToolResult(content="Rue 1")),
]


def test_a_summary_asks_the_model_to_condense_the_older_turns_and_records_its_reply() -> None:
    model = ScriptedChatModel(
        [Completion(message=Message.assistant("  Zoë's café is at Rue 1.  "), usage=USED)]
    )
    log = Log()
    window = ContextSpec(max_tokens=4_000, strategy="summarize", keep=1)
    ctx = context(
        model, log, context_window=window, iteration=4, context_summary=Summary(2, "Earlier.")
    )
    pool = CallPool(10)

    run_in(pool, actions._summarize(ctx, OLDER))

    (request,) = model.requests
    assert request.tools == ()
    assert [(m.role.value, m.content) for m in request.messages] == [
        ("system", actions._SUMMARIZE.format(words=200)),
        (
            "user",
            "Summary so far: Earlier.\n\nuser: Find the café's address.\n\n"
            'assistant:  [calls search({"q": "café Zoë"})] [calls open({"n": 2})]\n\n'
            "tool: Rue 1",
        ),
    ]
    assert "at most 200 words" in request.messages[0].content
    assert log.of(EventType.MODEL_REQUESTED) == [
        {"messages": 2, "tools": [], "purpose": "summarize"}
    ]
    (responded,) = log.of(EventType.MODEL_RESPONDED)
    assert (responded["latency_ms"], responded["purpose"]) == (LATENCY, "summarize")
    assert log.of(EventType.CONTEXT_TRIMMED) == [
        {
            "strategy": "summarize",
            "summarized_messages": 3,
            "covered_messages": 5,
            "summary_chars": len("Zoë's café is at Rue 1."),
        }
    ]
    assert log.of(EventType.ITERATION_COMPLETED) == [
        {
            "step": 5, "decision": "summarize", "answer": "Zoë's café is at Rue 1.",
            "tools": [], "error": None, "summary": "", "next_state": "work",
        }
    ]  # fmt: skip
    assert (ctx.iteration, ctx.notes.recorded_iteration) == (5, 5)
    assert ctx.context_summary == Summary(5, "Zoë's café is at Rue 1.")
    assert ctx.usage == USED
    assert (pool.spent, ctx.notes.shared_calls) == (1, 1)  # a map's shared calls pay for it


def test_a_first_summary_covers_only_the_turns_it_condensed() -> None:
    model = ScriptedChatModel(["The user asked for the café."])
    log = Log()
    window = ContextSpec(max_tokens=4_000, strategy="summarize", keep=1)
    ctx = context(model, log, context_window=window)

    run_in(None, actions._summarize(ctx, OLDER[:1]))

    assert model.requests[0].messages[1].content == "user: Find the café's address."
    assert ctx.context_summary == Summary(1, "The user asked for the café.")
    assert ctx.notes.shared_calls is None  # no map: nothing drawn


def test_a_summary_request_too_long_for_the_window_is_cut_to_fit_it() -> None:
    model = ScriptedChatModel(["Short."])
    log = Log()
    window = ContextSpec(max_tokens=256, strategy="summarize", keep=1)
    ctx = context(model, log, context_window=window)
    older = [Message.user("word " * 2_000)]

    run_in(None, actions._summarize(ctx, older))

    sent = model.requests[0].messages
    assert (
        estimate_tokens(sent) <= 256 < estimate_tokens([*sent[:1], Message.user("word " * 2_000)])
    )


def test_a_summary_the_model_fails_is_recorded_as_a_failed_summarize_call() -> None:
    failure = AgentConnectionError("server down")
    model = ScriptedChatModel([failure])
    log = Log()
    window = ContextSpec(max_tokens=4_000, strategy="summarize", keep=1)
    ctx = context(model, log, context_window=window)

    with pytest.raises(AgentConnectionError):
        run_in(None, actions._summarize(ctx, OLDER))

    assert log.of(EventType.MODEL_FAILED) == [{"error": failure.to_dict(), "purpose": "summarize"}]
    assert log.of(EventType.MODEL_RESPONDED) == []


# --- parallel tool calls -------------------------------------------------------------------


class Tools:
    """Tools answering at once with their call's arguments; "hang" waits until cancelled (and
    takes a while to clean up) and "crash" raises (a tool executor failing for good)."""

    def __init__(self) -> None:
        self.ran: list[str] = []
        self.cancelled: list[str] = []

    def list_tools(self, names: Any = None) -> list[Any]:
        return []

    async def execute(self, call: ToolCall) -> ToolResult:
        self.ran.append(call.id)
        if call.name == "hang":
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                await asyncio.sleep(0.01)  # cleaning up takes a while
                self.cancelled.append(call.id)
                raise
        if call.name == "crash":
            await asyncio.sleep(0)  # the other calls have started by now
            raise RuntimeError("the tool server went away")
        return ToolResult(content=f"{call.name} {call.arguments}")


def batch(*calls: ToolCall) -> Completion:
    return Completion(message=Message.assistant("", calls))


def test_a_call_rejected_in_a_parallel_batch_does_not_run_and_the_others_are_timed() -> None:
    deploy = ToolCall(id="d1", name="deploy", arguments={"env": "prod"})
    a, b = ToolCall(id="a1", name="read", arguments={"n": 1}), ToolCall(id="b1", name="list")
    tools, log = Tools(), Log()
    services = RunServices(
        tools=tools, clock=TickingClock(), record=log, human=ScriptedHuman([HumanAnswer.reject()])
    )
    ctx = RunContext(
        services=services,
        current_state="act",
        parallel_tool_calls=True,
        approval_required=frozenset({"deploy"}),
        iteration=3,
        last_completion=batch(a, deploy, b),
    )

    asyncio.run(actions.tools_execute(ctx))

    assert tools.ran == ["a1", "b1"]
    refused = ToolResult(
        content="rejected by the user: no reason given", is_error=True, error_type="Rejected"
    )
    assert log.of(EventType.TOOL_FINISHED) == [
        {"call": a.to_dict(), "result": {"content": "read {'n': 1}", "is_error": False},
         "duration_ms": LATENCY},
        {"call": b.to_dict(), "result": {"content": "list {}", "is_error": False},
         "duration_ms": LATENCY},
        {"call": deploy.to_dict(), "result": refused.to_dict(), "duration_ms": 0.0},
    ]  # fmt: skip
    assert [(r.iteration, r.call.id, r.result.content, r.duration_ms) for r in ctx.tool_calls] == [
        (3, "a1", "read {'n': 1}", LATENCY),
        (3, "d1", refused.content, 0.0),
        (3, "b1", "list {}", LATENCY),
    ]
    assert ctx.last_results == ctx.tool_calls
    sent = ctx.session.messages()
    assert [(m.tool_call_id, m.content) for m in sent] == [
        ("a1", "read {'n': 1}"),
        ("d1", refused.content),
        ("b1", "list {}"),
    ]
    assert ctx.failure_streak == 0  # a person's no is not a failing tool


def test_a_parallel_call_that_fails_for_good_cancels_the_others_before_the_error_is_raised() -> (
    None
):
    tools, log = Tools(), Log()
    services = RunServices(tools=tools, clock=TickingClock(), record=log)
    calls = (ToolCall(id="h1", name="hang"), ToolCall(id="x1", name="crash"))
    ctx = RunContext(
        services=services,
        current_state="act",
        parallel_tool_calls=True,
        last_completion=batch(*calls),
    )

    async def main() -> list[str]:
        with pytest.raises(RuntimeError, match="the tool server went away"):
            await actions.tools_execute(ctx)
        return list(tools.cancelled)  # the cancelled calls have cleaned up by now

    assert asyncio.run(main()) == ["h1"]
    assert [e["call"]["id"] for e in log.of(EventType.TOOL_STARTED)] == ["h1", "x1"]
    assert log.of(EventType.TOOL_FINISHED) == []
    assert ctx.tool_calls == []


# --- agent.decide --------------------------------------------------------------------------

LOOK, WRITE = "look it up", "write the résumé"


def pick(choice: str, id: str) -> Completion:
    return call("choose", {"choice": choice}, id=id)


def deciding(
    model: Any, log: Log, *, prompt: str | None = "What next?", **values: Any
) -> RunContext:
    """A context in the agent.decide state `route`, whose two choices are both legal."""
    choices = [
        Choice(index=0, text=LOOK, target="research", holds=lambda ctx: True),
        Choice(index=1, text=WRITE, target="write", holds=lambda ctx: True),
    ]
    services = RunServices(model=model, clock=TickingClock(), record=log)
    values.setdefault("choices", {"route": choices})
    values.setdefault("limits", Limits(max_malformed_outputs=3))
    return RunContext(
        services=services,
        current_state="route",
        state_spec=StateSpec(action="agent.decide", prompt=prompt),
        **values,
    )


def test_agent_decide_asks_again_after_an_illegal_pick_charging_a_maps_shared_calls() -> None:
    model = ScriptedChatModel([pick("dance", "c1"), pick(LOOK, "c2")])
    log = Log()
    ctx = deciding(model, log, malformed_streak=0)
    pool = CallPool(10)

    run_in(pool, actions.agent_decide(ctx))

    assert (ctx.choice, ctx.iteration, ctx.malformed_streak, ctx.malformed_reason) == (
        LOOK, 2, 0, None
    )  # fmt: skip
    assert (pool.spent, ctx.notes.shared_calls) == (1, 1)  # the kernel took the first call
    assert [e["latency_ms"] for e in log.of(EventType.MODEL_RESPONDED)] == [LATENCY, LATENCY]
    assert [r["next_state"] for r in log.of(EventType.ITERATION_COMPLETED)] == ["route", "research"]
    assert ctx.notes.recorded_iteration == 2


def test_agent_decide_gives_up_unpicked_after_max_malformed_outputs_in_a_row() -> None:
    model = ScriptedChatModel([pick("dance", "c1"), "I would look.", pick("sing", "c3")])
    log = Log()
    ctx = deciding(model, log)

    run_in(None, actions.agent_decide(ctx))

    assert (ctx.choice, ctx.iteration, ctx.malformed_streak) == (None, 3, 3)
    assert model.remaining == 0


def test_a_retried_agent_decide_repeats_neither_its_prompt_nor_its_iteration() -> None:
    model = ScriptedChatModel([pick("dance", "c1"), pick(WRITE, "c2")])
    log = Log()
    ctx = deciding(model, log, attempt=2, iteration=4)
    ctx.session.add(Message.user("Capital of France?"))

    run_in(None, actions.agent_decide(ctx))

    assert log.of(EventType.MESSAGE_ADDED)[0]["message"]["role"] == "tool"  # no prompt again
    assert log.of(EventType.MODEL_REQUESTED) == [
        {"messages": 1, "tools": ["choose"], "choices": [LOOK, WRITE], "attempt": 2},
        {"messages": 3, "tools": ["choose"], "choices": [LOOK, WRITE]},  # a new iteration
    ]
    assert (ctx.iteration, ctx.choice) == (5, WRITE)


def test_agent_decide_in_a_state_without_a_prompt_adds_no_message() -> None:
    model = ScriptedChatModel([pick(LOOK, "c1")])
    log = Log()
    ctx = deciding(model, log, prompt=None)
    ctx.session.add(Message.user("Capital of France?"))

    run_in(None, actions.agent_decide(ctx))

    assert [m.content for m in model.requests[0].messages] == ["Capital of France?"]


def test_agent_decide_with_no_choices_declared_asks_nothing_and_clears_the_last_pick() -> None:
    model = ScriptedChatModel([])
    ctx = deciding(model, Log(), choices={}, choice=LOOK)

    run_in(None, actions.agent_decide(ctx))

    assert (ctx.choice, ctx.offered_choices, model.requests) == (None, (), [])


def test_a_model_failure_during_a_pick_is_recorded_and_raised() -> None:
    failure = AgentConnectionError("server down")
    log = Log()
    ctx = deciding(ScriptedChatModel([failure]), log)

    with pytest.raises(AgentConnectionError):
        run_in(None, actions.agent_decide(ctx))

    assert log.of(EventType.MODEL_FAILED) == [{"error": failure.to_dict()}]
    assert log.of(EventType.MODEL_RESPONDED) == []


def test_agent_decide_without_a_model_says_it_needs_one() -> None:
    ctx = deciding(None, Log())
    with pytest.raises(FsmKernelError) as raised:
        run_in(None, actions.agent_decide(ctx))
    assert str(raised.value) == "agent.decide needs a model, but the run has none"


# --- malformed replies and human input -----------------------------------------------------


def test_a_call_of_a_tool_not_offered_is_answered_with_why_and_recorded_as_malformed() -> None:
    log = Log()
    ctx = context(None, log, iteration=2)
    reply = call("deploy", {"env": "prod"}, id="d1")

    actions.apply_completion(ctx, reply, {"read_file"}, None)

    (finished,) = log.of(EventType.TOOL_FINISHED)
    assert finished == {
        "call": reply.message.tool_calls[0].to_dict(),
        "result": {
            "content": "error: your reply was not executed: tool 'deploy' was not offered "
            "(offered: read_file). Reply again with valid tool calls, or answer without tools.",
            "is_error": True,
            "error_type": "MalformedOutput",
        },
        "duration_ms": 0.0,
        "malformed": True,
    }
    assert [(r.iteration, r.duration_ms) for r in ctx.tool_calls] == [(2, 0.0)]
    assert ctx.malformed_streak == 1


def test_a_reply_failing_the_output_schema_is_shown_the_schema_as_written() -> None:
    log = Log()
    schema = OutputSchema.resolve(
        {"type": "object", "properties": {"café": {"type": "string"}}, "required": ["café"]}
    )
    ctx = context(None, log, outputs={"work": schema})
    reply = as_completion("not JSON")

    actions.apply_completion(ctx, reply, set(), schema.check_reply(reply))

    (added,) = log.of(EventType.MESSAGE_ADDED)
    assert added["message"]["content"].endswith(
        '\n{"type": "object", "properties": {"café": {"type": "string"}}, "required": ["café"]}'
    )


def test_human_input_without_a_prompt_asks_for_your_input() -> None:
    human = ScriptedHuman([HumanAnswer.input("Paris")])
    services = RunServices(human=human, record=Log())
    ctx = RunContext(services=services, current_state="ask", state_spec=StateSpec())

    asyncio.run(actions.human_input(ctx))

    assert [(q.kind, q.state, q.prompt) for q in human.questions] == [
        ("input", "ask", "Your input?")
    ]
    assert [m.content for m in ctx.session.messages()] == ["Paris"]


# --- guards, references and users' code ----------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "passed"),
    [
        ("PASS", True),
        ("**Passed.** All good.", True),
        ("Approved: ship it", True),
        ("PASSX", False),  # only punctuation and emphasis around the first word are ignored
        ("Passing so far", False),
        ("", False),
    ],
)
def test_critique_passed_holds_when_the_reply_starts_with_pass_passed_or_approved(
    reply: str, passed: bool
) -> None:
    ctx = RunContext(last_completion=as_completion(reply))
    assert actions.critique_passed(ctx) is passed


def test_a_reference_names_its_module_before_the_first_colon_and_may_name_nested_attributes() -> (
    None
):
    import os.path

    assert actions.resolve_ref("os:path.join") is os.path.join
    with pytest.raises(actions.RefError) as raised:
        actions.resolve_ref("json:dumps:x")
    assert raised.value.message == "module 'json' has no attribute 'dumps:x'"


def returns_a_coroutine(ctx: RunContext) -> Coroutine[Any, Any, None]:
    """A user's plain action that hands back a coroutine: the kernel awaits it."""

    async def later() -> None:
        ctx.scratch["ran"] = "later"

    return later()


def test_a_users_plain_action_that_returns_a_coroutine_has_it_awaited() -> None:
    action = actions.resolve_action(f"{__name__}:returns_a_coroutine")
    ctx = RunContext()

    asyncio.run(action(ctx))

    assert ctx.scratch == {"ran": "later"}


def test_user_code_without_a_name_runs_on_a_daemon_thread_named_user_code() -> None:
    import functools
    import threading

    def where(prefix: str) -> tuple[str, bool]:
        thread = threading.current_thread()
        return f"{prefix}{thread.name}", thread.daemon

    unnamed = functools.partial(where, "on ")  # a partial has no __qualname__

    assert asyncio.run(actions.in_thread(unnamed)) == ("on fsm-kernel: user code", True)


def test_a_request_is_fitted_to_the_window_by_at_most_four_times_the_estimate() -> None:
    log = Log()
    window = ContextSpec(max_tokens=256, strategy="drop_oldest", keep=1)
    last = Completion(message=Message.assistant("x"), usage=Usage(prompt_tokens=1_000))
    ctx = context(
        None,
        log,
        context_window=window,
        system_prompt="You help.",
        last_completion=last,
        last_request_estimate=100,  # the server counted ten times the estimate: 4x is used
    )
    turns = ["Capital?", "a" * 200, "More.", "b" * 200, "Go on."]
    for i, text in enumerate(turns):
        ctx.session.add(Message.user(text) if i % 2 == 0 else Message.assistant(text))
    estimated = estimate_tokens(ctx.messages_for_model())

    sent = asyncio.run(actions._within_window(ctx, ctx.messages_for_model()))

    assert [m.content for m in sent] == ["You help.", "Capital?", "Go on."]
    assert log.events == [
        (
            EventType.CONTEXT_TRIMMED,
            {
                "strategy": "drop_oldest",
                "estimated_tokens_before": estimated * 4,
                "estimated_tokens_after": 76,
                "shortened_tool_results": [],
                "dropped_messages": 3,
            },
        )
    ]
    assert ctx.last_request_estimate == estimate_tokens(sent)


def test_an_illegal_pick_is_told_every_choice_as_written_and_its_record_keeps_200_chars() -> None:
    wrong = "z" * 250
    model = ScriptedChatModel([pick(wrong, "c1"), pick(WRITE, "c2")])
    log = Log()
    ctx = deciding(model, log)

    run_in(None, actions.agent_decide(ctx))

    first = log.of(EventType.ITERATION_COMPLETED)[0]
    assert first["error"].endswith(f'is not one of the offered choices ("{LOOK}", "{WRITE}")')
    told = (
        f'error: not accepted: {first["error"]}. Call choose again with one of: "{LOOK}"; "{WRITE}"'
    )
    assert model.requests[1].messages[-1].content == told
    assert first["tools"] == [
        {"id": "c1", "name": "choose", "input": {"choice": wrong}, "output": told[:200],
         "is_error": True},
    ]  # fmt: skip
    assert len(told) > 200
