"""`runs list` counts a run's iterations as the run's own result does (its model calls, as the
event log records them): a run that waits for a person, or ended, in the middle of an iteration
has made that iteration's call."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.clikit import Outcome, cli
from tests.fakes.openai_server import FakeOpenAIServer, call, http_error, text_reply, tool_reply


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


@pytest.fixture(params=["runs.db", "runs.jsonl"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    return tmp_path / str(request.param)


def listed(capsys: pytest.CaptureFixture[str], store: Path, *flags: str) -> tuple[int, int]:
    """The ITER column of the one listed run, and `iterations` of its JSON."""
    table = cli(capsys, "runs", "list", *flags, "--store", str(store))
    header, row = table.out.splitlines()
    column = header.index("ITER")
    as_json = cli(capsys, "runs", "list", *flags, "--json", "--store", str(store))
    return int(row[column : column + 4]), json.loads(as_json.out)[0]["iterations"]


def start(
    capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer, store: Path, workflow: str
) -> Outcome:
    return cli(capsys, "run", workflow, "-p", "read a", "--base-url", server.base_url,
               "--store", str(store), "--json")  # fmt: skip


def test_a_waiting_run_is_listed_with_the_iteration_it_waits_in(
    server: FakeOpenAIServer, store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(tool_reply(call("read_file", {"path": "a.txt"})), text_reply("Nothing."))
    waiting = start(capsys, server, store, "approve_tools")
    assert (waiting.code, waiting.json()["iterations"]) == (3, 1)

    assert listed(capsys, store, "--waiting") == (1, 1)
    assert listed(capsys, store) == (1, 1)

    run_id = waiting.json()["run_id"]
    done = cli(capsys, "resume", run_id, "--approve", "--store", str(store), "--json")
    assert (done.code, done.json()["iterations"]) == (0, 2)
    assert listed(capsys, store) == (2, 2)


def test_a_run_whose_model_call_failed_is_listed_with_that_call(
    server: FakeOpenAIServer, store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(http_error(401))
    failed = start(capsys, server, store, "default")
    assert (failed.code, failed.json()["termination_reason"]) == (1, "agent_error")

    assert listed(capsys, store) == (failed.json()["iterations"],) * 2
