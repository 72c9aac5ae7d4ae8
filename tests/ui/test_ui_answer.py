"""Answering a run that waits for a person from its page: the forms post (CSRF-checked) to the
viewer, which runs `fsm-kernel resume` with the answer as a process of its own; the run goes on
against the fake model server, recorded like any resume, and the page follows it."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from fsm_kernel import Agent
from fsm_kernel.protocol import Event, EventType
from fsm_kernel.store import SqliteEventStore
from fsm_kernel.ui import Viewer
from tests.fakes.openai_server import FakeOpenAIServer, call, text_reply, tool_reply
from tests.ui.conftest import ViewerFactory, base_url

ROOT = Path(__file__).resolve().parents[2]
APPROVE = ROOT / "workflows" / "approve_tools.yaml"


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


def suspend(store: Path, server: FakeOpenAIServer, workspace: Path) -> str:
    """A run of approve_tools that waits for approval of read_file(notes.txt)."""
    (workspace / "notes.txt").write_text("42\n")
    server.enqueue(tool_reply(call("read_file", {"path": "notes.txt"}, id="c1")))

    async def go() -> str:
        async with Agent(
            APPROVE,
            base_url=server.base_url,
            model="m",
            workspace=workspace,
            store=store,
            max_retries=0,
        ) as agent:
            result = await agent.run("What do my notes say?")
        assert result.status == "waiting"
        return result.run_id

    import asyncio

    with ThreadPoolExecutor(1) as pool:  # under playwright this thread runs an event loop
        return pool.submit(asyncio.run, go()).result()


def events(store: Path, run_id: str) -> list[Event]:
    with SqliteEventStore(store) as log:
        return log.read(run_id)


def wait_until(check: Callable[[], bool], seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def ended(store: Path, run_id: str) -> Callable[[], bool]:
    return lambda: events(store, run_id)[-1].type is EventType.RUN_TERMINATED


def csrf(html: str) -> str:
    found = re.search(r'name="csrf_token" value="([0-9a-f]{64})"', html)
    assert found, "no CSRF field"
    return found.group(1)


def test_approve_from_the_page_resumes_the_run_once(
    store: Path,
    tmp_path: Path,
    server: FakeOpenAIServer,
    serve: ViewerFactory,
    client_for: Callable[[Viewer], httpx.Client],
) -> None:
    run_id = suspend(store, server, tmp_path)
    client = client_for(serve(store=str(store)))
    html = client.get(f"/runs/{run_id}").text
    seq = re.search(r'id="waiting" data-kind="approval" data-seq="(\d+)"', html)
    assert seq is not None
    assert f'action="/runs/{run_id}/answer"' in html
    token, answer = csrf(html), f"/runs/{run_id}/answer"

    no_token = client.post(answer, data={"seq": seq.group(1), "action": "approve"})
    stale = client.post(answer, data={"csrf_token": token, "seq": "1", "action": "approve"})
    wrong = client.post(
        answer, data={"csrf_token": token, "seq": seq.group(1), "action": "input", "text": "x"}
    )
    unknown = client.post(
        "/runs/nope/answer", data={"csrf_token": token, "seq": "1", "action": "approve"}
    )

    assert no_token.status_code == 403
    assert (stale.status_code, "no longer waits" in stale.text) == (409, True)
    assert (wrong.status_code, "waits for approval, not input" in wrong.text) == (409, True)
    assert unknown.status_code == 404
    assert events(store, run_id)[-1].type is EventType.RUN_SUSPENDED  # nothing answered yet

    server.enqueue(text_reply("Your notes say 42."))
    done = client.post(answer, data={"csrf_token": token, "seq": seq.group(1), "action": "approve"})

    assert (done.status_code, done.headers["location"]) == (303, f"/runs/{run_id}")
    wait_until(ended(store, run_id))
    log = events(store, run_id)
    (answered,) = [e for e in log if e.type is EventType.HUMAN_ANSWERED]
    assert answered.data["approved"] is True
    assert answered.data["by"].endswith("(fsm-kernel ui)")
    assert log[-1].data["reason"] == "final_answer"
    assert log[-1].data["answer"] == "Your notes say 42."
    assert [e.data["call"]["id"] for e in log if e.type is EventType.TOOL_STARTED] == ["c1"]
    again = client.post(
        answer, data={"csrf_token": token, "seq": seq.group(1), "action": "approve"}
    )
    assert again.status_code == 409  # it waits no more: a second click runs nothing


@pytest.mark.browser
def test_reject_then_input_then_approve_in_the_browser(
    store: Path, tmp_path: Path, server: FakeOpenAIServer, serve: ViewerFactory, page: Any
) -> None:
    run_id = suspend(store, server, tmp_path)
    page.goto(f"{base_url(serve(store=str(store)))}/runs/{run_id}")
    assert page.locator("#waiting").get_attribute("data-kind") == "approval"

    page.fill("#reject-reason", "<b>private</b> file")
    page.click("#reject")
    page.wait_for_selector('#waiting[data-kind="input"]', timeout=30_000)
    assert "What should the agent do instead?" in page.locator("#waiting pre.prompt").inner_text()

    server.enqueue(
        tool_reply(call("read_file", {"path": "notes.txt"}, id="c2")),
        text_reply("The notes say 42."),
    )
    page.fill("#input-text", "read notes.txt again")
    page.click("#send-input")
    page.wait_for_selector('#waiting[data-kind="approval"]', timeout=30_000)
    page.click("#approve")
    page.wait_for_selector('#run[data-status="final_answer"]', timeout=30_000)

    assert page.locator("#waiting").count() == 0
    log = events(store, run_id)
    answers = [e.data for e in log if e.type is EventType.HUMAN_ANSWERED]
    assert [(a["kind"], a.get("approved"), a.get("reason"), a.get("text")) for a in answers] == [
        ("approval", False, "<b>private</b> file", None),
        ("input", None, None, "read notes.txt again"),
        ("approval", True, None, None),
    ]
    results = [e.data["result"]["content"] for e in log if e.type is EventType.TOOL_FINISHED]
    assert results == ["rejected by the user: <b>private</b> file", "42\n"]
