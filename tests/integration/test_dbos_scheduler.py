"""The scheduler on DBOS (`--engine dbos`), end to end: the CLI in subprocesses, runs over real
HTTP against FakeOpenAIServer (each reply held back a little, so runs overlap), on SQLite and on
PostgreSQL. A `schedule --once` cycle with two `worker` processes runs every enabled agent once
and never more than `max_concurrent` at once; `dispatches` lists the runs; a second tick skips
an agent whose run is still going; the same config runs on the own queue too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

pytest.importorskip("dbos")

from fsm_kernel.protocol import EventType
from fsm_kernel.store import open_store
from tests.fakes.openai_server import FakeOpenAIServer, hang, text_reply
from tests.integration.test_dbos import _pg_url

ROOT = Path(__file__).resolve().parents[2]
AGENTS = 6
CAP = 2

CONFIG = """\
kernel_id: fleet
store: STORE
state_dir: state
max_concurrent: 2
timeout_seconds: 60
seed_state: "# STATE"
agents:
"""


@pytest.fixture(params=["sqlite", "postgres"])
def config(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A config of AGENTS agents (and a disabled one) capped at CAP runs at once."""
    if request.param == "sqlite":
        store = str(tmp_path / "kernel.db")
    else:
        request.applymarker(pytest.mark.postgres)
        store = _pg_url(request.getfixturevalue("pg_dsn"))
    agents = "".join(
        f"  - {{agent_id: a{i}, workflow: single_shot, prompt: 'task {i}'}}\n"
        for i in range(AGENTS)
    )
    path = tmp_path / "fleet.yaml"
    text = CONFIG.replace("STORE", store) + agents
    path.write_text(text + "  - {agent_id: off, prompt: never, enabled: false}\n")
    return path


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "fsm_kernel", *args]


def _env(vmid: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "DBOS__VMID": vmid}


def _store(config: Path) -> str:
    line = next(x for x in config.read_text().splitlines() if x.startswith("store: "))
    return line.removeprefix("store: ")


def _spans(config: Path, run_ids: list[str]) -> list[tuple[datetime, datetime]]:
    """Each run's (run.started, run.terminated) times from the event log."""
    store = open_store(_store(config))
    try:
        logs = [store.read(r) for r in run_ids]
    finally:
        store.close()
    spans = []
    for events in logs:
        ended = [e.timestamp for e in events if e.type == EventType.RUN_TERMINATED]
        assert len(ended) == 1, [e.type for e in events]
        spans.append((events[0].timestamp, ended[0]))
    return spans


def _run_of(line: str) -> str | None:
    """The run id of a worker's outcome line (`  done      a1               run RUN_ID ...`)."""
    words = line.split()
    return words[3] if len(words) >= 4 and words[2] == "run" else None


def _most_at_once(spans: list[tuple[datetime, datetime]]) -> int:
    edges = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    running = most = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    return most


def test_a_cycle_with_two_workers_never_exceeds_the_cap(
    config: Path, server: FakeOpenAIServer, tmp_path: Path
) -> None:
    server.enqueue(*[hang(0.6, then=text_reply("done")) for _ in range(AGENTS)])
    flags = ["--engine", "dbos", "--base-url", server.base_url, "--model", "m"]
    workers = [
        subprocess.Popen(
            _cmd("worker", str(config), "--concurrency", "2", *flags),
            cwd=tmp_path,
            env=_env(f"worker-{n}"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in (1, 2)
    ]
    try:
        # Each worker says it is listening before the cycle starts: on a loaded machine a
        # worker still importing would leave every dispatch to the scheduler's process.
        started = [w.stderr.readline() for w in workers if w.stderr is not None]
        assert all("on DBOS, queue" in line for line in started), started
        once = subprocess.run(
            _cmd("schedule", str(config), "--once", "--json", *flags),
            cwd=tmp_path, env=_env("scheduler"), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        for w in workers:
            w.send_signal(signal.SIGTERM)
        outputs = [w.communicate(timeout=30) for w in workers]

    assert once.returncode == 0, once.stderr
    cycle = json.loads(once.stdout)
    details = cycle["details"]
    assert sorted(d["agent_id"] for d in details) == [f"a{i}" for i in range(AGENTS)]
    assert {d["status"] for d in details} == {"done"}
    assert cycle["skipped_agents"] == [{"agent_id": "off", "reason": "disabled"}]
    assert len(server.requests) == AGENTS  # each agent ran once: no run twice, none lost
    spans = _spans(config, [d["run_id"] for d in details])
    assert _most_at_once(spans) == CAP  # the cap held, and was reached
    # Which process dequeues which dispatch is DBOS's choice (each polls the queue; the
    # scheduler's own process runs some, at times all): what any worker ran was this cycle's.
    cycle_runs = {d["run_id"] for d in details}
    worker_runs = [w for out, _ in outputs for line in out.splitlines() if (w := _run_of(line))]
    assert set(worker_runs) <= cycle_runs, (worker_runs, cycle_runs)
    assert len(worker_runs) == len(set(worker_runs))  # none ran twice
    assert all(w.returncode == 0 for w in workers), [err for _, err in outputs]

    listed = subprocess.run(
        _cmd("dispatches", str(config), "--engine", "dbos", "--json"),
        cwd=tmp_path, env=_env("cli"), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert sorted(r["agent_id"] for r in rows) == [f"a{i}" for i in range(AGENTS)]
    assert {r["status"] for r in rows} == {"SUCCESS"}

    ended = rows[0]["run_id"]  # cancelling a run that ended: refused, both records unchanged
    refused = subprocess.run(
        _cmd("dispatches", str(config), "--engine", "dbos", "--cancel", ended),
        cwd=tmp_path, env=_env("cli"), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2
    assert refused.stderr == f"error: run {ended} already ended (final_answer): nothing to cancel\n"


def test_an_agent_still_running_is_skipped_by_the_next_tick(
    config: Path, server: FakeOpenAIServer, tmp_path: Path
) -> None:
    server.enqueue(*[hang(3.0, then=text_reply("slow")) for _ in range(AGENTS)])
    server.enqueue(*[text_reply("fast") for _ in range(AGENTS)])
    flags = ["--engine", "dbos", "--base-url", server.base_url, "--model", "m"]
    first = subprocess.Popen(
        _cmd("schedule", str(config), "--once", "--json", *flags),
        cwd=tmp_path, env=_env("first"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while len(server.requests) < CAP:  # two runs are in their model call
            assert time.monotonic() < deadline, "no run started"
            time.sleep(0.05)
        time.sleep(1.1)  # the next tick is another second
        second = subprocess.run(
            _cmd("schedule", str(config), "--once", "--json", *flags),
            cwd=tmp_path, env=_env("second"), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert second.returncode == 0, second.stderr
    skipped = {s["agent_id"] for s in json.loads(second.stdout)["skipped_agents"]}
    assert skipped == {f"a{i}" for i in range(AGENTS)} | {"off"}  # all still queued or running
    assert len(json.loads(out)["details"]) == AGENTS


def test_the_same_config_runs_on_the_own_queue(
    config: Path, server: FakeOpenAIServer, tmp_path: Path
) -> None:
    server.enqueue(*[text_reply("done") for _ in range(AGENTS)])
    once = subprocess.run(
        _cmd("schedule", str(config), "--once", "--json", "--base-url", server.base_url,
             "--model", "m"),
        cwd=tmp_path, env=_env("local"), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert once.returncode == 0, once.stderr
    assert json.loads(once.stdout)["succeeded"] == AGENTS
