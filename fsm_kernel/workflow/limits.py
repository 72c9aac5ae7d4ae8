"""The limits the kernel enforces in code, whatever the transitions say: which one a run has hit,
and the error that names the figures. Pure: reads the RunContext, changes nothing.

Imports protocol and the workflow's spec and context only (the kernel calls `limit_reached`
between steps; actions.py takes the `budget_exceeded` guard from here).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fsm_kernel.protocol import Usage
from fsm_kernel.workflow.context import RunContext
from fsm_kernel.workflow.spec import TerminationReason

__all__ = ["MAX_CALL_DEPTH", "LimitHit", "budget_exceeded", "limit_reached", "tokens_used"]

MAX_CALL_DEPTH = 32
"""How deep `workflow.call`/`workflow.map` may nest: a run started by a chain of this many
calling workflows (the top run at depth 0) may not start another child. `validate` rejects a
chain of files that would go deeper, and the runtime refuses such a child as a failure of the
calling state (catchable, routed like any other child failure)."""


@dataclass(frozen=True)
class LimitHit:
    """A limit the run has reached: the reason it ends for, and why in figures."""

    reason: TerminationReason
    error: str | None


def tokens_used(usage: Usage) -> int:
    """What `limits.max_tokens` counts: prompt + completion tokens, or the server's total when
    it reports more (some report only a total). A server that reports no usage counts zero."""
    return max(usage.prompt_tokens + usage.completion_tokens, usage.total_tokens)


def budget_exceeded(ctx: RunContext) -> bool:
    """The run's model calls have used `limits.max_tokens` tokens (0: no cap)."""
    cap = ctx.limits.max_tokens
    return bool(cap) and tokens_used(ctx.usage) >= cap


def _fatal(ctx: RunContext) -> LimitHit | None:
    if ctx.fatal_error is None:
        return None
    return LimitHit(TerminationReason.FATAL_TOOL_ERROR, ctx.fatal_error)


def _tool_failures(ctx: RunContext) -> LimitHit | None:
    cap = ctx.limits.max_tool_failures
    if ctx.failure_streak < cap:
        return None
    last = ctx.tool_calls[-1] if ctx.tool_calls else None
    detail = f"; the last: {last.call.name}: {last.result.content[:200]}" if last else ""
    error = f"{ctx.failure_streak} failed tool calls in a row (limits.max_tool_failures = {cap})"
    return LimitHit(TerminationReason.TOOL_FAILURES, error + detail)


def _no_progress(ctx: RunContext) -> LimitHit | None:
    cap = ctx.limits.no_progress_repeats
    if ctx.repeat_count < cap:
        return None
    name = ctx.tool_calls[-1].call.name if ctx.tool_calls else "a tool"
    error = (
        f"{name} called with the same arguments {ctx.repeat_count} times in a row "
        f"(limits.no_progress_repeats = {cap})"
    )
    return LimitHit(TerminationReason.NO_PROGRESS, error)


def _malformed(ctx: RunContext) -> LimitHit | None:
    cap = ctx.limits.max_malformed_outputs
    if ctx.malformed_streak < cap:
        return None
    detail = f"; the last: {ctx.malformed_reason}" if ctx.malformed_reason else ""
    error = (
        f"{ctx.malformed_streak} malformed model replies in a row "
        f"(limits.max_malformed_outputs = {cap}){detail}"
    )
    return LimitHit(TerminationReason.MALFORMED_OUTPUT, error)


def _budget(ctx: RunContext) -> LimitHit | None:
    if not budget_exceeded(ctx):
        return None
    usage = ctx.usage
    error = (
        f"the model calls used {tokens_used(usage):,} tokens ({usage.prompt_tokens:,} prompt + "
        f"{usage.completion_tokens:,} completion), reaching limits.max_tokens = "
        f"{ctx.limits.max_tokens:,}"
    )
    return LimitHit(TerminationReason.BUDGET_EXCEEDED, error)


def _iterations(ctx: RunContext) -> LimitHit | None:
    cap = ctx.limits.max_iterations
    if not cap or ctx.iterations_used < cap:
        return None
    return LimitHit(TerminationReason.MAX_ITERATIONS, None)


_BEFORE_MODEL_CALL: tuple[Callable[[RunContext], LimitHit | None], ...] = (
    _fatal,
    _tool_failures,
    _no_progress,
    _malformed,
    _budget,
    _iterations,
)
"""In the order the stock workflows test them on their way out of `evaluate`."""


def limit_reached(ctx: RunContext, *, model_call_next: bool) -> LimitHit | None:
    """The limit the run must stop for now, if any; the kernel asks between steps (after a
    transition that did not reach a final state, before the next state's action).

    The token budget stops the run at the first step after the model call that used it up (a
    reply that asked for tools does not get them run). The others stop it before the next model
    call (`model_call_next`), as `max_iterations` always has: they arise in one state (a tool
    failure in `act`) and a workflow may end the run for them a step or two later through its
    own edge (`evaluate → terminate [tool_failures]`), which then fires first, so the log and
    the diagram show that edge. A workflow without such an edge still stops: no model call is
    made past a limit.
    """
    if not model_call_next:
        return _budget(ctx)
    for check in _BEFORE_MODEL_CALL:
        hit = check(ctx)
        if hit is not None:
            return hit
    return None
