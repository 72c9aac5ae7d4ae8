"""An httpx transport that opens one connection per request and closes it with the response.

The model client keeps no connection alive between calls (a kept-alive connection belongs to
the event loop that opened it, and one client may serve several loops in turn). httpx's own
transport does that through httpcore's connection pool told to keep none, which costs the
same on the wire but not in CPU: the pool scans every connection it holds each time a request
starts or ends, so n concurrent runs pay O(n) per request (a quarter of the client's CPU at
500 concurrent runs). With nothing to reuse there is nothing to pool: this transport hands
each request its own `httpcore.AsyncHTTPConnection` and closes it when the response is
closed (or the request fails), as the pool would. The bytes sent are the same; timeouts
(connect, read, write: the request's `timeout` extension), TLS (the client's SSL context) and
httpx's exceptions are too.

Not used when the environment names a proxy (HTTP_PROXY, ALL_PROXY, ...): httpx mounts its
proxy transports only for a client built without a transport of its own.
"""

from __future__ import annotations

import ssl
import urllib.request
from collections.abc import AsyncIterable, AsyncIterator, Iterator
from contextlib import contextmanager

import httpcore
import httpx

# httpcore's exceptions as httpx raises them (httpx maps them the same way; its map is
# private). The most specific class wins: a ConnectTimeout is both a TimeoutException and a
# ConnectTimeout, and is raised as httpx.ConnectTimeout.
_EXCEPTIONS: dict[type[Exception], type[httpx.HTTPError]] = {
    httpcore.TimeoutException: httpx.TimeoutException,
    httpcore.ConnectTimeout: httpx.ConnectTimeout,
    httpcore.ReadTimeout: httpx.ReadTimeout,
    httpcore.WriteTimeout: httpx.WriteTimeout,
    httpcore.PoolTimeout: httpx.PoolTimeout,
    httpcore.NetworkError: httpx.NetworkError,
    httpcore.ConnectError: httpx.ConnectError,
    httpcore.ReadError: httpx.ReadError,
    httpcore.WriteError: httpx.WriteError,
    httpcore.ProxyError: httpx.ProxyError,
    httpcore.UnsupportedProtocol: httpx.UnsupportedProtocol,
    httpcore.ProtocolError: httpx.ProtocolError,
    httpcore.LocalProtocolError: httpx.LocalProtocolError,
    httpcore.RemoteProtocolError: httpx.RemoteProtocolError,
}


def proxies_in_environment() -> bool:
    """True when HTTP_PROXY, HTTPS_PROXY, ALL_PROXY (any case) or the like is set."""
    return bool(urllib.request.getproxies())


@contextmanager
def _as_httpx_errors() -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        mapped: type[httpx.HTTPError] | None = None
        for source, target in _EXCEPTIONS.items():
            if isinstance(exc, source) and (mapped is None or issubclass(target, mapped)):
                mapped = target
        if mapped is None:
            raise
        raise mapped(str(exc)) from exc


class OneShotTransport(httpx.AsyncBaseTransport):
    """One new HTTP/1.1 connection per request, closed with its response. asyncio only."""

    def __init__(self, ssl_context: ssl.SSLContext) -> None:
        self._ssl_context = ssl_context
        self._backend = httpcore.AnyIOBackend()
        self._open: set[httpcore.AsyncHTTPConnection] = set()
        """Connections whose response is not closed yet: `aclose` closes them."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        assert isinstance(request.stream, httpx.AsyncByteStream)
        url = request.url
        core_request = httpcore.Request(
            method=request.method,
            url=httpcore.URL(
                scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path
            ),
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        connection = httpcore.AsyncHTTPConnection(
            origin=core_request.url.origin,
            ssl_context=self._ssl_context,
            network_backend=self._backend,
        )
        self._open.add(connection)
        try:
            with _as_httpx_errors():
                response = await connection.handle_async_request(core_request)
        except BaseException:
            await self._close(connection)
            raise
        assert isinstance(response.stream, AsyncIterable)
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            stream=_ClosingStream(response.stream, connection, self),
            extensions=response.extensions,
        )

    async def _close(self, connection: httpcore.AsyncHTTPConnection) -> None:
        self._open.discard(connection)
        await connection.aclose()

    async def aclose(self) -> None:
        for connection in list(self._open):
            await self._close(connection)


class _ClosingStream(httpx.AsyncByteStream):
    """A response body that closes its connection when it is closed."""

    def __init__(
        self,
        stream: AsyncIterable[bytes],
        connection: httpcore.AsyncHTTPConnection,
        transport: OneShotTransport,
    ) -> None:
        self._stream = stream
        self._connection = connection
        self._transport = transport

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _as_httpx_errors():
            async for part in self._stream:
                yield part

    async def aclose(self) -> None:
        try:
            closer = getattr(self._stream, "aclose", None)
            if closer is not None:
                await closer()
        finally:
            await self._transport._close(self._connection)
