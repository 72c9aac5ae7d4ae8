"""The scheduler's timer check: every tick, resume the runs in its store that wait in a waiting
state whose timer is due (`run.suspended` with `waiting_for.kind == "event"` and `due` past),
so their timers fire without anyone running `fsm-kernel resume`.

A tick's cycle runs on one scheduler of the fleet (the tick is taken in the dispatch store), so
each due run is resumed once per tick; should two processes try anyway, the run's lock lets one
through and the other skips it. A resumed run that ends settles the dispatch that waited on it.
Child runs are left to their parent: a parent waiting with its child carries the child's `due`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime

from fsm_kernel.api import Agent
from fsm_kernel.bootstrap import load_spec
from fsm_kernel.errors import FsmKernelError
from fsm_kernel.protocol import Clock, SystemClock
from fsm_kernel.replay import RecordedRun
from fsm_kernel.scheduler import SchedulerConfig, state_tools
from fsm_kernel.scheduler.queue import settle_waiting_dispatch
from fsm_kernel.store import open_store

__all__ = ["MAX_WOKEN", "due_runs", "timer_waker"]

logger = logging.getLogger(__name__)

MAX_WOKEN = 1000
"""Waiting runs looked at per tick at most (the most recent first); the rest wait a tick."""


def due_runs(location: str, now: datetime, limit: int = MAX_WOKEN) -> list[tuple[str, str]]:
    """(run id, workflow path) of the top-level runs in the store at `location` that wait for
    a timer due at or before `now`."""
    out: list[tuple[str, str]] = []
    with open_store(location, read_only=True) as store:
        for summary in store.list_runs(limit=limit, waiting=True):
            run = RecordedRun.load(store, summary.run_id)
            waiting = run.waiting_for or {}
            due = waiting.get("due")
            path = run.started.data.get("workflow_path")
            if waiting.get("kind") != "event" or not due or not path or run.parent_run_id:
                continue
            if datetime.fromisoformat(str(due)) <= now:
                out.append((run.run_id, str(path)))
    return out


def timer_waker(
    config: SchedulerConfig, clock: Clock | None = None
) -> Callable[[], Awaitable[int]]:
    """The check a Scheduler runs each tick (`Scheduler(..., wake=)`): resumes each due run
    (its timer fires) and returns how many it resumed."""
    clock = clock or SystemClock()

    async def wake() -> int:
        found = await asyncio.to_thread(due_runs, config.store, clock.now())
        woken = 0
        for run_id, path in found:
            woken += await _resume(config, run_id, path)
        return woken

    return wake


async def _resume(config: SchedulerConfig, run_id: str, path: str) -> int:
    """Resume one due run, with the STATE.md tools its dispatch ran with; 1 if it went on."""
    try:
        agent = Agent(load_spec(path), store=config.store, tools=state_tools(config.state_file))
        async with agent:
            result = await agent.resume(run_id)
    except FsmKernelError as exc:  # held by another process, no longer due, file gone...
        logger.warning("run %s: its timer is due but it was not resumed: %s", run_id, exc)
        return 0
    logger.info("run %s: its timer fired (%s)", run_id, result.termination_reason or "waiting")
    if result.status == "ended":
        reason = result.termination_reason
        await asyncio.to_thread(
            settle_waiting_dispatch,
            config.store,
            run_id,
            ok=result.ok,
            termination_reason=None if reason is None else str(reason),
            error=result.error,
        )
    return 1
