"""Instant wake-up on PostgreSQL: idle workers polling only once a minute start new work as soon as
it is enqueued, and take a freed slot as soon as a dispatch ends (LISTEN/NOTIFY); when the
listening connection dies, polling carries on and the listener comes back.

The bounds asserted (a second or two) are far above the ~5 ms a wake-up takes and far below the
60 s poll they must beat: they prove the notification path, not a speed (the benchmark measures
that: benchmarks/dispatch_queue.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from fsm_kernel.scheduler import (
    AgentSpec,
    DispatchDetail,
    DispatchQueue,
    ExecutionStatus,
    QueueSignal,
    RunOutcome,
    SchedulerConfig,
    Worker,
    open_queue,
)
from fsm_kernel.scheduler.pg_queue import PostgresDispatchListener
from tests.unit.test_scheduler_fakes import pg_url

pytestmark = pytest.mark.postgres

K = "wake"
BOUND = 2.0


@pytest.fixture
def store(pg_dsn: str) -> str:
    return pg_url(pg_dsn)


@pytest.fixture
def queue(store: str) -> Iterator[DispatchQueue]:
    q = open_queue(store)
    yield q
    q.close()


def config(store: str, *, max_concurrent: int = 3, poll: float = 60.0) -> SchedulerConfig:
    return SchedulerConfig(
        kernel_id=K,
        store=store,
        max_concurrent=max_concurrent,
        poll_seconds=poll,
        lease_seconds=60,
        agents=tuple(AgentSpec(agent_id=f"a{i}", prompt="p") for i in range(6)),
    )


class Recorder:
    """A runner noting when each run starts; runs of agents in `hold` wait for `release`."""

    def __init__(self, hold: tuple[str, ...] = ()) -> None:
        self.started: dict[str, float] = {}
        self.hold = hold
        self.release = asyncio.Event()

    async def __call__(self, agent: AgentSpec, prompt: str) -> RunOutcome:
        self.started[agent.agent_id] = time.monotonic()
        if agent.agent_id in self.hold:
            await self.release.wait()
        return RunOutcome(ok=True)


async def until(check: Any, what: str) -> None:
    deadline = time.monotonic() + 10
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def test_an_idle_worker_starts_enqueued_work_at_once(store: str, queue: DispatchQueue) -> None:
    runner = Recorder()
    latencies: list[float] = []

    async def scenario() -> None:
        worker = Worker(config(store), open_queue(store), runner)
        task = asyncio.create_task(worker.run())
        await asyncio.wait_for(worker.listening.wait(), 10)
        for i in range(5):
            await asyncio.sleep(0.1)  # idle: its one look at the queue found nothing
            sent = time.monotonic()
            await asyncio.to_thread(queue.enqueue, K, f"a{i}", "p", 0, f"k{i}")
            await until(lambda i=i: f"a{i}" in runner.started, f"the run of a{i}")
            latencies.append(runner.started[f"a{i}"] - sent)
        worker.stop()
        await asyncio.wait_for(task, 10)
        worker.queue.close()

    asyncio.run(scenario())
    assert max(latencies) < BOUND, latencies  # the poll interval is 60 s


def test_a_freed_slot_wakes_a_worker_waiting_for_one(store: str, queue: DispatchQueue) -> None:
    """max_concurrent 1: worker X runs a0; worker Y waits for the slot with a0's end as its only
    cue (X stops claiming before a0 ends)."""
    x_runner, y_runner = Recorder(hold=("a0",)), Recorder()
    y_results: list[DispatchDetail] = []

    async def scenario() -> float:
        x = Worker(config(store, max_concurrent=1), open_queue(store), x_runner)
        x_task = asyncio.create_task(x.run())
        await asyncio.to_thread(queue.enqueue, K, "a0", "p", 0, "k0")
        await until(lambda: "a0" in x_runner.started, "X's run")
        y = Worker(
            config(store, max_concurrent=1), open_queue(store), y_runner, on_result=y_results.append
        )
        y_task = asyncio.create_task(y.run())
        await asyncio.wait_for(y.listening.wait(), 10)
        await asyncio.to_thread(queue.enqueue, K, "a1", "p", 0, "k1")
        await asyncio.sleep(0.3)  # Y looked, found no free slot, and now waits
        assert y_runner.started == {}
        x.stop()  # X finishes a0 but claims nothing more
        ended = time.monotonic()
        x_runner.release.set()
        await until(lambda: "a1" in y_runner.started, "Y's run")
        latency = y_runner.started["a1"] - ended
        for worker, task in ((x, x_task), (y, y_task)):
            worker.stop()
            await asyncio.wait_for(task, 10)
            worker.queue.close()
        return latency

    latency = asyncio.run(scenario())
    assert latency < BOUND
    assert [d.status for d in y_results] == [ExecutionStatus.DONE]


def test_polling_carries_on_while_the_listener_is_down_and_it_comes_back(
    store: str, queue: DispatchQueue
) -> None:
    import psycopg

    runner = Recorder()

    async def scenario() -> None:
        worker = Worker(config(store, poll=0.2), open_queue(store), runner)
        task = asyncio.create_task(worker.run())
        await asyncio.wait_for(worker.listening.wait(), 10)
        with psycopg.connect(store, autocommit=True) as conn:  # the server drops the listener
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE query LIKE 'LISTEN %%' AND pid <> pg_backend_pid()"
            )
        worker.listening.clear()
        await asyncio.to_thread(queue.enqueue, K, "a0", "p", 0, "k0")
        await until(lambda: "a0" in runner.started, "the run found by polling")
        await asyncio.wait_for(worker.listening.wait(), 10)  # reconnected (retry after 1 s)
        worker.stop()
        await asyncio.wait_for(task, 10)
        worker.queue.close()

    asyncio.run(scenario())
    assert set(runner.started) == {"a0"}


def test_the_listener_passes_on_its_kernels_signals_only(store: str, queue: DispatchQueue) -> None:
    async def scenario() -> list[QueueSignal]:
        got: list[QueueSignal] = []
        async with PostgresDispatchListener(store, K) as listener:
            got.append(await asyncio.wait_for(listener.get(), 10))  # connected
            other = await asyncio.to_thread(queue.enqueue, "another-kernel", "a0", "p", 0, "o")
            mine = await asyncio.to_thread(queue.enqueue, K, "a0", "p", 0, "m")
            assert other is not None
            assert mine is not None
            got.append(await asyncio.wait_for(listener.get(), 10))
            claimed = await asyncio.to_thread(queue.claim, K, "w", 60, 3)
            assert claimed is not None
            await asyncio.to_thread(queue.cancel, K, mine.dispatch_id)
            got.append(await asyncio.wait_for(listener.get(), 10))
        return got

    signals = asyncio.run(scenario())
    assert [s.kind for s in signals] == ["reconnected", "enqueued", "cancel"]
    assert {s.kernel_id for s in signals} == {K}
    assert signals[1].dispatch_id == signals[2].dispatch_id


def _connections(store: str) -> int:
    """Clients connected to the store's database, this one left out. Client backends only:
    an autovacuum worker visiting the database after the enqueues shows there too."""
    import psycopg

    with psycopg.connect(store, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
        ).fetchone()
    assert row is not None
    return int(row[0])


async def _started(store: str, runner: Recorder) -> tuple[Worker, int, int]:
    """A worker of `store`, started: it, and the server's connections before and after."""
    worker = Worker(config(store), open_queue(store), runner)
    before = await asyncio.to_thread(_connections, store)
    await worker.start()
    return worker, before, await asyncio.to_thread(_connections, store)


def test_start_connects_and_listens_before_the_first_claim(
    store: str, queue: DispatchQueue
) -> None:
    """A started worker is ready: its claim connection is open and it LISTENs, yet it has
    claimed nothing; run() then takes the work at once, on those connections."""
    runner = Recorder()
    queue.enqueue(K, "a0", "p", 0, "k0")

    async def scenario() -> tuple[int, int, int]:
        worker, before, started = await _started(store, runner)
        assert worker.listening.is_set()
        await worker.start()  # idempotent: nothing more is opened
        assert await asyncio.to_thread(_connections, store) == started
        await asyncio.sleep(0.2)
        assert runner.started == {}  # start() claims nothing
        assert [d.status.value for d in queue.list(K)] == ["pending"]
        task = asyncio.create_task(worker.run())
        await until(lambda: "a0" in runner.started, "the run")
        running = await asyncio.to_thread(_connections, store)
        worker.stop()
        await asyncio.wait_for(task, 10)
        worker.queue.close()
        return before, started, running

    before, started, running = asyncio.run(scenario())
    assert started - before == 2  # the claim connection and the listener's
    assert running == started  # run() opened no other


def test_start_fails_at_once_on_an_unreachable_server() -> None:
    from fsm_kernel.errors import StoreError
    from fsm_kernel.scheduler.pg_queue import PostgresDispatchQueue

    unreachable = "postgresql://fsm@127.0.0.1:9/none?connect_timeout=2"
    worker = Worker(config(unreachable), PostgresDispatchQueue(unreachable), Recorder())

    async def scenario() -> None:
        for _ in range(2):  # not marked started by a failed attempt: the second tries again
            with pytest.raises(StoreError, match="unavailable"):
                await worker.start()
        assert not worker.listening.is_set()

    asyncio.run(scenario())


def test_a_worker_started_then_stopped_before_it_ran_stops_listening(
    store: str, queue: DispatchQueue
) -> None:
    """stop() between start() and run() (Ctrl-C while `fsm-kernel worker` connects): the
    listener's connection closes; run() then returns at once, claiming nothing."""
    runner = Recorder()
    queue.enqueue(K, "a0", "p", 0, "k0")

    async def scenario() -> tuple[int, int, int]:
        worker, before, started = await _started(store, runner)
        worker.stop()
        deadline = time.monotonic() + 10
        while await asyncio.to_thread(_connections, store) != started - 1:
            assert time.monotonic() < deadline, "the listener's connection stayed open"
            await asyncio.sleep(0.05)
        await asyncio.wait_for(worker.run(), 10)
        after_run = await asyncio.to_thread(_connections, store)
        worker.queue.close()
        return before, started, after_run

    before, started, after_run = asyncio.run(scenario())
    assert started - before == 2
    assert after_run == started - 1  # run() listened to nothing more
    assert runner.started == {}
    assert [d.status.value for d in queue.list(K)] == ["pending"]
