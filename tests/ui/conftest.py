"""Fixtures of the run viewer's tests: runs recorded for real (the fake OpenAI-compatible server
over loopback, real SQLite files), a viewer serving them on a free loopback port, and headless
Chromium (Debian's package, driven by playwright; tests that need it are marked `browser` and
skip without it, unless FSM_KERNEL_REQUIRE_BROWSER=1, as in CI, makes that a failure)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

import fsm_kernel
from fsm_kernel.kernel import RunResult
from fsm_kernel.store import open_store
from fsm_kernel.ui import Viewer, ViewerConfig, open_viewer
from tests.fakes.openai_server import FakeOpenAIServer

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="needs the dot program")
"""For tests of the drawn diagram (Debian package graphviz; CI installs it)."""
XSS = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
"""Markup a hostile model or tool might return: it must show as text and never run."""


def record(
    store: Path | str,
    *replies: Any,
    prompt: str = "What time is it?",
    workflow: str = "default",
    tools: Sequence[Callable[..., Any]] = (),
    **options: Any,
) -> RunResult:
    """One real run against the fake server answering `replies`, recorded in `store` (on a
    thread of its own: under playwright, this thread already runs an event loop)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(
            _record, store, replies, prompt=prompt, workflow=workflow, tools=tools, **options
        ).result()


def _record(
    store: Path | str,
    replies: Sequence[Any],
    *,
    prompt: str,
    workflow: str,
    tools: Sequence[Callable[..., Any]],
    **options: Any,
) -> RunResult:
    with FakeOpenAIServer() as server:
        server.enqueue(*replies)
        result = fsm_kernel.run(
            workflow,
            prompt,
            base_url=server.base_url,
            model="fake-model",
            max_retries=0,
            store=str(store),
            tools=tools,
            **options,
        )
        server.assert_complete()
    return result


def echo(text: str) -> str:
    """Repeat the text back.

    Args:
        text: what to repeat.
    """
    return text


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """An empty event store (the viewer opens an existing store only)."""
    path = tmp_path / "runs.db"
    open_store(path).close()
    return path


ViewerFactory = Callable[..., Viewer]


@pytest.fixture
def serve() -> Iterator[ViewerFactory]:
    """`serve(store=..., **ViewerConfig fields)`: a started viewer on a free loopback port."""
    started: list[Viewer] = []

    def start(**config: Any) -> Viewer:
        config.setdefault("port", 0)
        viewer = open_viewer(ViewerConfig(**config)).start()
        started.append(viewer)
        return viewer

    yield start
    for viewer in started:
        viewer.stop()


def base_url(viewer: Viewer) -> str:
    return f"http://127.0.0.1:{viewer.port}"


@pytest.fixture
def client_for() -> Iterator[Callable[[Viewer], httpx.Client]]:
    clients: list[httpx.Client] = []

    def make(viewer: Viewer) -> httpx.Client:
        client = httpx.Client(base_url=base_url(viewer), timeout=30)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def _unavailable(why: str) -> None:
    if os.environ.get("FSM_KERNEL_REQUIRE_BROWSER") == "1":
        pytest.fail(f"browser tests must run here: {why}")
    pytest.skip(why)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Chromium for one module's tests. Not longer: playwright's sync API runs an event loop on
    this thread while it is open, and other tests call asyncio.run() here."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("playwright is not installed (pip install playwright)")
    if not Path(CHROMIUM).exists():
        _unavailable("chromium is not installed (apt-get install chromium)")
    with sync_playwright() as playwright:
        # As root (CI), Chromium's sandbox cannot start; the pages are our own.
        args = ["--no-sandbox"] if os.geteuid() == 0 else []
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=args)
        yield launched
        launched.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh browser page; any JavaScript error on it fails the test."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    opened = context.new_page()
    errors: list[str] = []
    opened.on("pageerror", lambda exc: errors.append(str(exc)))
    opened.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    opened.set_default_timeout(20_000)
    yield opened
    context.close()
    assert errors == []
