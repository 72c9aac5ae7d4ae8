"""The Worker: claims and executes dispatches only (real SQLite queue, scripted runners)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fsm_kernel.errors import StoreError
from fsm_kernel.scheduler import DispatchDetail, DispatchStatus, ExecutionStatus, Worker, open_queue
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


def enqueue_all(queue: SqliteDispatchQueue, agents: list[str]) -> None:
    for agent in agents:
        assert queue.enqueue("k1", agent, f"task for {agent}", 0, f"key-{agent}") is not None


def make_worker(
    tmp_path: Path, queue: Any, runner: Any, results: list[DispatchDetail], **config: Any
) -> Worker:
    agents = config.pop("agents", ["a", "b", "c", "d"])
    return Worker(
        make_config(tmp_path, agents, **config),
        queue,
        runner,
        worker_id="w1",
        poll_seconds=0.01,
        on_result=results.append,
    )


def test_worker_runs_queued_dispatches_within_the_cap(
    tmp_path: Path, queue: SqliteDispatchQueue
) -> None:
    enqueue_all(queue, ["a", "b", "c", "d"])
    runner = ScriptedRunner({"c": "raise"}, hold_until_peak=2)
    results: list[DispatchDetail] = []
    worker = make_worker(tmp_path, queue, runner, results, max_concurrent=2)

    async def scenario() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        await wait_until(lambda: len(results) == 4, what="four dispatches")
        stop.set()
        await asyncio.wait_for(task, 5)

    asyncio.run(scenario())
    assert runner.peak == 2
    assert sorted(runner.calls) == [(a, f"task for {a}") for a in "abcd"]
    rows = {d.agent_id: d for d in queue.list("k1")}
    assert {a: r.status.value for a, r in rows.items()} == {
        "a": "done",
        "b": "done",
        "c": "failed",
        "d": "done",
    }
    assert {r.worker_id for r in rows.values()} == {"w1"}
    assert rows["c"].error == "RuntimeError: boom in c"


def test_worker_picks_up_work_enqueued_later(tmp_path: Path, queue: SqliteDispatchQueue) -> None:
    runner = ScriptedRunner()
    results: list[DispatchDetail] = []
    worker = make_worker(tmp_path, queue, runner, results)

    async def scenario() -> None:
        task = asyncio.create_task(worker.run())
        await asyncio.sleep(0.03)  # a few empty polls
        enqueue_all(queue, ["a"])
        await wait_until(lambda: len(results) == 1, what="the late dispatch")
        worker.stop()
        worker.stop()
        await asyncio.wait_for(task, 5)

    asyncio.run(scenario())
    assert [(d.agent_id, d.status) for d in results] == [("a", ExecutionStatus.DONE)]


def test_worker_stop_lets_in_flight_finish(tmp_path: Path, queue: SqliteDispatchQueue) -> None:
    enqueue_all(queue, ["a", "b"])
    runner = ScriptedRunner({"a": "block", "b": "block"})
    results: list[DispatchDetail] = []
    worker = make_worker(tmp_path, queue, runner, results, max_concurrent=1)

    async def scenario() -> None:
        task = asyncio.create_task(worker.run())
        await asyncio.wait_for(runner.started.wait(), 5)
        worker.stop()
        runner.release.set()
        await asyncio.wait_for(task, 5)

    asyncio.run(scenario())
    assert [d.status for d in results] == [ExecutionStatus.DONE]
    assert sorted(d.status.value for d in queue.list("k1")) == ["done", "pending"]


def test_worker_abandon_leaves_leases_to_expire(
    tmp_path: Path, queue: SqliteDispatchQueue, clock: FakeClock
) -> None:
    enqueue_all(queue, ["a", "b"])
    runner = ScriptedRunner({"a": "hang", "b": "hang"}, hold_until_peak=2)
    results: list[DispatchDetail] = []
    worker = make_worker(tmp_path, queue, runner, results, max_concurrent=2, lease_seconds=60)

    async def scenario() -> None:
        task = asyncio.create_task(worker.run())
        await wait_until(lambda: runner.active == 2, what="two runs")
        worker.stop(abandon=True)
        await asyncio.wait_for(task, 5)

    asyncio.run(scenario())
    assert [d.status for d in results] == [ExecutionStatus.ABANDONED] * 2
    assert sorted(runner.cancelled) == ["a", "b"]
    assert {d.status for d in queue.list("k1")} == {DispatchStatus.RUNNING}
    clock.advance(61)
    assert queue.claim("k1", "w2", 60, 2) is not None


def test_cancelling_the_worker_abandons_its_runs(
    tmp_path: Path, queue: SqliteDispatchQueue
) -> None:
    enqueue_all(queue, ["a"])
    runner = ScriptedRunner({"a": "hang"})
    worker = make_worker(tmp_path, queue, runner, [])

    async def scenario() -> None:
        task = asyncio.create_task(worker.run())
        await asyncio.wait_for(runner.started.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: runner.cancelled == ["a"], what="the run to be cancelled")

    asyncio.run(scenario())
    assert queue.list("k1")[0].status is DispatchStatus.RUNNING


class FlakyClaimQueue(SqliteDispatchQueue):
    failures = 2

    def complete_and_claim(self, *args: Any, **kwargs: Any) -> Any:
        if self.failures:
            self.failures -= 1
            raise StoreError("connection refused")
        return super().complete_and_claim(*args, **kwargs)


def test_claim_failures_are_retried(tmp_path: Path, clock: FakeClock) -> None:
    queue = FlakyClaimQueue(tmp_path / "flaky.db", clock=clock)
    queue.ensure_schema()
    enqueue_all(queue, ["a"])
    results: list[DispatchDetail] = []
    worker = make_worker(tmp_path, queue, ScriptedRunner(), results)

    async def scenario() -> None:
        task = asyncio.create_task(worker.run())
        await wait_until(lambda: len(results) == 1, what="the dispatch after two failed claims")
        worker.stop()
        await asyncio.wait_for(task, 5)

    try:
        asyncio.run(scenario())
    finally:
        queue.close()
    assert queue.failures == 0
    assert results[0].status is ExecutionStatus.DONE


def test_start_on_sqlite_opens_nothing_to_listen_with_and_run_still_works(
    tmp_path: Path, queue: SqliteDispatchQueue
) -> None:
    enqueue_all(queue, ["a"])
    runner = ScriptedRunner()
    results: list[DispatchDetail] = []
    worker = make_worker(tmp_path, queue, runner, results)

    async def scenario() -> None:
        await worker.start()
        await worker.start()
        assert not worker.listening.is_set()  # SQLite only polls
        assert [d.status for d in queue.list("k1")] == [DispatchStatus.PENDING]  # none claimed
        task = asyncio.create_task(worker.run())
        await wait_until(lambda: len(results) == 1, what="the dispatch")
        worker.stop()
        await asyncio.wait_for(task, 5)

    asyncio.run(scenario())
    assert [(d.agent_id, d.status) for d in results] == [("a", ExecutionStatus.DONE)]


class _SilentListener:
    """A listener that connects, in appearance, but never hears anything (not even that it
    is listening): a server whose LISTEN never completes."""

    def __init__(self) -> None:
        self.entered = self.exited = False

    async def __aenter__(self) -> _SilentListener:
        self.entered = True
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.exited = True

    async def get(self) -> Any:
        await asyncio.Event().wait()  # forever


class _QueueWithSilentListener:
    """The SQLite queue, with a listener that never says it listens."""

    def __init__(self, queue: SqliteDispatchQueue) -> None:
        self._queue = queue
        self.silent = _SilentListener()

    def listener(self, kernel_id: str) -> _SilentListener:
        return self.silent

    def __getattr__(self, name: str) -> Any:
        return getattr(self._queue, name)


def test_start_gives_up_waiting_for_a_listener_that_never_listens_with_a_warning(
    tmp_path: Path, queue: SqliteDispatchQueue, caplog: pytest.LogCaptureFixture
) -> None:
    quiet = _QueueWithSilentListener(queue)
    worker = make_worker(tmp_path, quiet, ScriptedRunner(), [])

    async def scenario() -> None:
        await worker.start(listen_timeout=0.05)
        assert not worker.listening.is_set()
        assert quiet.silent.entered
        assert not quiet.silent.exited
        worker.stop()  # before run(): the listener is closed now, not when the loop ends
        await wait_until(lambda: quiet.silent.exited, what="the listener closed")

    asyncio.run(scenario())
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == ["worker w1: not listening for wake-ups after 0.05s; polling meanwhile"]


def test_stop_during_start_ends_the_wait_for_the_listener_at_once(
    tmp_path: Path, queue: SqliteDispatchQueue, caplog: pytest.LogCaptureFixture
) -> None:
    """Ctrl-C while `fsm-kernel worker` waits to listen: start() returns without waiting out
    its listen_timeout (an hour here) and without the warning; run() then claims nothing."""
    enqueue_all(queue, ["a"])
    quiet = _QueueWithSilentListener(queue)
    runner = ScriptedRunner()
    worker = make_worker(tmp_path, quiet, runner, [])

    async def scenario() -> None:
        starting = asyncio.create_task(worker.start(listen_timeout=3600))
        await wait_until(lambda: quiet.silent.entered, what="the listener")
        worker.stop()
        await asyncio.wait_for(starting, 5)
        await asyncio.wait_for(worker.run(), 5)

    asyncio.run(scenario())
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert runner.calls == []
    assert [d.status for d in queue.list("k1")] == [DispatchStatus.PENDING]
