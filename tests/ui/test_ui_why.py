"""The run viewer's timeline says why each transition fired (issue 28, part 4), over HTTP: under
each transition an expandable "why" line lists the edges its step tried, the check that ruled
out each edge passed over and the checks of the edge taken, as `runs show --why` does; labels
are escaped; a run recorded before `tried` existed shows its transitions without one."""

from __future__ import annotations

from dataclasses import replace
from html.parser import HTMLParser
from pathlib import Path

import httpx

from fsm_kernel.protocol import EventType
from fsm_kernel.store import SqliteEventStore, open_store
from tests.fakes.openai_server import call, text_reply, tool_reply
from tests.ui.conftest import ViewerFactory, base_url, record

COUNTER = """\
name: counter
variables:
  attempts: {type: integer, default: 0}
initial: think
states:
  think: {action: agent.think, assign: {attempts: "vars.attempts + 1"}}
  done: {final: true}
transitions:
  - {source: think, target: think, when: "vars.attempts < 2"}
  - {source: think, target: done, reason: final_answer}
"""


class _Whys(HTMLParser):
    """The text of each `<details class="why">`: its summary, then one line per edge tried."""

    def __init__(self) -> None:
        super().__init__()
        self.whys: list[list[str]] = []
        self._depth = 0
        self._line: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "details" and dict(attrs).get("class") == "why":
            self.whys.append([])
            self._depth = 1
        elif self._depth and tag == "details":
            self._depth += 1
        if self._depth and tag in ("summary", "li"):
            self._line = []

    def handle_endtag(self, tag: str) -> None:
        if self._depth and tag in ("summary", "li") and self._line is not None:
            self.whys[-1].append(" ".join("".join(self._line).split()))
            self._line = None
        if self._depth and tag == "details":
            self._depth -= 1

    def handle_data(self, data: str) -> None:
        if self._line is not None:
            self._line.append(data)


def _whys(html: str) -> list[list[str]]:
    parser = _Whys()
    parser.feed(html[html.index('id="run-timeline"') :])
    return parser.whys


def _page(url: str, run_id: str) -> str:
    response = httpx.get(f"{url}/runs/{run_id}", timeout=30)
    assert response.status_code == 200
    return response.text


def test_each_transition_has_a_why_line_with_the_edges_tried(
    store: Path, serve: ViewerFactory
) -> None:
    run = record(store, tool_reply(call("datetime", {}, id="c1")), text_reply("It is noon."))

    html = _page(base_url(serve(store=str(store))), run.run_id)

    whys = _whys(html)
    assert len(whys) == 6  # one per transition
    assert whys[1] == ["why · 1 edge tried", "✓ edge 2 → act: has_tool_calls true"]
    assert whys[3] == [
        "why · 6 edges tried",
        "✗ edge 7 → terminate: done_called false",
        "✗ edge 8 → terminate: fatal_tool_error false",
        "✗ edge 9 → terminate: tool_failures false",
        "✗ edge 10 → terminate: no_progress false",
        "✗ edge 11 → terminate: iteration_limit false",
        "✓ edge 12 → observe: no condition",
    ]
    assert whys[5] == [
        "why · 4 edges tried",
        "✗ edge 2 → act: has_tool_calls false",
        "✗ edge 3 → think: malformed_output false",
        "✗ edge 4 → terminate: malformed_output false",
        "✓ edge 5 → terminate: no condition",
    ]
    seqs = [e.seq for e in run.events if e.type is EventType.TRANSITION_TAKEN]
    for seq in seqs:  # kept open across the page's live refresh, like the other details
        assert f'<details class="why" data-key="w{seq}">' in html


def test_a_when_label_is_escaped_and_its_value_shown(
    store: Path, serve: ViewerFactory, tmp_path: Path
) -> None:
    workflow = tmp_path / "counter.yaml"
    workflow.write_text(COUNTER)
    run = record(store, text_reply("one"), text_reply("two"), workflow=str(workflow))

    html = _page(base_url(serve(store=str(store))), run.run_id)

    assert _whys(html) == [
        ["why · 1 edge tried", "✓ edge 1 → think: when: vars.attempts < 2 true"],
        [
            "why · 2 edges tried",
            "✗ edge 1 → think: when: vars.attempts < 2 false",
            "✓ edge 2 → done: no condition",
        ],
    ]
    assert "<code>when: vars.attempts &lt; 2</code>" in html


def test_a_run_recorded_without_tried_shows_its_transitions_without_why(
    store: Path, serve: ViewerFactory, tmp_path: Path
) -> None:
    run = record(store, text_reply("It is noon."))
    old = tmp_path / "old.db"
    open_store(old).close()
    with SqliteEventStore(store) as log:
        events = log.read(run.run_id)
    with SqliteEventStore(old) as log:
        log.append(
            [
                replace(e, data={k: v for k, v in e.data.items() if k != "tried"})
                if e.type is EventType.TRANSITION_TAKEN
                else e
                for e in events
            ]
        )

    html = _page(base_url(serve(store=str(old))), run.run_id)

    assert _whys(html) == []
    timeline = html[html.index('id="run-timeline"') :]
    assert timeline.count('<div class="entry transition"') == 2
    assert "<b>think</b> → <b>terminate</b>" in timeline
