"""What stands between the run viewer and a browser: the access token, the Host check, CSRF
tokens for state-changing POSTs, security headers, and one-line handling of unexpected errors.

`Guard` is a plain ASGI middleware wrapped around the whole app; `Csrf` signs and checks the
token every POST form carries (see `post_action` in _app.py for how a POST route uses it).
"""

from __future__ import annotations

import hashlib
import hmac
import html
import ipaddress
import logging
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qsl, urlencode

__all__ = [
    "CSRF_FIELD",
    "MAX_FORM_BYTES",
    "Csrf",
    "CsrfError",
    "Guard",
    "GuardSettings",
    "is_loopback",
]

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

CSRF_FIELD = "csrf_token"
"""The form field every POST carries (see Csrf)."""
MAX_FORM_BYTES = 64 * 1024
"""A POST body larger than this is refused (413) before it is parsed."""
TOKEN_PARAM = "token"

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
"""No inline script or style anywhere, so content from runs cannot run even if some escaping
were missed; nothing loads from elsewhere; no framing."""

_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"same-origin"),  # no-referrer makes a form post say Origin: null
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"cross-origin-resource-policy", b"same-origin"),
    (b"cache-control", b"no-store"),
)

_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (127.0.0.0/8, ::1)."""
    name = host.strip("[]").lower()
    if name in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, kw_only=True)
class GuardSettings:
    """How the guard treats requests."""

    token: str | None
    """Every request must carry it (query `?token=`, cookie or `Authorization: Bearer`);
    None: no token (allowed only on a loopback address)."""
    loopback_only: bool
    """Refuse requests whose Host header names anything but a loopback address (a web page
    that rebinds its DNS name to 127.0.0.1 cannot read the viewer)."""
    cookie_suffix: str
    """Cookies are per host, not per port: the suffix keeps two viewers apart."""
    secret: bytes
    """Signs the CSRF tokens (random per process)."""


class CsrfError(Exception):
    """A POST without a valid CSRF token, or from another origin."""


class Csrf:
    """Signed double-submit CSRF tokens: each browser gets a random nonce in an HttpOnly,
    SameSite=Strict cookie; the token a form carries is an HMAC of that nonce under a secret
    of this process. A page of another site can neither read the token (same-origin policy)
    nor send the cookie (SameSite), and a token is worthless with another nonce."""

    def __init__(self, secret: bytes, cookie: str) -> None:
        self._secret = secret
        self.cookie = cookie

    def token(self, nonce: str) -> str:
        """The token forms carry for the browser holding `nonce`."""
        return hmac.new(self._secret, nonce.encode(), hashlib.sha256).hexdigest()

    def check(self, scope: Scope, fields: dict[str, str]) -> None:
        """Raise CsrfError unless the form's token matches the request's nonce cookie and the
        request comes from this origin (Origin, when the browser sends it)."""
        nonce = cookies_of(scope).get(self.cookie)
        given = fields.get(CSRF_FIELD, "")
        if not nonce or not given or not hmac.compare_digest(given, self.token(nonce)):
            raise CsrfError("missing or invalid CSRF token: reload the page and try again")
        origin = header(scope, b"origin")
        if origin is not None and origin != own_origin(scope):
            raise CsrfError(f"cross-origin request from {origin!r} refused")
        if header(scope, b"sec-fetch-site") not in (None, "same-origin", "none"):
            raise CsrfError("cross-site request refused")


def parse_form(body: bytes) -> dict[str, str]:
    """An application/x-www-form-urlencoded body as {name: value} (the last value wins)."""
    text = body.decode("utf-8", "replace")
    return dict(parse_qsl(text, keep_blank_values=True, max_num_fields=100))


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value).decode("latin-1")
    return None


def cookies_of(scope: Scope) -> dict[str, str]:
    raw = header(scope, b"cookie")
    if not raw:
        return {}
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(raw)
    except Exception:  # a malformed Cookie header is no cookie, not an error page
        return {}
    return {key: morsel.value for key, morsel in jar.items()}


def own_origin(scope: Scope) -> str:
    return f"{scope.get('scheme', 'http')}://{header(scope, b'host') or ''}"


def _cookie(name: str, value: str) -> bytes:
    return f"{name}={value}; Path=/; HttpOnly; SameSite=Strict".encode()


class Guard:
    """The ASGI middleware every request goes through (see the module docstring)."""

    def __init__(self, app: ASGIApp, settings: GuardSettings) -> None:
        self.app = app
        self.settings = settings
        self.token_cookie = f"fsmk_token_{settings.cookie_suffix}"
        self.csrf = Csrf(settings.secret, f"fsmk_csrf_{settings.cookie_suffix}")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await _plain(send, *refusal)
            return
        if self._token_in_query(scope):
            await self._drop_token_from_url(scope, send)
            return
        cookies = cookies_of(scope)
        extra: list[tuple[bytes, bytes]] = []
        nonce = cookies.get(self.csrf.cookie)
        if not nonce:
            nonce = secrets.token_hex(16)
            extra.append((b"set-cookie", _cookie(self.csrf.cookie, nonce)))
        scope.setdefault("state", {})["csrf_token"] = self.csrf.token(nonce)
        scope["state"]["csrf"] = self.csrf
        await self._call_app(scope, receive, send, extra)

    def _refusal(self, scope: Scope) -> tuple[int, str] | None:
        if self.settings.loopback_only and not is_loopback(_host_name(scope)):
            return 421, "this viewer answers on a loopback address only (check the URL)"
        if self.settings.token is not None and not self._has_token(scope):
            return 401, (
                "a token is required: open the URL `fsm-kernel ui` printed (with ?token=...)"
            )
        return None

    def _has_token(self, scope: Scope) -> bool:
        expected = self.settings.token
        assert expected is not None
        candidates = [cookies_of(scope).get(self.token_cookie), _query_token(scope)]
        auth = header(scope, b"authorization")
        if auth and auth.lower().startswith("bearer "):
            candidates.append(auth[7:].strip())
        return any(
            c is not None and hmac.compare_digest(c.encode(), expected.encode()) for c in candidates
        )

    def _token_in_query(self, scope: Scope) -> bool:
        """A GET with ?token= on a viewer that has a token (one without ignores the parameter:
        a stale bookmark still opens the page)."""
        if self.settings.token is None:
            return False
        return scope.get("method") == "GET" and _query_token(scope) is not None

    async def _drop_token_from_url(self, scope: Scope, send: Send) -> None:
        """A valid ?token= becomes a cookie, and the browser goes to the same URL without it
        (so the token stays out of the history and the address bar)."""
        assert self.settings.token is not None
        query = [
            (k, v)
            for k, v in parse_qsl(scope.get("query_string", b"").decode("latin-1"))
            if k != TOKEN_PARAM
        ]
        location = _same_site_path(scope.get("path", "/")) + (
            f"?{urlencode(query)}" if query else ""
        )
        await send(
            {
                "type": "http.response.start",
                "status": 303,
                "headers": [
                    (b"location", location.encode("latin-1", "replace")),
                    (b"set-cookie", _cookie(self.token_cookie, self.settings.token)),
                    *_HEADERS,
                ],
            }
        )
        await send({"type": "http.response.body", "body": b""})

    async def _call_app(
        self, scope: Scope, receive: Receive, send: Send, extra: list[tuple[bytes, bytes]]
    ) -> None:
        started = False

        async def send_with_headers(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", ()), *_HEADERS, *extra]
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        except Exception as exc:  # one line in the log, a page for the browser; no traceback
            logger.warning("%s %s failed: %s: %s", scope.get("method"), scope.get("path"),
                           type(exc).__name__, exc)  # fmt: skip
            logger.debug("traceback", exc_info=True)
            if not started:
                await _plain(send, 500, "internal error (the viewer's log has one line about it)")


def _same_site_path(path: str) -> str:
    """`path` as a Location that stays on this site: `//host/x` and `/\\host/x` are URLs of
    another host to a browser (an open redirect), so leading slashes and backslashes become
    one slash."""
    return "/" + path.lstrip("/\\")


def _host_name(scope: Scope) -> str:
    """The Host header without its port ("[::1]:8765" -> "::1")."""
    host = (header(scope, b"host") or "").strip()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if ":" in host else host


def _query_token(scope: Scope) -> str | None:
    query: bytes = scope.get("query_string", b"")
    for key, value in parse_qsl(query.decode("latin-1")):
        if key == TOKEN_PARAM:
            return value
    return None


async def _plain(send: Send, status: int, text: str) -> None:
    body = (
        f"<!doctype html><meta charset=utf-8><title>fsm-kernel</title><p>{html.escape(text)}</p>"
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"text/html; charset=utf-8"), *_HEADERS],
        }
    )
    await send({"type": "http.response.body", "body": body})
