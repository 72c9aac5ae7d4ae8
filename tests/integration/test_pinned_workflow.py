"""Runs pinned to the workflow they started with (issue 27, part 6), through the CLI against the
fake model server over loopback: run.started records the workflow's text and version; after
the file is edited so that it would decide differently, `signal`/`resume` and `replay` still
follow the recorded definition; `runs show` says which version the run is pinned to and that
the file now says another; a log without a recorded text keeps the file-on-disk behaviour."""

from __future__ import annotations

import json
import sqlite3
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fsm_kernel.protocol import EventType
from fsm_kernel.store import SqliteEventStore
from tests.clikit import cli
from tests.fakes.openai_server import FakeOpenAIServer, text_reply
from tests.integration.test_resume_replay import (  # the crash-and-resume harness
    CRASH_WORKFLOW,
    ScriptServer,
    _cli,
    _env,
    _kill,
    _wait_until,
    servers,  # noqa: F401 (a fixture)
)
from tests.integration.test_resume_replay import _events as _events_of

WORKFLOW = """\
name: deploy_on_ci
version: 1
reasons:
  rejected: {description: CI said no}
initial: plan
states:
  plan: {action: agent.think, prompt: Plan the deploy.}
  wait_for_ci: {description: waits for CI}
  deploy: {action: agent.think, prompt: Deploy it.}
  done: {final: true}
  stopped: {final: true}
transitions:
  - {source: plan, target: wait_for_ci}
  - {source: wait_for_ci, target: deploy, event: ci_passed}
  - {source: wait_for_ci, target: stopped, event: ci_failed, reason: rejected}
  - {source: deploy, target: done, reason: final_answer}
"""

# Version 2 decides differently on the same event: ci_passed now stops the run.
EDITED = (
    WORKFLOW.replace("version: 1", "version: 2")
    .replace(
        "target: deploy, event: ci_passed", "target: stopped, event: ci_passed, reason: rejected"
    )
    .replace(
        "target: stopped, event: ci_failed, reason: rejected", "target: deploy, event: ci_failed"
    )
)


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


def _start(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> tuple[Path, Path, str]:
    store, workflow = tmp_path / "runs.db", tmp_path / "deploy.yaml"
    workflow.write_text(WORKFLOW)
    server.enqueue(text_reply("planned"))
    first = cli(capsys, "run", str(workflow), "-p", "ship v2", "--base-url", server.base_url,
                "--model", "m", "--store", str(store), "--max-retries", "0", "--json")  # fmt: skip
    assert first.code == 3, first.out + first.err
    return store, workflow, str(first.json()["run_id"])


def _events(store: Path, run_id: str) -> list[tuple[str, dict[str, object]]]:
    with SqliteEventStore(store) as events:
        return [(e.type.value, e.data) for e in events.read(run_id)]


def test_run_started_records_the_workflow_text_and_version(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store, _, run_id = _start(server, tmp_path, capsys)

    started = _events(store, run_id)[0][1]

    assert started["workflow_text"] == WORKFLOW
    assert started["workflow_version"] == 1


def test_a_run_resumed_after_its_file_was_edited_follows_its_pinned_version(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store, workflow, run_id = _start(server, tmp_path, capsys)
    workflow.write_text(EDITED)  # would stop the run on ci_passed

    shown = cli(capsys, "runs", "show", run_id, "--store", str(store))
    shown_json = cli(capsys, "runs", "show", run_id, "--store", str(store), "--json").json()
    server.enqueue(text_reply("deployed"))
    done = cli(capsys, "signal", run_id, "ci_passed", "--store", str(store), "--json")

    assert shown.code == 0
    assert "definition: pinned to version 1" in shown.out
    assert "the file now says version 2" in shown.out
    pinned = shown_json["termination"]["pinned"]
    assert (pinned["version"], pinned["file_version"], pinned["file_changed"]) == (1, 2, True)
    assert done.code == 0, done.out + done.err
    assert done.json()["response"] == "deployed"
    taken = [
        (d["source"], d["target"]) for t, d in _events(store, run_id) if t == "transition.taken"
    ]
    assert taken == [("plan", "wait_for_ci"), ("wait_for_ci", "deploy"), ("deploy", "done")]
    resumed = next(d for t, d in _events(store, run_id) if t == "run.resumed")
    assert resumed["forced"] is False
    assert resumed["workflow_text"] is None  # the definition did not change: not recorded again

    replay = cli(capsys, "replay", run_id, "--store", str(store))
    assert replay.code == 0, replay.out + replay.err
    assert replay.out.splitlines()[-1].startswith("identical: 3 transitions, reason final_answer")
    what_if = cli(capsys, "replay", run_id, "--store", str(store), "--workflow", str(workflow))
    assert what_if.code == 1  # the edited file, given explicitly, decides differently
    assert "diverged at step 2" in what_if.out


def test_a_forced_resume_moves_the_run_to_the_new_file_for_later_resumes(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store, workflow, run_id = _start(server, tmp_path, capsys)
    workflow.write_text(EDITED)

    refused = cli(capsys, "signal", run_id, "ci_failed", "--store", str(store),
                  "--workflow", str(workflow))  # fmt: skip
    server.enqueue(text_reply("deployed"))
    forced = cli(capsys, "signal", run_id, "ci_failed", "--store", str(store),
                 "--workflow", str(workflow), "--force", "--json")  # fmt: skip

    assert refused.code == 2
    assert "the workflow changed since run" in refused.err
    assert forced.code == 0, forced.out + forced.err
    resumed = next(d for t, d in _events(store, run_id) if t == "run.resumed")
    assert (resumed["workflow_text"], resumed["workflow_version"]) == (EDITED, 2)
    shown = cli(capsys, "runs", "show", run_id, "--store", str(store))
    assert "definition: pinned to version 2" in shown.out
    assert "the file is unchanged" in shown.out
    replay = cli(capsys, "replay", run_id, "--store", str(store))
    assert replay.code == 0, replay.out + replay.err


def test_a_log_without_a_recorded_text_uses_the_file_checked_against_its_hash(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store, workflow, run_id = _start(server, tmp_path, capsys)
    with sqlite3.connect(store) as db:  # as an older fsm-kernel wrote it: no text
        db.execute(  # the store's only run
            "UPDATE events SET data = json_remove(data, '$.workflow_text') "
            "WHERE type = 'run.started'"
        )
    workflow.write_text(EDITED)

    refused = cli(capsys, "signal", run_id, "ci_passed", "--store", str(store))

    assert refused.code == 2
    assert "the workflow changed since run" in refused.err
    assert "workflow_text" not in json.dumps(_events(store, run_id)[0][1])


def test_migrate_refuses_an_edit_that_changes_a_recorded_decision(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store, workflow, run_id = _start(server, tmp_path, capsys)
    before = _events(store, run_id)
    # version 2 stops right after planning: the recorded plan → wait_for_ci would not happen
    workflow.write_text(
        EDITED.replace(
            "  - {source: plan, target: wait_for_ci}\n",
            "  - {source: plan, target: stopped, guard: has_answer, reason: rejected}\n"
            "  - {source: plan, target: wait_for_ci}\n",
        )
    )

    refused = cli(capsys, "resume", run_id, "--migrate", "--store", str(store))

    assert refused.code == 2
    lines = refused.err.strip().splitlines()
    assert len(lines) == 1, refused.err
    assert "cannot migrate run" in lines[0]
    assert "at step 1 (iteration 1) it recorded plan → wait_for_ci" in lines[0]
    assert "the new definition takes plan → stopped" in lines[0]
    assert "nothing was changed" in lines[0]
    assert _events(store, run_id) == before


def test_migrate_moves_a_waiting_run_to_an_edit_that_keeps_its_recorded_decisions(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store, workflow, run_id = _start(server, tmp_path, capsys)
    workflow.write_text(EDITED)  # changes only what happens next: ci_passed now stops

    no_event = cli(capsys, "resume", run_id, "--migrate", "--store", str(store))
    done = cli(capsys, "signal", run_id, "ci_passed", "--migrate", "--store", str(store), "--json")

    assert no_event.code == 2  # it waits for an event: resume alone cannot continue it
    assert "waits for an event" in no_event.err
    assert done.code == 1, done.out + done.err  # the new definition's decision
    assert done.json()["termination_reason"] == "rejected"
    resumed = [d for t, d in _events(store, run_id) if t == "run.resumed"]
    assert len(resumed) == 1
    assert (resumed[0]["forced"], resumed[0]["workflow_version"]) == (True, 2)
    assert resumed[0]["workflow_text"] == EDITED
    taken = [
        (d["source"], d["target"]) for t, d in _events(store, run_id) if t == "transition.taken"
    ]
    assert taken == [("plan", "wait_for_ci"), ("wait_for_ci", "stopped")]
    shown = cli(capsys, "runs", "show", run_id, "--store", str(store))
    assert "definition: pinned to version 2" in shown.out
    assert "the file is unchanged" in shown.out
    replay = cli(capsys, "replay", run_id, "--store", str(store))
    assert replay.code == 0, replay.out + replay.err  # replayed under the definition it moved to


@pytest.mark.parametrize(("value", "message"), [("0", "greater than or equal to 1"),
                                                ('"2"', "valid integer")])  # fmt: skip
def test_validate_rejects_a_version_that_is_not_a_positive_integer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str, message: str
) -> None:
    workflow = tmp_path / "bad.yaml"
    workflow.write_text(WORKFLOW.replace("version: 1", f"version: {value}"))

    checked = cli(capsys, "validate", str(workflow))

    assert checked.code == 2
    assert f"{workflow}:2:10: version: " in checked.err
    assert message in checked.err


def test_migrate_moves_an_interrupted_run_and_refuses_a_changed_decision(
    tmp_path: Path,
    servers: Callable[[str, list[object]], ScriptServer],  # noqa: F811 (the fixture)
) -> None:
    store, workflow = tmp_path / "runs.db", tmp_path / "wf.yaml"
    workflow.write_text(CRASH_WORKFLOW.read_text())
    first = servers("first", [{"hang": 60}])
    proc = subprocess.Popen(
        _cli("run", str(workflow), "--prompt", "x", "--base-url", first.base_url, "--store",
             str(store)),
        env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    _wait_until(lambda: first.request_count() >= 1, "the first model request")
    _kill(proc)  # interrupted in `think`, after observe → think was recorded
    run_id = _events_of(store)[0].run_id
    original = workflow.read_text()
    second = servers("second", ["Fine."])

    # observe now goes straight to the end: the recorded observe → think would not happen
    workflow.write_text(
        original.replace("version: 1\n", "").replace(
            "  - {source: observe,  target: think}\n",
            "  - {source: observe,  target: terminate, unless: has_answer, reason: done}\n"
            "  - {source: observe,  target: think}\n",
        )
    )
    before = len(_events_of(store))
    refused = subprocess.run(
        _cli("resume", run_id, "--migrate", "--base-url", second.base_url, "--store", str(store)),
        env=_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2, refused.stderr
    assert "cannot migrate run" in refused.stderr
    assert len(_events_of(store)) == before

    workflow.write_text(original.replace("max_iterations: 10", "max_iterations: 5"))
    migrated = subprocess.run(
        _cli("resume", run_id, "--migrate", "--base-url", second.base_url, "--store", str(store),
             "--json"),
        env=_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert migrated.returncode == 0, migrated.stderr
    resumed = [e.data for e in _events_of(store) if e.type == EventType.RUN_RESUMED]
    assert resumed[-1]["forced"] is True
    assert resumed[-1]["workflow_text"] == workflow.read_text()  # it follows the new file now
    assert json.loads(migrated.stdout)["termination_reason"] == "final_answer"
