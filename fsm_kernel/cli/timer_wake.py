"""The scheduler's timer check: every tick, wake the runs in its store that wait in a waiting
state whose timer is due (`run.suspended` with `waiting_for.kind == "event"` and `due` past), so
their timers fire without anyone running `fsm-kernel resume`.

A run started by a dispatch left that dispatch `waiting`: the check makes it pending again
(`DispatchQueue.wake_waiting`, which notifies idle workers on PostgreSQL), and whichever worker
of the fleet claims it first, on any host (the scheduler's own cycle included), resumes the run;
its outcome completes the dispatch as usual. A dispatch whose agent has another active dispatch
cannot be woken yet (one active dispatch per agent): it stays waiting and is tried again at the
next tick. A due run that no dispatch started (`fsm-kernel run` in the same store) is resumed
here, in the scheduler's process; a run whose dispatch was woken already, or cancelled, is left
alone.

A tick's cycle runs on one scheduler of the fleet (the tick is taken in the dispatch store), so
each due run is woken once per tick; should two processes resume one run anyway, the run's lock
lets one through. Child runs are left to their parent: a parent waiting with its child carries
the child's `due`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime

from fsm_kernel.api import Agent
from fsm_kernel.bootstrap import load_spec, recorded_workflow
from fsm_kernel.errors import FsmKernelError, StoreConflictError
from fsm_kernel.protocol import Clock, SystemClock
from fsm_kernel.replay import RecordedRun
from fsm_kernel.scheduler import DispatchQueue, SchedulerConfig, open_queue, state_tools
from fsm_kernel.store import open_store
from fsm_kernel.workflow.spec import WorkflowSpec

__all__ = ["MAX_WOKEN", "due_runs", "recorded_spec", "timer_waker"]

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


def recorded_spec(location: str, run_id: str) -> tuple[WorkflowSpec, str]:
    """The workflow run `run_id` (of the store at `location`) follows, and its recorded path:
    the text the run recorded (a run is pinned to it even after its file changed), else (a log
    from an older fsm-kernel) the file at that path.

    Raises:
        RunNotFoundError: no such run. ResumeError: it recorded neither text nor path.
        WorkflowValidationError: the recorded workflow no longer loads.
    """
    with open_store(location, read_only=True) as store:
        run = RecordedRun.load(store, run_id)
    found = recorded_workflow(run)
    path = str(run.started.data.get("workflow_path") or "")
    return (found if isinstance(found, WorkflowSpec) else load_spec(found)), path


def timer_waker(
    config: SchedulerConfig, clock: Clock | None = None, *, queue: DispatchQueue | None = None
) -> Callable[[], Awaitable[int]]:
    """The check a Scheduler runs each tick (`Scheduler(..., wake=)`): wakes each due run (see
    the module's docstring), at most MAX_WOKEN, and returns how many it woke. `queue` is the
    scheduler's dispatch queue (default: the config's store, opened for each check)."""
    clock = clock or SystemClock()

    async def wake() -> int:
        found = await asyncio.to_thread(due_runs, config.store, clock.now())
        if not found:
            return 0
        if queue is not None:
            return await _wake_all(config, queue, found)
        opened = await asyncio.to_thread(open_queue, config.store)
        try:
            return await _wake_all(config, opened, found)
        finally:
            opened.close()

    return wake


async def _wake_all(
    config: SchedulerConfig, queue: DispatchQueue, found: list[tuple[str, str]]
) -> int:
    woken = 0
    for run_id, _ in found:
        woken += await _wake(config, queue, run_id)
    return woken


async def _wake(config: SchedulerConfig, queue: DispatchQueue, run_id: str) -> int:
    """Wake one due run: through its dispatch when a dispatch started it, else in process;
    1 if it was woken."""
    try:
        dispatch = await asyncio.to_thread(queue.wake_waiting, run_id)
    except StoreConflictError as exc:
        logger.warning("run %s: its timer is due; %s; tried again next tick", run_id, exc)
        return 0
    if dispatch is not None:
        logger.info(
            "run %s: its timer is due; dispatch %s (%s) is pending again, for a worker to resume "
            "the run",
            run_id,
            dispatch.dispatch_id,
            dispatch.agent_id,
        )
        return 1
    other = await asyncio.to_thread(queue.dispatch_of_run, run_id)
    if other is not None:  # woken already (pending, running), or finished, or cancelled
        logger.debug("run %s: its dispatch %s is %s", run_id, other.dispatch_id, other.status)
        return 0
    return await _resume(config, run_id)


async def _resume(config: SchedulerConfig, run_id: str) -> int:
    """Resume one due run no dispatch started, in this process, on the definition it recorded,
    with the STATE.md tools a dispatch runs with; 1 if it went on."""
    try:
        spec, _ = await asyncio.to_thread(recorded_spec, config.store, run_id)
        agent = Agent(spec, store=config.store, tools=state_tools(config.state_file))
        async with agent:
            result = await agent.resume(run_id)
    except FsmKernelError as exc:  # held by another process, no longer due, file gone...
        logger.warning("run %s: its timer is due but it was not resumed: %s", run_id, exc)
        return 0
    logger.info("run %s: its timer fired (%s)", run_id, result.termination_reason or "waiting")
    return 1
