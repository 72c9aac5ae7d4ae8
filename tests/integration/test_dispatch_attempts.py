"""The attempt limit with real `fsm-kernel worker` processes killed by SIGKILL, on SQLite and on
PostgreSQL: the dispatch's run never answers (the model request hangs), so each worker that
claims it is killed mid-run; after max_attempts (3) claims it is failed ("abandoned after 3
attempts: lease expired"), no worker claims it again, `dispatches` shows why, and the next tick
plans the agent afresh.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from fsm_kernel.cli import main
from fsm_kernel.scheduler import (
    Dispatch,
    DispatchQueue,
    DispatchStatus,
    Scheduler,
    load_scheduler_config,
    open_queue,
)
from tests.fakes.openai_server import FakeOpenAIServer, hang
from tests.unit.test_scheduler_fakes import ScriptedRunner, pg_url

ROOT = Path(__file__).resolve().parents[2]
KERNEL = "crashy"
LEASE = 1.0
ATTEMPTS = 3


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "runs.db")
    return pg_url(request.getfixturevalue("pg_dsn"))


@pytest.fixture
def config(store: str, tmp_path: Path) -> Path:
    path = tmp_path / "crashy.yaml"
    document = {
        "kernel_id": KERNEL,
        "state_dir": str(tmp_path / "state"),
        "store": store,
        "lease_seconds": LEASE,  # heartbeats every 1/3 s; a killed worker's lease ends in 1 s
        "max_attempts": ATTEMPTS,
        "poll_seconds": 0.05,
        "timeout_seconds": 60,
        "agents": [{"agent_id": "crasher", "prompt": "Crash the worker that runs you."}],
    }
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    return path


class Workers:
    """`python -m fsm_kernel worker CONFIG` processes, by pid; stderr drained by threads."""

    def __init__(self, config: Path, base_url: str) -> None:
        self.cmd = [sys.executable, "-m", "fsm_kernel", "worker", str(config)]
        self.cmd += ["--base-url", base_url, "--model", "m"]
        self.procs: dict[int, subprocess.Popen[str]] = {}
        self.stderr: dict[int, list[str]] = {}
        self.readers: list[threading.Thread] = []

    def start(self, count: int) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        for _ in range(count):
            proc = subprocess.Popen(
                self.cmd,
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            lines = self.stderr[proc.pid] = []
            reader = threading.Thread(target=_drain, args=(proc, lines), daemon=True)
            reader.start()
            self.readers.append(reader)
            self.procs[proc.pid] = proc

    def sigkill(self, pid: int) -> None:
        self.procs[pid].send_signal(signal.SIGKILL)
        assert self.procs[pid].wait(10) == -signal.SIGKILL

    def alive(self) -> list[int]:
        return [pid for pid, proc in self.procs.items() if proc.poll() is None]

    def stop(self) -> list[int]:
        codes = []
        for pid in self.alive():
            self.procs[pid].send_signal(signal.SIGTERM)
            codes.append(self.procs[pid].wait(20))
        return codes

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        for reader in self.readers:
            reader.join(5)
        for proc in self.procs.values():
            if proc.stderr is not None:
                proc.stderr.close()


def _drain(proc: subprocess.Popen[str], lines: list[str]) -> None:
    assert proc.stderr is not None
    lines.extend(proc.stderr)


def wait_until(what: str, check: Callable[[], bool], detail: Callable[[], object]) -> None:
    deadline = time.monotonic() + 20
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {detail()}")
        time.sleep(0.02)


@pytest.fixture
def queue(store: str) -> Iterator[DispatchQueue]:
    q = open_queue(store)
    yield q
    q.close()


def holder_pid(row: Dispatch) -> int:
    """The pid in a worker id `host:pid:random`."""
    assert row.worker_id is not None
    return int(row.worker_id.split(":")[-2])


def test_a_dispatch_that_kills_every_worker_fails_after_max_attempts(
    config: Path, queue: DispatchQueue, capsys: pytest.CaptureFixture[str]
) -> None:
    with FakeOpenAIServer(*[hang(60)] * ATTEMPTS) as server:
        workers = Workers(config, server.base_url)
        try:
            workers.start(ATTEMPTS + 1)  # one survivor when the dispatch has been given up
            dispatch = queue.enqueue(KERNEL, "crasher", "Crash.", 0, "crash-1")
            assert dispatch is not None
            row = lambda: queue.get(dispatch.dispatch_id)  # noqa: E731
            killed = []
            for attempt in range(1, ATTEMPTS + 1):
                server.wait_for_requests(attempt, timeout=20)  # attempt N's run is mid-call
                current = row()
                assert current is not None
                assert (current.status, current.attempts) == (DispatchStatus.RUNNING, attempt)
                killed.append(holder_pid(current))
                workers.sigkill(killed[-1])
            wait_until(
                "the dispatch to be abandoned",
                lambda: row().status is DispatchStatus.FAILED,  # type: ignore[union-attr]
                row,
            )
            time.sleep(LEASE * 1.5)  # a survivor keeps polling; nothing may claim it again
            final = row()
            survivors = workers.alive()
            requests = len(server.requests)
            codes = workers.stop()
        finally:
            workers.kill_all()

    assert final is not None
    assert (final.status, final.attempts, final.max_attempts) == (
        DispatchStatus.FAILED,
        ATTEMPTS,
        ATTEMPTS,
    )
    assert final.error == f"abandoned after {ATTEMPTS} attempts: lease expired"
    assert requests == ATTEMPTS  # three runs began, none after the last kill
    assert len(set(killed)) == ATTEMPTS  # each attempt was a different process
    assert len(survivors) == 1
    assert codes == [0]
    assert not any("Traceback" in line for lines in workers.stderr.values() for line in lines)

    capsys.readouterr()
    assert main(["dispatches", str(config)]) == 0
    listing = capsys.readouterr().out
    assert "ATTEMPTS" in listing
    line = next(line for line in listing.splitlines() if final.dispatch_id in line)
    assert f"{ATTEMPTS}/{ATTEMPTS}" in line
    assert "failed" in line
    assert "abandoned after 3 attempts: lease expired" in line

    # The next tick plans the agent afresh (no worker left: the tick runs it itself).
    runner = ScriptedRunner()
    scheduler = Scheduler(load_scheduler_config(config), queue, runner)
    result = asyncio.run(scheduler.run_cycle())
    assert (result.dispatched, result.succeeded) == (1, 1)
    assert [a for a, _ in runner.calls] == ["crasher"]
