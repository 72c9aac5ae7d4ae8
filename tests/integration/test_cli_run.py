"""`fsm-kernel run` over real HTTP against FakeOpenAIServer: the issue's acceptance test (once in
process, once through the installed console script), every termination reason the CLI can
produce, exit codes, --json, human output, progress on stderr, and never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fsm_kernel.errors import ToolFatalError
from fsm_kernel.protocol import EventType
from fsm_kernel.store import JsonlEventStore, SqliteEventStore
from tests.clikit import Outcome, cli
from tests.fakes.openai_server import (
    FakeOpenAIServer,
    call,
    hang,
    http_error,
    text_reply,
    tool_reply,
)

REPO = Path(__file__).resolve().parents[2]
DEFAULT = REPO / "workflows" / "default.yaml"
RESULT_KEYS = {
    "run_id",
    "workflow",
    "status",
    "termination_reason",
    "response",
    "output",
    "iterations",
    "tool_calls",
    "usage",
}
CALL_KEYS = {"iteration", "id", "name", "arguments", "result", "is_error"}
CONNECT_HINT = "is Ollama (or your model server) running?"


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "runs.db"


def run_args(base_url: str, store: Path, workspace: Path, *extra: str) -> list[str]:
    return [
        "run",
        str(DEFAULT),
        "--prompt",
        "What time is it?",
        "--base-url",
        base_url,
        "--store",
        str(store),
        "--workspace",
        str(workspace),
        *extra,
    ]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def assert_result_shape(result: dict[str, Any]) -> None:
    assert RESULT_KEYS <= set(result) <= RESULT_KEYS | {"error"}
    assert result["workflow"] == "default"
    for record in result["tool_calls"]:
        assert set(record) == CALL_KEYS
    assert set(result["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}


# --- the acceptance test ----------------------------------------------------------------------


def test_acceptance_what_time_is_it(
    server: FakeOpenAIServer, store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(
        tool_reply(call("datetime", {}, id="call_dt")),
        text_reply("It is 12:00 UTC on a Sunday."),
    )

    outcome = cli(capsys, run_args(server.base_url, store, tmp_path, "--json"))

    assert outcome.code == 0
    result = outcome.json()
    assert_result_shape(result)
    assert result["termination_reason"] == "final_answer"
    assert result["response"] == "It is 12:00 UTC on a Sunday."
    assert result["iterations"] == 2
    assert "error" not in result
    (dt,) = result["tool_calls"]
    assert (dt["iteration"], dt["id"], dt["name"], dt["is_error"]) == (
        1,
        "call_dt",
        "datetime",
        False,
    )
    assert dt["result"].startswith("utc: ")
    assert result["usage"] == {"prompt_tokens": 20, "completion_tokens": 10, "total_tokens": 30}
    first, second = server.requests
    assert {t["function"]["name"] for t in first["tools"]} >= {"datetime", "done"}
    assert first["messages"][-1] == {"role": "user", "content": "What time is it?"}
    assert second["messages"][-1]["role"] == "tool"
    assert second["messages"][-1]["tool_call_id"] == "call_dt"
    server.assert_complete()


def test_acceptance_through_the_installed_console_script(
    server: FakeOpenAIServer, store: Path
) -> None:
    script = shutil.which("fsm-kernel")
    assert script is not None, "the fsm-kernel console script is not installed"
    server.enqueue(tool_reply(call("datetime", {})), text_reply("It is noon."))

    proc = subprocess.run(
        [
            script,
            "run",
            "workflows/default.yaml",
            "--prompt",
            "What time is it?",
            "--base-url",
            server.base_url,
            "--json",
            "--store",
            str(store),
        ],
        cwd=REPO,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    result = Outcome(proc.returncode, proc.stdout, proc.stderr).json()
    assert result["termination_reason"] == "final_answer"
    assert result["response"] == "It is noon."
    assert result["iterations"] == 2
    assert [c["name"] for c in result["tool_calls"]] == ["datetime"]
    server.assert_complete()


# --- human output -----------------------------------------------------------------------------


def test_human_output_answer_tools_iterations_termination(
    server: FakeOpenAIServer, store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(tool_reply(call("datetime", {"timezone": "UTC"})), text_reply("Noon."))

    outcome = cli(capsys, run_args(server.base_url, store, tmp_path))

    assert outcome.code == 0
    lines = outcome.out.splitlines()
    assert lines[0] == "Noon."
    assert "tool calls:" in lines
    assert any(line.startswith('  ✓ [1] datetime({"timezone": "UTC"}) → utc: ') for line in lines)
    assert "iterations: 2" in lines
    assert "termination: final_answer" in lines
    assert any(line.startswith("run id: ") for line in lines)
    assert not any(line.startswith("error:") for line in lines)


def test_progress_goes_to_stderr_not_stdout(
    server: FakeOpenAIServer, store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(tool_reply(call("datetime", {})), text_reply("Noon."))

    outcome = cli(capsys, run_args(server.base_url, store, tmp_path))

    err = outcome.err.splitlines()
    assert err[0].startswith("run ")
    assert err[0].endswith("(default)")
    assert "→ observe" in err
    assert "→ think" in err
    assert "  tool datetime({})" in err
    assert err[-1] == "■ final_answer"
    assert "→ observe" not in outcome.out
    assert "■" not in outcome.out


def test_json_mode_keeps_stderr_free_of_progress(
    server: FakeOpenAIServer, store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(text_reply("Noon."))

    outcome = cli(capsys, run_args(server.base_url, store, tmp_path, "--json"))

    assert outcome.code == 0
    assert outcome.json()["iterations"] == 1
    assert "→ think" not in outcome.err


def test_failed_tool_calls_are_marked(
    server: FakeOpenAIServer, store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(tool_reply(call("read_file", {"path": "missing.txt"})), text_reply("No file."))

    outcome = cli(capsys, run_args(server.base_url, store, tmp_path))

    assert outcome.code == 0
    assert any(line.startswith("  ✗ [1] read_file(") for line in outcome.out.splitlines())
    assert "  ✗ read_file: " in outcome.err


# --- termination reasons and exit codes -------------------------------------------------------


def test_done(
    server: FakeOpenAIServer, store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(tool_reply(call("done", {"answer": "forty-two"})))

    outcome = cli(capsys, run_args(server.base_url, store, tmp_path, "--json"))

    assert outcome.code == 0
    result = outcome.json()
    assert (result["termination_reason"], result["response"], result["iterations"]) == (
        "done",
        "forty-two",
        1,
    )
    server.assert_complete()


def test_max_iterations_flag(
    server: FakeOpenAIServer, store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(tool_reply(call("datetime", {})))

    outcome = cli(
        capsys, run_args(server.base_url, store, tmp_path, "--json", "--max-iterations", "1")
    )

    assert outcome.code == 1
    result = outcome.json()
    assert_result_shape(result)
    assert result["termination_reason"] == "max_iterations"
    assert result["iterations"] == 1
    assert len(result["tool_calls"]) == 1
    server.assert_complete()


def test_tool_failures(
    server: FakeOpenAIServer, store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(*(tool_reply(call("read_file", {"path": f"no{i}.txt"})) for i in range(3)))

    outcome = cli(capsys, run_args(server.base_url, store, tmp_path, "--json"))

    assert outcome.code == 1
    result = outcome.json()
    assert result["termination_reason"] == "tool_failures"
    assert [c["is_error"] for c in result["tool_calls"]] == [True, True, True]
    server.assert_complete()


def test_no_progress(
    server: FakeOpenAIServer, store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(*(tool_reply(call("list_directory", {"path": "."})) for _ in range(3)))

    outcome = cli(capsys, run_args(server.base_url, store, tmp_path))

    assert outcome.code == 1
    assert "termination: no_progress" in outcome.out.splitlines()
    assert "iterations: 3" in outcome.out.splitlines()
    server.assert_complete()


def test_malformed_output(
    server: FakeOpenAIServer, store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(*(tool_reply(call("datetime", '{"timezone": ')) for _ in range(3)))

    outcome = cli(capsys, run_args(server.base_url, store, tmp_path, "--json"))

    assert outcome.code == 1
    result = outcome.json()
    assert result["termination_reason"] == "malformed_output"
    assert result["iterations"] == 3
    assert result["tool_calls"][0]["arguments"] == '{"timezone": '
    assert all(c["is_error"] for c in result["tool_calls"])
    assert server.errors == [], "the error went back as a proper tool message"
    server.assert_complete()


def test_malformed_then_recovered(
    server: FakeOpenAIServer, store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(
        tool_reply(call("datetime", "{oops", id="bad")),
        tool_reply(call("datetime", {}, id="good")),
        text_reply("Noon."),
    )

    outcome = cli(capsys, run_args(server.base_url, store, tmp_path, "--json"))

    assert outcome.code == 0
    result = outcome.json()
    assert result["termination_reason"] == "final_answer"
    assert result["iterations"] == 3
    retry = server.requests[1]["messages"]
    assert retry[-1]["role"] == "tool"
    assert retry[-1]["tool_call_id"] == "bad"
    server.assert_complete()


def test_agent_error_connection_refused_json(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"http://127.0.0.1:{closed_port()}/v1"

    outcome = cli(capsys, run_args(url, store, tmp_path, "--json"))

    assert outcome.code == 1
    result = outcome.json()
    assert_result_shape(result)
    assert result["termination_reason"] == "agent_error"
    assert result["iterations"] == 1
    assert result["response"] == ""
    assert "cannot reach model server" in result["error"]
    assert CONNECT_HINT in result["error"]


def test_agent_error_connection_refused_human(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"http://127.0.0.1:{closed_port()}/v1"

    outcome = cli(capsys, run_args(url, store, tmp_path))

    assert outcome.code == 1
    assert "termination: agent_error" in outcome.out.splitlines()
    error_lines = [line for line in outcome.out.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1
    assert CONNECT_HINT in error_lines[0]
    assert "■ agent_error" in outcome.err


def test_agent_error_keeps_the_partial_result(
    server: FakeOpenAIServer, store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(tool_reply(call("datetime", {})), http_error(500))

    outcome = cli(capsys, run_args(server.base_url, store, tmp_path, "--json"))

    assert outcome.code == 1
    result = outcome.json()
    assert result["termination_reason"] == "agent_error"
    assert result["iterations"] == 2
    assert [c["name"] for c in result["tool_calls"]] == ["datetime"]
    assert "500" in result["error"]


def test_unauthorized(
    server: FakeOpenAIServer, store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(http_error(401))

    outcome = cli(capsys, run_args(server.base_url, store, tmp_path, "--json"))

    assert outcome.code == 1
    result = outcome.json()
    assert result["termination_reason"] == "agent_error"
    assert "401" in result["error"]
    assert "FSM_KERNEL_API_KEY" in result["error"]
    server.assert_complete()


def test_request_timeout_is_an_agent_error(
    server: FakeOpenAIServer, store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(hang(3, text_reply("late")))

    outcome = cli(
        capsys, run_args(server.base_url, store, tmp_path, "--json", "--request-timeout", "0.2")
    )

    assert outcome.code == 1
    result = outcome.json()
    assert result["termination_reason"] == "agent_error"
    assert "timed out" in result["error"]


def test_run_timeout(
    server: FakeOpenAIServer, store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(hang(3, text_reply("late")))

    outcome = cli(capsys, run_args(server.base_url, store, tmp_path, "--json", "--timeout", "0.2"))

    assert outcome.code == 1
    result = outcome.json()
    assert_result_shape(result)
    assert result["termination_reason"] == "timeout"
    assert "timed out" in result["error"]
    assert result["iterations"] == 1


def test_ctrl_c_cancels_the_run(
    server: FakeOpenAIServer, store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(tool_reply(call("datetime", {})), hang(3, text_reply("late")))

    def interrupt() -> None:
        server.wait_for_requests(2)  # the second model call is in flight
        os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=interrupt, daemon=True)
    thread.start()
    outcome = cli(capsys, run_args(server.base_url, store, tmp_path, "--json"))
    thread.join(timeout=10)

    assert outcome.code == 1
    result = outcome.json()
    assert_result_shape(result)
    assert result["termination_reason"] == "cancelled"
    assert result["iterations"] == 2
    assert [c["name"] for c in result["tool_calls"]] == ["datetime"]
    with SqliteEventStore(store) as events_db:
        assert events_db.read(result["run_id"])[-1].data["reason"] == "cancelled"


def eject(reason: str) -> str:
    """A user tool that cannot go on.

    Args:
        reason: Why.
    """
    raise ToolFatalError(f"ejected: {reason}")


def broken_action(ctx: object) -> None:
    raise KeyError("a bug in a user action")


USER_CODE_WORKFLOW = """\
name: usercode
tools: [datetime, "tests.integration.test_cli_run:eject"]
initial: observe
states:
  observe:   {action: session.observe}
  think:     {action: agent.think}
  act:       {action: tools.execute}
  evaluate:  {action: kernel.evaluate}
  audit:     {action: "tests.integration.test_cli_run:broken_action"}
  terminate: {final: true}
transitions:
  - {source: observe,  target: think}
  - {source: think,    target: act,       guard: has_tool_calls}
  - {source: think,    target: audit}
  - {source: act,      target: evaluate}
  - {source: evaluate, target: terminate, guard: fatal_tool_error, reason: fatal_tool_error}
  - {source: evaluate, target: observe}
  - {source: audit,    target: terminate, reason: final_answer}
"""


def test_fatal_tool_error_from_a_user_tool(
    server: FakeOpenAIServer, store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workflow = tmp_path / "usercode.yaml"
    workflow.write_text(USER_CODE_WORKFLOW, encoding="utf-8")
    server.enqueue(tool_reply(call("eject", {"reason": "no fuel"})))
    args = run_args(server.base_url, store, tmp_path, "--json")
    args[1] = str(workflow)

    outcome = cli(capsys, args)

    assert outcome.code == 1
    result = outcome.json()
    assert result["termination_reason"] == "fatal_tool_error"
    assert result["workflow"] == "usercode"
    (record,) = result["tool_calls"]
    assert record["is_error"]
    assert "ejected: no fuel" in record["result"]
    assert {t["function"]["name"] for t in server.requests[0]["tools"]} == {"datetime", "eject"}
    server.assert_complete()


def test_a_raising_action_is_reason_error(
    server: FakeOpenAIServer, store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workflow = tmp_path / "usercode.yaml"
    workflow.write_text(USER_CODE_WORKFLOW, encoding="utf-8")
    server.enqueue(text_reply("All good."))
    args = run_args(server.base_url, store, tmp_path, "--json")
    args[1] = str(workflow)

    outcome = cli(capsys, args)

    assert outcome.code == 1
    result = outcome.json()
    assert result["termination_reason"] == "error"
    assert result["response"] == "All good."
    assert "KeyError" in result["error"]
    assert "a bug in a user action" in result["error"]
    assert "\n" not in result["error"]


# --- the event store --------------------------------------------------------------------------


def test_store_flag_records_the_run(
    server: FakeOpenAIServer, store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(tool_reply(call("datetime", {})), text_reply("Noon."))

    result = cli(capsys, run_args(server.base_url, store, tmp_path, "--json")).json()

    assert store.is_file()
    with SqliteEventStore(store) as events_db:
        events = events_db.read(result["run_id"])
        (summary,) = events_db.list_runs()
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert events[0].type == EventType.RUN_STARTED
    assert events[-1].type == EventType.RUN_TERMINATED
    assert events[-1].data["reason"] == "final_answer"
    assert "api_key" not in json.dumps(events[0].data).replace('"api_key": null', "")
    assert summary.run_id == result["run_id"]
    assert summary.termination_reason == "final_answer"


def test_store_flag_jsonl(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(text_reply("Noon."))
    log = tmp_path / "events.jsonl"

    result = cli(capsys, run_args(server.base_url, log, tmp_path, "--json")).json()

    events = JsonlEventStore(log).read(result["run_id"])
    assert events[-1].type == EventType.RUN_TERMINATED


def test_failed_runs_are_recorded_too(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"http://127.0.0.1:{closed_port()}/v1"

    result = cli(capsys, run_args(url, store, tmp_path, "--json")).json()

    with SqliteEventStore(store) as events_db:
        last = events_db.read(result["run_id"])[-1]
    assert last.type == EventType.RUN_TERMINATED
    assert last.data["reason"] == "agent_error"


def test_api_key_is_never_stored(
    server: FakeOpenAIServer,
    store: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FSM_KERNEL_API_KEY", "sk-very-secret")
    server.enqueue(text_reply("Noon."))

    outcome = cli(capsys, run_args(server.base_url, store, tmp_path, "--json"))

    assert server.request_headers[0]["authorization"] == "Bearer sk-very-secret"
    assert b"sk-very-secret" not in store.read_bytes()
    assert "sk-very-secret" not in outcome.out + outcome.err


# --- usage errors -----------------------------------------------------------------------------


def test_bad_workflow_file_exits_2_with_its_location(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = REPO / "tests" / "data" / "broken_unknown_target.yaml"
    args = run_args("http://127.0.0.1:9/v1", store, tmp_path)
    args[1] = str(broken)

    outcome = cli(capsys, args)

    assert outcome.code == 2
    assert outcome.err.strip() == f"error: {broken}:9:31: unknown target state 'thinkk'"
    assert outcome.out == ""


def test_bad_workflow_file_with_json_exits_2(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = REPO / "tests" / "data" / "broken_yaml_syntax.yaml"
    args = run_args("http://127.0.0.1:9/v1", store, tmp_path, "--json")
    args[1] = str(broken)

    outcome = cli(capsys, args)

    assert outcome.code == 2
    assert f"{broken}:3:18: YAML syntax error" in outcome.err


def test_unknown_workflow_exits_2(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = run_args("http://127.0.0.1:9/v1", store, tmp_path)
    args[1] = "no-such-workflow"

    outcome = cli(capsys, args)

    assert outcome.code == 2
    assert "no such workflow file or stock workflow" in outcome.err
    assert "default" in outcome.err


def test_stock_workflow_by_name(
    server: FakeOpenAIServer, store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(text_reply("Noon."))
    args = run_args(server.base_url, store, tmp_path, "--json")
    args[1] = "default"

    outcome = cli(capsys, args)

    assert outcome.code == 0
    assert outcome.json()["workflow"] == "default"


def test_missing_prompt_exits_2(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    outcome = cli(capsys, ["run", str(DEFAULT), "--store", str(store)])

    assert outcome.code == 2
    assert "--prompt" in outcome.err
    assert outcome.out == ""


@pytest.mark.parametrize(
    "extra",
    [["--max-iterations", "many"], ["--timeout", "soon"], ["--no-such-flag"]],
    ids=["iterations", "timeout", "unknown-flag"],
)
def test_bad_flags_exit_2(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str]
) -> None:
    outcome = cli(capsys, run_args("http://127.0.0.1:9/v1", store, tmp_path, *extra))

    assert outcome.code == 2
    assert outcome.err.splitlines()[-1].startswith("error: ")


def test_negative_max_iterations_is_a_usage_error(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    outcome = cli(
        capsys, run_args("http://127.0.0.1:9/v1", store, tmp_path, "--max-iterations", "-1")
    )

    assert outcome.code == 2
    assert outcome.err.startswith("error: ") or "\nerror: " in outcome.err


def test_missing_memory_folder_is_a_clean_error(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-memory-here"

    outcome = cli(
        capsys, run_args("http://127.0.0.1:9/v1", store, tmp_path, "--memory", str(missing))
    )

    assert outcome.code != 0
    assert outcome.err.startswith("error: ")
    assert str(missing) in outcome.err


def test_no_command_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    outcome = cli(capsys, [])

    assert outcome.code == 2
