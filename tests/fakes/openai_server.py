"""A fake OpenAI-compatible chat-completions server for integration tests: real HTTP over
loopback, scripted replies. Standard library only (it never imports fsm_kernel), so it also runs
as a script for subprocess tests.

In-process use::

    from tests.fakes.openai_server import FakeOpenAIServer, call, text_reply, tool_reply

    with FakeOpenAIServer() as server:                 # 127.0.0.1, a free port, daemon thread
        server.enqueue(
            tool_reply(call("read_file", {"path": "a.txt"}, id="c1")),
            text_reply("done", reasoning="thought about it"),
        )
        settings = AgentSettings(base_url=server.base_url, model="m", max_retries=0)
        ...                                            # run the code under test
        assert server.requests[1]["messages"][-1]["tool_call_id"] == "c1"
        server.assert_complete()                       # every reply used, no errors

Each POST to `/v1/chat/completions` takes the next reply from the queue. Replies:

* `text_reply(content, *, reasoning=None)`: a plain answer (`reasoning` goes in the `reasoning`
  field, as Ollama and vLLM send it).
* `tool_reply(*calls, content=None)`, with `call(name, arguments, id=None)` per call; several
  calls are parallel tool calls in one response. `arguments` is a dict (sent as a JSON string)
  or a string sent verbatim (for invalid-JSON tests).
* `http_error(status, body=None, headers=None, *, echo_auth=False)`: an error status; the
  default body is OpenAI-shaped, a dict is sent as JSON, a string as text. With
  `echo_auth=True` the answer echoes the request's credentials, as some proxies do on 401 and
  in 5xx pages: `$AUTHORIZATION` (the whole `Authorization` header value) and `$API_KEY` (the
  value without its `Bearer ` prefix) are replaced in the body (in every string of a JSON
  body); the default body carries both.
* `raw_body(text, status=200, *, echo_auth=False)`: any text, e.g. invalid JSON.
* `hang(seconds, then=None)`: wait before answering `then` (default: a 504). The wait ends at
  once when the server stops, so timeout tests shut down fast.
* `trickle(then, interval=0.1)`: send the headers of `then` at once, then its body one byte
  every `interval` seconds (a server that is slow but never silent; ends when the server stops).
* `chunked(then)`: send `then` with `Transfer-Encoding: chunked` and no Content-Length.
* `disconnect()`: close the connection without answering.
* `sse_reply(*events, done=True, crlf=False, cut_after=None)`: server-sent events written as
  given (a dict is sent as `data: <json>`, a str verbatim, e.g. `": ping\n\n"` or
  `"data: not json\n\n"`), then `data: [DONE]` unless `done=False`; for bad streams and
  mid-stream errors.
* `streamed(then, style)`: `then`, streamed in `style` (a StreamStyle) when the request asks.
* a plain dict: a full response body sent as-is with status 200 (for quirk tests).
* a callable `fn(request_body) -> reply`: decides from the request.

Generated replies echo the request's `model` and carry `usage`. When the queue is empty the
server answers 500 with a body saying the script ran out, and records that in `.errors`.

Streaming: a request with `"stream": true` gets each generated reply (`text_reply`,
`tool_reply`) as server-sent events (`text/event-stream`, chunked), in the server's
`stream_style` unless the reply has its own (`streamed`): text cut into pieces, tool-call
arguments into fragments (OpenAI style, `StreamStyle()`) or each call whole in one delta, all
at index 0 (`OLLAMA_STYLE`), usage in a last chunk with empty choices when the request asks
(`stream_options.include_usage`), then `data: [DONE]`; `StreamStyle` also has CRLF line ends,
`: ping` comments, a null final finish reason, no usage, no ids, a pause between events and a
connection dropped after N events. So every scripted reply works whether or not the client
streams. Other replies (errors, raw bodies, plain dicts) are sent as they are; with
`stream_style=None` the server answers every request with plain JSON.

Connections close after each answer unless `keep_alive=True` (then they stay open as with a
real server; `stop()` still ends them at once).

With `reject_response_format=True` the server is one that cannot do structured output: a
request carrying `response_format` is answered 400 with OpenAI's own message for a model without
it ("Invalid parameter: 'response_format' of type 'json_schema' is not supported with this
model."), using no scripted reply (the request is still in `.requests`; `.rejected` counts them).

With `strict=True` (the default) the server also enforces OpenAI's message-ordering rules and
answers 400 with OpenAI's own messages, as the real API does: a `tool` message must answer a
call of the assistant message before it, and every call must be answered before the next
non-tool message. Such a rejection uses no scripted reply and is recorded in `.errors`.

Inspect `.requests` (JSON bodies received), `.request_headers` (lower-cased names), `.errors`,
`.pending` (replies left), `.peak_in_flight` (the most requests answered at the same time) and
`wait_for_requests(n)`.

Script mode, for running the `fsm-kernel` CLI in a subprocess::

    python -m tests.fakes.openai_server --script replies.json [--port 0] [--requests-log FILE]

`replies.json` is a list of reply specs: `{"text": "...", "reasoning": "..."}`,
`{"tool_calls": [{"name": "...", "arguments": {...}, "id": "..."}], "content": "..."}`,
`{"status": 500, "body": ..., "headers": {...}, "echo_auth": true}`, `{"raw": "...", "status":
200}`, `{"hang": 5, "then": {...}}`, `{"trickle": 0.1, "then": {...}}`, `{"chunked": true,
"then": {...}}`, `{"stream": {StreamStyle fields}, "then": {...}}`, `{"sse": [event, ...],
"done": true}`, `{"disconnect": true}`, `{"body": {...}}` (sent as-is), or a bare string (a
text reply). The server prints `READY http://127.0.0.1:PORT/v1` on one line (flushed)
and serves until killed; `--requests-log FILE` appends each request body as a JSON line, flushed
at once so it survives a SIGKILL of the client; `--reject-response-format` as above. Run it
from the repository root (or run the file directly: `python tests/fakes/openai_server.py ...`).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import signal
import socket
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

__all__ = [
    "API_KEY",
    "AUTHORIZATION",
    "ENDPOINT",
    "NO_RESPONSE_FORMAT",
    "OLLAMA_STYLE",
    "OPENAI_STYLE",
    "FakeOpenAIServer",
    "Reply",
    "ReplyLike",
    "StreamStyle",
    "call",
    "chunked",
    "completion_chunks",
    "disconnect",
    "hang",
    "http_error",
    "main",
    "raw_body",
    "reply_from_spec",
    "sse_reply",
    "streamed",
    "text_reply",
    "tool_reply",
    "trickle",
]

logger = logging.getLogger(__name__)

ENDPOINT = "/v1/chat/completions"
DEFAULT_USAGE: Mapping[str, int] = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
AUTHORIZATION = "$AUTHORIZATION"
"""In an `echo_auth` reply: replaced by the request's whole Authorization header value."""
API_KEY = "$API_KEY"
"""In an `echo_auth` reply: replaced by the Authorization value without its `Bearer ` prefix."""
NO_RESPONSE_FORMAT = (
    "Invalid parameter: 'response_format' of type 'json_schema' is not supported with this model."
)
"""OpenAI's 400 message for a model without structured output (`reject_response_format`)."""
_CHUNK_SIZE = 64 * 1024
_JSON = "application/json"
_EVENT_STREAM = "text/event-stream"


@dataclass(frozen=True)
class StreamStyle:
    """How a generated reply is streamed (see the module docstring)."""

    text_piece: int = 3
    """Characters per content or reasoning delta (0: all in one)."""
    args_piece: int = 5
    """Characters per argument fragment after a call's first delta, which carries its id and
    name (OpenAI); 0: each call whole in one delta (Ollama)."""
    call_index: str = "sequential"
    """`sequential` (0, 1, ...), `zero` (every call at index 0, Ollama #15457) or `none`."""
    call_ids: bool = True
    """False: calls without ids (old Ollama, vLLM #18412)."""
    repeat_role: bool = False
    """Every delta repeats `role: assistant` and `content: ""` (Ollama)."""
    usage: str = "chunk"
    """`chunk`: a last chunk with empty choices (when the request asks for usage); `finish`: on
    the finish chunk; `none`: no usage at all."""
    finish_reason: bool = True
    """False: the final chunk's finish reason is null (Ollama, vLLM #27572)."""
    done: bool = True
    """End with `data: [DONE]`."""
    crlf: bool = False
    """End lines with CRLF."""
    ping: bool = False
    """A `: ping` comment line before every event."""
    interval: float = 0.0
    """Seconds between events (cut short when the server stops)."""
    cut_after: int | None = None
    """Drop the connection after this many events, in the middle of the body."""


OPENAI_STYLE = StreamStyle()
OLLAMA_STYLE = StreamStyle(args_piece=0, call_index="zero", repeat_role=True)


@dataclass(frozen=True)
class Reply:
    """One scripted answer. Build it with the helpers below rather than by hand."""

    status: int = 200
    body: Any = None
    """Sent as JSON when not None."""
    text: str | None = None
    """Sent verbatim when `body` is None."""
    headers: Mapping[str, str] = field(default_factory=dict)
    delay: float = 0.0
    """Seconds to wait before answering (cut short when the server stops)."""
    disconnect: bool = False
    """Close the connection without sending anything."""
    completion: bool = False
    """A generated chat completion: fill in `id`, `created` and the request's `model`."""
    echo_auth: bool = False
    """Replace `AUTHORIZATION` and `API_KEY` in the body by the request's credentials."""
    byte_interval: float = 0.0
    """Seconds between bytes of the body (0: send it at once); the headers go first."""
    chunked: bool = False
    """Send the body with `Transfer-Encoding: chunked` instead of a Content-Length."""
    content_type: str = _JSON
    stream_style: StreamStyle | None = None
    """How to stream a generated completion (None: the server's style)."""
    events: tuple[bytes, ...] | None = None
    """Server-sent events, written (chunked) one at a time instead of a body."""
    event_interval: float = 0.0
    cut_after: int | None = None
    """Drop the connection after this many events, without ending the body."""


ReplyLike = Reply | Mapping[str, Any] | Callable[[dict[str, Any]], Any]


def call(
    name: str, arguments: Mapping[str, Any] | str | None = None, id: str | None = None
) -> dict[str, Any]:
    """One tool call in wire form, for `tool_reply`. A str `arguments` is sent verbatim."""
    args = arguments if isinstance(arguments, str) else json.dumps(dict(arguments or {}))
    return {
        "id": id if id is not None else f"call_{uuid.uuid4().hex[:12]}",
        "type": "function",
        "function": {"name": name, "arguments": args},
    }


def text_reply(
    content: str,
    *,
    reasoning: str | None = None,
    finish_reason: str | None = "stop",
    usage: Mapping[str, int] | None = None,
) -> Reply:
    """A plain assistant answer."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning"] = reasoning
    return _completion(message, finish_reason, usage)


def tool_reply(
    *calls: Mapping[str, Any],
    content: str | None = None,
    finish_reason: str | None = "tool_calls",
    usage: Mapping[str, int] | None = None,
) -> Reply:
    """An assistant turn with one or more (parallel) tool calls; build each with `call()`."""
    message = {"role": "assistant", "content": content, "tool_calls": [dict(c) for c in calls]}
    return _completion(message, finish_reason, usage)


def _completion(
    message: dict[str, Any], finish_reason: str | None, usage: Mapping[str, int] | None
) -> Reply:
    body = {
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
        "usage": dict(usage if usage is not None else DEFAULT_USAGE),
    }
    return Reply(body=body, completion=True)


def http_error(
    status: int,
    body: Any = None,
    headers: Mapping[str, str] | None = None,
    *,
    echo_auth: bool = False,
) -> Reply:
    """An error status. `body`: None for an OpenAI-shaped error, a dict/list for JSON, a str for
    text. `echo_auth`: fill `AUTHORIZATION` / `API_KEY` in the body with the request's
    credentials (the default body then echoes both, like a proxy dumping the request)."""
    if body is None:
        kind = "server_error" if status >= 500 else "invalid_request_error"
        body = _error_body(f"fake server error {status}", kind)
        if echo_auth:
            body["error"]["message"] += f": bad key {API_KEY}"
            body["request"] = {"headers": {"authorization": AUTHORIZATION}}
    if isinstance(body, str):
        return Reply(status=status, text=body, headers=dict(headers or {}), echo_auth=echo_auth)
    return Reply(status=status, body=body, headers=dict(headers or {}), echo_auth=echo_auth)


def _error_body(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def raw_body(text: str, status: int = 200, *, echo_auth: bool = False) -> Reply:
    """Any text as the body (e.g. invalid JSON), with a JSON content type. `echo_auth`: as for
    `http_error`."""
    return Reply(status=status, text=text, echo_auth=echo_auth)


def hang(seconds: float, then: ReplyLike | None = None) -> Reply:
    """Wait `seconds` before answering `then` (default: a 504). Cut short by server shutdown."""
    after = _to_reply(then, {}) if then is not None else http_error(504)
    return replace(after, delay=seconds)


def trickle(then: ReplyLike, interval: float = 0.1) -> Reply:
    """Answer `then`, its body one byte every `interval` seconds after the headers: each read
    gets data in time, so only a deadline on the whole request ends it."""
    return replace(_to_reply(then, {}), byte_interval=interval)


def chunked(then: ReplyLike) -> Reply:
    """Answer `then` with `Transfer-Encoding: chunked` and no Content-Length, so the client
    learns the size only by reading."""
    return replace(_to_reply(then, {}), chunked=True)


def streamed(then: ReplyLike, style: StreamStyle) -> Reply:
    """`then` (a generated reply), streamed in `style` when the request asks for a stream."""
    return replace(_to_reply(then, {}), stream_style=style)


def sse_reply(
    *events: Mapping[str, Any] | str,
    done: bool = True,
    crlf: bool = False,
    cut_after: int | None = None,
) -> Reply:
    """Server-sent events as given: a dict is sent as `data: <json>`, a str verbatim (bring its
    own blank line). `done`: end with `data: [DONE]`. `cut_after`: drop the connection after
    that many events."""
    end = "\r\n" if crlf else "\n"
    texts = [e if isinstance(e, str) else f"data: {json.dumps(e)}{end}{end}" for e in events]
    if done:
        texts.append(f"data: [DONE]{end}{end}")
    encoded = tuple(t.encode() for t in texts)
    return Reply(content_type=_EVENT_STREAM, chunked=True, events=encoded, cut_after=cut_after)


def completion_chunks(
    body: Mapping[str, Any], style: StreamStyle = OPENAI_STYLE, *, include_usage: bool = True
) -> list[dict[str, Any]]:
    """The `chat.completion.chunk` objects a server streaming `body` in `style` would send."""
    choice = body["choices"][0]
    message = choice.get("message") or {}
    head = {k: body[k] for k in ("id", "created", "model") if k in body}
    head["object"] = "chat.completion.chunk"
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
    for key in ("reasoning_content", "reasoning", "content"):
        if isinstance(message.get(key), str) and message[key]:
            deltas += [{key: piece} for piece in _pieces(message[key], style.text_piece)]
    for index, tool_call in enumerate(message.get("tool_calls") or ()):
        deltas += _call_deltas(index, tool_call, style)
    if style.repeat_role:
        deltas = [{"role": "assistant", "content": "", **delta} for delta in deltas]
    chunks = [
        {**head, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas
    ]
    finish = choice.get("finish_reason") if style.finish_reason else None
    last: dict[str, Any] = {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}
    usage = body.get("usage")
    if usage is not None and style.usage == "finish":
        last["usage"] = usage
    chunks.append(last)
    if usage is not None and style.usage == "chunk" and include_usage:
        chunks.append({**head, "choices": [], "usage": usage})
    return chunks


def _pieces(text: str, size: int) -> list[str]:
    if size <= 0:
        return [text]
    return [text[start : start + size] for start in range(0, len(text), size)]


def _call_deltas(index: int, tool_call: Mapping[str, Any], style: StreamStyle) -> list[Any]:
    fn = tool_call.get("function") or {}
    arguments = fn.get("arguments")
    entry: dict[str, Any] = {}
    if style.call_index != "none":
        entry["index"] = index if style.call_index == "sequential" else 0
    if style.call_ids and tool_call.get("id") is not None:
        entry["id"] = tool_call["id"]
    entry["type"] = "function"
    if style.args_piece <= 0 or not isinstance(arguments, str):
        return [
            {
                "tool_calls": [
                    {**entry, "function": {"name": fn.get("name"), "arguments": arguments}}
                ]
            }
        ]
    first = {"tool_calls": [{**entry, "function": {"name": fn.get("name"), "arguments": ""}}]}
    key = {k: v for k, v in entry.items() if k == "index"}  # fragments carry only the index
    return [first] + [
        {"tool_calls": [{**key, "function": {"arguments": piece}}]}
        for piece in _pieces(arguments, style.args_piece)
    ]


def _stream(reply: Reply, style: StreamStyle, request: Mapping[str, Any]) -> Reply:
    """A generated reply as the server-sent events of `style`."""
    options = request.get("stream_options")
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    chunks = completion_chunks(reply.body, style, include_usage=include_usage)
    end = "\r\n" if style.crlf else "\n"
    ping = f": ping{end}" if style.ping else ""
    texts = [f"{ping}data: {json.dumps(chunk)}{end}{end}" for chunk in chunks]
    if style.done:
        texts.append(f"{ping}data: [DONE]{end}{end}")
    return replace(
        reply,
        body=None,
        content_type=_EVENT_STREAM,
        chunked=True,
        events=tuple(t.encode() for t in texts),
        event_interval=style.interval,
        cut_after=style.cut_after,
    )


def disconnect() -> Reply:
    """Close the connection without answering."""
    return Reply(disconnect=True)


def reply_from_spec(spec: Any) -> Reply:
    """A Reply from a JSON spec (script mode); see the module docstring. ValueError if unknown."""
    if isinstance(spec, str):
        return text_reply(spec)
    if not isinstance(spec, dict):
        raise ValueError(f"a reply spec must be an object or a string, not {spec!r}")
    wrapped = _wrapper_from_spec(spec)
    if wrapped is not None:
        return wrapped
    if "text" in spec:
        return text_reply(spec["text"], reasoning=spec.get("reasoning"))
    if "tool_calls" in spec:
        calls = [call(c["name"], c.get("arguments"), c.get("id")) for c in spec["tool_calls"]]
        return tool_reply(*calls, content=spec.get("content"))
    if "raw" in spec:
        return raw_body(spec["raw"], int(spec.get("status", 200)))
    if "status" in spec:
        return http_error(
            int(spec["status"]),
            spec.get("body"),
            spec.get("headers"),
            echo_auth=bool(spec.get("echo_auth")),
        )
    if spec.get("disconnect"):
        return disconnect()
    if "body" in spec:
        return Reply(body=spec["body"])
    raise ValueError(f"unknown reply spec {spec!r}")


def _wrapper_from_spec(spec: dict[str, Any]) -> Reply | None:
    """The specs that change how another reply (`then`) is delivered; None for the others."""
    if "hang" in spec:
        then = reply_from_spec(spec["then"]) if "then" in spec else None
        return hang(float(spec["hang"]), then)
    if "trickle" in spec:
        return trickle(reply_from_spec(spec["then"]), float(spec["trickle"]))
    if spec.get("chunked"):
        return chunked(reply_from_spec(spec["then"]))
    if isinstance(spec.get("stream"), dict):
        return streamed(reply_from_spec(spec["then"]), StreamStyle(**spec["stream"]))
    if "sse" in spec:
        return sse_reply(*spec["sse"], done=bool(spec.get("done", True)))
    return None


def _to_reply(reply: Any, request: dict[str, Any]) -> Reply:
    if isinstance(reply, Reply):
        return reply
    if isinstance(reply, Mapping):
        return Reply(body=dict(reply))
    if callable(reply):
        return _to_reply(reply(request), request)
    raise TypeError(f"not a reply: {reply!r}")


def _with_credentials(reply: Reply, headers: Mapping[str, str]) -> Reply:
    """`reply` with the request's credentials put in place of `AUTHORIZATION` and `API_KEY`."""
    authorization = headers.get("authorization", "")
    key = authorization.removeprefix("Bearer ").strip()

    def fill(value: Any) -> Any:
        if isinstance(value, str):
            return value.replace(AUTHORIZATION, authorization).replace(API_KEY, key)
        if isinstance(value, dict):
            return {k: fill(v) for k, v in value.items()}
        if isinstance(value, list):
            return [fill(v) for v in value]
        return value

    return replace(reply, body=fill(reply.body), text=fill(reply.text))


class FakeOpenAIServer:
    """Scripted OpenAI-compatible server on 127.0.0.1 in a daemon thread (see the module doc)."""

    def __init__(
        self,
        *replies: ReplyLike,
        port: int = 0,
        strict: bool = True,
        keep_alive: bool = False,
        requests_log: Path | str | None = None,
        stream_style: StreamStyle | None = OPENAI_STYLE,
        reject_response_format: bool = False,
    ) -> None:
        self._queue: deque[ReplyLike] = deque(replies)
        self._reject_response_format = reject_response_format
        self._rejected = 0
        self._stream_style = stream_style
        self._port = port
        self._strict = strict
        self._keep_alive = keep_alive
        self._connections: set[socket.socket] = set()
        self._requests_log = Path(requests_log) if requests_log is not None else None
        self._lock = threading.Condition()
        self._requests: list[dict[str, Any]] = []
        self._headers: list[dict[str, str]] = []
        self._errors: list[str] = []
        self._ids = itertools.count(1)
        self._in_flight = 0
        self._peak_in_flight = 0
        self._stopping = threading.Event()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> FakeOpenAIServer:
        """Bind and serve in a daemon thread. Returns self."""
        if self._httpd is not None:
            return self
        handler = type("_BoundHandler", (_Handler,), {"fake": self})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", self._port), handler)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.01},
            name="fake-openai-server",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving; interrupts hanging replies. Safe to call twice."""
        if self._httpd is None:
            return
        self._stopping.set()
        self._httpd.shutdown()
        with self._lock:  # wake handler threads idling on kept-alive connections
            for connection in self._connections:
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join()
        self._httpd = None

    def __enter__(self) -> FakeOpenAIServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # --- script and inspection ---------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("the fake server is not running")
        return int(self._httpd.server_address[1])

    @property
    def base_url(self) -> str:
        """`http://127.0.0.1:PORT/v1`, what a client's base URL should be."""
        return f"http://127.0.0.1:{self.port}/v1"

    def enqueue(self, *replies: ReplyLike) -> None:
        """Append replies to the script."""
        with self._lock:
            self._queue.extend(replies)

    @property
    def requests(self) -> list[dict[str, Any]]:
        """The JSON bodies received so far, in order (a copy)."""
        with self._lock:
            return list(self._requests)

    @property
    def request_headers(self) -> list[dict[str, str]]:
        """The headers of each request (names lower-cased), in order (a copy)."""
        with self._lock:
            return [dict(h) for h in self._headers]

    @property
    def errors(self) -> list[str]:
        """What went wrong on the server side: script ran out, rule violations, bad paths."""
        with self._lock:
            return list(self._errors)

    @property
    def rejected(self) -> int:
        """Requests refused for their `response_format` (`reject_response_format`)."""
        with self._lock:
            return self._rejected

    @property
    def pending(self) -> int:
        """Replies not used yet."""
        with self._lock:
            return len(self._queue)

    @property
    def peak_in_flight(self) -> int:
        """The most chat-completion requests the server was answering at the same time."""
        with self._lock:
            return self._peak_in_flight

    def _flight(self, step: int) -> None:
        with self._lock:
            self._in_flight += step
            self._peak_in_flight = max(self._peak_in_flight, self._in_flight)

    def wait_for_requests(self, count: int, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Block until at least `count` requests arrived; TimeoutError otherwise."""
        with self._lock:
            if not self._lock.wait_for(lambda: len(self._requests) >= count, timeout):
                raise TimeoutError(
                    f"fake server got {len(self._requests)} request(s), expected {count}"
                )
            return list(self._requests)

    def assert_complete(self) -> None:
        """AssertionError if replies are left over or the server recorded errors."""
        with self._lock:
            problems = list(self._errors)
            if self._queue:
                problems.append(f"{len(self._queue)} scripted reply(ies) never requested")
        if problems:
            raise AssertionError("fake server: " + "; ".join(problems))

    # --- serving (called from handler threads) -----------------------------------------------

    def _record(self, body: dict[str, Any], headers: dict[str, str]) -> None:
        with self._lock:
            self._requests.append(body)
            self._headers.append(headers)
            self._lock.notify_all()
            if self._requests_log is not None:
                with self._requests_log.open("a", encoding="utf-8") as log:
                    log.write(json.dumps(body) + "\n")

    def _error(self, message: str) -> None:
        logger.warning("fake server: %s", message)
        with self._lock:
            self._errors.append(message)

    def _next_reply(self, request: dict[str, Any]) -> Reply:
        with self._lock:
            number = len(self._requests)
            scripted = self._queue.popleft() if self._queue else None
        if scripted is None:
            message = f"the script ran out of replies (request #{number} got none)"
            self._error(message)
            return http_error(500, _error_body(f"fake server: {message}", "server_error"))
        return self._finish(_to_reply(scripted, request), request)

    def _finish(self, reply: Reply, request: dict[str, Any]) -> Reply:
        if not reply.completion:
            return reply
        body = dict(reply.body)
        body["id"] = f"chatcmpl-fake-{next(self._ids)}"
        body["created"] = int(time.time())
        body["model"] = request.get("model") if isinstance(request.get("model"), str) else ""
        reply = replace(reply, body=body)
        style = reply.stream_style or self._stream_style
        if request.get("stream") is True and style is not None:
            return _stream(reply, style, request)
        return reply

    def _answer(self, path: str, request: Any, headers: dict[str, str]) -> Reply:
        if path.rstrip("/") != ENDPOINT:
            self._error(f"POST to unknown path {path}")
            return http_error(404, _error_body(f"unknown path {path}"))
        if not isinstance(request, dict):
            self._error("request body is not a JSON object")
            return http_error(400, _error_body("the body must be a JSON object"))
        self._record(request, headers)
        problem = _check_request(request) if self._strict else None
        if problem is not None:
            self._error(f"request #{len(self.requests)} rejected: {problem}")
            return http_error(400, _error_body(problem))
        if self._reject_response_format and "response_format" in request:
            with self._lock:
                self._rejected += 1
            body = _error_body(NO_RESPONSE_FORMAT)
            body["error"]["param"] = "response_format"
            return http_error(400, body)
        return self._next_reply(request)

    def _track(self, connection: socket.socket, *, active: bool) -> None:
        with self._lock:
            if active:
                self._connections.add(connection)
            else:
                self._connections.discard(connection)

    def _wait(self, seconds: float) -> bool:
        """Sleep up to `seconds`; True if the server is stopping."""
        return self._stopping.wait(seconds) if seconds > 0 else self._stopping.is_set()


def _check_request(request: dict[str, Any]) -> str | None:
    """OpenAI's validation of the message list, with its own error texts."""
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty array"
    if not isinstance(request.get("model"), str):
        return "'model' must be a string"
    open_ids: list[Any] = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"Invalid 'messages[{index}]': expected an object"
        if message.get("role") == "tool":
            if message.get("tool_call_id") not in open_ids:
                return (
                    "Invalid parameter: messages with role 'tool' must be a response to a "
                    "preceeding message with 'tool_calls'."
                )
            open_ids.remove(message["tool_call_id"])
            continue
        if open_ids:
            return _unanswered(open_ids)
        open_ids = [tc.get("id") for tc in message.get("tool_calls") or () if isinstance(tc, dict)]
    return _unanswered(open_ids) if open_ids else None


def _unanswered(ids: Sequence[str]) -> str:
    return (
        "An assistant message with 'tool_calls' must be followed by tool messages responding to "
        "each 'tool_call_id'. The following tool_call_ids did not have response messages: "
        + ", ".join(str(i) for i in ids)
    )


class _Handler(BaseHTTPRequestHandler):
    """Turns HTTP into FakeOpenAIServer calls; one connection per request unless keep_alive."""

    fake: FakeOpenAIServer
    protocol_version = "HTTP/1.1"
    timeout = 30  # a client that never sends its body cannot pin a thread forever

    def setup(self) -> None:
        super().setup()
        self.fake._track(self.connection, active=True)

    def finish(self) -> None:
        self.fake._track(self.connection, active=False)
        super().finish()

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        headers = {k.lower(): v for k, v in self.headers.items()}
        try:
            request: Any = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            request = None
        self.fake._flight(+1)
        try:
            reply = self.fake._answer(self.path, request, headers)
            if reply.echo_auth:
                reply = _with_credentials(reply, headers)
            self.close_connection = not self.fake._keep_alive
            if self.fake._wait(reply.delay) or reply.disconnect:
                self.close_connection = True
                return
            self._send(reply)
        finally:
            self.fake._flight(-1)

    def do_GET(self) -> None:
        self.close_connection = not self.fake._keep_alive
        if self.path.rstrip("/") == "/v1/models":
            models = {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}
            self._send(Reply(body=models))
        else:
            self._send(http_error(404, _error_body(f"unknown path {self.path}")))

    def _send(self, reply: Reply) -> None:
        if reply.body is not None:
            payload = json.dumps(reply.body).encode()
        else:
            payload = (reply.text or "").encode()
        try:
            self.send_response(reply.status)
            self.send_header("Content-Type", reply.content_type)
            if reply.chunked:
                self.send_header("Transfer-Encoding", "chunked")
            else:
                self.send_header("Content-Length", str(len(payload)))
            if self.close_connection:
                self.send_header("Connection", "close")
            for name, value in reply.headers.items():
                self.send_header(name, value)
            self.end_headers()
            if reply.events is not None:
                self._write_events(reply)
            else:
                self._write_body(payload, reply)
        except ConnectionError:  # broken pipe, reset: a client that stopped reading
            self.close_connection = True
            logger.debug("fake server: the client left before the answer")

    def _write_body(self, payload: bytes, reply: Reply, *, end: bool = True) -> None:
        """The body in pieces: one byte at a time when trickling, else 64 KiB (so a client
        that stops reading a big answer early is seen to stop), framed when chunked. `end`:
        write the terminating chunk."""
        step = 1 if reply.byte_interval > 0 else _CHUNK_SIZE
        for start in range(0, len(payload), step):
            piece = payload[start : start + step]
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece) if reply.chunked else piece)
            if reply.byte_interval > 0 and self.fake._wait(reply.byte_interval):
                self.close_connection = True  # the server is stopping: leave the body unfinished
                return
        if reply.chunked and end:
            self.wfile.write(b"0\r\n\r\n")

    def _write_events(self, reply: Reply) -> None:
        """Server-sent events, one chunk each, `event_interval` apart; trickled byte by byte
        when `byte_interval` is set. With `cut_after`, only that many events are sent and the
        body is never finished (no terminating chunk): the client sees the connection drop."""
        events = reply.events or ()
        if reply.cut_after is not None:
            events = events[: reply.cut_after]
        for event in events:
            if reply.byte_interval > 0:
                self._write_body(event, replace(reply, chunked=True), end=False)
            else:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
            if self.fake._stopping.is_set() or (
                reply.event_interval > 0 and self.fake._wait(reply.event_interval)
            ):
                self.close_connection = True  # the server is stopping: leave the body unfinished
                return
        if reply.cut_after is not None:
            self.close_connection = True
            return
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("fake server: %s", format % args)


# --- script mode -----------------------------------------------------------------------------


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tests.fakes.openai_server",
        description="Serve scripted OpenAI chat-completions replies on 127.0.0.1.",
    )
    parser.add_argument("--script", required=True, type=Path, help="JSON list of reply specs")
    parser.add_argument("--port", type=int, default=0, help="port (default: a free one)")
    parser.add_argument("--requests-log", type=Path, help="append each request as a JSON line")
    parser.add_argument(
        "--no-strict", action="store_true", help="do not enforce OpenAI's message-order rules"
    )
    parser.add_argument(
        "--reject-response-format",
        action="store_true",
        help="answer 400 to every request carrying response_format",
    )
    return parser.parse_args(argv)


def _load_script(path: Path) -> list[Reply]:
    specs = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(specs, list):
        raise ValueError(f"{path}: the script must be a JSON list of reply specs")
    return [reply_from_spec(spec) for spec in specs]


def main(argv: Sequence[str] | None = None) -> int:
    """Script mode: serve until SIGTERM/SIGINT (or SIGKILL). Exit 2 on a bad script."""
    args = _parse_args(argv)
    try:
        replies = _load_script(args.script)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        sys.stderr.write(f"error: cannot load {args.script}: {exc}\n")
        return 2
    done = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        done.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    server = FakeOpenAIServer(
        *replies,
        port=args.port,
        strict=not args.no_strict,
        requests_log=args.requests_log,
        reject_response_format=args.reject_response_format,
    )
    with server:
        sys.stdout.write(f"READY {server.base_url}\n")
        sys.stdout.flush()
        while not done.wait(0.5):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
