"""The DBOS integration's pure parts: where the scheduler's DBOS system database is, how a run
under DBOS is recognised, and what `send_to_run` refuses before it touches any database."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("dbos")

from fsm_kernel.errors import ResumeError
from fsm_kernel.integrations.dbos import dbos_engine, send_to_run
from fsm_kernel.integrations.dbos_scheduler import system_database
from fsm_kernel.protocol import Event, EventType
from fsm_kernel.replay import RecordedRun
from fsm_kernel.scheduler import SchedulerConfig
from fsm_kernel.workflow.human import HumanAnswer


@pytest.fixture(autouse=True)
def _no_url_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FSM_KERNEL_DBOS_URL", raising=False)
    monkeypatch.delenv("DBOS_SYSTEM_DATABASE_URL", raising=False)


def _run(settings: dict[str, object], *, suspended: bool = False) -> RecordedRun:
    from datetime import UTC, datetime

    now = datetime.now(UTC)
    started = Event(run_id="r1", seq=1, type=EventType.RUN_STARTED, timestamp=now,
                    data={"goal": "g", "settings": settings})  # fmt: skip
    events = [started]
    if suspended:
        waiting = {"kind": "input", "state": "ask", "prompt": "name?"}
        events.append(Event(run_id="r1", seq=2, type=EventType.RUN_SUSPENDED, timestamp=now,
                            data={"waiting_for": waiting}))  # fmt: skip
    run = RecordedRun("r1", events, started, None)
    for e in events[1:]:
        run._person_or_life_cycle(e)
    return run


def test_the_system_database_follows_the_store(tmp_path: Path) -> None:
    sqlite = SchedulerConfig(store=str(tmp_path / "kernel.db"))
    assert system_database(sqlite) == f"sqlite:///{tmp_path / 'kernel.dbos.sqlite'}"
    pg = SchedulerConfig(store="postgresql://u@db/app")
    assert system_database(pg) == "postgresql://u@db/app"


def test_the_environment_names_the_system_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DBOS_SYSTEM_DATABASE_URL", "postgresql://second/x")
    monkeypatch.setenv("FSM_KERNEL_DBOS_URL", "postgresql://first/x")
    assert system_database(SchedulerConfig(store=str(tmp_path / "k.db"))) == "postgresql://first/x"


def test_a_run_under_dbos_is_recognised_by_its_recorded_engine() -> None:
    engine = {"name": "dbos", "workflow": "fsm-kernel.w"}
    assert dbos_engine(_run({"engine": engine})) == engine
    assert dbos_engine(_run({})) is None
    assert dbos_engine(_run({"engine": "local"})) is None


def test_send_to_run_refuses_a_killed_run_and_a_missing_database() -> None:
    engine = {"name": "dbos", "workflow": "fsm-kernel.w"}
    with pytest.raises(ResumeError, match="DBOS recovers it once a process launches it"):
        send_to_run(_run({"engine": engine}), None)
    with pytest.raises(ResumeError, match="recorded no system database: set FSM_KERNEL_DBOS_URL"):
        send_to_run(_run({"engine": engine}, suspended=True), HumanAnswer.input("Ada"))
