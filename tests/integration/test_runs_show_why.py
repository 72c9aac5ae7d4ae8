"""`fsm-kernel runs show RUN --why` (issue 28, part 4) against real SQLite stores filled by real
runs through the fake OpenAI-compatible server over loopback: each step's edges tried, the check
that ruled out each edge passed over and the checks of the edge taken, in the terminal and in
`--json`; compound priority and a waiting state's event; and a log written before `tried` was
recorded (the same run with it stripped) still shows, replays identically and resumes without
diverging."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from fsm_kernel.protocol import EventType
from fsm_kernel.store import SqliteEventStore
from tests.clikit import Outcome, cli
from tests.fakes.openai_server import FakeOpenAIServer, call, text_reply, tool_reply

REPO = Path(__file__).resolve().parents[2]
DEFAULT = REPO / "workflows" / "default.yaml"
RESEARCH = REPO / "tests" / "data" / "compound_research.yaml"

WAIT = """\
name: deploy_on_ci
reasons:
  timed_out: {description: CI never answered}
initial: plan
states:
  plan: {action: agent.think, prompt: Plan the deploy.}
  wait_for_ci: {description: waits for CI or gives up}
  deploy: {action: agent.think, prompt: Deploy it.}
  done: {final: true}
  gave_up: {final: true}
transitions:
  - {source: plan, target: wait_for_ci}
  - {source: wait_for_ci, target: deploy, event: ci_passed}
  - {source: wait_for_ci, target: gave_up, after: 30m, reason: timed_out}
  - {source: deploy, target: done, reason: final_answer}
"""


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


def _run(capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer, workflow: Path,
         store: Path, workspace: Path) -> Outcome:  # fmt: skip
    return cli(
        capsys,
        "run", workflow, "--prompt", "What time is it?", "--base-url", server.base_url,
        "--model", "m", "--max-retries", "0", "--store", store, "--workspace", workspace,
        "--json",
    )  # fmt: skip


def _why_section(out: str) -> list[str]:
    """The lines of the `--why` section (up to the blank line before the audit)."""
    lines = out.splitlines()
    start = lines.index("why each transition fired: the edges each step tried, in order")
    end = lines.index("", start)
    return lines[start:end]


def _strip_tried(source: Path, target: Path, run_id: str) -> None:
    """Copy the run's log to `target` as fsm-kernel wrote it before it recorded `tried`."""
    with SqliteEventStore(source) as log:
        events = log.read(run_id)
    bare = [
        replace(e, data={k: v for k, v in e.data.items() if k != "tried"})
        if e.type is EventType.TRANSITION_TAKEN
        else e
        for e in events
    ]
    with SqliteEventStore(target) as old:
        old.append(bare)


def _taken(store: Path, run_id: str) -> list[dict[str, object]]:
    with SqliteEventStore(store) as log:
        return [e.data for e in log.read(run_id) if e.type is EventType.TRANSITION_TAKEN]


def test_runs_show_why_lists_each_steps_edges_and_the_check_that_decided(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(tool_reply(call("datetime", {}, id="t1")), text_reply("It is noon."))
    store = tmp_path / "runs.db"
    run_id = _run(capsys, server, DEFAULT, store, tmp_path).json()["run_id"]

    shown = cli(capsys, "runs", "show", run_id, "--store", store, "--why")

    assert shown.code == 0, shown.err
    assert _why_section(shown.out) == [
        "why each transition fired: the edges each step tried, in order",
        "(✗ passed over: the check that was false; ✓ taken: its checks)",
        "  step 1  observe → think",
        "    ✓ edge 1 → think  (no condition)",
        "  step 2  think → act [has_tool_calls]  (iteration 1)",
        "    ✓ edge 2 → act  has_tool_calls: true",
        "  step 3  act → evaluate  (iteration 1)",
        "    ✓ edge 6 → evaluate  (no condition)",
        "  step 4  evaluate → observe  (iteration 1)",
        "    ✗ edge 7 → terminate   done_called: false",
        "    ✗ edge 8 → terminate   fatal_tool_error: false",
        "    ✗ edge 9 → terminate   tool_failures: false",
        "    ✗ edge 10 → terminate  no_progress: false",
        "    ✗ edge 11 → terminate  iteration_limit: false",
        "    ✓ edge 12 → observe    (no condition)",
        "  step 5  observe → think  (iteration 1)",
        "    ✓ edge 1 → think  (no condition)",
        "  step 6  think → terminate → final_answer  (iteration 2)",
        "    ✗ edge 2 → act        has_tool_calls: false",
        "    ✗ edge 3 → think      malformed_output: false",
        "    ✗ edge 4 → terminate  malformed_output: false",
        "    ✓ edge 5 → terminate  (no condition)",
    ]
    assert "termination audit:" in shown.out  # the rest of runs show is still there
    plain = cli(capsys, "runs", "show", run_id, "--store", store)
    assert "why each transition fired" not in plain.out


def test_runs_show_why_json_has_each_steps_recorded_tried_list(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(tool_reply(call("datetime", {}, id="t1")), text_reply("It is noon."))
    store = tmp_path / "runs.db"
    run_id = _run(capsys, server, DEFAULT, store, tmp_path).json()["run_id"]

    why = cli(capsys, "runs", "show", run_id, "--store", store, "--why", "--json").json()["why"]
    plain = cli(capsys, "runs", "show", run_id, "--store", store, "--json").json()

    assert "why" not in plain
    assert [(s["step"], s["source"], s["target"], s["index"]) for s in why] == [
        (1, "observe", "think", 0), (2, "think", "act", 1), (3, "act", "evaluate", 5),
        (4, "evaluate", "observe", 11), (5, "observe", "think", 0),
        (6, "think", "terminate", 4),
    ]  # fmt: skip
    assert why[1]["guard"] == "has_tool_calls"
    assert why[5]["reason"] == "final_answer"
    assert why[1]["tried"] == [
        {"edge": 1, "target": "act", "checks": [{"check": "has_tool_calls", "value": True}],
         "passed": True},
    ]  # fmt: skip
    assert [s["tried"] for s in why] == [d["tried"] for d in _taken(store, run_id)]


def test_why_shows_a_compound_states_edges_tried_before_the_childs(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(
        tool_reply(call("datetime", {}, id="t1")), text_reply("Found it."), text_reply("Report.")
    )
    store = tmp_path / "runs.db"
    run_id = _run(capsys, server, RESEARCH, store, tmp_path).json()["run_id"]

    section = _why_section(cli(capsys, "runs", "show", run_id, "--store", store, "--why").out)

    assert section[2:6] == [
        "  step 1  research.think → research.act [has_tool_calls]  (iteration 1)",
        "    ✗ edge 1 → terminate  tool_failed: false",
        "    ✗ edge 5 → report     completed: false",
        "    ✓ edge 2 → act        has_tool_calls: true",
    ]
    found = section.index("  step 4  research.found → report [completed]  (iteration 2)")
    assert section[found + 1 : found + 3] == [
        "    ✗ edge 1 → terminate  tool_failed: false",
        "    ✓ edge 5 → report     completed: true",
    ]


def test_why_shows_the_event_that_woke_a_waiting_run_after_signal(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store, workflow = tmp_path / "runs.db", tmp_path / "deploy.yaml"
    workflow.write_text(WAIT)
    server.enqueue(text_reply("planned"), text_reply("deployed"))
    waiting = _run(capsys, server, workflow, store, tmp_path)
    assert waiting.code == 3, waiting.err
    run_id = waiting.json()["run_id"]

    done = cli(capsys, "signal", run_id, "ci_passed", "--store", store, "--json")

    assert done.code == 0, done.err
    section = _why_section(cli(capsys, "runs", "show", run_id, "--store", store, "--why").out)
    assert section[4:7] == [
        "  step 2  wait_for_ci → deploy [event ci_passed]  (iteration 1)",
        "    ✓ edge 2 → deploy  event ci_passed: true",
        "  step 3  deploy → done → final_answer  (iteration 2)",
    ]


def test_a_log_without_tried_still_shows_replays_identically_and_resumes(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(tool_reply(call("datetime", {}, id="t1")), text_reply("It is noon."))
    store, old = tmp_path / "runs.db", tmp_path / "old.db"
    run_id = _run(capsys, server, DEFAULT, store, tmp_path).json()["run_id"]
    _strip_tried(store, old, run_id)

    shown = cli(capsys, "runs", "show", run_id, "--store", old, "--why")
    why = cli(capsys, "runs", "show", run_id, "--store", old, "--why", "--json").json()["why"]
    replayed = cli(capsys, "replay", run_id, "--store", old)

    assert shown.code == 0, shown.err
    assert _why_section(shown.out)[2:4] == [
        "  step 1  observe → think",
        "    (not recorded: the run was recorded before fsm-kernel kept why)",
    ]
    assert [s["tried"] for s in why] == [None] * 6
    assert replayed.code == 0, replayed.out + replayed.err
    assert cli(capsys, "replay", run_id, "--store", store).code == 0


def test_a_waiting_run_recorded_without_tried_resumes_without_diverging(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store, old, workflow = tmp_path / "runs.db", tmp_path / "old.db", tmp_path / "deploy.yaml"
    workflow.write_text(WAIT)
    server.enqueue(text_reply("planned"), text_reply("deployed"))
    run_id = _run(capsys, server, workflow, store, tmp_path).json()["run_id"]
    _strip_tried(store, old, run_id)

    done = cli(capsys, "signal", run_id, "ci_passed", "--store", old, "--json")

    assert done.code == 0, done.err
    assert json.loads(done.out)["response"] == "deployed"
    assert "diverged" not in done.err
    taken = _taken(old, run_id)
    assert [(d["source"], d["target"]) for d in taken] == [
        ("plan", "wait_for_ci"), ("wait_for_ci", "deploy"), ("deploy", "done"),
    ]  # fmt: skip
    assert "tried" not in taken[0]  # the step recorded before stays as it was
    assert taken[1]["tried"] == [
        {"edge": 1, "target": "deploy", "checks": [{"check": "event ci_passed", "value": True}],
         "passed": True},
    ]  # fmt: skip
