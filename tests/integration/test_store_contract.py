"""The EventStore contract: one set of test bodies run against every backend (SQLite and JSONL
files in tmp_path, and a real PostgreSQL database from tests/pg.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from fsm_kernel.errors import (
    ResumeError,
    RunLockedError,
    RunNotFoundError,
    StoreConflictError,
    StoreError,
)
from fsm_kernel.protocol import (
    Completion,
    Event,
    EventStore,
    EventType,
    Message,
    RunFilter,
    Tool,
    ToolCall,
)
from fsm_kernel.store import (
    AnyEventStore,
    JsonlEventStore,
    PostgresEventStore,
    SqliteEventStore,
    export_run,
    import_events,
)
from fsm_kernel.store._sql import event_row

REPO = Path(__file__).resolve().parents[2]
T0 = datetime(2026, 3, 1, 12, 0, 0, 250000, tzinfo=UTC)
_CLASSES: dict[str, Callable[[str], AnyEventStore]] = {
    "sqlite": SqliteEventStore,
    "jsonl": JsonlEventStore,
    "postgres": PostgresEventStore,
}


@dataclass
class Backend:
    kind: str
    location: str

    def open(self) -> AnyEventStore:
        return _CLASSES[self.kind](self.location)


BACKENDS = ["sqlite", "jsonl", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    kind: str = request.param
    if kind == "postgres":
        return Backend(kind, request.getfixturevalue("pg_dsn"))
    suffix = "db" if kind == "sqlite" else "jsonl"
    return Backend(kind, str(tmp_path / "store" / f"events.{suffix}"))


@pytest.fixture
def store(backend: Backend) -> Iterator[AnyEventStore]:
    with backend.open() as opened:
        yield opened


def ev(
    run_id: str,
    seq: int,
    type_: EventType = EventType.STATE_ENTERED,
    *,
    iteration: int = 0,
    data: dict[str, Any] | None = None,
    ts: datetime | None = None,
    state: str | None = "think",
) -> Event:
    return Event(
        run_id=run_id,
        seq=seq,
        type=type_,
        timestamp=ts or T0 + timedelta(seconds=seq),
        iteration=iteration,
        state=state,
        data=data if data is not None else {"n": seq},
    )


def started(run_id: str, *, ts: datetime = T0, workflow: str = "default", goal: str = "g") -> Event:
    data = {"workflow": workflow, "goal": goal}
    return ev(run_id, 1, EventType.RUN_STARTED, data=data, ts=ts, state=None)


def seqs(store: EventStore, run_id: str) -> list[int]:
    return [e.seq for e in store.read(run_id)]


def test_append_and_read_back_in_seq_order(store: AnyEventStore) -> None:
    first = [started("r1"), ev("r1", 2)]
    later = [ev("r1", 4), ev("r1", 3)]  # a batch need not be sorted
    store.append(first)
    store.append([])
    store.append(later)

    events = store.read("r1")

    assert [e.seq for e in events] == [1, 2, 3, 4]
    assert events == [*first, later[1], later[0]]


def test_events_of_several_runs_are_kept_apart(store: AnyEventStore) -> None:
    store.append([started("a"), started("b")])
    store.append([ev("a", 2), ev("b", 2), ev("a", 3)])

    assert seqs(store, "a") == [1, 2, 3]
    assert seqs(store, "b") == [1, 2]
    assert {e.run_id for e in store.read("b")} == {"b"}
    assert store.read("unknown") == []


def test_conflicting_append_is_refused_and_writes_nothing(store: AnyEventStore) -> None:
    store.append([started("r"), ev("r", 2)])
    before = store.list_runs()
    batch = [
        ev("r", 3, EventType.ITERATION_COMPLETED, iteration=1),
        ev("r", 2, data={"other": True}),
        ev("r", 4, EventType.RUN_TERMINATED, data={"reason": "done"}),
        ev("fresh", 1),
    ]

    with pytest.raises(StoreConflictError, match=r"seq 2\b"):
        store.append(batch)

    assert seqs(store, "r") == [1, 2]
    assert store.read("r")[1].data == {"n": 2}
    assert store.read("fresh") == []
    assert store.list_runs() == before  # the runs row moved in the same transaction
    assert store.next_seq("r") == 3


def test_same_seq_twice_in_one_batch_is_a_conflict(store: AnyEventStore) -> None:
    with pytest.raises(StoreConflictError, match="twice"):
        store.append([started("r"), ev("r", 2), ev("r", 2)])

    assert store.read("r") == []
    assert store.list_runs() == []


def test_batch_with_unstorable_data_writes_nothing(store: AnyEventStore) -> None:
    store.append([started("r")])

    with pytest.raises(StoreError, match="plain JSON"):
        store.append([ev("r", 2), ev("r", 3, data={"x": float("nan")})])
    with pytest.raises(StoreError, match="plain JSON"):
        store.append([ev("r", 2, data={"x": object()})])
    with pytest.raises(StoreError, match="plain JSON"):
        store.append([ev("r", 2, data={"x": {1: "int key", "b": "str key"}})])
    with pytest.raises(StoreError, match="timezone-aware"):
        store.append([ev("r", 2, ts=datetime(2026, 1, 1))])
    with pytest.raises(StoreError, match="seq must be"):
        store.append([ev("r", 0)])

    assert seqs(store, "r") == [1]


def test_next_seq(store: AnyEventStore) -> None:
    assert store.next_seq("r") == 1
    store.append([started("r"), ev("r", 2)])
    assert store.next_seq("r") == 3
    store.append([ev("r", 7)])
    assert store.next_seq("r") == 8
    assert store.next_seq("other") == 1


def test_list_runs_newest_first_with_iterations_and_reason(store: AnyEventStore) -> None:
    hour = timedelta(hours=1)
    plus2 = timezone(timedelta(hours=2))
    store.append([started("mid", ts=T0 + hour, workflow="react", goal="find x")])
    store.append([started("new", ts=T0 + 2 * hour, workflow="plan", goal="ship")])
    # Local time 13:30+02:00 is 11:30 UTC: the oldest, whatever its text says.
    store.append([started("old", ts=(T0 - 0.5 * hour).astimezone(plus2), goal="")])
    store.append([ev("mid", 2, EventType.ITERATION_COMPLETED, iteration=1)])
    store.append(
        [ev("mid", 3, iteration=9), ev("mid", 4, EventType.ITERATION_COMPLETED, iteration=2)]
    )
    store.append([ev("mid", 5, EventType.RUN_TERMINATED, data={"reason": "done"})])
    store.append([ev("new", 2, EventType.ITERATION_COMPLETED, iteration=1)])

    runs = store.list_runs()

    assert [r.run_id for r in runs] == ["new", "mid", "old"]
    mid = runs[1]
    assert (mid.workflow, mid.goal, mid.iterations) == ("react", "find x", 2)
    assert mid.termination_reason == "done"
    assert mid.started_at == T0 + hour
    assert (runs[0].iterations, runs[0].termination_reason) == (1, None)
    assert (runs[2].iterations, runs[2].goal) == (0, "")
    assert [r.run_id for r in store.list_runs(limit=2)] == ["new", "mid"]
    assert store.list_runs(limit=0) == []


def test_run_seen_before_its_start_event_is_listed(store: AnyEventStore) -> None:
    store.append([ev("r", 2, EventType.ITERATION_COMPLETED, iteration=3, ts=T0)])
    assert [(r.workflow, r.iterations) for r in store.list_runs()] == [("", 3)]

    store.append([started("r", ts=T0 - timedelta(seconds=5), workflow="late")])

    (run,) = store.list_runs()
    assert (run.workflow, run.iterations, run.started_at) == ("late", 3, T0 - timedelta(seconds=5))


def test_find_run_by_id_and_unique_prefix(store: AnyEventStore) -> None:
    ids = ["0199aaaa-1111", "0199aaaa-2222", "0199bbbb-3333", "run1", "run10"]
    store.append([started(run_id) for run_id in ids])

    assert store.find_run("0199b") == "0199bbbb-3333"
    assert store.find_run("0199aaaa-2222") == "0199aaaa-2222"
    assert store.find_run(" 0199aaaa-1 ") == "0199aaaa-1111"
    assert store.find_run("run1") == "run1"  # an exact id wins over longer ids it prefixes
    assert store.find_run("run10") == "run10"


def test_find_run_unknown_or_ambiguous(store: AnyEventStore) -> None:
    store.append([started(run_id) for run_id in ("0199aaaa-1111", "0199aaaa-2222", "x%_y")])

    with pytest.raises(RunNotFoundError, match="ambiguous") as ambiguous:
        store.find_run("0199a")
    assert "0199aaaa-1111" in str(ambiguous.value)
    assert "0199aaaa-2222" in str(ambiguous.value)
    with pytest.raises(RunNotFoundError, match="no run"):
        store.find_run("zzz")
    with pytest.raises(RunNotFoundError):
        store.find_run("   ")
    with pytest.raises(RunNotFoundError):
        store.find_run("x_")  # no LIKE wildcards: '_' is a plain character
    assert store.find_run("x%") == "x%_y"


def test_ambiguous_prefix_lists_a_bounded_number_of_candidates(store: AnyEventStore) -> None:
    store.append([started(f"run-{i:02d}") for i in range(15)])

    with pytest.raises(RunNotFoundError) as info:
        store.find_run("run-")

    message = str(info.value)
    assert "run-00" in message
    assert "run-09" in message
    assert "run-10" not in message
    assert message.endswith("...")


def test_concurrent_threads_appending_to_different_runs(store: AnyEventStore) -> None:
    threads, per_thread = 8, 50
    barrier = threading.Barrier(threads)
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            barrier.wait()
            for seq in range(1, per_thread + 1):
                store.append([ev(f"t{n}", seq, iteration=seq)])
        except BaseException as exc:  # handed to the main thread
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()

    assert errors == []
    for n in range(threads):
        assert seqs(store, f"t{n}") == list(range(1, per_thread + 1))
    assert len(store.list_runs(limit=100)) == threads


def test_racing_writers_of_one_seq_exactly_one_wins(backend: Backend) -> None:
    writers = 6
    stores = [backend.open() for _ in range(writers)]  # separate connections / descriptors
    barrier = threading.Barrier(writers)
    outcomes: list[str] = []

    def work(n: int) -> None:
        barrier.wait()
        try:
            stores[n].append([ev("race", 1, data={"writer": n})])
            outcomes.append("won")
        except StoreConflictError:
            outcomes.append("conflict")

    workers = [threading.Thread(target=work, args=(n,)) for n in range(writers)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    try:
        assert sorted(outcomes) == ["conflict"] * (writers - 1) + ["won"]
        assert len(stores[0].read("race")) == 1
    finally:
        for opened in stores:
            opened.close()


_WRITER = """
import sys
from datetime import UTC, datetime
from fsm_kernel.protocol import Event, EventType
from fsm_kernel.store import JsonlEventStore, PostgresEventStore, SqliteEventStore

kind, location, run_id, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
cls = {"sqlite": SqliteEventStore, "jsonl": JsonlEventStore, "postgres": PostgresEventStore}[kind]
with cls(location) as store:
    for seq in range(1, count + 1):
        store.append([Event(run_id=run_id, seq=seq, type=EventType.STATE_ENTERED,
                            timestamp=datetime.now(UTC), data={"pid": run_id})])
"""


def test_two_processes_appending_to_one_store(backend: Backend) -> None:
    backend.open().close()  # as the kernel does: the schema exists before workers start
    count = 150
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, backend.kind, backend.location, f"p{n}", str(count)],
            cwd=REPO,
            env=dict(os.environ),
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in range(2)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err

    with backend.open() as store:
        for n in range(2):
            assert seqs(store, f"p{n}") == list(range(1, count + 1))


_ACKER = """
import sys
from datetime import UTC, datetime
from fsm_kernel.protocol import Event, EventType
from fsm_kernel.store import JsonlEventStore, PostgresEventStore, SqliteEventStore

kind, location = sys.argv[1], sys.argv[2]
cls = {"sqlite": SqliteEventStore, "jsonl": JsonlEventStore, "postgres": PostgresEventStore}[kind]
store = cls(location)
for seq in range(1, 100_000):
    store.append([Event(run_id="killed", seq=seq, type=EventType.TOOL_FINISHED,
                        timestamp=datetime.now(UTC), data={"output": "x" * 200})])
    print(seq, flush=True)
"""


def test_events_acknowledged_before_sigkill_survive(backend: Backend) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _ACKER, backend.kind, backend.location],
        cwd=REPO,
        env=dict(os.environ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    acked = 0
    try:
        for line in proc.stdout:
            acked = int(line)
            if acked >= 40:
                break
    finally:
        proc.kill()  # SIGKILL: no atexit, no close, no flush
        _, err = proc.communicate(timeout=30)
    assert acked >= 40, err

    with backend.open() as store:
        stored = seqs(store, "killed")
    assert stored[:acked] == list(range(1, acked + 1))
    assert stored == list(range(1, len(stored) + 1))


_RELAXED_ACKER = """
import sys
from datetime import UTC, datetime
from fsm_kernel.protocol import Event, EventType
from fsm_kernel.store import JsonlEventStore, PostgresEventStore, SqliteEventStore

kind, location, how = sys.argv[1], sys.argv[2], sys.argv[3]
cls = {"sqlite": SqliteEventStore, "jsonl": JsonlEventStore, "postgres": PostgresEventStore}[kind]
store = cls(location)
for seq in range(1, 100_000):
    batch = [Event(run_id="killed", seq=seq, type=EventType.STATE_ENTERED,
                   timestamp=datetime.now(UTC), data={"n": seq})]
    if how == "relaxed" or not store.append_if_idle(batch):
        store.append(batch, durable=False)
    print(seq, flush=True)
"""


@pytest.mark.parametrize("how", ["relaxed", "idle"])
def test_relaxed_appends_acknowledged_before_sigkill_survive(backend: Backend, how: str) -> None:
    """`durable=False` and `append_if_idle` skip the wait for the disk, not the commit: what
    was acknowledged survives the process being killed."""
    if how == "idle" and backend.kind == "postgres":
        pytest.skip("append_if_idle is for local stores (a relaxed PostgreSQL commit is I/O)")
    proc = subprocess.Popen(
        [sys.executable, "-c", _RELAXED_ACKER, backend.kind, backend.location, how],
        cwd=REPO,
        env=dict(os.environ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    acked = 0
    try:
        for line in proc.stdout:
            acked = int(line)
            if acked >= 40:
                break
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=30)
    assert acked >= 40, err
    with backend.open() as store:
        stored = seqs(store, "killed")
    assert stored[:acked] == list(range(1, acked + 1))
    assert stored == list(range(1, len(stored) + 1))


def test_concurrent_appends_commit_together_and_fail_alone(store: AnyEventStore) -> None:
    store.append([started("dup")])
    threads = 10
    barrier = threading.Barrier(threads)
    outcomes: dict[int, str] = {}

    def work(n: int) -> None:
        barrier.wait()
        batch = [ev("dup", 1)] if n == 3 else [ev(f"g{n}", 1), ev(f"g{n}", 2)]
        try:
            store.append(batch, durable=n % 2 == 0)
            outcomes[n] = "ok"
        except StoreConflictError:
            outcomes[n] = "conflict"

    workers = [threading.Thread(target=work, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert outcomes == {n: "conflict" if n == 3 else "ok" for n in range(threads)}
    assert [e.type for e in store.read("dup")] == [EventType.RUN_STARTED]
    for n in range(threads):
        if n != 3:
            assert seqs(store, f"g{n}") == [1, 2]


def test_reopened_store_reads_everything_back(backend: Backend) -> None:
    with backend.open() as store:
        store.append([started("r", workflow="react", goal="keep me")])
        store.append([ev("r", 2, EventType.ITERATION_COMPLETED, iteration=1)])
        store.append([ev("r", 3, EventType.RUN_TERMINATED, data={"reason": "final_answer"})])
        expected = store.read("r")
    with pytest.raises(StoreError, match="closed"):
        store.read("r")
    store.close()  # idempotent

    with backend.open() as reopened:
        assert reopened.read("r") == expected
        (run,) = reopened.list_runs()
        assert (run.goal, run.iterations, run.termination_reason) == ("keep me", 1, "final_answer")
        assert reopened.next_seq("r") == 4
        assert reopened.find_run("r") == "r"


def test_opening_twice_is_fine_and_both_see_the_same_log(backend: Backend) -> None:
    with backend.open() as first, backend.open() as second:
        first.append([started("r")])
        second.append([ev("r", 2)])

        assert seqs(first, "r") == [1, 2]
        assert seqs(second, "r") == [1, 2]
        with pytest.raises(StoreConflictError):
            first.append([ev("r", 2)])
    with backend.open() as third:
        assert seqs(third, "r") == [1, 2]


def test_round_trip_of_every_field(store: AnyEventStore) -> None:
    ist = timezone(timedelta(hours=5, minutes=30))
    data = {
        "text": 'naïve café — 日本語 🚀 "quoted" back\\slash\nnew line\ttab',
        "nested": {"list": [1, 2.5, None, True, False, "x", {"deep": ["é"]}], "empty": {}},
        "big": 2**62,
        "small": -7,
        "float": 0.1,
        "tiny": 1e-7,
        "none": None,
        "clé ünïcode": [],
    }
    run_id = "run-ü-🚀"
    events = [
        Event(
            run_id=run_id,
            seq=seq,
            type=type_,
            timestamp=datetime(2026, 7, 4, 23, 59, 59, 999999, tzinfo=ist) + timedelta(days=seq),
            iteration=seq * 3,
            state=None if seq % 2 else f"état-{seq} ✓",
            data={**data, "type": type_.value},
        )
        for seq, type_ in enumerate(EventType, start=1)
    ]

    store.append(events)
    back = store.read(run_id)

    assert back == events
    assert [e.type for e in back] == list(EventType)
    assert all(e.timestamp.utcoffset() == timedelta(0) for e in back)
    assert back[0].timestamp.microsecond == 999999
    assert store.find_run("run-ü") == run_id


def _other(kind: str, tmp_path: Path) -> AnyEventStore:
    if kind == "sqlite":
        return JsonlEventStore(tmp_path / "copy" / "events.jsonl")
    return SqliteEventStore(tmp_path / "copy" / "events.db")


def test_export_to_jsonl_and_import_elsewhere(
    store: AnyEventStore, backend: Backend, tmp_path: Path
) -> None:
    events = [
        started("keep", workflow="react", goal="ünïcode goal"),
        ev("keep", 2, data={"nested": {"a": [1, {"b": None}]}}),
        ev("keep", 3, EventType.ITERATION_COMPLETED, iteration=1),
        ev("keep", 4, EventType.RUN_TERMINATED, data={"reason": "done"}),
    ]
    store.append([*events, started("skip")])
    target_file = tmp_path / "exports" / "keep.jsonl"

    assert export_run(store, "keep", target_file) == 4

    with _other(backend.kind, tmp_path) as other:
        assert import_events(other, target_file) == 4
        assert other.read("keep") == events
        assert other.read("skip") == []
        assert other.list_runs() == [r for r in store.list_runs() if r.run_id == "keep"]
        with pytest.raises(StoreConflictError):
            import_events(other, target_file)
        assert len(other.read("keep")) == 4


def test_import_into_this_backend(store: AnyEventStore, tmp_path: Path) -> None:
    events = [
        started("imp"),
        ev("imp", 2),
        ev("imp", 3, EventType.ITERATION_COMPLETED, iteration=1),
    ]
    with SqliteEventStore(tmp_path / "src.db") as source:
        source.append(events)
        export_run(source, "imp", tmp_path / "imp.jsonl")

    assert import_events(store, tmp_path / "imp.jsonl") == 3
    assert store.read("imp") == events
    assert store.list_runs()[0].iterations == 1


def test_export_of_an_unknown_run(store: AnyEventStore, tmp_path: Path) -> None:
    with pytest.raises(RunNotFoundError):
        export_run(store, "nope", tmp_path / "nope.jsonl")
    assert not (tmp_path / "nope.jsonl").exists()


def test_list_runs_rejects_a_negative_limit(store: AnyEventStore) -> None:
    with pytest.raises(ValueError, match="limit"):
        store.list_runs(limit=-1)


# --- summaries, filters and pages (the run viewer's listing) ----------------------------------


def responded(run_id: str, seq: int, usage: dict[str, int]) -> Event:
    completion = {"message": {"role": "assistant", "content": "x"}, "usage": usage}
    return ev(run_id, seq, EventType.MODEL_RESPONDED, data={"completion": completion})


def test_summaries_carry_tokens_status_and_last_change(store: AnyEventStore) -> None:
    store.append([started("r")])
    with store.lock_run("r"):  # a process drives it
        assert store.list_runs()[0].status == "running"
    assert store.list_runs()[0].status == "interrupted"  # none does: it died
    store.append([responded("r", 2, {"prompt_tokens": 10, "completion_tokens": 5})])
    store.append([responded("r", 3, {"total_tokens": 7}), ev("r", 4)])  # no split: the total
    store.append([ev("r", 5, EventType.RUN_TERMINATED, data={"reason": "agent_error"})])

    (run,) = store.list_runs()
    assert (run.tokens, run.status, run.termination_reason) == (22, "ended", "agent_error")
    assert run.shown_status == "agent_error"
    assert run.updated_at == T0 + timedelta(seconds=5)

    with store.lock_run("r"):
        store.append([ev("r", 6, EventType.RUN_RESUMED, data={})])  # a resume reopens it
        (run,) = store.list_runs()
    assert (run.status, run.termination_reason, run.tokens) == ("running", None, 22)
    store.append([ev("r", 7, EventType.RUN_TERMINATED, data={"reason": "done"})])
    assert store.list_runs()[0].shown_status == "done"
    assert store.list_runs()[0].updated_at == T0 + timedelta(seconds=7)


def _fill(store: AnyEventStore) -> list[str]:
    """Nine runs a minute apart, newest last: workflows, statuses and goals to filter on."""
    ids = [f"run-{i}" for i in range(9)]
    for i, run_id in enumerate(ids):
        workflow = "react" if i % 3 == 0 else "default"
        goal = "Find the 50% FILE" if i == 4 else f"task {i}"
        store.append([started(run_id, ts=T0 + timedelta(minutes=i), workflow=workflow, goal=goal)])
        if i % 2 == 0:
            data = {"reason": "done" if i % 4 == 0 else "max_iterations"}
            store.append([ev(run_id, 2, EventType.RUN_TERMINATED, data=data)])
    return ids


def ids_of(runs: Sequence[Any]) -> list[str]:
    return [r.run_id for r in runs]


def test_list_runs_filters_by_workflow_status_and_text(store: AnyEventStore) -> None:
    _fill(store)

    react = RunFilter(workflow="react")
    assert ids_of(store.list_runs(where=react)) == ["run-6", "run-3", "run-0"]
    assert ids_of(store.list_runs(where=RunFilter(status="done"))) == ["run-8", "run-4", "run-0"]
    ended = RunFilter(status="ended", workflow="react")
    assert ids_of(store.list_runs(where=ended)) == ["run-6", "run-0"]
    running = RunFilter(status="running", workflow="default")
    interrupted = RunFilter(status="interrupted", workflow="default")
    assert ids_of(store.list_runs(where=interrupted)) == ["run-7", "run-5", "run-1"]
    assert store.list_runs(where=running) == []
    with store.lock_run("run-5"), store.lock_run("run-1"):  # their processes live
        assert ids_of(store.list_runs(where=running)) == ["run-5", "run-1"]
        assert ids_of(store.list_runs(where=interrupted)) == ["run-7"]
        assert (store.count_runs(where=running), store.count_runs(where=interrupted)) == (2, 1)
        assert store.list_runs(where=interrupted)[0].shown_status == "interrupted"
    assert ids_of(store.list_runs(where=RunFilter(text="50% file"))) == ["run-4"]  # any case
    assert ids_of(store.list_runs(where=RunFilter(text="RUN-8"))) == ["run-8"]  # the id too
    assert store.list_runs(where=RunFilter(text="5_%")) == []  # no wildcards of its own
    assert store.list_runs(where=RunFilter(text="task 4")) == []
    assert store.count_runs() == 9
    assert store.count_runs(where=react) == 3
    assert store.count_runs(where=RunFilter(status="max_iterations", text="task")) == 2
    assert store.list_runs(where=RunFilter()) == store.list_runs()


def test_child_runs_carry_their_parent_and_a_filter_leaves_them_out(
    store: AnyEventStore,
) -> None:
    store.append([started("parent", ts=T0)])
    for i in range(2):
        child = started(f"child-{i}", ts=T0 + timedelta(seconds=i + 1), workflow="react")
        child = Event(**{**child.__dict__, "data": {**child.data, "parent_run_id": "parent"}})
        store.append(
            [child, ev(f"child-{i}", 2, EventType.RUN_TERMINATED, data={"reason": "done"})]
        )

    runs = {r.run_id: r for r in store.list_runs()}
    assert runs["parent"].parent_run_id is None
    assert runs["child-0"].parent_run_id == runs["child-1"].parent_run_id == "parent"
    assert runs["child-1"].to_dict()["parent_run_id"] == "parent"
    top = RunFilter(top_level=True)
    assert ids_of(store.list_runs(where=top)) == ["parent"]
    assert store.count_runs(where=top) == 1
    assert ids_of(store.list_runs(where=RunFilter(workflow="react"))) == ["child-1", "child-0"]


def test_list_runs_pages_both_ways_with_a_run_id_as_the_cursor(store: AnyEventStore) -> None:
    ids = _fill(store)[::-1]  # newest first

    first = ids_of(store.list_runs(limit=4))
    second = ids_of(store.list_runs(limit=4, before=first[-1]))
    last = ids_of(store.list_runs(limit=4, before=second[-1]))
    assert [first, second, last] == [ids[:4], ids[4:8], ids[8:]]
    assert store.list_runs(limit=4, before=last[-1]) == []
    assert ids_of(store.list_runs(limit=4, after=second[0])) == first  # back, newest first
    assert ids_of(store.list_runs(limit=2, after=second[0])) == ids[2:4]  # the nearest ones
    assert store.list_runs(limit=4, after=first[0]) == []
    default = RunFilter(workflow="default")
    assert ids_of(store.list_runs(limit=2, where=default, before="run-7")) == ["run-5", "run-4"]
    with pytest.raises(RunNotFoundError):
        store.list_runs(before="nope")
    with pytest.raises(ValueError, match="not both"):
        store.list_runs(before=ids[0], after=ids[1])


@pytest.mark.parametrize("version", [1, 4, 5])
def test_events_recorded_by_an_older_schema_are_read_resumed_and_appended(
    backend: Backend, version: int
) -> None:
    if backend.kind == "jsonl":
        pytest.skip("a JSON Lines log has no schema")
    orphan = ev("orphan", 1, EventType.STATE_ENTERED)  # a run without a runs row
    _write_old_version(backend, version, extra=[orphan])

    with backend.open() as store:
        old = store.read("old")
        assert [(e.run_id, e.seq, e.type) for e in old] == [
            ("old", 1, EventType.RUN_STARTED),
            ("old", 2, EventType.MODEL_RESPONDED),
            ("old", 3, EventType.RUN_TERMINATED),
        ]
        assert old[1].data["completion"]["usage"]["total_tokens"] == 17
        assert old[2] == ev("old", 3, EventType.RUN_TERMINATED, data={"reason": "done"})
        assert [e.type for e in store.read("resumed")][-1] is EventType.RUN_RESUMED
        assert store.next_seq("resumed") == 4
        with pytest.raises(StoreConflictError, match="run resumed: seq 3 already exists"):
            store.append([ev("resumed", 3)])
        store.append([ev("resumed", 4), ev("resumed", 5)])
        store.append([started("new")])
        assert [e.seq for e in store.read("resumed")] == [1, 2, 3, 4, 5]
        assert [e.seq for e in store.read("orphan")] == [1]
        assert store.next_seq("new") == 2
    with backend.open() as again:  # as the next process sees it
        assert [e.seq for e in again.read("resumed")] == [1, 2, 3, 4, 5]
        assert [e.seq for e in again.read("old")] == [1, 2, 3]
        again.append([ev("old", 4)])
        assert again.next_seq("old") == 5


@pytest.mark.parametrize("version", [1, 2])
def test_runs_recorded_by_an_older_schema_get_tokens_and_status(
    backend: Backend, version: int
) -> None:
    if backend.kind == "jsonl":
        pytest.skip("a JSON Lines log has no schema: its summaries are computed when read")
    _write_old_version(backend, version)

    with backend.open() as store:
        runs = {r.run_id: r for r in store.list_runs()}
        assert (runs["old"].tokens, runs["old"].status, runs["old"].shown_status) == (
            17, "ended", "done"
        )  # fmt: skip
        assert (runs["live"].tokens, runs["live"].status) == (0, "interrupted")  # no process
        store.append([responded("live", 3, {"prompt_tokens": 2, "completion_tokens": 1})])
        assert {r.run_id: r.tokens for r in store.list_runs()}["live"] == 3
        assert ids_of(store.list_runs(where=RunFilter(status="done"))) == ["old"]


def _write_old_version(backend: Backend, version: int, extra: Sequence[Event] = ()) -> None:
    """A store as an earlier fsm-kernel left it: migrated up to `version` only (with the
    `extra` events too, whose runs have no row)."""
    from fsm_kernel.store._schema import MIGRATIONS
    from fsm_kernel.store._sql import POSTGRES, SQLITE

    applied = MIGRATIONS[:version]
    dialect = SQLITE if backend.kind == "sqlite" else POSTGRES
    events = [
        started("old"),
        responded("old", 2, {"prompt_tokens": 10, "completion_tokens": 7, "total_tokens": 17}),
        ev("old", 3, EventType.RUN_TERMINATED, data={"reason": "done"}),
        started("live"),
        started("resumed"),
        ev("resumed", 2, EventType.RUN_TERMINATED, data={"reason": "agent_error"}),
        ev("resumed", 3, EventType.RUN_RESUMED, data={}),
    ]
    runs = [
        ("old", "default", "g", T0, 1, "done", T0),
        ("live", "default", "g", T0, 0, None, T0),
        ("resumed", "default", "g", T0, 0, "agent_error", T0),
    ]
    p = dialect.param
    statements = [dialect.migrations_table]
    later: list[str] = []  # from v5 on, migrations rework the rows versions 1 to 4 wrote
    for migration in applied:
        steps = migration.sqlite if dialect is SQLITE else migration.postgres
        (statements if migration.version <= 4 else later).extend(steps)
    if backend.kind == "sqlite":
        import sqlite3

        Path(backend.location).parent.mkdir(parents=True, exist_ok=True)
        conn: Any = sqlite3.connect(backend.location, isolation_level=None)
    else:
        import psycopg

        conn = psycopg.connect(backend.location, autocommit=True)
    try:
        for statement in statements:
            conn.execute(statement)
        for migration in applied:
            conn.execute(
                f"INSERT INTO schema_migrations VALUES ({p}, {p}, {p}, {p})",
                ("events", migration.version, migration.name, dialect.to_db_ts(T0)),
            )
        insert = (  # the events table of versions 1 to 4
            "INSERT INTO events (run_id, seq, type, ts, iteration, state, version, data) "
            f"VALUES ({', '.join([p] * 7)}, {dialect.json_param})"
        )
        for event in [*events, *extra]:
            conn.execute(insert, event_row(dialect, event))
        for row in runs:  # the columns of version 1
            values = [*row[:3], dialect.to_db_ts(row[3]), *row[4:6], dialect.to_db_ts(row[6])]
            conn.execute(
                "INSERT INTO runs (run_id, workflow, goal, started_at, iterations, "
                f"termination_reason, updated_at) VALUES ({', '.join([p] * 7)})",
                values,
            )
        if version >= 2:  # as that version's code kept it
            conn.execute("UPDATE runs SET status = 'ended' WHERE termination_reason IS NOT NULL")
        for statement in later:
            conn.execute(statement)
    finally:
        conn.close()


# --- run locks ---------------------------------------------------------------------------------


def test_a_second_lock_of_the_same_run_is_refused_at_once(
    store: AnyEventStore, backend: Backend
) -> None:
    with backend.open() as other, store.lock_run("0199-locked-run"):
        with pytest.raises(RunLockedError, match="run 0199-locked-run is being run by") as info:
            with store.lock_run("0199-locked-run"):
                pytest.fail("the same store locked the run twice")
        with pytest.raises(RunLockedError):
            with other.lock_run("0199-locked-run"):
                pytest.fail("a second store of this process locked the run")

    assert isinstance(info.value, ResumeError)
    assert info.value.run_id == "0199-locked-run"
    assert "wait for it to end or stop it" in str(info.value)


def test_locks_of_different_runs_do_not_block_each_other(
    store: AnyEventStore, backend: Backend
) -> None:
    runs = [f"run-{n}" for n in range(5)]
    with backend.open() as other, store.lock_run(runs[0]):
        with other.lock_run(runs[1]), store.lock_run(runs[2]):
            for run_id in runs[3:]:
                with other.lock_run(run_id):
                    pass


def test_a_run_lock_is_released_when_the_block_ends(store: AnyEventStore, backend: Backend) -> None:
    with store.lock_run("r"):
        pass
    with pytest.raises(RuntimeError, match="boom"):
        with store.lock_run("r"):
            raise RuntimeError("boom")

    with backend.open() as other, other.lock_run("r"):
        with pytest.raises(RunLockedError):
            with store.lock_run("r"):
                pass
    with store.lock_run("r"), store.lock_run("r2"):
        pass


def test_a_closed_store_does_not_lock(backend: Backend) -> None:
    store = backend.open()
    store.close()

    with pytest.raises(StoreError, match="closed"):
        with store.lock_run("r"):
            pass


# --- what a run asks of its store ----------------------------------------------------------------


class _Recording:
    """A store that takes `durable=` and records each batch's event types and durability."""

    def __init__(self, inner: AnyEventStore) -> None:
        self.inner = inner
        self.batches: list[tuple[list[EventType], bool]] = []

    def append(self, events: Sequence[Event], *, durable: bool = True) -> None:
        self.batches.append(([e.type for e in events], durable))
        self.inner.append(events, durable=durable)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


class _TwoCalls:
    """Two tool calls in one reply, then an answer."""

    async def complete(self, messages: Sequence[Message], tools: Sequence[Tool]) -> Completion:
        if messages[-1].role.value == "user":
            calls = [ToolCall(id=f"c{i}", name="datetime", arguments={}) for i in range(2)]
            return Completion(message=Message.assistant("", calls))
        return Completion(message=Message.assistant("It is noon."))


def test_a_run_syncs_before_each_model_and_tool_call_and_at_its_end(store: AnyEventStore) -> None:
    """Every step is committed before the next starts; the disk is waited for only before a
    side effect (model call, tool call) and at the end, which then covers all before it."""
    from fsm_kernel.kernel import Kernel
    from fsm_kernel.tools import builtin_registry
    from fsm_kernel.workflow.compiler import compile_workflow
    from fsm_kernel.workflow.loader import load_workflow

    recording = _Recording(store)
    kernel = Kernel(
        compile_workflow(load_workflow(REPO / "workflows" / "default.yaml")),
        model=_TwoCalls(),
        tools=builtin_registry("."),
        store=recording,  # type: ignore[arg-type]
    )
    result = asyncio.run(kernel.run("What time is it?"))
    assert result.termination_reason == "final_answer"
    side_effects = {EventType.MODEL_REQUESTED, EventType.TOOL_STARTED}
    for types, durable in recording.batches:
        expected = types[-1] in side_effects or EventType.RUN_TERMINATED in types
        assert durable is expected, (types, durable)
    second_start = [types for types, _ in recording.batches if EventType.TOOL_STARTED in types][1]
    assert EventType.TOOL_FINISHED in second_start  # the first call's result synced before
    assert [e.seq for e in store.read(result.run_id)] == list(range(1, len(result.events) + 1))


def test_concurrent_runs_sharing_a_store_each_log_every_step(store: AnyEventStore) -> None:
    """Runs on one store and one loop write through one writer, their batches committed
    together: each run's log is still whole and in order."""
    from fsm_kernel.kernel import Kernel
    from fsm_kernel.tools import builtin_registry
    from fsm_kernel.workflow.compiler import compile_workflow
    from fsm_kernel.workflow.loader import load_workflow

    kernel = Kernel(
        compile_workflow(load_workflow(REPO / "workflows" / "default.yaml")),
        model=_TwoCalls(),
        tools=builtin_registry("."),
        store=store,
    )

    async def main() -> list[Any]:
        return list(await asyncio.gather(*(kernel.run(f"task {i}") for i in range(20))))

    results = asyncio.run(main())
    assert {r.termination_reason for r in results} == {"final_answer"}
    for result in results:
        stored = store.read(result.run_id)
        assert [e.seq for e in stored] == list(range(1, len(result.events) + 1))
        assert [e.type for e in stored] == [e.type for e in result.events]
    assert len(store.list_runs(limit=100)) == 20
