"""A compound state's `after:` deadline from the CLI against the fake OpenAI-compatible server
over loopback: a short deadline is waited for in process by a waiting child and fires (the run
ends with the deadline's reason, exit 1); `runs show` and `replay` read it back; a run that
signals in time ends normally with the deadline cancelled."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fsm_kernel.protocol import EventType
from fsm_kernel.store import SqliteEventStore
from tests.clikit import cli
from tests.fakes.openai_server import FakeOpenAIServer, text_reply

WORKFLOW = """\
name: release_deadline
reasons:
  out_of_time: {description: the release took too long}
initial: release
states:
  release:
    initial: build
    states:
      build: {action: agent.think, prompt: Build it.}
      wait_ci: {description: waits for CI}
      shipped: {final: true}
  done: {final: true}
  late: {final: true}
transitions:
  - {source: release, target: late, after: 1s, reason: out_of_time}
  - {source: build, target: wait_ci}
  - {source: wait_ci, target: shipped, event: ci_passed}
  - {source: release, target: done, guard: completed, reason: final_answer}
"""


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


def test_a_compound_deadline_fires_in_process_and_replays_identically(
    tmp_path: Path, server: FakeOpenAIServer, capsys: pytest.CaptureFixture[str]
) -> None:
    workflow, store = tmp_path / "release.yaml", tmp_path / "runs.db"
    workflow.write_text(WORKFLOW)
    server.enqueue(text_reply("built"))

    ran = cli(capsys, "run", str(workflow), "-p", "ship", "--base-url", server.base_url,
              "--model", "m", "--store", str(store), "--json")  # fmt: skip

    assert ran.code == 1, ran.out + ran.err
    assert ran.json()["termination_reason"] == "out_of_time"
    run_id = str(ran.json()["run_id"])
    with SqliteEventStore(store) as events:
        log = events.read(run_id)
    timers = [(e.type.value, e.data.get("edge")) for e in log if e.type.value.startswith("timer")]
    assert timers == [("timer.set", 0), ("timer.fired", 0)]
    last = [e.data for e in log if e.type is EventType.TRANSITION_TAKEN][-1]
    assert (last["from"], last["to"], last["guard"]) == ("release.wait_ci", "late", "after 1s")
    replay = cli(capsys, "replay", run_id, "--store", str(store))
    assert replay.code == 0, replay.out + replay.err
    assert replay.out.splitlines()[-1].startswith("identical: 2 transitions, reason out_of_time")


def test_validate_accepts_the_deadline_and_the_diagram_labels_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workflow = tmp_path / "release.yaml"
    workflow.write_text(WORKFLOW)

    checked = cli(capsys, "validate", str(workflow))
    drawn = cli(capsys, "diagram", str(workflow), "--format", "mermaid")

    assert checked.code == 0, checked.err
    assert drawn.code == 0, drawn.err
    assert "release --> late : 1. [after 1s] → out_of_time" in drawn.out
