"""Declared `migrations:` (issue 27, part 6): a run pinned to version 1 moves to version 2 whose
states were renamed and whose edges were renumbered, by `--migrate` from the CLI and
`Agent.resume(migrate=True)` from Python; the log records the translation, so the catch-up of
that resume and every later resume and replay match the recorded steps exactly (no model call
made twice, no event recorded twice); an undeclared rename is refused; validate checks the
`migrations:` block at file:line:col."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsm_kernel import Agent
from fsm_kernel.protocol import EventType
from fsm_kernel.store import SqliteEventStore
from fsm_kernel.workflow.loader import load_workflow_text
from fsm_kernel.workflow.migrations import Translation, translate_log, translation_between
from tests.clikit import cli
from tests.fakes.openai_server import FakeOpenAIServer, text_reply

V1 = """\
name: release
version: 1
reasons:
  rejected: {description: CI said no}
initial: plan
states:
  plan: {action: agent.think, prompt: Plan the release.}
  wait_for_ci: {description: waits for CI}
  deploy: {action: agent.think, prompt: Deploy it.}
  wait_for_smoke: {description: waits for the smoke test}
  done: {final: true}
  stopped: {final: true}
transitions:
  - {source: plan, target: wait_for_ci}
  - {source: wait_for_ci, target: deploy, event: ci_passed}
  - {source: wait_for_ci, target: stopped, event: ci_failed, reason: rejected}
  - {source: deploy, target: wait_for_smoke}
  - {source: wait_for_smoke, target: done, event: smoke_passed, reason: final_answer}
"""

# Version 2: plan is now `planning`, wait_for_ci is `await_ci`, and an edge is inserted first
# (every recorded edge index moves by one); what the run recorded is decided the same way.
V2 = """\
name: release
version: 2
migrations:
  - {from: 1, rename_states: {plan: planning, wait_for_ci: await_ci}}
reasons:
  rejected: {description: CI said no}
  abandoned: {description: nobody answered}
initial: planning
states:
  planning: {action: agent.think, prompt: Plan the release.}
  await_ci: {description: waits for CI}
  deploy: {action: agent.think, prompt: Deploy it.}
  wait_for_smoke: {description: waits for the smoke test}
  done: {final: true}
  stopped: {final: true}
transitions:
  - {source: await_ci, target: stopped, event: abandon, reason: abandoned}
  - {source: planning, target: await_ci}
  - {source: await_ci, target: deploy, event: ci_passed}
  - {source: await_ci, target: stopped, event: ci_failed, reason: rejected}
  - {source: deploy, target: wait_for_smoke}
  - {source: wait_for_smoke, target: done, event: smoke_passed, reason: final_answer}
"""


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


def _start(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> tuple[Path, Path, str]:
    store, workflow = tmp_path / "runs.db", tmp_path / "release.yaml"
    workflow.write_text(V1)
    server.enqueue(text_reply("planned"))
    first = cli(capsys, "run", str(workflow), "-p", "ship v2", "--base-url", server.base_url,
                "--model", "m", "--store", str(store), "--max-retries", "0", "--json")  # fmt: skip
    assert first.code == 3, first.out + first.err
    return store, workflow, str(first.json()["run_id"])


def _events(store: Path, run_id: str) -> list[tuple[str, dict[str, object]]]:
    with SqliteEventStore(store) as events:
        return [(e.type.value, e.data) for e in events.read(run_id)]


def _taken(store: Path, run_id: str) -> list[tuple[object, object, object]]:
    return [
        (d["source"], d["target"], d["index"])
        for t, d in _events(store, run_id)
        if t == "transition.taken"
    ]


def test_translation_renames_states_and_renumbers_edges() -> None:
    old = load_workflow_text(V1, path="v1.yaml")
    new = load_workflow_text(V2, path="v2.yaml")

    move = translation_between(old, new)

    assert move.state("plan") == "planning"
    assert move.state("wait_for_ci") == "await_ci"
    assert move.state("deploy") == "deploy"
    assert dict(move.edges) == {0: 1, 1: 2, 2: 3, 3: 4, 4: 5}
    assert move.to_dict() == {
        "states": {"plan": "planning", "wait_for_ci": "await_ci"},
        "edges": {"0": 1, "1": 2, "2": 3, "3": 4, "4": 5},
    }
    assert Translation.from_dict(move.to_dict()) == Translation(
        {"plan": "planning", "wait_for_ci": "await_ci"}, {0: 1, 1: 2, 2: 3, 3: 4, 4: 5}
    )


def test_an_edge_the_new_version_dropped_gets_a_number_no_edge_has() -> None:
    old = load_workflow_text(V1, path="v1.yaml")
    dropped = V2.replace(
        "  - {source: await_ci, target: stopped, event: ci_failed, reason: rejected}\n", ""
    )

    move = translation_between(old, load_workflow_text(dropped, path="v2.yaml"))

    assert move.edge(2) == -3  # ci_failed's edge is gone
    assert move.edge(1) == 2


def test_a_cli_migration_moves_a_waiting_run_and_every_later_resume_matches_its_log(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store, workflow, run_id = _start(server, tmp_path, capsys)
    workflow.write_text(V2)
    server.enqueue(text_reply("deployed"))

    moved = cli(capsys, "signal", run_id, "ci_passed", "--migrate", "--store", str(store),
                "--json")  # fmt: skip
    smoke = cli(capsys, "signal", run_id, "smoke_passed", "--store", str(store), "--json")
    replay = cli(capsys, "replay", run_id, "--store", str(store))

    assert moved.code == 3, moved.out + moved.err  # now waits for the smoke test
    assert moved.json()["waiting_for"]["state"] == "wait_for_smoke"
    assert smoke.code == 0, smoke.out + smoke.err
    assert smoke.json()["termination_reason"] == "final_answer"
    resumed = [d for t, d in _events(store, run_id) if t == "run.resumed"]
    assert resumed[0]["translation"] == {
        "states": {"plan": "planning", "wait_for_ci": "await_ci"},
        "edges": {"0": 1, "1": 2, "2": 3, "3": 4, "4": 5},
    }
    assert resumed[1]["translation"] is None
    # each step recorded once: the prefix in v1's names and numbers as it was written, the rest
    # under v2's
    assert _taken(store, run_id) == [
        ("plan", "wait_for_ci", 0),
        ("await_ci", "deploy", 2),
        ("deploy", "wait_for_smoke", 4),
        ("wait_for_smoke", "done", 5),
    ]
    types = [t for t, _ in _events(store, run_id)]
    assert types.count("model.requested") == 2  # plan once, deploy once: nothing redone
    assert types.count("event.delivered") == 2
    assert len(server.requests) == 2
    assert replay.code == 0, replay.out + replay.err
    assert "planning → await_ci" in replay.out  # read under the names it follows now
    assert replay.out.splitlines()[-1].startswith("identical: 4 transitions")


def test_an_undeclared_rename_is_refused_and_nothing_recorded(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store, workflow, run_id = _start(server, tmp_path, capsys)
    before = _events(store, run_id)
    workflow.write_text(V2.replace("wait_for_ci: await_ci", "wait_for_ci: deploy_gate"))
    workflow.write_text(
        V2.replace(
            "  - {from: 1, rename_states: {plan: planning, wait_for_ci: await_ci}}\n", ""
        ).replace("migrations:\n", "")
    )

    refused = cli(capsys, "signal", run_id, "ci_passed", "--migrate", "--store", str(store))

    assert refused.code == 2
    assert refused.err.count("\n") == 1, refused.err
    assert "cannot migrate run" in refused.err
    assert "it recorded plan → wait_for_ci" in refused.err
    assert _events(store, run_id) == before


def test_the_python_api_migrates_with_resume_and_signal(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store, workflow, run_id = _start(server, tmp_path, capsys)
    workflow.write_text(V2)
    server.enqueue(text_reply("deployed"))

    async def go() -> tuple[str, str | None]:
        agent = Agent(str(workflow), store=str(store), base_url=server.base_url, model="m")
        async with agent:
            result = await agent.signal(run_id, "ci_passed", migrate=True)
        return result.status, (result.waiting_for or {}).get("state")

    assert asyncio.run(go()) == ("waiting", "wait_for_smoke")
    assert [t for t, _ in _events(store, run_id)].count("model.requested") == 2


def test_translate_log_applies_a_recorded_translation_to_the_events_before_it(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store, workflow, run_id = _start(server, tmp_path, capsys)
    workflow.write_text(V2)
    server.enqueue(text_reply("deployed"))
    cli(capsys, "signal", run_id, "ci_passed", "--migrate", "--store", str(store))

    with SqliteEventStore(store) as events:
        log = translate_log(events.read(run_id))

    taken = [
        (e.data["source"], e.data["index"]) for e in log if e.type is EventType.TRANSITION_TAKEN
    ]
    assert taken == [("planning", 1), ("await_ci", 2), ("deploy", 4)]
    assert [e.state for e in log if e.type is EventType.MODEL_REQUESTED] == ["planning", "deploy"]


@pytest.mark.parametrize(
    ("edit", "where", "message"),
    [
        (lambda t: t.replace("version: 2\n", ""), ":3:3:", "migrations: need the workflow's own"),
        (lambda t: t.replace("{from: 1,", "{from: 2,"), ":4:12:", "from 2 is not below"),
        (lambda t: t.replace("plan: planning", "plan: plans"), ":4:37:", "no state 'plans'"),
        (
            lambda t: t.replace("plan: planning", "deploy: planning"),
            ":4:31:",
            "'deploy' is still a state",
        ),
    ],
)
def test_validate_checks_the_migrations_block(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: object, where: str, message: str
) -> None:
    workflow = tmp_path / "v2.yaml"
    workflow.write_text(edit(V2))  # type: ignore[operator]

    checked = cli(capsys, "validate", str(workflow))

    assert checked.code == 2, checked.out
    assert message in checked.err
    assert f"{workflow}{where}" in checked.err, checked.err
