"""Crash, resume and replay, end to end: the real CLI in a subprocess against the fake model
server (script mode), SIGKILLed at several points, then resumed; replay served from the log."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fsm_kernel.cli import main
from fsm_kernel.protocol import Event, EventType
from fsm_kernel.store import SqliteEventStore
from tests.fakes.openai_server import FakeOpenAIServer, call, text_reply, tool_reply

ROOT = Path(__file__).resolve().parents[2]
CRASH_WORKFLOW = ROOT / "tests" / "data" / "crash.yaml"
DEFAULT_WORKFLOW = ROOT / "workflows" / "default.yaml"


class ScriptServer:
    """The fake server in its own process, so it outlives the killed client."""

    def __init__(self, tmp: Path, name: str, replies: list[object]) -> None:
        script = tmp / f"{name}.json"
        script.write_text(json.dumps(replies))
        self.log = tmp / f"{name}.requests.jsonl"
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests/fakes/openai_server.py"), "--script", str(script),
             "--requests-log", str(self.log)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        assert line.startswith("READY "), line
        self.base_url = line.split()[1]

    def request_count(self) -> int:
        return len(self.log.read_text().splitlines()) if self.log.exists() else 0

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Callable[[str, list[object]], ScriptServer]]:
    started: list[ScriptServer] = []

    def start(name: str, replies: list[object]) -> ScriptServer:
        server = ScriptServer(tmp_path, name, replies)
        started.append(server)
        return server

    yield start
    for s in started:
        s.stop()


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "fsm_kernel", *args]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "FSM_KERNEL_MAX_RETRIES": "0"}


def _events(store_path: Path) -> list[Event]:
    with SqliteEventStore(store_path) as store:
        runs = store.list_runs()
        assert len(runs) == 1
        return store.read(runs[0].run_id)


def _wait_until(predicate: Callable[[], bool], what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _has_event(store_path: Path, type_: EventType, count: int = 1) -> Callable[[], bool]:
    def check() -> bool:
        if not store_path.exists():
            return False
        try:
            with SqliteEventStore(store_path) as store:
                runs = store.list_runs()
                if not runs:
                    return False
                events = store.read(runs[0].run_id)
        except Exception:  # the writer may be mid-creation
            return False
        return sum(1 for e in events if e.type == type_) >= count

    return check


def _kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)


def _assert_complete_log(events: list[Event], iterations: int, reason: str) -> None:
    seqs = [e.seq for e in events]
    assert seqs == sorted(set(seqs)), "seq must be unique and increasing"
    steps = Counter(e.data["step"] for e in events if e.type == EventType.ITERATION_COMPLETED)
    assert steps == Counter(range(1, iterations + 1)), f"each iteration exactly once: {steps}"
    terminated = [e for e in events if e.type == EventType.RUN_TERMINATED]
    assert [e.data["reason"] for e in terminated] == [reason]
    finished = Counter(e.data["call"]["id"] for e in events if e.type == EventType.TOOL_FINISHED)
    assert all(n == 1 for n in finished.values()), f"a tool result recorded twice: {finished}"


def test_kill_during_model_call_then_resume(tmp_path: Path, servers) -> None:
    store = tmp_path / "runs.db"
    first = servers("first", [
        {"tool_calls": [{"name": "datetime", "arguments": {}, "id": "c1"}]},
        {"hang": 60},
    ])  # fmt: skip
    proc = subprocess.Popen(
        _cli("run", str(CRASH_WORKFLOW), "--prompt", "time?", "--base-url", first.base_url,
             "--store", str(store), "--json"),
        env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    _wait_until(lambda: first.request_count() >= 2, "the second model request")
    _wait_until(_has_event(store, EventType.MODEL_REQUESTED, 2), "model.requested recorded")
    _kill(proc)
    before = _events(store)
    assert not any(e.type == EventType.RUN_TERMINATED for e in before)

    second = servers("second", ["It is noon."])
    out = subprocess.run(
        _cli("resume", before[0].run_id[:13], "--base-url", second.base_url, "--store",
             str(store), "--json"),
        env=_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["termination_reason"] == "final_answer"
    assert result["response"] == "It is noon."
    assert result["iterations"] == 2
    assert second.request_count() == 1, "only the lost model call is made again"
    after = _events(store)
    assert after[: len(before)] == before, "nothing recorded is rewritten"
    _assert_complete_log(after, iterations=2, reason="final_answer")
    # the resumed model request carried the whole conversation rebuilt from the log
    request = json.loads(second.log.read_text().splitlines()[0])
    assert [m["role"] for m in request["messages"]] == ["system", "user", "assistant", "tool"]


def test_kill_during_tool_call_reexecutes_the_tool(tmp_path: Path, servers) -> None:
    store = tmp_path / "runs.db"
    marker = tmp_path / "blocking"
    marker.write_text("x")
    first = servers("first", [
        {"tool_calls": [{"name": "block", "arguments": {"path": str(marker)}, "id": "b1"}]},
    ])  # fmt: skip
    proc = subprocess.Popen(
        _cli("run", str(CRASH_WORKFLOW), "--prompt", "wait", "--base-url", first.base_url,
             "--store", str(store)),
        env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    _wait_until(_has_event(store, EventType.TOOL_STARTED), "tool.started recorded")
    _kill(proc)
    marker.unlink()

    second = servers("second", ["Waited."])
    out = subprocess.run(
        _cli("resume", _events(store)[0].run_id, "--base-url", second.base_url, "--store",
             str(store), "--json"),
        env=_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "re-executing tool block" in out.stderr or "will run again" in out.stderr
    result = json.loads(out.stdout)
    assert result["termination_reason"] == "final_answer"
    assert [t["result"] for t in result["tool_calls"]] == ["unblocked blocking"]
    events = _events(store)
    _assert_complete_log(events, iterations=2, reason="final_answer")
    assert sum(1 for e in events if e.type == EventType.TOOL_STARTED) == 1
    resumed = [e for e in events if e.type == EventType.RUN_RESUMED]
    assert resumed[0].data["rerun_tool_calls"] == ["b1"]


def test_kill_between_iterations_then_resume(tmp_path: Path, servers) -> None:
    store = tmp_path / "runs.db"
    first = servers("first", [
        {"tool_calls": [{"name": "datetime", "arguments": {}, "id": "d1"}]},
        {"tool_calls": [{"name": "datetime", "arguments": {"timezone": "UTC"}, "id": "d2"}]},
        {"hang": 60},
    ])  # fmt: skip
    proc = subprocess.Popen(
        _cli("run", str(CRASH_WORKFLOW), "--prompt", "twice", "--base-url", first.base_url,
             "--store", str(store)),
        env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    _wait_until(_has_event(store, EventType.ITERATION_COMPLETED, 2), "two iterations")
    _kill(proc)
    second = servers("second", ["Done twice."])
    run_id = _events(store)[0].run_id
    out = subprocess.run(
        _cli("resume", run_id, "--base-url", second.base_url, "--store", str(store)),
        env=_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "Done twice." in out.stdout
    _assert_complete_log(_events(store), iterations=3, reason="final_answer")
    # a finished run cannot be resumed again
    again = subprocess.run(
        _cli("resume", run_id, "--store", str(store)), env=_env(), capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert again.returncode == 2  # bad input: the run cannot be resumed
    assert "already terminated (final_answer)" in again.stderr
    assert "Traceback" not in again.stderr


def test_resume_refuses_a_changed_workflow_unless_forced(tmp_path: Path, servers) -> None:
    store = tmp_path / "runs.db"
    workflow = tmp_path / "wf.yaml"
    workflow.write_text(CRASH_WORKFLOW.read_text())
    first = servers("first", [{"hang": 60}])
    proc = subprocess.Popen(
        _cli("run", str(workflow), "--prompt", "x", "--base-url", first.base_url, "--store",
             str(store)),
        env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    _wait_until(lambda: first.request_count() >= 1, "the first model request")
    _kill(proc)
    workflow.write_text(workflow.read_text().replace("max_iterations: 10", "max_iterations: 5"))
    run_id = _events(store)[0].run_id
    second = servers("second", ["Fine."])
    # The run is pinned to the text it recorded; moving it to the edited file takes --force.
    refused = subprocess.run(
        _cli("resume", run_id, "--workflow", str(workflow), "--base-url", second.base_url,
             "--store", str(store)),
        env=_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2  # bad input: resume it with --force
    assert "workflow changed" in refused.stderr
    assert "--force" in refused.stderr
    forced = subprocess.run(
        _cli("resume", run_id, "--workflow", str(workflow), "--force", "--base-url",
             second.base_url, "--store", str(store), "--json"),
        env=_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert forced.returncode == 0, forced.stderr
    resumed = [e for e in _events(store) if e.type == EventType.RUN_RESUMED]
    assert resumed[-1].data["forced"] is True


def _record_run(tmp_path: Path, workflow: Path, capsys) -> tuple[str, Path, FakeOpenAIServer]:
    store = tmp_path / "runs.db"
    server = FakeOpenAIServer()
    server.start()
    server.enqueue(
        tool_reply(call("datetime", {}, id="t1")),
        tool_reply(call("list_directory", {"path": "."}, id="t2")),
        text_reply("All done."),
    )
    code = main(["run", str(workflow), "--prompt", "look around", "--base-url", server.base_url,
                 "--store", str(store), "--workspace", str(tmp_path), "--json"])  # fmt: skip
    assert code == 0
    run_id = json.loads(capsys.readouterr().out)["run_id"]
    return run_id, store, server


def test_replay_is_identical_and_calls_nothing(tmp_path: Path, capsys) -> None:
    run_id, store, server = _record_run(tmp_path, DEFAULT_WORKFLOW, capsys)
    try:
        requests_before = len(server.requests)
        code = main(["replay", run_id, "--store", str(store), "--json"])
        report = json.loads(capsys.readouterr().out)
        assert code == 0, report
        assert report["identical"] is True
        assert report["model_calls_served"] == 3
        assert len(server.requests) == requests_before, "replay must not call the model"
        assert report["steps"][-1]["recorded"].endswith("final_answer")
    finally:
        server.stop()


def test_replay_reports_where_an_edited_workflow_diverges(tmp_path: Path, capsys) -> None:
    run_id, store, server = _record_run(tmp_path, DEFAULT_WORKFLOW, capsys)
    server.stop()
    edited = tmp_path / "edited.yaml"
    # the edit: after any tool call the run ends as if `done` were called
    edited.write_text(
        DEFAULT_WORKFLOW.read_text().replace(
            "guard: done_called,      reason: done", "guard: has_tool_calls,   reason: done"
        )
    )
    assert edited.read_text() != DEFAULT_WORKFLOW.read_text()
    code = main(["replay", run_id, "--store", str(store), "--workflow", str(edited)])
    out = capsys.readouterr().out
    assert code == 1
    # steps: observe→think, think→act, act→evaluate, then evaluate decides differently
    assert "diverged at step 4 (iteration 1)" in out
    assert "evaluate → observe" in out
    assert "evaluate → terminate [has_tool_calls] → done" in out


def test_runs_show_lists_every_iteration(tmp_path: Path, capsys) -> None:
    run_id, store, server = _record_run(tmp_path, DEFAULT_WORKFLOW, capsys)
    server.stop()
    assert main(["runs", "show", run_id[:12], "--store", str(store)]) == 0
    out = capsys.readouterr().out
    for fragment in ("datetime", "list_directory", "All done.", "final_answer", "tool_calls"):
        assert fragment in out
    assert main(["runs", "show", run_id, "--store", str(store), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [it["step"] for it in shown["iterations"]] == [1, 2, 3]
    assert [it["decision"] for it in shown["iterations"]] == ["tool_calls", "tool_calls", "answer"]
    assert shown["termination"]["reason"] == "final_answer"
    exported = tmp_path / "run.jsonl"
    assert main(["runs", "export", run_id, "-o", str(exported), "--store", str(store)]) == 0
    lines = exported.read_text().splitlines()
    assert len(lines) == len(_events(store))
    assert main(["runs", "events", run_id, "--store", str(store), "--json"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == len(lines)
    assert main(["runs", "list", "--store", str(store), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed[0]["iterations"] == 3
    assert listed[0]["termination_reason"] == "final_answer"
