"""Timers and named events (issue 27, part 2) end to end through the CLI against the fake model
server over loopback: a run waiting on an event (exit 3, waiting_for kind event) continued by
`fsm-kernel signal` from another process with the event's data; an event the state does not
await refused (exit 2, nothing recorded); a timer that fires after the process was killed while
it waited, on `resume`; `replay` reports identical; `Agent.signal` in the Python API."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsm_kernel import Agent
from fsm_kernel.store import SqliteEventStore
from tests.clikit import cli
from tests.fakes.openai_server import FakeOpenAIServer, text_reply

ROOT = Path(__file__).resolve().parents[2]

WORKFLOW = """\
name: deploy_on_ci
reasons:
  timed_out: {description: CI never answered}
initial: plan
states:
  plan: {action: agent.think, prompt: Plan the deploy.}
  wait_for_ci: {description: waits for CI or gives up}
  deploy: {action: agent.think, prompt: Deploy it.}
  done: {final: true}
  gave_up: {final: true}
transitions:
  - {source: plan, target: wait_for_ci}
  - {source: wait_for_ci, target: deploy, event: ci_passed}
  - {source: wait_for_ci, target: gave_up, after: AFTER, reason: timed_out}
  - {source: deploy, target: done, reason: final_answer}
"""


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


def _workflow(tmp_path: Path, after: str = "30m") -> Path:
    path = tmp_path / "deploy.yaml"
    path.write_text(WORKFLOW.replace("AFTER", after))
    return path


def _run(server: FakeOpenAIServer, workflow: Path, store: Path) -> list[str]:
    return [
        "run", str(workflow), "-p", "ship v2", "--base-url", server.base_url, "--model", "m",
        "--store", str(store), "--max-retries", "0", "--json",
    ]  # fmt: skip


def _events(store: Path, run_id: str) -> list[tuple[str, dict[str, object]]]:
    with SqliteEventStore(store) as events:
        return [(e.type.value, e.data) for e in events.read(run_id)]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "FSM_KERNEL_MAX_RETRIES": "0"}


def test_a_run_waits_for_an_event_and_signal_from_another_process_continues_it(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store, workflow = tmp_path / "runs.db", _workflow(tmp_path)
    server.enqueue(text_reply("planned"))

    first = cli(capsys, _run(server, workflow, store))

    assert first.code == 3
    waiting = first.json()
    assert waiting["status"] == "waiting"
    assert waiting["waiting_for"]["kind"] == "event"
    assert waiting["waiting_for"]["state"] == "wait_for_ci"
    assert waiting["waiting_for"]["events"] == ["ci_passed"]
    assert waiting["waiting_for"]["due"].endswith("+00:00")
    run_id = waiting["run_id"]
    listed = cli(capsys, "runs", "list", "--waiting", "--store", str(store), "--json")
    assert [r["run_id"] for r in json.loads(listed.out)] == [run_id]
    shown = cli(capsys, "runs", "show", run_id, "--store", str(store)).out
    due = waiting["waiting_for"]["due"]
    assert f"waiting for event ci_passed or its timer, due {due} in wait_for_ci" in shown
    assert (
        f"go on with:      fsm-kernel signal {run_id} ci_passed [--data JSON]; once due: "
        f"fsm-kernel resume {run_id}"
    ) in shown

    server.enqueue(text_reply("deployed build 7"))
    done = subprocess.run(
        [sys.executable, "-m", "fsm_kernel", "signal", run_id, "ci_passed", "--data",
         '{"build": 7}', "--by", "ci-bot", "--store", str(store), "--json"],
        env=_env(), capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip

    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["termination_reason"] == "final_answer"
    assert result["response"] == "deployed build 7"
    events = _events(store, run_id)
    assert ("event.delivered", {"name": "ci_passed", "data": {"build": 7}, "by": "ci-bot"}) in (
        events
    )
    assert ("timer.cancelled", {"edge": 2}) in events
    assert [t for t, _ in events].count("timer.set") == 1
    taken = [(d["source"], d["target"]) for t, d in events if t == "transition.taken"]
    assert taken == [("plan", "wait_for_ci"), ("wait_for_ci", "deploy"), ("deploy", "done")]

    replay = cli(capsys, "replay", run_id, "--store", str(store))
    assert replay.code == 0, replay.out + replay.err
    assert replay.out.splitlines()[-1].startswith("identical: 3 transitions, reason final_answer")


def test_signal_of_an_event_the_state_does_not_await_is_refused(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store, workflow = tmp_path / "runs.db", _workflow(tmp_path)
    server.enqueue(text_reply("planned"))
    run_id = cli(capsys, _run(server, workflow, store)).json()["run_id"]
    before = _events(store, run_id)

    wrong = cli(capsys, "signal", run_id, "ci_failed", "--store", str(store))
    bad_data = cli(capsys, "signal", run_id, "ci_passed", "--data", "{oops", "--store", str(store))

    assert wrong.code == 2
    assert wrong.err.strip().splitlines()[-1] == (
        f"error: run {run_id} waits in state 'wait_for_ci' for ci_passed, not event "
        "'ci_failed': refused, nothing was recorded"
    )
    assert bad_data.code == 2
    assert "--data is not JSON" in bad_data.err
    assert _events(store, run_id) == before


def test_a_timer_fires_on_resume_after_the_process_was_killed_while_it_waited(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store, workflow = tmp_path / "runs.db", _workflow(tmp_path, after="5s")
    server.enqueue(text_reply("planned"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "fsm_kernel", *_run(server, workflow, store)],
        env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        run_id = _wait_for_timer(store, proc)
        proc.send_signal(signal.SIGKILL)  # it sleeps on its 5 s timer in process: killed there
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "timer.fired" not in [t for t, _ in _events(store, run_id)]

    resumed = cli(capsys, "resume", run_id, "--store", str(store), "--json")

    assert resumed.code == 1  # timed_out is the workflow's own, not a success
    assert resumed.json()["termination_reason"] == "timed_out"
    events = _events(store, run_id)
    fired = [d for t, d in events if t == "timer.fired"]
    set_ = [d for t, d in events if t == "timer.set"]
    assert len(set_) == 1  # the recorded timer, not a new one: due 5 s after it was first set
    assert fired == [{"edge": 2, "due": set_[0]["due"]}]
    replay = cli(capsys, "replay", run_id, "--store", str(store))
    assert replay.code == 0, replay.out + replay.err


def _wait_for_timer(store: Path, proc: subprocess.Popen[bytes]) -> str:
    """The run's id once its timer is set (the process then sleeps on it)."""
    for _ in range(600):
        if store.exists():
            with SqliteEventStore(store) as events:
                for summary in events.list_runs():
                    if any(e.type.value == "timer.set" for e in events.read(summary.run_id)):
                        return summary.run_id
        assert proc.poll() is None, "the run ended before it set its timer"
        time.sleep(0.05)
    raise AssertionError("no timer.set within 30 s")


def test_agent_signal_delivers_an_event_through_the_python_api(
    server: FakeOpenAIServer, tmp_path: Path
) -> None:
    workflow = _workflow(tmp_path)
    server.enqueue(text_reply("planned"), text_reply("deployed"))

    async def go() -> tuple[str, str | None, str]:
        async with Agent(
            workflow, base_url=server.base_url, model="m", store=tmp_path / "runs.db"
        ) as agent:
            first = await agent.run("ship v2")
            assert first.waiting_for is not None
            done = await agent.signal(first.run_id, "ci_passed", {"build": 8}, by="me")
            report = await agent.replay(first.run_id)
            assert report.identical
            return (
                first.status,
                done.termination_reason and str(done.termination_reason),
                (done.response),
            )

    assert asyncio.run(go()) == ("waiting", "final_answer", "deployed")


def test_a_child_run_that_waits_for_an_event_is_signalled_through_its_parent(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "child.yaml").write_text(
        "name: child_wait\ninitial: wait\nstates:\n  wait: {}\n  done: {final: true}\n"
        "transitions:\n  - {source: wait, target: done, event: go, reason: final_answer}\n"
    )
    parent = tmp_path / "parent.yaml"
    parent.write_text(
        "name: parent_call\ninitial: call\nstates:\n"
        "  call: {action: workflow.call, workflow: child.yaml}\n  done: {final: true}\n"
        "transitions:\n  - {source: call, target: done, reason: final_answer}\n"
    )
    store = tmp_path / "runs.db"

    first = cli(capsys, _run(server, parent, store))

    assert first.code == 3
    waiting = first.json()["waiting_for"]
    assert (waiting["kind"], waiting["events"], waiting["due"]) == ("event", ["go"], None)
    run_id, child_id = first.json()["run_id"], waiting["child_run_id"]
    done = cli(capsys, "signal", run_id, "go", "--data", "[1, 2]", "--store", str(store), "--json")

    assert done.code == 0, done.err
    assert done.json()["termination_reason"] == "final_answer"
    delivered = [d for t, d in _events(store, child_id) if t == "event.delivered"]
    assert [(d["name"], d["data"]) for d in delivered] == [("go", [1, 2])]
    assert cli(capsys, "replay", run_id, "--store", str(store)).code == 0
