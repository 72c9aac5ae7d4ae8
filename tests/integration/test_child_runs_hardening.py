"""Child runs on hostile input, through the CLI and the Python API against the fake server: a
map over a list far longer than its `max_items` starts no child, a chain of calls deeper than
MAX_CALL_DEPTH is refused at that depth (and the deepest allowed chain runs), and a child that
failed fails a parent that does not route `child_failed`, all the way up a chain of calls."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import fsm_kernel
from fsm_kernel.protocol import EventType
from fsm_kernel.store import SqliteEventStore
from fsm_kernel.workflow.limits import MAX_CALL_DEPTH
from fsm_kernel.workflow.spec import WorkflowSpec
from tests.fakes.openai_server import FakeOpenAIServer, http_error, text_reply
from tests.integration.test_child_runs import DATA, run_cli

PLAN_AND_MAP = """\
name: mapper
tools: []
limits: {max_iterations: 30}
initial: plan
states:
  plan:
    action: agent.think
    answer: false
    output: {type: object, properties: {steps: {type: array}}, required: [steps]}
  work:
    action: workflow.map
    workflow: @STEP@
    items: output.steps
    max_concurrency: 2@MORE@
  terminate: {final: true}
transitions:
  - {source: plan, target: work}
  - {source: work, target: terminate, guard: child_succeeded, reason: final_answer}
  - {source: work, target: terminate, reason: steps_failed}
reasons:
  steps_failed: {description: a step did not succeed}
  plan_too_long: {description: more steps than the map takes}
"""


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer(stream_style=None) as fake:
        yield fake


def mapper(tmp_path: Path, more: str = "") -> Path:
    path = tmp_path / "mapper.yaml"
    path.write_text(PLAN_AND_MAP.replace("@STEP@", str(DATA / "step.yaml")).replace("@MORE@", more))
    return path


def runs_in(store: Path) -> list[Any]:
    with SqliteEventStore(store) as events:
        return list(events.list_runs())


def log_of(store: Path, run_id: str) -> list[Any]:
    with SqliteEventStore(store) as events:
        return list(events.read(run_id))


def error_of(store: Path, run_id: str) -> str:
    """The error a run's `run.terminated` records."""
    (ended,) = [e for e in log_of(store, run_id) if e.type is EventType.RUN_TERMINATED]
    return str(ended.data.get("error") or "")


# --- workflow.map: max_items ----------------------------------------------------------------


def test_a_map_over_100000_items_starts_no_child_and_fails_its_state(
    capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer, tmp_path: Path
) -> None:
    store = tmp_path / "r.db"
    server.enqueue(text_reply(json.dumps({"steps": [f"s{i}" for i in range(100_000)]})))

    done = run_cli(capsys, server, "run", mapper(tmp_path), "-p", "go", "--store", store, "--json")

    assert done.code == 1
    result = done.json()
    assert result["termination_reason"] == "error"
    assert result["error"] == (
        "state 'work' was given 100,000 items (output.steps), more than its max_items = 100: "
        "no child was started"
    )
    assert len(server.requests) == 1  # the plan only
    assert [r.run_id for r in runs_in(store)] == [result["run_id"]]
    types = {e.type for e in log_of(store, result["run_id"])}
    assert EventType.CHILD_STARTED not in types


def test_max_items_is_the_states_to_set_and_going_over_it_is_caught(
    capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer, tmp_path: Path
) -> None:
    catching = (
        "\n    max_items: 3\n    catch: [{error: error, target: terminate, reason: plan_too_long}]"
    )
    workflow = mapper(tmp_path, catching)
    server.enqueue(text_reply(json.dumps({"steps": ["a", "b", "c", "d"]})))

    over = run_cli(capsys, server, "run", workflow, "-p", "go", "--store", tmp_path / "1.db",
                   "--json")  # fmt: skip

    assert over.json()["termination_reason"] == "plan_too_long"
    assert len(runs_in(tmp_path / "1.db")) == 1
    server.enqueue(text_reply(json.dumps({"steps": ["a", "b", "c"]})), *[text_reply("ok")] * 3)
    fits = run_cli(capsys, server, "run", workflow, "-p", "go", "--store", tmp_path / "2.db",
                   "--json")  # fmt: skip
    assert fits.json()["termination_reason"] == "final_answer"
    assert len(runs_in(tmp_path / "2.db")) == 4


def test_validate_bounds_max_items(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from tests.clikit import cli

    too_many = cli(capsys, "validate", str(mapper(tmp_path, "\n    max_items: 10001")))
    assert too_many.code == 2
    assert "max_items: Input should be less than or equal to 10000" in too_many.err
    fine = cli(capsys, "validate", str(mapper(tmp_path, "\n    max_items: 10000")))
    assert fine.code == 0, fine.err


# --- chains of calls: MAX_CALL_DEPTH -------------------------------------------------------


def chain(folder: Path, files: int, *, first: int = 0) -> Path:
    """Files c{first}.yaml … each calling the next, the last answering with one model call;
    no state routes on its child's outcome. Returns the first."""
    folder.mkdir(exist_ok=True)
    last = first + files - 1
    for i in range(first, last + 1):
        state = (
            "{action: agent.think}"
            if i == last
            else f"{{action: workflow.call, workflow: c{i + 1}.yaml}}"
        )
        (folder / f"c{i}.yaml").write_text(
            f"name: c{i}\ntools: []\ninitial: call\nstates:\n  call: {state}\n"
            "  end: {final: true}\n"
            "transitions:\n  - {source: call, target: end, reason: final_answer}\n"
        )
    return folder / f"c{first}.yaml"


def test_the_deepest_chain_of_calls_allowed_runs_to_its_end(
    capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer, tmp_path: Path
) -> None:
    store = tmp_path / "r.db"
    top = chain(tmp_path / "chain", MAX_CALL_DEPTH + 1)  # runs at depths 0 … 32
    server.enqueue(text_reply("from the bottom"))

    done = run_cli(capsys, server, "run", top, "-p", "dig", "--store", store, "--json")

    assert done.code == 0, done.err
    assert done.json()["response"] == "from the bottom"
    runs = runs_in(store)
    assert len(runs) == MAX_CALL_DEPTH + 1
    assert {r.termination_reason for r in runs} == {"final_answer"}


def test_a_call_past_max_call_depth_fails_its_state_and_every_caller(tmp_path: Path) -> None:
    # c1 … c33 are each a valid chain on their own; a top built in code (never validated as a
    # whole) calling c1 makes c32 the run at depth 32, which may not start c33.
    first = chain(tmp_path / "chain", MAX_CALL_DEPTH + 1, first=1)
    top = WorkflowSpec.model_validate(
        {
            "name": "top",
            "tools": [],
            "initial": "call",
            "states": {
                "call": {"action": "workflow.call", "workflow": str(first)},
                "end": {"final": True},
            },
            "transitions": [{"source": "call", "target": "end", "reason": "final_answer"}],
        }
    )
    store = tmp_path / "r.db"
    with FakeOpenAIServer(stream_style=None) as server:
        server.enqueue(text_reply("never asked"))
        result = fsm_kernel.run(top, "dig", base_url=server.base_url, model="m", store=store)
        assert server.requests == []

    refused = (
        f"state 'call' cannot start 'c33.yaml': this run is already 32 workflow calls deep, the "
        f"most calls may nest (MAX_CALL_DEPTH = {MAX_CALL_DEPTH})"
    )
    assert result.termination_reason == "error"
    assert result.error is not None
    assert result.error.endswith(refused)
    assert result.error.startswith(
        "state 'call': its child did not succeed and no edge of the state routes child_failed; "
        "the child run "
    )
    assert len(result.error) < 1000
    runs = {r.workflow: r for r in runs_in(store)}
    assert len(runs) == MAX_CALL_DEPTH + 1  # depths 0 … 32: c33 never started
    assert "c33" not in runs
    assert runs["c32"].termination_reason == "error"
    deepest = log_of(store, runs["c32"].run_id)
    assert deepest[-1].data["error"] == refused
    assert EventType.CHILD_STARTED not in {e.type for e in deepest}
    assert all("RecursionError" not in error_of(store, r.run_id) for r in runs.values())


# --- a failed child fails a parent that does not route on it -----------------------------


def test_a_failure_deep_in_a_chain_that_routes_on_nothing_fails_the_top_run(
    capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer, tmp_path: Path
) -> None:
    store = tmp_path / "r.db"
    top = chain(tmp_path / "chain", 4)
    server.enqueue(http_error(400))  # the bottom run's model call fails

    done = run_cli(capsys, server, "run", top, "-p", "dig", "--store", store, "--json")

    assert done.code == 1
    result = done.json()
    assert result["termination_reason"] == "error"
    assert result["error"].startswith("state 'call': its child did not succeed and no edge")
    runs = {r.workflow: r for r in runs_in(store)}
    assert runs["c3"].termination_reason == "agent_error"
    assert [runs[f"c{i}"].termination_reason for i in range(3)] == ["error"] * 3
    bottom = error_of(store, runs["c3"].run_id)
    assert bottom
    assert error_of(store, runs["c2"].run_id).endswith(f"ended agent_error: {bottom}")


def test_a_failed_child_goes_to_the_callers_catch_or_its_child_failed_edge(
    capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer, tmp_path: Path
) -> None:
    chain(tmp_path, 2, first=1)
    catching = tmp_path / "catching.yaml"
    catching.write_text(
        "name: catching\ntools: []\ninitial: call\nstates:\n"
        "  call:\n    action: workflow.call\n    workflow: c1.yaml\n"
        "    catch: [{error: error, target: end, reason: gave_up}]\n"
        "  end: {final: true}\n"
        "transitions:\n  - {source: call, target: end, reason: final_answer}\n"
        "reasons: {gave_up: {description: the child failed}}\n"
    )
    server.enqueue(http_error(400))
    caught = run_cli(capsys, server, "run", catching, "-p", "x", "--store", tmp_path / "1.db",
                     "--json")  # fmt: skip
    assert (caught.code, caught.json()["termination_reason"]) == (1, "gave_up")

    routing = tmp_path / "routing.yaml"
    routing.write_text(
        catching.read_text()
        .replace("name: catching", "name: routing")
        .replace(
            "transitions:\n",
            "transitions:\n  - {source: call, target: end, guard: child_failed, reason: gave_up}\n",
        )
        .replace("    catch: [{error: error, target: end, reason: gave_up}]\n", "")
    )
    server.enqueue(http_error(400))
    routed = run_cli(capsys, server, "run", routing, "-p", "x", "--store", tmp_path / "2.db",
                     "--json")  # fmt: skip
    assert (routed.code, routed.json()["termination_reason"]) == (1, "gave_up")
    assert "error" not in routed.json() or routed.json()["error"] is None
