"""A run whose process was killed is `interrupted` (and resumable) everywhere, not `running`
forever: its lock died with its process. And the commands that only read the event log write
nothing: a mistyped store is one line and exit 2, with no folder or empty store left behind.
(Issue 26, sections 3 and 4.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fsm_kernel.protocol import EventType
from fsm_kernel.store import SqliteEventStore
from tests.clikit import cli
from tests.fakes.openai_server import FakeOpenAIServer, hang, text_reply

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


def killed_run(store: Path, server: FakeOpenAIServer, workspace: Path) -> str:
    """A `fsm-kernel run` SIGKILLed while its model call hangs; its run id."""
    server.enqueue(hang(120, text_reply("never sent")))
    process = subprocess.Popen(
        [sys.executable, "-m", "fsm_kernel", "run", "single_shot", "--prompt", "What is 6 x 7?",
         "--base-url", server.base_url, "--model", "m", "--max-retries", "0",
         "--store", str(store), "--workspace", str(workspace)],
        cwd=REPO, env=dict(os.environ), stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        server.wait_for_requests(1, timeout=50)
        with SqliteEventStore(store) as log:
            (run,) = log.list_runs()
            assert (run.status, log.is_running(run.run_id)) == ("running", True)  # alive
    finally:
        process.send_signal(signal.SIGKILL)  # no cleanup code runs
        process.wait()
    return run.run_id


def test_a_killed_run_is_interrupted_everywhere_and_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer
) -> None:
    store = tmp_path / "runs.db"
    run_id = killed_run(store, server, tmp_path)

    listed = cli(capsys, "runs", "list", "--store", store)
    as_json = cli(capsys, "runs", "list", "--json", "--store", store)
    shown = cli(capsys, "runs", "show", run_id, "--store", store)
    shown_json = cli(capsys, "runs", "show", run_id, "--json", "--store", store)

    (row,) = listed.out.splitlines()[1:]
    assert row.split()[5] == "interrupted"
    (summary,) = json.loads(as_json.out)
    assert (summary["run_id"], summary["status"]) == (run_id, "interrupted")
    assert "  status:          interrupted (its process stopped before the run ended)" in shown.out
    assert f"  resumable:       yes (it did not end): fsm-kernel resume {run_id}" in shown.out
    termination = json.loads(shown_json.out)["termination"]
    assert (termination["status"], termination["resumable"]) == ("interrupted", True)
    waiting = cli(capsys, "runs", "list", "--waiting", "--store", store)
    assert waiting.out == ""

    from fsm_kernel.ui import ViewerConfig, open_viewer

    with open_viewer(ViewerConfig(store=str(store), port=0)) as viewer:
        url = f"http://127.0.0.1:{viewer.port}"
        table = httpx.get(f"{url}/", timeout=30).text
        only = httpx.get(f"{url}/?status=interrupted", timeout=30).text
        running = httpx.get(f"{url}/?status=running", timeout=30).text
        page = httpx.get(f"{url}/runs/{run_id}", timeout=30).text
    assert '<span class="status interrupted">interrupted</span>' in table
    assert f'data-run-id="{run_id}"' in only
    assert f'data-run-id="{run_id}"' not in running
    assert '<span class="status big interrupted" id="run-status">interrupted</span>' in page
    assert f"<code>fsm-kernel resume {run_id}</code>" in page

    server.enqueue(text_reply("42"))
    resumed = cli(
        capsys, "resume", run_id, "--store", store, "--base-url", server.base_url,
        "--max-retries", "0",
    )  # fmt: skip
    assert resumed.code == 0, resumed.err
    (summary,) = json.loads(cli(capsys, "runs", "list", "--json", "--store", store).out)
    assert (summary["status"], summary["termination_reason"]) == ("ended", "final_answer")
    with SqliteEventStore(store) as log:
        assert log.read(run_id)[-1].type is EventType.RUN_TERMINATED


READ_ONLY_COMMANDS = [
    ["runs", "list"],
    ["runs", "list", "--json"],
    ["runs", "show", "0199"],
    ["runs", "events", "0199"],
    ["runs", "export", "0199", "-o", "out.jsonl"],
    ["replay", "0199"],
]


@pytest.mark.parametrize("name", ["typo/x.db", "typo/deeper/x.jsonl", "typo/x.sqlite3"])
@pytest.mark.parametrize("command", READ_ONLY_COMMANDS, ids=" ".join)
def test_a_read_only_command_on_a_missing_store_writes_nothing(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: list[str],
    name: str,
) -> None:
    monkeypatch.chdir(tmp_path)

    out = cli(capsys, *command, "--store", tmp_path / name)

    assert out.code == 2
    assert out.err == (
        f"error: no event store at {tmp_path / name}: no run was recorded there (check --store "
        "or FSM_KERNEL_STORE)\n"
    )
    assert sorted(tmp_path.iterdir()) == []  # no folder, no store, no lock file


@pytest.mark.parametrize("as_json", [False, True])
def test_runs_list_in_a_new_folder_lists_nothing_and_writes_nothing(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    as_json: bool,
) -> None:
    # the default store is made by the first run: before it, a newcomer's `runs list` is an
    # empty list, not an error (a store named by --store or FSM_KERNEL_STORE must exist)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FSM_KERNEL_STORE", raising=False)

    out = cli(capsys, "runs", "list", *(["--json"] if as_json else []))

    assert out.code == 0
    assert out.out == ("[]\n" if as_json else "")
    assert out.err == "no runs recorded yet (no store at .fsm-kernel/runs.db in this folder)\n"
    assert sorted(tmp_path.iterdir()) == []


def test_the_viewer_on_a_missing_store_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FSM_KERNEL_STORE", raising=False)

    named = cli(capsys, "ui", "--store", tmp_path / "typo" / "runs.db", "--port", "0")
    default = cli(capsys, "ui", "--port", "0")

    assert (named.code, default.code) == (2, 2)
    assert named.err.startswith(f"error: no event store at {tmp_path / 'typo' / 'runs.db'}: ")
    assert default.err.startswith("error: no event store at .fsm-kernel/runs.db: ")
    assert sorted(tmp_path.iterdir()) == []


def test_reading_an_existing_store_changes_nothing_in_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer
) -> None:
    store = tmp_path / "runs.db"
    run_id = killed_run(store, server, tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}

    for command in (["runs", "list"], ["runs", "show", run_id], ["runs", "events", run_id]):
        assert cli(capsys, *command, "--store", store).code == 0
    assert cli(capsys, "runs", "list", "--json", "--store", store).out.count(run_id) == 1

    after = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    assert after.keys() == before.keys()
    assert after[store.name] == before[store.name]
    assert after["runs.db.locks"] == before["runs.db.locks"]
