"""MCP servers that misbehave (issue 26): one that lists 20,000 tools, one that never answers
or ignores every way to stop it but SIGKILL, an empty command, a line on stdout that is not
JSON-RPC, and a tool that echoes the secret it was given. The servers are hand-written
(tests/data/mcp_raw_server.py): they start fast and misbehave on demand."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp")

from fsm_kernel.errors import ConfigError
from fsm_kernel.tools.mcp_client import MAX_TOOLS_PER_SERVER, McpRef, McpServers
from fsm_kernel.tools.registry import ToolRegistry
from fsm_kernel.workflow.spec import McpServerSpec
from tests.clikit import cli
from tests.fakes.openai_server import FakeOpenAIServer, call, text_reply, tool_reply

ROOT = Path(__file__).resolve().parents[2]
RAW = ROOT / "tests" / "data" / "mcp_raw_server.py"

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def fake() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as server:
        yield server


def raw(*args: str, **extra: Any) -> dict[str, Any]:
    return {"command": sys.executable, "args": [str(RAW), *args], **extra}


def workflow(tmp_path: Path, servers: dict[str, Any], tools: list[Any]) -> str:
    text = (ROOT / "workflows" / "default.yaml").read_text()
    text = text.replace("name: default", "name: mcp_hardening")
    text = text.replace(
        "tools: [datetime, read_file, list_directory, done]",
        f"tools: {json.dumps(tools)}\nmcp_servers: {json.dumps(servers)}",
    )
    path = tmp_path / "mcp.yaml"
    path.write_text(text)
    return str(path)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_server_with_20000_tools_is_listed_at_once_and_an_entry_takes_at_most_the_cap(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    many = {"many": raw("--tools", "20000")}

    one = cli(capsys, "tools", "--workflow", workflow(tmp_path, many, ["mcp:many/t19999"]))
    every = cli(capsys, "tools", "--workflow", workflow(tmp_path, many, ["mcp:many"]))
    missing = cli(capsys, "tools", "--workflow", workflow(tmp_path, many, ["mcp:many/nope"]))

    assert (one.code, one.out) == (0, "t19999()\n    Tool 19999.\n"), one.err
    assert every.code == 2
    assert every.out == ""
    assert every.err.strip() == (
        f"error: MCP server 'many' lists 20001 tools, more than the {MAX_TOOLS_PER_SERVER} "
        "an entry mcp:many may offer: name the ones to offer (mcp:many/TOOL)"
    )
    assert missing.code == 2
    assert "has no tool 'nope' (it has: getenv, t0, t1, t10, t100, t1000," in missing.err
    assert missing.err.rstrip().endswith("and 19981 more)")  # one line, not 20,001 names


def test_registering_every_tool_of_a_server_is_linear(tmp_path: Path) -> None:
    """At the cap, twice over (two entries select the same tools: each keeps its one name)."""
    servers = McpServers({"s": McpServerSpec(**raw("--tools", str(MAX_TOOLS_PER_SERVER - 1)))})
    registry = ToolRegistry()

    async def register() -> list[Any]:
        try:
            return await servers.register([McpRef("s", None), McpRef("s", None)], registry)
        finally:
            await servers.aclose()

    (_, names), (_, again) = asyncio.run(register())

    assert names == again == ["getenv", *(f"t{i}" for i in range(MAX_TOOLS_PER_SERVER - 1))]
    assert len(registry) == MAX_TOOLS_PER_SERVER


@pytest.mark.parametrize("how", ["--silent", "--stubborn"])
def test_startup_timeout_is_a_deadline_and_the_server_is_killed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, how: str
) -> None:
    """A server that never answers is given up at its startup_timeout and killed at once,
    even one that ignores the end of its stdin and SIGTERM (the SDK's own shutdown waited
    2 s + 2 s + 2 s after our 5 s: 13.5 s for `startup_timeout: 5`)."""
    pidfile = tmp_path / "pid"
    mute = raw("--silent", how, "--pidfile", str(pidfile), startup_timeout=2)
    path = workflow(tmp_path, {"mute": mute}, ["mcp:mute"])

    started = time.monotonic()
    refused = cli(capsys, "tools", "--workflow", path)
    took = time.monotonic() - started

    assert refused.code == 2
    assert refused.err.strip() == (
        "error: MCP server 'mute' did not start within 2s (mcp_servers.mute.startup_timeout)"
    )
    assert took < 2 + 4, f"the deadline was 2 s; the command took {took:.1f} s"
    assert not alive(int(pidfile.read_text()))


def test_a_started_server_that_ignores_every_request_to_stop_is_killed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    pidfile = tmp_path / "pid"
    path = workflow(tmp_path, {"s": raw("--stubborn", "--pidfile", str(pidfile))}, ["mcp:s"])

    listed = cli(capsys, "tools", "--workflow", path)

    assert listed.code == 0, listed.err
    assert listed.out.startswith("getenv(name?: string)")
    assert not alive(int(pidfile.read_text()))


def test_an_empty_command_is_one_clear_error_for_a_workflow_built_in_python() -> None:
    empty = McpServerSpec.model_construct(command="", args=[], env={}, headers={})
    servers = McpServers({"s": empty})

    with pytest.raises(ConfigError) as refused:
        asyncio.run(servers.register([McpRef("s", None)], ToolRegistry()))

    assert str(refused.value) == (
        "mcp_servers.s.command is empty: give the program that starts the server"
    )


def test_a_line_on_stdout_that_is_not_json_rpc_is_skipped_with_one_line_no_traceback(
    tmp_path: Path,
) -> None:
    path = workflow(tmp_path, {"s": raw("--banner", "Server v1 ready!")}, ["mcp:s"])

    listed = subprocess.run(
        [sys.executable, "-m", "fsm_kernel", "tools", "--workflow", path],
        capture_output=True, text=True, timeout=50, cwd=tmp_path,
    )  # fmt: skip

    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.startswith("getenv(name?: string)")
    assert [line for line in listed.stderr.splitlines() if line] == [
        "WARNING [-]: MCP server s wrote a line that is not JSON-RPC on its stdout (skipped): "
        "'Server v1 ready!'"
    ]


def test_a_secret_given_to_a_server_and_echoed_by_its_tool_never_reaches_the_model(
    capsys: pytest.CaptureFixture[str],
    fake: FakeOpenAIServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    literal, ours = "literal-s3cret-in-the-file", "s3cret-from-our-environment"
    monkeypatch.setenv("HARDENING_TOKEN", ours)
    env = {"LITERAL": literal, "FROM_ENV": "${HARDENING_TOKEN}", "LEVEL": "warn"}
    path = workflow(tmp_path, {"s": raw(env=env)}, ["mcp:s/getenv"])
    fake.enqueue(
        tool_reply(
            call("getenv", {"name": "LITERAL"}, id="c1"),
            call("getenv", {"name": "FROM_ENV"}, id="c2"),
            call("getenv", {"name": "LEVEL"}, id="c3"),
        ),
        text_reply("ok"),
    )

    done = cli(
        capsys, "run", path, "-p", "go", "--base-url", fake.base_url, "--model", "m",
        "--store", str(tmp_path / "r.db"), "--max-retries", "0", "--json",
    )  # fmt: skip

    assert done.code == 0, done.err
    results = [m["content"] for m in fake.requests[1]["messages"] if m["role"] == "tool"]
    assert results == ["[REDACTED]", "[REDACTED]", "warn"]  # too short to be a secret
    sent = json.dumps(fake.requests)
    assert literal not in sent
    assert ours not in sent
