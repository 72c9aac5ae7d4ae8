"""MCP tool servers end to end: real servers written with the official SDK's server side
(tests/data/mcp_server.py) over stdio and over streamable HTTP on loopback, a run through the
CLI against the fake OpenAI-compatible server, replay without the servers, tool names kept
unique, headers from the environment never recorded, a crashed or hung server turning calls into
error results, approval, and `fsm-kernel tools --workflow`."""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp")

from fsm_kernel.protocol import EventType
from fsm_kernel.store import SqliteEventStore
from tests.clikit import cli
from tests.fakes.openai_server import (
    FakeOpenAIServer,
    call,
    text_reply,
    tool_reply,
)

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "tests" / "data" / "mcp_server.py"

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def fake() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as server:
        yield server


def stdio(name: str = "calc", **extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"command": sys.executable, "args": [str(SERVER)], **extra}
    if name != "calc":
        spec["env"] = {"MCP_TEST_NAME": name}
    return spec


def workflow(tmp_path: Path, servers: dict[str, Any], tools: list[Any], **limits: int) -> Path:
    text = (ROOT / "workflows" / "default.yaml").read_text()
    text = text.replace("name: default", "name: mcp_test")
    text = text.replace(
        "tools: [datetime, read_file, list_directory, done]",
        f"tools: {json.dumps(tools)}\nmcp_servers: {json.dumps(servers)}",
    )
    for key, value in limits.items():
        text = text.replace("limits:\n", f"limits:\n  {key}: {value}\n", 1)
    path = tmp_path / "mcp.yaml"
    path.write_text(text)
    return path


def run(
    capsys: pytest.CaptureFixture[str], fake: FakeOpenAIServer, path: Path, store: Path, *a: str
) -> Any:
    return cli(
        capsys, "run", path, "-p", "go", "--base-url", fake.base_url, "--model", "m",
        "--store", store, "--max-retries", "0", "--json", *a,
    )  # fmt: skip


def offered(request: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["function"]["name"]: t["function"] for t in request.get("tools", [])}


def test_a_run_calls_a_stdio_servers_tool_and_replays_without_it(
    capsys: pytest.CaptureFixture[str], fake: FakeOpenAIServer, tmp_path: Path
) -> None:
    path = workflow(tmp_path, {"calc": stdio()}, ["mcp:calc", "done"])
    store = tmp_path / "runs.db"
    fake.enqueue(tool_reply(call("add", {"a": 2, "b": 40}, id="c1")), text_reply("It is 42."))

    done = run(capsys, fake, path, store)

    assert done.code == 0, done.err
    result = done.json()
    assert result["response"] == "It is 42."
    assert result["tool_calls"][0]["result"] == "42"
    tools = offered(fake.requests[0])
    assert set(tools) == {"add", "echo", "shout", "slow", "die", "whoami", "done"}
    assert tools["add"]["description"] == "Add two whole numbers."
    assert tools["add"]["parameters"]["required"] == ["a", "b"]
    assert fake.requests[1]["messages"][-1]["content"] == "42"
    with SqliteEventStore(store) as events:
        started = events.read(result["run_id"])[0].data
    assert started["settings"]["mcp_servers"] == {
        "calc": {"command": sys.executable, "args": [str(SERVER)], "cwd": None, "env": []}
    }
    assert "add" in started["settings"]["tools"]

    replayed = cli(capsys, "replay", result["run_id"], "--store", store, "--json")
    assert replayed.code == 0, replayed.out
    assert replayed.json()["identical"] is True


def test_one_tool_of_a_server_and_names_kept_unique_across_servers(
    capsys: pytest.CaptureFixture[str], fake: FakeOpenAIServer, tmp_path: Path
) -> None:
    servers = {"calc": stdio(), "loud": stdio("loud")}
    path = workflow(tmp_path, servers, ["mcp:calc/shout", "mcp:loud/shout", "mcp:loud/echo"])
    fake.enqueue(
        tool_reply(
            call("shout", {"text": "a"}, id="c1"), call("loud__shout", {"text": "b"}, id="c2")
        ),
        text_reply("ok"),
    )

    done = run(capsys, fake, path, tmp_path / "r.db")

    assert done.code == 0, done.err
    assert list(offered(fake.requests[0])) == ["shout", "loud__shout", "echo"]
    results = [c["result"] for c in done.json()["tool_calls"]]
    assert results == ["calc: A!", "loud: B!"]


def test_a_server_without_the_named_tool_is_a_clear_error(
    capsys: pytest.CaptureFixture[str], fake: FakeOpenAIServer, tmp_path: Path
) -> None:
    path = workflow(tmp_path, {"calc": stdio()}, ["mcp:calc/multiply"])

    refused = run(capsys, fake, path, tmp_path / "r.db")

    assert refused.code == 2
    assert "MCP server 'calc' has no tool 'multiply' (it has: add, die, echo" in refused.err
    assert fake.requests == []


def test_validate_points_at_an_undeclared_server(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = workflow(tmp_path, {"calc": stdio()}, ["done", "mcp:files"])

    refused = cli(capsys, "validate", path)

    assert refused.code == 2
    assert (
        "tool entry 'mcp:files' names MCP server 'files', which mcp_servers does not declare"
        in (refused.err)
    )
    assert f"{path}:" in refused.err
    both = workflow(tmp_path, {"x": {"command": "a", "url": "http://h/mcp"}}, ["mcp:x"])
    assert "give either command (stdio) or url" in cli(capsys, "validate", both).err


def test_a_server_that_never_starts_is_a_clear_error(
    capsys: pytest.CaptureFixture[str], fake: FakeOpenAIServer, tmp_path: Path
) -> None:
    mute = {
        "command": sys.executable,
        "args": ["-c", "import sys, time; print('not MCP', file=sys.stderr); time.sleep(30)"],
        "startup_timeout": 1,
    }
    path = workflow(tmp_path, {"mute": mute}, ["mcp:mute"])

    started = time.monotonic()
    refused = run(capsys, fake, path, tmp_path / "r.db")

    assert refused.code == 2
    assert time.monotonic() - started < 15
    assert "MCP server 'mute' did not start within 1s" in refused.err
    assert "its stderr ends: not MCP" in refused.err


def test_a_crashed_or_hung_server_turns_calls_into_errors_and_the_run_goes_on(
    capsys: pytest.CaptureFixture[str], fake: FakeOpenAIServer, tmp_path: Path
) -> None:
    path = workflow(tmp_path, {"calc": stdio(call_timeout=1)}, ["mcp:calc"])
    fake.enqueue(
        tool_reply(call("slow", {"seconds": 5}, id="c1")),
        tool_reply(call("die", {}, id="c2")),
        tool_reply(call("add", {"a": 1, "b": 1}, id="c3")),
    )

    done = run(capsys, fake, path, tmp_path / "r.db")

    result = done.json()
    assert result.get("termination_reason") == "tool_failures", (done.out, done.err)
    calls = result["tool_calls"]
    assert [c["is_error"] for c in calls] == [True, True, True]
    assert "did not finish within 1s" in calls[0]["result"]
    assert "MCP server 'calc'" in calls[1]["result"]
    assert "MCP server 'calc'" in calls[2]["result"]  # dead: every later call fails too


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def http_server() -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, str(SERVER), "--http", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert process.poll() is None, "the MCP HTTP server exited"
                assert time.monotonic() < deadline, "the MCP HTTP server never listened"
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_a_streamable_http_server_gets_headers_from_the_environment_never_recorded(
    capsys: pytest.CaptureFixture[str],
    fake: FakeOpenAIServer,
    tmp_path: Path,
    http_server: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    secret = "s3cr3t-mcp-token-value"
    monkeypatch.setenv("MCP_TOKEN", secret)
    server = {"url": http_server, "headers": {"Authorization": "Bearer ${MCP_TOKEN}"}}
    path = workflow(tmp_path, {"remote": server}, ["mcp:remote/whoami", "mcp:remote/add"])
    store = tmp_path / "runs.db"
    fake.enqueue(tool_reply(call("whoami", {}, id="c1")), text_reply("done"))

    done = run(capsys, fake, path, store)

    assert done.code == 0, done.err
    sent = fake.requests[1]["messages"][-1]["content"]
    assert sent == hashlib.sha256(f"Bearer {secret}".encode()).hexdigest()  # it got it expanded
    with SqliteEventStore(store) as events:
        log = events.read(done.json()["run_id"])
    assert secret not in json.dumps([e.data for e in log])  # the log never holds it
    assert secret not in done.out
    started = log[0].data["settings"]["mcp_servers"]
    assert started == {"remote": {"url": http_server, "headers": ["Authorization"]}}
    listed = cli(capsys, "tools", "--workflow", path, "--json")
    assert [t["name"] for t in json.loads(listed.out)] == ["whoami", "add"]

    monkeypatch.delenv("MCP_TOKEN")
    refused = run(capsys, fake, path, tmp_path / "r2.db")
    assert refused.code == 2
    assert "mcp_servers.remote.headers.Authorization uses ${MCP_TOKEN}, which is not set" in (
        refused.err
    )


def test_approval_applies_to_mcp_tools(
    capsys: pytest.CaptureFixture[str], fake: FakeOpenAIServer, tmp_path: Path
) -> None:
    tools = [{"name": "mcp:calc/add", "approval": "required"}, "mcp:calc/echo"]
    path = workflow(tmp_path, {"calc": stdio()}, tools)
    store = tmp_path / "runs.db"
    fake.enqueue(tool_reply(call("add", {"a": 1, "b": 2}, id="c1")))

    waiting = run(capsys, fake, path, store)

    assert waiting.code == 3, waiting.err
    assert waiting.json()["waiting_for"]["tool_call"]["name"] == "add"
    fake.enqueue(text_reply("3"))
    done = cli(capsys, "resume", waiting.json()["run_id"], "--approve", "--store", store, "--json")
    assert done.code == 0, done.err
    assert done.json()["tool_calls"][0]["result"] == "3"


def test_tools_lists_a_workflows_mcp_tools_with_their_schemas(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = workflow(tmp_path, {"calc": stdio()}, ["datetime", "mcp:calc/add"])

    listed = cli(capsys, "tools", "--workflow", path)
    as_json = cli(capsys, "tools", "--workflow", path, "--json")

    assert listed.code == 0, listed.err
    assert "add(a: integer, b: integer)\n    Add two whole numbers." in listed.out
    schemas = {t["name"]: t for t in json.loads(as_json.out)}
    assert list(schemas) == ["datetime", "add"]
    assert schemas["add"]["parameters"]["properties"]["a"]["type"] == "integer"


def test_events_record_mcp_calls_like_any_tool(
    capsys: pytest.CaptureFixture[str], fake: FakeOpenAIServer, tmp_path: Path
) -> None:
    path = workflow(tmp_path, {"calc": stdio()}, ["mcp:calc/echo"])
    store = tmp_path / "runs.db"
    fake.enqueue(tool_reply(call("echo", {"text": "hi"}, id="c1")), text_reply("ok"))

    done = run(capsys, fake, path, store)

    with SqliteEventStore(store) as events:
        log = events.read(done.json()["run_id"])
    finished = next(e.data for e in log if e.type is EventType.TOOL_FINISHED)
    assert finished["call"]["name"] == "echo"
    assert finished["result"]["content"] == "calc says hi"


SCHEDULER = """kernel_id: mcp
schedule: "*/10 * * * *"
state_dir: state
store: kernel.db
timeout_seconds: 60
agents:
  - {{agent_id: first, workflow: {workflow}, prompt: "FIRST {{STATE}}"}}
  - {{agent_id: second, workflow: {workflow}, prompt: "SECOND {{STATE}}"}}
"""


def test_a_scheduler_starts_each_workflows_servers_once_for_the_process(
    capsys: pytest.CaptureFixture[str],
    fake: FakeOpenAIServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    starts = tmp_path / "starts.txt"
    server = stdio(env={"MCP_TEST_STARTS": str(starts)})
    path = workflow(tmp_path, {"calc": server}, ["mcp:calc/add"])
    (tmp_path / "sched.yaml").write_text(SCHEDULER.format(workflow=path))

    def reply(request: dict[str, Any]) -> Any:
        if request["messages"][-1]["role"] == "tool":
            return text_reply("added")
        return tool_reply(call("add", {"a": 1, "b": 2}, id="c1"))

    fake.enqueue(*[reply] * 4)

    outcome = cli(capsys, "schedule", "sched.yaml", "--once", "--base-url", fake.base_url)

    assert outcome.code == 0, outcome.err
    tool_results = [
        r["messages"][-1]["content"] for r in fake.requests if r["messages"][-1]["role"] == "tool"
    ]
    assert tool_results == ["3", "3"]  # both dispatches called it
    assert len(starts.read_text().split()) == 1  # one server process for both


def test_a_child_workflows_mcp_servers_start_once_for_all_its_children(
    capsys: pytest.CaptureFixture[str], fake: FakeOpenAIServer, tmp_path: Path
) -> None:
    starts = tmp_path / "starts.txt"
    child = workflow(tmp_path, {"calc": stdio(env={"MCP_TEST_STARTS": str(starts)})},
                     ["mcp:calc/add"])  # fmt: skip
    parent = tmp_path / "parent.yaml"
    parent.write_text(
        (ROOT / "tests" / "data" / "children" / "fanout.yaml").read_text()
        .replace("workflow: step.yaml", f"workflow: {child.name}")
    )  # fmt: skip

    def reply(request: dict[str, Any]) -> Any:
        last = request["messages"][-1]
        if "response_format" in request:
            return text_reply(json.dumps({"steps": ["one", "two"]}))
        if last["role"] == "tool":
            return text_reply(f"sum {last['content']}")
        if str(last["content"]).startswith("Step"):
            return tool_reply(call("add", {"a": 20, "b": 22}, id="c1"))
        return text_reply("both added")

    fake.enqueue(*[reply] * 6)

    done = run(capsys, fake, parent, tmp_path / "r.db")

    assert done.code == 0, done.err
    assert done.json()["response"] == "both added"
    results = [
        m["content"] for r in fake.requests for m in r["messages"][-1:] if m["role"] == "tool"
    ]
    assert results == ["42", "42"]
    assert len(starts.read_text().split()) == 1  # one server for both children
