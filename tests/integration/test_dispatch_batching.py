"""The queue's guarantees when workers claim and complete dispatches in batches.

- The fleet cap is exact under concurrent batch claims: many claimers at once, each asking for
  more than the cap leaves, take exactly the room between them (PostgreSQL at READ COMMITTED,
  and SQLite); worker processes with several slots each never run more than the cap at once,
  measured by the runs themselves.
- A worker SIGKILLed holding a batch loses nothing and runs nothing twice: once the leases
  expire another worker runs each dispatch once, and the dead worker's late outcomes are
  refused (fenced by worker and attempt).
- A worker SIGKILLed with outcomes buffered (waiting for the claim that records them) reruns
  only those: the outcomes it reported recorded are in the store and never run again.
- A claim records the outcomes before it and is offered the slots they free, in one call; the
  worker's awaited form (`complete_and_claim_async`, PostgreSQL's on an asyncio connection of
  the calling event loop) does exactly what the blocking one does, reconnects after its
  connection was lost, and follows the caller to another event loop; a PostgreSQL worker
  claims through it alone.
- The attempt limit and cancellation act on dispatches claimed in a batch.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fsm_kernel.errors import StoreConflictError, StoreError
from fsm_kernel.scheduler import (
    AgentSpec,
    DispatchQueue,
    DispatchStatus,
    RunOutcome,
    Worker,
    open_queue,
)
from fsm_kernel.scheduler.executor import DispatchDetail, ExecutionStatus
from fsm_kernel.scheduler.queue import Completion
from tests.integration.test_scheduler_multiworker import (
    KERNEL,
    Fleet,
    fleet_config,
    peak_concurrency,
    runs,
    wait_for,
)
from tests.unit.test_scheduler_fakes import FakeClock, pg_url

BACKENDS = [pytest.param("sqlite"), pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "queue.db")
    return pg_url(request.getfixturevalue("pg_dsn"))


@pytest.fixture
def queue(store: str) -> Iterator[DispatchQueue]:
    q = open_queue(store)
    yield q
    q.close()


def enqueue(queue: DispatchQueue, count: int, *, max_attempts: int = 3) -> list[str]:
    ids = []
    for i in range(count):
        d = queue.enqueue(KERNEL, f"agent{i}", "p", 0, f"job{i}", max_attempts=max_attempts)
        assert d is not None
        ids.append(d.dispatch_id)
    return ids


def done(worker: str, dispatch_id: str, attempt: int) -> Completion:
    return Completion(
        dispatch_id=dispatch_id, worker_id=worker, attempt=attempt, status=DispatchStatus.DONE
    )


def claim_all_at_once(store: str, claimers: int, limit: int, cap: int) -> list[list[str]]:
    """Each claimer (its own connection) asks for `limit` at the same moment."""
    queues = [open_queue(store) for _ in range(claimers)]
    barrier = threading.Barrier(claimers)
    got: list[list[str]] = [[] for _ in range(claimers)]

    def claim(i: int) -> None:
        barrier.wait()
        claimed = queues[i].claim_batch(KERNEL, f"w{i}", 60, cap, limit)
        got[i] = [d.dispatch_id for d in claimed]

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(claimers)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        for q in queues:
            q.close()
    return got


def test_concurrent_batch_claims_take_exactly_the_room_the_cap_leaves(
    store: str, queue: DispatchQueue
) -> None:
    enqueue(queue, 60)
    cap = 5
    for round_ in range(4):
        got = claim_all_at_once(store, claimers=8, limit=4, cap=cap)
        taken = [d for batch in got for d in batch]
        assert len(taken) == cap, (round_, got)  # 8 x 4 asked for, 5 allowed: never 6
        assert len(set(taken)) == cap
        rows = [queue.get(d) for d in taken]
        assert all(r is not None and r.status is DispatchStatus.RUNNING for r in rows)
        # With the kernel full, no claimer gets anything.
        assert claim_all_at_once(store, claimers=4, limit=4, cap=cap) == [[]] * 4
        # Their ends free the kernel for the next round's race.
        for owner, batch in enumerate(got):
            results = queue.complete_batch([done(f"w{owner}", d, 1) for d in batch])
            assert all(not isinstance(r, Exception) for r in results)


def test_a_batch_is_the_best_dispatches_first_and_never_more_than_asked(
    queue: DispatchQueue,
) -> None:
    ids = enqueue(queue, 6)
    urgent = queue.enqueue(KERNEL, "urgent", "p", 9, "urgent")
    assert urgent is not None
    claimed = queue.claim_batch(KERNEL, "w", 60, 100, 3)
    assert [d.dispatch_id for d in claimed] == [urgent.dispatch_id, ids[0], ids[1]]
    assert {d.worker_id for d in claimed} == {"w"}
    assert {d.attempts for d in claimed} == {1}
    assert [d.dispatch_id for d in queue.claim_batch(KERNEL, "w", 60, 5, 10)] == ids[2:4]


CompleteAndClaim = Callable[..., tuple[list[StoreConflictError | None], list[Any]]]


@pytest.fixture(params=["blocking", "awaited"])
def complete_and_claim(request: pytest.FixtureRequest, queue: DispatchQueue) -> CompleteAndClaim:
    """The queue's complete_and_claim, or its awaited form run in an event loop of its own per
    call (each call on PostgreSQL then opens its connection in that loop)."""
    if request.param == "blocking":
        return queue.complete_and_claim
    return lambda *args: asyncio.run(queue.complete_and_claim_async(*args))


def test_complete_and_claim_records_the_outcomes_then_claims_into_the_slots_they_free(
    queue: DispatchQueue, complete_and_claim: CompleteAndClaim
) -> None:
    a, b, c, d, e = enqueue(queue, 5)
    assert [x.dispatch_id for x in queue.claim_batch(KERNEL, "w", 60, 2, 2)] == [a, b]
    assert complete_and_claim([], KERNEL, "w", 60, 2, 2) == ([], [])  # the cap is full
    outcome_a = Completion(
        dispatch_id=a, worker_id="w", attempt=1, status=DispatchStatus.FAILED, error="E: boom"
    )
    results, claimed = complete_and_claim(
        [outcome_a, done("w", b, 2)],  # b's outcome names an attempt this worker does not hold
        KERNEL,
        "w",
        60,
        2,
        2,
    )
    assert results[0] is None  # recorded (the worker gets no row back)
    recorded = queue.get(a)
    assert recorded is not None
    assert (recorded.status, recorded.error) == (DispatchStatus.FAILED, "E: boom")
    assert isinstance(results[1], StoreConflictError)
    assert f"worker w no longer holds dispatch {b}" in str(results[1])
    # a's end freed one slot and the same call took it; b still holds the other.
    assert [(x.dispatch_id, x.status, x.attempts) for x in claimed] == [
        (c, DispatchStatus.RUNNING, 1)
    ]
    assert queue.get(b).status is DispatchStatus.RUNNING  # type: ignore[union-attr]
    results, claimed = complete_and_claim([done("w", b, 1), done("w", c, 1)], KERNEL, "w", 60, 2, 5)
    assert results == [None, None]
    assert [queue.get(x).status for x in (b, c)] == [DispatchStatus.DONE] * 2  # type: ignore[union-attr]
    assert [x.dispatch_id for x in claimed] == [d, e]


def test_complete_and_claim_records_each_outcomes_fields_exactly(
    queue: DispatchQueue, complete_and_claim: CompleteAndClaim
) -> None:
    """The outcomes travel as one JSON value (PostgreSQL): text that JSON escapes, no text at
    all, and every final status arrive as they were sent."""
    ids = enqueue(queue, 4)
    queue.claim_batch(KERNEL, "w", 60, 4, 4)
    error = 'E: "quoted" \\ back\\slash, tab\t, ünïcødé ☃ and \u2028 — 500 chars max'
    sent = [
        Completion(dispatch_id=ids[0], worker_id="w", attempt=1, status="failed", error=error),
        Completion(
            dispatch_id=ids[1],
            worker_id="w",
            attempt=1,
            status=DispatchStatus.WAITING,
            run_id="run-1",
            termination_reason="waiting for 'input'",
        ),
        Completion(dispatch_id=ids[2], worker_id="w", attempt=1, status="cancelled"),
        Completion(dispatch_id=ids[3], worker_id="w", attempt=1, status="done", run_id="r"),
    ]
    assert complete_and_claim(sent, KERNEL, "w", 60, 4, 4) == ([None] * 4, [])
    rows = [queue.get(i) for i in ids]
    assert [
        (r.status.value, r.run_id, r.termination_reason, r.error)  # type: ignore[union-attr]
        for r in rows
    ] == [
        ("failed", None, None, error),
        ("waiting", "run-1", "waiting for 'input'", None),
        ("cancelled", None, None, None),
        ("done", "r", None, None),
    ]


@pytest.mark.postgres
def test_the_awaited_claim_reconnects_after_its_connection_was_lost(
    pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker's claim connection (an AsyncConnection) dropped by the server: that call
    fails as a StoreError (nothing recorded, nothing claimed), the next one reconnects. The
    loss is logged once, on one line."""
    import psycopg

    queue = open_queue(pg_url(pg_dsn))
    a, b = enqueue(queue, 2)

    async def scenario() -> None:
        _, claimed = await queue.complete_and_claim_async([], KERNEL, "w", 60, 10, 1)
        assert [d.dispatch_id for d in claimed] == [a]
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        with pytest.raises(StoreError, match="unavailable") as failed:
            await queue.complete_and_claim_async([done("w", a, 1)], KERNEL, "w", 60, 10, 1)
        assert "\n" not in str(failed.value)
        lost = [r.getMessage() for r in caplog.records if "connection lost" in r.getMessage()]
        assert len(lost) == 1, lost
        assert "\n" not in lost[0]
        observer = open_queue(pg_url(pg_dsn))  # the queue's own connections were dropped too
        assert observer.get(a).status is DispatchStatus.RUNNING  # type: ignore[union-attr]
        observer.close()
        results, claimed = await queue.complete_and_claim_async(
            [done("w", a, 1)], KERNEL, "w", 60, 10, 1
        )
        assert results == [None]
        assert [d.dispatch_id for d in claimed] == [b]

    try:
        asyncio.run(scenario())
    finally:
        queue.close()
    observer = open_queue(pg_url(pg_dsn))
    assert observer.get(a).status is DispatchStatus.DONE  # type: ignore[union-attr]
    observer.close()


def test_complete_batch_records_each_outcome_and_fences_each_lost_lease(
    queue: DispatchQueue,
) -> None:
    a, b, c = enqueue(queue, 3)
    claimed = queue.claim_batch(KERNEL, "w", 60, 10, 3)
    assert len(claimed) == 3
    results = queue.complete_batch(
        [
            done("w", a, 1),
            done("intruder", b, 1),  # not this worker's lease
            Completion(
                dispatch_id=c,
                worker_id="w",
                attempt=1,
                status=DispatchStatus.FAILED,
                run_id="r-c",
                error="E: boom",
            ),
        ],
        max_concurrent=10,
    )
    assert not isinstance(results[0], Exception)
    assert results[0].status is DispatchStatus.DONE
    assert isinstance(results[1], StoreConflictError)
    assert "worker intruder no longer holds dispatch" in str(results[1])
    assert not isinstance(results[2], Exception)
    assert (results[2].status, results[2].run_id, results[2].error) == (
        DispatchStatus.FAILED,
        "r-c",
        "E: boom",
    )
    row_b = queue.get(b)
    assert row_b is not None
    assert row_b.status is DispatchStatus.RUNNING


def test_the_attempt_limit_acts_on_batched_claims(store: str) -> None:
    clock = FakeClock()
    queue = open_queue(store, clock=clock)
    try:
        ids = enqueue(queue, 3, max_attempts=2)
        first = queue.claim_batch(KERNEL, "dead", 10, 10, 3)
        assert sorted(d.dispatch_id for d in first) == sorted(ids)
        clock.advance(11)  # the dead worker's leases expire
        second = queue.claim_batch(KERNEL, "alive", 10, 10, 3)
        assert sorted(d.dispatch_id for d in second) == sorted(ids)
        assert {d.attempts for d in second} == {2}
        late = queue.complete_batch([done("dead", d, 1) for d in ids], max_concurrent=10)
        assert all(isinstance(r, StoreConflictError) for r in late)  # fenced
        clock.advance(11)  # expired again: the second attempt was the last
        assert queue.claim_batch(KERNEL, "third", 10, 10, 3) == []
        rows = [queue.get(d) for d in ids]
    finally:
        queue.close()
    for row in rows:
        assert row is not None
        assert (row.status, row.attempts, row.worker_id) == (DispatchStatus.FAILED, 2, "alive")
        assert row.error == "abandoned after 2 attempts: lease expired"


@pytest.mark.postgres
def test_a_worker_killed_with_outcomes_buffered_reruns_only_what_it_never_recorded(
    pg_store: str, tmp_path: Path
) -> None:
    """A buffered outcome promises nothing until its run reports it recorded: the worker
    killed with two outcomes waiting for a claim that never reached the store recorded
    neither, so those two run again; the two it reported recorded never run again."""
    queue = open_queue(pg_store)
    fleet = Fleet(pg_store, tmp_path, agents=6, max_concurrent=6, lease=1.0)
    try:
        ids = enqueue(queue, 6)
        # Claim 1 takes agent0-1; claim 2 records them and takes agent2-3; claim 3, carrying
        # agent2-3's outcomes, stalls before it reaches the store.
        doomed = fleet.start("doomed", "--concurrency=2", "--stall-after-calls=2")
        wait_for(
            queue,
            "two outcomes recorded and two more buffered",
            lambda: sum(e[1] == "end" for e in fleet.events()) == 4,
        )
        time.sleep(0.3)  # nothing else happens: the worker is stuck in its third claim
        before_kill = fleet.events()
        doomed.kill()
        doomed.wait(10)
        fleet.start("rescuer", "--concurrency=2")
        wait_for(
            queue,
            "every dispatch done",
            lambda: all(queue.get(d).status is DispatchStatus.DONE for d in ids),  # type: ignore[union-attr]
        )
        fleet.stop_all()
        rows = {d: queue.get(d) for d in ids}
    finally:
        fleet.kill_leftovers()
        queue.close()
    recorded = sorted(agent for _, kind, agent, w in before_kill if kind == "recorded")
    assert recorded == ["agent0", "agent1"]
    starts = sorted((agent, w) for _, kind, agent, w in fleet.events() if kind == "start")
    assert starts == [
        ("agent0", "doomed"),
        ("agent1", "doomed"),
        ("agent2", "doomed"),
        ("agent2", "rescuer"),  # ran, but its outcome never reached the store
        ("agent3", "doomed"),
        ("agent3", "rescuer"),
        ("agent4", "rescuer"),
        ("agent5", "rescuer"),
    ]
    owners = [(r.agent_id, r.worker_id, r.attempts) for r in rows.values() if r is not None]
    assert sorted(owners) == [
        ("agent0", "doomed", 1),
        ("agent1", "doomed", 1),
        ("agent2", "rescuer", 2),
        ("agent3", "rescuer", 2),
        ("agent4", "rescuer", 1),
        ("agent5", "rescuer", 1),
    ]


def test_cancel_stops_one_run_of_a_batch_and_leaves_the_others(
    store: str, queue: DispatchQueue
) -> None:
    ids = enqueue(queue, 3)
    config = fleet_config(store, 3, max_concurrent=3, lease=0.9)  # heartbeat every 0.3 s
    started: list[str] = []
    results: list[DispatchDetail] = []
    ended_before_stop: list[DispatchDetail] = []

    async def runner(agent: AgentSpec, prompt: str) -> RunOutcome:
        started.append(agent.agent_id)
        await asyncio.Event().wait()  # until cancelled
        raise AssertionError("unreachable")

    async def scenario() -> None:
        worker = Worker(config, open_queue(store), runner, concurrency=3, on_result=results.append)
        task = asyncio.create_task(worker.run())
        try:
            await until(lambda: len(started) == 3, "the batch of three to start")
            await asyncio.to_thread(queue.cancel, KERNEL, ids[1])
            await until(lambda: len(results) == 1, "the cancelled run to end")
            await asyncio.sleep(0.7)  # two more heartbeats: the other runs carry on
            ended_before_stop.extend(results)
        finally:
            worker.stop(abandon=True)
            await asyncio.wait_for(task, 10)
            worker.queue.close()

    asyncio.run(scenario())
    assert sorted(started) == ["agent0", "agent1", "agent2"]
    assert [(r.dispatch_id, r.status) for r in ended_before_stop] == [
        (ids[1], ExecutionStatus.CANCELLED)
    ]
    statuses = [queue.get(d).status for d in ids]  # type: ignore[union-attr]
    assert statuses == [DispatchStatus.RUNNING, DispatchStatus.CANCELLED, DispatchStatus.RUNNING]
    claimed = [queue.get(d).started_at for d in ids]  # type: ignore[union-attr]
    assert len(set(claimed)) == 1  # the three were claimed by one statement


async def until(check: Callable[[], bool], what: str) -> None:
    for _ in range(1000):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def pg_store(pg_dsn: str) -> str:
    return pg_url(pg_dsn)


@pytest.mark.postgres
def test_worker_processes_with_several_slots_never_run_more_than_the_cap(
    pg_store: str, tmp_path: Path
) -> None:
    jobs, cap, workers, slots = 30, 5, 4, 3
    queue = open_queue(pg_store)
    fleet = Fleet(pg_store, tmp_path, agents=jobs, max_concurrent=cap, lease=30)
    try:
        enqueue(queue, jobs)
        for n in range(workers):  # 4 x 3 slots = 12 wanted at once, against a cap of 5
            fleet.start(f"w{n}", "--run-seconds=0.15", f"--concurrency={slots}")
        wait_for(
            queue,
            "every dispatch done",
            lambda: all(d.status is DispatchStatus.DONE for d in queue.list(KERNEL, 100)),
        )
        fleet.stop_all()
        rows = queue.list(KERNEL, 100)
    finally:
        fleet.kill_leftovers()
        queue.close()
    events = fleet.events()
    starts = sorted(agent for _, kind, agent, _ in events if kind == "start")
    assert starts == sorted(f"agent{i}" for i in range(jobs))  # each ran exactly once
    assert peak_concurrency(events) == cap  # measured by the runs: reached, never exceeded
    per_worker = [peak_concurrency([e for e in events if e[3] == w]) for w in fleet.procs]
    assert max(per_worker) > 1  # a worker did run a batch at once
    assert {d.attempts for d in rows} == {1}


@pytest.mark.postgres
def test_a_worker_killed_holding_a_batch_loses_nothing_and_runs_nothing_twice(
    pg_store: str, tmp_path: Path
) -> None:
    queue = open_queue(pg_store)
    fleet = Fleet(pg_store, tmp_path, agents=3, max_concurrent=3, lease=1.0)
    try:
        ids = enqueue(queue, 3)
        hang = [f"--hang=agent{i}" for i in range(3)]
        doomed = fleet.start("doomed", "--concurrency=3", *hang)
        wait_for(queue, "the batch to start", lambda: len(runs(fleet.events())) == 3)
        held = [queue.get(d) for d in ids]
        doomed.kill()  # SIGKILL: no cleanup, no completion, no more heartbeats
        doomed.wait(10)
        fleet.start("rescuer", "--concurrency=3")
        wait_for(
            queue,
            "the rescuer to complete the batch",
            lambda: all(queue.get(d).status is DispatchStatus.DONE for d in ids),  # type: ignore[union-attr]
        )
        # The dead worker's results, arriving late, are refused: the rows stay the rescuer's.
        late = queue.complete_batch([done("doomed", d, 1) for d in ids], max_concurrent=3)
        fleet.stop_all()
        rows = [queue.get(d) for d in ids]
    finally:
        fleet.kill_leftovers()
        queue.close()
    assert all(h is not None and h.worker_id == "doomed" for h in held)
    assert len({h.started_at for h in held if h is not None}) == 1  # one claim took all three
    assert all(isinstance(r, StoreConflictError) for r in late)
    expiry = max(h.lease_expires_at for h in held if h and h.lease_expires_at)
    for row in rows:
        assert row is not None
        assert (row.worker_id, row.attempts, row.run_id) == (
            "rescuer",
            2,
            f"rescuer:{row.agent_id}",
        )
        assert row.started_at is not None
        assert row.started_at >= expiry
    starts = sorted((worker, agent) for _, kind, agent, worker in fleet.events() if kind == "start")
    agents = [f"agent{i}" for i in range(3)]
    assert starts == [*[("doomed", a) for a in agents], *[("rescuer", a) for a in agents]]


def test_a_worker_claims_and_records_by_the_batch_in_one_call_per_batch(tmp_path: Path) -> None:
    from fsm_kernel.scheduler import SqliteDispatchQueue

    class CountingQueue(SqliteDispatchQueue):
        def __init__(self, path: str) -> None:
            super().__init__(path)
            self.claims: list[int] = []
            self.completions: list[int] = []
            """Outcomes carried by each claim."""
            self.alone: list[int] = []
            """Outcomes recorded on their own (complete_batch)."""

        def complete_and_claim(self, completions: Any, *args: Any) -> Any:
            results, claimed = super().complete_and_claim(completions, *args)
            self.claims.append(len(claimed))
            self.completions.append(len(completions))
            return results, claimed

        def complete_batch(self, completions: Any, **kwargs: Any) -> Any:
            self.alone.append(len(completions))
            return super().complete_batch(completions, **kwargs)

    store = str(tmp_path / "queue.db")
    queue = CountingQueue(store)
    queue.ensure_schema()
    enqueue(queue, 20)
    config = fleet_config(store, 20, max_concurrent=5, lease=30)
    ran: list[str] = []

    async def runner(agent: AgentSpec, prompt: str) -> RunOutcome:
        ran.append(agent.agent_id)
        return RunOutcome(ok=True)

    async def scenario() -> None:
        worker = Worker(config, queue, runner, concurrency=5, poll_seconds=0.01)
        task = asyncio.create_task(worker.run())
        await until(lambda: sum(queue.completions) == 20, "every outcome recorded")
        worker.stop()
        await asyncio.wait_for(task, 10)

    try:
        asyncio.run(scenario())
        rows = queue.list(KERNEL, 100)
    finally:
        queue.close()
    assert sorted(ran) == sorted(f"agent{i}" for i in range(20))
    assert all(d.status is DispatchStatus.DONE for d in rows)
    assert [n for n in queue.claims if n][:4] == [5, 5, 5, 5]  # the free slots, each time
    # Each batch's outcomes were recorded by the claim that took the next batch, none alone.
    assert [n for n in queue.completions if n] == [5, 5, 5, 5]
    assert queue.alone == []


@pytest.mark.postgres
def test_a_postgresql_worker_awaits_its_claims_in_its_event_loop(pg_dsn: str) -> None:
    """A PostgreSQL worker claims through the awaited call (its own AsyncConnection), never
    through the blocking one (which a thread would run), and its claims carry every outcome."""
    store = pg_url(pg_dsn)
    queue = open_queue(store)
    enqueue(queue, 20)
    config = fleet_config(store, 20, max_concurrent=5, lease=30)
    carried: list[int] = []
    awaited = queue.complete_and_claim_async

    def blocking(*args: Any) -> Any:
        raise AssertionError("the blocking claim was called")

    async def counted(completions: Any, *args: Any) -> Any:
        results, claimed = await awaited(completions, *args)
        carried.append(len(completions))
        return results, claimed

    queue.complete_and_claim = blocking  # type: ignore[method-assign]
    queue.complete_and_claim_async = counted  # type: ignore[method-assign]
    ran: list[str] = []

    async def runner(agent: AgentSpec, prompt: str) -> RunOutcome:
        ran.append(agent.agent_id)
        return RunOutcome(ok=True)

    async def scenario() -> None:
        worker = Worker(config, queue, runner, concurrency=5, poll_seconds=0.01)
        task = asyncio.create_task(worker.run())
        await until(lambda: sum(carried) == 20, "every outcome recorded by a claim")
        worker.stop()
        await asyncio.wait_for(task, 10)

    try:
        asyncio.run(scenario())
        rows = queue.list(KERNEL, 100)
    finally:
        queue.close()
    assert sorted(ran) == sorted(f"agent{i}" for i in range(20))
    assert [d.status for d in rows] == [DispatchStatus.DONE] * 20


@pytest.mark.postgres
def test_a_server_never_reached_is_one_error_line_and_no_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No connection was ever made: the caller's StoreError (one line: libpq's hint joined on)
    says it all, with no "connection lost" warning before it, from either connection."""
    from fsm_kernel.scheduler.pg_queue import PostgresDispatchQueue

    queue = PostgresDispatchQueue("postgresql://fsm@127.0.0.1:9/none?connect_timeout=2")
    with pytest.raises(StoreError, match="unavailable") as sync_failed:
        queue.list(KERNEL)

    async def awaited() -> None:
        await queue.complete_and_claim_async([], KERNEL, "w", 60, 10, 1)

    with pytest.raises(StoreError, match="unavailable") as async_failed:
        asyncio.run(awaited())
    queue.close()
    for failed in (sync_failed, async_failed):
        assert "\n" not in str(failed.value)
        assert "Is the server running" in str(failed.value)  # the hint, on the same line
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
