"""Several processes (here threads, each with its own connection) opening a new SQLite store at
the same moment all succeed: switching the file to WAL is retried when SQLite refuses a lock
upgrade that would deadlock ("database is locked", answered without waiting). Found as a
flaky migration test; before the fix a few rounds of eight openers failed."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from fsm_kernel.scheduler.queue import open_queue
from fsm_kernel.store import SqliteEventStore

ROUNDS, OPENERS = 60, 8


def open_together(path: Path, open_one: Callable[[Path], None]) -> list[BaseException]:
    errors: list[BaseException] = []
    barrier = threading.Barrier(OPENERS)

    def opener() -> None:
        try:
            barrier.wait()
            open_one(path)
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=opener) for _ in range(OPENERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return errors


def open_event_store(path: Path) -> None:
    SqliteEventStore(path).close()


def open_dispatch_queue(path: Path) -> None:
    open_queue(str(path)).close()


@pytest.mark.parametrize("open_one", [open_event_store, open_dispatch_queue])
def test_a_new_store_opened_by_many_at_once(
    tmp_path: Path, open_one: Callable[[Path], None]
) -> None:
    for n in range(ROUNDS):
        path = tmp_path / f"runs{n}.db"
        if n % 2:  # a store an older fsm-kernel left, not in WAL mode yet
            sqlite3.connect(path).execute("CREATE TABLE legacy (x)").connection.close()
        assert open_together(path, open_one) == []
        conn = sqlite3.connect(path)  # and the file is in WAL mode
        try:
            assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        finally:
            conn.close()
