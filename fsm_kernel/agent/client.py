"""HttpChatModel: the httpx client for OpenAI-compatible `/chat/completions` servers. Owns
timeouts, retries with backoff, and the translation of every httpx failure and error status into
fsm_kernel.errors types; nothing from httpx escapes this module. Imports protocol, config,
errors and agent.wire only.
"""

from __future__ import annotations

import asyncio
import email.utils
import errno
import functools
import json
import logging
import random as _random
import ssl
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

import httpx

from fsm_kernel.agent.wire import completion_from_wire, messages_to_wire, tools_to_wire
from fsm_kernel.config import AgentSettings
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
from fsm_kernel.protocol import Completion, Message, Tool

__all__ = ["HttpChatModel"]

logger = logging.getLogger(__name__)

INITIAL_RETRY_DELAY = 0.5
MAX_RETRY_DELAY = 8.0
MAX_RETRY_AFTER = 60.0
"""A server-sent Retry-After longer than this is cut to it."""
_MESSAGE_LIMIT = 300
_BODY_LIMIT = 2000
_RETRY_STATUSES = frozenset({408, 409, 429})
_CONNECT_HINT = "is Ollama (or your model server) running? set --base-url or FSM_KERNEL_BASE_URL"
# Servers that cannot do tool calling say so with a 400 (Ollama, vLLM) or a 500 (old llama.cpp);
# retrying never helps (llm-servers.md §5.11).
_NO_TOOLS_MARKERS = (
    "does not support tools",
    "tools param requires --jinja",
    "--enable-auto-tool-choice",
    "support tool use",
    "unsupported param: tools",
)

Sleep = Callable[[float], Awaitable[None]]


class HttpChatModel:
    """A ChatModel that POSTs to `{base_url}/chat/completions`.

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
        self._settings = settings
        self._base_url = settings.base_url.rstrip("/")
        self._url = _endpoint(self._base_url)
        self._sleep = sleep
        self._random = random
        self._client = httpx.AsyncClient(
            headers=_headers(settings.api_key),
            timeout=_timeout(settings),
            transport=transport,
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

    async def complete(self, messages: Sequence[Message], tools: Sequence[Tool]) -> Completion:
        """Ask the model once, retrying transient failures.

        Raises:
            AgentError: the subclass says why no usable answer could be had.
        """
        payload = self._payload(messages, tools)
        retries = max(self._settings.max_retries, 0)
        attempt = 0
        while True:
            try:
                return await self._attempt(payload, attempt)
            except AgentError as exc:
                if not exc.retryable or attempt >= retries:
                    raise
                delay = self._retry_delay(exc, attempt)
                attempt += 1
                logger.warning("%s; retry %d of %d in %.2fs", exc.message, attempt, retries, delay)
                await self._sleep(delay)

    def _payload(self, messages: Sequence[Message], tools: Sequence[Tool]) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "model": self._settings.model,
            "messages": messages_to_wire(messages),
        }
        if tools:
            payload["tools"] = tools_to_wire(tools)
        if self._settings.temperature is not None:
            payload["temperature"] = self._settings.temperature
        return payload

    def _retry_delay(self, exc: AgentError, attempt: int) -> float:
        """The server's Retry-After when it sent one, else exponential backoff with jitter
        (openai-python's constants: 0.5 s, doubling, capped at 8 s, jitter shortens by <= 25%)."""
        retry_after = exc.retry_after if isinstance(exc, AgentHTTPError) else None
        if retry_after is not None and retry_after > 0:
            return min(retry_after, MAX_RETRY_AFTER)
        backoff = min(INITIAL_RETRY_DELAY * 2**attempt, MAX_RETRY_DELAY)
        return backoff * (1 - 0.25 * self._random())

    async def _attempt(self, payload: dict[str, Any], attempt: int) -> Completion:
        logger.debug(
            "POST %s model=%s messages=%d tools=%d attempt=%d",
            self._url,
            payload["model"],
            len(payload["messages"]),
            len(payload.get("tools", ())),
            attempt + 1,
        )
        response = await self._post(payload)
        logger.debug("%s answered %d", self._url, response.status_code)
        if not 200 <= response.status_code < 300:
            raise self._status_error(response)
        return self._parse(response)

    async def _post(self, payload: dict[str, Any]) -> httpx.Response:
        try:
            return await self._client.post(self._url, json=payload)
        except httpx.TimeoutException as exc:
            raise self._timeout_error(exc) from exc
        except httpx.TransportError as exc:
            reason = _transport_reason(exc)
            raise AgentConnectionError(
                f"cannot reach model server at {self._base_url}: {reason} — {_CONNECT_HINT}",
                base_url=self._base_url,
            ) from exc
        except httpx.HTTPError as exc:  # TooManyRedirects, DecodingError, ...
            raise AgentResponseError(
                f"model server at {self._base_url} sent an unusable response: {exc}",
                base_url=self._base_url,
            ) from exc

    def _timeout_error(self, exc: httpx.TimeoutException) -> AgentTimeoutError:
        if isinstance(exc, httpx.ConnectTimeout):
            seconds = self._settings.connect_timeout
            message = (
                f"cannot reach model server at {self._base_url}: no connection within "
                f"{seconds:g}s — {_CONNECT_HINT}"
            )
        else:
            message = (
                f"model server at {self._base_url} timed out after "
                f"{self._settings.request_timeout:g}s (set FSM_KERNEL_REQUEST_TIMEOUT to wait "
                "longer)"
            )
        return AgentTimeoutError(message, base_url=self._base_url)

    def _parse(self, response: httpx.Response) -> Completion:
        try:
            body = json.loads(response.content)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise AgentResponseError(
                f"model server at {self._base_url} sent a response that is not JSON: "
                f"{_shorten(response.text, 120)!r}",
                base_url=self._base_url,
            ) from exc
        try:
            return completion_from_wire(body)
        except AgentResponseError as exc:
            raise AgentResponseError(
                f"model server at {self._base_url} sent an unusable response: {exc.message}",
                base_url=self._base_url,
            ) from exc

    def _status_error(self, response: httpx.Response) -> AgentError:
        status = response.status_code
        detail = _ErrorDetail.from_response(response)
        if not 400 <= status < 600:
            return AgentResponseError(
                f"model server at {self._base_url} answered {status}: {detail.message}",
                base_url=self._base_url,
            )
        kind, message = self._describe_status(status, detail)
        return kind(
            message,
            base_url=self._base_url,
            status_code=status,
            body=_shorten(response.text, _BODY_LIMIT),
            retry_after=_retry_after(response.headers, datetime.now(UTC)),
        )

    def _describe_status(
        self, status: int, detail: _ErrorDetail
    ) -> tuple[type[AgentHTTPError], str]:
        where = f"model server at {self._base_url}"
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


class _ErrorDetail:
    """The message and code of an error body in any of the shapes servers use: OpenAI
    `{"error": {...}}`, Ollama `{"error": "..."}`, old vLLM flat `{"object": "error", ...}`,
    or plain text."""

    def __init__(self, message: str, code: str) -> None:
        self.message = message
        self.code = code

    @classmethod
    def from_response(cls, response: httpx.Response) -> _ErrorDetail:
        try:
            body: Any = json.loads(response.content)
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = response.text
        message, code = _message_and_code(body)
        return cls(
            _shorten(message, _MESSAGE_LIMIT) or response.reason_phrase or "no message", code
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


def _endpoint(base_url: str) -> str:
    try:
        url = httpx.URL(base_url)
    except httpx.InvalidURL as exc:
        raise ConfigError(f"invalid model server URL {base_url!r}: {exc}") from exc
    if url.scheme not in ("http", "https") or not url.host:
        raise ConfigError(
            f"invalid model server URL {base_url!r}: it must start with http:// or https:// "
            "(e.g. http://localhost:11434/v1)"
        )
    return f"{base_url}/chat/completions"


def _headers(api_key: str | None) -> dict[str, str]:
    headers = {"Accept": "application/json", "User-Agent": "fsm-kernel"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    # httpx would build (and load the CA bundle into) a new context per client: ~0.1 s each.
    return httpx.create_ssl_context()


def _timeout(settings: AgentSettings) -> httpx.Timeout:
    # request_timeout <= 0 means "no limit": local servers can spend minutes loading a model.
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
    return _shorten(str(exc), 120) or type(exc).__name__


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
