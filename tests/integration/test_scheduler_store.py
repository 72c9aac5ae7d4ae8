"""The dispatch queue contract, one body per test, run on SQLite and on PostgreSQL."""

from __future__ import annotations

import json
import sqlite3
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from fsm_kernel.errors import ConfigError, StoreConflictError, StoreError, StoreSchemaError
from fsm_kernel.scheduler import Dispatch, DispatchQueue, DispatchStatus, open_queue
from fsm_kernel.scheduler.queue import SqliteDispatchQueue
from tests.unit.test_scheduler_fakes import FakeClock, pg_url

K = "k1"


@pytest.fixture(scope="module")
def pg_module_url(pg_server_dsn: str) -> Iterator[str]:
    """One database for the module (creating one per test costs ~0.4 s each); `store` empties
    it before every test."""
    import psycopg

    name = f"t_sched_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_server_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    info = psycopg.conninfo.conninfo_to_dict(pg_server_dsn)
    info["dbname"] = name
    yield pg_url(psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()}))
    with psycopg.connect(pg_server_dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "nested" / "runs.db")
    import psycopg

    url: str = request.getfixturevalue("pg_module_url")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "DROP TABLE IF EXISTS kernel_dispatch_tasks, dispatch_tasks, scheduler_ticks, "
            "scheduler_schema CASCADE"  # the claim function goes with its table
        )
    return url


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def queue(store: str, clock: FakeClock) -> Iterator[DispatchQueue]:
    q = open_queue(store, clock=clock)
    yield q
    q.close()


def enqueue(
    queue: DispatchQueue, agent: str, priority: int = 0, key: str | None = None
) -> Dispatch:
    dispatch = queue.enqueue(K, agent, f"prompt for {agent}", priority, key or f"{K}:{agent}:t0")
    assert dispatch is not None
    return dispatch


def test_open_queue_picks_the_backend_and_schema_setup_is_idempotent(
    store: str, clock: FakeClock, queue: DispatchQueue
) -> None:
    expected = "SqliteDispatchQueue" if not store.startswith("postgresql://") else "Postgres"
    assert type(queue).__name__.startswith(expected)
    assert isinstance(queue, DispatchQueue)
    queue.ensure_schema()
    queue.ensure_schema()
    enqueue(queue, "a")
    other = open_queue(store, clock=clock)  # a second process opening the same store
    try:
        other.ensure_schema()
        assert [d.agent_id for d in other.list(K)] == ["a"]
    finally:
        other.close()


def test_a_newer_schema_is_refused(store: str, clock: FakeClock, queue: DispatchQueue) -> None:
    with queue._transaction() as conn:  # type: ignore[attr-defined]  # both adapters have it
        conn.execute("UPDATE scheduler_schema SET version = 99")
    with pytest.raises(StoreSchemaError, match="newer"):
        open_queue(store, clock=clock)


def test_enqueue_then_list_most_recent_first(queue: DispatchQueue, clock: FakeClock) -> None:
    first = enqueue(queue, "a", priority=3)
    clock.advance(1)
    second = enqueue(queue, "b")
    queue.enqueue("other-kernel", "c", "p", 0, "other:c")

    listed = queue.list(K)
    assert [d.dispatch_id for d in listed] == [second.dispatch_id, first.dispatch_id]
    assert [d.dispatch_id for d in queue.list(K, limit=1)] == [second.dispatch_id]
    row = listed[1]
    assert (row.kernel_id, row.agent_id, row.prompt, row.priority) == (K, "a", "prompt for a", 3)
    assert row.status is DispatchStatus.PENDING
    assert (row.worker_id, row.lease_expires_at, row.attempts, row.run_id) == (None, None, 0, None)
    assert row.created_at == clock.now() - timedelta(seconds=1)
    assert row.created_at.tzinfo is not None
    assert len(row.dispatch_id) == 36
    json.dumps(row.to_dict())


def test_dedupe_key_and_one_active_dispatch_per_agent(queue: DispatchQueue) -> None:
    first = enqueue(queue, "a", key="k1:a:tick1")
    assert queue.enqueue(K, "b", "p", 0, "k1:a:tick1") is None  # dedupe key taken
    assert queue.enqueue(K, "a", "p", 0, "k1:a:tick2") is None  # agent a already pending
    assert queue.enqueue("k2", "a", "p", 0, "k2:a:tick2") is not None  # other kernel: fine

    claimed = queue.claim(K, "w1", 60, 5)
    assert claimed is not None
    assert claimed.dispatch_id == first.dispatch_id
    assert queue.enqueue(K, "a", "p", 0, "k1:a:tick2") is None  # still running
    queue.complete(first.dispatch_id, "w1", status="done")
    assert queue.enqueue(K, "a", "p", 0, "k1:a:tick2") is not None
    assert queue.enqueue(K, "a", "p", 0, "k1:a:tick1") is None  # the key stays taken


def test_mark_done_and_failed(queue: DispatchQueue, clock: FakeClock) -> None:
    a, b = enqueue(queue, "a"), enqueue(queue, "b")
    for _ in range(2):
        assert queue.claim(K, "w1", 60, 5) is not None
    clock.advance(5)
    done = queue.complete(
        a.dispatch_id, "w1", status=DispatchStatus.DONE, run_id="r1", termination_reason="done"
    )
    failed = queue.complete(
        b.dispatch_id, "w1", status="failed", termination_reason="timeout", error="timed out"
    )
    assert (done.status, done.run_id, done.termination_reason, done.error) == (
        DispatchStatus.DONE,
        "r1",
        "done",
        None,
    )
    assert (failed.status, failed.termination_reason, failed.error) == (
        DispatchStatus.FAILED,
        "timeout",
        "timed out",
    )
    stored = queue.get(a.dispatch_id)
    assert stored is not None
    assert stored.finished_at == clock.now()
    assert stored.started_at == clock.now() - timedelta(seconds=5)
    assert stored.lease_expires_at is None
    assert queue.get("no-such-id") is None


def test_complete_accepts_only_final_statuses(queue: DispatchQueue) -> None:
    a = enqueue(queue, "a")
    assert queue.claim(K, "w1", 60, 5) is not None
    for bad in ("running", "pending", "exploded"):
        with pytest.raises(StoreError, match="status"):
            queue.complete(a.dispatch_id, "w1", status=bad)


def test_claim_highest_priority_first_then_oldest(queue: DispatchQueue, clock: FakeClock) -> None:
    low = enqueue(queue, "low", priority=1)
    clock.advance(1)
    high = enqueue(queue, "high", priority=10)
    clock.advance(1)
    old_mid = enqueue(queue, "old-mid", priority=5)
    clock.advance(1)
    new_mid = enqueue(queue, "new-mid", priority=5)

    order = []
    while (claimed := queue.claim(K, "w1", 60, 10)) is not None:
        order.append(claimed.dispatch_id)
        assert claimed.status is DispatchStatus.RUNNING
        assert claimed.worker_id == "w1"
        assert claimed.attempts == 1
        assert claimed.lease_expires_at == clock.now() + timedelta(seconds=60)
    expected = [high.dispatch_id, old_mid.dispatch_id, new_mid.dispatch_id, low.dispatch_id]
    assert order == expected


def test_claim_refuses_beyond_max_concurrent(queue: DispatchQueue) -> None:
    for agent in "abc":
        enqueue(queue, agent)
    first = queue.claim(K, "w1", 60, 2)
    assert first is not None
    assert queue.claim(K, "w2", 60, 2) is not None
    assert queue.claim(K, "w3", 60, 2) is None
    queue.complete(first.dispatch_id, "w1", status="done")
    assert queue.claim(K, "w3", 60, 2) is not None
    assert queue.claim("other-kernel", "w3", 60, 2) is None


def test_expired_lease_is_reclaimed_and_frees_its_slot(
    queue: DispatchQueue, clock: FakeClock
) -> None:
    a = enqueue(queue, "a")
    assert queue.claim(K, "dead-worker", 60, 1) is not None
    clock.advance(59)
    assert queue.claim(K, "w2", 60, 1) is None  # lease still live: slot taken, nothing to take
    clock.advance(1)
    reclaimed = queue.claim(K, "w2", 60, 1)
    assert reclaimed is not None
    assert (reclaimed.dispatch_id, reclaimed.worker_id, reclaimed.attempts) == (
        a.dispatch_id,
        "w2",
        2,
    )


def test_heartbeat_extends_the_lease(queue: DispatchQueue, clock: FakeClock) -> None:
    a = enqueue(queue, "a")
    claimed = queue.claim(K, "w1", 60, 1)
    assert claimed is not None
    clock.advance(50)
    beat = queue.heartbeat(a.dispatch_id, "w1", 60, attempt=claimed.attempts)
    assert beat.lease_expires_at == clock.now() + timedelta(seconds=60)
    clock.advance(50)  # 100 s after the claim, 50 after the heartbeat
    assert queue.claim(K, "w2", 60, 5) is None


def test_late_completion_and_heartbeat_are_refused(queue: DispatchQueue, clock: FakeClock) -> None:
    a = enqueue(queue, "a")
    assert queue.claim(K, "slow", 60, 1) is not None
    clock.advance(61)
    assert queue.claim(K, "fast", 60, 1) is not None

    with pytest.raises(StoreConflictError, match="no longer holds"):
        queue.heartbeat(a.dispatch_id, "slow", 60)
    with pytest.raises(StoreConflictError, match="no longer holds"):
        queue.complete(a.dispatch_id, "slow", status="done", run_id="zombie")
    with pytest.raises(StoreConflictError, match="no longer holds"):
        queue.complete(a.dispatch_id, "fast", status="done", attempt=1)  # stale fencing token
    done = queue.complete(a.dispatch_id, "fast", status="done", run_id="r2", attempt=2)
    assert (done.status, done.run_id, done.worker_id) == (DispatchStatus.DONE, "r2", "fast")
    with pytest.raises(StoreConflictError):
        queue.complete(a.dispatch_id, "fast", status="failed")  # already final
    with pytest.raises(StoreConflictError, match="does not exist"):
        queue.heartbeat("no-such-id", "fast", 60)


def test_completion_after_expiry_is_accepted_while_nobody_reclaimed(
    queue: DispatchQueue, clock: FakeClock
) -> None:
    a = enqueue(queue, "a")
    assert queue.claim(K, "w1", 60, 1) is not None
    clock.advance(120)
    assert queue.complete(a.dispatch_id, "w1", status="done").status is DispatchStatus.DONE


def test_latest_per_agent(queue: DispatchQueue, clock: FakeClock) -> None:
    enqueue(queue, "a", key="a1")
    claimed = queue.claim(K, "w1", 60, 5)
    assert claimed is not None
    queue.complete(claimed.dispatch_id, "w1", status="failed")
    clock.advance(1)
    newer_a = enqueue(queue, "a", key="a2")
    b = enqueue(queue, "b", key="b1")
    queue.enqueue("k2", "c", "p", 0, "c1")

    latest = queue.latest_per_agent(K)
    assert set(latest) == {"a", "b"}
    assert latest["a"].dispatch_id == newer_a.dispatch_id
    assert latest["a"].status is DispatchStatus.PENDING
    assert latest["b"].dispatch_id == b.dispatch_id
    assert queue.latest_per_agent("nobody") == {}


def test_a_tick_fires_once_per_kernel(queue: DispatchQueue) -> None:
    tick = datetime(2026, 2, 11, 10, 10, tzinfo=UTC)
    assert queue.try_acquire_tick(K, tick) is True
    assert queue.try_acquire_tick(K, tick) is False
    assert queue.try_acquire_tick(K, tick + timedelta(microseconds=300)) is False
    assert queue.try_acquire_tick(K, tick.astimezone(tz=None)) is False  # same instant
    assert queue.try_acquire_tick("k2", tick) is True
    assert queue.try_acquire_tick(K, tick + timedelta(minutes=10)) is True


def test_naive_datetimes_are_rejected(queue: DispatchQueue) -> None:
    with pytest.raises(StoreError, match="naive"):
        queue.try_acquire_tick(K, datetime(2026, 2, 11, 10, 10))  # naive on purpose


def test_concurrent_claims_from_many_connections_respect_the_cap(
    store: str, clock: FakeClock, queue: DispatchQueue
) -> None:
    for i in range(10):
        enqueue(queue, f"agent{i}")
    workers = 8
    queues = [open_queue(store, clock=clock) for _ in range(workers)]
    barrier = threading.Barrier(workers)
    claimed: list[Dispatch | None] = [None] * workers

    def claim(i: int) -> None:
        barrier.wait()
        claimed[i] = queues[i].claim(K, f"w{i}", 60, 3)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(workers)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
    finally:
        for q in queues:
            q.close()
    ids = [d.dispatch_id for d in claimed if d is not None]
    assert len(ids) == 3
    assert len(set(ids)) == 3
    running = [d for d in queue.list(K) if d.status is DispatchStatus.RUNNING]
    assert len(running) == 3


def test_the_queue_shares_the_sqlite_file_with_the_event_log(tmp_path: Path) -> None:
    from fsm_kernel.store import open_store

    path = tmp_path / "runs.db"
    open_store(path).close()
    queue = open_queue(str(path))
    try:
        assert queue.enqueue(K, "a", "p", 0, "key") is not None
    finally:
        queue.close()
    events = open_store(path)
    try:
        assert events.list_runs() == []
    finally:
        events.close()
    with sqlite3.connect(path) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    conn.close()
    assert {"kernel_dispatch_tasks", "scheduler_ticks", "scheduler_schema"} <= tables


def test_a_jsonl_store_cannot_hold_the_queue(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="JSON Lines"):
        open_queue(str(tmp_path / "runs.jsonl"))


def test_sqlite_errors_become_store_errors(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    queue = SqliteDispatchQueue(blocker / "runs.db")
    with pytest.raises(StoreError, match="dispatch store failed"):
        queue.ensure_schema()
    queue.close()


def test_postgres_connection_errors_become_store_errors() -> None:
    pytest.importorskip("psycopg")
    from fsm_kernel.scheduler.pg_queue import PostgresDispatchQueue

    queue = PostgresDispatchQueue("postgresql:///nodb?host=/nonexistent-dir&connect_timeout=2")
    with pytest.raises(StoreError, match="unavailable"):
        queue.ensure_schema()
    queue.close()
    assert "nodb" not in repr(queue)


# --- attempt limit, cancellation, constant-cost claims -----------------------------------------


def expire_and_reclaim(queue: DispatchQueue, clock: FakeClock, times: int) -> Dispatch | None:
    """Let the current lease expire `times` times, each followed by a claim (a worker that dies)."""
    claimed = None
    for _ in range(times):
        clock.advance(61)
        claimed = queue.claim(K, "next-worker", 60, 5)
    return claimed


def test_a_dispatch_whose_lease_expires_max_attempts_times_is_failed_never_reclaimed(
    queue: DispatchQueue, clock: FakeClock
) -> None:
    a = queue.enqueue(K, "a", "p", 0, "a1", max_attempts=3)
    assert a is not None
    assert a.max_attempts == 3
    assert queue.claim(K, "w1", 60, 5) is not None  # attempt 1
    second = expire_and_reclaim(queue, clock, 2)  # attempts 2 and 3
    assert second is not None
    assert second.attempts == 3

    clock.advance(61)  # the third lease expires too
    assert queue.claim(K, "w9", 60, 5) is None  # nothing left to take: it is abandoned
    row = queue.get(a.dispatch_id)
    assert row is not None
    assert (row.status, row.attempts, row.error) == (
        DispatchStatus.FAILED,
        3,
        "abandoned after 3 attempts: lease expired",
    )
    assert (row.finished_at, row.lease_expires_at) == (clock.now(), None)
    clock.advance(3600)
    assert queue.claim(K, "w9", 60, 5) is None
    assert queue.enqueue(K, "a", "p", 0, "a2") is not None  # the agent may be dispatched again


def test_reap_finishes_exhausted_and_cancelled_expired_dispatches_only(
    queue: DispatchQueue, clock: FakeClock
) -> None:
    once = queue.enqueue(K, "once", "p", 0, "o", max_attempts=1)
    twice = queue.enqueue(K, "twice", "p", 0, "t", max_attempts=2)
    stop = queue.enqueue(K, "stop", "p", 0, "s")
    assert once is not None
    assert twice is not None
    assert stop is not None
    for _ in range(3):
        assert queue.claim(K, "w1", 60, 5) is not None
    assert queue.cancel(K, stop.dispatch_id) is not None  # requested: the worker is alive
    assert queue.reap(K) == []  # every lease still live
    clock.advance(61)

    reaped = {d.agent_id: d for d in queue.reap(K)}
    assert set(reaped) == {"once", "stop"}
    assert reaped["once"].status is DispatchStatus.FAILED
    assert reaped["once"].error == "abandoned after 1 attempt: lease expired"
    assert reaped["stop"].status is DispatchStatus.CANCELLED
    assert "lease expired" in (reaped["stop"].error or "")
    assert queue.reap(K) == []
    reclaimed = queue.claim(K, "w2", 60, 5)  # the one with an attempt left
    assert reclaimed is not None
    assert (reclaimed.agent_id, reclaimed.attempts) == ("twice", 2)


def test_cancel_a_pending_dispatch_at_once(queue: DispatchQueue, clock: FakeClock) -> None:
    a = enqueue(queue, "a")
    cancelled = queue.cancel(K, a.dispatch_id)
    assert cancelled is not None
    assert (cancelled.status, cancelled.finished_at, cancelled.started_at) == (
        DispatchStatus.CANCELLED,
        clock.now(),
        None,
    )
    assert cancelled.error == "cancelled while pending: it never ran"
    assert queue.claim(K, "w1", 60, 5) is None
    assert queue.enqueue(K, "a", "p", 0, "a-next") is not None  # no longer active
    with pytest.raises(StoreConflictError, match="already finished: cancelled"):
        queue.cancel(K, a.dispatch_id)


def test_cancel_a_running_dispatch_asks_its_worker_through_the_heartbeat(
    queue: DispatchQueue, clock: FakeClock
) -> None:
    a = enqueue(queue, "a")
    claimed = queue.claim(K, "w1", 60, 5)
    assert claimed is not None
    assert claimed.cancel_requested_at is None
    clock.advance(5)
    requested = queue.cancel(K, a.dispatch_id)
    assert requested is not None
    assert (requested.status, requested.cancel_requested_at) == (
        DispatchStatus.RUNNING,
        clock.now(),
    )
    clock.advance(1)
    again = queue.cancel(K, a.dispatch_id)  # idempotent: the first request's time stays
    assert again is not None
    assert again.cancel_requested_at == requested.cancel_requested_at
    beat = queue.heartbeat(a.dispatch_id, "w1", 60, attempt=1)
    assert beat.cancel_requested_at == requested.cancel_requested_at
    done = queue.complete(
        a.dispatch_id, "w1", status="cancelled", run_id="r1", termination_reason="cancelled"
    )
    assert (done.status, done.run_id, done.termination_reason) == (
        DispatchStatus.CANCELLED,
        "r1",
        "cancelled",
    )
    with pytest.raises(StoreConflictError, match="already finished"):
        queue.cancel(K, a.dispatch_id)


def test_a_cancelled_running_dispatch_is_never_reclaimed(
    queue: DispatchQueue, clock: FakeClock
) -> None:
    a = enqueue(queue, "a")
    assert queue.claim(K, "dead", 60, 5) is not None
    assert queue.cancel(K, a.dispatch_id) is not None
    clock.advance(61)
    assert queue.claim(K, "w2", 60, 5) is None
    row = queue.get(a.dispatch_id)
    assert row is not None
    assert row.status is DispatchStatus.CANCELLED


def test_cancelling_a_dispatch_whose_lease_expired_finishes_it_at_once(
    queue: DispatchQueue, clock: FakeClock
) -> None:
    a = enqueue(queue, "a")
    assert queue.claim(K, "dead", 60, 5) is not None
    clock.advance(61)
    row = queue.cancel(K, a.dispatch_id)
    assert row is not None
    assert (row.status, row.lease_expires_at) == (DispatchStatus.CANCELLED, None)
    with pytest.raises(StoreConflictError, match="no longer holds"):
        queue.heartbeat(a.dispatch_id, "dead", 60)  # a late worker learns it lost the lease


def test_cancel_of_an_unknown_or_other_kernels_dispatch_is_none(queue: DispatchQueue) -> None:
    other = queue.enqueue("k2", "a", "p", 0, "k2a")
    assert other is not None
    assert queue.cancel(K, other.dispatch_id) is None
    assert queue.cancel(K, "no-such-id") is None
    still = queue.get(other.dispatch_id)
    assert still is not None
    assert still.status is DispatchStatus.PENDING


def test_find_by_prefix_and_active_per_agent(queue: DispatchQueue, clock: FakeClock) -> None:
    a = enqueue(queue, "a")
    b = enqueue(queue, "b")
    done = enqueue(queue, "c")
    queue.enqueue("k2", "a", "p", 0, "k2a")
    assert [d.dispatch_id for d in queue.find(K, a.dispatch_id)] == [a.dispatch_id]
    assert len(queue.find(K, a.dispatch_id[:4], limit=5)) == 3  # UUIDv7: same time prefix
    assert queue.find(K, "ffffffff") == []
    claimed = [queue.claim(K, "w", 60, 5) for _ in range(3)]
    finished = next(d for d in claimed if d is not None and d.agent_id == "c")
    queue.complete(finished.dispatch_id, "w", status="done")
    assert {k: d.dispatch_id for k, d in queue.active_per_agent(K).items()} == {
        "a": a.dispatch_id,
        "b": b.dispatch_id,
    }
    assert done.dispatch_id not in {d.dispatch_id for d in queue.active_per_agent(K).values()}
