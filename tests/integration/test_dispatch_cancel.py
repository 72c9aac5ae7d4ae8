"""`fsm-kernel dispatches CONFIG --cancel DISPATCH_ID`, end to end, on SQLite and PostgreSQL: a
pending dispatch is cancelled at once; a running one (a real kernel run whose model request
hangs) is stopped by its worker, on SQLite at its next heartbeat, on PostgreSQL at once through
NOTIFY (its heartbeat is 20 s away), and the run's event log ends with the reason `cancelled`;
unknown, finished, malformed and ambiguous ids are usage errors (one line, exit 2).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from fsm_kernel.bootstrap import RunOptions
from fsm_kernel.cli import main
from fsm_kernel.cli.scheduling import make_runner
from fsm_kernel.protocol import EventType
from fsm_kernel.scheduler import (
    DispatchDetail,
    DispatchQueue,
    DispatchStatus,
    ExecutionStatus,
    Worker,
    load_scheduler_config,
    open_queue,
)
from fsm_kernel.store import open_store
from tests.fakes.openai_server import FakeOpenAIServer, hang
from tests.unit.test_scheduler_fakes import pg_url

KERNEL = "stoppable"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if backend == "sqlite":
        return str(tmp_path / "runs.db")
    return pg_url(request.getfixturevalue("pg_dsn"))


@pytest.fixture
def config(backend: str, store: str, tmp_path: Path) -> Path:
    # SQLite: the worker learns of the cancel at its heartbeat (0.1 s). PostgreSQL: the heartbeat
    # is 20 s away, so a prompt stop can only come from the NOTIFY.
    heartbeat, lease = (0.1, 10) if backend == "sqlite" else (20, 60)
    path = tmp_path / "stoppable.yaml"
    document = {
        "kernel_id": KERNEL,
        "state_dir": str(tmp_path / "state"),
        "store": store,
        "lease_seconds": lease,
        "heartbeat_seconds": heartbeat,
        "poll_seconds": 0.05,
        "timeout_seconds": 60,
        "agents": [{"agent_id": "slow", "prompt": "Take your time."}],
    }
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    return path


@pytest.fixture
def queue(store: str) -> Iterator[DispatchQueue]:
    q = open_queue(store)
    yield q
    q.close()


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cancelling_a_running_dispatch_ends_its_run_cancelled(
    config: Path, queue: DispatchQueue, store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = load_scheduler_config(config)
    results: list[DispatchDetail] = []
    dispatch = queue.enqueue(KERNEL, "slow", "Take your time.", 0, "slow-1")
    assert dispatch is not None

    async def scenario(server: FakeOpenAIServer) -> tuple[float, tuple[int, str, str]]:
        runner = make_runner(settings, config, RunOptions(base_url=server.base_url, model="m"))
        worker = Worker(settings, open_queue(store), runner, on_result=results.append)
        task = asyncio.create_task(worker.run())
        try:
            await asyncio.to_thread(server.wait_for_requests, 1, 20)  # the run is mid-call
            requested = time.monotonic()
            outcome = await asyncio.to_thread(
                cli, capsys, "dispatches", str(config), "--cancel", dispatch.dispatch_id[:-4]
            )
            for _ in range(1000):
                if results:
                    break
                await asyncio.sleep(0.01)
            elapsed = time.monotonic() - requested
        finally:
            worker.stop()
            await asyncio.wait_for(task, 10)
            worker.queue.close()
        return elapsed, outcome

    with FakeOpenAIServer(hang(60)) as server:
        elapsed, (code, out, err) = asyncio.run(scenario(server))

    assert code == 0, err
    assert out.startswith(f"cancel requested for {dispatch.dispatch_id} (slow), running on ")
    assert "the run ends 'cancelled'" in out
    assert elapsed < 5  # PostgreSQL: the heartbeat would have taken 20 s
    assert len(results) == 1
    detail = results[0]
    assert (detail.status, detail.termination_reason) == (ExecutionStatus.CANCELLED, "cancelled")
    row = queue.get(dispatch.dispatch_id)
    assert row is not None
    assert (row.status, row.termination_reason, row.run_id) == (
        DispatchStatus.CANCELLED,
        "cancelled",
        detail.run_id,
    )
    assert row.run_id is not None
    events = open_store(store)
    try:
        log = events.read(row.run_id)
    finally:
        events.close()
    assert log[-1].type is EventType.RUN_TERMINATED
    assert log[-1].data["reason"] == "cancelled"


def test_cancelling_a_pending_dispatch_and_the_usage_errors(
    config: Path, queue: DispatchQueue, capsys: pytest.CaptureFixture[str]
) -> None:
    first = queue.enqueue(KERNEL, "slow", "p", 0, "k-1")
    assert first is not None

    code, out, err = cli(capsys, "dispatches", str(config), "--cancel", first.dispatch_id)
    assert (code, err) == (0, "")
    assert out == f"cancelled {first.dispatch_id} (slow): it was pending and never ran\n"
    row = queue.get(first.dispatch_id)
    assert row is not None
    assert row.status is DispatchStatus.CANCELLED
    assert queue.claim(KERNEL, "w", 60, 3) is None

    code, out, err = cli(capsys, "dispatches", str(config), "--cancel", first.dispatch_id)
    assert (code, out) == (2, "")
    assert err == (
        f"error: cannot cancel: dispatch {first.dispatch_id} (slow) has already finished: "
        "cancelled\n"
    )

    code, out, err = cli(capsys, "dispatches", str(config), "--cancel", "0123abcd")
    assert (code, out) == (2, "")
    assert err.count("\n") == 1
    assert f"no dispatch 0123abcd in kernel {KERNEL}" in err

    code, _, err = cli(capsys, "dispatches", str(config), "--cancel", "../etc/passwd")
    assert code == 2
    assert "is not a dispatch id" in err

    second = queue.enqueue(KERNEL, "slow", "p", 0, "k-2")
    assert second is not None
    shared = first.dispatch_id[:4]  # UUIDv7 ids made the same second share their start
    assert second.dispatch_id.startswith(shared)
    code, _, err = cli(capsys, "dispatches", str(config), "--cancel", shared)
    assert code == 2
    assert "is the start of several dispatch ids" in err

    code, out, _ = cli(capsys, "dispatches", str(config), "--cancel", "feedbeef", "--json")
    assert code == 2
    assert json.loads(out)["exit_code"] == 2
    code, out, _ = cli(capsys, "dispatches", str(config), "--json", "--cancel", second.dispatch_id)
    assert code == 0
    cancelled: dict[str, Any] = json.loads(out)
    assert (cancelled["dispatch_id"], cancelled["status"]) == (second.dispatch_id, "cancelled")

    code, out, _ = cli(capsys, "dispatches", str(config))
    assert code == 0
    assert out.count("cancelled") >= 2
    assert "ATTEMPTS" in out
    assert "0/3" in out


def test_the_help_documents_cancel(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["dispatches", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--cancel DISPATCH_ID" in text
    assert "within one heartbeat" in text
    assert "'cancelled'" in text
