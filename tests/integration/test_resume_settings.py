"""A run's settings have one source of truth, its log: `resume RUN` and `replay RUN` alone take
the server, model, limits and workspace the run recorded; a run the model server failed stays
resumable; replay reproduces capped, resumed, failed and timed-out runs exactly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from fsm_kernel.protocol import Event, EventType
from fsm_kernel.store import SqliteEventStore
from tests.clikit import Outcome, cli
from tests.fakes.openai_server import (
    FakeOpenAIServer,
    call,
    hang,
    http_error,
    text_reply,
    tool_reply,
)

REPO = Path(__file__).resolve().parents[2]
DEFAULT = REPO / "workflows" / "default.yaml"


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "runs.db"


def events_of(store: Path, run_id: str) -> list[Event]:
    with SqliteEventStore(store) as events:
        return events.read(run_id)


ZONES = ["UTC", "Europe/Paris", "Asia/Tokyo", "America/Lima", "Africa/Cairo", "Europe/Oslo"]


def clock_calls(n: int, first: int = 0) -> list[Any]:
    """n datetime calls, each with other arguments (the same call thrice is no_progress)."""
    return [
        tool_reply(call("datetime", {"timezone": ZONES[i % len(ZONES)]}, id=f"c{i}"))
        for i in range(first, first + n)
    ]


def run(capsys: pytest.CaptureFixture[str], store: Path, url: str, *extra: str) -> Outcome:
    return cli(
        capsys, "run", str(DEFAULT), "-p", "time?", "--base-url", url, "--store", str(store),
        "--json", *extra,
    )  # fmt: skip


# --- replay takes the recorded limits ----------------------------------------------------------


def test_a_run_capped_by_a_flag_replays_identical(
    server: FakeOpenAIServer, store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(*clock_calls(5))
    result = run(capsys, store, server.base_url, "--max-iterations", "3").json()
    assert result["termination_reason"] == "max_iterations"

    replay = cli(capsys, "replay", result["run_id"], "--store", str(store), "--json")

    assert replay.code == 0, replay.out
    assert replay.json()["identical"] is True
    assert replay.json()["replayed_reason"] == "max_iterations"


def test_replay_with_another_workflow_file_stays_a_what_if(
    server: FakeOpenAIServer, store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(*clock_calls(5))
    result = run(capsys, store, server.base_url, "--max-iterations", "3").json()

    what_if = cli(
        capsys, "replay", result["run_id"], "--store", str(store), "--workflow", str(DEFAULT),
        "--json",
    )  # fmt: skip

    assert what_if.code == 1  # the file's own cap (10) asks for answers the log does not have
    assert what_if.json()["identical"] is False


# --- the model server failed: the run stays resumable --------------------------------------------


def test_a_run_the_server_failed_is_resumed_later_from_its_last_step(
    server: FakeOpenAIServer, store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(*clock_calls(2), http_error(503), http_error(503))
    failed = run(capsys, store, server.base_url, "--max-retries", "1").json()
    assert failed["termination_reason"] == "agent_error"
    run_id = failed["run_id"]
    shown = cli(capsys, "runs", "show", run_id, "--store", str(store))
    assert f"resumable:       yes (the model server failed): fsm-kernel resume {run_id}" in (
        shown.out
    )

    server.enqueue(text_reply("It is noon."))
    resumed = cli(capsys, "resume", run_id, "--store", str(store), "--json")  # no --base-url

    assert resumed.code == 0, resumed.err
    assert resumed.json()["response"] == "It is noon."
    assert resumed.json()["termination_reason"] == "final_answer"
    assert len(server.requests) == 5  # 2 answered, 2 failed, then the retried third call
    events = events_of(store, run_id)
    started = Counter(e.data["call"]["id"] for e in events if e.type == EventType.TOOL_STARTED)
    assert started == {"c0": 1, "c1": 1}  # nothing completed is repeated
    ends = [e.data["reason"] for e in events if e.type == EventType.RUN_TERMINATED]
    assert ends == ["agent_error", "final_answer"]
    resumed_event = next(e for e in events if e.type == EventType.RUN_RESUMED)
    assert resumed_event.data["reopened"] == "agent_error"
    assert resumed_event.data["overrides"] == {}

    replay = cli(capsys, "replay", run_id, "--store", str(store), "--json")
    assert replay.json()["identical"] is True, replay.out
    assert cli(capsys, "resume", run_id, "--store", str(store), "--json").code == 2  # finished


def test_a_resume_that_cannot_reach_the_server_leaves_the_run_resumable(
    server: FakeOpenAIServer, store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(*clock_calls(1), http_error(503))
    run_id = run(capsys, store, server.base_url, "--max-retries", "0").json()["run_id"]
    server.enqueue(http_error(502))

    again = cli(capsys, "resume", run_id, "--store", str(store), "--json", "--max-retries", "0")
    server.enqueue(text_reply("Done at last."))
    finished = cli(capsys, "resume", run_id, "--store", str(store), "--json")

    assert again.json()["termination_reason"] == "agent_error"
    assert finished.json()["response"] == "Done at last."
    assert cli(capsys, "replay", run_id, "--store", str(store)).code == 0


def test_a_run_the_server_refused_is_final(
    server: FakeOpenAIServer, store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(http_error(401))
    run_id = run(capsys, store, server.base_url).json()["run_id"]

    refused = cli(capsys, "resume", run_id, "--store", str(store), "--json")

    assert refused.code == 2  # bad input: the run cannot be resumed
    assert "already terminated (agent_error)" in refused.json()["error"]
    assert "resumable" not in cli(capsys, "runs", "show", run_id, "--store", str(store)).out


def test_a_failed_run_replays_identical_with_the_failure_where_it_was(
    server: FakeOpenAIServer, store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(*clock_calls(1), http_error(503))
    run_id = run(capsys, store, server.base_url, "--max-retries", "0").json()["run_id"]

    replay = cli(capsys, "replay", run_id, "--store", str(store), "--json").json()

    assert replay["identical"] is True
    assert replay["replayed_reason"] == "agent_error"


def test_a_timed_out_run_replays_the_steps_it_took(
    server: FakeOpenAIServer, store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(*clock_calls(1), hang(5, text_reply("too late")))
    result = run(capsys, store, server.base_url, "--timeout", "1").json()
    assert result["termination_reason"] == "timeout"

    replay = cli(capsys, "replay", result["run_id"], "--store", str(store), "--json").json()

    assert replay["identical"] is True
    assert replay["replayed_reason"] == "timeout"


# --- a killed run resumes with what it recorded --------------------------------------------------


def console(argv: Sequence[str]) -> subprocess.Popen[str]:
    exe = Path(sys.executable).with_name("fsm-kernel")
    env = {**os.environ, "FSM_KERNEL_BASE_URL": "http://127.0.0.1:9/v1"}
    return subprocess.Popen(
        [str(exe), *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def test_a_killed_run_resumes_against_its_recorded_server_model_and_limits(
    server: FakeOpenAIServer, store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "a.txt").write_text("alpha")
    server.enqueue(*clock_calls(1), hang(30, text_reply("never")))
    proc = console(
        ["run", str(DEFAULT), "-p", "time?", "--base-url", server.base_url, "--model", "m-1",
         "--store", str(store), "--max-iterations", "3", "--workspace", str(workspace)]
    )  # fmt: skip
    try:
        server.wait_for_requests(2)  # the second model call is in flight
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=10)
    with SqliteEventStore(store) as events:
        run_id = events.list_runs()[0].run_id
    server.enqueue(tool_reply(call("read_file", {"path": "a.txt"}, id="r1")), *clock_calls(3, 1))

    # cwd and env point elsewhere: only the log knows the server, model, limits and workspace.
    resumed = cli(capsys, "resume", run_id, "--store", str(store), "--json").json()

    assert resumed["termination_reason"] == "max_iterations"
    assert resumed["iterations"] == 3
    assert [r["result"] for r in resumed["tool_calls"] if r["name"] == "read_file"] == ["alpha"]
    assert {r["model"] for r in server.requests} == {"m-1"}
    marker = next(e for e in events_of(store, run_id) if e.type == EventType.RUN_RESUMED)
    assert marker.data["limits"]["max_iterations"] == 3
    assert marker.data["settings"]["base_url"] == server.base_url
    assert cli(capsys, "replay", run_id, "--store", str(store)).code == 0


def test_a_flag_given_to_resume_overrides_and_is_recorded(
    server: FakeOpenAIServer, store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(*clock_calls(1), http_error(503))
    run_id = run(capsys, store, server.base_url, "--max-retries", "0").json()["run_id"]
    server.enqueue(*clock_calls(5, first=1))

    resumed = cli(
        capsys, "resume", run_id, "--store", str(store), "--json", "--max-iterations", "4",
        "--model", "other",
    ).json()  # fmt: skip

    assert resumed["iterations"] == 4
    assert server.requests[-1]["model"] == "other"
    marker = next(e for e in events_of(store, run_id) if e.type == EventType.RUN_RESUMED)
    assert marker.data["overrides"] == {"max_iterations": 4, "model": "other"}
    assert cli(capsys, "replay", run_id, "--store", str(store)).code == 0


def test_resuming_builds_no_kernel_of_the_agents_own_settings(
    server: FakeOpenAIServer,
    store: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`resume` builds the run's kernel from what the run recorded; the agent's own (from the
    CLI's flags and environment) is built only when it runs something: no bundled-model
    notice, no probe of a default server, no client opened just to be thrown away."""
    import asyncio

    from fsm_kernel import Agent, bootstrap

    server.enqueue(*clock_calls(1), http_error(503))
    failed = run(capsys, store, server.base_url, "--max-retries", "0").json()
    for name in ("FSM_KERNEL_BASE_URL", "FSM_KERNEL_MODEL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(bootstrap, "local_model_available", lambda: True)
    monkeypatch.setattr(bootstrap, "_server_answers", lambda url: False)
    server.enqueue(text_reply("It is noon."))

    async def resume() -> Any:
        async with Agent(DEFAULT, store=str(store)) as agent:
            return await agent.resume(failed["run_id"])

    with caplog.at_level("WARNING"):
        result = asyncio.run(resume())

    assert result.response == "It is noon."
    assert not [r for r in caplog.records if "bundled" in r.getMessage()]
