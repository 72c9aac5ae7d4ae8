"""The run viewer's pages over HTTP (no browser): what the runs table, a run, the workflows and
the scheduler pages say about real recorded runs, exactly; escaping and redaction of what
came from runs; and that reading never waits for a writer."""

from __future__ import annotations

import json
import re
import sqlite3
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from fsm_kernel import redact
from fsm_kernel.protocol import Event, EventType
from fsm_kernel.scheduler import DispatchStatus, SqliteDispatchQueue
from fsm_kernel.store import SqliteEventStore
from tests.fakes.openai_server import call, text_reply, tool_reply
from tests.ui.conftest import XSS, ViewerFactory, base_url, echo, needs_dot, record
from tests.ui.html import table_rows, text_of

TOOL_THEN_ANSWER = (tool_reply(call("datetime", {}, id="c1")), text_reply("It is noon."))


def get(viewer_url: str, path: str, **kwargs: object) -> httpx.Response:
    return httpx.get(viewer_url + path, timeout=30, **kwargs)  # type: ignore[arg-type]


def test_runs_page_lists_runs_newest_first_with_their_summaries(
    store: Path, serve: ViewerFactory
) -> None:
    first = record(store, *TOOL_THEN_ANSWER, prompt="first task")
    second = record(
        store,
        tool_reply(call("datetime", {}, id="a")),
        tool_reply(call("datetime", {}, id="b")),
        prompt="second task",
        max_iterations=2,
    )
    url = base_url(serve(store=str(store)))

    html = get(url, "/").text

    rows = table_rows(html)
    assert [run_id for run_id, _ in rows] == [second.run_id, first.run_id]
    (_, newest), (_, oldest) = rows
    with SqliteEventStore(store) as log:  # each id as short as it can be and still unique
        shown = (log.find_run(newest[0]), log.find_run(oldest[0]))
    assert shown == (second.run_id, first.run_id)
    assert newest[1:6] == ["default", "max_iterations", "2", "30", newest[5]]
    assert oldest[1:5] == ["default", "final_answer", "2", "30"]
    assert (newest[7], oldest[7]) == ("second task", "first task")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", oldest[5])
    assert re.fullmatch(r"\d+ ms|\d+\.\d s", oldest[6])
    assert text_of(html, "runs-count") == "2 runs"
    assert 'id="older"' not in html
    assert 'id="newer"' not in html


def test_runs_page_filters_by_status_workflow_and_text(store: Path, serve: ViewerFactory) -> None:
    done = record(store, *TOOL_THEN_ANSWER, prompt="Find the Report")
    capped = record(
        store, tool_reply(call("datetime", {}, id="a")), prompt="other", max_iterations=1
    )
    single = record(store, text_reply("hi"), prompt="say hi", workflow="single_shot")
    url = base_url(serve(store=str(store)))

    def ids(query: str) -> list[str]:
        return [run_id for run_id, _ in table_rows(get(url, "/" + query).text)]

    assert ids("?status=final_answer") == [single.run_id, done.run_id]
    assert ids("?status=max_iterations") == [capped.run_id]
    assert ids("?workflow=single_shot") == [single.run_id]
    assert ids("?q=report") == [done.run_id]
    assert ids(f"?q={capped.run_id[-6:]}") == [capped.run_id]
    assert ids("?status=final_answer&workflow=default") == [done.run_id]
    assert ids("?status=running") == []
    html = get(url, "/?q=nothing+like+it").text
    assert "no runs match" in html
    assert text_of(html, "runs-count") == "0 runs match"
    assert get(url, "/runs/table?status=max_iterations").text.count("data-run-id=") == 1


@needs_dot
def test_run_page_draws_the_run_on_its_diagram_and_lists_its_steps(
    store: Path, serve: ViewerFactory
) -> None:
    run = record(store, *TOOL_THEN_ANSWER)
    url = base_url(serve(store=str(store)))

    html = get(url, f"/runs/{run.run_id}").text

    assert text_of(html, "run-status") == "final_answer"
    assert text_of(html, "run-tokens") == "30 (20 prompt, 10 completion)"
    assert text_of(html, "run-iterations") == "2"
    assert text_of(html, "run-answer") == "It is noon."
    svg = html[html.index("<svg") : html.index("</svg>")]
    assert re.search(r'class="node state ended" data-state="terminate"', svg)
    assert re.search(r'class="node state" data-state="think"><title>think</title>', svg)
    assert "current" not in svg  # an ended run is in no state
    think_act = svg[svg.index('data-edge="think-&gt;act"') :]
    assert "×1" in think_act[: think_act.index("</g>")]
    assert ">think &#160;×2<" in svg or ">think  ×2<" in svg
    tool = re.search(r'<details class="entry tool" data-key="t\d+" data-call-id="c1".*?</details>',
                     html, re.DOTALL)  # fmt: skip
    assert tool is not None
    assert "<code>datetime</code>" in tool.group(0)
    assert re.search(r'<pre class="result">utc: \d{4}-', tool.group(0))
    assert 'data-states="act"' in tool.group(0)
    timeline = html[html.index('id="run-timeline"') :]
    transitions = re.findall(r'data-edge="([a-z_]+)-&gt;([a-z_]+)"', timeline)
    assert [f"{a}->{b}" for a, b in transitions] == [
        "observe->think", "think->act", "act->evaluate", "evaluate->observe",
        "observe->think", "think->terminate",
    ]  # fmt: skip
    assert re.findall(r"<h3>(.*?)</h3>", html) == ["Start", "Iteration 1", "Iteration 2"]


def test_a_run_page_by_prefix_redirects_and_an_unknown_run_is_a_404(
    store: Path, serve: ViewerFactory
) -> None:
    run = record(store, text_reply("hi"), workflow="single_shot")
    url = base_url(serve(store=str(store)))

    moved = get(url, f"/runs/{run.run_id[:10]}")
    assert (moved.status_code, moved.headers["location"]) == (303, f"/runs/{run.run_id}")
    missing = get(url, "/runs/%3Cscript%3Ealert(1)%3C!--")
    assert missing.status_code == 404
    assert "<script>alert" not in missing.text
    assert text_of(missing.text, "error-message") == (
        "no run with id or id prefix '<script>alert(1)<!--'"
    )
    nowhere = get(url, "/runs/a/b/c")
    assert (nowhere.status_code, text_of(nowhere.text, "error-message")) == (404, "no such page")


def test_head_parts_and_raw_events_for_live_pages(store: Path, serve: ViewerFactory) -> None:
    run = record(store, text_reply("hi"), workflow="single_shot")
    url = base_url(serve(store=str(store)))
    with SqliteEventStore(store) as events:
        last = events.read(run.run_id)[-1]

    assert get(url, f"/runs/{run.run_id}/head").json() == {"seq": last.seq}
    parts = get(url, f"/runs/{run.run_id}/parts").json()
    assert (parts["seq"], parts["status"], parts["live"]) == (last.seq, "final_answer", False)
    assert sorted(parts["parts"]) == ["diagram", "header", "timeline", "waiting"]
    assert parts["parts"]["waiting"].strip() == ""
    raw = get(url, f"/runs/{run.run_id}/events/{last.seq}")
    assert raw.headers["content-type"] == "application/json"
    assert raw.json() == json.loads(json.dumps(last.to_dict()))
    assert get(url, f"/runs/{run.run_id}/events/999").status_code == 404


def test_everything_from_runs_is_escaped(store: Path, serve: ViewerFactory) -> None:
    run = record(
        store,
        tool_reply(call("echo", {"text": XSS}, id="x1")),
        text_reply(f"Done: {XSS}"),
        prompt=f"Echo this: {XSS}",
        tools=[echo],
    )
    url = base_url(serve(store=str(store)))

    for path in ("/", f"/runs/{run.run_id}", "/runs/table"):
        html = get(url, path).text
        assert "<script>window.__pwned" not in html, path
        assert "<img src=x" not in html, path
        assert "&lt;script&gt;window.__pwned = 1&lt;/script&gt;" in html, path
    parts = get(url, f"/runs/{run.run_id}/parts").json()["parts"]
    assert all("<script>window" not in part for part in parts.values())
    timeline = parts["timeline"]
    assert '<pre class="result">&lt;script&gt;window.__pwned = 1&lt;/script&gt;&lt;img src=x ' \
           'onerror=&#34;window.__pwned = 2&#34;&gt;</pre>' in timeline  # fmt: skip
    assert '<pre class="reply">Done: &lt;script&gt;' in timeline


def test_secrets_never_appear_on_any_page(
    store: Path, serve: ViewerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = "Uiv1ewerSecretKey0123456789"  # no credential shape: only known as the key
    run = record(store, *TOOL_THEN_ANSWER, prompt="what time is it")
    redact._forget_secrets()  # a viewer process knows the key from its environment only
    monkeypatch.setenv("FSM_KERNEL_API_KEY", key)
    # A log written by something that did not redact (an import, another tool): the viewer
    # redacts what it shows all the same.
    with SqliteEventStore(store) as events:
        seq = events.next_seq(run.run_id)
        events.append([Event(
            run_id=run.run_id, seq=seq, type=EventType.MODEL_NOTICE, timestamp=datetime.now(UTC),
            data={"kind": "echo", "header": "Authorization: Bearer abcdefghijkl0123", "key": key,
                  "openai": "sk-proj-abcdefghijklmnop0123"},
        )])  # fmt: skip
    url = base_url(serve(store=str(store)))

    pages = ["/", "/runs/table", f"/runs/{run.run_id}", f"/runs/{run.run_id}/parts",
             f"/runs/{run.run_id}/events/1", f"/runs/{run.run_id}/events/{seq}", "/workflows",
             f"/workflows/run/{run.run_id}"]  # fmt: skip
    for path in pages:
        body = get(url, path).text
        assert key not in body, path
        assert "abcdefghijkl0123" not in body, path
        assert "abcdefghijklmnop0123" not in body, path
    assert "[REDACTED]" in get(url, f"/runs/{run.run_id}/events/{seq}").text
    assert '"api_key"' not in get(url, f"/runs/{run.run_id}").text


def test_reads_never_wait_for_a_writer(store: Path, serve: ViewerFactory) -> None:
    run = record(store, text_reply("hi"), workflow="single_shot")
    url = base_url(serve(store=str(store)))
    writer = sqlite3.connect(store, isolation_level=None, timeout=0)
    try:
        writer.execute("BEGIN IMMEDIATE")  # a run holding the write lock mid-commit
        writer.execute("UPDATE runs SET goal = 'being written'")
        assert [r for r, _ in table_rows(get(url, "/").text)] == [run.run_id]
        assert get(url, f"/runs/{run.run_id}").status_code == 200
    finally:
        writer.execute("ROLLBACK")
        writer.close()


@needs_dot
def test_workflows_page_lists_stock_and_recent_workflows(
    store: Path, serve: ViewerFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "imported"
    (tmp_path / "ui_marker_tools.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "def shout(text: str) -> str:\n    '''Shout.\n\n    Args:\n        text: what.\n    '''\n"
        "    return text.upper()\n"
    )
    custom = tmp_path / "mine.yaml"
    custom.write_text(
        (Path(__file__).parents[2] / "workflows" / "single_shot.yaml").read_text()
        .replace("name: single_shot", "name: mine") + "\n# tools: [ui_marker_tools:shout]\n"
    )  # fmt: skip
    run = record(store, text_reply("hi"), workflow=str(custom))
    marker.unlink(missing_ok=True)
    monkeypatch.chdir(tmp_path)  # the viewer shows workflow files under its folder
    url = base_url(serve(store=str(store)))

    html = get(url, "/workflows").text
    stock = [name for name, _ in table_rows(html, "data-name")]
    assert {"default", "react", "plan_execute", "reflect", "single_shot"} <= set(stock)
    assert [name for name, cells in table_rows(html[html.index('id="recent"') :], "data-name")] \
        == ["mine"]  # fmt: skip
    page = get(url, f"/workflows/run/{run.run_id}").text
    assert text_of(page, "workflow-path") == str(custom)
    assert "name: mine" in text_of(page, "workflow-source")
    assert 'data-state="answer"' in page
    assert not marker.exists()  # read as data: nothing it names was imported
    react = get(url, "/workflows/stock/react").text
    assert 'data-state="reason"' in react
    assert "name: react" in react
    assert get(url, "/workflows/stock/nope").status_code == 404


def test_scheduler_page_groups_dispatches_by_cycle_and_links_runs(
    store: Path, serve: ViewerFactory, tmp_path: Path
) -> None:
    run = record(store, text_reply("hi"), workflow="single_shot")
    config = tmp_path / "scheduler.yaml"
    config.write_text(
        f"kernel_id: k1\nstore: {store}\nagents:\n"
        "  - {agent_id: writer, workflow: single_shot, prompt: write}\n"
        "  - {agent_id: critic, workflow: single_shot, prompt: judge}\n"
    )
    queue = SqliteDispatchQueue(store)
    queue.ensure_schema()
    tick = "2026-11-01T10:00:00+00:00"
    done = queue.enqueue("k1", "writer", "write it", 0, f"k1:writer:{tick}")
    waiting = queue.enqueue("k1", "critic", "judge it", 0, "k1:critic:manual:0199")
    assert done is not None
    assert waiting is not None
    claimed = queue.claim("k1", "w1", 60, 5)
    assert claimed is not None
    assert claimed.dispatch_id == done.dispatch_id
    queue.complete(done.dispatch_id, "w1", status=DispatchStatus.DONE, run_id=run.run_id,
                   termination_reason="final_answer")  # fmt: skip
    queue.close()
    url = base_url(serve(scheduler=str(config)))

    html = get(url, "/scheduler").text
    cycles = re.findall(r'<section class="cycle" data-stamp="([^"]+)">', html)
    assert cycles == ["manual:0199", tick]
    rows = dict(table_rows(html, "data-dispatch-id"))
    assert rows[done.dispatch_id][:4] == [done.dispatch_id[:8], "writer", "done", "1/3"]
    assert rows[done.dispatch_id][6:8] == [run.run_id[:8], "final_answer"]
    assert rows[waiting.dispatch_id][:4] == [waiting.dispatch_id[:8], "critic", "pending", "0/3"]
    assert f'href="/runs/{run.run_id}"' in html
    run_page = get(url, f"/runs/{run.run_id}").text
    assert f'href="/scheduler#d-{done.dispatch_id}"' in run_page
    assert text_of(run_page, "run-dispatch") == done.dispatch_id[:8]
    assert [r for r, _ in table_rows(get(url, "/").text)] == [run.run_id]  # the config's store


def test_without_a_scheduler_config_the_page_says_how_to_get_one(
    store: Path, serve: ViewerFactory
) -> None:
    url = base_url(serve(store=str(store)))
    page = get(url, "/scheduler")
    assert page.status_code == 404
    assert "--scheduler CONFIG" in page.text
    assert 'href="/scheduler"' not in get(url, "/").text


def test_a_json_lines_store_is_served_too(tmp_path: Path, serve: ViewerFactory) -> None:
    store = tmp_path / "runs.jsonl"
    run = record(store, *TOOL_THEN_ANSWER)
    url = base_url(serve(store=str(store)))

    rows = table_rows(get(url, "/").text)
    assert [(r, cells[2], cells[4]) for r, cells in rows] == [(run.run_id, "final_answer", "30")]
    assert 'data-call-id="c1"' in get(url, f"/runs/{run.run_id}").text


@pytest.mark.postgres
def test_a_postgresql_store_and_its_dispatches_are_served(
    pg_dsn: str, serve: ViewerFactory, tmp_path: Path
) -> None:
    from fsm_kernel.scheduler import open_queue
    from tests.unit.test_scheduler_fakes import pg_url

    store = pg_url(pg_dsn)
    run = record(store, *TOOL_THEN_ANSWER)
    queue = open_queue(store)
    dispatch = queue.enqueue("k1", "writer", "write", 0, "k1:writer:manual:7")
    assert dispatch is not None
    assert queue.claim("k1", "w1", 60, 5) is not None
    queue.complete(dispatch.dispatch_id, "w1", status=DispatchStatus.DONE, run_id=run.run_id,
                   termination_reason="final_answer")  # fmt: skip
    queue.close()
    config = tmp_path / "scheduler.yaml"
    config.write_text(
        f"kernel_id: k1\nstore: '{store}'\nagents:\n"
        "  - {agent_id: writer, workflow: single_shot, prompt: write}\n"
    )
    url = base_url(serve(scheduler=str(config)))

    assert [r for r, _ in table_rows(get(url, "/").text)] == [run.run_id]
    run_page = get(url, f"/runs/{run.run_id}").text
    assert text_of(run_page, "run-tokens") == "30 (20 prompt, 10 completion)"
    assert text_of(run_page, "run-dispatch") == dispatch.dispatch_id[:8]
    rows = dict(table_rows(get(url, "/scheduler").text, "data-dispatch-id"))
    assert rows[dispatch.dispatch_id][1:3] == ["writer", "done"]


def test_a_parent_run_lists_its_child_runs_and_each_child_links_back(
    store: Path, serve: ViewerFactory
) -> None:
    fanout = Path(__file__).parents[1] / "data" / "children" / "fanout.yaml"
    plan = text_reply(json.dumps({"steps": ["a", "b"]}))
    run = record(store, plan, text_reply("did a"), text_reply("did b"), text_reply("sum"),
                 workflow=str(fanout))  # fmt: skip
    url = base_url(serve(store=str(store)))

    html = get(url, f"/runs/{run.run_id}").text

    children = html[html.index('id="run-children"') :]
    children = children[: children.index("</ul>")]
    links = re.findall(r'<a class="mono" href="/runs/([0-9a-f-]+)">', children)
    assert len(links) == 2
    assert re.findall(r"item (\d) step.yaml", children) == ["1", "2"]
    assert children.count("final_answer") == 2
    child = get(url, f"/runs/{links[0]}").text
    assert f'href="/runs/{run.run_id}"' in child


def test_the_timeline_shows_child_runs_starting_and_ending(
    store: Path, serve: ViewerFactory
) -> None:
    delegate = Path(__file__).parents[1] / "data" / "children" / "delegate.yaml"
    run = record(store, text_reply("the child's answer"), workflow=str(delegate))
    url = base_url(serve(store=str(store)))

    html = get(url, f"/runs/{run.run_id}").text

    timeline = html[html.index('id="run-timeline"') :]
    entries = re.findall(r'<div class="entry child"[^>]*>.*?</div>', timeline, re.DOTALL)
    assert len(entries) == 2
    started, ended = entries
    assert re.search(r'child run <a class="mono" href="/runs/[0-9a-f-]+">', started)
    assert 'of step.yaml: <span class="dim">Please do: What time is it?</span>' in started
    assert "final_answer" in ended
    assert "the child&#39;s answer" in ended
