"""The scheduler engine: one cycle per cron tick (read STATE.md, plan, enqueue, run up to
max_concurrent dispatches, record outcomes) and the cron loop around it.

Tick policy: missed ticks collapse into the latest one; a tick that comes while the previous
cycle still runs is skipped; each tick fires once per fleet (`try_acquire_tick`). The first tick
is the first fire time after start: ticks missed while nothing ran are not caught up.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from fsm_kernel.errors import StoreError
from fsm_kernel.protocol import Clock, SystemClock, new_id
from fsm_kernel.scheduler.config import SchedulerConfig
from fsm_kernel.scheduler.cron import CronSchedule
from fsm_kernel.scheduler.executor import (
    AgentRunner,
    DispatchDetail,
    DispatchExecutor,
    ExecutionStatus,
    default_worker_id,
)
from fsm_kernel.scheduler.planner import Plan, SkippedAgent, plan_dispatches
from fsm_kernel.scheduler.queue import Dispatch, DispatchQueue, tick_key
from fsm_kernel.scheduler.statefile import StateFile

__all__ = ["CycleResult", "Scheduler", "Sleep"]

logger = logging.getLogger(__name__)

Sleep = Callable[[float], Awaitable[None]]


@dataclass(frozen=True, kw_only=True)
class CycleResult:
    """What one tick did."""

    tick: datetime
    """The scheduled time of the tick (or the `now` given to run_cycle)."""
    dispatched: int = 0
    """Dispatches enqueued by this tick."""
    succeeded: int = 0
    failed: int = 0
    skipped: int = 0
    """Agents not dispatched: disabled, still pending/running, or duplicate."""
    details: tuple[DispatchDetail, ...] = ()
    """Every dispatch this cycle executed (it may also pick up older pending ones)."""
    skipped_agents: tuple[SkippedAgent, ...] = ()
    """Which agents were not dispatched and why; a running one names the dispatch, the worker
    holding its lease and when that lease expires (a dead scheduler's dispatch blocks its
    agent until then)."""
    enqueued_ids: tuple[str, ...] = ()
    tick_skipped: str | None = None
    """None when the cycle ran; "overlap" (previous cycle still running) or "taken" (another
    scheduler of the fleet fired this tick)."""
    missed_ticks: int = 0
    """Earlier fire times collapsed into this tick."""

    @property
    def waiting(self) -> int:
        """Dispatches whose run waits for a person (`fsm-kernel resume` completes them)."""
        return sum(d.status is ExecutionStatus.WAITING for d in self.details)

    @property
    def abandoned(self) -> int:
        return sum(d.status is ExecutionStatus.ABANDONED for d in self.details)

    @property
    def cancelled(self) -> int:
        return sum(d.status is ExecutionStatus.CANCELLED for d in self.details)

    @property
    def lost(self) -> int:
        return sum(d.status is ExecutionStatus.LOST for d in self.details)

    def to_dict(self) -> dict[str, Any]:
        return {
            "tick": self.tick.isoformat(),
            "tick_skipped": self.tick_skipped,
            "missed_ticks": self.missed_ticks,
            "dispatched": self.dispatched,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "skipped": self.skipped,
            "cancelled": self.cancelled,
            "waiting": self.waiting,
            "abandoned": self.abandoned,
            "lost": self.lost,
            "enqueued_ids": list(self.enqueued_ids),
            "details": [d.to_dict() for d in self.details],
            "skipped_agents": [s.to_dict() for s in self.skipped_agents],
        }


class Scheduler:
    """Ticks on the config's cron schedule and runs each tick's dispatches in this process."""

    def __init__(
        self,
        config: SchedulerConfig,
        queue: DispatchQueue,
        runner: AgentRunner,
        *,
        clock: Clock | None = None,
        worker_id: str | None = None,
        sleep: Sleep = asyncio.sleep,
        state_file: StateFile | None = None,
        on_cycle: Callable[[CycleResult], None] | None = None,
        wake: Callable[[], Awaitable[int]] | None = None,
        on_start: Callable[[Dispatch], None] | None = None,
    ) -> None:
        """Nothing touches the disk or the store until a cycle runs.

        Args:
            config: The validated scheduler config.
            queue: The dispatch queue (see open_queue).
            runner: Runs one agent's kernel run; see AgentRunner.
            clock: Wall time for the cron loop (the queue has its own clock).
            worker_id: Lease owner name; unique per process by default.
            sleep: Awaited to wait for the next tick; inject a fake in tests.
            state_file: Defaults to config.state_file.
            on_cycle: Called with every tick's result, skipped ticks included.
            wake: Run at the start of every cycle: resumes the runs whose timer is due (a
                waiting state's `after:`) and returns how many; its failure is logged.
            on_start: Called with each dispatch this process claimed, as its run starts (the
                cycle's result, with every outcome, comes once they all ended).
        """
        self.config = config
        self.queue = queue
        self.clock: Clock = clock or SystemClock()
        self.worker_id = worker_id or default_worker_id()
        self.state_file = state_file or StateFile(config.state_file)
        self.schedule = CronSchedule(config.schedule)
        self._sleep = sleep
        self._on_cycle = on_cycle
        self._wake = wake
        self._on_start = on_start
        self._executor = DispatchExecutor(config, queue, runner, worker_id=self.worker_id)
        self._cycle_lock = asyncio.Lock()
        self._stop_requested = asyncio.Event()
        self._abandon = asyncio.Event()
        self._temps_cleaned = False

    @property
    def stopping(self) -> bool:
        return self._stop_requested.is_set()

    def stop(self, *, abandon: bool = False) -> None:
        """Stop ticking and claiming. Idempotent.

        In-flight dispatches finish unless `abandon`: then their runs are cancelled and their
        rows left running, to be reclaimed once the lease expires.
        """
        if not self._stop_requested.is_set():
            logger.info("scheduler %s stopping", self.worker_id)
        self._stop_requested.set()
        if abandon:
            self._abandon.set()
            self._executor.abandon_all()

    async def run_cycle(self, now: datetime | None = None) -> CycleResult:
        """One tick: read state, plan, enqueue, execute, report. Does not take the fleet-wide
        tick (run_forever does), so `--once` always runs.

        Raises:
            StoreError: STATE.md or the dispatch store could not be read or written.
        """
        tick = now or self.clock.now()
        if self._cycle_lock.locked():
            logger.warning("tick %s skipped: the previous cycle is still running", tick)
            return CycleResult(tick=tick, tick_skipped="overlap")
        async with self._cycle_lock:
            # A cycle for a given tick is deduplicated per tick (several schedulers may fire
            # it); a cycle for "now" (--once) always dispatches, however soon after the last.
            return await self._cycle(tick, scheduled=now is not None)

    async def settle(self) -> None:
        """Wait a little for the `notify:` webhooks still being told (before exiting)."""
        await self._executor.settle()

    async def run_forever(self, stop_event: asyncio.Event | None = None) -> None:
        """Tick until `stop_event` is set or stop() is called, then let the running cycle end."""
        watcher = asyncio.create_task(self._watch(stop_event)) if stop_event else None
        cycle: asyncio.Task[None] | None = None
        next_fire = self.schedule.next_after(self.clock.now())
        try:
            while not self.stopping:
                now = self.clock.now()
                if now < next_fire:
                    await self._wait((next_fire - now).total_seconds())
                    continue
                tick = self.schedule.latest_at_or_before(now)
                missed = self.schedule.fires_between(next_fire, tick) - 1
                next_fire = self.schedule.next_after(tick)
                cycle = await self._fire(tick, missed, cycle)
            if cycle is not None:
                await cycle
        except asyncio.CancelledError:
            self.stop(abandon=True)
            if cycle is not None:
                cycle.cancel()  # in-flight runs are abandoned; their leases expire
            raise
        finally:
            if watcher is not None:
                watcher.cancel()
            await self.settle()

    async def _cycle(self, tick: datetime, *, scheduled: bool = True) -> CycleResult:
        state = await asyncio.to_thread(self._prepare_and_read_state)
        kernel_id = self.config.kernel_id
        # Dispatches abandoned after max_attempts (or cancelled while their worker was dead)
        # are finished first, so their agents are planned afresh by this very tick.
        await asyncio.to_thread(self.queue.reap, kernel_id)
        await self._wake_due_timers()
        active = await asyncio.to_thread(self.queue.active_per_agent, kernel_id)
        plan = plan_dispatches(self.config.agents, state, active)
        stamp = tick_key(tick).isoformat() if scheduled else f"manual:{new_id()}"
        enqueued, duplicates = await self._enqueue(plan, stamp)
        details = await self._drain() if not self.stopping else []
        return _summarize(tick, plan, enqueued, duplicates, details)

    async def _wake_due_timers(self) -> None:
        """Resume the runs whose timer is due (see `wake`); never fails the cycle."""
        if self._wake is None:
            return
        try:
            woken = await self._wake()
        except Exception:  # the cycle's dispatches go on; the cause is logged
            logger.exception("waking the runs whose timer is due failed")
            return
        if woken:
            logger.info("%d run(s) resumed: their timer was due", woken)

    def _prepare_and_read_state(self) -> str:
        if not self._temps_cleaned:
            self.state_file.remove_stale_temps()
            self._temps_cleaned = True
        if self.config.seed_state is not None:
            self.state_file.seed(self.config.seed_state)
        return self.state_file.read()

    async def _enqueue(self, plan: Plan, stamp: str) -> tuple[list[str], list[SkippedAgent]]:
        enqueued: list[str] = []
        duplicates: list[SkippedAgent] = []
        for item in plan.dispatches:
            agent = item.agent
            dispatch = await asyncio.to_thread(
                self.queue.enqueue,
                self.config.kernel_id,
                agent.agent_id,
                item.prompt,
                agent.priority,
                f"{self.config.kernel_id}:{agent.agent_id}:{stamp}",
                max_attempts=self.config.max_attempts,
            )
            if dispatch is None:
                duplicates.append(SkippedAgent(agent_id=agent.agent_id, reason="duplicate"))
            else:
                enqueued.append(dispatch.dispatch_id)
        return enqueued, duplicates

    async def _drain(self) -> list[DispatchDetail]:
        """Claim and execute until nothing is claimable, at most max_concurrent at a time."""
        details: list[DispatchDetail] = []
        slots = [self._slot(details) for _ in range(self.config.max_concurrent)]
        await asyncio.gather(*slots)
        return details

    async def _slot(self, details: list[DispatchDetail]) -> None:
        config = self.config
        while not self.stopping:
            try:
                dispatch = await asyncio.to_thread(
                    self.queue.claim,
                    config.kernel_id,
                    self.worker_id,
                    config.lease_seconds,
                    config.max_concurrent,
                )
            except StoreError as exc:
                logger.error("claiming a dispatch failed: %s", exc)
                return
            if dispatch is None:
                return
            if self._on_start is not None:
                self._on_start(dispatch)
            details.append(await self._executor.execute(dispatch, abandon=self._abandon))

    async def _fire(
        self, tick: datetime, missed: int, previous: asyncio.Task[None] | None
    ) -> asyncio.Task[None] | None:
        if missed > 0:
            logger.warning("%d missed tick(s) collapsed into the tick of %s", missed, tick)
        if previous is not None and not previous.done():
            logger.warning("tick %s skipped: the previous cycle is still running", tick)
            self._emit(CycleResult(tick=tick, tick_skipped="overlap", missed_ticks=missed))
            return previous
        try:
            acquired = await asyncio.to_thread(
                self.queue.try_acquire_tick, self.config.kernel_id, tick
            )
        except StoreError as exc:
            logger.error("tick %s not fired: %s", tick, exc)
            return None
        if not acquired:
            logger.info("tick %s already fired by another scheduler", tick)
            self._emit(CycleResult(tick=tick, tick_skipped="taken", missed_ticks=missed))
            return None
        return asyncio.create_task(self._run_and_emit(tick, missed))

    async def _run_and_emit(self, tick: datetime, missed: int) -> None:
        try:
            result = await self.run_cycle(tick)
        except Exception:  # the loop must outlive one broken cycle; the cause is logged
            logger.exception("cycle of tick %s failed", tick)
            return
        self._emit(replace(result, missed_ticks=missed))

    def _emit(self, result: CycleResult) -> None:
        if self._on_cycle is not None:
            self._on_cycle(result)

    async def _wait(self, seconds: float) -> None:
        """Sleep (injected) until the delay passes or stop() is called."""
        await sleep_or_event(self._sleep(max(seconds, 0.0)), self._stop_requested)

    async def _watch(self, stop_event: asyncio.Event) -> None:
        await stop_event.wait()
        self.stop()


def _summarize(
    tick: datetime,
    plan: Plan,
    enqueued: Sequence[str],
    duplicates: Sequence[SkippedAgent],
    details: Sequence[DispatchDetail],
) -> CycleResult:
    skipped = (*plan.skipped, *duplicates)
    return CycleResult(
        tick=tick,
        dispatched=len(enqueued),
        succeeded=sum(d.status is ExecutionStatus.DONE for d in details),
        failed=sum(d.status is ExecutionStatus.FAILED for d in details),
        skipped=len(skipped),
        details=tuple(details),
        skipped_agents=skipped,
        enqueued_ids=tuple(enqueued),
    )


async def sleep_or_event(sleep: Awaitable[None], event: asyncio.Event) -> None:
    """Until `sleep` (the injected sleep's awaitable) finishes or `event` is set, whichever
    comes first; the other is cancelled."""
    sleeper = asyncio.create_task(_awaited(sleep))
    waker = asyncio.create_task(event.wait())
    try:
        await asyncio.wait({sleeper, waker}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (sleeper, waker):
            task.cancel()
        await asyncio.gather(sleeper, waker, return_exceptions=True)


async def _awaited(awaitable: Awaitable[None]) -> None:
    """An awaitable (the injected sleep) as a coroutine, which create_task needs."""
    await awaitable
