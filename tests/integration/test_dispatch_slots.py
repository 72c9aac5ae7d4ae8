"""The PostgreSQL queue's fleet cap kept by slot rows (pg_queue.py): what the slots must do
beyond the claims the other dispatch tests race.

- A heartbeat renews its slot with its lease: a dispatch whose first lease would have run out
  still fills its slot, so the cap holds.
- A lowered cap counts the dispatches still holding slots above it until they end (exact, not
  merely conservative), and the slots above it are deleted as they are freed.
- Opening a store of the advisory-lock protocol gives its running dispatches slots (the cap
  counts them at once) and drops that protocol's claim function, so an older worker still
  running fails its claims instead of claiming outside the slots.
- A batch of ends wakes idle workers (NOTIFY `ended`) only when the kernel's cap was full; ends
  recorded by a worker's claim (`complete_and_claim`) wake no one: that claim takes the slots
  they free. Its rows tell the outcomes it recorded from the dispatches it reaped.
- That claim hands the slots of the dispatches it ended straight on to those it claims (not to
  a lower free slot), frees the ones it cannot fill, counts them exactly under a lowered cap,
  and never hands on a slot another claim took after its lease ran out.
- Opening a store whose claim functions are of another version (or of none: an older
  fsm-kernel made them) replaces their bodies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC
from typing import Any

import pytest

from fsm_kernel.scheduler import Dispatch, open_queue, pg_queue
from fsm_kernel.scheduler.pg_queue import PostgresDispatchQueue
from fsm_kernel.scheduler.queue import Completion
from tests.unit.test_scheduler_fakes import FakeClock, pg_url

pytestmark = pytest.mark.postgres

K = "k1"
OLD_FUNCTION = (
    "fsm_kernel_claim_dispatches(text, text, timestamptz, timestamptz, integer, text, integer)"
)


@pytest.fixture
def url(pg_dsn: str) -> str:
    return pg_url(pg_dsn)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def queue(url: str, clock: FakeClock) -> Iterator[PostgresDispatchQueue]:
    q = open_queue(url, clock=clock)
    assert isinstance(q, PostgresDispatchQueue)
    yield q
    q.close()


def sql(url: str, statement: str) -> list[dict[str, Any]]:
    import psycopg
    from psycopg.rows import dict_row

    with psycopg.connect(url, autocommit=True, row_factory=dict_row) as conn:
        cursor = conn.execute(statement)
        return list(cursor.fetchall()) if cursor.description else []


def enqueue(queue: PostgresDispatchQueue, clock: FakeClock, *agents: str) -> list[Dispatch]:
    """One dispatch per agent, a second apart: claimed in this order."""
    made = []
    for agent in agents:
        d = queue.enqueue(K, agent, "p", 0, None)
        assert d is not None
        made.append(d)
        clock.advance(1)
    return made


def claim(queue: PostgresDispatchQueue, cap: int, limit: int = 10) -> list[str]:
    return [d.agent_id for d in queue.claim_batch(K, "w", 60, cap, limit)]


def done(queue: PostgresDispatchQueue, d: Dispatch) -> None:
    row = queue.get(d.dispatch_id)
    assert row is not None
    queue.complete(d.dispatch_id, "w", status="done", attempt=row.attempts)


def status_of(queue: PostgresDispatchQueue, d: Dispatch) -> str:
    row = queue.get(d.dispatch_id)
    assert row is not None
    return row.status.value


def slot_numbers(url: str) -> list[int]:
    return [r["slot"] for r in sql(url, "SELECT slot FROM kernel_dispatch_slots ORDER BY slot")]


def test_a_heartbeat_keeps_the_slot_its_dispatch_holds(
    queue: PostgresDispatchQueue, clock: FakeClock
) -> None:
    a, _ = enqueue(queue, clock, "a", "b")
    assert claim(queue, cap=1) == ["a"]
    clock.advance(50)
    queue.heartbeat(a.dispatch_id, "w", 60, attempt=1)
    clock.advance(50)  # the claim's lease has run out, the heartbeat's has not
    assert claim(queue, cap=1) == []  # b waits: a still fills the one slot
    clock.advance(11)  # now the renewed lease has run out too: a is reclaimed, before b
    assert claim(queue, cap=1) == ["a"]


def test_a_lowered_cap_counts_the_dispatches_above_it_until_they_end(
    url: str, queue: PostgresDispatchQueue, clock: FakeClock
) -> None:
    a, b, c, *_ = enqueue(queue, clock, "a", "b", "c", "d", "e", "f")
    assert claim(queue, cap=3) == ["a", "b", "c"]  # slots 0, 1, 2
    done(queue, a)  # frees slot 0; c still holds slot 2, above a cap of 2
    assert claim(queue, cap=2) == []  # b and c run: the lower cap is full
    done(queue, b)
    assert claim(queue, cap=2) == ["d"]  # c and d: one taken, not two
    assert claim(queue, cap=2) == []
    assert slot_numbers(url) == [0, 1, 2]  # slot 2 is c's until c ends
    done(queue, c)
    assert claim(queue, cap=2) == ["e"]
    assert slot_numbers(url) == [0, 1]  # the cap's slots only, from now on
    assert claim(queue, cap=2) == []


def test_a_raised_cap_adds_slots(url: str, queue: PostgresDispatchQueue, clock: FakeClock) -> None:
    enqueue(queue, clock, "a", "b", "c", "d")
    assert claim(queue, cap=1) == ["a"]
    assert claim(queue, cap=3) == ["b", "c"]
    assert slot_numbers(url) == [0, 1, 2]


def test_a_store_of_the_advisory_lock_protocol_gets_slots_for_its_running_dispatches(
    url: str, clock: FakeClock
) -> None:
    first = open_queue(url, clock=clock)
    for agent in "abc":
        first.enqueue(K, agent, "p", 0, None)
        clock.advance(1)
    running = first.claim_batch(K, "old", 60, 5, 2)
    first.close()
    # What the previous release left: no slots, no slot column, its own claim function.
    sql(url, "DROP FUNCTION fsm_kernel_claim_with_slots")
    sql(url, "DROP TABLE kernel_dispatch_slots")
    sql(url, "ALTER TABLE kernel_dispatch_tasks DROP COLUMN slot")
    sql(
        url,
        f"CREATE FUNCTION {OLD_FUNCTION} RETURNS SETOF kernel_dispatch_tasks "
        "LANGUAGE sql AS 'SELECT * FROM kernel_dispatch_tasks WHERE false'",
    )

    queue = open_queue(url, clock=clock)
    try:
        # The two running dispatches hold slots: with a cap of 2 nothing more runs.
        assert queue.claim_batch(K, "new", 60, 2, 5) == []
        assert sorted(
            r["dispatch_id"]
            for r in sql(
                url, "SELECT dispatch_id FROM kernel_dispatch_slots WHERE dispatch_id IS NOT NULL"
            )
        ) == sorted(d.dispatch_id for d in running)
        queue.complete(running[0].dispatch_id, "old", status="done", attempt=1)
        assert [d.agent_id for d in queue.claim_batch(K, "new", 60, 2, 5)] == ["c"]
        # An older worker still running fails its claims loudly.
        gone = sql(url, f"SELECT to_regprocedure('{OLD_FUNCTION}') AS f")
        assert gone == [{"f": None}]
    finally:
        queue.close()


def ended_signals(url: str, act: Callable[[], None]) -> list[str]:
    """The `ended` notifications sent while `act` runs, as dispatch ids."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as listening:
        listening.execute("LISTEN fsm_kernel_dispatch")
        act()
        notes = [n.payload for n in listening.notifies(timeout=0.5, stop_after=100)]
    return [p.split()[2] for p in notes if p.startswith("ended ")]


def test_a_batch_of_ends_wakes_workers_only_when_the_cap_was_full(
    url: str, queue: PostgresDispatchQueue, clock: FakeClock
) -> None:
    enqueue(queue, clock, "a", "b", "c", "d", "e")
    first = queue.claim_batch(K, "w", 60, 10, 2)
    outcomes = [
        Completion(dispatch_id=d.dispatch_id, worker_id="w", attempt=1, status="done")
        for d in first
    ]
    # Room to spare (2 of 10 running): nobody waits for these slots, so no signal.
    assert ended_signals(url, lambda: queue.complete_batch(outcomes, max_concurrent=10)) == []
    full = queue.claim_batch(K, "w", 60, 2, 2)  # the cap of 2 now full, one dispatch pending
    outcomes = [
        Completion(dispatch_id=d.dispatch_id, worker_id="w", attempt=1, status="done") for d in full
    ]
    sent = ended_signals(url, lambda: queue.complete_batch(outcomes, max_concurrent=2))
    assert sorted(sent) == sorted(d.dispatch_id for d in full)


def test_ends_recorded_by_a_claim_wake_no_one_and_refill_the_slots_they_free(
    url: str, queue: PostgresDispatchQueue, clock: FakeClock
) -> None:
    a, b, c = enqueue(queue, clock, "a", "b", "c")
    full = queue.claim_batch(K, "w", 60, 2, 2)  # the cap of 2 full, c pending
    outcomes = [
        Completion(dispatch_id=d.dispatch_id, worker_id="w", attempt=1, status="done") for d in full
    ]
    got: list[Any] = []
    sent = ended_signals(
        url, lambda: got.append(queue.complete_and_claim(outcomes, K, "w", 60, 2, 2))
    )
    results, claimed = got[0]
    assert sent == []  # the claim that freed the slots took what there was to take
    assert results == [None, None]  # recorded: the worker gets no rows back
    assert [status_of(queue, d) for d in (a, b)] == ["done", "done"]
    assert [d.dispatch_id for d in claimed] == [c.dispatch_id]
    held = sql(
        url,
        f"SELECT dispatch_id FROM kernel_dispatch_slots WHERE kernel_id = '{K}' "
        "AND dispatch_id IS NOT NULL",
    )
    assert [row["dispatch_id"] for row in held] == [c.dispatch_id]


def test_a_claim_that_records_outcomes_tells_them_from_the_dispatches_it_reaps(
    queue: PostgresDispatchQueue, clock: FakeClock
) -> None:
    doomed = queue.enqueue(K, "x", "p", 0, None, max_attempts=1)
    assert doomed is not None
    clock.advance(1)
    (mine,) = enqueue(queue, clock, "a")
    (pending,) = enqueue(queue, clock, "b")
    assert [d.dispatch_id for d in queue.claim_batch(K, "other", 10, 10, 1)] == [doomed.dispatch_id]
    assert [d.dispatch_id for d in queue.claim_batch(K, "w", 1000, 10, 1)] == [mine.dispatch_id]
    clock.advance(20)  # the other worker's lease ran out on its only attempt
    outcome = Completion(dispatch_id=mine.dispatch_id, worker_id="w", attempt=1, status="done")
    results, claimed = queue.complete_and_claim([outcome], K, "w", 60, 10, 5)
    assert results == [None]
    recorded = queue.get(mine.dispatch_id)
    assert recorded is not None
    assert (recorded.status.value, recorded.worker_id) == ("done", "w")
    assert [d.dispatch_id for d in claimed] == [pending.dispatch_id]
    reaped = queue.get(doomed.dispatch_id)
    assert reaped is not None
    assert (reaped.status.value, reaped.error) == (
        "failed",
        "abandoned after 1 attempt: lease expired",
    )


def slots_held(url: str) -> dict[int, str]:
    rows = sql(
        url,
        f"SELECT slot, dispatch_id FROM kernel_dispatch_slots WHERE kernel_id = '{K}' "
        "AND dispatch_id IS NOT NULL",
    )
    return {r["slot"]: r["dispatch_id"] for r in rows}


def outcomes_of(claimed: list[Dispatch]) -> list[Completion]:
    return [
        Completion(dispatch_id=d.dispatch_id, worker_id="w", attempt=d.attempts, status="done")
        for d in claimed
    ]


def test_a_claim_hands_the_slots_of_the_dispatches_it_ended_to_those_it_claims(
    url: str, queue: PostgresDispatchQueue, clock: FakeClock
) -> None:
    a, b, c, d, e, f = enqueue(queue, clock, "a", "b", "c", "d", "e", "f")
    first = queue.claim_batch(K, "w", 60, 10, 4)
    assert slots_held(url) == {n: x.dispatch_id for n, x in enumerate((a, b, c, d))}
    queue.complete(a.dispatch_id, "w", status="done", attempt=1)  # slot 0 free
    # c's and d's ends hand slots 2 and 3 on to e and f: not the lower free slot 0.
    results, claimed = queue.complete_and_claim(outcomes_of(first[2:]), K, "w", 60, 10, 2)
    assert results == [None, None]
    assert [status_of(queue, x) for x in (c, d)] == ["done", "done"]
    assert [x.dispatch_id for x in claimed] == [e.dispatch_id, f.dispatch_id]
    after = slots_held(url)
    assert sorted(after) == [1, 2, 3]
    assert after[1] == b.dispatch_id
    assert {after[2], after[3]} == {e.dispatch_id, f.dispatch_id}
    for slot in (2, 3):  # each dispatch row names the slot that names it
        rows = sql(
            url, f"SELECT slot FROM kernel_dispatch_tasks WHERE dispatch_id = '{after[slot]}'"
        )
        assert rows == [{"slot": slot}]
    assert {x.status.value for x in claimed} == {"running"}


def test_slots_handed_on_that_no_claim_fills_are_freed(
    url: str, queue: PostgresDispatchQueue, clock: FakeClock
) -> None:
    enqueue(queue, clock, "a", "b", "c")
    first = queue.claim_batch(K, "w", 60, 3, 3)
    assert len(slots_held(url)) == 3
    # Nothing is left to claim: every slot the ends would have handed on is free again.
    assert queue.complete_and_claim(outcomes_of(first[:2]), K, "w", 60, 3, 3)[1] == []
    assert list(slots_held(url).values()) == [first[2].dispatch_id]
    # A claim limited to fewer dispatches than it ended frees the rest.
    (d,) = enqueue(queue, clock, "d")
    enqueue(queue, clock, "e")
    _, claimed = queue.complete_and_claim(outcomes_of(first[2:]), K, "w", 60, 3, 1)
    assert [x.dispatch_id for x in claimed] == [d.dispatch_id]
    assert list(slots_held(url).values()) == [d.dispatch_id]
    # The cap counts exactly what runs: two more fit beside d, not one more or three.
    assert len(queue.claim_batch(K, "other", 60, 3, 5)) == 1  # e, the only one pending
    f, _ = enqueue(queue, clock, "f", "g")
    assert [x.dispatch_id for x in queue.claim_batch(K, "other", 60, 3, 5)] == [f.dispatch_id]


def test_a_claim_under_a_lowered_cap_counts_the_slots_its_own_ends_free(
    url: str, queue: PostgresDispatchQueue, clock: FakeClock
) -> None:
    enqueue(queue, clock, "a", "b", "c", "d", "e")
    first = queue.claim_batch(K, "w", 60, 3, 3)  # slots 0, 1, 2
    # The cap lowered to 2 while three run: ending two leaves one running, so one more fits.
    results, claimed = queue.complete_and_claim(outcomes_of(first[1:]), K, "w", 60, 2, 5)
    assert results == [None, None]
    assert [status_of(queue, x) for x in first[1:]] == ["done", "done"]
    assert [x.agent_id for x in claimed] == ["d"]
    assert len(slots_held(url)) == 2
    assert queue.claim_batch(K, "w", 60, 2, 5) == []  # a and d: the lower cap is full


def test_a_slot_another_claim_took_after_the_lease_ran_out_is_not_handed_on(
    url: str, queue: PostgresDispatchQueue, clock: FakeClock
) -> None:
    (a,) = enqueue(queue, clock, "a")
    (mine,) = queue.claim_batch(K, "w", 10, 1, 1)
    urgent = queue.enqueue(K, "b", "p", 5, None)
    assert urgent is not None
    enqueue(queue, clock, "c")
    clock.advance(20)  # w's lease ran out: the one slot is free, and b comes before a
    assert [x.dispatch_id for x in queue.claim_batch(K, "other", 60, 1, 1)] == [urgent.dispatch_id]
    results, claimed = queue.complete_and_claim(outcomes_of([mine]), K, "w", 60, 1, 1)
    assert results == [None]  # still running under w: recorded
    assert status_of(queue, a) == "done"
    assert claimed == []  # its slot is b's now: not handed on to c, nor freed
    assert slots_held(url) == {0: urgent.dispatch_id}
    assert len(queue.claim_batch(K, "w", 60, 1, 1)) == 0


def test_an_ended_dispatch_that_held_no_slot_leaves_the_claim_its_free_slots(
    url: str, queue: PostgresDispatchQueue, clock: FakeClock
) -> None:
    a, b = enqueue(queue, clock, "a", "b")
    first = queue.claim_batch(K, "w", 60, 3, 1)
    # A row that names no slot (made outside this protocol): nothing to hand on, and the claim
    # still finds the free slots.
    sql(url, f"UPDATE kernel_dispatch_tasks SET slot = NULL WHERE dispatch_id = '{a.dispatch_id}'")
    sql(url, "UPDATE kernel_dispatch_slots SET dispatch_id = NULL, lease_expires_at = NULL")
    _, claimed = queue.complete_and_claim(outcomes_of(first), K, "w", 60, 3, 3)
    assert [x.dispatch_id for x in claimed] == [b.dispatch_id]
    assert list(slots_held(url).values()) == [b.dispatch_id]


def test_opening_a_store_replaces_claim_functions_of_another_version(url: str) -> None:
    open_queue(url).close()
    tag = "SELECT obj_description(to_regprocedure(%s), 'pg_proc') AS tag"
    signature = pg_queue._COMPLETE_AND_CLAIM_SIGNATURE
    assert sql(url, tag.replace("%s", f"'{signature}'")) == [{"tag": pg_queue._FUNCTIONS_TAG}]
    # What an older fsm-kernel left: the same signatures, other bodies, no version comment.
    for ddl in (pg_queue._CLAIM_DDL, pg_queue._COMPLETE_AND_CLAIM_DDL):
        header = ddl[: ddl.index("$fn$")]
        sql(url, f"{header}$fn$ BEGIN RAISE EXCEPTION 'the old body'; END $fn$")
    sql(url, f"COMMENT ON FUNCTION {pg_queue._COMPLETE_AND_CLAIM_SIGNATURE} IS NULL")
    stale = open_queue(url)
    try:
        assert isinstance(stale, PostgresDispatchQueue)
        stale.enqueue(K, "a", "p", 0, None)
        (claimed,) = stale.claim_batch(K, "w", 60, 2, 2)
        assert stale.complete_and_claim(outcomes_of([claimed]), K, "w", 60, 2, 2) == ([None], [])
    finally:
        stale.close()
    assert sql(url, tag.replace("%s", f"'{signature}'")) == [{"tag": pg_queue._FUNCTIONS_TAG}]
    # A store whose functions carry another version is brought to this one too.
    sql(url, f"COMMENT ON FUNCTION {signature} IS 'fsm-kernel dispatch functions v1'")
    open_queue(url).close()
    assert sql(url, tag.replace("%s", f"'{signature}'")) == [{"tag": pg_queue._FUNCTIONS_TAG}]
    # What version 2 left: the outcomes as six arrays (another signature), each recorded one
    # returned as its whole row. Its function goes: a worker of that version still running
    # fails its claims (a StoreError it logs) instead of misreading this version's rows.
    arrays = pg_queue._ARRAYS_SIGNATURE
    sql(url, f"DROP FUNCTION {signature}")
    header = pg_queue._COMPLETE_AND_CLAIM_DDL[: pg_queue._COMPLETE_AND_CLAIM_DDL.index("$fn$")]
    header = header.replace(
        "p_outcomes json",
        "p_ids text[], p_attempts integer[], "
        "p_statuses text[], p_run_ids text[], p_reasons text[], "
        "p_errors text[]",
    )
    sql(url, f"{header}$fn$ BEGIN RAISE EXCEPTION 'the v2 body'; END $fn$")
    sql(url, f"COMMENT ON FUNCTION {arrays} IS 'fsm-kernel dispatch functions v2'")
    exists = "SELECT to_regprocedure(%s) IS NOT NULL AS found"
    assert sql(url, exists.replace("%s", f"'{arrays}'")) == [{"found": True}]
    again = open_queue(url)
    try:
        assert isinstance(again, PostgresDispatchQueue)
        again.enqueue(K, "b", "p", 0, None)
        (claimed,) = again.claim_batch(K, "w", 60, 2, 2)
        assert again.complete_and_claim(outcomes_of([claimed]), K, "w", 60, 2, 2) == ([None], [])
        assert status_of(again, claimed) == "done"
    finally:
        again.close()
    assert sql(url, tag.replace("%s", f"'{signature}'")) == [{"tag": pg_queue._FUNCTIONS_TAG}]
    assert sql(url, exists.replace("%s", f"'{arrays}'")) == [{"found": False}]


def test_the_queue_reads_times_in_utc_whatever_the_server_zone(url: str, clock: FakeClock) -> None:
    sql(
        url,
        "DO $$BEGIN EXECUTE format('ALTER DATABASE %I SET TimeZone = %L', "
        "current_database(), 'America/New_York'); END$$",
    )
    queue = open_queue(url, clock=clock)
    try:
        assert isinstance(queue, PostgresDispatchQueue)
        made = queue.enqueue(K, "a", "p", 0, None)
        assert made is not None
        with queue._main.session() as conn:  # rows' times arrive as Python's own UTC
            assert conn.execute("SHOW TimeZone").fetchone() == {"TimeZone": "UTC"}
        row = queue.get(made.dispatch_id)
        assert row is not None
        assert row.created_at == clock.now()
        assert row.created_at.tzinfo is UTC
    finally:
        queue.close()
