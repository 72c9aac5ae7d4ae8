"""Opening event stores: the location forms open_store accepts and refuses (creating nothing,
echoing no secret), files that are not stores, schemas newer than the code, bad PostgreSQL DSNs,
and the JSONL file's damage rules."""

from __future__ import annotations

import json
import sqlite3
import sys
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import quote

import pytest

from fsm_kernel.errors import ConfigError, StoreError, StoreLocationError, StoreSchemaError
from fsm_kernel.protocol import Event, EventStore, EventType
from fsm_kernel.store import (
    JsonlEventStore,
    PostgresEventStore,
    SqliteEventStore,
    is_postgres_dsn,
    open_store,
    parse_store_location,
)
from fsm_kernel.store._schema import MIGRATIONS, SCHEMA_VERSION, plan_migrations

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
REFUSED_URL = "postgresql://fsm:s3cret-pw@127.0.0.1:1/runs"


def ev(run_id: str, seq: int) -> Event:
    return Event(run_id=run_id, seq=seq, type=EventType.STATE_ENTERED, timestamp=T0, data={})


def test_open_store_dispatches_on_the_location(tmp_path: Path) -> None:
    with open_store(tmp_path / "a" / "b" / "runs.db") as sqlite_store:
        assert isinstance(sqlite_store, SqliteEventStore)
    with open_store(str(tmp_path / "runs.jsonl")) as jsonl_store:
        assert isinstance(jsonl_store, JsonlEventStore)
    with open_store(tmp_path / "RUNS.JSONL") as upper:
        assert isinstance(upper, JsonlEventStore)
    assert isinstance(sqlite_store, EventStore)
    assert isinstance(jsonl_store, EventStore)
    assert (tmp_path / "a" / "b" / "runs.db").is_file()


@pytest.mark.parametrize("url", [REFUSED_URL, REFUSED_URL.replace("postgresql", "postgres")])
def test_open_store_sends_postgres_urls_to_postgres(url: str) -> None:
    assert is_postgres_dsn(url)
    with pytest.raises(StoreError, match=r"^PostgreSQL host=127\.0\.0\.1 port=1 dbname=runs"):
        open_store(url)


# location -> (backend class, the file it opens relative to the working directory)
ACCEPTED: dict[str, tuple[type, str]] = {
    "runs.db": (SqliteEventStore, "runs.db"),
    "runs.sqlite": (SqliteEventStore, "runs.sqlite"),
    "runs.sqlite3": (SqliteEventStore, "runs.sqlite3"),
    "sub/RUNS.DB": (SqliteEventStore, "sub/RUNS.DB"),
    "runs.jsonl": (JsonlEventStore, "runs.jsonl"),
    "RUNS.JSONL": (JsonlEventStore, "RUNS.JSONL"),
    "sqlite:///sub/runs.db": (SqliteEventStore, "sub/runs.db"),
    "SQLITE:///runs.db": (SqliteEventStore, "runs.db"),
    # The scheme is explicit, so any name will do (even .jsonl means SQLite here).
    "sqlite:///runs.data": (SqliteEventStore, "runs.data"),
    "sqlite:///runs.jsonl": (SqliteEventStore, "runs.jsonl"),
}


@pytest.mark.parametrize(("location", "expected"), sorted(ACCEPTED.items()))
def test_every_accepted_form_opens_its_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, location: str, expected: tuple[type, str]
) -> None:
    backend, relative = expected
    monkeypatch.chdir(tmp_path)

    with open_store(location) as store:
        assert type(store) is backend
        store.append([ev("r", 1)])

    assert (tmp_path / relative).is_file()
    with open_store(location) as reopened:
        assert reopened.read("r") == [ev("r", 1)]


def test_sqlite_url_with_four_slashes_is_absolute(tmp_path: Path) -> None:
    path = tmp_path / "abs" / "runs.db"

    with open_store(f"sqlite:///{path}") as store:
        assert isinstance(store, SqliteEventStore)

    assert f"sqlite:///{path}".startswith("sqlite:////")
    assert path.is_file()


def test_a_path_object_is_a_path(tmp_path: Path) -> None:
    with open_store(tmp_path / "runs.sqlite3") as store:
        assert isinstance(store, SqliteEventStore)
    assert parse_store_location(tmp_path / "x.jsonl").backend == "jsonl"


@pytest.mark.postgres
def test_a_postgresql_url_opens_postgres(pg_dsn: str) -> None:
    from psycopg.conninfo import conninfo_to_dict

    info = {k: str(v) for k, v in conninfo_to_dict(pg_dsn).items()}
    dbname = info.pop("dbname", "postgres")
    query = "&".join(f"{k}={quote(v, safe='')}" for k, v in sorted(info.items()))

    with open_store(f"postgresql:///{quote(dbname, safe='')}?{query}") as store:
        assert isinstance(store, PostgresEventStore)
        store.append([ev("r", 1)])
        assert store.read("r") == [ev("r", 1)]


# location -> what the message shows of it
REFUSED: dict[str, str] = {
    "mysql://fsm:hunter2@db/runs": "'mysql://…'",
    "s3://bucket/runs.db": "'s3://…'",
    "sqlite://runs.db": "'sqlite://…'",  # two slashes: a host, which SQLite has not
    "sqlite:runs.db": "'sqlite:…'",
    "fsm:hunter2@db/runs.db": "'fsm:…'",  # a URL that lost its scheme
    "sqlite:///": "'sqlite:///' without a path",
    "host=db password=hunter2": "(a keyword string, not shown)",
    "dbname=runs.db password=hunter2": "(a keyword string, not shown)",
    "notes.txt": "'notes.txt'",
    "runs": "'runs'",
    "runs.db password=hunter2": "'runs.db password=[REDACTED]'",
    ":memory:": "':memory:'",  # sqlite:///:memory: is the way to say it
    "": "(empty)",
    "   ": "(empty)",
}


@pytest.mark.parametrize(("location", "shown"), sorted(REFUSED.items()))
def test_every_other_location_is_refused_and_creates_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, location: str, shown: str
) -> None:
    monkeypatch.chdir(tmp_path)

    with pytest.raises(StoreLocationError) as info:
        open_store(location)

    message = str(info.value)
    assert isinstance(info.value, ConfigError)  # the CLI exits 2
    assert message.startswith(f"unsupported store location {shown}: use a path ending in .db, ")
    assert "sqlite:///relative/path.db or sqlite:////absolute/path.db" in message
    assert "postgresql://" in message
    assert "hunter2" not in message
    assert "\n" not in message
    assert list(tmp_path.iterdir()) == []


def test_a_refused_path_object_creates_nothing(tmp_path: Path) -> None:
    with pytest.raises(StoreLocationError) as info:
        open_store(tmp_path / "sub" / "runs")

    assert f"'{tmp_path / 'sub' / 'runs'}'" in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_the_cli_exits_2_on_a_refused_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from fsm_kernel.cli import main

    monkeypatch.chdir(tmp_path)

    assert main(["runs", "list", "--store", "host=db password=hunter2"]) == 2

    err = capsys.readouterr().err
    assert "unsupported store location (a keyword string, not shown)" in err
    assert "hunter2" not in err
    assert list(tmp_path.iterdir()) == []


def test_is_postgres_dsn() -> None:
    assert is_postgres_dsn(" POSTGRESQL://h/db")
    assert not is_postgres_dsn("postgresql.db")
    assert not is_postgres_dsn(Path("postgresql://h/db"))


def test_in_memory_sqlite_store() -> None:
    with open_store("sqlite:///:memory:") as store:
        store.append([ev("r", 1)])
        assert store.read("r") == [ev("r", 1)]


@pytest.mark.parametrize("name", ["notes.db", "notes.sqlite"])
def test_a_text_file_is_not_a_database(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_text("these are my notes, not a database\n" * 20)

    with pytest.raises(StoreError) as info:
        open_store(path)

    message = str(info.value)
    assert str(path) in message
    assert "not an SQLite database" in message
    assert "\n" not in message
    assert path.read_text().startswith("these are my notes")


def test_a_directory_is_not_a_database(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match=str(tmp_path)):
        SqliteEventStore(tmp_path)


def test_opening_twice_applies_each_migration_once(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    SqliteEventStore(path).close()
    SqliteEventStore(path).close()

    with sqlite3.connect(path) as conn:
        rows = conn.execute("SELECT component, version, name FROM schema_migrations").fetchall()
        mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
    assert rows == [("events", m.version, m.name) for m in MIGRATIONS]
    assert mode == "wal"


def _record_migration(path: Path, version: int, name: str) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute(
            "INSERT INTO schema_migrations VALUES ('events', ?, ?, '2030-01-01T00:00:00+00:00')",
            (version, name),
        )
    conn.close()


def test_a_schema_newer_than_the_code_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    SqliteEventStore(path).close()
    _record_migration(path, SCHEMA_VERSION + 1, "from_the_future")

    with pytest.raises(StoreSchemaError, match=rf"version {SCHEMA_VERSION + 1} is newer"):
        open_store(path)


def test_other_components_migrations_do_not_count(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    SqliteEventStore(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute("INSERT INTO schema_migrations VALUES ('dispatch', 99, 'queue', 'now')")
    conn.close()

    with SqliteEventStore(path) as store:
        assert store.next_seq("r") == 1


def test_plan_migrations() -> None:
    assert plan_migrations({}, where="db") == list(MIGRATIONS)
    assert plan_migrations({m.version: m.name for m in MIGRATIONS}, where="db") == []
    with pytest.raises(StoreSchemaError, match="unknown event store migration 1 'renamed'"):
        plan_migrations({1: "renamed"}, where="db")
    with pytest.raises(StoreSchemaError, match=r"^db: "):
        plan_migrations({SCHEMA_VERSION + 5: "x"}, where="db")


def test_refused_postgres_connection_is_one_line_without_password() -> None:
    with pytest.raises(StoreError) as info:
        PostgresEventStore(REFUSED_URL)

    message = str(info.value)
    assert "\n" not in message
    assert "s3cret-pw" not in message
    assert "cannot connect" in message


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://fsm:s3cret-pw@[::1/runs",  # unbalanced IPv6 bracket
        "postgresql://fsm:s3cret-pw@127.0.0.1:1/runs?sslmode=nonsense",
        "password=s3cret-pw not-a-dsn",
    ],
)
def test_malformed_postgres_dsn_is_one_line_without_password(dsn: str) -> None:
    with pytest.raises(StoreError) as info:
        PostgresEventStore(dsn)

    assert "\n" not in str(info.value)
    assert "s3cret-pw" not in str(info.value)


def test_postgres_without_psycopg_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "psycopg", None)  # makes `import psycopg` fail

    with pytest.raises(ImportError, match=r"pip install 'fsm-kernel\[postgres\]'"):
        open_store(REFUSED_URL)


def test_jsonl_lines_are_events_with_a_checksum(tmp_path: Path) -> None:
    path = tmp_path / "runs.jsonl"
    with JsonlEventStore(path) as store:
        store.append([ev("r", 1), ev("r", 2)])

    lines = path.read_text(encoding="utf-8").splitlines()
    first = json.loads(lines[0])
    assert len(lines) == 2
    assert first.pop("crc32")
    assert first == ev("r", 1).to_dict()


def test_jsonl_torn_last_line_is_ignored_then_cut_off(tmp_path: Path) -> None:
    path = tmp_path / "runs.jsonl"
    with JsonlEventStore(path) as store:
        store.append([ev("r", 1), ev("r", 2)])
    intact = path.read_bytes()
    path.write_bytes(intact + intact.splitlines(keepends=True)[0][:25])  # a crash mid-append

    with JsonlEventStore(path) as store:
        assert [e.seq for e in store.read("r")] == [1, 2]
        store.append([ev("r", 3)])

    assert path.read_bytes().startswith(intact)
    with JsonlEventStore(path) as reopened:
        assert [e.seq for e in reopened.read("r")] == [1, 2, 3]


def test_jsonl_hand_written_fixture_without_checksum_or_final_newline(tmp_path: Path) -> None:
    path = tmp_path / "fixture.jsonl"
    lines = [json.dumps(ev("r", 1).to_dict()), "", json.dumps(ev("r", 2).to_dict())]
    path.write_text("\n".join(lines), encoding="utf-8")

    with JsonlEventStore(path) as store:
        assert [e.seq for e in store.read("r")] == [1, 2]
        store.append([ev("r", 3)])
    with JsonlEventStore(path) as reopened:
        assert [e.seq for e in reopened.read("r")] == [1, 2, 3]


def test_jsonl_altered_line_is_reported_with_its_line_number(tmp_path: Path) -> None:
    path = tmp_path / "runs.jsonl"
    with JsonlEventStore(path) as store:
        store.append([ev("r", 1), ev("r", 2)])
    path.write_text(path.read_text().replace('"seq":2', '"seq":9'))

    with pytest.raises(StoreError, match=r"runs\.jsonl:2: not an event: checksum mismatch"):
        JsonlEventStore(path)


@pytest.mark.parametrize(
    ("line", "error", "match"),
    [
        ('{"run_id": "r"}', StoreError, "not an event"),
        ("[1, 2]", StoreError, "not a JSON object"),
        (
            '{"run_id": "r", "seq": 2, "type": "run.exploded", "ts": "2026-01-01T00:00:00+00:00"}',
            StoreSchemaError,
            "unknown event type 'run.exploded'",
        ),
    ],
)
def test_jsonl_line_that_is_not_an_event(
    tmp_path: Path, line: str, error: type[StoreError], match: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ev("r", 1).to_dict()) + "\n" + line + "\n")

    with pytest.raises(error, match=match) as info:
        JsonlEventStore(path)
    assert "bad.jsonl:2" in str(info.value)


def test_jsonl_duplicate_seq_in_the_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "dup.jsonl"
    path.write_text((json.dumps(ev("r", 1).to_dict()) + "\n") * 2)

    with pytest.raises(StoreError, match=r"dup\.jsonl:2: run r seq 1 appears twice"):
        JsonlEventStore(path)
