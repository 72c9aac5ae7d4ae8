"""`notify:` webhooks against a loopback HTTP receiver: one that answers 200, one that answers
500 then 200, one that is slow, one that is down. The run is never delayed or failed by them,
every attempt is recorded as a `notify.attempted` event after the run's ending, a waiting run
tells who must answer, secrets stay out of the log, and a scheduler tells about a failed
dispatch."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from fsm_kernel import Agent
from fsm_kernel.protocol import EventType
from fsm_kernel.store import SqliteEventStore
from tests.clikit import cli
from tests.fakes.openai_server import FakeOpenAIServer, call, http_error, text_reply, tool_reply

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)


class Receiver:
    """A webhook receiver on 127.0.0.1: /ok answers 200, /flaky 500 then 200, /slow after
    `slow_seconds`; it keeps every POST (path, headers, JSON body, when)."""

    def __init__(self) -> None:
        self.posts: list[dict[str, Any]] = []
        self.slow_seconds = 3.0
        self._flaky = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"null")
                with receiver._lock:
                    receiver.posts.append(
                        {
                            "path": self.path,
                            "headers": {k.lower(): v for k, v in self.headers.items()},
                            "body": body,
                            "at": time.monotonic(),
                        }
                    )
                    flaky = receiver._flaky = receiver._flaky + (self.path == "/flaky")
                if self.path == "/slow":
                    time.sleep(receiver.slow_seconds)
                status = 500 if self.path == "/flaky" and flaky == 1 else 200
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def bodies(self, path: str) -> list[Any]:
        with self._lock:
            return [p["body"] for p in self.posts if p["path"] == path]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    r.thread.start()
    try:
        yield r
    finally:
        r.httpd.shutdown()
        r.httpd.server_close()


@pytest.fixture
def fake() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as server:
        yield server


def down_url() -> str:
    with socket.socket() as s:  # a port nobody listens on once this closes
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/hook"


def workflow(tmp_path: Path, hooks: list[dict[str, Any]], base: str = "default") -> Path:
    text = (ROOT / "workflows" / f"{base}.yaml").read_text()
    path = tmp_path / "notified.yaml"
    path.write_text(text + f"notify: {json.dumps(hooks)}\n")
    return path


def attempts(store: Path, run_id: str) -> list[dict[str, Any]]:
    with SqliteEventStore(store) as events:
        log = events.read(run_id)
    ended = max(i for i, e in enumerate(log) if e.type in (
        EventType.RUN_TERMINATED, EventType.RUN_SUSPENDED
    ))  # fmt: skip
    tried = [e for e in log if e.type is EventType.NOTIFY_ATTEMPTED]
    assert all(log.index(e) > ended for e in tried)  # after the run's ending
    return [e.data for e in tried]


def test_each_webhook_is_told_with_retries_and_every_attempt_is_recorded(
    capsys: pytest.CaptureFixture[str],
    fake: FakeOpenAIServer,
    receiver: Receiver,
    tmp_path: Path,
) -> None:
    hooks = [
        {"url": f"{receiver.url}/ok", "on": ["ended"]},
        {"url": f"{receiver.url}/flaky", "on": ["ended"], "format": "slack"},
        {"url": down_url(), "on": ["ended"], "retries": 1},
        {"url": f"{receiver.url}/never", "on": ["waiting"]},
    ]
    store = tmp_path / "runs.db"
    fake.enqueue(text_reply("All done." + " and more" * 100))

    done = cli(
        capsys, "run", workflow(tmp_path, hooks), "-p", "go", "--base-url", fake.base_url,
        "--model", "m", "--store", store, "--json",
    )  # fmt: skip

    assert done.code == 0, done.err
    run_id = done.json()["run_id"]
    (told,) = receiver.bodies("/ok")
    assert told["event"] == "ended"
    assert told["run_id"] == run_id
    assert told["workflow"] == "default"
    assert (told["status"], told["reason"], told["error"]) == ("ended", "final_answer", None)
    assert told["answer"].startswith("All done. and more")
    assert len(told["answer"]) == 501  # 500 characters and an ellipsis
    assert told["hint"] == f"fsm-kernel runs show {run_id}"
    flaky = receiver.bodies("/flaky")
    assert len(flaky) == 2  # 500, then 200
    assert flaky[1]["text"].startswith("*default run ")
    assert f"`fsm-kernel runs show {run_id}`" in flaky[1]["text"]
    assert receiver.bodies("/never") == []

    tried = attempts(store, run_id)

    def outcome(a: dict[str, Any]) -> tuple[Any, ...]:
        return (a["attempt"], a["status"], a["ok"], a["final"])

    ok = [outcome(a) for a in tried if a["format"] == "json" and a["ok"]]
    assert ok == [(1, 200, True, True)]
    slack = [outcome(a) for a in tried if a["format"] == "slack"]
    assert slack == [(1, 500, False, False), (2, 200, True, True)]
    down = [a for a in tried if a["format"] == "json" and not a["ok"]]
    assert [outcome(a) for a in down] == [(1, None, False, False), (2, None, False, True)]
    assert all(a["error"].startswith("ConnectError") for a in down)
    assert all(a["url"].startswith("http://127.0.0.1:") and "/" not in a["url"][7:] for a in tried)

    replayed = cli(capsys, "replay", run_id, "--store", store, "--json")
    assert replayed.json()["identical"] is True


def test_a_slow_webhook_never_delays_the_run(
    fake: FakeOpenAIServer, receiver: Receiver, tmp_path: Path
) -> None:
    receiver.slow_seconds = 2.0
    hooks = [{"url": f"{receiver.url}/slow", "on": ["ended"], "timeout_seconds": 0.5, "retries": 0}]
    fake.enqueue(text_reply("quick"))
    store = tmp_path / "runs.db"

    async def go() -> tuple[float, float, str]:
        agent = Agent(workflow(tmp_path, hooks), base_url=fake.base_url, model="m", store=store)
        started = time.monotonic()
        result = await agent.run("go")
        ran = time.monotonic() - started
        await agent.aclose()  # waits a little for the webhook
        return ran, time.monotonic() - started, result.run_id

    ran, closed, run_id = asyncio.run(go())

    assert ran < 1.5  # the run returned while its webhook was still being told
    assert closed >= 0.5
    (tried,) = attempts(store, run_id)
    assert (tried["status"], tried["error"], tried["final"]) == (None, "timed out", True)
    assert len(receiver.bodies("/slow")) == 1


def test_a_waiting_run_tells_who_must_answer_and_resume_carries_on(
    capsys: pytest.CaptureFixture[str],
    fake: FakeOpenAIServer,
    receiver: Receiver,
    tmp_path: Path,
) -> None:
    hooks = [{"url": f"{receiver.url}/ok"}]  # the default: failed, waiting, dispatch_failed
    store = tmp_path / "runs.db"
    fake.enqueue(tool_reply(call("read_file", {"path": "notes.txt"}, id="c1")))
    path = workflow(tmp_path, hooks, base="approve_tools")

    waiting = cli(
        capsys, "run", path, "-p", "read my notes", "--base-url", fake.base_url, "--model", "m",
        "--store", store, "--json", "--workspace", tmp_path,
    )  # fmt: skip

    assert waiting.code == 3, waiting.err
    run_id = waiting.json()["run_id"]
    (told,) = receiver.bodies("/ok")
    assert (told["event"], told["status"]) == ("waiting", "waiting")
    assert told["waiting_for"]["tool_call"]["name"] == "read_file"
    assert told["hint"] == (
        f"fsm-kernel runs show {run_id}; answer with fsm-kernel resume {run_id}"
    )
    fake.enqueue(text_reply("There are no notes."))
    done = cli(capsys, "resume", run_id, "--approve", "--store", store, "--json")
    assert done.code == 0, done.err
    assert len(receiver.bodies("/ok")) == 1  # a success: the hook did not ask for `ended`
    with SqliteEventStore(store) as events:
        log = events.read(run_id)
    assert [e.type for e in log].count(EventType.NOTIFY_ATTEMPTED) == 1
    assert log[-1].type is EventType.RUN_TERMINATED  # the resume went on past the attempt
    assert cli(capsys, "replay", run_id, "--store", store, "--json").json()["identical"] is True


def test_secrets_in_a_webhook_stay_out_of_the_log(
    capsys: pytest.CaptureFixture[str],
    fake: FakeOpenAIServer,
    receiver: Receiver,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HOOK_URL", f"{receiver.url}/ok")
    monkeypatch.setenv("HOOK_TOKEN", "hook-token-5f2a9c1e77")
    hooks = [{"url": "${HOOK_URL}", "on": ["failed"], "headers": {"X-Token": "${HOOK_TOKEN}"}}]
    store = tmp_path / "runs.db"
    fake.enqueue(http_error(400))

    failed = cli(
        capsys, "run", workflow(tmp_path, hooks), "-p", "go", "--base-url", fake.base_url,
        "--model", "m", "--store", store, "--json", "--max-retries", "0",
    )  # fmt: skip

    assert failed.code == 1
    (post,) = [p for p in receiver.posts if p["path"] == "/ok"]
    assert post["headers"]["x-token"] == "hook-token-5f2a9c1e77"
    assert post["body"]["event"] == "failed"
    assert post["body"]["reason"] == "agent_error"
    (tried,) = attempts(store, failed.json()["run_id"])
    assert tried["url"] == "(from the environment)"
    with SqliteEventStore(store) as events:
        text = json.dumps([e.data for e in events.read(failed.json()["run_id"])])
    assert "hook-token-5f2a9c1e77" not in text


def test_validate_checks_notify(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = workflow(tmp_path, [{"url": "http://h/x", "on": ["sometimes"]}])

    refused = cli(capsys, "validate", bad)

    assert refused.code == 2
    assert f"{bad}:" in refused.err
    assert "Input should be 'ended', 'failed', 'waiting' or 'dispatch_failed'" in refused.err


SCHEDULER = """kernel_id: notified
schedule: "*/10 * * * *"
state_dir: state
store: kernel.db
timeout_seconds: 30
notify:
  - {{url: "{url}/ok", on: [dispatch_failed]}}
agents:
  - agent_id: breaker
    workflow: single_shot
    prompt: "break {{STATE}}"
"""


def test_a_scheduler_tells_about_a_failed_dispatch(
    capsys: pytest.CaptureFixture[str],
    fake: FakeOpenAIServer,
    receiver: Receiver,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sched.yaml").write_text(SCHEDULER.format(url=receiver.url))
    fake.enqueue(http_error(400))

    outcome = cli(capsys, "schedule", "sched.yaml", "--once", "--base-url", fake.base_url, "--json")

    assert outcome.code == 1
    (told,) = receiver.bodies("/ok")  # once, as dispatch_failed (not also as a failed run)
    assert told["event"] == "dispatch_failed"
    assert told["agent_id"] == "breaker"
    assert told["dispatch_id"]
    assert told["reason"] == "agent_error"
    (tried,) = attempts(tmp_path / "kernel.db", told["run_id"])
    assert (tried["event"], tried["status"]) == ("dispatch_failed", 200)
