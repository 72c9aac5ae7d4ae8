"""The run viewer against a hostile tester, over real HTTP (issue 26, section 3): run ids shown
so the CLI accepts them, a stray ?token=, an open redirect, workflow files a tampered store
names, answers sent three at a time or failing late, and one slow page holding up the rest."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from fsm_kernel.protocol import Event, EventType
from fsm_kernel.store import SqliteEventStore
from fsm_kernel.ui import Viewer
from fsm_kernel.ui import _answers as answers_module
from fsm_kernel.ui._reader import UiReader
from tests.fakes.openai_server import FakeOpenAIServer, text_reply
from tests.ui.conftest import ViewerFactory
from tests.ui.html import table_rows, text_of
from tests.ui.test_ui_answer import csrf, events, suspend, wait_until

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "0123456789abcdef0123"
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
SECRET = "hunter2-the-database-password"
Clients = Callable[[Viewer], httpx.Client]


def started(run_id: str, minute: int, **data: Any) -> Event:
    data = {"workflow": "w", "goal": f"goal of {run_id}", **data}
    ts = T0 + timedelta(minutes=minute)
    return Event(run_id=run_id, seq=1, type=EventType.RUN_STARTED, timestamp=ts, data=data)


def ended(run_id: str, minute: int) -> Event:
    ts = T0 + timedelta(minutes=minute, seconds=1)
    data = {"reason": "final_answer", "answer": "ok"}
    return Event(run_id=run_id, seq=2, type=EventType.RUN_TERMINATED, timestamp=ts, data=data)


def shortest_unique(run_id: str, others: list[str]) -> str:
    """The reference: the fewest characters (8 at least, not ending in '-') no other id has."""
    for n in range(8, len(run_id) + 1):
        if run_id[n - 1] != "-" and not any(o.startswith(run_id[:n]) for o in others):
            return run_id[:n]
    return run_id


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


# -- run ids -------------------------------------------------------------------------------------


def test_run_ids_are_shown_as_their_shortest_unique_prefix_which_the_cli_accepts(
    store: Path, serve: ViewerFactory, client_for: Clients
) -> None:
    ids = [  # UUIDv7s of one minute share 8 characters, of one millisecond 13 and more
        "01a2194d-16e0-7000-8000-000000000001",
        "01a2194d-16e0-7000-8000-000000000002",
        "01a2194d-16e1-7abc-8000-000000000003",
        "01a2194d-9999-7000-8000-000000000004",
        "01a2194e-0000-7000-8000-000000000005",
        "01b00000-0000-7000-8000-000000000006",
    ]
    with SqliteEventStore(store) as log:
        for minute, run_id in enumerate(ids):
            workflow = "other" if run_id.endswith("2") else "w"  # off the filtered page
            log.append([started(run_id, minute, workflow=workflow), ended(run_id, minute)])
    client = client_for(serve(store=str(store)))

    shown = {run_id: cells[0] for run_id, cells in table_rows(client.get("/").text)}
    filtered = {r: c[0] for r, c in table_rows(client.get("/?workflow=w").text)}

    expected = {r: shortest_unique(r, [o for o in ids if o != r]) for r in ids}
    assert shown == expected
    assert shown["01b00000-0000-7000-8000-000000000006"] == "01b00000"
    assert shown["01a2194d-16e0-7000-8000-000000000001"] == ids[0]  # only the end differs
    assert filtered == {r: expected[r] for r in ids if not r.endswith("2")}  # unique in store
    with SqliteEventStore(store) as log:
        assert [log.find_run(prefix) for prefix in shown.values()] == list(shown)
    page = client.get(f"/runs/{ids[4]}").text
    assert "<title>Run 01a2194e · fsm-kernel</title>" in page


# -- the Guard -----------------------------------------------------------------------------------


def raw_get(port: int, target: str) -> tuple[str, dict[str, str]]:
    """The status line and headers of `GET target` sent verbatim (clients normalize `//`)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        request = f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
        sock.sendall(request.encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in head[1:])
    return head[0], {k.lower(): v for k, v in headers.items()}


def test_a_token_in_the_url_of_a_viewer_without_one_is_ignored(
    store: Path, serve: ViewerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    viewer = serve(store=str(store))
    caplog.set_level(logging.DEBUG)

    status, headers = raw_get(viewer.port, "/?token=x")
    table, _ = raw_get(viewer.port, "/runs/table?token=abc&status=running")

    assert (status, table) == ("HTTP/1.1 200 OK", "HTTP/1.1 200 OK")
    assert headers["content-type"].startswith("text/html")
    assert [r for r in caplog.records if r.exc_info or "Exception" in r.getMessage()] == []


@pytest.mark.parametrize("target", ["//evil.example/x", "/\\evil.example/x", "///evil.example/x"])
def test_the_token_redirect_never_leaves_the_site(
    store: Path, serve: ViewerFactory, target: str
) -> None:
    viewer = serve(store=str(store), token=TOKEN)

    status, headers = raw_get(viewer.port, f"{target}?token={TOKEN}&a=1")

    assert status == "HTTP/1.1 303 See Other"
    assert headers["location"] == "/evil.example/x?a=1"  # a path of this site (a 404 there)


# -- workflow files ------------------------------------------------------------------------------


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_run_shows_only_the_workflow_file_it_recorded_under_the_viewers_folder(
    store: Path,
    serve: ViewerFactory,
    client_for: Clients,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    here = tmp_path / "project"
    here.mkdir()
    secret = here / "settings.yaml"
    secret.write_text(f"database:\n  password: {SECRET}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    outside = elsewhere / "flow.yaml"
    workflow = (ROOT / "workflows" / "single_shot.yaml").read_text()
    outside.write_text(workflow.replace("name: single_shot", "name: outside"))
    inside = here / "flow.yaml"
    inside.write_text(workflow.replace("name: single_shot", "name: inside"))
    runs = {  # what a tampered store may say
        "0199aaaa-0000-7000-8000-000000000001": (secret, "0" * 64),  # any .yaml file
        "0199aaaa-0000-7000-8000-000000000002": (secret, sha256(secret)),  # even its own hash
        "0199aaaa-0000-7000-8000-000000000003": (Path("settings.yaml"), sha256(secret)),
        "0199aaaa-0000-7000-8000-000000000004": (outside, sha256(outside)),  # not served
        "0199aaaa-0000-7000-8000-000000000005": (inside, "1" * 64),  # changed since
        "0199aaaa-0000-7000-8000-000000000006": (inside, sha256(inside)),  # as the run used it
    }
    with SqliteEventStore(store) as log:
        for minute, (run_id, (path, digest)) in enumerate(runs.items()):
            data = {"workflow_path": str(path), "workflow_hash": digest}
            log.append([started(run_id, minute, **data), ended(run_id, minute)])
    monkeypatch.chdir(here)
    client = client_for(serve(store=str(store)))

    pages = {run_id: client.get(f"/workflows/run/{run_id}") for run_id in runs}
    run_pages = {run_id: client.get(f"/runs/{run_id}").text for run_id in runs}

    *refused, shown = runs
    assert [pages[r].status_code for r in refused] == [404] * 5
    for run_id in refused:
        assert "not on this machine" in pages[run_id].text
        assert SECRET not in pages[run_id].text + run_pages[run_id]
        assert "password" not in pages[run_id].text + run_pages[run_id]
    assert pages[shown].status_code == 200
    assert text_of(pages[shown].text, "workflow-path") == str(inside)
    assert "name: inside" in text_of(pages[shown].text, "workflow-source")


# -- answers -------------------------------------------------------------------------------------


def waiting_seq(html: str) -> str:
    found = re.search(r'id="waiting" data-kind="approval" data-seq="(\d+)"', html)
    assert found is not None
    return found.group(1)


def test_three_simultaneous_answers_resume_once_and_the_others_get_409(
    store: Path,
    tmp_path: Path,
    server: FakeOpenAIServer,
    serve: ViewerFactory,
    client_for: Clients,
) -> None:
    run_id = suspend(store, server, tmp_path)
    server.enqueue(text_reply("Your notes say 42."))
    client = client_for(serve(store=str(store)))
    html = client.get(f"/runs/{run_id}").text
    form = {"csrf_token": csrf(html), "seq": waiting_seq(html), "action": "approve"}
    go = threading.Barrier(3)

    def answer(_: int) -> httpx.Response:
        go.wait()
        return client.post(f"/runs/{run_id}/answer", data=form)

    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(answer, range(3)))

    assert sorted(r.status_code for r in replies) == [303, 409, 409]
    refused = [r.text for r in replies if r.status_code == 409]
    assert all("answered already" in t or "no longer waits" in t for t in refused)
    wait_until(lambda: events(store, run_id)[-1].type is EventType.RUN_TERMINATED)
    log = events(store, run_id)
    assert len([e for e in log if e.type is EventType.HUMAN_ANSWERED]) == 1
    assert [e.data["reason"] for e in log if e.type is EventType.RUN_TERMINATED] == ["final_answer"]


def zombie_children() -> list[int]:
    """This process's children that ended and were never waited for."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if state == "Z" and int(ppid) == os.getpid():
            found.append(int(entry.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_resume_failing_after_the_settle_window_is_shown_on_the_page_and_reaped(
    store: Path,
    tmp_path: Path,
    server: FakeOpenAIServer,
    serve: ViewerFactory,
    client_for: Clients,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run_id = suspend(store, server, tmp_path)
    monkeypatch.setattr(answers_module, "_SETTLE_SECONDS", 0.0)  # every failure comes late
    client = client_for(serve(store=str(store)))
    html = client.get(f"/runs/{run_id}").text
    form = {"csrf_token": csrf(html), "seq": waiting_seq(html), "action": "approve"}

    with SqliteEventStore(store) as log, log.lock_run(run_id):  # as if a resume held the run
        posted = client.post(f"/runs/{run_id}/answer", data=form)
        assert posted.status_code == 303
        page = client.get(f"/runs/{run_id}").text
        busy = client.post(f"/runs/{run_id}/answer", data=form)  # while that resume lives
        wait_until(lambda: 'id="answer-failed"' in client.get(f"/runs/{run_id}").text)
        page = client.get(f"/runs/{run_id}").text

    assert busy.status_code == 409
    assert f"run {run_id} is being run by another process" in text_of(page, "answer-failed")
    assert 'id="approve"' in page  # the question stands: answer again
    assert events(store, run_id)[-1].type is EventType.RUN_SUSPENDED
    assert zombie_children() == []
    server.enqueue(text_reply("Your notes say 42."))
    again = client.post(f"/runs/{run_id}/answer", data=form)
    assert again.status_code == 303
    wait_until(lambda: events(store, run_id)[-1].type is EventType.RUN_TERMINATED)
    wait_until(lambda: not zombie_children())


# -- a slow page ---------------------------------------------------------------------------------


def test_a_slow_page_does_not_hold_up_the_others(
    store: Path,
    serve: ViewerFactory,
    client_for: Clients,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slow_id = "0199bbbb-0000-7000-8000-000000000001"
    with SqliteEventStore(store) as log:
        log.append([started(slow_id, 0), ended(slow_id, 0)])
    entered, release = threading.Event(), threading.Event()
    run: Callable[[UiReader, str], Any] = UiReader.run

    def slow_run(self: UiReader, run_id: str) -> Any:
        entered.set()  # as a run whose 200 KB reply takes minutes to redact
        assert release.wait(50)
        return run(self, run_id)

    monkeypatch.setattr(UiReader, "run", slow_run)
    client = client_for(serve(store=str(store)))

    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(client.get, f"/runs/{slow_id}")
        assert entered.wait(30)
        others = [client.get(path) for path in ("/", "/runs/table", "/workflows")]
        meanwhile = slow.done()
        release.set()
        assert slow.result().status_code == 200

    assert [r.status_code for r in others] == [200, 200, 200]
    assert meanwhile is False  # answered while the slow page was still being rendered
    assert [run_id for run_id, _ in table_rows(others[0].text)] == [slow_id]
