"""What every event store tells about its runs beyond their events (issue 26): whether a
process drives a run now (its lock is held, asked without taking it), so a killed run reads
`interrupted`; and a run id's shortest unique prefix, which find_run resolves."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from fsm_kernel.errors import RunLockedError, StoreLocationError
from fsm_kernel.protocol import Event, EventType, RunFilter
from fsm_kernel.store import (
    AnyEventStore,
    open_store,
)
from fsm_kernel.store._schema import unique_prefix
from tests.lockkit import HOLDER, REPO, STORES

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


@pytest.fixture
def store(location: tuple[str, str]) -> Iterator[AnyEventStore]:
    with STORES[location[0]](location[1]) as opened:
        yield opened


def started(run_id: str, minute: int = 0) -> Event:
    ts = T0 + timedelta(minutes=minute)
    data = {"workflow": "w", "goal": "g"}
    return Event(run_id=run_id, seq=1, type=EventType.RUN_STARTED, timestamp=ts, data=data)


def test_a_run_is_running_while_another_process_holds_its_lock_then_interrupted(
    location: tuple[str, str], store: AnyEventStore
) -> None:
    run_id = "0199c0de-0000-7000-8000-00000000beef"
    store.append([started(run_id)])
    kind, where = location
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, kind, where, run_id],
        cwd=REPO, env=dict(os.environ), stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == "locked\n"
        alive = (store.is_running(run_id), store.list_runs()[0].status)
        counted = store.count_runs(where=RunFilter(status="running"))
    finally:
        holder.kill()  # SIGKILL: no cleanup code runs
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()

    assert alive == (True, "running")
    assert counted == 1
    deadline = time.monotonic() + 10  # PostgreSQL ends a dead client's session a moment later
    while store.is_running(run_id) and kind == "postgres" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.is_running(run_id) is False
    (run,) = store.list_runs()
    assert (run.status, run.shown_status) == ("interrupted", "interrupted")
    assert store.count_runs(where=RunFilter(status="interrupted")) == 1
    with store.lock_run(run_id):  # asking took nothing: the lock is free for a resume
        assert store.is_running(run_id) is True
        with pytest.raises(RunLockedError):
            with STORES[kind](where) as other, other.lock_run(run_id):
                pass


def reference(run_id: str, others: list[str]) -> str:
    for n in range(8, len(run_id) + 1):
        if run_id[n - 1] != "-" and not any(o.startswith(run_id[:n]) for o in others):
            return run_id[:n]
    return run_id


def test_short_ids_are_the_shortest_prefixes_find_run_resolves(store: AnyEventStore) -> None:
    ids = [
        "01a2194d-16e0-7000-8000-000000000001",
        "01a2194d-16e0-7000-8000-000000000002",
        "01a2194d-16e1-7abc-8000-000000000003",
        "01a2194d-9999-7000-8000-000000000004",
        "01a2194e-0000-7000-8000-000000000005",
        "01b00000-0000-7000-8000-000000000006",
    ]
    for minute, run_id in enumerate(ids):
        store.append([started(run_id, minute)])

    shown = [store.short_id(run_id) for run_id in ids]

    assert shown == [reference(r, [o for o in ids if o != r]) for r in ids]
    assert (shown[-1], shown[0]) == ("01b00000", ids[0])
    assert [store.find_run(prefix) for prefix in shown] == ids


def test_unique_prefix_never_ends_in_a_dash_and_keeps_eight_characters() -> None:
    assert unique_prefix("01a2194d-16e0", None, None) == "01a2194d"
    assert unique_prefix("01a2194d-16e0", "01a2194c-0000", None) == "01a2194d"
    assert unique_prefix("01a2194d-16e0", "01a2194d-0000", None) == "01a2194d-1"
    assert unique_prefix("01a2194d-16e0", None, "01a2194d-16e0-x") == "01a2194d-16e0"


@pytest.mark.parametrize("name", ["events.db", "events.jsonl"])
def test_a_store_opened_read_only_creates_nothing_and_reads_what_is_there(
    tmp_path: Path, name: str
) -> None:
    with pytest.raises(StoreLocationError, match="no event store at"):
        open_store(tmp_path / "no" / name, read_only=True)
    assert list(tmp_path.iterdir()) == []
    with open_store(tmp_path / name) as writer:
        writer.append([started("r1")])
    with open_store(tmp_path / name, read_only=True) as reader:
        assert [r.run_id for r in reader.list_runs()] == ["r1"]
        assert reader.is_running("r1") is False
        with pytest.raises(Exception, match="read-only"):
            reader.append([started("r2")])
    assert not (tmp_path / f"{name}.locks").exists()  # asking about locks created no file
