"""`DispatchQueue.wake_waiting` (issue 27, part 2: timers woken through the dispatch queue), on
SQLite and PostgreSQL: a waiting dispatch whose run's timer is due becomes pending again with its
run, its worker and lease cleared and its attempts restarted; the one-active-dispatch-per-agent
index refuses it while its agent has another active dispatch (it stays waiting); a woken dispatch
is claimed, reclaimed and abandoned with attempts of its own, settled by a resume by hand,
cancelled with a message saying its run still waits; PostgreSQL notifies idle workers, and a
conflicting enqueue that commits while the wake waits is a refusal, not a store failure."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from fsm_kernel.errors import StoreConflictError
from fsm_kernel.scheduler import Dispatch, DispatchQueue, DispatchStatus, open_queue
from fsm_kernel.scheduler.queue import CANCELLED_WOKEN, SqliteDispatchQueue
from tests.unit.test_scheduler_fakes import FakeClock, pg_url

K = "k1"
LEASE = 60.0


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "runs.db")
    return pg_url(request.getfixturevalue("pg_dsn"))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def queue(store: str, clock: FakeClock) -> Iterator[DispatchQueue]:
    q = open_queue(store, clock=clock)
    yield q
    q.close()


def enqueue(queue: DispatchQueue, agent: str = "a", key: str = "t0") -> Dispatch:
    dispatch = queue.enqueue(K, agent, f"prompt for {agent}", 5, f"{K}:{agent}:{key}")
    assert dispatch is not None
    return dispatch


def suspended(queue: DispatchQueue, run_id: str = "r1", agent: str = "a") -> Dispatch:
    """A dispatch whose run suspended: claimed by worker w1 and completed `waiting`."""
    enqueue(queue, agent)
    claimed = queue.claim(K, "w1", LEASE, 3)
    assert claimed is not None
    return queue.complete(
        claimed.dispatch_id, "w1", status=DispatchStatus.WAITING, run_id=run_id, attempt=1
    )


def test_a_waiting_dispatch_is_woken_pending_with_its_run_and_attempts_restarted(
    queue: DispatchQueue, clock: FakeClock
) -> None:
    waiting = suspended(queue)
    clock.advance(3600)

    woken = queue.wake_waiting("r1")

    assert woken is not None
    assert (woken.dispatch_id, woken.status, woken.run_id) == (
        waiting.dispatch_id,
        DispatchStatus.PENDING,
        "r1",
    )
    assert (woken.worker_id, woken.lease_expires_at, woken.finished_at) == (None, None, None)
    assert (woken.attempts, woken.max_attempts) == (0, 3)
    assert (woken.error, woken.termination_reason, woken.cancel_requested_at) == (None,) * 3
    assert (woken.created_at, woken.priority, woken.prompt) == (
        waiting.created_at,
        5,
        "prompt for a",
    )
    assert queue.wake_waiting("r1") is None  # pending already: nothing waits on r1 now
    claimed = queue.claim(K, "w2", LEASE, 3)
    assert claimed is not None
    assert (claimed.dispatch_id, claimed.run_id, claimed.worker_id, claimed.attempts) == (
        waiting.dispatch_id,
        "r1",
        "w2",
        1,
    )
    assert queue.dispatch_of_run("r1") == claimed
    assert queue.wake_waiting("unknown-run") is None
    assert queue.dispatch_of_run("unknown-run") is None


def test_a_woken_dispatch_is_claimed_before_newer_ones_of_its_priority(
    queue: DispatchQueue, clock: FakeClock
) -> None:
    waiting = suspended(queue)
    clock.advance(10)
    newer = enqueue(queue, "b")
    assert queue.wake_waiting("r1") is not None

    first = queue.claim(K, "w2", LEASE, 3)

    assert first is not None
    assert first.dispatch_id == waiting.dispatch_id  # older creation time, same priority
    second = queue.claim(K, "w2", LEASE, 3)
    assert second is not None
    assert second.dispatch_id == newer.dispatch_id


def test_waking_is_refused_while_the_agent_has_another_active_dispatch(
    queue: DispatchQueue,
) -> None:
    waiting = suspended(queue)
    newer = enqueue(queue, "a", key="t1")  # the next tick dispatched the agent afresh

    with pytest.raises(StoreConflictError, match=rf"{newer.dispatch_id} is pending") as refused:
        queue.wake_waiting("r1")
    assert f"dispatch {waiting.dispatch_id} (run r1) stays waiting" in str(refused.value)
    current = queue.get(waiting.dispatch_id)
    assert current is not None
    assert current.status is DispatchStatus.WAITING
    assert current.finished_at == waiting.finished_at  # untouched

    running = queue.claim(K, "w2", LEASE, 3)
    assert running is not None
    assert running.dispatch_id == newer.dispatch_id
    with pytest.raises(StoreConflictError, match=rf"{newer.dispatch_id} is running"):
        queue.wake_waiting("r1")

    queue.complete(newer.dispatch_id, "w2", status=DispatchStatus.DONE, attempt=1)
    woken = queue.wake_waiting("r1")  # the next tick tries again, and now it may
    assert woken is not None
    assert woken.status is DispatchStatus.PENDING


def test_a_woken_dispatch_has_max_attempts_of_its_own(
    queue: DispatchQueue, clock: FakeClock
) -> None:
    """The first leg used two claims (a worker died); the woken leg still gets three."""
    enqueue(queue)
    first = queue.claim(K, "w1", LEASE, 3)
    assert first is not None
    clock.advance(LEASE + 1)
    again = queue.claim(K, "w2", LEASE, 3)
    assert again is not None
    assert again.attempts == 2
    queue.complete(again.dispatch_id, "w2", status="waiting", run_id="r1", attempt=2)
    assert queue.wake_waiting("r1") is not None

    attempts = []
    for worker in ("w3", "w4", "w5"):
        claimed = queue.claim(K, worker, LEASE, 3)
        assert claimed is not None
        attempts.append(claimed.attempts)
        clock.advance(LEASE + 1)  # each worker dies
    assert attempts == [1, 2, 3]
    assert queue.claim(K, "w6", LEASE, 3) is None  # reaped instead
    ended = queue.get(again.dispatch_id)
    assert ended is not None
    assert (ended.status, ended.error, ended.run_id) == (
        DispatchStatus.FAILED,
        "abandoned after 3 attempts: lease expired",
        "r1",
    )


def test_a_run_resumed_by_hand_settles_its_woken_dispatch_before_a_worker_takes_it(
    queue: DispatchQueue,
) -> None:
    waiting = suspended(queue)
    assert queue.wake_waiting("r1") is not None

    settled = queue.settle_waiting("r1", status="done", termination_reason="final_answer")

    assert settled is not None
    assert (settled.dispatch_id, settled.status, settled.termination_reason) == (
        waiting.dispatch_id,
        DispatchStatus.DONE,
        "final_answer",
    )
    assert queue.claim(K, "w2", LEASE, 3) is None  # no worker resumes an ended run


def test_cancelling_a_woken_dispatch_says_its_run_still_waits(queue: DispatchQueue) -> None:
    waiting = suspended(queue)
    assert queue.wake_waiting("r1") is not None

    cancelled = queue.cancel(K, waiting.dispatch_id)

    assert cancelled is not None
    assert (cancelled.status, cancelled.error) == (DispatchStatus.CANCELLED, CANCELLED_WOKEN)
    assert queue.wake_waiting("r1") is None  # not woken again: it was cancelled
    found = queue.dispatch_of_run("r1")
    assert found is not None
    assert found.status is DispatchStatus.CANCELLED


def test_a_store_without_a_dispatch_queue_has_nothing_to_wake(tmp_path: Path) -> None:
    queue = SqliteDispatchQueue(tmp_path / "events-only.db")  # no ensure_schema: no table
    try:
        assert queue.wake_waiting("r1") is None
        assert queue.dispatch_of_run("r1") is None
    finally:
        queue.close()


@pytest.mark.postgres
def test_waking_notifies_idle_workers_like_an_enqueue(pg_dsn: str) -> None:
    import asyncio

    from fsm_kernel.scheduler.pg_queue import PostgresDispatchListener

    store = pg_url(pg_dsn)
    queue = open_queue(store)
    try:
        waiting = suspended(queue)

        async def scenario() -> list[tuple[str, str]]:
            async with PostgresDispatchListener(store, K) as listener:
                connected = await asyncio.wait_for(listener.get(), 10)
                await asyncio.to_thread(queue.wake_waiting, "r1")
                woken = await asyncio.wait_for(listener.get(), 10)
            return [(s.kind, s.dispatch_id) for s in (connected, woken)]

        signals = asyncio.run(scenario())
    finally:
        queue.close()
    assert signals == [("reconnected", ""), ("enqueued", waiting.dispatch_id)]


@pytest.mark.postgres
def test_an_enqueue_committed_while_the_wake_waits_is_a_refusal(pg_dsn: str) -> None:
    """The wake's NOT EXISTS check cannot see another transaction's uncommitted dispatch of the
    agent; the unique index then waits for it and refuses the row once it commits."""
    import psycopg

    store = pg_url(pg_dsn)
    queue = open_queue(store)
    try:
        waiting = suspended(queue)
        outcome: list[BaseException | Dispatch | None] = []
        with psycopg.connect(store) as other:  # a transaction, left open
            other.execute(
                "INSERT INTO kernel_dispatch_tasks (dispatch_id, kernel_id, agent_id, prompt, "
                "status, created_at) VALUES ('racer', %s, 'a', 'p', 'pending', now())",
                (K,),
            )

            def wake() -> None:
                try:
                    outcome.append(queue.wake_waiting("r1"))
                except BaseException as exc:  # reported below
                    outcome.append(exc)

            thread = threading.Thread(target=wake)
            thread.start()
            waits = _wait_for_lock_wait(store)
            other.commit()
            thread.join(10)
        assert waits, "the wake never waited on the uncommitted row"
        assert len(outcome) == 1
        assert isinstance(outcome[0], StoreConflictError), outcome
        assert "racer is pending" in str(outcome[0])
        current = queue.get(waiting.dispatch_id)
        assert current is not None
        assert current.status is DispatchStatus.WAITING
    finally:
        queue.close()


def _wait_for_lock_wait(store: str) -> bool:
    """Whether a session came to wait on a lock (the wake, behind the open transaction)."""
    import time

    import psycopg

    with psycopg.connect(store, autocommit=True) as conn:
        for _ in range(400):
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND datname = current_database()"
            ).fetchone()
            if row is not None and row[0] > 0:
                return True
            time.sleep(0.025)
    return False


def test_another_agents_active_dispatch_does_not_block_the_wake(
    queue: DispatchQueue, clock: FakeClock
) -> None:
    suspended(queue, run_id="r1", agent="a")
    enqueue(queue, "b", key="t1")
    clock.advance(timedelta(minutes=1).total_seconds())

    woken = queue.wake_waiting("r1")

    assert woken is not None  # b's pending dispatch does not block a's
    assert woken.agent_id == "a"
