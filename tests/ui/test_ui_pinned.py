"""A run pinned to the workflow it started with (issue 27, part 6), on its page in the viewer:
after its file was edited, the page says which version the run follows and what the file says
now, and draws the recorded definition (its states), not the edited file's."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from fsm_kernel import Agent
from fsm_kernel.ui import Viewer
from tests.fakes.openai_server import FakeOpenAIServer, text_reply
from tests.ui.conftest import ViewerFactory

WORKFLOW = """\
name: deploy_on_ci
version: 1
initial: plan
states:
  plan: {action: agent.think}
  wait_for_ci: {description: waits for CI}
  deploy: {action: agent.think}
  done: {final: true}
transitions:
  - {source: plan, target: wait_for_ci}
  - {source: wait_for_ci, target: deploy, event: ci_passed}
  - {source: deploy, target: done, reason: final_answer}
"""


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


def test_the_run_page_says_which_version_the_run_is_pinned_to(
    store: Path,
    tmp_path: Path,
    server: FakeOpenAIServer,
    serve: ViewerFactory,
    client_for: Callable[[Viewer], httpx.Client],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)  # the viewer shows files under its working directory
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
        run_id = pool.submit(asyncio.run, go()).result()
    workflow.write_text(
        WORKFLOW.replace("version: 1", "version: 2").replace("wait_for_ci", "await_ci")
    )

    page = client_for(serve(store=str(store))).get(f"/runs/{run_id}").text

    assert '<dd id="run-definition">pinned to version 1 (sha256 ' in page
    assert "the file now says version 2 (sha256 " in page
    assert "wait_for_ci" in page  # drawn from the recorded text
    assert "await_ci" not in page
