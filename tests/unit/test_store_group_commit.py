"""The SQLite store's group commit (append_batches, how the run recorder writes the batches of
many concurrent runs): the batches of a group go in as one (multi-row statements for their
events and for the run rows they only advance), with exactly the outcome of appending them
one by one, and a conflicting batch still fails alone. A lone batch goes in a row a step."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

import fsm_kernel.store._sql as sql_module
from fsm_kernel.errors import StoreConflictError, StoreError
from fsm_kernel.protocol import Event, EventType
from fsm_kernel.store import SqliteEventStore
from fsm_kernel.store._schema import encode_data

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def ev(
    run_id: str,
    seq: int,
    type_: EventType = EventType.STATE_ENTERED,
    *,
    iteration: int = 0,
    data: dict[str, Any] | None = None,
) -> Event:
    if data is None:
        data = {"workflow": "w", "goal": run_id} if type_ is EventType.RUN_STARTED else {}
    return Event(
        run_id=run_id,
        seq=seq,
        type=type_,
        timestamp=T0 + timedelta(seconds=seq),
        iteration=iteration,
        state="think",
        data=data,
    )


def responded(run_id: str, seq: int, used: int) -> Event:
    usage = {"prompt_tokens": used, "completion_tokens": 1}
    return ev(run_id, seq, EventType.MODEL_RESPONDED, data={"completion": {"usage": usage}})


def iteration(run_id: str, seq: int, n: int) -> Event:
    return ev(run_id, seq, EventType.ITERATION_COMPLETED, iteration=n, data={"step": n})


def runs_batches() -> list[list[tuple[list[Event], bool]]]:
    """Groups of batches as concurrent runs commit them: new runs, runs the store has
    written (their progress), a run twice in one group, an ending, more events in one group
    than one statement carries."""
    started = [([ev(f"r{i}", 1, EventType.RUN_STARTED), ev(f"r{i}", 2)], True) for i in range(5)]
    progress = [
        ([responded("r0", 3, 10), ev("r0", 4)], True),
        ([iteration("r1", 3, 1)], False),
        ([responded("r2", 3, 7)], True),
        ([iteration("r2", 4, 1), responded("r2", 5, 3)], True),  # r2 again, same group
        ([ev("r3", 3)], False),  # bookkeeping only: the row stays as it is
        ([ev("r4", 3, EventType.RUN_TERMINATED, iteration=0, data={"reason": "done"})], True),
    ]
    many = [([ev(f"r{i}", 10), ev(f"r{i}", 11)], False) for i in range(4)]
    bulk = [([ev("r0", seq) for seq in range(20, 20 + 300)], False)]  # > ROWS_PER_INSERT
    late = [([iteration("r0", 400, 2), iteration("r0", 401, 3)], True)]
    return [started, progress, many + bulk, late]


def contents(store: SqliteEventStore) -> tuple[list[Any], list[Any]]:
    runs = sorted(store.list_runs(limit=100), key=lambda r: r.run_id)
    events = [e for r in runs for e in store.read(r.run_id)]
    return [(e.run_id, e.seq, e.type, e.timestamp, e.data) for e in events], runs


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[tuple[SqliteEventStore, SqliteEventStore]]:
    with (
        SqliteEventStore(tmp_path / "one.db") as one_by_one,
        SqliteEventStore(tmp_path / "grouped.db") as grouped,
    ):
        yield one_by_one, grouped


@pytest.mark.parametrize("update_from", [True, False], ids=["update-from", "executemany"])
def test_a_group_stores_exactly_what_appending_its_batches_one_by_one_stores(
    stores: tuple[SqliteEventStore, SqliteEventStore],
    monkeypatch: pytest.MonkeyPatch,
    update_from: bool,
) -> None:
    one_by_one, grouped = stores
    monkeypatch.setattr(SqliteEventStore, "_update_from", update_from)
    for group in runs_batches():
        for events, durable in group:
            one_by_one.append(events, durable=durable)
        assert grouped.append_batches(group) == [None] * len(group)
    assert contents(grouped) == contents(one_by_one)
    summary = {r.run_id: r for r in grouped.list_runs(limit=100)}
    assert (summary["r0"].iterations, summary["r0"].tokens) == (3, 11)
    assert (summary["r2"].iterations, summary["r2"].tokens) == (1, 8 + 4)
    assert summary["r2"].updated_at == T0 + timedelta(seconds=5)
    assert (summary["r4"].status, summary["r4"].termination_reason) == ("ended", "done")
    assert [e.seq for e in grouped.read("r0")][-3:] == [319, 400, 401]


def test_a_group_writes_its_events_and_progress_in_a_few_statements(
    stores: tuple[SqliteEventStore, SqliteEventStore],
) -> None:
    _, grouped = stores
    first, second, *_ = runs_batches()
    grouped.append_batches(first)
    statements: list[str] = []
    assert grouped._conn is not None
    grouped._conn.set_trace_callback(statements.append)
    grouped.append_batches(second)
    inserts = [s.count("), (") + 1 for s in statements if s.startswith("INSERT INTO events")]
    updates = [s for s in statements if s.startswith("UPDATE runs")]
    assert inserts == [8]  # the 8 events of 6 batches in one statement
    # r0, r1 and r2 (twice, folded into one row) advanced together: 3 rows, 2 + 1
    assert [u.count("), (") + 1 for u in updates] == [2, 1]
    assert "('r2', 1, '2026-03-01T12:00:05.000000+00:00', 12)" in updates[1]
    assert not [s for s in statements if "SAVEPOINT batch" in s]  # no conflict: no batch's own


def test_a_conflicting_batch_fails_alone_and_the_others_of_its_group_are_stored(
    stores: tuple[SqliteEventStore, SqliteEventStore],
) -> None:
    _, store = stores
    store.append([ev("old", 1, EventType.RUN_STARTED)])
    group = [
        ([ev("new", 1, EventType.RUN_STARTED), ev("new", 2)], True),  # numbered, rolled back,
        ([ev("old", 1), ev("old", 2)], True),  # the conflict            # numbered again
        ([iteration("old", 3, 1)], False),
        ([ev("late", 1, EventType.RUN_STARTED)], True),
    ]
    errors = store.append_batches(group)
    assert [errors[0], errors[2], errors[3]] == [None, None, None]
    assert isinstance(errors[1], StoreConflictError)
    assert "run old: seq 1 already exists" in str(errors[1])
    assert [(e.run_id, e.seq) for e in store.read("new")] == [("new", 1), ("new", 2)]
    assert [e.seq for e in store.read("old")] == [1, 3]
    assert [e.seq for e in store.read("late")] == [1]
    assert store._run_nos == {"old": 1, "new": 2, "late": 3}
    assert {r.run_id: r.iterations for r in store.list_runs()} == {"old": 1, "new": 0, "late": 0}


def test_a_groups_rows_go_in_statements_of_at_most_rows_per_insert_each_a_power_of_two(
    stores: tuple[SqliteEventStore, SqliteEventStore],
) -> None:
    _, store = stores
    store.append([ev("r", 1, EventType.RUN_STARTED)])
    statements: list[str] = []
    assert store._conn is not None
    store._conn.set_trace_callback(statements.append)
    count = sql_module.ROWS_PER_INSERT * 2 + 37  # 128 + 128 + 32 + 4 + 1
    group = [([ev("r", seq) for seq in range(2, 2 + count)], False), ([ev("q", 1)], True)]
    assert store.append_batches(group) == [None, None]
    sizes = [s.count("), (") + 1 for s in statements if s.startswith("INSERT INTO events")]
    assert sizes == [128, 128, 32, 4, 2]
    assert [e.seq for e in store.read("r")] == list(range(1, 2 + count))
    assert [e.seq for e in store.read("q")] == [1]


def test_a_lone_batch_inserts_a_row_a_step_and_updates_its_run_by_key(
    stores: tuple[SqliteEventStore, SqliteEventStore],
) -> None:
    _, store = stores
    store.append([ev("r", 1, EventType.RUN_STARTED)])
    statements: list[str] = []
    assert store._conn is not None
    store._conn.set_trace_callback(statements.append)
    store.append([ev("r", 2), ev("r", 3), iteration("r", 4, 1)])
    inserts = [s for s in statements if s.startswith("INSERT INTO events")]
    assert len(inserts) == 3
    assert all("), (" not in s for s in inserts)
    [update] = [s for s in statements if s.startswith("UPDATE runs")]
    assert " FROM " not in update
    assert store.list_runs()[0].iterations == 1


@pytest.mark.parametrize(
    "data",
    [
        {"b": [1, 2.5, None, True, False], "a": 'é\n"\\ \u2028', "c": {"z": {}, "y": []}},
        {"nested": {"k": [{"x": 1e300, "y": -0.0, "z": 12345678901234567890}]}},
        {"text": "日本語", "emoji": "\U0001f600", "ctrl": "\x00\x1f"},
        {},
    ],
)
def test_event_data_is_encoded_as_compact_sorted_json(data: dict[str, Any]) -> None:
    expected = json.dumps(data, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    assert encode_data(ev("r", 1, data=data)) == expected


@pytest.mark.parametrize(
    ("data", "why"),
    [
        ({"x": math.nan}, "Out of range float values"),
        ({"x": object()}, "not JSON serializable"),
        ({"x": {1: 2, "a": 3}}, "not supported between"),
    ],
)
def test_data_that_is_not_plain_json_is_refused_with_the_event_named(
    data: dict[str, Any], why: str
) -> None:
    with pytest.raises(StoreError, match=f"event r#7 .*data is not plain JSON: .*{why}"):
        encode_data(ev("r", 7, data=data))


def test_circular_data_is_refused_and_the_next_event_encodes(tmp_path: Path) -> None:
    loop: dict[str, Any] = {}
    loop["self"] = loop
    with pytest.raises(StoreError, match="data is not plain JSON"):
        encode_data(ev("r", 1, data=loop))
    fine = {"a": [1]}
    assert encode_data(ev("r", 2, data=fine)) == '{"a":[1]}'
    assert encode_data(ev("r", 3, data={"again": fine})) == '{"again":{"a":[1]}}'


@pytest.mark.postgres
def test_postgres_stores_a_group_as_one_by_one_appends_and_fails_a_conflict_alone(
    pg_dsn: str, tmp_path: Path
) -> None:
    from fsm_kernel.store.postgres import PostgresEventStore

    with (
        SqliteEventStore(tmp_path / "one.db") as one_by_one,
        PostgresEventStore(pg_dsn) as grouped,
    ):
        for group in runs_batches():
            for events, durable in group:
                one_by_one.append(events, durable=durable)
            assert grouped.append_batches(group) == [None] * len(group)
        assert contents(grouped) == contents(one_by_one)
        conflict = [([ev("r0", 1)], True), ([iteration("r1", 500, 4)], False)]
        errors = grouped.append_batches(conflict)
        assert isinstance(errors[0], StoreConflictError)
        assert errors[1] is None
        assert {r.run_id: r.iterations for r in grouped.list_runs()}["r1"] == 4


@pytest.mark.parametrize("update_from", [True, False], ids=["update-from", "executemany"])
def test_a_group_folds_a_runs_progress_as_appending_one_by_one_would(
    stores: tuple[SqliteEventStore, SqliteEventStore],
    monkeypatch: pytest.MonkeyPatch,
    update_from: bool,
) -> None:
    # A run twice in one group, its second batch stamped earlier (the wall clock stepped
    # back) and with a lower iteration: the row keeps the greatest of each, as progress_run
    # leaves it after each batch in turn.
    one_by_one, grouped = stores
    monkeypatch.setattr(SqliteEventStore, "_update_from", update_from)
    first = [
        ([ev("r", 1, EventType.RUN_STARTED)], True),
        ([ev("s", 1, EventType.RUN_STARTED)], True),
    ]
    ahead = ev("r", 2, EventType.ITERATION_COMPLETED, iteration=5, data={"step": 5})
    behind = Event(
        run_id="r",
        seq=3,
        type=EventType.ITERATION_COMPLETED,
        timestamp=T0 - timedelta(hours=1),
        iteration=4,
        state="think",
        data={"step": 4},
    )
    second = [([ahead], True), ([iteration("s", 2, 1)], True), ([behind], True)]
    for group in (first, second):
        for events, durable in group:
            one_by_one.append(events, durable=durable)
        assert grouped.append_batches(group) == [None] * len(group)
    assert contents(grouped) == contents(one_by_one)
    run = {r.run_id: r for r in grouped.list_runs()}["r"]
    assert (run.iterations, run.updated_at) == (5, T0 + timedelta(seconds=2))
