"""Child runs: a `workflow.call` state runs another workflow as a run of its own, a
`workflow.map` state runs one child per item of a list, at most `max_concurrency` at a time.

A child is a run like any other (its own event log, linked to the parent by `parent_run_id`).
The parent records each child's id (`child.started`) before the child starts and its outcome
(`child.finished`) after, so a re-driven parent (resume, replay) meets the same children: the
`ChildRunner` (a per-run collaborator, `RunServices.children`) reuses a child that ended,
resumes one that was cut off, and starts one that never began. The parent gets the children's
answers in its context (`ctx.children`, the guards `child_succeeded` / `child_failed`) and in
its conversation (one user message), and spends their iterations and tokens from its own
limits: a child may use at most the iterations and the time the parent has left, and the
children of one map share what the parent had left (a `CallPool`), so together they cannot
spend more either.

A calling state fails (an action error, `error`: its `catch:` may route it, else the run ends
`error`) before any child is recorded when a map's list is longer than its `max_items`, or when
the run is already MAX_CALL_DEPTH calls deep (`ChildRunError`); and after its children ended when
one did not succeed and no edge of the state routes on their outcome (`child_failed` /
`child_succeeded`): a failure deep in a chain of calls reaches the top, never an empty success.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

from fsm_kernel.errors import FsmKernelError
from fsm_kernel.protocol import EventType, Message, Usage, new_id
from fsm_kernel.workflow.context import RunContext
from fsm_kernel.workflow.human import HumanAnswer, Question, Suspended
from fsm_kernel.workflow.limits import MAX_CALL_DEPTH
from fsm_kernel.workflow.spec import DEFAULT_MAP_ITEMS, Limits

__all__ = [
    "CALL_ACTIONS",
    "TEMPLATE_NAMES",
    "CallPool",
    "ChildRequest",
    "ChildResult",
    "ChildRunError",
    "ChildRunner",
    "bounded_limits",
    "charge_shared_calls",
    "child_failed",
    "child_succeeded",
    "draw_on",
    "render",
    "take_shared_call",
    "template_names",
    "workflow_call",
    "workflow_map",
]

CALL_ACTIONS = frozenset({"workflow.call", "workflow.map"})
"""The built-in actions that start child runs."""

TEMPLATE_NAMES = frozenset({"goal", "answer", "output", "child", "children", "scratch", "event"})
"""What an `input:` template and an `items:` path may start with (a map adds item, index)."""
MAP_NAMES = frozenset({"item", "index"})

DEFAULT_CONCURRENCY = 4
"""A map's `max_concurrency` when the state does not say."""

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*)\}")


class TemplateError(FsmKernelError):
    """An `input:` template or an `items:` path that names nothing in the run."""


class ChildRunError(FsmKernelError):
    """A calling state that failed for its children: a map over its `max_items`, a call past
    MAX_CALL_DEPTH, or a child that did not succeed where the state does not route on it."""


@dataclass(frozen=True, kw_only=True)
class ChildRequest:
    """What a parent asks its ChildRunner for: one child run."""

    run_id: str
    """Chosen (and recorded) by the parent before the child starts."""
    parent_run_id: str
    workflow: str
    """As the state names it: a stock name or a path."""
    caller: str
    """The calling workflow's file: a relative `workflow:` path starts from its folder."""
    prompt: str
    max_iterations: int | None = None
    """The parent's remaining model calls (None: the parent has no cap)."""
    timeout_seconds: float | None = None
    """The parent's remaining time in seconds (None: the parent has no timeout)."""
    take_answer: Callable[[], HumanAnswer | None] = field(default=lambda: None, repr=False)
    """The answer the parent's resume was given, if still unused: for a child that waits."""


@dataclass(frozen=True, kw_only=True)
class ChildResult:
    """How a child run ended (or that it waits for a person)."""

    run_id: str
    workflow: str
    reason: str | None
    """Its termination reason; None while it waits for a person or when it never started."""
    ok: bool
    answer: str = ""
    output: Any = None
    """Its structured output (JSON data), None without one."""
    iterations: int = 0
    usage: Usage = field(default_factory=Usage)
    error: str | None = None
    waiting_for: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "run_id": self.run_id,
            "workflow": self.workflow,
            "reason": self.reason,
            "ok": self.ok,
            "answer": self.answer,
            "output": self.output,
            "iterations": self.iterations,
            "usage": self.usage.to_dict(),
        }
        if self.error:
            d["error"] = self.error
        if self.waiting_for is not None:
            d["waiting_for"] = self.waiting_for
        return d

    def view(self) -> dict[str, Any]:
        """What templates see of it: `{child.answer}`, `{child.output.KEY}`, ..."""
        recorded = self.to_dict()
        return {key: recorded.get(key) for key in _VIEW_KEYS}


_VIEW_KEYS = ("run_id", "workflow", "reason", "ok", "answer", "output", "error")


@runtime_checkable
class ChildRunner(Protocol):
    """Runs child runs for a parent: starts, resumes or reuses the run `request.run_id`."""

    async def run(self, request: ChildRequest) -> ChildResult: ...


def bounded_limits(own: Limits, iterations: int | None, seconds: float | None) -> Limits:
    """A child's limits: its workflow's own, capped by what its parent has left (0 in a
    limit means none, so the parent's remainder replaces it)."""
    updates: dict[str, Any] = {}
    if iterations is not None:
        cap = own.max_iterations
        updates["max_iterations"] = min(cap, iterations) if cap else iterations
    if seconds is not None:
        cap_s = own.timeout_seconds
        updates["timeout_seconds"] = min(cap_s, seconds) if cap_s else seconds
    return own.model_copy(update=updates) if updates else own


class CallPool:
    """The model calls the children of one `workflow.map` share: what their parent had left
    when the map began. A child's own cap (that same remainder) bounds it alone; the pool
    bounds the children together, however many run at once. A map inside a child of a map
    draws on both pools (`outer`)."""

    def __init__(self, size: int, outer: CallPool | None = None) -> None:
        self.size = size
        self.spent = 0
        self.outer = outer

    def _chain(self) -> Iterator[CallPool]:
        pool: CallPool | None = self
        while pool is not None:
            yield pool
            pool = pool.outer

    def take(self) -> CallPool | None:
        """Take one call from this pool and every pool around it; when one of them is spent,
        take nothing and return that one."""
        for pool in self._chain():
            if pool.spent >= pool.size:
                return pool
        self.charge(1)
        return None

    def charge(self, calls: int) -> None:
        """Count calls made without taking them first (a context summary's, or those of a
        child that had ended before its parent was resumed)."""
        for pool in self._chain():
            pool.spent += calls


_SHARED_CALLS: ContextVar[CallPool | None] = ContextVar("fsm_kernel_shared_calls", default=None)
"""The pool of the map whose child runs in this task (each child is a task of its own)."""

_DEPTH: ContextVar[int] = ContextVar("fsm_kernel_call_depth", default=0)
"""How many calls deep the run of this task is (0: the run being driven, its children 1, ...)."""


def draw_on(pool: CallPool | None) -> None:
    """The runs of the running task (a map's child, a child's replay) draw their model calls
    on `pool` (None: on no pool)."""
    _SHARED_CALLS.set(pool)


def take_shared_call(ctx: RunContext, *, recorded: bool = False) -> str | None:
    """Take the run's next model call from the pools of the maps it is a child of (the kernel
    asks before each model call); why not, when one of them is spent. A call its log already
    holds (`recorded`: a resumed child catching up) is counted, never refused: it was made."""
    pool = _SHARED_CALLS.get()
    if pool is None:
        return None
    if recorded:
        charge_shared_calls(1, ctx)
        return None
    spent = pool.take()
    drawn = ctx.notes.shared_calls or 0  # set even when refused: its ending says it drew on one
    if spent is None:
        ctx.notes.shared_calls = drawn + 1
        return None
    ctx.notes.shared_calls = drawn
    return (
        f"the {spent.size} model call(s) its parent had left are spent: the children of a "
        "workflow.map share them"
    )


def charge_shared_calls(calls: int, ctx: RunContext | None = None) -> None:
    """Count `calls` model calls made without `take_shared_call` against the maps' pools
    (a context summary of the run `ctx`, or a child that ended before its parent resumed)."""
    pool = _SHARED_CALLS.get()
    if pool is None:
        return
    pool.charge(calls)
    if ctx is not None:
        ctx.notes.shared_calls = (ctx.notes.shared_calls or 0) + calls


# --- templates ---------------------------------------------------------------------------


def template_names(template: str) -> list[str]:
    """The root names a template's placeholders use (`{output.steps}` uses `output`)."""
    return [m.group(1).split(".")[0] for m in _PLACEHOLDER.finditer(template)]


def _values(ctx: RunContext, extra: Mapping[str, Any]) -> dict[str, Any]:
    last = ctx.children[-1].view() if ctx.children else None
    return {
        "goal": ctx.goal,
        "answer": ctx.answer,
        "output": ctx.last_output if ctx.last_output is not None else ctx.output,
        "child": last,
        "children": [c.answer for c in ctx.children],
        "scratch": ctx.scratch,
        "event": ctx.event,  # the last event delivered: {event.name}, {event.data.x}
        **extra,
    }


def _lookup(values: Mapping[str, Any], path: str) -> Any:
    current: Any = values
    for part in path.split("."):
        current = _plain(current)
        if isinstance(current, Mapping) and part in current:
            current = current[part]
        elif isinstance(current, list) and part.isdigit() and int(part) < len(current):
            current = current[int(part)]
        else:
            raise TemplateError(f"{{{path}}} names nothing in the run (no {part!r})")
    return _plain(current)


def _plain(value: Any) -> Any:
    """A pydantic model as its JSON data; anything else as it is."""
    dump = getattr(value, "model_dump", None)
    return dump(mode="json") if callable(dump) else value


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    return json.dumps(value, ensure_ascii=False)


def render(template: str, ctx: RunContext, extra: Mapping[str, Any] | None = None) -> str:
    """`template` with each `{name.path}` replaced by its value (objects as JSON)."""
    values = _values(ctx, extra or {})
    return _PLACEHOLDER.sub(lambda m: _text(_lookup(values, m.group(1))), template)


def _items(ctx: RunContext, path: str) -> list[Any]:
    value = _lookup(_values(ctx, {}), path.strip().strip("{}"))
    if not isinstance(value, list):
        shown = json.dumps(value, ensure_ascii=False)[:120]
        raise TemplateError(f"items {path!r} is not a list (it is {shown})")
    return value


# --- the actions ------------------------------------------------------------------------


def _remaining(ctx: RunContext) -> tuple[int | None, float | None]:
    """The model calls and seconds the parent has left for a child."""
    cap = ctx.limits.max_iterations
    iterations = max(cap - ctx.iterations_used, 1) if cap else None
    seconds = None
    deadline = ctx.notes.deadline
    when = deadline.when() if deadline is not None else None
    if when is not None:
        seconds = max(when - asyncio.get_running_loop().time(), 0.001)
    return iterations, seconds


def _next_child_id(ctx: RunContext) -> str:
    """The id of the run's next child: the recorded one when the run is re-driven."""
    n = ctx.notes.children_started
    ctx.notes.children_started += 1
    recorded = ctx.services.recorded_children
    return recorded[n] if n < len(recorded) else new_id()


def _request(ctx: RunContext, run_id: str, prompt: str) -> ChildRequest:
    iterations, seconds = _remaining(ctx)
    take = getattr(ctx.services.human, "take_given", None)
    return ChildRequest(
        run_id=run_id,
        parent_run_id=ctx.run_id,
        workflow=str(ctx.state_spec.workflow),
        caller=ctx.workflow_path,
        prompt=prompt,
        max_iterations=iterations,
        timeout_seconds=seconds,
        take_answer=take if callable(take) else (lambda: None),
    )


def _runner(ctx: RunContext) -> ChildRunner:
    runner = ctx.services.children
    if runner is None:
        raise FsmKernelError(f"{ctx.state_spec.action} needs a child runner, but the run has none")
    return runner


def _started(ctx: RunContext, run_id: str, prompt: str, item: int | None) -> None:
    data: dict[str, Any] = {
        "run_id": run_id,
        "workflow": ctx.state_spec.workflow,
        "input": prompt,
    }
    if item is not None:
        data["item"] = item
    ctx.record(EventType.CHILD_STARTED, data)


async def _finished(ctx: RunContext, result: ChildResult, item: int | None) -> None:
    data = result.to_dict()
    if item is not None:
        data["item"] = item
    ctx.record(EventType.CHILD_FINISHED, data)
    await ctx.flush()


def _absorb(ctx: RunContext, results: Sequence[ChildResult]) -> None:
    """The children's outcome into the parent: its context, its usage and its budget."""
    ctx.children = list(results)
    for result in results:
        ctx.child_iterations += result.iterations
        ctx.usage = ctx.usage + result.usage


def _wait_for(ctx: RunContext, results: Sequence[ChildResult]) -> None:
    """Suspend the parent when a child waits for a person (the first one, in item order):
    resuming the parent with the answer resumes that child."""
    for result in results:
        if result.waiting_for is not None:
            asked = Question.from_dict(result.waiting_for)
            state = ctx.current_state
            raise Suspended(replace(asked, state=state, child_run_id=result.run_id))


def _not_started(run_id: str, workflow: str) -> ChildResult:
    return ChildResult(
        run_id=run_id,
        workflow=workflow,
        reason=None,
        ok=False,
        error="not started: an earlier item failed (fail_fast)",
    )


def _shown(result: ChildResult) -> str:
    if result.ok:
        return result.answer
    why = result.error or result.answer or "no answer"
    return f"(failed: {result.reason or 'did not end'}) {why}"


def _child_depth(ctx: RunContext) -> int:
    """The depth the state's children run at; refused past MAX_CALL_DEPTH (the run itself
    is `_DEPTH` calls deep: 0 for the run being driven)."""
    depth = _DEPTH.get()
    if depth >= MAX_CALL_DEPTH:
        raise ChildRunError(
            f"state {ctx.current_state!r} cannot start {ctx.state_spec.workflow!r}: this run is "
            f"already {depth} workflow calls deep, the most calls may nest (MAX_CALL_DEPTH = "
            f"{MAX_CALL_DEPTH})"
        )
    return depth + 1


def _check_items(ctx: RunContext, items: Sequence[Any]) -> None:
    """A map's list fits its `max_items` (default DEFAULT_MAP_ITEMS)."""
    cap = ctx.state_spec.max_items or DEFAULT_MAP_ITEMS
    if len(items) > cap:
        raise ChildRunError(
            f"state {ctx.current_state!r} was given {len(items):,} items "
            f"({ctx.state_spec.items}), more than its max_items = {cap:,}: no child was started"
        )


_ERROR_TAIL = 600
"""The characters of a failed child's error its parent's error quotes (the end: in a chain of
calls, the root cause is last)."""


def _fail_unrouted(ctx: RunContext, results: Sequence[ChildResult]) -> None:
    """Fail the state when a child did not succeed and no edge of the state routes on the
    children's outcome: a failure is never passed off as the parent's success."""
    failed = [r for r in results if not r.ok]
    if not failed or ctx.state_spec.routes_child_outcome:
        return
    first = min(failed, key=lambda r: r.reason in (None, "cancelled"))  # a cause, not a casualty
    why = first.error or first.answer or "no answer"
    if len(why) > _ERROR_TAIL:
        why = "…" + why[-_ERROR_TAIL:]
    count = f"{len(failed)} of {len(results)} children" if len(results) > 1 else "its child"
    raise ChildRunError(
        f"state {ctx.current_state!r}: {count} did not succeed and no edge of the state routes "
        f"child_failed; the child run {first.run_id} ({first.workflow}) ended "
        f"{first.reason or 'without a reason'}: {why}"
    )


async def workflow_call(ctx: RunContext) -> None:
    """Run the state's `workflow:` as a child run on the `input:` template (default the goal);
    its answer becomes the parent's (where `answer` is true) and joins the conversation."""
    depth = _child_depth(ctx)
    prompt = render(ctx.state_spec.input or "{goal}", ctx)
    run_id = _next_child_id(ctx)
    _started(ctx, run_id, prompt, None)
    await ctx.flush()
    deeper = _DEPTH.set(depth)
    try:
        result = await _runner(ctx).run(_request(ctx, run_id, prompt))
    finally:
        _DEPTH.reset(deeper)
    await _finished(ctx, result, None)
    _absorb(ctx, [result])
    _wait_for(ctx, [result])
    if result.ok and ctx.state_spec.answer:
        ctx.answer = result.answer
    message = Message.user(
        f"The workflow {ctx.state_spec.workflow!r} (run {run_id}) was asked: {prompt}\n"
        f"It answered: {_shown(result)}"
    )
    ctx.add_message(message)
    _fail_unrouted(ctx, [result])


async def workflow_map(ctx: RunContext) -> None:
    """Run the state's `workflow:` once per item of `items:`, at most `max_concurrency` at a
    time; the answers, in item order, join the conversation as one message. A failed item
    cancels the others only with `fail_fast: true`."""
    spec = ctx.state_spec
    depth = _child_depth(ctx)
    items = _items(ctx, str(spec.items))
    _check_items(ctx, items)
    template = spec.input or "{item}"
    prompts = [
        render(template, ctx, {"item": item, "index": i + 1}) for i, item in enumerate(items)
    ]
    ids = [_next_child_id(ctx) for _ in items]
    for i, (run_id, prompt) in enumerate(zip(ids, prompts, strict=True)):
        _started(ctx, run_id, prompt, i)
    await ctx.flush()  # every child's id is on disk before any child starts
    runner = _runner(ctx)
    gate = asyncio.Semaphore(spec.max_concurrency or DEFAULT_CONCURRENCY)
    left, _ = _remaining(ctx)
    outer = _SHARED_CALLS.get()
    pool = CallPool(left, outer) if left is not None else outer
    failed = asyncio.Event()
    results: dict[int, ChildResult] = {}
    began: set[int] = set()

    async def one(i: int) -> None:
        draw_on(pool)  # in this task only: its child's model calls draw on the pool
        _DEPTH.set(depth)  # and its child runs one call deeper
        async with gate:
            if failed.is_set():  # fail_fast: an earlier item failed before this one began
                result = _not_started(ids[i], str(spec.workflow))
            else:
                began.add(i)
                result = await runner.run(_request(ctx, ids[i], prompts[i]))
        results[i] = result
        if not result.ok and result.waiting_for is None and spec.fail_fast:
            failed.set()
            for j, task in enumerate(tasks):
                if j != i and not task.done():
                    task.cancel()
        await _finished(ctx, result, i)

    tasks = [asyncio.ensure_future(one(i)) for i in range(len(items))]
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    for i, outcome in enumerate(outcomes):
        if isinstance(outcome, asyncio.CancelledError) and i not in results:
            results[i] = (
                ChildResult(
                    run_id=ids[i],
                    workflow=str(spec.workflow),
                    reason="cancelled",
                    ok=False,
                    error="cancelled: another item failed (fail_fast)",
                )
                if i in began
                else _not_started(ids[i], str(spec.workflow))
            )
            await _finished(ctx, results[i], i)
        elif isinstance(outcome, BaseException):
            raise outcome
    ordered = [results[i] for i in range(len(items))]
    _absorb(ctx, ordered)
    _wait_for(ctx, ordered)
    lines = [f"{i + 1}. {prompts[i]}\n   → {_shown(result)}" for i, result in enumerate(ordered)]
    message = Message.user(
        f"The workflow {spec.workflow!r} ran once per item ({len(ordered)} items):\n"
        + "\n".join(lines)
        if ordered
        else f"The workflow {spec.workflow!r} had no items to run (the list was empty)."
    )
    ctx.add_message(message)
    _fail_unrouted(ctx, ordered)


# --- guards --------------------------------------------------------------------------------


def child_succeeded(ctx: RunContext) -> bool:
    """The last workflow.call / workflow.map state's children all ended for a success reason."""
    return bool(ctx.children) and all(c.ok for c in ctx.children)


def child_failed(ctx: RunContext) -> bool:
    """A child of the last workflow.call / workflow.map state did not succeed."""
    return any(not c.ok for c in ctx.children)
