"""A throwaway PostgreSQL server for the tests (a pytest plugin, loaded from conftest).

Order of preference:
1. FSM_KERNEL_TEST_PG_DSN, a server someone else runs (any libpq DSN/URL);
2. a cluster this plugin creates with initdb + pg_ctl in a temp dir (Unix socket only, no TCP
   port), run as the `postgres` user when the tests run as root, stopped at the end.

Tests that need it take the `pg_dsn` fixture (a fresh, empty database per test) and are marked
`postgres`. Without a server they skip, unless FSM_KERNEL_REQUIRE_PG=1 (set in CI), which turns
the skip into a failure so CI can never silently lose the PostgreSQL tests.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

_BIN_DIRS = [Path("/usr/lib/postgresql") / v / "bin" for v in ("17", "16", "15", "14")]


def _find_bin(name: str) -> str | None:
    for d in _BIN_DIRS:
        if (d / name).exists():
            return str(d / name)
    return shutil.which(name)


def _as_postgres(cmd: list[str]) -> list[str]:
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *cmd]
    return cmd


class _Cluster:
    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="fsmk-pg-"))
        self.data = self.root / "data"
        self.port = 54000 + (os.getpid() % 900)
        self.pg_ctl = _find_bin("pg_ctl")
        self.initdb = _find_bin("initdb")

    def start(self) -> str:
        if not (self.pg_ctl and self.initdb):
            raise RuntimeError("initdb/pg_ctl not found (apt-get install postgresql)")
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")
        run = lambda cmd: subprocess.run(  # noqa: E731
            _as_postgres(cmd), check=True, capture_output=True, text=True, timeout=120
        )
        run([self.initdb, "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync"])
        opts = (
            f"-p {self.port} -k {self.root} -c listen_addresses='' -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        run(
            [
                self.pg_ctl,
                "-D",
                str(self.data),
                "-l",
                str(self.root / "log"),
                "-w",
                "-o",
                opts,
                "start",
            ]
        )
        return f"host={self.root} port={self.port} user=postgres dbname=postgres"

    def stop(self) -> None:
        if self.pg_ctl and self.data.exists():
            subprocess.run(
                _as_postgres([self.pg_ctl, "-D", str(self.data), "-m", "immediate", "-w", "stop"]),
                capture_output=True,
                timeout=60,
                check=False,
            )
        shutil.rmtree(self.root, ignore_errors=True)


def _unavailable(why: str) -> None:
    if os.environ.get("FSM_KERNEL_REQUIRE_PG") == "1":
        pytest.fail(f"PostgreSQL required (FSM_KERNEL_REQUIRE_PG=1) but unavailable: {why}")
    pytest.skip(f"no PostgreSQL server: {why}")


@pytest.fixture(scope="session")
def pg_server_dsn() -> Iterator[str]:
    """DSN of the maintenance database of a running server."""
    dsn = os.environ.get("FSM_KERNEL_TEST_PG_DSN")
    if dsn:
        yield dsn
        return
    try:
        import psycopg  # noqa: F401
    except ImportError:
        _unavailable("psycopg is not installed (pip install 'fsm-kernel[postgres]')")
    cluster = _Cluster()
    try:
        dsn = cluster.start()
    except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        cluster.stop()
        _unavailable(f"could not start a throwaway cluster: {detail.strip()[:300]}")
    try:
        yield dsn
    finally:
        cluster.stop()


@pytest.fixture
def pg_dsn(pg_server_dsn: str) -> Iterator[str]:
    """DSN of a fresh, empty database, dropped after the test."""
    import psycopg

    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    info = psycopg.conninfo.conninfo_to_dict(pg_server_dsn)
    info["dbname"] = name
    dsn = psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})
    try:
        yield dsn
    finally:
        with psycopg.connect(pg_server_dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
