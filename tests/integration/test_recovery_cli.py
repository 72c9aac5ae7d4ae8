"""`retry:`, `catch:` and a state's `agent:` from the CLI, over real HTTP to the fake
OpenAI-compatible server on loopback: a catch routes `agent_error` to a fallback state on
another model (one server answering per model name, and two servers), retries, a user's action
caught as `error`, the progress lines, replay and resume of such runs, and the diagram."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fsm_kernel.protocol import Event, EventType
from fsm_kernel.store import SqliteEventStore
from tests.clikit import Outcome, cli
from tests.fakes.openai_server import FakeOpenAIServer, Reply, http_error, text_reply

FALLBACK = """
# Answers on the big model; when its server keeps failing, on the small one.
name: fallback
tools: [datetime]
initial: think
states:
  think:
    action: agent.think
    retry: {error: agent_error, max_attempts: 1, backoff_seconds: 0}
    catch:
      - {error: agent_error, target: fallback}
  fallback:
    action: agent.think
    agent: {model: small, temperature: 0.2}
  done: {final: true}
transitions:
  - {source: think, target: done, reason: final_answer}
  - {source: fallback, target: done, reason: final_answer}
"""


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


def by_model(**replies: Reply) -> Any:
    """A reply chosen by the request's model name."""
    return lambda request: replies[request["model"]]


def write(tmp_path: Path, text: str, name: str = "fallback.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def run(
    capsys: pytest.CaptureFixture[str], workflow: Path, server: FakeOpenAIServer, store: Path
) -> Outcome:
    return cli(
        capsys,
        "run", workflow, "--prompt", "What is 6 x 7?", "--base-url", server.base_url,
        "--model", "big", "--store", store, "--workspace", workflow.parent,
    )  # fmt: skip


def events(store: Path) -> list[Event]:
    with SqliteEventStore(store) as s:
        (summary,) = s.list_runs()
        return s.read(summary.run_id)


def of_type(log: list[Event], type_: EventType) -> list[dict[str, Any]]:
    return [e.data for e in log if e.type == type_]


def test_catch_routes_agent_error_to_a_fallback_state_on_another_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer
) -> None:
    answer = by_model(big=http_error(500), small=text_reply("42, from the small model"))
    server.enqueue(answer, answer, answer)
    store = tmp_path / "runs.db"

    outcome = run(capsys, write(tmp_path, FALLBACK), server, store)

    assert outcome.code == 0, outcome.err
    assert outcome.out.splitlines()[0] == "42, from the small model"
    assert "termination: final_answer" in outcome.out
    assert [(r["model"], r.get("temperature")) for r in server.requests] == [
        ("big", None),
        ("big", None),
        ("small", 0.2),
    ]
    progress = outcome.err.splitlines()
    assert progress[1:6] == [
        "→ think",
        f"  ✗ think failed (attempt 1): AgentServerError: model server at {server.base_url} "
        "failed with 500: fake server error 500; retrying in 0s",
        f"  ✗ think failed: AgentServerError: model server at {server.base_url} failed with "
        "500: fake server error 500; caught → fallback",
        "→ fallback",
        "  42, from the small model",
    ]
    log = events(store)
    assert [d["guard"] for d in of_type(log, EventType.TRANSITION_TAKEN)] == [
        "catch agent_error",
        "",
    ]
    (caught,) = of_type(log, EventType.ERROR_CAUGHT)
    assert (caught["target"], caught["attempts"], caught["error"]["status_code"]) == (
        "fallback",
        2,
        500,
    )
    settings = log[0].data["settings"]
    assert settings["model"] == "big"
    assert settings["state_agents"] == {"fallback": {"model": "small", "temperature": 0.2}}
    server.assert_complete()


def test_a_fallback_on_another_server_never_gets_the_runs_api_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FSM_KERNEL_API_KEY", "sk-primary-secret")
    with FakeOpenAIServer() as primary, FakeOpenAIServer() as backup:
        primary.enqueue(http_error(503), http_error(503))
        backup.enqueue(text_reply("answer from the backup server"))
        own = f"agent: {{model: small, base_url: '{backup.base_url}'}}"
        text = FALLBACK.replace("agent: {model: small, temperature: 0.2}", own)
        store = tmp_path / "runs.db"

        outcome = run(capsys, write(tmp_path, text), primary, store)

        assert outcome.code == 0, outcome.err
        assert outcome.out.splitlines()[0] == "answer from the backup server"
        assert [h.get("authorization") for h in primary.request_headers] == [
            "Bearer sk-primary-secret"
        ] * 2
        assert [h.get("authorization") for h in backup.request_headers] == [None]
        assert [r["model"] for r in backup.requests] == ["small"]
        backup_url = backup.base_url
    settings = events(store)[0].data["settings"]
    assert settings["state_agents"] == {"fallback": {"model": "small", "base_url": backup_url}}
    assert "sk-primary-secret" not in store.read_bytes().decode("latin-1")


USER_ACTION = '''
"""A user's action that fails while the file `fail` is in the workspace."""
from pathlib import Path

def fetch(ctx):
    if Path("fail").exists():
        raise ConnectionResetError("upstream API went away")
    ctx.scratch["fetched"] = True
'''
USER_WORKFLOW = """
name: fetcher
initial: fetch_data
states:
  fetch_data:
    action: "fetch_mod:fetch"
    retry: {error: error, max_attempts: 2, backoff_seconds: 0}
    catch: [{error: any, target: explain}]
  explain:
    action: agent.think
    prompt: The data could not be fetched; say so.
  done: {final: true}
  fetched: {final: true}
transitions:
  - {source: fetch_data, target: fetched, reason: done}
  - {source: explain, target: done, reason: final_answer}
"""


def test_a_users_action_failure_is_retried_then_caught_and_replayed(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    server: FakeOpenAIServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (tmp_path / "fetch_mod.py").write_text(USER_ACTION)
    (tmp_path / "fail").write_text("")
    monkeypatch.chdir(tmp_path)
    server.enqueue(text_reply("Sorry: the upstream API went away."))
    store = tmp_path / "runs.db"

    outcome = run(capsys, write(tmp_path, USER_WORKFLOW, "fetcher.yaml"), server, store)

    assert outcome.code == 0, outcome.err
    assert outcome.out.splitlines()[0] == "Sorry: the upstream API went away."
    log = events(store)
    assert [d["attempt"] for d in of_type(log, EventType.ACTION_FAILED)] == [1, 2]
    (caught,) = of_type(log, EventType.ERROR_CAUGHT)
    assert caught["kind"] == "error"
    assert caught["error"] == {
        "type": "ConnectionResetError",
        "message": "upstream API went away",
    }
    assert server.requests[0]["messages"][-1] == {
        "role": "user",
        "content": "The data could not be fetched; say so.",
    }

    (tmp_path / "fail").unlink()  # the action would succeed now: replay follows the log
    replay = cli(capsys, "replay", log[0].run_id, "--store", store)

    assert replay.code == 0, replay.out + replay.err
    assert replay.out.splitlines()[:2] == [
        "= step   1 (iteration 0): fetch_data → explain [catch any]",
        "= step   2 (iteration 1): explain → done → final_answer",
    ]


def test_replay_and_resume_of_a_run_whose_fallback_failed_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer
) -> None:
    failing = by_model(big=http_error(500), small=http_error(503))
    server.enqueue(failing, failing, failing)
    store = tmp_path / "runs.db"
    workflow = write(tmp_path, FALLBACK)

    first = run(capsys, workflow, server, store)

    assert first.code == 1
    assert "termination: agent_error" in first.out
    run_id = events(store)[0].run_id
    replay = cli(capsys, "replay", run_id, "--store", store, "--json")
    report = replay.json()
    assert (replay.code, report["identical"], report["replayed_reason"]) == (
        0,
        True,
        "agent_error",
    )
    assert [s["recorded"] for s in report["steps"]] == ["think → fallback [catch agent_error]"]

    server.enqueue(by_model(small=text_reply("the small model is back")))
    resumed = cli(capsys, "resume", run_id, "--store", store)

    assert resumed.code == 0, resumed.err
    assert resumed.out.splitlines()[0] == "the small model is back"
    assert [r["model"] for r in server.requests] == ["big", "big", "small", "small"]
    log = events(store)
    assert [d["guard"] for d in of_type(log, EventType.TRANSITION_TAKEN)] == [
        "catch agent_error",
        "",
    ]
    assert len(of_type(log, EventType.ERROR_CAUGHT)) == 1
    assert cli(capsys, "replay", run_id, "--store", store).code == 0


def test_the_diagram_draws_the_catch_edge(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    outcome = cli(capsys, "diagram", write(tmp_path, FALLBACK), "--format", "dot")

    assert outcome.code == 0, outcome.err
    assert (
        'think -> fallback [label="catch agent_error" color="#b45309" fontcolor="#b45309" '
        "style=dashed]"
    ) in outcome.out
    assert json.dumps("dashed catch edge")[1:-1] in outcome.out
