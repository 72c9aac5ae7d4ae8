"""A person in the loop, end to end through the CLI against the fake model server over
loopback: approval of tool calls and input states, suspension (exit 3, `status: waiting`),
`resume --approve/--reject/--input` in a new process-like call, crashes while waiting, and
the status in `runs list`."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsm_kernel import Agent, AnswerError, HumanAnswer
from fsm_kernel.cli.human import TerminalChannel
from fsm_kernel.protocol import EventType
from fsm_kernel.store import SqliteEventStore
from fsm_kernel.testing import ScriptedChatModel, ScriptedHuman, WorkflowHarness, call
from fsm_kernel.workflow.human import Question
from tests.clikit import cli
from tests.fakes.openai_server import FakeOpenAIServer, text_reply, tool_reply
from tests.fakes.openai_server import call as wire_call

ROOT = Path(__file__).resolve().parents[2]
APPROVE = ROOT / "workflows" / "approve_tools.yaml"


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "notes.txt").write_text("the answer is 42\n")
    (ws / "secret.txt").write_text("do not read\n")
    return ws


def _run(server: FakeOpenAIServer, store: Path, ws: Path, *extra: str) -> list[str]:
    return [
        "run", str(APPROVE), "-p", "What do my notes say?", "--base-url", server.base_url,
        "--model", "m", "--store", str(store), "--workspace", str(ws), "--max-retries", "0",
        *extra,
    ]  # fmt: skip


def _resume(store: Path, run_id: str, *extra: str) -> list[str]:
    return ["resume", run_id, "--store", str(store), *extra]


def _types(store: Path, run_id: str) -> list[str]:
    with SqliteEventStore(store) as events:
        return [e.type.value for e in events.read(run_id)]


def test_approval_suspends_then_approve_runs_the_tool_once(
    server: FakeOpenAIServer, workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "runs.db"
    server.enqueue(tool_reply(wire_call("read_file", {"path": "notes.txt"}, id="c1")))

    first = cli(capsys, _run(server, store, workspace, "--json"))

    assert first.code == 3
    waiting = first.json()
    assert waiting["status"] == "waiting"
    assert waiting["termination_reason"] is None
    assert waiting["waiting_for"] == {
        "kind": "approval",
        "state": "act",
        "tool_call": {"id": "c1", "name": "read_file", "arguments": {"path": "notes.txt"}},
    }
    run_id = waiting["run_id"]
    assert _types(store, run_id)[-1] == "run.suspended"
    assert "tool.started" not in _types(store, run_id)  # nothing ran without approval
    listed = cli(capsys, "runs", "list", "--store", store, "--waiting", "--json")
    assert [(r["run_id"], r["status"]) for r in json.loads(listed.out)] == [(run_id, "waiting")]

    server.enqueue(text_reply("Your notes say the answer is 42."))
    resumed = cli(capsys, _resume(store, run_id, "--approve", "--by", "alice", "--json"))

    assert resumed.code == 0, resumed.err
    result = resumed.json()
    assert (result["status"], result["termination_reason"]) == ("ended", "final_answer")
    assert result["response"] == "Your notes say the answer is 42."
    assert len(server.requests) == 2  # the recorded first reply was not asked for again
    assert server.requests[1]["messages"][-1]["content"] == "the answer is 42\n"
    with SqliteEventStore(store) as events:
        log = events.read(run_id)
    (answered,) = [e for e in log if e.type is EventType.HUMAN_ANSWERED]
    assert answered.data == {
        "kind": "approval",
        "approved": True,
        "by": "alice",
        "state": "act",
        "tool_call_id": "c1",  # the call it approves, and the arguments the person was shown
        "arguments_sha256": hashlib.sha256(b'{"path":"notes.txt"}').hexdigest(),
    }
    started = [e for e in log if e.type is EventType.TOOL_STARTED]
    assert [e.data["call"]["id"] for e in started] == ["c1"]  # exactly once
    assert answered.seq < started[0].seq
    listed = cli(capsys, "runs", "list", "--store", store, "--json")
    assert [r["status"] for r in json.loads(listed.out)] == ["ended"]
    again = cli(capsys, _resume(store, run_id, "--approve"))
    assert again.code == 2  # nothing waits any more: a second approval cannot run it twice
    assert "does not wait for a person" in again.err


def test_reject_goes_back_to_the_model_which_takes_another_way(
    server: FakeOpenAIServer, workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "runs.db"
    server.enqueue(tool_reply(wire_call("read_file", {"path": "secret.txt"}, id="c1")))
    run_id = cli(capsys, _run(server, store, workspace, "--json")).json()["run_id"]

    rejected = cli(capsys, _resume(store, run_id, "--reject", "that file is private", "--json"))

    # The rejection routes to the steer state, which asks the person how to go on.
    assert rejected.code == 3
    assert rejected.json()["waiting_for"] == {
        "kind": "input",
        "state": "steer",
        "prompt": "A tool call was rejected. What should the agent do instead?",
    }
    wrong = cli(capsys, _resume(store, run_id, "--approve"))
    assert wrong.code == 2
    assert "waits for input (--input)" in wrong.err

    server.enqueue(
        tool_reply(wire_call("read_file", {"path": "notes.txt"}, id="c2")),
        text_reply("The notes say 42."),
    )
    steered = cli(capsys, _resume(store, run_id, "--input", "read notes.txt instead", "--json"))
    assert steered.code == 3  # the new call needs approval too
    assert steered.json()["waiting_for"]["tool_call"]["name"] == "read_file"
    second_request = server.requests[1]["messages"]
    tool_results = [m for m in second_request if m["role"] == "tool"]
    assert tool_results[-1]["content"] == "rejected by the user: that file is private"
    assert second_request[-1] == {"role": "user", "content": "read notes.txt instead"}

    done = cli(capsys, _resume(store, run_id, "--approve", "--json"))
    assert done.code == 0
    result = done.json()
    assert result["response"] == "The notes say 42."
    assert [(c["name"], c["is_error"]) for c in result["tool_calls"]] == [
        ("read_file", True),
        ("read_file", False),
    ]
    assert len(server.requests) == 3
    with SqliteEventStore(store) as events:
        started = [e for e in events.read(run_id) if e.type is EventType.TOOL_STARTED]
    assert [e.data["call"]["id"] for e in started] == ["c2"]  # the rejected call never ran


def test_resume_of_a_waiting_run_needs_its_answer(
    server: FakeOpenAIServer, workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "runs.db"
    server.enqueue(tool_reply(wire_call("list_directory", {"path": "."}, id="c1")))
    run_id = cli(capsys, _run(server, store, workspace, "--json")).json()["run_id"]

    bare = cli(capsys, _resume(store, run_id, "--json"))
    wrong = cli(capsys, _resume(store, run_id, "--input", "hi"))

    assert bare.code == 2
    assert bare.json()["exit_code"] == 2
    assert "waits for approval (--approve or --reject)" in bare.err
    assert 'list_directory({"path": "."})' in bare.err
    assert len(bare.err.strip().splitlines()) == 1
    assert wrong.code == 2
    assert "--input given" in wrong.err
    assert _types(store, run_id)[-1] == "run.suspended"  # refused before anything was written


def test_human_output_names_the_command_that_answers(
    server: FakeOpenAIServer, workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "runs.db"
    server.enqueue(tool_reply(wire_call("read_file", {"path": "notes.txt"}, id="c1")))

    outcome = cli(capsys, _run(server, store, workspace))  # stdin is not a terminal here

    assert outcome.code == 3
    assert 'waiting for approval of read_file({"path": "notes.txt"}) in state act' in outcome.out
    run_id = outcome.out.strip().splitlines()[-1].split()[-1]
    assert f"answer with: fsm-kernel resume {run_id} --approve" in outcome.out
    listed = cli(capsys, "runs", "list", "--store", store)
    assert "waiting" in listed.out.splitlines()[1]
    shown = cli(capsys, "runs", "show", run_id, "--store", store)
    assert "waiting for a person: approval of read_file" in shown.out


def test_a_crash_while_waiting_and_after_the_answer_loses_nothing(
    server: FakeOpenAIServer, workspace: Path, tmp_path: Path
) -> None:
    """The suspended process ends; a resume that dies after recording the approval (SIGKILL
    while the tool runs) is resumed without an answer: the approval is not asked again."""
    store = tmp_path / "runs.db"
    tools = tmp_path / "slowtools"
    tools.mkdir()
    (tools / "slow_mod.py").write_text(
        "import os, time\n"
        "def slow_write(text: str) -> str:\n"
        '    """Write text slowly.\n\n    Args:\n        text: what to write\n    """\n'
        "    with open(os.environ['SLOW_MARK'], 'a') as f:\n"
        "        f.write(text + '\\n')\n"
        "    time.sleep(float(os.environ.get('SLOW_SLEEP', '0')))\n"
        "    return 'written'\n"
    )
    workflow = tmp_path / "slow.yaml"
    workflow.write_text(
        APPROVE.read_text()
        .replace("name: approve_tools", "name: slow_approve")
        .replace("  - done\n", "  - done\n  - {name: 'slow_mod:slow_write', approval: required}\n")
    )
    marks = tmp_path / "marks.txt"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(tools)]),
        "SLOW_MARK": str(marks),
        "FSM_KERNEL_MAX_RETRIES": "0",
    }
    base = [sys.executable, "-m", "fsm_kernel"]
    server.enqueue(tool_reply(wire_call("slow_write", {"text": "hello"}, id="w1")))
    first = subprocess.run(
        [*base, "run", str(workflow), "-p", "write hello", "--base-url", server.base_url,
         "--model", "m", "--store", str(store), "--workspace", str(workspace), "--json"],
        env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert first.returncode == 3, first.stderr
    run_id = first.stdout.strip().split('"run_id": "')[1].split('"')[0]

    resumed = subprocess.Popen(
        [*base, "resume", run_id, "--store", str(store), "--approve", "--by", "bob", "--json"],
        env={**env, "SLOW_SLEEP": "60"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        for _ in range(600):  # until the approved tool is running
            if (marks.exists() and marks.read_text()) or resumed.poll() is not None:
                break
            time.sleep(0.05)
        assert marks.read_text() == "hello\n"
    finally:
        resumed.kill()
        resumed.wait(timeout=10)
    assert _types(store, run_id)[-1] == "tool.started"

    server.enqueue(text_reply("Wrote it."))
    last = subprocess.run(
        [*base, "resume", run_id, "--store", str(store), "--json"],
        env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip

    assert last.returncode == 0, last.stderr
    assert '"response": "Wrote it."' in last.stdout
    types = _types(store, run_id)
    assert types.count("human.answered") == 1  # the recorded approval was served, not re-asked
    assert types.count("run.suspended") == 1
    with SqliteEventStore(store) as events:
        (answered,) = [e for e in events.read(run_id) if e.type is EventType.HUMAN_ANSWERED]
    assert answered.data["by"] == "bob"
    # The call killed mid-way had started without a result: it is run again (as any tool).
    assert marks.read_text() == "hello\nhello\n"


def test_interactive_terminal_answers_inline_and_waiting_is_off_the_clock(
    tmp_path: Path,
) -> None:
    """The terminal channel asks on stderr and reads stdin; a person who takes longer than
    the run's whole timeout does not time the run out."""
    harness = WorkflowHarness(APPROVE)
    (tmp_path / "notes.txt").write_text("42")
    model = ScriptedChatModel([call("read_file", {"path": "notes.txt"}), "It is 42."])

    class SlowPerson(TerminalChannel):
        async def ask(self, question: Question) -> HumanAnswer:
            await asyncio.sleep(1.5)  # longer than limits.timeout_seconds below
            return await super().ask(question)

    out = io.StringIO()
    person = SlowPerson(by="carol", stdin=io.StringIO("y\n"), out=out)
    result = harness.run(
        "notes?", model=model, workspace=tmp_path, human=person, limits={"timeout_seconds": 1}
    )

    assert result.termination_reason == "final_answer"
    assert out.getvalue() == 'approve read_file({"path": "notes.txt"})? [y/N] '
    assert result.tool_calls[0].result.content == "42"


def test_terminal_reject_asks_why_and_end_of_input_suspends() -> None:
    q = Question(kind="approval", state="act", tool_call=None)
    no = TerminalChannel(by="dan", stdin=io.StringIO("n\ntoo risky\n"), out=io.StringIO())
    gone = TerminalChannel(stdin=io.StringIO(""), out=io.StringIO())

    answer = asyncio.run(no.ask(q))

    assert (answer.approved, answer.text, answer.by) == (False, "too risky", "dan")
    from fsm_kernel.workflow.human import Suspended

    with pytest.raises(Suspended):
        asyncio.run(gone.ask(q))


def test_guards_and_scripted_person_in_the_harness(tmp_path: Path) -> None:
    harness = WorkflowHarness(APPROVE)
    assert harness.step("act", answers=[HumanAnswer.reject("no")]).target == "steer"
    assert harness.step("act", answers=[HumanAnswer.approve()]).target == "evaluate"
    assert harness.step("act").target == "evaluate"

    model = ScriptedChatModel([call("list_directory", {}), "Done without listing."])
    person = ScriptedHuman([HumanAnswer.reject("not now"), HumanAnswer.input("just answer")])
    result = harness.run("list", model=model, workspace=tmp_path, human=person)

    assert result.termination_reason == "final_answer"
    assert [q.kind for q in person.questions] == ["approval", "input"]
    assert result.messages[-2].content == "just answer"
    waiting = harness.run(
        "list", model=ScriptedChatModel([call("list_directory", {})]), workspace=tmp_path
    )
    assert (waiting.status, waiting.termination_reason, waiting.ok) == ("waiting", None, False)


def test_python_api_suspends_and_resumes_with_an_answer(
    server: FakeOpenAIServer, workspace: Path, tmp_path: Path
) -> None:
    async def go() -> None:
        server.enqueue(
            tool_reply(wire_call("read_file", {"path": "notes.txt"}, id="p1")),
            text_reply("42."),
        )
        async with Agent(
            APPROVE,
            base_url=server.base_url,
            model="m",
            workspace=workspace,
            store=tmp_path / "api.db",
            max_retries=0,
        ) as agent:
            waiting = await agent.run("notes?")
            assert waiting.status == "waiting"
            assert waiting.waiting_for is not None
            assert waiting.waiting_for["tool_call"]["id"] == "p1"
            with pytest.raises(AnswerError):
                await agent.resume(waiting.run_id)
            with pytest.raises(AnswerError):
                await agent.resume(waiting.run_id, answer=HumanAnswer.input("x"))
            done = await agent.resume(waiting.run_id, answer=HumanAnswer.approve(by="eve"))
            assert (done.status, done.termination_reason, done.response) == (
                "ended",
                "final_answer",
                "42.",
            )
            report = await agent.replay(waiting.run_id)
            assert report.identical, report.to_dict()

    asyncio.run(go())


SCHEDULED = """\
kernel_id: hitl
schedule: "*/10 * * * *"
state_dir: state
store: kernel.db
agents:
  - agent_id: reader
    workflow: {workflow}
    prompt: "READER-TASK: what do the notes say? {{STATE}}"
  - agent_id: clock
    prompt: "CLOCK-TASK: what time is it? {{STATE}}"
"""


def test_a_scheduled_run_that_waits_frees_the_worker_and_resume_completes_it(
    server: FakeOpenAIServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("42")
    (tmp_path / "hitl.yaml").write_text(SCHEDULED.format(workflow=APPROVE))

    def answer(request: dict[str, object]) -> object:
        text = json.dumps(request["messages"])
        if "CLOCK-TASK" in text:
            return text_reply("It is noon.")
        if '"role": "tool"' in text:
            return text_reply("The notes say 42.")
        return tool_reply(wire_call("read_file", {"path": "notes.txt"}, id="r1"))

    server.enqueue(answer, answer)

    cycle = cli(capsys, "schedule", "hitl.yaml", "--once", "--base-url", server.base_url, "--json")

    assert cycle.code == 0, cycle.err  # waiting is not a failure
    result = cycle.json()
    assert (result["succeeded"], result["failed"], result["waiting"]) == (1, 0, 1)
    statuses = {d["agent_id"]: d["status"] for d in result["details"]}
    assert statuses == {"reader": "waiting", "clock": "done"}
    (waiting,) = [d for d in result["details"] if d["agent_id"] == "reader"]
    rows = json.loads(cli(capsys, "dispatches", "hitl.yaml", "--json").out)
    (row,) = [r for r in rows if r["agent_id"] == "reader"]
    assert (row["status"], row["run_id"]) == ("waiting", waiting["run_id"])
    human = cli(capsys, "dispatches", "hitl.yaml")
    assert f"waiting for a person: fsm-kernel resume {waiting['run_id']}" in human.out

    server.enqueue(answer)
    resumed = cli(capsys, "resume", waiting["run_id"], "--store", "kernel.db", "--approve")

    assert resumed.code == 0, resumed.err
    rows = json.loads(cli(capsys, "dispatches", "hitl.yaml", "--json").out)
    (row,) = [r for r in rows if r["agent_id"] == "reader"]
    assert (row["status"], row["termination_reason"]) == ("done", "final_answer")
    assert row["finished_at"] is not None


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("{name: raed_file, approval: required}", ":20:5: unknown tool 'raed_file'"),
        ("{name: read_file, approval: maybe}", ":20:33: approval: Input should be 'required'"),
        ("{name: read_file, approve: required}", ":20:23: unknown key 'approve'"),
    ],
)
def test_validate_points_at_a_bad_tool_entry(
    entry: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        APPROVE.read_text().replace("  - {name: read_file, approval: required}", f"  - {entry}")
    )

    outcome = cli(capsys, "validate", bad)

    assert outcome.code == 2
    assert outcome.err == f"error: {bad}{message}" + outcome.err.split(message, 1)[1]
    assert len(outcome.err.splitlines()) == 1


def test_the_schema_describes_tool_entries(capsys: pytest.CaptureFixture[str]) -> None:
    schema = json.loads(cli(capsys, "schema").out)
    items = schema["properties"]["tools"]["anyOf"][1]["items"]["anyOf"]
    entry = items[1]
    assert items[0] == {"type": "string"}
    assert entry["properties"]["approval"]["enum"] == ["required", "never"]
    assert entry["required"] == ["name"]
    assert entry["additionalProperties"] is False


def test_waiting_for_a_person_is_never_caught_or_retried(tmp_path: Path) -> None:
    """`catch: any` and `retry:` on the state that asks: suspension is not a failure."""
    text = APPROVE.read_text().replace(
        "  act:      {action: tools.execute, description: run the tools a person approved}",
        "  act:\n    action: tools.execute\n    retry: {max_attempts: 2}\n"
        "    catch: [{error: any, target: terminate, reason: final_answer}]",
    )
    assert text != APPROVE.read_text()
    workflow = tmp_path / "caught.yaml"
    workflow.write_text(text)
    harness = WorkflowHarness(workflow)
    model = ScriptedChatModel([call("list_directory", {})])

    result = harness.run("list", model=model, workspace=tmp_path)

    assert (result.status, result.termination_reason) == ("waiting", None)
    types = [e.type for e in result.events]
    assert EventType.ACTION_FAILED not in types
    assert EventType.ERROR_CAUGHT not in types
    assert types[-1] is EventType.RUN_SUSPENDED


def test_the_diagram_of_a_waiting_run_says_it_waits_where(
    server: FakeOpenAIServer, workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "runs.db"
    server.enqueue(tool_reply(wire_call("read_file", {"path": "notes.txt"}, id="c1")))
    run_id = cli(capsys, _run(server, store, workspace, "--json")).json()["run_id"]

    waiting = cli(capsys, "diagram", APPROVE, "--run", run_id, "--store", store)
    server.enqueue(text_reply("42."))
    assert cli(capsys, _resume(store, run_id, "--approve")).code == 0
    ended = cli(capsys, "diagram", APPROVE, "--run", run_id, "--store", store)

    assert f"run {run_id[:8]}" in waiting.out or run_id in waiting.out
    assert "waiting for a person in act after 2 transitions" in waiting.out
    assert "waiting for a person" not in ended.out
    assert "final_answer after" in ended.out


def test_a_rejection_leads_the_model_to_another_tool(
    server: FakeOpenAIServer, workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workflow = tmp_path / "guarded.yaml"
    workflow.write_text(
        (ROOT / "workflows" / "default.yaml")
        .read_text()
        .replace("name: default", "name: guarded")
        .replace(
            "tools: [datetime, read_file, list_directory, done]",
            "tools: [datetime, {name: read_file, approval: required}, list_directory, done]",
        )
    )
    store = tmp_path / "runs.db"
    server.enqueue(tool_reply(wire_call("read_file", {"path": "secret.txt"}, id="r1")))
    args = ["run", workflow, "-p", "What files are there?", "--base-url", server.base_url,
            "--model", "m", "--store", store, "--workspace", workspace, "--json"]  # fmt: skip
    run_id = cli(capsys, *args).json()["run_id"]

    server.enqueue(
        tool_reply(wire_call("list_directory", {"path": "."}, id="l1")),
        text_reply("There are notes.txt and secret.txt."),
    )
    done = cli(capsys, _resume(store, run_id, "--reject", "list the folder instead", "--json"))

    assert done.code == 0, done.err
    result = done.json()
    assert [(c["name"], c["is_error"]) for c in result["tool_calls"]] == [
        ("read_file", True),
        ("list_directory", False),
    ]
    assert result["tool_calls"][0]["result"] == "rejected by the user: list the folder instead"
    assert "notes.txt" in result["tool_calls"][1]["result"]
    assert result["response"] == "There are notes.txt and secret.txt."


def test_a_crash_before_the_question_asks_it_on_resume_without_asking_the_model_again(
    server: FakeOpenAIServer, workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The log of a process killed after the model's reply but before `run.suspended` was
    written: a plain resume asks the question (exit 3) from the recorded reply."""
    import sqlite3

    store = tmp_path / "runs.db"
    server.enqueue(tool_reply(wire_call("read_file", {"path": "notes.txt"}, id="c1")))
    run_id = cli(capsys, _run(server, store, workspace, "--json")).json()["run_id"]
    with sqlite3.connect(store) as db:  # as if killed just before the suspension
        db.execute(
            "DELETE FROM events WHERE type = 'run.suspended'"
            " AND key >> 32 = (SELECT run_no FROM runs WHERE run_id = ?)",
            (run_id,),
        )
        db.execute("UPDATE runs SET status = 'running' WHERE run_id = ?", (run_id,))
    assert _types(store, run_id)[-1] != "run.suspended"
    with_answer = cli(capsys, _resume(store, run_id, "--approve"))
    assert with_answer.code == 2  # it does not wait yet: there is nothing to approve

    again = cli(capsys, _resume(store, run_id, "--json"))

    assert again.code == 3
    assert again.json()["waiting_for"]["tool_call"]["id"] == "c1"
    assert len(server.requests) == 1  # the recorded reply was served, not asked again
    server.enqueue(text_reply("42."))
    done = cli(capsys, _resume(store, run_id, "--approve", "--json"))
    assert (done.code, done.json()["response"]) == (0, "42.")
