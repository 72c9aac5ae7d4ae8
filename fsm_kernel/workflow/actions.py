"""The built-in vocabulary of actions and guards, and resolution of `package.module:function`
references to users' own.

An action is `async def action(ctx: RunContext) -> None` (a plain function works too); it runs
when its state is entered. A guard is `def guard(ctx: RunContext) -> bool`, pure and fast: it
decides which transition fires. Actions raise AgentError when the model server fails; any other
exception ends the run with reason `error` (unless the state's `retry:`/`catch:` handles it,
see recovery.py).
"""

from __future__ import annotations

import asyncio
import contextvars
import importlib
import inspect
import json
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fsm_kernel.errors import AgentError, FsmKernelError
from fsm_kernel.protocol import Completion, EventType, Message, ToolCall, ToolResult
from fsm_kernel.tools import DONE_TOOL
from fsm_kernel.workflow.children import (
    charge_shared_calls,
    child_failed,
    child_succeeded,
    workflow_call,
    workflow_map,
)
from fsm_kernel.workflow.context import RunContext, ToolCallRecord
from fsm_kernel.workflow.decide import CHOOSE, choose_tool, legal_choices, pick_of
from fsm_kernel.workflow.human import HumanAnswer, Question
from fsm_kernel.workflow.limits import budget_exceeded, limit_reached
from fsm_kernel.workflow.spec import COMPLETED
from fsm_kernel.workflow.window import Summary, estimate_tokens, fit, summarized, to_condense

if TYPE_CHECKING:
    from fsm_kernel.workflow.output import ReplyCheck

__all__ = [
    "BUILTIN_ACTIONS",
    "BUILTIN_GUARDS",
    "ActionDef",
    "GuardFn",
    "RefError",
    "in_thread",
    "is_truncated",
    "iteration_record",
    "resolve_action",
    "resolve_guard",
    "resolve_ref",
]

GuardFn = Callable[[RunContext], bool]
ActionFn = Callable[[RunContext], Awaitable[None] | None]


class RefError(FsmKernelError):
    """A `package.module:function` reference that cannot be imported."""


@dataclass(frozen=True)
class ActionDef:
    """A resolved action: the callable and whether it calls the model (counts an iteration)."""

    name: str
    fn: ActionFn
    calls_model: bool = False
    starts_children: bool = False
    """It starts child runs (workflow.call, workflow.map): the kernel checks the iteration and
    token limits first, as before a model call."""
    user_code: bool = False
    """A user's action (`package.module:function`): it may have done anything a resume must
    not redo, so the kernel commits its step as soon as it ends (see RunRecorder.end_step)."""

    async def __call__(self, ctx: RunContext) -> None:
        result = self.fn(ctx)
        if inspect.isawaitable(result):
            await result


async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` on a daemon thread of its own, awaited without blocking the event loop.

    Users' plain functions (actions, guards) run this way, so one that blocks cannot hold the
    loop: the run's deadline and Ctrl-C still fire on time. A thread that never returns cannot
    be killed; being a daemon, it does not keep the process alive once the run has ended.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    context = contextvars.copy_context()  # the run id of log lines, as on the loop

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # the run stopped waiting (deadline, cancellation)
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def work() -> None:
        try:
            outcome: tuple[Any, BaseException | None] = (context.run(fn, *args), None)
        except BaseException as exc:  # handed to the awaiting task, which re-raises it
            outcome = (None, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop closed while the code ran: nobody is waiting
            pass

    name = getattr(fn, "__qualname__", "user code")
    threading.Thread(target=work, name=f"fsm-kernel: {name}", daemon=True).start()
    return await future


def _threaded(fn: ActionFn) -> ActionFn:
    """A user's action: coroutine functions run on the loop, plain functions in a thread."""
    if inspect.iscoroutinefunction(fn):
        return fn

    async def run_in_thread(ctx: RunContext) -> None:
        result = await in_thread(fn, ctx)
        if inspect.isawaitable(result):
            await result

    return run_in_thread


# --- actions -----------------------------------------------------------------------------


async def session_observe(ctx: RunContext) -> None:
    """Start an iteration: forget the previous step's tool results."""
    ctx.last_results = []


def _malformed_reason(completion: Completion, offered: set[str]) -> str | None:
    for call in completion.message.tool_calls:
        if call.arguments_error is not None:
            return (
                f"tool call {call.name!r} has arguments that are not JSON: {call.arguments_error}"
            )
        if call.name not in offered:
            known = ", ".join(sorted(offered)) or "none"
            return f"tool {call.name!r} was not offered (offered: {known})"
    return None


def _refuse_malformed(ctx: RunContext, completion: Completion, reason: str) -> None:
    """Answer every call of a malformed reply with an error (a text reply that fails the output
    schema: with a user message saying why), so the model can retry."""
    if not completion.message.tool_calls:
        _ask_again(ctx, reason)
        return
    for call in completion.message.tool_calls:
        result = ToolResult(
            content=f"error: your reply was not executed: {reason}. Reply again with valid "
            "tool calls, or answer without tools.",
            is_error=True,
            error_type="MalformedOutput",
        )
        _add_tool_result(ctx, call, result, duration_ms=0.0, malformed=True)


def _ask_again(ctx: RunContext, reason: str) -> None:
    schema = ctx.output_schema
    shown = json.dumps(schema.schema, ensure_ascii=False) if schema is not None else "{}"
    message = Message.user(
        f"Your reply was not accepted: {reason}. Reply again with only a JSON value that "
        f"matches this JSON Schema:\n{shown}"
    )
    ctx.add_message(message)


async def agent_think(ctx: RunContext) -> None:
    """Ask the model, with the conversation so far and the tools this state offers."""
    if ctx.model is None:
        raise FsmKernelError("agent.think needs a model, but the run has none")
    retrying = ctx.attempt > 1  # a `retry:` of this call: same prompt, same iteration
    if ctx.state_spec.prompt and not retrying:
        message = Message.user(ctx.state_spec.prompt)
        ctx.add_message(message)
    offered = ctx.offered_tools()
    messages = await _within_window(ctx, ctx.messages_for_model())
    options = _request_options(ctx)
    if not retrying:
        ctx.iteration += 1
    requested: dict[str, Any] = {"messages": len(messages), "tools": [t.name for t in offered]}
    if retrying:
        requested["attempt"] = ctx.attempt
    if "response_format" in options:
        requested["output"] = options["response_format"].name
    ctx.record(EventType.MODEL_REQUESTED, requested)
    await ctx.flush()  # before waiting on the model, the log shows what the run is waiting for
    started = ctx.clock.monotonic()
    try:
        completion = await ctx.model.complete(messages, offered, **options)
    except AgentError as exc:  # retried, caught or the end of the run; the log says which call
        ctx.record(EventType.MODEL_FAILED, {"error": exc.to_dict()})
        raise
    latency_ms = round((ctx.clock.monotonic() - started) * 1000, 1)
    ctx.record(
        EventType.MODEL_RESPONDED, {"completion": completion.to_dict(), "latency_ms": latency_ms}
    )
    apply_completion(ctx, completion, {t.name for t in offered}, await _checked(ctx, completion))


async def agent_decide(ctx: RunContext) -> None:
    """Let the model choose the next edge: offer it the state's `choice:` edges whose guards
    hold, as the one tool `choose` (forced, its argument an enum of their texts), and keep its
    pick in `ctx.choice`, which the machine's choice edges test (see workflow/decide.py).

    When no choice is legal the model is not asked and the state's fallback edge fires. An
    illegal pick is malformed output: answered with why and asked again, each reply a model
    call and an iteration, until `limits.max_malformed_outputs` malformed replies in a row (or
    another limit) leave it unpicked. The last reply of agent.think (`last_completion`, which
    has_answer, has_tool_calls and tools.execute read) is left as it was."""
    if ctx.model is None:
        raise FsmKernelError("agent.decide needs a model, but the run has none")
    retrying = ctx.attempt > 1  # a `retry:` of this call: same prompt, same iteration
    ctx.choice = None
    ctx.offered_choices = await _legal_choices(ctx)
    if not ctx.offered_choices:
        return
    if ctx.state_spec.prompt and not retrying:
        ctx.add_message(Message.user(ctx.state_spec.prompt))
    while not await _ask_choice(ctx, retrying=retrying):
        retrying = False
        if limit_reached(ctx, model_call_next=True) is not None:
            return  # malformed until the retries ran out, or another limit: no pick
        charge_shared_calls(1, ctx)  # the kernel took the first call from a map's pool


async def _legal_choices(ctx: RunContext) -> tuple[str, ...]:
    """The choices whose guards hold, tested in a thread when a user's guard is among them."""
    if any(c.user_code for c in ctx.choices.get(ctx.current_state, ())):
        legal: tuple[str, ...] = await in_thread(legal_choices, ctx)
        return legal
    return legal_choices(ctx)


async def _ask_choice(ctx: RunContext, *, retrying: bool) -> bool:
    """One request for a pick, recorded like agent.think's; whether the reply picked."""
    model = ctx.model
    assert model is not None
    offered = ctx.offered_choices
    messages = await _within_window(ctx, ctx.messages_for_model())
    if not retrying:
        ctx.iteration += 1
    requested: dict[str, Any] = {"messages": len(messages), "tools": [CHOOSE]}
    requested["choices"] = list(offered)
    if retrying:
        requested["attempt"] = ctx.attempt
    ctx.record(EventType.MODEL_REQUESTED, requested)
    await ctx.flush()
    started = ctx.clock.monotonic()
    try:
        forced: dict[str, Any] = {"tool_choice": CHOOSE}  # a keyword a ChatModel may take
        completion = await model.complete(messages, [choose_tool(offered)], **forced)
    except AgentError as exc:
        ctx.record(EventType.MODEL_FAILED, {"error": exc.to_dict()})
        raise
    latency_ms = round((ctx.clock.monotonic() - started) * 1000, 1)
    ctx.record(
        EventType.MODEL_RESPONDED, {"completion": completion.to_dict(), "latency_ms": latency_ms}
    )
    return _take_pick(ctx, completion)


def _take_pick(ctx: RunContext, completion: Completion) -> bool:
    """Fold a reply to agent.decide into the run: the pick, or why it is malformed (the model
    is told, in the conversation, as for agent.think); its iteration's record."""
    ctx.usage = ctx.usage + completion.usage
    ctx.session.add(completion.message)
    pick, problem = pick_of(completion, ctx.offered_choices)
    ctx.choice, ctx.malformed_reason = pick, problem
    ctx.malformed_streak = 0 if problem is None else ctx.malformed_streak + 1
    tools = _answer_pick(ctx, completion, problem)
    chosen = [c.target for c in ctx.choices.get(ctx.current_state, ()) if c.text == pick]
    record = iteration_record(
        ctx.iteration,
        "choice" if problem is None else "malformed",
        next_state=chosen[0] if chosen else ctx.current_state,
        tools=tools,
        error=problem,
    )
    record["choice"] = pick
    ctx.record(EventType.ITERATION_COMPLETED, record)
    ctx.notes.recorded_iteration = ctx.iteration  # the kernel's next record is the next one
    return pick is not None


def _answer_pick(ctx: RunContext, completion: Completion, problem: str | None) -> list[Any]:
    """Answer each call of the reply (the pick taken, or why not and what to pick from), or a
    text reply with a user message; the calls as the iteration's record lists them."""
    listed = "; ".join(json.dumps(text, ensure_ascii=False) for text in ctx.offered_choices)
    said = f"chosen: {ctx.choice}"
    if problem is not None:
        said = f"error: not accepted: {problem}. Call {CHOOSE} again with one of: {listed}"
    calls = completion.message.tool_calls
    if not calls:
        ask = f"Your reply was not accepted: {problem}. Call {CHOOSE} with one of: {listed}"
        ctx.add_message(Message.user(ask))
    tools = []
    for call in calls:
        result = ToolResult(content=said, is_error=problem is not None)
        ctx.add_message(Message.tool(call, result))
        tools.append(
            {
                "id": call.id,
                "name": call.name,
                "input": call.arguments,
                "output": said[:200],
                "is_error": result.is_error,
            }
        )
    return tools


async def _checked(ctx: RunContext, completion: Completion) -> ReplyCheck | None:
    """The reply checked against the state's output schema, if it has one. A schema with
    `pattern`s is checked in a process of its own (see `OutputSchema`): waited for off the
    event loop, so the other runs of this process go on meanwhile."""
    schema = ctx.output_schema
    if schema is None:
        return None
    if schema.patterns:
        return await asyncio.to_thread(schema.check_reply, completion)
    return schema.check_reply(completion)


async def _within_window(ctx: RunContext, request: Sequence[Message]) -> Sequence[Message]:
    """The request made to fit the workflow's `context:` window (recorded when changed)."""
    window = ctx.context_window
    if window is None:
        return request
    messages = list(request)
    scale = 1.0  # how far off the estimate of the last request was, by the server's count
    reported = ctx.last_completion.usage.prompt_tokens if ctx.last_completion else 0
    if reported > 0 and ctx.last_request_estimate > 0:
        scale = min(max(reported / ctx.last_request_estimate, 0.5), 4.0)
    if window.strategy == "summarize":
        older = to_condense(messages, window, ctx.context_summary, scale)
        if older:
            await _summarize(ctx, older)
        messages = summarized(messages, ctx.context_summary)
    fitted = fit(messages, window, scale)
    ctx.last_request_estimate = estimate_tokens(fitted.messages)
    if fitted.changed:
        ctx.record(EventType.CONTEXT_TRIMMED, fitted.to_dict(window.strategy))
    return fitted.messages


_SUMMARIZE = (
    "Condense the conversation below into a summary the assistant can continue from: the "
    "facts found, what was done and with which tools, what is still open. Plain text, at most "
    "{words} words; no preamble."
)
_SUMMARY_WORDS = 200


async def _summarize(ctx: RunContext, older: Sequence[Message]) -> None:
    """One model call condenses `older` (with the summary so far) into the run's new summary:
    it counts as an iteration and is recorded (model.requested with `purpose: summarize`, then
    the reply), so a resume or a replay serves it from the log like any answer."""
    model = ctx.model
    assert model is not None
    previous = ctx.context_summary
    lines = [f"Summary so far: {previous.text}"] if previous else []
    for m in older:
        calls = "".join(
            f" [calls {c.name}({json.dumps(c.arguments, ensure_ascii=False)})]"
            for c in m.tool_calls
        )
        lines.append(f"{m.role.value}: {m.content}{calls}")
    request = [
        Message.system(_SUMMARIZE.format(words=_SUMMARY_WORDS)),
        Message.user("\n\n".join(lines)),
    ]
    if ctx.context_window is not None:  # this request keeps to the window too
        request = fit(request, ctx.context_window).messages
    ctx.iteration += 1
    charge_shared_calls(1, ctx)
    ctx.record(
        EventType.MODEL_REQUESTED,
        {"messages": len(request), "tools": [], "purpose": "summarize"},
    )
    await ctx.flush()
    started = ctx.clock.monotonic()
    try:
        completion = await model.complete(request, [])
    except AgentError as exc:
        ctx.record(EventType.MODEL_FAILED, {"error": exc.to_dict(), "purpose": "summarize"})
        raise
    latency_ms = round((ctx.clock.monotonic() - started) * 1000, 1)
    ctx.record(
        EventType.MODEL_RESPONDED,
        {"completion": completion.to_dict(), "latency_ms": latency_ms, "purpose": "summarize"},
    )
    ctx.usage = ctx.usage + completion.usage
    covered = (previous.covered if previous else 0) + len(older)
    ctx.context_summary = Summary(covered, completion.message.content.strip())
    ctx.record(
        EventType.CONTEXT_TRIMMED,
        {
            "strategy": "summarize",
            "summarized_messages": len(older),
            "covered_messages": covered,
            "summary_chars": len(ctx.context_summary.text),
        },
    )
    record = iteration_record(
        ctx.iteration,
        "summarize",
        next_state=ctx.current_state,
        answer=ctx.context_summary.text[:ANSWER_SHOWN],
    )
    ctx.record(EventType.ITERATION_COMPLETED, record)
    ctx.notes.recorded_iteration = ctx.iteration  # the kernel's next record is the next one


ANSWER_SHOWN = 500
"""The characters of an answer an `iteration.completed` record keeps."""


def iteration_record(
    step: int,
    decision: str,
    *,
    next_state: str,
    answer: str = "",
    tools: Sequence[dict[str, Any]] = (),
    error: str | None = None,
    summary: str = "",
) -> dict[str, Any]:
    """The data of an `iteration.completed` event: every iteration's record has these fields
    (`decision`: tool_calls, answer, malformed, failed or summarize)."""
    return {
        "step": step,
        "decision": decision,
        "answer": answer,
        "tools": list(tools),
        "error": error,
        "summary": summary,
        "next_state": next_state,
    }


def _request_options(ctx: RunContext) -> dict[str, Any]:
    """The keywords of `complete()` this state sets, and only those: a user's model need not
    know them (see ChatModel)."""
    options: dict[str, Any] = {}
    if ctx.state_spec.tool_choice is not None:
        options["tool_choice"] = ctx.state_spec.tool_choice
    schema = ctx.output_schema
    if schema is not None:
        options["response_format"] = schema.response_format()
    return options


def apply_completion(
    ctx: RunContext, completion: Completion, offered: set[str], check: ReplyCheck | None
) -> None:
    """Fold a model answer into the context (shared by live runs and resume): a reply whose
    answer fails the state's output schema (`check`, None without one) is malformed, like a
    call of a tool not offered."""
    ctx.last_completion = completion
    ctx.completion_iteration = ctx.iteration
    ctx.usage = ctx.usage + completion.usage
    ctx.session.add(completion.message)
    ctx.last_output = check.value if check is not None else None
    ctx.output_error = check.problem if check is not None else None
    ctx.malformed_reason = _malformed_reason(completion, offered) or ctx.output_error
    if ctx.malformed_reason is not None:
        ctx.malformed_streak += 1
        _refuse_malformed(ctx, completion, ctx.malformed_reason)
        return
    ctx.malformed_streak = 0
    if not completion.message.tool_calls and ctx.state_spec.answer:
        ctx.answer = completion.message.content
        ctx.output = ctx.last_output


def _add_tool_result(
    ctx: RunContext, call: ToolCall, result: ToolResult, *, duration_ms: float, malformed: bool
) -> None:
    data: dict[str, Any] = {
        "call": call.to_dict(),
        "result": result.to_dict(),
        "duration_ms": duration_ms,
    }
    if malformed:
        data["malformed"] = True
    ctx.record(EventType.TOOL_FINISHED, data)
    ctx.session.add(Message.tool(call, result))
    record = ToolCallRecord(
        iteration=ctx.iteration, call=call, result=result, duration_ms=duration_ms
    )
    ctx.tool_calls.append(record)
    ctx.last_results.append(record)


_NOT_RUN = "TooManyToolCalls"
"""error_type of a call refused for limits.max_tool_calls_per_reply."""
_REJECTED = "Rejected"
"""error_type of a call a person did not approve."""


async def ask(ctx: RunContext, question: Question) -> HumanAnswer:
    """Ask a person through the run's channel and record the answer (`human.answered`); the
    channel may suspend the run instead (it raises `Suspended`)."""
    answer = await ctx.services.human.ask(question)
    data = {**answer.to_dict(), "state": question.state}
    if question.tool_call is not None:
        data["tool_call_id"] = question.tool_call.id
    ctx.record(EventType.HUMAN_ANSWERED, data)
    await ctx.flush()  # durable at once: a person is never asked the same thing twice
    ctx.answers.append(answer)
    return answer


def _rejected(answer: HumanAnswer) -> ToolResult:
    why = answer.text.strip() or "no reason given"
    return ToolResult(content=f"rejected by the user: {why}", is_error=True, error_type=_REJECTED)


async def tools_execute(ctx: RunContext) -> None:
    """Run the tool calls of the last model reply; results go back to the model in the calls'
    order. One after another, or at the same time where `parallel_tool_calls` says so."""
    if ctx.tools is None or ctx.last_completion is None:
        return
    ctx.last_results = []
    ctx.answers = []
    calls = ctx.last_completion.message.tool_calls
    cap = ctx.limits.max_tool_calls_per_reply
    parallel = ctx.state_spec.parallel_tool_calls
    if parallel is None:
        parallel = ctx.parallel_tool_calls
    if parallel and len(calls[:cap]) > 1:
        await _run_at_once(ctx, calls[:cap])
    else:
        for call in calls[:cap]:
            refusal = await _refusal(ctx, call)
            if refusal is not None:  # back to the model as the call's result
                _add_tool_result(ctx, call, refusal, duration_ms=0.0, malformed=False)
            else:
                await _run_one(ctx, call)
    for call in calls[cap:]:
        refused = ToolResult(
            content=f"error: not executed: at most {cap} tool calls are run per reply "
            "(limits.max_tool_calls_per_reply); make the remaining calls in your next reply",
            is_error=True,
            error_type=_NOT_RUN,
        )
        _add_tool_result(ctx, call, refused, duration_ms=0.0, malformed=False)
    update_tool_counters(ctx)


async def _refusal(ctx: RunContext, call: ToolCall) -> ToolResult | None:
    """None when the call may run (it needs no approval, or a person gave it); else the
    result that tells the model a person rejected it."""
    if call.name not in ctx.approval_required:
        return None
    answer = await ask(ctx, Question(kind="approval", state=ctx.current_state, tool_call=call))
    return None if answer.approved else _rejected(answer)


async def _run_one(ctx: RunContext, call: ToolCall) -> None:
    assert ctx.tools is not None
    ctx.record(EventType.TOOL_STARTED, {"call": call.to_dict()})
    await ctx.flush()  # a crash during the call must leave "started, no result" in the log
    started = ctx.clock.monotonic()
    result = await ctx.tools.execute(call)
    duration_ms = round((ctx.clock.monotonic() - started) * 1000, 1)
    _add_tool_result(ctx, call, result, duration_ms=duration_ms, malformed=False)


async def _run_at_once(ctx: RunContext, calls: Sequence[ToolCall]) -> None:
    """The calls of one reply at the same time, at most limits.max_parallel_tool_calls.

    A person approves (or not) each call first, in order. Every approved call's `tool.started`
    is on disk before any of them runs; each `tool.finished` is written as soon as its call
    ends (so a crash repeats no call that finished), and the conversation gets the results in
    the calls' order (so the next request, a resume and a replay do not depend on timing)."""
    tools = ctx.tools
    assert tools is not None
    refusals: dict[str, ToolResult] = {}
    for call in calls:
        refusal = await _refusal(ctx, call)
        if refusal is not None:
            refusals[call.id] = refusal
    approved = [call for call in calls if call.id not in refusals]
    for call in approved:
        ctx.record(EventType.TOOL_STARTED, {"call": call.to_dict()})
    await ctx.flush()
    gate = asyncio.Semaphore(ctx.limits.max_parallel_tool_calls)
    finished: dict[str, ToolCallRecord] = {}

    async def run(call: ToolCall) -> None:
        async with gate:
            started = ctx.clock.monotonic()
            result = await tools.execute(call)
        duration_ms = round((ctx.clock.monotonic() - started) * 1000, 1)
        ctx.record(
            EventType.TOOL_FINISHED,
            {"call": call.to_dict(), "result": result.to_dict(), "duration_ms": duration_ms},
        )
        finished[call.id] = ToolCallRecord(
            iteration=ctx.iteration, call=call, result=result, duration_ms=duration_ms
        )
        await ctx.flush()

    tasks = [asyncio.ensure_future(run(call)) for call in approved]
    try:
        await asyncio.gather(*tasks)
    except BaseException:  # one failed for good (or the run was cancelled): stop the others
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    for call in calls:  # the calls' order, whatever order they finished in
        if call.id in refusals:
            _add_tool_result(ctx, call, refusals[call.id], duration_ms=0.0, malformed=False)
            continue
        record = finished[call.id]
        ctx.session.add(Message.tool(call, record.result))
        ctx.tool_calls.append(record)
        ctx.last_results.append(record)


def update_tool_counters(ctx: RunContext) -> None:
    """Failure streak, repeated calls, done and fatal flags from the last results."""
    for record in ctx.last_results:
        call, result = record.call, record.result
        if result.error_type in (_NOT_RUN, _REJECTED):
            continue  # refused (per-reply cap, a person's no): the tool itself did not fail
        ctx.failure_streak = ctx.failure_streak + 1 if result.is_error else 0
        key = json.dumps([call.name, call.arguments], sort_keys=True)
        ctx.repeat_count = ctx.repeat_count + 1 if key == ctx.last_call_key else 1
        ctx.last_call_key = key
        if result.fatal and ctx.fatal_error is None:
            ctx.fatal_error = f"{call.name}: {result.content}"
        if call.name == DONE_TOOL and not result.is_error:
            ctx.done_answer = str(call.arguments.get("answer", result.content))
            ctx.answer = ctx.done_answer
            ctx.output = ctx.last_output  # the answer as its reply was validated, if it was


async def kernel_evaluate(ctx: RunContext) -> None:
    """Summarise where the run stands; the guards on the way out decide what happens next."""
    failed = sum(1 for r in ctx.last_results if r.result.is_error)
    limits = ctx.limits
    cap = limits.max_iterations or "∞"
    ctx.summary = (
        f"iteration {ctx.iteration}/{cap}; {len(ctx.last_results)} tool call(s), {failed} failed; "
        f"failure streak {ctx.failure_streak}/{limits.max_tool_failures}; "
        f"repeats {ctx.repeat_count}/{limits.no_progress_repeats}"
    )


async def human_input(ctx: RunContext) -> None:
    """Ask a person the state's `prompt:`; the answer joins the conversation as a user message."""
    ctx.answers = []
    question = Question(
        kind="input", state=ctx.current_state, prompt=ctx.state_spec.prompt or "Your input?"
    )
    answer = await ask(ctx, question)
    message = Message.user(answer.text)
    ctx.add_message(message)


BUILTIN_ACTIONS: dict[str, ActionDef] = {
    "session.observe": ActionDef("session.observe", session_observe),
    "agent.think": ActionDef("agent.think", agent_think, calls_model=True),
    "agent.decide": ActionDef("agent.decide", agent_decide, calls_model=True),
    "tools.execute": ActionDef("tools.execute", tools_execute),
    "kernel.evaluate": ActionDef("kernel.evaluate", kernel_evaluate),
    "human.input": ActionDef("human.input", human_input),
    "workflow.call": ActionDef("workflow.call", workflow_call, starts_children=True),
    "workflow.map": ActionDef("workflow.map", workflow_map, starts_children=True),
}


# --- guards ------------------------------------------------------------------------------


def has_tool_calls(ctx: RunContext) -> bool:
    """The last reply asked for tools (and was well formed)."""
    c = ctx.last_completion
    return c is not None and bool(c.message.tool_calls) and ctx.malformed_reason is None


def has_answer(ctx: RunContext) -> bool:
    """The last reply is text without tool calls."""
    c = ctx.last_completion
    return c is not None and not c.message.tool_calls and bool(c.message.content.strip())


def critique_passed(ctx: RunContext) -> bool:
    """The last reply starts with PASS (used by critique steps)."""
    c = ctx.last_completion
    words = c.message.content.strip().split() if c is not None else []
    return bool(words) and words[0].strip(".:!,*").upper() in {"PASS", "PASSED", "APPROVED"}


def is_truncated(ctx: RunContext) -> bool:
    """The last reply is text cut off by the model's length limit (finish_reason "length",
    no tool calls). A cut-off tool call is malformed output instead (its arguments are not JSON).
    """
    c = ctx.last_completion
    return c is not None and c.finish_reason == "length" and not c.message.tool_calls


def approved(ctx: RunContext) -> bool:
    """A person was asked in the last step that asked, and approved every call they saw."""
    asked = [a for a in ctx.answers if a.kind == "approval"]
    return bool(asked) and all(a.approved for a in asked)


def rejected(ctx: RunContext) -> bool:
    """A person rejected a tool call in the last step that asked."""
    return any(a.kind == "approval" and not a.approved for a in ctx.answers)


BUILTIN_GUARDS: dict[str, Callable[[RunContext], bool]] = {
    "has_tool_calls": has_tool_calls,
    "has_answer": has_answer,
    "malformed_output": lambda ctx: ctx.malformed_reason is not None,
    "retries_exhausted": lambda ctx: ctx.malformed_streak >= ctx.limits.max_malformed_outputs,
    "done_called": lambda ctx: ctx.done_answer is not None,
    "fatal_tool_error": lambda ctx: ctx.fatal_error is not None,
    "iteration_limit": lambda ctx: (
        bool(ctx.limits.max_iterations) and ctx.iterations_used >= ctx.limits.max_iterations
    ),
    "budget_exceeded": budget_exceeded,
    "no_progress": lambda ctx: ctx.repeat_count >= ctx.limits.no_progress_repeats,
    "tool_failures": lambda ctx: ctx.failure_streak >= ctx.limits.max_tool_failures,
    "tool_failed": lambda ctx: any(r.result.is_error for r in ctx.last_results),
    "critique_passed": critique_passed,
    "truncated": is_truncated,
    "approved": approved,
    "rejected": rejected,
    "caught": lambda ctx: ctx.caught is not None,
    "child_succeeded": child_succeeded,
    "child_failed": child_failed,
}


# --- references ---------------------------------------------------------------------------


def resolve_ref(ref: str) -> Any:
    """Import `package.module:attribute`."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise RefError(f"{ref!r} is not a 'package.module:function' reference")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RefError(f"cannot import module {module_name!r} for {ref!r}: {exc}") from None
    try:
        target = module
        for part in attr.split("."):
            target = getattr(target, part)
    except AttributeError:
        raise RefError(f"module {module_name!r} has no attribute {attr!r}") from None
    if not callable(target):
        raise RefError(f"{ref!r} is not callable")
    return target


def resolve_action(name: str) -> ActionDef:
    """A built-in action by name, or a user's by reference."""
    if name in BUILTIN_ACTIONS:
        return BUILTIN_ACTIONS[name]
    if ":" not in name:
        known = ", ".join(sorted(BUILTIN_ACTIONS))
        raise RefError(f"unknown action {name!r} (built-in: {known}; or package.module:function)")
    fn = resolve_ref(name)
    calls_model = bool(getattr(fn, "calls_model", False))
    return ActionDef(name, _threaded(fn), calls_model=calls_model, user_code=True)


def resolve_guard(name: str) -> Callable[[RunContext], bool]:
    """A built-in guard by name, or a user's by reference."""
    if name in BUILTIN_GUARDS:
        return BUILTIN_GUARDS[name]
    if ":" not in name:
        known = ", ".join(sorted([*BUILTIN_GUARDS, COMPLETED]))  # completed: the compiler's
        raise RefError(f"unknown guard {name!r} (built-in: {known}; or package.module:function)")
    fn: Callable[[RunContext], bool] = resolve_ref(name)
    return fn
