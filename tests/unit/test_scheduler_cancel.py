"""Cancellation and the attempt limit as the executor, the Worker and the Scheduler see them (real
SQLite queue, scripted runners): a cancel request stops the run within one heartbeat (at once
with a listener's signal), the runner's own report of the cancelled run is kept, and a dispatch
abandoned after max_attempts frees its agent for the same tick."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fsm_kernel.scheduler import (
    AgentSpec,
    DispatchDetail,
    DispatchStatus,
    ExecutionStatus,
    QueueSignal,
    RunOutcome,
    Scheduler,
    Worker,
    open_queue,
)
from fsm_kernel.scheduler.queue import SqliteDispatchQueue
from tests.unit.test_scheduler_fakes import FakeClock, ScriptedRunner, make_config, wait_until


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def queue(tmp_path: Path, clock: FakeClock) -> Iterator[SqliteDispatchQueue]:
    q = open_queue(str(tmp_path / "runs.db"), clock=clock)
    assert isinstance(q, SqliteDispatchQueue)
    yield q
    q.close()


class KernelLikeRunner:
    """Like the kernel: a cancelled run is not an exception but a result, recorded as
    `cancelled`, with its run id."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled_at: float | None = None

    async def __call__(self, agent: AgentSpec, prompt: str) -> RunOutcome:
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled_at = time.monotonic()
            task = asyncio.current_task()
            assert task is not None
            task.uncancel()
            return RunOutcome(ok=False, run_id="run-42", termination_reason="cancelled")
        raise AssertionError("unreachable")


def start_worker(
    tmp_path: Path, queue: Any, runner: Any, results: list[DispatchDetail], **config: Any
) -> Worker:
    poll = config.pop("poll", 0.01)
    return Worker(
        make_config(tmp_path, config.pop("agents", ["a", "b"]), **config),
        queue,
        runner,
        worker_id="w1",
        poll_seconds=poll,
        on_result=results.append,
    )


def test_a_cancel_request_stops_the_run_at_the_next_heartbeat(
    tmp_path: Path, queue: SqliteDispatchQueue
) -> None:
    dispatch = queue.enqueue("k1", "a", "task", 0, "a1")
    assert dispatch is not None
    runner = KernelLikeRunner()
    results: list[DispatchDetail] = []
    worker = start_worker(tmp_path, queue, runner, results, heartbeat_seconds=0.05)

    async def scenario() -> float:
        task = asyncio.create_task(worker.run())
        await asyncio.wait_for(runner.started.wait(), 5)
        requested = time.monotonic()
        assert queue.cancel("k1", dispatch.dispatch_id) is not None
        await wait_until(lambda: len(results) == 1, what="the cancelled dispatch")
        worker.stop()
        await asyncio.wait_for(task, 5)
        return requested

    requested = asyncio.run(scenario())
    assert runner.cancelled_at is not None
    assert runner.cancelled_at - requested < 2.0  # one heartbeat is 0.05 s
    assert [(d.status, d.run_id, d.termination_reason) for d in results] == [
        (ExecutionStatus.CANCELLED, "run-42", "cancelled")
    ]
    row = queue.get(dispatch.dispatch_id)
    assert row is not None
    assert (row.status, row.run_id, row.termination_reason, row.error) == (
        DispatchStatus.CANCELLED,
        "run-42",
        "cancelled",
        "cancelled on request",
    )


def test_a_runner_that_lets_the_cancellation_through_still_ends_cancelled(
    tmp_path: Path, queue: SqliteDispatchQueue
) -> None:
    dispatch = queue.enqueue("k1", "a", "task", 0, "a1")
    assert dispatch is not None
    runner = ScriptedRunner({"a": "hang"})
    results: list[DispatchDetail] = []
    worker = start_worker(tmp_path, queue, runner, results, heartbeat_seconds=0.02)

    async def scenario() -> None:
        task = asyncio.create_task(worker.run())
        await asyncio.wait_for(runner.started.wait(), 5)
        queue.cancel("k1", dispatch.dispatch_id)
        await wait_until(lambda: len(results) == 1, what="the cancelled dispatch")
        worker.stop()
        await asyncio.wait_for(task, 5)

    asyncio.run(scenario())
    assert runner.cancelled == ["a"]
    assert results[0].status is ExecutionStatus.CANCELLED
    assert results[0].run_id is None
    row = queue.get(dispatch.dispatch_id)
    assert row is not None
    assert (row.status, row.termination_reason) == (DispatchStatus.CANCELLED, "cancelled")


class SignallingQueue(SqliteDispatchQueue):
    """The SQLite queue with a listener the test feeds, as PostgreSQL's NOTIFY would."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.signals: asyncio.Queue[QueueSignal] | None = None

    def listener(self, kernel_id: str) -> Any:
        self.signals = asyncio.Queue()
        self.signals.put_nowait(QueueSignal("reconnected", kernel_id))
        return FakeListener(self.signals)


class FakeListener:
    def __init__(self, signals: asyncio.Queue[QueueSignal]) -> None:
        self.signals = signals

    async def __aenter__(self) -> FakeListener:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def get(self) -> QueueSignal:
        return await self.signals.get()


def test_signals_wake_an_idle_worker_and_cancel_a_run_without_waiting(
    tmp_path: Path, clock: FakeClock
) -> None:
    queue = SignallingQueue(tmp_path / "sig.db", clock=clock)
    queue.ensure_schema()
    runner = KernelLikeRunner()
    results: list[DispatchDetail] = []
    # Polling and heartbeats far too slow to explain anything below.
    worker = start_worker(
        tmp_path, queue, runner, results, poll=60.0, lease_seconds=600, heartbeat_seconds=300
    )

    async def scenario() -> None:
        task = asyncio.create_task(worker.run())
        await asyncio.wait_for(worker.listening.wait(), 5)
        await asyncio.sleep(0.05)  # idle now: the first look found nothing
        dispatch = queue.enqueue("k1", "a", "task", 0, "a1")
        assert dispatch is not None
        assert queue.signals is not None
        queue.signals.put_nowait(QueueSignal("enqueued", "k1", dispatch.dispatch_id))
        await asyncio.wait_for(runner.started.wait(), 5)
        queue.cancel("k1", dispatch.dispatch_id)
        queue.signals.put_nowait(QueueSignal("cancel", "k1", dispatch.dispatch_id))
        queue.signals.put_nowait(QueueSignal("cancel", "k1", "not-running-here"))
        await wait_until(lambda: len(results) == 1, what="the cancelled dispatch")
        worker.stop()
        await asyncio.wait_for(task, 5)

    try:
        asyncio.run(scenario())
    finally:
        queue.close()
    assert [(d.status, d.run_id) for d in results] == [(ExecutionStatus.CANCELLED, "run-42")]


def test_the_timeout_keeps_the_run_id_the_cancelled_runner_reports(
    tmp_path: Path, queue: SqliteDispatchQueue, clock: FakeClock
) -> None:
    config = make_config(tmp_path, ["a"], timeout_seconds=0.05)
    runner = KernelLikeRunner()
    sched = Scheduler(config, queue, runner, clock=clock, worker_id="s1")
    result = asyncio.run(sched.run_cycle())
    assert [(d.status, d.run_id, d.termination_reason) for d in result.details] == [
        (ExecutionStatus.FAILED, "run-42", "timeout")
    ]


def test_the_schedulers_own_runs_notice_a_cancel_at_their_heartbeat(
    tmp_path: Path, queue: SqliteDispatchQueue, clock: FakeClock
) -> None:
    config = make_config(tmp_path, ["a", "b"], heartbeat_seconds=0.02)
    runner = ScriptedRunner({"a": "hang"})
    sched = Scheduler(config, queue, runner, clock=clock, worker_id="s1")

    async def scenario() -> Any:
        cycle = asyncio.create_task(sched.run_cycle())
        await wait_until(lambda: "a" in runner.agent_ids(), what="a's run")
        running = next(d for d in queue.list("k1") if d.agent_id == "a")
        queue.cancel("k1", running.dispatch_id)
        return await asyncio.wait_for(cycle, 5)

    result = asyncio.run(scenario())
    assert (result.succeeded, result.failed, result.cancelled) == (1, 0, 1)
    assert result.to_dict()["cancelled"] == 1
    assert {d.agent_id: d.status.value for d in queue.list("k1")} == {
        "a": "cancelled",
        "b": "done",
    }


def test_a_tick_abandons_an_exhausted_dispatch_and_plans_its_agent_afresh(
    tmp_path: Path, queue: SqliteDispatchQueue, clock: FakeClock
) -> None:
    config = make_config(tmp_path, ["a"], max_attempts=2, lease_seconds=60)
    stuck = queue.enqueue("k1", "a", "old", 0, "old", max_attempts=2)
    assert stuck is not None
    for _ in range(2):  # two workers died holding it
        assert queue.claim("k1", "dead", 60, 3) is not None
        clock.advance(61)
    runner = ScriptedRunner()
    result = asyncio.run(Scheduler(config, queue, runner, clock=clock).run_cycle())

    assert (result.dispatched, result.succeeded, result.skipped) == (1, 1, 0)
    assert runner.calls == [("a", "a: ")]
    old = queue.get(stuck.dispatch_id)
    assert old is not None
    assert (old.status, old.attempts, old.error) == (
        DispatchStatus.FAILED,
        2,
        "abandoned after 2 attempts: lease expired",
    )
    new = next(d for d in queue.list("k1") if d.dispatch_id != stuck.dispatch_id)
    assert (new.status, new.max_attempts) == (DispatchStatus.DONE, 2)
