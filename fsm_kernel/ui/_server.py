"""Putting the viewer on the network: open the stores (the SQLite event store read-only), build
the app, bind the socket, serve with uvicorn (in the foreground for the CLI, or on a thread for
tests and scripts).
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn

from fsm_kernel.config import default_store_location
from fsm_kernel.errors import ConfigError
from fsm_kernel.redact import register_secret
from fsm_kernel.store import AnyEventStore, open_store
from fsm_kernel.ui._app import create_app
from fsm_kernel.ui._dispatches import DispatchReader
from fsm_kernel.ui._reader import UiReader
from fsm_kernel.ui._security import GuardSettings, is_loopback

__all__ = ["MIN_TOKEN_LENGTH", "Viewer", "ViewerConfig", "new_token", "open_viewer"]

MIN_TOKEN_LENGTH = 16
_KEY_VARIABLES = ("FSM_KERNEL_API_KEY", "OPENAI_API_KEY")


def new_token() -> str:
    """A random access token (hex: nothing in it looks like a credential to the redactor)."""
    return secrets.token_hex(20)


@dataclass(frozen=True, kw_only=True)
class ViewerConfig:
    """What `fsm-kernel ui` was asked for."""

    store: str | None = None
    """The event store (default: the scheduler config's, else FSM_KERNEL_STORE or
    .fsm-kernel/runs.db)."""
    scheduler: str | None = None
    """A scheduler config file, for the Scheduler page and the run-to-dispatch links."""
    host: str = "127.0.0.1"
    port: int = 8765
    """0: any free port (the Viewer's url says which)."""
    token: str | None = None
    """Required on every request when given; a non-loopback host must have one."""


class Viewer:
    """The viewer bound to its socket, ready to serve."""

    def __init__(self, app: Any, sock: socket.socket, config: ViewerConfig, store: str) -> None:
        self.app = app
        self.config = config
        self.store_location = store
        self._sock = sock
        self._server = uvicorn.Server(
            uvicorn.Config(
                app,
                log_config=None,  # fsm-kernel's logging stays as the CLI set it up
                access_log=False,  # a ?token= URL must not reach a log
                log_level="warning",
                server_header=False,
                lifespan="on",
                timeout_graceful_shutdown=3,
            )
        )
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    @property
    def url(self) -> str:
        """The address to open (with the token, when there is one)."""
        host = self.config.host
        shown = f"[{host}]" if ":" in host else host
        query = f"?token={self.config.token}" if self.config.token else ""
        return f"http://{shown}:{self.port}/{query}"

    def serve(self) -> None:
        """Serve until Ctrl-C (SIGINT) or SIGTERM, then stop gracefully."""
        self._server.run(sockets=[self._sock])

    def start(self) -> Viewer:
        """Serve on a thread of its own; returns once the server answers."""
        self._thread = threading.Thread(target=self.serve, name="fsm-kernel-ui", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise ConfigError("the viewer did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop a viewer started with start() (waits for it)."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._sock.close()

    def __enter__(self) -> Viewer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def open_viewer(config: ViewerConfig) -> Viewer:
    """Open the stores, build the app and bind its socket (nothing is served yet).

    Raises:
        ConfigError: a non-loopback host without a token, a short token, a socket that cannot
            be bound, a scheduler config that does not load.
        StoreError: the event store cannot be opened.
    """
    if config.token is not None and len(config.token) < MIN_TOKEN_LENGTH:
        raise ConfigError(f"the token must be at least {MIN_TOKEN_LENGTH} characters long")
    if config.token is None and not is_loopback(config.host):
        raise ConfigError(
            f"--host {config.host} is not a loopback address: the viewer needs a token there "
            "(--token, or let `fsm-kernel ui` generate one)"
        )
    for name in _KEY_VARIABLES:  # a key in the environment is redacted even in old logs
        register_secret(os.environ.get(name))
    dispatches = None
    store = config.store
    roots = [Path.cwd()]  # the folders whose workflow files runs may be shown with
    if config.scheduler is not None:
        from fsm_kernel.scheduler import load_scheduler_config

        path = Path(config.scheduler)
        scheduler = load_scheduler_config(path)
        dispatches = DispatchReader(scheduler, path)
        store = store or scheduler.store
        roots.append(path.resolve().parent)
    store = store or default_store_location()
    events = open_event_store(store)
    try:
        sock = _listen(config.host, config.port)
    except BaseException:
        events.close()
        raise
    guard = GuardSettings(
        token=config.token,
        loopback_only=is_loopback(config.host),
        cookie_suffix=str(sock.getsockname()[1]),
        secret=secrets.token_bytes(32),
    )
    app = create_app(UiReader(events, dispatches, location=store, roots=roots), guard)
    return Viewer(app, sock, config, store)


def open_event_store(location: str) -> AnyEventStore:
    """The event store for reading (see open_store's `read_only`): a viewer started on a
    mistyped location says so, rather than serve an empty store it created."""
    return open_store(location, read_only=True)


def _listen(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        hint = "; choose another --port" if exc.errno in (98, 48) else ""
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}{hint}") from None
    return sock
