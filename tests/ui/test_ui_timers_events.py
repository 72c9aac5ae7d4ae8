"""A run waiting in a waiting state (issue 27, part 2) from its page in the viewer: the page
says which events it waits for and when its timer is due, and a form delivers an event with
its data, as `fsm-kernel signal RUN_ID NAME --data JSON` run by the viewer as a process of its
own; an event the state does not await is refused with the command's own error."""

from __future__ import annotations

import asyncio
import html as html_lib
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from fsm_kernel import Agent
from fsm_kernel.protocol import EventType
from fsm_kernel.ui import Viewer
from tests.fakes.openai_server import FakeOpenAIServer, text_reply
from tests.ui.conftest import ViewerFactory
from tests.ui.test_ui_answer import csrf, ended, events, wait_until

WORKFLOW = """\
name: deploy_on_ci
reasons:
  timed_out: {description: CI never answered}
initial: plan
states:
  plan: {action: agent.think}
  wait_for_ci: {description: waits for CI or gives up}
  deploy: {action: agent.think}
  done: {final: true}
  gave_up: {final: true}
transitions:
  - {source: plan, target: wait_for_ci}
  - {source: wait_for_ci, target: deploy, event: ci_passed}
  - {source: wait_for_ci, target: deploy, event: ci_forced}
  - {source: wait_for_ci, target: gave_up, after: 30m, reason: timed_out}
  - {source: deploy, target: done, reason: final_answer}
"""


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


def suspend(store: Path, server: FakeOpenAIServer, tmp_path: Path) -> str:
    workflow = tmp_path / "deploy.yaml"
    workflow.write_text(WORKFLOW)
    server.enqueue(text_reply("planned"))

    async def go() -> str:
        async with Agent(
            workflow, base_url=server.base_url, model="m", store=store, max_retries=0
        ) as agent:
            result = await agent.run("ship v2")
        assert result.status == "waiting"
        return result.run_id

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, go()).result()


def test_deliver_an_event_from_the_page(
    store: Path,
    tmp_path: Path,
    server: FakeOpenAIServer,
    serve: ViewerFactory,
    client_for: Callable[[Viewer], httpx.Client],
) -> None:
    run_id = suspend(store, server, tmp_path)
    client = client_for(serve(store=str(store)))
    html = client.get(f"/runs/{run_id}").text
    seq = re.search(r'id="waiting" data-kind="event" data-seq="(\d+)"', html)
    assert seq is not None
    assert "Waiting for an event in state <b>wait_for_ci</b>" in html
    assert "<code>ci_passed, ci_forced</code>" in html
    assert re.search(r'<time id="due">2\d{3}-\d\d-\d\dT[^<]+\+00:00</time>', html)
    assert '<option value="ci_passed">ci_passed</option>' in html
    assert 'id="input-form"' not in html
    token, answer = csrf(html), f"/runs/{run_id}/answer"
    form = {"csrf_token": token, "seq": seq.group(1), "action": "signal"}

    nameless = client.post(answer, data=form)
    wrong = client.post(answer, data={**form, "event": "ci_failed"})
    as_input = client.post(answer, data={**form, "action": "input", "text": "x"})

    assert (nameless.status_code, "name the event" in nameless.text) == (400, True)
    assert wrong.status_code == 409
    assert (
        "the run does not wait for event 'ci_failed' (it waits for ci_passed, ci_forced)"
        in html_lib.unescape(wrong.text)
    )
    assert (as_input.status_code, "waits for event, not input" in as_input.text) == (409, True)
    assert events(store, run_id)[-1].type is EventType.RUN_SUSPENDED  # nothing delivered

    server.enqueue(text_reply("deployed build 7"))
    done = client.post(answer, data={**form, "event": "ci_passed", "text": '{"build": 7}'})

    assert (done.status_code, done.headers["location"]) == (303, f"/runs/{run_id}")
    wait_until(ended(store, run_id))
    log = events(store, run_id)
    (delivered,) = [e for e in log if e.type is EventType.EVENT_DELIVERED]
    assert delivered.data["name"] == "ci_passed"
    assert delivered.data["data"] == {"build": 7}
    assert delivered.data["by"].endswith("(fsm-kernel ui)")
    assert log[-1].data["reason"] == "final_answer"
    assert log[-1].data["answer"] == "deployed build 7"
