"""Compound states from the CLI against the fake OpenAI-compatible server over loopback: the
issue's research/report example end to end, a parent-level edge firing from a nested state,
history returning to the last child, `validate` rejecting a duplicate id at depth and an
unreachable child edge, and a run killed inside a compound state then resumed and replayed
identically."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsm_kernel.protocol import EventType
from fsm_kernel.store import SqliteEventStore
from tests.clikit import cli
from tests.fakes.openai_server import FakeOpenAIServer, call, text_reply, tool_reply
from tests.integration.test_resume_replay import (
    _cli,
    _env,
    _events,
    _has_event,
    _kill,
    _wait_until,
    servers,  # noqa: F401  (the fixture)
)

DATA = Path(__file__).resolve().parents[1] / "data"
RESEARCH = DATA / "compound_research.yaml"
HISTORY = DATA / "compound_history.yaml"


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


def _run(
    capsys, server: FakeOpenAIServer, workflow: Path, store: Path, workspace: Path, *more: str
):
    return cli(
        capsys,
        "run", workflow, "--prompt", "research then report", "--base-url", server.base_url,
        "--store", store, "--workspace", workspace, *(more or ("--json",)),
    )  # fmt: skip


def _entered(store: Path, run_id: str) -> list[str]:
    with SqliteEventStore(store) as s:
        events = s.read(run_id)
    return [e.data["path"] for e in events if e.type == EventType.STATE_ENTERED]


def test_the_issue_example_runs_research_then_report(
    tmp_path: Path, server: FakeOpenAIServer, capsys
) -> None:
    server.enqueue(
        tool_reply(call("datetime", {}, id="t1")), text_reply("Found it."), text_reply("Report.")
    )
    store = tmp_path / "runs.db"
    out = _run(capsys, server, RESEARCH, store, tmp_path, "--verbose")
    assert out.code == 0, out.err
    assert out.out.startswith("Report.\n")
    assert "→ research.think\n" in out.err  # progress: the full path
    assert "→ research.found\n" in out.err
    with SqliteEventStore(store) as s:
        run_id = s.list_runs()[0].run_id
    assert _entered(store, run_id) == [
        "research.think", "research.act", "research.think", "research.found", "report",
    ]  # fmt: skip
    shown = cli(capsys, "runs", "show", run_id, "--store", store)
    assert "last transition: report → terminate" in shown.out
    events = cli(capsys, "runs", "events", run_id, "--store", store, "--json").out.splitlines()
    completed = [json.loads(line)["data"] for line in events if '"transition.taken"' in line][-2]
    assert completed == {
        "index": 4, "source": "research", "target": "report", "guard": "completed",
        "reason": None, "from": "research.found", "to": "report",
        "tried": [  # the compound state's edges, in file order: its escalation first
            {"edge": 0, "target": "terminate", "passed": False,
             "checks": [{"check": "tool_failed", "value": False}]},
            {"edge": 4, "target": "report", "passed": True,
             "checks": [{"check": "completed", "value": True}]},
        ],
    }  # fmt: skip


def test_a_parent_level_edge_fires_from_a_nested_state(
    tmp_path: Path, server: FakeOpenAIServer, capsys
) -> None:
    server.enqueue(tool_reply(call("read_file", {"path": "missing.txt"}, id="r1")))
    store = tmp_path / "runs.db"
    out = _run(capsys, server, RESEARCH, store, tmp_path)
    assert out.code == 1, out.err  # escalated: a reason the workflow declares a failure
    run_id = out.json()["run_id"]
    assert out.json()["termination_reason"] == "escalated"
    assert len(server.requests) == 1
    shown = cli(capsys, "runs", "show", run_id, "--store", store)
    assert "last transition: research.act → terminate [tool_failed]" in shown.out
    assert _entered(store, run_id) == ["research.think", "research.act"]


def test_history_returns_to_the_last_child_and_replays_identically(
    tmp_path: Path, server: FakeOpenAIServer, capsys
) -> None:
    server.enqueue(
        tool_reply(call("read_file", {"path": "missing.txt"}, id="r1")),
        text_reply("Keep going."),
        text_reply("It is noon."),
    )
    store = tmp_path / "runs.db"
    out = _run(capsys, server, HISTORY, store, tmp_path)
    assert out.code == 0, out.err
    run_id = out.json()["run_id"]
    assert _entered(store, run_id) == [
        "work.plan", "work.act", "check", "work.act", "work.plan", "work.finished",
    ]  # fmt: skip
    replay = cli(capsys, "replay", run_id, "--store", store, "--json")
    report = json.loads(replay.out)
    assert replay.code == 0, report
    assert report["identical"] is True
    assert report["steps"][1]["recorded"] == "work.act → check [tool_failed]"
    assert report["steps"][2]["recorded"] == "check → work.act"


BAD = """\
name: bad
initial: research
states:
  research:
    initial: think
    states:
      think: {action: agent.think}
      inner:
        initial: act
        states:
          act: {action: tools.execute}
          think: {action: agent.think}
      found: {final: true}
  terminate: {final: true}
transitions:
  - {source: research, target: terminate, reason: cancelled}
  - {source: think, target: act, guard: has_tool_calls}
  - {source: act, target: think}
"""


def test_validate_rejects_a_duplicate_id_at_depth_and_an_unreachable_child_edge(
    tmp_path: Path, capsys
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(BAD)
    out = cli(capsys, "validate", path)
    assert out.code == 2
    lines = out.err.splitlines()
    assert (
        f"error: {path}:12:11: state id 'think' is declared twice: state ids are unique across "
        "the whole workflow, at any depth (the first is 'research.think')"
    ) in lines
    unreachable = (
        "transition never fires: the transition out of 'research' (line 16) always fires first "
        "in every state it applies in (the edges of a compound state are tried before its "
        "children's)"
    )
    assert f"error: {path}:17:5: {unreachable}" in lines
    assert f"error: {path}:18:5: {unreachable}" in lines


def test_a_run_killed_inside_a_compound_state_resumes_and_replays_exactly(
    tmp_path: Path,
    servers,  # noqa: F811
    capsys,
) -> None:
    store = tmp_path / "runs.db"
    first = servers("first", [
        {"tool_calls": [{"name": "datetime", "arguments": {}, "id": "c1"}]},
        {"hang": 60},
    ])  # fmt: skip
    proc = subprocess.Popen(
        _cli("run", str(RESEARCH), "--prompt", "research", "--base-url", first.base_url,
             "--store", str(store), "--workspace", str(tmp_path), "--json"),
        env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    _wait_until(lambda: first.request_count() >= 2, "the second model request")
    _wait_until(_has_event(store, EventType.MODEL_REQUESTED, 2), "model.requested recorded")
    _kill(proc)
    before = _events(store)
    run_id = before[0].run_id
    assert [e.data.get("path") for e in before if e.type == EventType.STATE_ENTERED] == [
        "research.think", "research.act", "research.think",
    ]  # fmt: skip
    shown = cli(capsys, "runs", "show", run_id, "--store", store)
    assert "state:           research.think" in shown.out

    second = servers("second", ["Found it.", "The report."])
    out = subprocess.run(
        _cli("resume", run_id, "--base-url", second.base_url, "--store", str(store), "--json"),
        env=_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["termination_reason"] == "final_answer"
    assert second.request_count() == 2, "only the lost call and the report are asked"
    after = _events(store)
    assert after[: len(before)] == before, "nothing recorded is rewritten"
    paths = [e.data.get("path") for e in after if e.type == EventType.STATE_ENTERED]
    assert paths == [
        "research.think", "research.act", "research.think",  # the first process
        "research.found", "report",  # the resume: it caught up with the log, then went on
    ]  # fmt: skip
    replay = cli(capsys, "replay", run_id, "--store", store, "--json")
    report = json.loads(replay.out)
    assert replay.code == 0, report
    assert report["identical"] is True
    assert [s["recorded"] for s in report["steps"]] == [
        "research.think → research.act [has_tool_calls]",
        "research.act → research.think",
        "research.think → research.found",
        "research.found → report [completed]",
        "report → terminate → final_answer",
    ]
