"""Bounded work on hostile input in the kernel's core paths, and the Python API's robustness
(issue 26), through the public API against the fake model server over loopback HTTP (and the
CLI where an exit code is the point):

- a megabyte reply of one long word is redacted in time (it took minutes: the run ended long
  after its timeout, as `final_answer`);
- a run whose step kept the event loop busy past its deadline ends `timeout`;
- tool arguments nested 5,000 deep are malformed output fed back to the model (they ended the
  run `error` with a RecursionError), and arguments at the documented depth limit still run;
- text no store can encode (a lone surrogate) is refused before anything is recorded when a
  caller gives it, and repaired when a model sends it (a raw UnicodeEncodeError left the run
  `running`);
- an approval runs only the call it was shown: a log changed after the run suspended is
  refused (exit 2), and nothing runs.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sqlite3
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import fsm_kernel
from fsm_kernel import Agent, AnswerError, ConfigError, HumanAnswer
from fsm_kernel.protocol import MAX_JSON_DEPTH, Completion, Event, EventType, Message, Tool
from fsm_kernel.replay import RecordedRun
from fsm_kernel.store import open_store
from fsm_kernel.testing import ScriptedChatModel, call
from tests.clikit import cli
from tests.fakes.openai_server import FakeOpenAIServer, raw_body, text_reply, tool_reply
from tests.fakes.openai_server import call as wire_call

ROOT = Path(__file__).resolve().parents[2]
APPROVE = ROOT / "workflows" / "approve_tools.yaml"
NOTES_SHA256 = hashlib.sha256(b'{"path":"notes.txt"}').hexdigest()
"""What an approval of read_file(path="notes.txt") records of the arguments it was shown."""


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        monkeypatch.setenv("FSM_KERNEL_BASE_URL", fake.base_url)
        monkeypatch.setenv("FSM_KERNEL_MODEL", "m")
        monkeypatch.setenv("FSM_KERNEL_MAX_RETRIES", "0")
        yield fake


def events_of(store: Path, run_id: str) -> list[Event]:
    with open_store(store) as events:
        return events.read(run_id)


def status_of(store: Path, run_id: str) -> str:
    with open_store(store) as events:
        return RecordedRun.load(events, run_id).status


def of_type(events: Sequence[Event], type_: EventType) -> list[Event]:
    return [e for e in events if e.type is type_]


def nested(depth: int) -> str:
    """A JSON object `depth` levels deep: {"a":{"a": ... 1 ...}}."""
    return '{"a":' * depth + "1" + "}" * depth


# --- redaction and the run's timeout -------------------------------------------------------------


def test_a_megabyte_reply_of_one_word_is_recorded_redacted_well_within_its_timeout(
    server: FakeOpenAIServer, tmp_path: Path
) -> None:
    """The URL pattern made every character of a long word a start that scanned to the word's
    end: 200 KB took 161 s. A megabyte would take most of an hour; pytest's timeout is 60 s."""
    word = "a1" * 500_000
    server.enqueue(text_reply(f"{word} see x://u:pw1@h"))
    store = tmp_path / "runs.db"

    result = fsm_kernel.run("default", "Say it.", store=store, timeout=30, stream=False)

    assert result.termination_reason == "final_answer", result.error
    assert result.response == f"{word} see x://u:pw1@h"  # the caller gets the answer whole
    (responded,) = of_type(events_of(store, result.run_id), EventType.MODEL_RESPONDED)
    assert responded.data["completion"]["message"]["content"] == f"{word} see x://u:[REDACTED]@h"


class BusyModel:
    """A model whose every call keeps the event loop busy for `seconds` (as CPU-bound work on
    the loop does), then answers."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.calls = 0

    async def complete(
        self, messages: Sequence[Message], tools: Sequence[Tool], **options: Any
    ) -> Completion:
        self.calls += 1
        time.sleep(self.seconds)  # noqa: ASYNC251  # the point: asyncio.timeout cannot fire
        return Completion(message=Message.assistant("Done."), finish_reason="stop")


def test_a_step_that_overran_the_runs_deadline_ends_it_timeout_not_final_answer(
    tmp_path: Path,
) -> None:
    model = BusyModel(seconds=0.6)
    store = tmp_path / "runs.db"

    async def main() -> fsm_kernel.RunResult:
        async with Agent("default", chat_model=model, timeout=0.2, store=store) as agent:
            return await agent.run("Say done.")

    result = asyncio.run(main())

    assert (result.termination_reason, result.error) == ("timeout", "run timed out after 0.2s")
    assert model.calls == 1
    (ended,) = of_type(events_of(store, result.run_id), EventType.RUN_TERMINATED)
    assert ended.data["reason"] == "timeout"
    assert status_of(store, result.run_id) == "ended"


# --- deeply nested JSON from the model ----------------------------------------------------------

_DEEP_BODY = json.dumps(
    {
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "datetime", "arguments": "@ARGS@"}},
                ]},
                "finish_reason": "tool_calls",
            }
        ]
    }
).replace('"@ARGS@"', nested(5_000))  # fmt: skip


@pytest.mark.parametrize(
    ("reply", "stream"),
    [
        (tool_reply(wire_call("datetime", nested(5_000), id="c1")), False),
        (tool_reply(wire_call("datetime", nested(5_000), id="c1")), True),
        (raw_body(_DEEP_BODY), False),
    ],
    ids=["arguments as a JSON string", "streamed", "arguments as an object (Ollama native)"],
)
def test_arguments_nested_5000_deep_are_malformed_output_fed_back_not_a_crash(
    server: FakeOpenAIServer, tmp_path: Path, reply: Any, stream: bool
) -> None:
    server.enqueue(reply, text_reply("It is noon."))
    store = tmp_path / "runs.db"

    result = fsm_kernel.run("default", "What time is it?", store=store, stream=stream)

    assert (result.termination_reason, result.response) == ("final_answer", "It is noon.")
    reason = (
        "tool call 'datetime' has arguments that are not JSON: arguments nest objects and "
        f"arrays deeper than {MAX_JSON_DEPTH} levels"
    )
    fed_back = server.requests[1]["messages"][-1]
    assert (fed_back["role"], fed_back["tool_call_id"]) == ("tool", "c1")
    assert fed_back["content"].startswith(f"error: your reply was not executed: {reason}.")
    log = events_of(store, result.run_id)
    (finished,) = of_type(log, EventType.TOOL_FINISHED)
    assert finished.data["malformed"] is True
    assert not of_type(log, EventType.TOOL_STARTED)  # the call never ran
    assert of_type(log, EventType.ITERATION_COMPLETED)[0].data["decision"] == "malformed"


def test_deep_arguments_from_any_chat_model_are_malformed_output_too(tmp_path: Path) -> None:
    """The local model and your own ChatModel make ToolCalls without the wire: the depth limit
    is the ToolCall's, so redaction and the store never walk 5,000 levels."""
    deep: Any = 1
    for _ in range(5_000):
        deep = {"a": deep}
    model = ScriptedChatModel([call("datetime", deep, id="c1"), "It is noon."])
    store = tmp_path / "runs.db"

    async def main() -> fsm_kernel.RunResult:
        async with Agent("default", chat_model=model, store=store) as agent:
            return await agent.run("What time is it?")

    result = asyncio.run(main())

    assert (result.termination_reason, result.response) == ("final_answer", "It is noon."), (
        result.error
    )
    fed_back = model.requests[1].last_message
    assert fed_back is not None
    assert fed_back.content.startswith(
        "error: your reply was not executed: tool call 'datetime' has arguments that are not "
        f"JSON: arguments nest objects and arrays deeper than {MAX_JSON_DEPTH} levels."
    )
    assert status_of(store, result.run_id) == "ended"


def test_arguments_at_the_depth_limit_reach_the_tool_through_redaction_store_and_validation(
    server: FakeOpenAIServer, tmp_path: Path
) -> None:
    def depth(data: dict[str, Any]) -> int:
        """How deep `data` nests."""
        levels = 0
        node: Any = {"data": data}
        while isinstance(node, dict):
            node, levels = next(iter(node.values())), levels + 1
        return levels - 1

    arguments = '{"data":' + nested(MAX_JSON_DEPTH - 1) + "}"  # the limit, the object included
    server.enqueue(tool_reply(wire_call("depth", arguments, id="c1")), text_reply("99 deep."))
    store = tmp_path / "runs.db"

    result = fsm_kernel.run("default", "How deep?", store=store, tools=[depth])

    assert result.termination_reason == "final_answer", result.error
    assert [(r.call.name, r.result.content, r.result.is_error) for r in result.tool_calls] == [
        ("depth", str(MAX_JSON_DEPTH - 1), False)
    ]
    (started,) = of_type(events_of(store, result.run_id), EventType.TOOL_STARTED)
    assert started.data["call"]["arguments"] == json.loads(arguments)  # stored whole


# --- text that no store can encode --------------------------------------------------------------


def test_a_reply_with_a_lone_surrogate_escape_is_recorded_repaired_and_the_run_ends(
    server: FakeOpenAIServer, tmp_path: Path
) -> None:
    server.enqueue(text_reply("bad \ud800 text"))  # sent as the JSON escape "\ud800"
    store = tmp_path / "runs.db"

    result = fsm_kernel.run("default", "hi", store=store, stream=False)

    assert (result.termination_reason, result.response) == ("final_answer", "bad \ufffd text")
    assert status_of(store, result.run_id) == "ended"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"prompt": "bad \ud800 goal"}, "the prompt is not valid text: it holds '\\ud800' at "
         "character 4, a lone surrogate"),
        ({"prompt": "ok", "continue_from": [Message.user("old \udc80")]},
         "the history is not valid text: it holds '\\udc80', a lone surrogate"),
    ],
    ids=["goal", "history"],
)  # fmt: skip
def test_a_goal_that_is_not_text_is_refused_before_anything_is_recorded(
    tmp_path: Path, options: dict[str, Any], message: str
) -> None:
    store = tmp_path / "runs.db"

    async def main() -> None:
        async with Agent("default", chat_model=ScriptedChatModel(["Hi."]), store=store) as agent:
            await agent.run(**options)

    with pytest.raises(ConfigError) as refused:
        asyncio.run(main())

    assert str(refused.value).startswith(message)
    with open_store(store) as events:
        assert events.list_runs() == []


def test_an_answer_that_is_not_text_is_refused_and_the_run_still_waits(tmp_path: Path) -> None:
    store = tmp_path / "runs.db"
    model = ScriptedChatModel([call("read_file", {"path": "x.txt"}, id="c1"), "Fine."])

    async def main() -> tuple[str, str, str]:
        async with Agent("approve_tools", chat_model=model, store=store) as agent:
            waiting = await agent.run("Read x.txt")
            with pytest.raises(AnswerError) as refused:
                await agent.resume(waiting.run_id, answer=HumanAnswer.reject("no \ud800"))
            status = status_of(store, waiting.run_id)
            steer = await agent.resume(waiting.run_id, answer=HumanAnswer.reject("private"))
            return str(refused.value), status, str(steer.waiting_for and steer.waiting_for["kind"])

    refused, status, then = asyncio.run(main())

    assert refused == (
        "the answer's text is not valid text: it holds '\\ud800' at character 3, a lone "
        "surrogate, which UTF-8 cannot encode"
    )
    assert status == "waiting"  # not `running` with 0 iterations
    assert then == "input"  # the good answer went through: the person is asked how to go on


def test_a_user_name_with_undecodable_bytes_answers_as_text(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Python reads bytes of the environment that are not UTF-8 as lone surrogates: the
    default `by` ($USER) is repaired, not a reason to refuse the person's answer."""
    monkeypatch.setenv("USER", "al\udcffice")

    assert HumanAnswer.approve().by == "al\ufffdice"
    with pytest.raises(AnswerError, match="the answer's by is not valid text"):
        HumanAnswer.approve(by="al\udcffice")  # given explicitly: refused, as any text


# --- an approval is bound to the call it showed -------------------------------------------------


def _tamper(store: Path, type_: EventType, edit: Any) -> None:
    """Rewrite the data of the events of `type_` in a SQLite store that holds one run, as
    someone with write access to it could between suspension and resume."""
    with sqlite3.connect(store) as db:
        query = "SELECT rowid, data FROM events WHERE type = ?"
        for rowid, data in db.execute(query, (type_.value,)).fetchall():
            changed = json.dumps(edit(json.loads(data)))
            db.execute("UPDATE events SET data = ? WHERE rowid = ?", (changed, rowid))


def _to_secret(data: dict[str, Any]) -> dict[str, Any]:
    for tc in data["completion"]["message"]["tool_calls"]:
        tc["arguments"] = {"path": "secret.txt"}
    return data


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "notes.txt").write_text("the answer is 42\n")
    (ws / "secret.txt").write_text("do not read\n")
    return ws


def _waiting_for(store: Path, run_id: str) -> dict[str, Any]:
    with open_store(store) as events:
        waiting = RecordedRun.load(events, run_id).waiting_for
    assert waiting is not None
    return waiting


def _suspend(
    server: FakeOpenAIServer, store: Path, ws: Path, capsys: pytest.CaptureFixture[str]
) -> str:
    server.enqueue(tool_reply(wire_call("read_file", {"path": "notes.txt"}, id="c1")))
    first = cli(capsys, "run", APPROVE, "-p", "What do my notes say?", "--store", store,
                "--workspace", ws, "--json")  # fmt: skip
    assert first.code == 3
    assert first.json()["waiting_for"]["tool_call"]["arguments"] == {"path": "notes.txt"}
    return str(first.json()["run_id"])


def test_approve_refuses_a_log_whose_call_was_changed_after_it_was_shown(
    server: FakeOpenAIServer, workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "runs.db"
    run_id = _suspend(server, store, workspace, capsys)
    _tamper(store, EventType.MODEL_RESPONDED, _to_secret)  # run.suspended still shows notes

    approved = cli(capsys, "resume", run_id, "--store", store, "--approve", "--json")

    assert approved.code == 2
    assert (
        f"run {run_id} showed read_file call c1 for approval, but its log now asks about "
        'read_file({"path": "secret.txt"}): the log was changed after the run suspended; '
        "--approve refused, nothing was run"
    ) in approved.err
    log = events_of(store, run_id)
    assert log[-1].type is EventType.RUN_SUSPENDED  # nothing recorded: it still waits
    assert not of_type(log, EventType.TOOL_STARTED)
    assert len(server.requests) == 1


def test_an_approval_bound_to_the_call_seen_is_refused_when_the_whole_log_changed(
    server: FakeOpenAIServer, workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both the reply and what the run shows were changed (consistently): an approval bound
    to the call the person saw (`HumanAnswer.approve(call=...)`) still runs nothing."""
    store = tmp_path / "runs.db"
    run_id = _suspend(server, store, workspace, capsys)
    seen = _waiting_for(store, run_id)
    _tamper(store, EventType.MODEL_RESPONDED, _to_secret)
    _tamper(store, EventType.RUN_SUSPENDED, lambda d: {**d, "waiting_for": {
        **d["waiting_for"], "tool_call": {**d["waiting_for"]["tool_call"],
                                          "arguments": {"path": "secret.txt"}}}})  # fmt: skip

    async def main() -> None:
        async with Agent(APPROVE, store=store) as agent:
            await agent.resume(run_id, answer=HumanAnswer.approve(call=seen["tool_call"]))

    with pytest.raises(AnswerError) as refused:
        asyncio.run(main())

    assert str(refused.value) == (
        f'run {run_id} waits for approval of read_file({{"path": "secret.txt"}}) in state '
        "'act' (call c1); this --approve was given for the same call with other arguments: "
        "refused, nothing was run"
    )
    assert not of_type(events_of(store, run_id), EventType.TOOL_STARTED)


def test_a_recorded_approval_is_not_given_to_a_call_whose_arguments_changed(
    server: FakeOpenAIServer, workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The approval was recorded, then the process died before the tool ran (a run left
    `running`); the reply it approved was changed meanwhile. The resumed run asks again about
    the call its log now holds, and runs nothing."""
    store = tmp_path / "runs.db"
    run_id = _suspend(server, store, workspace, capsys)
    approved = {"kind": "approval", "approved": True, "by": "alice", "state": "act",
                "tool_call_id": "c1", "arguments_sha256": NOTES_SHA256}  # fmt: skip
    with open_store(store) as events:  # what `resume --approve` wrote before it died
        last = events.read(run_id)[-1]
        events.append([
            Event(run_id=run_id, seq=last.seq + n, type=type_, timestamp=last.timestamp,
                  iteration=last.iteration, state="act", data=data)
            for n, (type_, data) in enumerate(
                [(EventType.RUN_RESUMED, {}), (EventType.HUMAN_ANSWERED, approved)], start=1)
        ])  # fmt: skip
    assert status_of(store, run_id) == "running"
    _tamper(store, EventType.MODEL_RESPONDED, _to_secret)

    resumed = cli(capsys, "resume", run_id, "--store", store, "--json")

    assert resumed.code == 3, resumed.err
    assert resumed.json()["waiting_for"]["tool_call"] == {
        "id": "c1", "name": "read_file", "arguments": {"path": "secret.txt"}
    }  # fmt: skip
    assert not of_type(events_of(store, run_id), EventType.TOOL_STARTED)


def test_approve_runs_the_call_it_showed_and_records_which(
    server: FakeOpenAIServer, workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "runs.db"
    run_id = _suspend(server, store, workspace, capsys)
    seen = _waiting_for(store, run_id)
    server.enqueue(text_reply("They say 42."))

    async def main() -> fsm_kernel.RunResult:
        async with Agent(APPROVE, store=store, workspace=workspace) as agent:
            answer = HumanAnswer.approve(by="bob", call=seen["tool_call"])
            return await agent.resume(run_id, answer=answer)

    result = asyncio.run(main())

    assert result.termination_reason == "final_answer", result.error
    assert [(r.call.arguments, r.result.content) for r in result.tool_calls] == [
        ({"path": "notes.txt"}, "the answer is 42\n")
    ]
    (answered,) = of_type(events_of(store, run_id), EventType.HUMAN_ANSWERED)
    assert answered.data["tool_call_id"] == "c1"
    assert answered.data["arguments_sha256"] == NOTES_SHA256
