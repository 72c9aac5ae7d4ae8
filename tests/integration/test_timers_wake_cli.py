"""Durable timers through the dispatch queue at the CLI (issue 27, part 2): a dispatched run that
suspended on a 30 minute timer, due now,
- is resumed by an `fsm-kernel worker` process once the scheduler's timer check woke its
  dispatch (`fsm-kernel dispatches` shows it woken meanwhile), on SQLite and PostgreSQL;
- is woken and resumed by `fsm-kernel schedule --once` on its own, when no worker runs.

The first leg is a scheduler cycle run in this process with the system clock set two hours back
(see test_timers_wake_dispatch.py); the model is a fake OpenAI server over loopback.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsm_kernel.scheduler import (
    Dispatch,
    DispatchQueue,
    DispatchStatus,
    load_scheduler_config,
    open_queue,
)
from tests.clikit import cli
from tests.fakes.openai_server import FakeOpenAIServer, text_reply
from tests.integration.test_timers_wake_dispatch import REMIND, first_leg, types, wake_once
from tests.unit.test_scheduler_fakes import pg_url

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "runs.db")
    return pg_url(request.getfixturevalue("pg_dsn"))


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


def write_config(tmp_path: Path, store: str) -> Path:
    (tmp_path / "remind.yaml").write_text(REMIND)
    config = tmp_path / "scheduler.yaml"
    config.write_text(
        f"kernel_id: k1\nstate_dir: {tmp_path / 'state'}\nstore: '{store}'\npoll_seconds: 0.1\n"
        "agents:\n  - {agent_id: reminder, workflow: remind.yaml, prompt: Remind me to ship.}\n"
    )
    return config


def test_a_worker_process_resumes_the_run_the_scheduler_woke(
    store: str,
    tmp_path: Path,
    server: FakeOpenAIServer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = write_config(tmp_path, store)
    config = load_scheduler_config(path)
    queue = open_queue(store)
    try:
        run_id = first_leg(config, queue, tmp_path, server, monkeypatch)
        assert wake_once(config, queue) == 1
        listed = cli(capsys, "dispatches", str(path))
        assert f"woken (its run's timer is due): the next worker resumes run {run_id}" in listed.out
        server.enqueue(text_reply("Reminder: ship v2 today."))

        worker = subprocess.Popen(
            [sys.executable, "-m", "fsm_kernel", "worker", str(path),
             "--base-url", server.base_url, "--model", "m"],
            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            row = _until_done(queue, run_id, worker)
        finally:
            worker.send_signal(signal.SIGTERM)
            out, err = worker.communicate(timeout=60)
    finally:
        queue.close()

    assert worker.returncode == 0, err
    assert re.search(rf"^done\s+reminder\s+run {run_id} final_answer$", out, re.M), out
    assert row.worker_id is not None
    assert row.worker_id.split(":")[1] == str(worker.pid)  # host:pid:random of that process
    assert (row.status, row.termination_reason) == (DispatchStatus.DONE, "final_answer")
    kinds = types(store, run_id)
    assert (kinds.count("timer.fired"), kinds.count("run.resumed")) == (1, 1)
    assert kinds[-1] == "run.terminated"


def _until_done(queue: DispatchQueue, run_id: str, worker: subprocess.Popen[str]) -> Dispatch:
    for _ in range(600):
        row = queue.dispatch_of_run(run_id)
        assert row is not None
        if row.status is DispatchStatus.DONE:
            return row
        assert worker.poll() is None, "the worker exited"
        time.sleep(0.05)
    raise AssertionError("the worker did not resume the run within 30 s")


def test_schedule_once_wakes_the_run_and_resumes_it_when_no_worker_runs(
    tmp_path: Path,
    server: FakeOpenAIServer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    store = str(tmp_path / "runs.db")
    path = write_config(tmp_path, store)
    config = load_scheduler_config(path)
    queue = open_queue(store)
    try:
        run_id = first_leg(config, queue, tmp_path, server, monkeypatch)
    finally:
        queue.close()
    server.enqueue(text_reply("Reminder: ship v2 today."))
    monkeypatch.chdir(tmp_path)

    once = cli(
        capsys, "schedule", str(path), "--once", "--base-url", server.base_url, "--model", "m"
    )

    assert once.code == 0, once.err
    assert re.search(r"^tick \S+: dispatched 0, succeeded 1, failed 0, skipped 1$", once.out, re.M)
    assert re.search(rf"^  done\s+reminder\s+run {run_id} final_answer$", once.out, re.M), once.out
    assert "skipped reminder: pending" in once.err  # its woken dispatch was its active one
    assert re.search(rf"^resuming reminder \(run {run_id}, dispatch \S+\)$", once.err, re.M)
    kinds = types(store, run_id)
    assert (kinds.count("timer.fired"), kinds.count("run.resumed")) == (1, 1)


def test_cancelling_a_woken_dispatch_says_its_run_still_waits(
    tmp_path: Path,
    server: FakeOpenAIServer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    store = str(tmp_path / "runs.db")
    path = write_config(tmp_path, store)
    config = load_scheduler_config(path)
    queue = open_queue(store)
    try:
        run_id = first_leg(config, queue, tmp_path, server, monkeypatch)
        assert wake_once(config, queue) == 1
        woken = queue.dispatch_of_run(run_id)
        assert woken is not None

        cancelled = cli(capsys, "dispatches", str(path), "--cancel", woken.dispatch_id[:13])

        assert cancelled.code == 0, cancelled.err
        assert cancelled.out == (
            f"cancelled {woken.dispatch_id} (reminder): it was pending after its run's timer "
            f"woke it; run {run_id} was not resumed and still waits (fsm-kernel resume {run_id} "
            "fires its timer)\n"
        )
        assert wake_once(config, queue) == 0  # a cancelled dispatch is not woken again
    finally:
        queue.close()
    assert types(store, run_id)[-1] == "run.suspended"
