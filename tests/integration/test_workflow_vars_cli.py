"""Declared variables end to end: the real CLI against the fake model server over loopback.
Assignments are recorded (vars.assigned), a `when:` reads them, a replay reproduces them
identically, a resume after a crash rebuilds them, and a value failing its schema is a failure
of the state that `catch:` routes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from fsm_kernel.protocol import Event, EventType
from tests.integration.test_resume_replay import (
    _cli,
    _env,
    _events,
    _has_event,
    _kill,
    _wait_until,
    servers,  # noqa: F401 (a fixture)
)

COUNTER = """\
name: counter
variables:
  attempts: {type: integer, default: 0}
  plan: {type: array, items: {type: string}}
initial: plan
states:
  plan:
    action: agent.think
    answer: false
    output:
      type: object
      properties: {steps: {type: array, items: {type: string}}}
      required: [steps]
    assign: {plan: "output.steps"}
  work: {action: agent.think, assign: {attempts: "vars.attempts + 1"}}
  done: {final: true}
transitions:
  - {source: plan, target: work}
  - source: work
    target: done
    when: "vars.attempts >= size(vars.plan)"
    assign: {plan: "vars.plan + ['done']"}
    reason: final_answer
  - {source: work, target: work}
"""

EXPECTED = [
    {"name": "plan", "value": ["a", "b"], "state": "plan"},
    {"name": "attempts", "value": 1, "state": "work"},
    {"name": "attempts", "value": 2, "state": "work"},
    {"name": "plan", "value": ["a", "b", "done"], "transition": 1},
]


def assigned(events: list[Event]) -> list[dict[str, object]]:
    return [e.data for e in events if e.type == EventType.VARS_ASSIGNED]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_cli(*args), env=_env(), capture_output=True, text=True, timeout=60)


def test_assignments_are_recorded_and_replayed_identically(tmp_path: Path, servers) -> None:  # noqa: F811
    workflow = tmp_path / "counter.yaml"
    workflow.write_text(COUNTER)
    store = tmp_path / "runs.db"
    server = servers("s", ['{"steps": ["a", "b"]}', "one", "two"])

    out = run_cli("run", str(workflow), "--prompt", "go", "--base-url", server.base_url,
                  "--store", str(store), "--json")  # fmt: skip

    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["termination_reason"] == "final_answer"
    events = _events(store)
    assert assigned(events) == EXPECTED
    replay = run_cli("replay", events[0].run_id, "--store", str(store), "--json")
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert json.loads(replay.stdout)["identical"] is True


def test_a_resume_after_a_crash_rebuilds_the_variables(tmp_path: Path, servers) -> None:  # noqa: F811
    workflow = tmp_path / "counter.yaml"
    workflow.write_text(COUNTER)
    store = tmp_path / "runs.db"
    first = servers("first", ['{"steps": ["a", "b"]}', "one", {"hang": 60}])
    proc = subprocess.Popen(
        _cli("run", str(workflow), "--prompt", "go", "--base-url", first.base_url,
             "--store", str(store)),
        env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    _wait_until(lambda: first.request_count() >= 3, "the third model request")
    _wait_until(_has_event(store, EventType.MODEL_REQUESTED, 3), "model.requested recorded")
    _kill(proc)
    before = _events(store)
    assert assigned(before) == EXPECTED[:2]

    second = servers("second", ["two"])
    out = run_cli("resume", before[0].run_id, "--base-url", second.base_url,
                  "--store", str(store), "--json")  # fmt: skip

    assert out.returncode == 0, out.stderr
    assert second.request_count() == 1
    after = _events(store)
    assert after[: len(before)] == before, "nothing recorded is rewritten"
    # attempts went on from 1 (rebuilt from the log), and the when: saw 2 >= size(plan)
    assert assigned(after) == EXPECTED


@pytest.mark.parametrize("caught", [True, False])
def test_a_value_failing_its_schema_fails_the_state(
    tmp_path: Path,
    servers,  # noqa: F811
    caught: bool,
) -> None:
    text = COUNTER.replace("attempts: {type: integer, default: 0}",
                           "attempts: {type: integer, default: 0, maximum: 1}")  # fmt: skip
    if caught:
        text = text.replace(
            '  work: {action: agent.think, assign: {attempts: "vars.attempts + 1"}}',
            '  work: {action: agent.think, assign: {attempts: "vars.attempts + 1"}, '
            "catch: [{error: error, target: gave_up, reason: error}]}\n"
            "  gave_up: {final: true}",
        )
    workflow = tmp_path / "counter.yaml"
    workflow.write_text(text)
    store = tmp_path / "runs.db"
    server = servers("s", ['{"steps": ["a", "b", "c"]}', "one", "two"])

    out = run_cli("run", str(workflow), "--prompt", "go", "--base-url", server.base_url,
                  "--store", str(store), "--json")  # fmt: skip

    assert out.returncode != 0
    events = _events(store)
    assert [a["value"] for a in assigned(events) if a["name"] == "attempts"] == [1]
    ended = next(e for e in events if e.type == EventType.RUN_TERMINATED).data
    assert ended["reason"] == "error"
    message = "assign attempts: 2 does not fit its schema: 2 is greater than the maximum of 1"
    if caught:
        routed = [e for e in events if e.type == EventType.ERROR_CAUGHT]
        assert len(routed) == 1
        assert message in json.dumps(routed[0].data)
        assert [e.data["target"] for e in events if e.type == EventType.TRANSITION_TAKEN][-1] == (
            "gave_up"
        )
    else:
        assert message in (ended.get("error") or ""), ended
