"""The cron loop (Scheduler.run_forever) stepped tick by tick with a fake clock and a gated sleep:
regular ticks, missed ticks collapsed, overlapping ticks skipped, one fire per fleet, stopping."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from fsm_kernel.errors import StoreError
from fsm_kernel.scheduler import CycleResult, DispatchStatus, Scheduler, open_queue
from fsm_kernel.scheduler.queue import SqliteDispatchQueue
from tests.unit.test_scheduler_fakes import (
    FakeClock,
    GatedSleep,
    ScriptedRunner,
    make_config,
    wait_until,
)


def at(hour: int, minute: int) -> datetime:
    return datetime(2026, 2, 11, hour, minute, tzinfo=UTC)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()  # 10:00:30 UTC


@pytest.fixture
def queue(tmp_path: Path, clock: FakeClock) -> Iterator[SqliteDispatchQueue]:
    q = open_queue(str(tmp_path / "runs.db"), clock=clock)
    assert isinstance(q, SqliteDispatchQueue)
    yield q
    q.close()


class Loop:
    """A Scheduler running run_forever in the background, stepped by the test."""

    def __init__(self, sched: Scheduler, sleep: GatedSleep, results: list[CycleResult]) -> None:
        self.sched, self.sleep, self.results = sched, sleep, results
        self.stop_event = asyncio.Event()
        self.task = asyncio.create_task(sched.run_forever(self.stop_event))

    async def tick(self, *, extra: float = 0.0, expect_results: int) -> float:
        slept = await self.sleep.advance(extra=extra)
        await wait_until(lambda: len(self.results) >= expect_results, what="a cycle result")
        return slept

    async def finish(self) -> None:
        self.stop_event.set()
        await asyncio.wait_for(self.task, 5)


def make_loop(tmp_path: Path, queue: Any, runner: Any, clock: FakeClock, **kw: Any) -> Loop:
    results: list[CycleResult] = []
    sleep = GatedSleep(clock)
    config = make_config(tmp_path, kw.pop("agents", ["a"]), **kw)
    sched = Scheduler(
        config, queue, runner, clock=clock, worker_id="s1", sleep=sleep, on_cycle=results.append
    )
    return Loop(sched, sleep, results)


def test_ticks_fire_on_schedule(
    tmp_path: Path, queue: SqliteDispatchQueue, clock: FakeClock
) -> None:
    runner = ScriptedRunner()

    async def scenario() -> tuple[list[float], list[CycleResult]]:
        loop = make_loop(tmp_path, queue, runner, clock)
        slept = [await loop.tick(expect_results=n) for n in (1, 2, 3)]
        await loop.finish()
        return slept, loop.results

    slept, results = asyncio.run(scenario())
    assert slept == [570.0, 600.0, 600.0]
    assert [r.tick for r in results] == [at(10, 10), at(10, 20), at(10, 30)]
    assert [(r.dispatched, r.succeeded, r.tick_skipped, r.missed_ticks) for r in results] == [
        (1, 1, None, 0)
    ] * 3
    assert len(runner.calls) == 3


def test_missed_ticks_collapse_into_the_latest(
    tmp_path: Path, queue: SqliteDispatchQueue, clock: FakeClock
) -> None:
    runner = ScriptedRunner()

    async def scenario() -> tuple[float, list[CycleResult]]:
        loop = make_loop(tmp_path, queue, runner, clock)
        await loop.tick(extra=25 * 60, expect_results=1)  # the process stalls until 10:35
        slept = await loop.tick(expect_results=2)
        await loop.finish()
        return slept, loop.results

    slept, results = asyncio.run(scenario())
    assert [(r.tick, r.missed_ticks, r.dispatched) for r in results] == [
        (at(10, 30), 2, 1),
        (at(10, 40), 0, 1),
    ]
    assert slept == 300.0  # from 10:35 to 10:40
    assert len(runner.calls) == 2
    assert [d.dedupe_key for d in queue.list("k1")] == [
        "k1:a:2026-02-11T10:40:00+00:00",
        "k1:a:2026-02-11T10:30:00+00:00",
    ]


def test_an_overlapping_tick_is_skipped(
    tmp_path: Path, queue: SqliteDispatchQueue, clock: FakeClock
) -> None:
    runner = ScriptedRunner({"a": "block"})

    async def scenario() -> list[CycleResult]:
        loop = make_loop(tmp_path, queue, runner, clock)
        await loop.sleep.advance()  # 10:10: the cycle starts and blocks in the runner
        await asyncio.wait_for(runner.started.wait(), 5)
        await loop.tick(expect_results=1)  # 10:20: still running
        runner.release.set()
        await wait_until(lambda: len(loop.results) == 2, what="the 10:10 cycle")
        await loop.tick(expect_results=3)  # 10:30 runs again
        await loop.finish()
        return loop.results

    results = asyncio.run(scenario())
    assert [(r.tick, r.tick_skipped, r.dispatched) for r in results] == [
        (at(10, 20), "overlap", 0),
        (at(10, 10), None, 1),
        (at(10, 30), None, 1),
    ]
    assert len(runner.calls) == 2
    assert queue.try_acquire_tick("k1", at(10, 20)) is True  # the skipped tick was never taken


def test_a_tick_fires_once_per_fleet(tmp_path: Path) -> None:
    runners = [ScriptedRunner(), ScriptedRunner()]
    clocks = [FakeClock(), FakeClock()]
    queues = [open_queue(str(tmp_path / "shared.db"), clock=c) for c in clocks]

    async def scenario() -> list[list[CycleResult]]:
        loops = [
            make_loop(tmp_path, q, r, c) for q, r, c in zip(queues, runners, clocks, strict=True)
        ]
        for loop in loops:
            await loop.tick(expect_results=1)  # both reach 10:10
        for loop in loops:
            await loop.finish()
        return [loop.results for loop in loops]

    try:
        first, second = asyncio.run(scenario())
    finally:
        for q in queues:
            q.close()
    assert [(r.tick, r.tick_skipped, r.dispatched) for r in first] == [(at(10, 10), None, 1)]
    assert [(r.tick, r.tick_skipped, r.dispatched) for r in second] == [(at(10, 10), "taken", 0)]
    assert (len(runners[0].calls), len(runners[1].calls)) == (1, 0)


def test_stop_while_sleeping_ends_the_loop_and_is_idempotent(
    tmp_path: Path, queue: SqliteDispatchQueue, clock: FakeClock
) -> None:
    runner = ScriptedRunner()

    async def scenario() -> list[CycleResult]:
        loop = make_loop(tmp_path, queue, runner, clock)
        await asyncio.sleep(0)
        loop.sched.stop()
        loop.sched.stop()
        await asyncio.wait_for(loop.task, 5)
        loop.stop_event.set()
        return loop.results

    assert asyncio.run(scenario()) == []
    assert runner.calls == []


def test_stop_during_a_cycle_waits_for_it(
    tmp_path: Path, queue: SqliteDispatchQueue, clock: FakeClock
) -> None:
    runner = ScriptedRunner({"a": "block"})

    async def scenario() -> list[CycleResult]:
        loop = make_loop(tmp_path, queue, runner, clock)
        await loop.sleep.advance()
        await asyncio.wait_for(runner.started.wait(), 5)
        loop.stop_event.set()
        await asyncio.sleep(0.01)
        assert not loop.task.done()  # graceful: the in-flight run is still going
        runner.release.set()
        await asyncio.wait_for(loop.task, 5)
        return loop.results

    results = asyncio.run(scenario())
    assert [(r.tick, r.succeeded) for r in results] == [(at(10, 10), 1)]
    assert queue.list("k1")[0].status is DispatchStatus.DONE


def test_cancelling_the_loop_abandons_in_flight_dispatches(
    tmp_path: Path, queue: SqliteDispatchQueue, clock: FakeClock
) -> None:
    runner = ScriptedRunner({"a": "hang"})

    async def scenario() -> None:
        loop = make_loop(tmp_path, queue, runner, clock)
        await loop.sleep.advance()
        await asyncio.wait_for(runner.started.wait(), 5)
        loop.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loop.task
        await wait_until(lambda: runner.cancelled == ["a"], what="the run to be cancelled")

    asyncio.run(scenario())
    row = queue.list("k1")[0]
    assert (row.status, row.worker_id) == (DispatchStatus.RUNNING, "s1")  # lease left to expire


class FlakyQueue(SqliteDispatchQueue):
    """Fails the first active_per_agent call, like a store that blipped."""

    failures = 1

    def active_per_agent(self, kernel_id: str) -> Any:
        if self.failures:
            self.failures -= 1
            raise StoreError("database is locked")
        return super().active_per_agent(kernel_id)


def test_a_failed_cycle_does_not_stop_the_loop(
    tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    queue = FlakyQueue(tmp_path / "flaky.db", clock=clock)
    queue.ensure_schema()
    runner = ScriptedRunner()

    async def scenario() -> list[CycleResult]:
        loop = make_loop(tmp_path, queue, runner, clock)
        await loop.sleep.advance()  # 10:10 fails
        await wait_until(lambda: "failed" in caplog.text, what="the failed cycle")
        await loop.tick(expect_results=1)  # 10:20 works
        await loop.finish()
        return loop.results

    with caplog.at_level(logging.ERROR, logger="fsm_kernel.scheduler.engine"):
        try:
            results = asyncio.run(scenario())
        finally:
            queue.close()
    assert [(r.tick, r.tick_skipped, r.succeeded) for r in results] == [(at(10, 20), None, 1)]
    assert "cycle of tick 2026-02-11 10:10:00+00:00 failed" in caplog.text
