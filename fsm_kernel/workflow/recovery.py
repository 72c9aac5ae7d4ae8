"""Recovering from a failing action, declared per state: `retry:` runs it again, `catch:` routes
the run to another state instead of ending it.

The kernel calls `run_action` for every state's action. A failure a `catch:` entry matches
becomes data (`ctx.notes.failure`, then `ctx.caught`) and the machine takes the entry's catch
edge, a transition the compiler puts before the state's own (guarded by `catch_matches`); so the
log, the diagrams, replay and the transition harness see a catch like any other edge.
Cancellation, the run's timeout and the kernel's own failures are never retried or caught.
Never imports python-statemachine.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fsm_kernel.errors import AgentError, FsmKernelError, RunError, StoreError
from fsm_kernel.protocol import EventType
from fsm_kernel.workflow.actions import ActionDef
from fsm_kernel.workflow.context import CaughtError, RunContext
from fsm_kernel.workflow.human import Suspended
from fsm_kernel.workflow.spec import CatchSpec, RetrySpec, StateSpec

__all__ = [
    "catch_matches",
    "error_kind",
    "failure_of",
    "first_catch",
    "run_action",
    "take_failure",
]


def error_kind(exc: BaseException) -> str | None:
    """`agent_error` or `error` for a failure a state may retry or catch; None for one that must
    end the run: cancellation and timeouts (BaseException), the kernel's own run errors (a
    replay's divergence) and the store's; and a run that suspends to wait for a person (not a
    failure at all)."""
    if not isinstance(exc, Exception) or isinstance(exc, RunError | StoreError | Suspended):
        return None
    return "agent_error" if isinstance(exc, AgentError) else "error"


def _matches(wanted: str, kind: str) -> bool:
    return wanted in ("any", kind)


def first_catch(state: StateSpec, kind: str) -> int | None:
    """The position of the first `catch:` entry of `state` that handles `kind`."""
    return next((i for i, c in enumerate(state.catch) if _matches(c.error, kind)), None)


def catch_matches(ctx: RunContext, state: StateSpec, position: int) -> bool:
    """The guard of a catch edge: the action just failed and entry `position` is the first of
    its state's `catch:` list that handles the failure."""
    failure = ctx.notes.failure
    return failure is not None and first_catch(state, failure.error) == position


def take_failure(ctx: RunContext) -> None:
    """A catch edge fired: the failure it routed becomes `ctx.caught`."""
    ctx.caught, ctx.notes.failure = ctx.notes.failure, None


def failure_of(
    exc: BaseException, *, state: str, attempts: int = 1, iteration: int = 0
) -> CaughtError:
    """The CaughtError describing `exc` (a failure of `state`'s action)."""
    kind = error_kind(exc) or "error"
    message = str(exc).strip() or type(exc).__name__
    return CaughtError(
        state=state,
        error=kind,
        type=type(exc).__name__,
        message=message,
        attempts=attempts,
        iteration=iteration,
    )


def _error_data(exc: Exception) -> dict[str, Any]:
    if isinstance(exc, FsmKernelError):
        return exc.to_dict()
    return {"type": type(exc).__name__, "message": str(exc)}


def _cancelling() -> bool:
    """The run's task is being cancelled (Ctrl-C, the run's timeout): an action that turned the
    cancellation into an ordinary exception must still not be retried or caught."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def _attempt(ctx: RunContext, action: ActionDef, key: tuple[str, int, int]) -> None:
    recorded = ctx.services.recorded_failures.get(key)
    if recorded is not None:  # a re-drive: the recorded run's action failed here
        raise recorded
    await action(ctx)


async def run_action(ctx: RunContext, action: ActionDef, state: StateSpec) -> None:
    """Run the current state's action under its `retry:` and `catch:`.

    Returns normally when the action succeeded, or when it failed and a `catch:` entry
    matched (then `ctx.notes.failure` is set, so the machine takes that entry's catch edge).

    Raises:
        Exception: the action's failure, when no `catch:` entry handles it (the run ends
            `agent_error` or `error`, as without `catch:`).
    """
    if state.retry is None and not state.catch:
        await action(ctx)
        return
    sid = ctx.current_state
    visit = ctx.notes.visits[sid] = ctx.notes.visits.get(sid, 0) + 1
    attempt = 1
    try:
        while True:
            ctx.attempt = attempt
            try:
                await _attempt(ctx, action, (sid, visit, attempt))
                return
            except Exception as exc:
                kind = error_kind(exc)
                if kind is None or _cancelling():
                    raise
                if not await _retried(ctx, state.retry, exc, kind, (visit, attempt)):
                    _route(ctx, state, exc, kind, (visit, attempt))
                    return
            attempt += 1
    finally:
        ctx.attempt = 1


async def _retried(
    ctx: RunContext,
    retry: RetrySpec | None,
    exc: Exception,
    kind: str,
    where: tuple[int, int],
) -> bool:
    """Record the failed attempt and wait before the next one, if `retry:` allows one."""
    visit, attempt = where
    if retry is None or not _matches(retry.error, kind) or attempt > retry.max_attempts:
        return False
    delay = retry.delay(attempt)
    ctx.record(
        EventType.ACTION_FAILED,
        {
            "kind": kind,
            "error": _error_data(exc),
            "visit": visit,
            "attempt": attempt,
            "max_attempts": retry.max_attempts,
            "retry_in": delay,
        },
    )
    await ctx.flush()
    if delay > 0:
        await ctx.services.sleep(delay)
    return True


def _route(
    ctx: RunContext, state: StateSpec, exc: Exception, kind: str, where: tuple[int, int]
) -> None:
    """Hand the failure to the first matching `catch:` entry, or re-raise it."""
    visit, attempts = where
    position = first_catch(state, kind)
    if position is None:
        raise exc
    entry: CatchSpec = state.catch[position]
    failure = failure_of(exc, state=ctx.current_state, attempts=attempts, iteration=ctx.iteration)
    ctx.notes.failure = failure
    ctx.record(
        EventType.ERROR_CAUGHT,
        {
            "kind": kind,
            "error": _error_data(exc),
            "visit": visit,
            "attempts": attempts,
            "catch": position,
            "target": entry.target,
        },
    )
