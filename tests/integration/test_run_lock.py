"""Run locks across processes, on every backend: a live holder in another process refuses the
lock at once, and its death (SIGKILL: no cleanup code runs) frees the lock for the next
process right away: no lease to wait out."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsm_kernel.errors import RunLockedError
from fsm_kernel.store import AnyEventStore, SqliteEventStore
from tests.lockkit import HOLDER, REPO, STORES

RUN_ID = "0199c0de-0000-7000-8000-00000000beef"


@pytest.fixture
def holder(location: tuple[str, str]) -> Iterator[subprocess.Popen[str]]:
    """A process holding RUN_ID's lock (it has printed "locked"); killed at the end."""
    kind, where = location
    STORES[kind](where).close()  # the schema exists before the child starts
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, kind, where, RUN_ID],
        cwd=REPO,
        env=dict(os.environ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line == "locked\n", proc.stderr.read() if proc.stderr else line
        yield proc
    finally:
        proc.kill()
        proc.communicate(timeout=30)


def lock_within(store: AnyEventStore, seconds: float) -> float:
    """Take and release RUN_ID's lock, retrying until `seconds` pass; how long it took."""
    start = time.monotonic()
    while True:
        try:
            with store.lock_run(RUN_ID):
                return time.monotonic() - start
        except RunLockedError:
            if time.monotonic() - start > seconds:
                raise
            time.sleep(0.01)


def test_a_lock_held_by_another_process_is_refused_at_once(
    location: tuple[str, str], holder: subprocess.Popen[str]
) -> None:
    kind, where = location
    with STORES[kind](where) as store:
        start = time.monotonic()
        with pytest.raises(RunLockedError) as info:
            with store.lock_run(RUN_ID):
                pytest.fail("locked a run another process holds")
        assert time.monotonic() - start < 2  # non-blocking
        with store.lock_run("some-other-run"):
            pass

    assert str(info.value) == (
        f"run {RUN_ID} is being run by another process; wait for it to end or stop it"
    )
    assert holder.poll() is None


def test_the_lock_of_a_killed_holder_is_free_at_once(
    location: tuple[str, str], holder: subprocess.Popen[str]
) -> None:
    kind, where = location
    with STORES[kind](where) as store:
        with pytest.raises(RunLockedError):
            with store.lock_run(RUN_ID):
                pass

        holder.kill()  # SIGKILL
        holder.wait(timeout=30)

        if kind == "postgres":  # the server ends the dead client's session asynchronously
            assert lock_within(store, 5.0) < 5.0
        else:  # the OS drops the record locks as the process exits
            with store.lock_run(RUN_ID):
                pass


@pytest.mark.parametrize("suffix", ["db", "jsonl"])
def test_only_lock_run_creates_the_lock_file(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"events.{suffix}"
    store: AnyEventStore = STORES["sqlite" if suffix == "db" else "jsonl"](str(path))
    sidecar = tmp_path / f"events.{suffix}.locks"
    with store:
        store.read(RUN_ID)
        store.list_runs()
        assert not sidecar.exists()

        with store.lock_run(RUN_ID):
            assert sidecar.is_file()
        with store.lock_run(RUN_ID):  # the file left behind is reused, not a stale lock
            pass


def test_an_in_memory_sqlite_store_locks_within_itself() -> None:
    with SqliteEventStore(":memory:") as first, SqliteEventStore(":memory:") as second:
        with first.lock_run(RUN_ID), second.lock_run(RUN_ID):  # two separate databases
            with pytest.raises(RunLockedError):
                with first.lock_run(RUN_ID):
                    pass
