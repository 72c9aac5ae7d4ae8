"""The run viewer in a real headless browser (Debian's chromium, through playwright): the runs
page, a finished run's diagram overlay and a tool call's details, filtering the timeline from
the diagram, a live run followed state by state while the fake model server advances it, and
markup from a model and a tool that stays inert text."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import fsm_kernel
from fsm_kernel.kernel import RunResult
from tests.fakes.openai_server import FakeOpenAIServer, call, text_reply, tool_reply
from tests.ui.conftest import XSS, ViewerFactory, base_url, echo, needs_dot, record

pytestmark = pytest.mark.browser


def svg_text(locator: Any) -> str:
    """The text of an SVG element (spaces, no-break ones included, collapsed)."""
    return " ".join(locator.text_content().split())


@needs_dot
def test_runs_page_then_a_finished_run_on_its_diagram(
    store: Path, serve: ViewerFactory, page: Any
) -> None:
    run = record(store, tool_reply(call("datetime", {}, id="c1")), text_reply("It is noon."))
    page.goto(base_url(serve(store=str(store))))

    row = page.locator(f'#runs tr[data-run-id="{run.run_id}"]')
    assert row.locator("td").all_inner_texts()[:5] == [
        run.run_id[:8],
        "default",
        "final_answer",
        "2",
        "30",
    ]
    row.locator("a").click()
    page.wait_for_url(f"**/runs/{run.run_id}")

    diagram = page.locator("#diagram svg")
    assert svg_text(diagram.locator('g[data-state="think"] text').first) == "think ×2"
    assert svg_text(diagram.locator('g[data-state="act"] text').first) == "act ×1"
    ended = diagram.locator("g.node.ended")
    assert ended.get_attribute("data-state") == "terminate"
    assert diagram.locator("g.node.current").count() == 0
    edge = diagram.locator('g.edge[data-edge="think->act"]')
    assert svg_text(edge).endswith("×1")
    assert edge.locator("path").get_attribute("stroke-width") == "2.5"  # taken: drawn bold

    tool = page.locator('#run-timeline details.tool[data-call-id="c1"]')
    assert not tool.locator("pre.result").is_visible()
    tool.locator("summary").click()
    assert tool.locator("pre.args").inner_text() == "{}"
    assert tool.locator("pre.result").inner_text().startswith("utc: ")
    assert tool.locator("pre.result").is_visible()


@needs_dot
def test_clicking_a_state_or_an_edge_filters_the_timeline(
    store: Path, serve: ViewerFactory, page: Any
) -> None:
    run = record(store, tool_reply(call("datetime", {}, id="c1")), text_reply("It is noon."))
    page.goto(f"{base_url(serve(store=str(store)))}/runs/{run.run_id}")
    entries = page.locator("#run-timeline .entry")
    everything = entries.count()

    page.locator('#diagram g[data-state="act"]').click()
    visible = page.locator("#run-timeline .entry:visible")
    kinds = [e.get_attribute("class") for e in visible.all()]
    assert kinds == ["entry transition", "entry tool", "entry transition"]  # in, the call, out
    assert page.locator("#filterbar").inner_text().startswith("Showing state act only")
    assert page.locator('#diagram g.selected[data-state="act"]').count() == 1

    page.locator('#diagram g[data-edge="evaluate->observe"] text').first.click()  # its label
    edges = [e.get_attribute("data-edge") for e in visible.all()]
    assert edges == ["evaluate->observe"]
    assert page.locator("#run-timeline section.iteration:visible").count() == 1

    page.locator("#filter-clear").click()
    assert visible.count() == everything
    assert not page.locator("#filterbar").is_visible()


class Gate:
    """Holds the fake model's answer (or a tool) until the test opens it."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self.reached = threading.Event()

    def open(self) -> None:
        self._open.set()

    def wait(self) -> None:
        self.reached.set()
        assert self._open.wait(60), "the test never opened the gate"


@pytest.fixture
def gates() -> Iterator[list[Gate]]:
    made = [Gate() for _ in range(3)]
    yield made
    for gate in made:
        gate.open()  # never leave a run (or the fake server) hanging


@needs_dot
def test_a_live_run_is_followed_state_by_state(
    store: Path, serve: ViewerFactory, page: Any, gates: list[Gate]
) -> None:
    first_answer, tool_gate, second_answer = gates

    def slow_tool(text: str) -> str:
        """Wait for the test, then echo.

        Args:
            text: what to echo.
        """
        tool_gate.wait()
        return text

    def held(gate: Gate, reply: Any) -> Any:
        def answer(_request: dict[str, Any]) -> Any:
            gate.wait()
            return reply

        return answer

    results: list[RunResult] = []
    with FakeOpenAIServer() as server:
        server.enqueue(
            held(first_answer, tool_reply(call("slow_tool", {"text": "x"}, id="s1"))),
            held(second_answer, text_reply("finished")),
        )
        runner = threading.Thread(target=lambda: results.append(fsm_kernel.run(
            "default", "watch me", base_url=server.base_url, model="m", max_retries=0,
            store=str(store), tools=[slow_tool],
        )))  # fmt: skip
        runner.start()
        try:
            assert first_answer.reached.wait(30)
            url = base_url(serve(store=str(store)))
            runs_page = page.context.new_page()  # stays open, never reloaded
            runs_page.goto(url)
            assert runs_page.locator("#runs tbody tr").get_attribute("data-status") == "running"
            page.goto(url)
            page.locator("#runs tbody tr a").click()

            current = page.locator("#diagram g.node.current")
            page.wait_for_selector('#diagram g.node.current[data-state="think"]')
            assert page.locator("#run-timeline .entry.model.pending").count() == 1
            first_answer.open()
            page.wait_for_selector('#diagram g.node.current[data-state="act"]')
            assert page.locator("#run-current").inner_text() == "act"
            assert "running…" in page.locator("#run-timeline .entry.tool").inner_text()
            tool_gate.open()
            page.wait_for_selector('#diagram g.node.current[data-state="think"]')
            think = page.locator('#diagram g[data-state="think"] text').first
            assert svg_text(think) == "think ×2"
            second_answer.open()
            page.wait_for_selector('#run[data-status="final_answer"]')
            assert current.count() == 0
            assert page.locator("#diagram g.node.ended").get_attribute("data-state") == (
                "terminate"
            )
            assert page.locator("#run-answer").inner_text() == "finished"

            runs_page.wait_for_selector('#runs tbody tr[data-status="final_answer"]')
            assert runs_page.locator("#runs tbody tr td").all_inner_texts()[2:5] == [
                "final_answer",
                "2",
                "30",
            ]
        finally:
            for gate in gates:
                gate.open()
            runner.join(30)
    assert [r.termination_reason for r in results] == ["final_answer"]


def test_markup_from_a_model_and_a_tool_stays_inert_text(
    store: Path, serve: ViewerFactory, page: Any
) -> None:
    run = record(
        store,
        tool_reply(call("echo", {"text": XSS}, id="x1")),
        text_reply(f"Done: {XSS}"),
        prompt=f"Echo {XSS}",
        tools=[echo],
    )
    url = base_url(serve(store=str(store)))
    page.goto(url)
    assert page.locator("#runs td.goal").inner_text() == f"Echo {XSS}"
    page.goto(f"{url}/runs/{run.run_id}")
    for details in page.locator("#run-timeline details").all():
        details.locator("summary").first.click()

    assert page.evaluate("window.__pwned") is None
    assert page.locator("main img").count() == 0
    assert page.locator("main script").count() == 0
    tool = page.locator('#run-timeline details.tool[data-call-id="x1"]')
    assert tool.locator("pre.result").inner_text() == XSS
    assert page.locator("#run-answer").inner_text() == f"Done: {XSS}"
    assert page.locator("#run-timeline pre.reply").inner_text() == f"Done: {XSS}"
