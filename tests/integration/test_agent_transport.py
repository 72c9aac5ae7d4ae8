"""fsm_kernel.agent.transport: the model client's one-connection-per-request transport, over
real sockets to a small asyncio server that records the bytes it receives.

It must be indistinguishable from httpx's pooled transport told to keep no connection alive
(what the client used before): the same request bytes, the connection closed once the response
is, httpx's exceptions, and httpx's own transport whenever the environment names a proxy.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
import pytest

from fsm_kernel.agent.client import HttpChatModel, _ssl_context
from fsm_kernel.agent.transport import OneShotTransport
from fsm_kernel.config import AgentSettings
from fsm_kernel.errors import AgentConnectionError, AgentTimeoutError
from fsm_kernel.protocol import Message, Tool

ANSWER = json.dumps(
    {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}]}
).encode()


@dataclass
class Recorder:
    """What the server saw: each connection's request bytes, and whether the client closed
    each connection (EOF) after its answer."""

    requests: list[bytes] = field(default_factory=list)
    """Head and body of each request, its server's port in `Host:` replaced by PORT."""
    closed_by_client: int = 0
    delay: float = 0.0
    connections: int = 0


async def _serve_one(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rec: Recorder
) -> None:
    rec.connections += 1
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    body = await reader.readexactly(length)
    port = writer.get_extra_info("sockname")[1]
    rec.requests.append((head + body).replace(f":{port}\r\n".encode(), b":PORT\r\n"))
    if rec.delay:  # a slow answer, unless the client gives up (closes) first
        try:
            if await asyncio.wait_for(reader.read(1), rec.delay) == b"":
                rec.closed_by_client += 1
                return
        except TimeoutError:
            pass
    writer.write(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(ANSWER)}\r\n\r\n".encode()
        + ANSWER
    )
    await writer.drain()
    # Keep-alive server: the connection ends only when the client closes it.
    if await reader.read(1) == b"":
        rec.closed_by_client += 1


@asynccontextmanager
async def server(rec: Recorder) -> AsyncIterator[str]:
    handlers: set[asyncio.Task[None]] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        try:
            await _serve_one(reader, writer, rec)
        except (asyncio.IncompleteReadError, ConnectionError):
            rec.closed_by_client += 1
        finally:
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        async with srv:
            yield f"http://127.0.0.1:{port}/v1"
    finally:
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        await asyncio.sleep(0.01)  # the transports close on the loop's next turns


async def _settle(rec: Recorder, closed: int) -> None:
    for _ in range(200):
        if rec.closed_by_client >= closed:
            return
        await asyncio.sleep(0.01)


def _pooled() -> httpx.AsyncClient:
    return httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0))


def _one_shot() -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=OneShotTransport(_ssl_context()))


async def _post_with(make: type[httpx.AsyncClient] | object) -> Recorder:
    rec = Recorder()
    async with server(rec) as url, make() as client:  # type: ignore[operator]
        for n in range(2):
            response = await client.post(f"{url}/chat/completions", json={"n": n, "x": "é"})
            assert response.json() == json.loads(ANSWER)
        await _settle(rec, 2)
    return rec


def test_the_same_bytes_on_the_wire_as_httpx_pooled_transport() -> None:
    pooled = asyncio.run(_post_with(_pooled))
    one_shot = asyncio.run(_post_with(_one_shot))
    assert one_shot.requests == pooled.requests
    assert len(one_shot.requests) == 2
    assert b"Host: 127.0.0.1:PORT\r\n" in one_shot.requests[0]
    # ... and, like the pool keeping none alive, a connection per request, closed after it.
    assert (one_shot.connections, one_shot.closed_by_client) == (2, 2)
    assert (pooled.connections, pooled.closed_by_client) == (2, 2)


def test_the_model_client_sends_what_it_sent_through_httpx_transport(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def ask(rec: Recorder) -> str | None:
        async with server(rec) as url:
            settings = AgentSettings(base_url=url, model="m", api_key="sk-test-transport")
            async with HttpChatModel(settings) as model:
                completion = await model.complete(
                    [Message.system("be brief"), Message.user("hi")],
                    [Tool(name="echo", description="Echo.", parameters={"type": "object"})],
                )
            await _settle(rec, 1)
        return completion.message.content

    one_shot, pooled = Recorder(), Recorder()
    assert asyncio.run(ask(one_shot)) == "hi"
    monkeypatch.setattr("fsm_kernel.agent.client.proxies_in_environment", lambda: True)
    assert asyncio.run(ask(pooled)) == "hi"
    assert one_shot.requests == pooled.requests
    assert b"Authorization: Bearer sk-test-transport" in one_shot.requests[0]
    assert one_shot.closed_by_client == 1


def test_httpx_transport_when_the_environment_names_a_proxy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    settings = AgentSettings(base_url="http://127.0.0.1:9/v1", model="m")
    model = HttpChatModel(settings)
    assert isinstance(model._client._transport, OneShotTransport)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    proxied = HttpChatModel(settings)
    assert not isinstance(proxied._client._transport, OneShotTransport)
    assert isinstance(proxied._client._transport, httpx.AsyncHTTPTransport)
    asyncio.run(model.aclose())
    asyncio.run(proxied.aclose())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_connection_refused_is_httpx_connect_error_and_leaves_nothing_open() -> None:
    async def go() -> None:
        transport = OneShotTransport(_ssl_context())
        async with httpx.AsyncClient(transport=transport) as client:
            with pytest.raises(httpx.ConnectError):
                await client.post(f"http://127.0.0.1:{_free_port()}/v1/chat/completions", json={})
            assert transport._open == set()

    asyncio.run(go())


def test_the_model_client_still_says_connection_refused() -> None:
    async def go() -> None:
        url = f"http://127.0.0.1:{_free_port()}/v1"
        async with HttpChatModel(AgentSettings(base_url=url, model="m", max_retries=0)) as m:
            with pytest.raises(AgentConnectionError, match="connection refused"):
                await m.complete([Message.user("hi")], [])

    asyncio.run(go())


def test_a_slow_answer_is_httpx_read_timeout_and_the_model_client_times_out() -> None:
    async def go() -> None:
        rec = Recorder(delay=1.0)
        async with server(rec) as url:
            transport = OneShotTransport(_ssl_context())
            async with httpx.AsyncClient(transport=transport, timeout=0.2) as client:
                with pytest.raises(httpx.ReadTimeout):
                    await client.post(f"{url}/chat/completions", json={})
                assert transport._open == set()
            settings = AgentSettings(base_url=url, model="m", request_timeout=0.2, max_retries=0)
            async with HttpChatModel(settings) as model:
                with pytest.raises(AgentTimeoutError, match=r"timed out after 0\.2s"):
                    await model.complete([Message.user("hi")], [])

    asyncio.run(go())


def test_closing_the_transport_closes_a_response_still_open() -> None:
    async def go() -> None:
        rec = Recorder()
        async with server(rec) as url:
            transport = OneShotTransport(_ssl_context())
            client = httpx.AsyncClient(transport=transport)
            request = client.build_request("POST", f"{url}/chat/completions", json={})
            response = await client.send(request, stream=True)
            assert response.status_code == 200
            assert len(transport._open) == 1
            await client.aclose()
            assert transport._open == set()
            await _settle(rec, 1)
            assert rec.closed_by_client == 1

    asyncio.run(go())


def test_the_debug_line_of_each_request_is_logged_only_at_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def ask() -> None:
        async with server(Recorder()) as url:
            settings = AgentSettings(base_url=url, model="m", stream=False)
            async with HttpChatModel(settings) as model:
                await model.complete([Message.user("hi")], [])

    with caplog.at_level(logging.INFO, logger="fsm_kernel.agent.client"):
        asyncio.run(ask())
    assert not [r for r in caplog.records if r.getMessage().startswith("POST ")]
    with caplog.at_level(logging.DEBUG, logger="fsm_kernel.agent.client"):
        asyncio.run(ask())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("POST ")]
    assert len(lines) == 1
    assert re.fullmatch(
        r"POST http://127\.0\.0\.1:\d+/v1/chat/completions model=m messages=1 tools=0 "
        r"attempt=1 stream=False",
        lines[0],
    )


def test_a_cancelled_request_leaves_no_connection_open() -> None:
    async def go() -> None:
        rec = Recorder(delay=5.0)
        async with server(rec) as url:
            transport = OneShotTransport(_ssl_context())
            async with httpx.AsyncClient(transport=transport) as client:
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.2):
                        await client.post(f"{url}/chat/completions", json={})
                assert transport._open == set()
                await _settle(rec, 1)
                assert rec.closed_by_client == 1

    asyncio.run(go())
