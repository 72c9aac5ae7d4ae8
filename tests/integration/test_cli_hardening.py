"""The CLI boundary under hostile or careless input: every bad flag is a one-line usage error
(exit 2, and one JSON object on stdout under --json), prompts come from argv, a file or stdin,
global flags work on either side of the command, and nothing a model or a tool says can drive
the terminal."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsm_kernel.store import SqliteEventStore, open_store
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
EXAMPLE = REPO / "examples" / "custom_guard" / "workflow.yaml"
DEAD_URL = "http://127.0.0.1:9/v1"


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


def console(*argv: str | bytes, stdin: bytes = b"", cwd: Path | None = None) -> Outcome:
    """The installed console script in a subprocess (argv may hold raw bytes)."""
    exe = Path(sys.executable).with_name("fsm-kernel")
    env = {**os.environ, "LC_ALL": "C.UTF-8", "PYTHONUTF8": "1"}
    proc = subprocess.run(
        [os.fsencode(exe), *(a if isinstance(a, bytes) else a.encode() for a in argv)],
        input=stdin,
        capture_output=True,
        timeout=60,
        env=env,
        cwd=cwd,
        check=False,
    )
    out, err = proc.stdout.decode("utf-8", "replace"), proc.stderr.decode("utf-8", "replace")
    assert "Traceback" not in out + err
    return Outcome(proc.returncode, out, err)


def run_args(store: Path, *extra: str, url: str = DEAD_URL) -> list[str]:
    return ["run", str(DEFAULT), "--base-url", url, "--store", str(store), *extra]


def assert_usage_error(outcome: Outcome, *fragments: str) -> None:
    assert outcome.code == 2
    assert len(outcome.err.strip().splitlines()) == 1, outcome.err
    assert outcome.err.startswith("error: ")
    for fragment in fragments:
        assert fragment in outcome.err


# --- numbers, folders and text ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "value", "fragment"),
    [
        ("--timeout", "inf", "finite number of seconds"),
        ("--timeout", "-5", "finite number of seconds"),
        ("--request-timeout", "nan", "finite number of seconds"),
        ("--request-timeout", "-1", "finite number of seconds"),
        ("--max-retries", "-1", "out of range"),
        ("--max-retries", "1e9", "not a whole number"),
        ("--max-iterations", "-1", "out of range"),
        ("--max-iterations", str(10**30), "out of range"),
    ],
)
def test_bad_numbers_are_usage_errors_with_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, fragment: str
) -> None:
    store = tmp_path / "runs.db"

    outcome = cli(capsys, run_args(store, "--prompt", "hi", "--json", flag, value))

    assert_usage_error(outcome, flag, fragment)
    assert outcome.json() == {"error": outcome.err.strip()[len("error: ") :], "exit_code": 2}
    assert not store.exists()  # refused before anything was opened


@pytest.mark.parametrize("limit", ["-1", "0", str(10**30)])
def test_runs_list_limit_is_range_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], limit: str
) -> None:
    outcome = cli(
        capsys, ["runs", "list", "--store", str(tmp_path / "r.db"), "--limit", limit, "--json"]
    )

    assert_usage_error(outcome, "--limit", "out of range")
    assert outcome.json()["exit_code"] == 2


def test_runs_list_says_when_it_shows_only_the_most_recent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "runs.db"
    for n in range(3):
        cli(capsys, run_args(store, "--prompt", f"task {n}", "--max-retries", "0"))

    shown = cli(capsys, ["runs", "list", "--store", str(store), "--limit", "2"])
    everything = cli(capsys, ["runs", "list", "--store", str(store), "--limit", "3"])

    assert len(shown.out.splitlines()) == 3  # header + 2 runs
    assert "there are more: --limit N" in shown.err
    assert len(everything.out.splitlines()) == 4
    assert "there are more" not in everything.err


def test_workspace_must_be_an_existing_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    store = tmp_path / "runs.db"

    missing = cli(capsys, run_args(store, "-p", "hi", "--workspace", str(tmp_path / "nope")))
    not_dir = cli(capsys, run_args(store, "-p", "hi", "--workspace", str(a_file)))

    assert_usage_error(missing, "--workspace", "no such directory")
    assert_usage_error(not_dir, "--workspace", "not a directory")


def test_a_folder_given_as_the_workflow_is_named_as_a_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    outcome = cli(capsys, ["validate", str(tmp_path)])

    assert_usage_error(outcome, "is a folder")


def test_undecodable_prompt_bytes_become_replacement_characters(
    tmp_path: Path, server: FakeOpenAIServer
) -> None:
    server.enqueue(text_reply("Noted."))
    store = tmp_path / "runs.db"

    outcome = console(
        "run",
        str(DEFAULT),
        "--base-url",
        server.base_url,
        "--store",
        str(store),
        "--json",
        "--prompt",
        b"caf\xe9 \xff ok",
    )

    assert outcome.code == 0, outcome.err
    sent = server.requests[0]["messages"][-1]["content"]
    assert sent == "caf\ufffd \ufffd ok"
    with SqliteEventStore(store) as events:
        assert events.list_runs()[0].goal == "caf\ufffd \ufffd ok"


def test_an_undecodable_workflow_path_is_a_usage_error(tmp_path: Path) -> None:
    outcome = console("run", b"flow\xff.yaml", "--prompt", "hi", "--json", cwd=tmp_path)

    assert_usage_error(outcome, "not valid UTF-8")
    assert outcome.json()["exit_code"] == 2


# --- where the prompt comes from ---------------------------------------------------------------


def test_prompt_from_a_file_and_from_stdin(tmp_path: Path, server: FakeOpenAIServer) -> None:
    long_prompt = "Summarise this.\n" + "word " * 400_000  # 2 MB: past the OS argument limit
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(long_prompt)
    server.enqueue(text_reply("From the file."), text_reply("From stdin."))
    common = ["--base-url", server.base_url, "--store", str(tmp_path / "r.db"), "--json"]

    from_file = console("run", str(DEFAULT), "--prompt-file", str(prompt_file), *common)
    from_stdin = console("run", str(DEFAULT), "--prompt", "-", *common, stdin=b"piped task")

    assert from_file.code == 0, from_file.err
    assert from_file.json()["response"] == "From the file."
    assert server.requests[0]["messages"][-1]["content"] == long_prompt
    assert from_stdin.code == 0, from_stdin.err
    assert server.requests[1]["messages"][-1]["content"] == "piped task"


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ([], "exactly one of --prompt"),
        (["--prompt", "a", "--prompt-file", "b"], "exactly one of --prompt"),
        (["--prompt", "   "], "the prompt is empty"),
        (["--prompt-file", "/no/such/prompt.txt"], "cannot read --prompt-file"),
    ],
)
def test_prompt_problems_are_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], fragment: str
) -> None:
    outcome = cli(capsys, [*run_args(tmp_path / "r.db", "--json"), *extra])

    assert_usage_error(outcome, fragment)
    assert outcome.json()["exit_code"] == 2


# --- global flags ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["-v", "runs", "list"],
        ["runs", "list", "-v"],
        ["--debug", "runs", "list"],
        ["runs", "list", "--debug"],
        ["runs", "-v", "list"],
    ],
)
def test_global_flags_work_before_or_after_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    open_store(tmp_path / "r.db").close()  # runs list reads an existing store only
    outcome = cli(capsys, [*argv, "--store", str(tmp_path / "r.db")])

    assert outcome.code == 0, outcome.err


def test_verbose_before_the_command_turns_on_debug_logs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    outcome = cli(capsys, ["-v", *run_args(tmp_path / "r.db", "-p", "hi", "--max-retries", "0")])

    assert "DEBUG" in outcome.err


# --- the terminal ------------------------------------------------------------------------------


def test_control_characters_from_model_and_tools_do_not_reach_the_terminal(
    tmp_path: Path, server: FakeOpenAIServer, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "evil.txt").write_text("\x1b]0;pwned\x07\x1b[2J tool text\r")
    server.enqueue(
        tool_reply(call("read_file", {"path": "evil.txt"})),
        text_reply("\x1b[31mred\x1b[0m answer\x9b"),
    )
    args = run_args(tmp_path / "r.db", "-p", "read it", url=server.base_url)

    human = cli(capsys, [*args, "--workspace", str(tmp_path)])

    for stream in (human.out, human.err):
        assert "\x1b" not in stream
        assert "\x07" not in stream
        assert "\x9b" not in stream
    assert "\\u001b[31mred\\u001b[0m answer\\u009b" in human.out


def test_json_output_keeps_the_exact_text(
    tmp_path: Path, server: FakeOpenAIServer, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(text_reply("\x1b[31mred\x1b[0m\x7f\x9b"))

    outcome = cli(capsys, [*run_args(tmp_path / "r.db", "-p", "x", url=server.base_url), "--json"])

    assert "\x1b" not in outcome.out
    assert "\x9b" not in outcome.out
    assert outcome.json()["response"] == "\x1b[31mred\x1b[0m\x7f\x9b"


# --- diagram imports a workflow's own modules ----------------------------------------------


def test_diagram_imports_the_workflows_own_modules_like_run(tmp_path: Path) -> None:
    outcome = console("diagram", str(EXAMPLE), "--format", "mermaid", cwd=tmp_path)

    assert outcome.code == 0, outcome.err
    assert "stateDiagram" in outcome.out


# --- secrets -------------------------------------------------------------------------------------

SK_KEY = "sk-cli-0123456789abcdefLEAKED"
LOCAL_KEY = "local-key-0123456789LEAKED"


@pytest.mark.parametrize("key", [SK_KEY, LOCAL_KEY], ids=["sk-key", "any-key"])
@pytest.mark.parametrize("status", [401, 500])
@pytest.mark.parametrize("suffix", [".db", ".jsonl"])
def test_a_key_the_server_echoes_appears_on_no_way_out(
    tmp_path: Path,
    server: FakeOpenAIServer,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    key: str,
    status: int,
    suffix: str,
) -> None:
    monkeypatch.setenv("FSM_KERNEL_API_KEY", key)
    server.enqueue(*[http_error(status, echo_auth=True)] * 4)
    store = tmp_path / f"runs{suffix}"
    run = run_args(store, "-p", "hi", "--max-retries", "1", url=server.base_url)
    exported = tmp_path / "export.jsonl"
    drawn = tmp_path / "run.dot"

    outputs = [cli(capsys, run), cli(capsys, ["-v", *run, "--json"])]
    assert server.request_headers[0]["authorization"] == f"Bearer {key}"  # it was really sent
    run_id = outputs[1].json()["run_id"]
    outputs += [
        cli(capsys, ["runs", "show", run_id, "--store", str(store)]),
        cli(capsys, ["runs", "show", run_id, "--store", str(store), "--json"]),
        cli(capsys, ["runs", "events", run_id, "--store", str(store), "--json"]),
        cli(capsys, ["runs", "events", run_id, "--store", str(store)]),
        cli(capsys, ["runs", "export", run_id, "--store", str(store), "-o", str(exported)]),
        cli(capsys, ["diagram", "--run", run_id, "--store", str(store)]),
        cli(capsys, ["diagram", "--run", run_id, "--store", str(store), "-o", str(drawn)]),
    ]

    assert outputs[1].json()["termination_reason"] == "agent_error"
    assert "[REDACTED]" in outputs[1].json()["error"]  # the echo was there, and was redacted
    for outcome in outputs:
        assert key not in outcome.out + outcome.err
    files = [p for p in tmp_path.iterdir() if p.is_file()]
    assert exported in files
    assert drawn in files
    for path in files:
        assert key.encode() not in path.read_bytes(), path.name


# --- two processes on one run --------------------------------------------------------------------


def test_a_second_resume_of_a_live_run_is_refused_at_once(
    tmp_path: Path, server: FakeOpenAIServer
) -> None:
    store = tmp_path / "runs.db"
    server.enqueue(hang(30, text_reply("late")))
    exe = Path(sys.executable).with_name("fsm-kernel")
    first = subprocess.Popen(
        [str(exe), *run_args(store, "-p", "hi", url=server.base_url)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        server.wait_for_requests(1)  # the run is live, waiting on its model call
        with SqliteEventStore(store) as events:
            run_id = events.list_runs()[0].run_id

        refused = console("resume", run_id, "--store", str(store), "--json")

        assert refused.code == 1
        assert refused.json()["error"] == (
            f"run {run_id} is being run by another process; wait for it to end or stop it"
        )
        assert refused.err.count("\n") == 1
    finally:
        first.kill()
        first.wait()
    server.enqueue(text_reply("Resumed."))

    resumed = console(
        "resume", run_id, "--store", str(store), "--base-url", server.base_url, "--json"
    )

    assert resumed.code == 0, resumed.err
    assert resumed.json()["response"] == "Resumed."
