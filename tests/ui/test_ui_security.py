"""The viewer's guard: the access token on every request, the Host check on loopback, CSRF on
state-changing POSTs (the dispatch cancel form is the one today), security headers, and
unexpected errors as one log line and a page, never a traceback."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from fsm_kernel.errors import ConfigError
from fsm_kernel.scheduler import DispatchStatus, SqliteDispatchQueue
from fsm_kernel.ui import Viewer, ViewerConfig, open_viewer
from fsm_kernel.ui._reader import UiReader
from tests.fakes.openai_server import text_reply
from tests.ui.conftest import record

TOKEN = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def viewers() -> Iterator[list[Viewer]]:
    opened: list[Viewer] = []
    yield opened
    for viewer in opened:
        viewer.stop()


def client(viewers: list[Viewer], host: str = "127.0.0.1", **config: object) -> TestClient:
    """The viewer's app in process (its socket bound, never served), as `host` sees it."""
    viewer = open_viewer(ViewerConfig(port=0, **config))  # type: ignore[arg-type]
    viewers.append(viewer)
    return TestClient(viewer.app, base_url=f"http://{host}:{viewer.port}", follow_redirects=False)


def test_a_token_is_needed_on_every_request_and_leaves_the_url(
    store: Path, viewers: list[Viewer]
) -> None:
    record(store, text_reply("hi"), workflow="single_shot")
    with client(viewers, store=str(store), token=TOKEN) as browser:
        for path in ("/", "/runs/table", "/static/ui.css", "/workflows", "/nowhere"):
            refused = browser.get(path)
            assert refused.status_code == 401, path
            assert "data-run-id" not in refused.text
        assert browser.get("/?token=not-the-token-at-all").status_code == 401

        entered = browser.get(f"/runs/table?status=final_answer&token={TOKEN}")
        assert entered.status_code == 303
        assert entered.headers["location"] == "/runs/table?status=final_answer"
        cookie = entered.headers["set-cookie"]
        assert re.fullmatch(rf"fsmk_token_\d+={TOKEN}; Path=/; HttpOnly; SameSite=Strict", cookie)
        page = browser.get("/")  # the cookie from now on
        assert page.status_code == 200
        assert "data-run-id" in page.text
        assert TOKEN not in page.text
    with client(viewers, store=str(store), token=TOKEN) as other:
        bearer = other.get("/", headers={"Authorization": f"Bearer {TOKEN}"})
        assert bearer.status_code == 200


def test_a_non_loopback_address_needs_a_token_of_some_length(store: Path) -> None:
    with pytest.raises(ConfigError, match="not a loopback address: the viewer needs a token"):
        open_viewer(ViewerConfig(store=str(store), host="0.0.0.0", port=0))
    with pytest.raises(ConfigError, match="at least 16 characters"):
        open_viewer(ViewerConfig(store=str(store), port=0, token="short"))


def test_on_loopback_other_host_names_are_refused(store: Path, viewers: list[Viewer]) -> None:
    """A page whose DNS name was rebound to 127.0.0.1 still says its own name in Host."""
    with client(viewers, store=str(store)) as browser:
        assert browser.get("/").status_code == 200
        for host in ("evil.example", "evil.example:8765", "10.0.0.1"):
            refused = browser.get("/", headers={"host": host})
            assert refused.status_code == 421, host
        for host in ("localhost:9", "[::1]:8765", "127.0.0.1"):
            assert browser.get("/", headers={"host": host}).status_code == 200, host


def test_every_answer_carries_the_security_headers(store: Path, viewers: list[Viewer]) -> None:
    with client(viewers, store=str(store), token=TOKEN) as browser:
        answers = [browser.get("/"), browser.get(f"/?token={TOKEN}"), browser.get("/"),
                   browser.get("/nowhere"), browser.get("/static/ui.js")]  # fmt: skip
    for answer in answers:
        csp = answer.headers["content-security-policy"]
        assert "script-src 'self';" in csp
        assert "default-src 'none'" in csp
        assert "unsafe-inline" not in csp
        assert answer.headers["x-content-type-options"] == "nosniff"
        assert answer.headers["x-frame-options"] == "DENY"
        assert answer.headers["referrer-policy"] == "same-origin"
    assert [a.status_code for a in answers] == [401, 303, 200, 404, 200]


@pytest.fixture
def pending(store: Path, tmp_path: Path) -> tuple[Path, str]:
    """A scheduler config whose queue holds one pending dispatch."""
    config = tmp_path / "scheduler.yaml"
    config.write_text(
        f"kernel_id: k1\nstore: {store}\nagents:\n"
        "  - {agent_id: writer, workflow: single_shot, prompt: write}\n"
    )
    queue = SqliteDispatchQueue(store)
    queue.ensure_schema()
    dispatch = queue.enqueue("k1", "writer", "write it", 0, "k1:writer:manual:1")
    queue.close()
    assert dispatch is not None
    return config, dispatch.dispatch_id


def status_of(store: Path, dispatch_id: str) -> DispatchStatus:
    queue = SqliteDispatchQueue(store)
    try:
        found = queue.get(dispatch_id)
        assert found is not None
        return found.status
    finally:
        queue.close()


def csrf_token(html: str) -> str:
    found = re.search(r'name="csrf_token" value="([0-9a-f]{64})"', html)
    assert found, "the page has no CSRF field"
    return found.group(1)


def test_a_post_needs_the_csrf_token_of_its_own_browser(
    store: Path, viewers: list[Viewer], pending: tuple[Path, str]
) -> None:
    config, dispatch_id = pending
    action = f"/scheduler/dispatches/{dispatch_id}/cancel"
    mine, theirs = client(viewers, scheduler=str(config)), client(viewers, scheduler=str(config))
    with mine, theirs:
        token = csrf_token(mine.get("/scheduler").text)
        their_token = csrf_token(theirs.get("/scheduler").text)
        assert token != their_token  # signed per browser nonce

        attempts = {
            "no token": mine.post(action, data={"reason": "none given"}),
            "another browser's token": mine.post(action, data={"csrf_token": their_token}),
            "another origin": mine.post(action, data={"csrf_token": token},
                                        headers={"origin": "http://evil.example"}),
            "a cross-site fetch": mine.post(action, data={"csrf_token": token},
                                            headers={"sec-fetch-site": "cross-site"}),
            "no cookie": TestClient(mine.app, base_url=str(mine.base_url)).post(
                action, data={"csrf_token": token}),
        }  # fmt: skip
        for why, answer in attempts.items():
            assert answer.status_code == 403, why
            assert "CSRF" in answer.text or "refused" in answer.text, why
        json_post = mine.post(action, json={"csrf_token": token})
        assert json_post.status_code == 415
        huge = mine.post(action, data={"csrf_token": token, "pad": "x" * 70_000})
        assert huge.status_code == 413
        assert status_of(store, dispatch_id) is DispatchStatus.PENDING

        done = mine.post(action, data={"csrf_token": token},
                         headers={"origin": str(mine.base_url).rstrip("/")})  # fmt: skip
        assert (done.status_code, done.headers["location"]) == (303, f"/scheduler#d-{dispatch_id}")
        assert status_of(store, dispatch_id) is DispatchStatus.CANCELLED
        again = mine.post(action, data={"csrf_token": token})
        assert again.status_code == 409
        assert "has already finished: cancelled" in again.text
        unknown = mine.post("/scheduler/dispatches/nope/cancel", data={"csrf_token": token})
        assert unknown.status_code == 404


def test_a_post_without_the_access_token_is_refused_before_anything_else(
    store: Path, viewers: list[Viewer], pending: tuple[Path, str]
) -> None:
    config, dispatch_id = pending
    with client(viewers, scheduler=str(config), token=TOKEN) as browser:
        browser.get(f"/scheduler?token={TOKEN}")
        token = csrf_token(browser.get("/scheduler").text)
        browser.cookies.clear()
        refused = browser.post(f"/scheduler/dispatches/{dispatch_id}/cancel",
                               data={"csrf_token": token})  # fmt: skip
        assert refused.status_code == 401
    assert status_of(store, dispatch_id) is DispatchStatus.PENDING


def test_an_unexpected_error_is_one_log_line_and_a_page(
    store: Path,
    viewers: list[Viewer],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    run = record(store, text_reply("hi"), workflow="single_shot")

    def broken(self: UiReader, run_id: str) -> None:
        raise RuntimeError("the disk <b>melted</b>")

    monkeypatch.setattr(UiReader, "run", broken)
    caplog.set_level(logging.WARNING, logger="fsm_kernel.ui")
    with client(viewers, store=str(store)) as browser:
        answer = browser.get(f"/runs/{run.run_id}")
    assert answer.status_code == 500
    assert "internal error" in answer.text
    assert "<b>melted" not in answer.text
    records = [r for r in caplog.records if r.name.startswith("fsm_kernel.ui")]
    assert [r.getMessage() for r in records] == [
        f"GET /runs/{run.run_id} failed: RuntimeError: the disk <b>melted</b>"
    ]
    assert records[0].exc_info is None
