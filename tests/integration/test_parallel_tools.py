"""Parallel tool calls, end to end through the CLI against the fake server over loopback: the
calls of one reply run at the same time where the workflow allows it (a barrier that only opens
when all of them are inside proves it), at most limits.max_parallel_tool_calls at once, one after
another otherwise; results go back to the model in the calls' order; replay is identical."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from fsm_kernel.protocol import EventType
from fsm_kernel.store import SqliteEventStore
from tests.clikit import cli
from tests.fakes.openai_server import FakeOpenAIServer, call, text_reply, tool_reply

ROOT = Path(__file__).resolve().parents[2]

TOOLS = '''
import threading, time

GATE = {"barrier": threading.Barrier(1)}
LOCK = threading.Lock()
COUNT = {"active": 0, "peak": 0}


def meet(tag: str) -> str:
    """Wait until every expected call is inside at once.

    Args:
        tag: a label
    """
    GATE["barrier"].wait()
    return f"met {tag}"


def tally(tag: str) -> str:
    """Count the calls inside at once.

    Args:
        tag: a label
    """
    with LOCK:
        COUNT["active"] += 1
        COUNT["peak"] = max(COUNT["peak"], COUNT["active"])
    time.sleep(0.3)
    with LOCK:
        COUNT["active"] -= 1
    return f"tallied {tag}"
'''


@pytest.fixture
def server() -> Any:
    with FakeOpenAIServer() as fake:
        yield fake


def setup(tmp_path: Path, *, parallel: str, limit: int = 4) -> tuple[Path, ModuleType]:
    """A copy of the default workflow offering the test's tools, and their module."""
    name = f"ptools_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(TOOLS)
    text = (ROOT / "workflows" / "default.yaml").read_text()
    text = text.replace("name: default", "name: parallel")
    text = text.replace(
        "tools: [datetime, read_file, list_directory, done]",
        f"tools: ['{name}:meet', '{name}:tally', done]\n{parallel}",
    )
    text = text.replace(
        "  max_iterations: 10\n", f"  max_iterations: 10\n  max_parallel_tool_calls: {limit}\n"
    )
    workflow = tmp_path / "parallel.yaml"
    workflow.write_text(text)
    sys.path.insert(0, str(tmp_path))
    try:
        module = __import__(name)
    finally:
        sys.path.remove(str(tmp_path))
    return workflow, module


def run(capsys: Any, workflow: Path, server: FakeOpenAIServer, store: Path) -> dict[str, Any]:
    outcome = cli(
        capsys, "run", workflow, "-p", "go", "--base-url", server.base_url, "--model", "m",
        "--store", store, "--json", "--max-retries", "0",
    )  # fmt: skip
    assert outcome.code == 0, outcome.err
    return outcome.json()


def test_the_calls_of_one_reply_run_at_once_and_answer_in_their_order(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import threading

    workflow, tools = setup(tmp_path, parallel="parallel_tool_calls: true")
    tools.GATE["barrier"] = threading.Barrier(3, timeout=30)  # opens only with all 3 inside
    server.enqueue(
        tool_reply(
            call("meet", {"tag": "a"}, id="c1"),
            call("meet", {"tag": "b"}, id="c2"),
            call("meet", {"tag": "c"}, id="c3"),
        ),
        text_reply("All met."),
    )
    store = tmp_path / "runs.db"

    result = run(capsys, workflow, server, store)

    assert result["response"] == "All met."
    assert [(c["id"], c["result"], c["is_error"]) for c in result["tool_calls"]] == [
        ("c1", "met a", False),
        ("c2", "met b", False),
        ("c3", "met c", False),
    ]
    sent = [m for m in server.requests[1]["messages"] if m["role"] == "tool"]
    assert [(m["tool_call_id"], m["content"]) for m in sent] == [
        ("c1", "met a"),
        ("c2", "met b"),
        ("c3", "met c"),
    ]
    with SqliteEventStore(store) as events:
        log = events.read(result["run_id"])
    kinds = [
        (e.type, e.data["call"]["id"])
        for e in log
        if e.type in (EventType.TOOL_STARTED, EventType.TOOL_FINISHED)
    ]
    assert [k for k, _ in kinds[:3]] == [EventType.TOOL_STARTED] * 3  # all started first
    assert sorted(i for k, i in kinds[3:]) == ["c1", "c2", "c3"]
    replay = cli(capsys, "replay", result["run_id"], "--store", store, "--json")
    assert json.loads(replay.out)["identical"] is True


def test_at_most_max_parallel_tool_calls_run_at_once(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workflow, tools = setup(tmp_path, parallel="parallel_tool_calls: true", limit=2)
    server.enqueue(
        tool_reply(*(call("tally", {"tag": str(i)}, id=f"t{i}") for i in range(5))),
        text_reply("Counted."),
    )

    result = run(capsys, workflow, server, tmp_path / "runs.db")

    assert tools.COUNT["peak"] == 2
    assert [c["result"] for c in result["tool_calls"]] == [f"tallied {i}" for i in range(5)]


def test_without_the_setting_the_calls_run_one_after_another(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workflow, tools = setup(tmp_path, parallel="")
    server.enqueue(
        tool_reply(*(call("tally", {"tag": str(i)}, id=f"t{i}") for i in range(3))),
        text_reply("Counted."),
    )

    run(capsys, workflow, server, tmp_path / "runs.db")

    assert tools.COUNT["peak"] == 1


def test_a_state_may_turn_it_off_and_only_tools_execute_takes_it(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workflow, tools = setup(tmp_path, parallel="parallel_tool_calls: true")
    text = workflow.read_text()
    workflow.write_text(
        text.replace(
            "  act:       {action: tools.execute, description: run the requested tools}",
            "  act:       {action: tools.execute, parallel_tool_calls: false}",
        )
    )
    server.enqueue(
        tool_reply(*(call("tally", {"tag": str(i)}, id=f"t{i}") for i in range(3))),
        text_reply("Counted."),
    )
    run(capsys, workflow, server, tmp_path / "runs.db")
    assert tools.COUNT["peak"] == 1

    workflow.write_text(
        text.replace(
            "  think:     {action: agent.think, description: ask the model}",
            "  think:     {action: agent.think, parallel_tool_calls: true}",
        )
    )
    refused = cli(capsys, "validate", workflow)
    assert refused.code == 2
    assert "parallel_tool_calls' does nothing on state 'think'" in refused.err
    assert f"{workflow}:" in refused.err


KILLABLE = '''
import os, time


def step(tag: str, seconds: float) -> str:
    """Note the call, then take a while.

    Args:
        tag: a label
        seconds: how long
    """
    with open(os.environ["PT_MARKS"], "a") as f:
        f.write(tag + "\\n")
    time.sleep(seconds * float(os.environ.get("PT_SCALE", "1")))
    return f"done {tag}"
'''


def test_a_crash_mid_way_runs_again_only_the_calls_that_had_not_finished(
    server: FakeOpenAIServer, tmp_path: Path
) -> None:
    import os
    import subprocess
    import time

    (tmp_path / "killable.py").write_text(KILLABLE)
    text = (ROOT / "workflows" / "default.yaml").read_text()
    workflow = tmp_path / "killable.yaml"
    workflow.write_text(
        text.replace("name: default", "name: killable").replace(
            "tools: [datetime, read_file, list_directory, done]",
            "tools: ['killable:step', done]\nparallel_tool_calls: true",
        )
    )
    marks, store = tmp_path / "marks.txt", tmp_path / "runs.db"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)]),
           "PT_MARKS": str(marks), "FSM_KERNEL_MAX_RETRIES": "0"}  # fmt: skip
    server.enqueue(
        tool_reply(
            call("step", {"tag": "fast1", "seconds": 0}, id="f1"),
            call("step", {"tag": "slow", "seconds": 60}, id="s1"),
            call("step", {"tag": "fast2", "seconds": 0}, id="f2"),
        )
    )
    base = [sys.executable, "-m", "fsm_kernel"]
    first = subprocess.Popen(
        [*base, "run", str(workflow), "-p", "go", "--base-url", server.base_url, "--model", "m",
         "--store", str(store), "--json"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
    )  # fmt: skip

    def finished() -> list[str]:
        if not store.exists():
            return []
        with SqliteEventStore(store) as events:
            runs = events.list_runs()
            if not runs:
                return []
            log = events.read(runs[0].run_id)
        return [e.data["call"]["id"] for e in log if e.type is EventType.TOOL_FINISHED]

    try:
        deadline = time.monotonic() + 60
        while sorted(finished()) != ["f1", "f2"]:
            assert time.monotonic() < deadline, "the fast calls never ended"
            assert first.poll() is None, "the run ended before it was killed"
            time.sleep(0.05)
    finally:
        first.kill()
        first.wait(timeout=10)
    with SqliteEventStore(store) as events:
        run_id = events.list_runs()[0].run_id

    server.enqueue(text_reply("All three done."))
    fast_again = [*base, "resume", run_id, "--store", str(store), "--json"]
    done = subprocess.run(
        fast_again, env={**env, "PT_SCALE": "0"}, capture_output=True, text=True, timeout=120,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip

    assert done.returncode == 0, done.stderr
    assert sorted(marks.read_text().split()) == ["fast1", "fast2", "slow", "slow"]
    result = json.loads(done.stdout)
    assert [(c["id"], c["result"]) for c in result["tool_calls"]] == [
        ("f1", "done fast1"),
        ("s1", "done slow"),
        ("f2", "done fast2"),
    ]
