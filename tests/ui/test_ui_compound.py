"""The run viewer says where a run is inside compound states by its full path (issue 27,
part 1): a run waiting for a person in a child of a compound state reads "Now in work.ask"."""

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
name: nested_ask
initial: work
states:
  work:
    initial: plan
    states:
      plan: {action: agent.think, answer: false}
      ask: {action: human.input, prompt: "Go on?"}
  done: {final: true}
transitions:
  - {source: plan, target: ask}
  - {source: ask, target: done, reason: final_answer}
"""


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


def test_the_page_says_the_full_path_of_the_state_a_run_waits_in(
    store: Path,
    tmp_path: Path,
    server: FakeOpenAIServer,
    serve: ViewerFactory,
    client_for: Callable[[Viewer], httpx.Client],
) -> None:
    workflow = tmp_path / "nested.yaml"
    workflow.write_text(WORKFLOW)
    server.enqueue(text_reply("planned"))

    async def go() -> str:
        async with Agent(
            workflow, base_url=server.base_url, model="m", store=store, max_retries=0
        ) as agent:
            result = await agent.run("plan, then ask")
        assert result.status == "waiting"
        return result.run_id

    with ThreadPoolExecutor(1) as pool:
        run_id = pool.submit(asyncio.run, go()).result()
    html = client_for(serve(store=str(store))).get(f"/runs/{run_id}").text
    assert '<dd id="run-current">work.ask</dd>' in html
