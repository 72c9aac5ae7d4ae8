"""Conversations across runs: `run --continue RUN_ID`, `Agent.run(continue_from=...)` and
`fsm-kernel chat` (driven through a pseudo-terminal), against the fake server over loopback. A
continued run starts from the earlier run's conversation as its log records it, so replay and
resume rebuild the same requests."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsm_kernel import Agent
from fsm_kernel.protocol import EventType, Message
from fsm_kernel.replay import recorded_conversation
from fsm_kernel.store import SqliteEventStore
from tests.clikit import cli
from tests.fakes.openai_server import FakeOpenAIServer, call, text_reply, tool_reply

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


def _run(server: FakeOpenAIServer, store: Path, prompt: str, *extra: str) -> list[str]:
    return [
        "run", "default", "-p", prompt, "--base-url", server.base_url, "--model", "m",
        "--store", str(store), "--max-retries", "0", "--json", *extra,
    ]  # fmt: skip


def _said(request: dict[str, object]) -> list[tuple[str, str]]:
    messages = request["messages"]
    assert isinstance(messages, list)
    return [(m["role"], m.get("content") or "") for m in messages if m["role"] != "system"]


def test_run_continue_starts_from_the_earlier_conversation(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "runs.db"
    server.enqueue(
        tool_reply(call("datetime", {}, id="d1")),
        text_reply("Nice to meet you, Ada."),
        text_reply("Your name is Ada."),
    )
    first = cli(capsys, _run(server, store, "My name is Ada.")).json()

    second = cli(capsys, _run(server, store, "What is my name?", "--continue", first["run_id"][:8]))

    assert second.code == 0, second.err
    said = _said(server.requests[2])
    assert said[0] == ("user", "My name is Ada.")
    assert said[1][0] == "assistant"  # the datetime call
    assert said[2][0] == "tool"
    assert said[3:] == [("assistant", "Nice to meet you, Ada."), ("user", "What is my name?")]
    run_id = second.json()["run_id"]
    with SqliteEventStore(store) as events:
        started = events.read(run_id)[0]
        history = recorded_conversation(events, run_id)
    assert started.data["continues"] == first["run_id"]
    assert started.data["history_messages"] == 4
    assert [(m.role.value, m.content) for m in history][-2:] == [
        ("user", "What is my name?"),
        ("assistant", "Your name is Ada."),
    ]
    assert len(history) == 6
    replay = cli(capsys, "replay", run_id, "--store", store, "--json")
    assert json.loads(replay.out)["identical"] is True
    unknown = cli(capsys, _run(server, store, "?", "--continue", "nope"))
    assert unknown.code != 0
    assert "no run with id or id prefix 'nope'" in unknown.err


def test_the_python_api_continues_a_run_or_a_message_list(
    server: FakeOpenAIServer, tmp_path: Path
) -> None:
    async def go() -> None:
        server.enqueue(text_reply("Noted: blue."), text_reply("Blue."), text_reply("Still blue."))
        async with Agent(
            "default", base_url=server.base_url, model="m", store=tmp_path / "api.db"
        ) as agent:
            first = await agent.run("My favourite colour is blue.")
            second = await agent.run("What is it?", continue_from=first)
            given = [Message.user("Remember: blue."), Message.assistant("OK.")]
            third = await agent.run("And now?", continue_from=given)
            assert second.messages[:2] == first.messages
            assert [m.content for m in third.messages[:3]] == ["Remember: blue.", "OK.", "And now?"]
            report = await agent.replay(third.run_id)
            assert report.identical
            assert agent.store is not None
            assert [m.content for m in recorded_conversation(agent.store, third.run_id)] == [
                "Remember: blue.",
                "OK.",
                "And now?",
                "Still blue.",
            ]

    asyncio.run(go())
    said = _said(server.requests[1])
    assert said == [
        ("user", "My favourite colour is blue."),
        ("assistant", "Noted: blue."),
        ("user", "What is it?"),
    ]


def _read_until(fd: int, needle: bytes, seen: bytearray, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while needle not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"never saw {needle!r} in {bytes(seen)!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the child closed the terminal
                chunk = b""
            if not chunk:
                assert needle in seen, f"the terminal closed before {needle!r}: {bytes(seen)!r}"
                return
            seen.extend(chunk)


def test_chat_in_a_terminal_continues_line_after_line(
    server: FakeOpenAIServer, tmp_path: Path
) -> None:
    store = tmp_path / "chat.db"
    server.enqueue(text_reply("Hello, Bo."), text_reply("You are Bo."), text_reply("Bo, still."))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FSM_KERNEL_MAX_RETRIES": "0"}
    command = [sys.executable, "-m", "fsm_kernel", "chat", "default",
               "--base-url", server.base_url, "--model", "m", "--store", str(store)]  # fmt: skip

    def session(lines: list[bytes], expect: list[bytes], *extra: str) -> tuple[int, bytes]:
        main, child = pty.openpty()
        proc = subprocess.Popen(
            [*command, *extra], stdin=child, stdout=child, stderr=child, env=env, close_fds=True
        )
        os.close(child)
        seen = bytearray()
        try:
            for line, answer in zip(lines, expect, strict=True):
                _read_until(main, b"> ", seen)
                del seen[:]
                os.write(main, line)
                _read_until(main, answer, seen)
            _read_until(main, b"> ", seen)
            os.write(main, b"!exit\r")
            code = proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            os.close(main)
        return code, bytes(seen)

    code, _ = session([b"I am Bo.\r", b"Who am I?\r"], [b"Hello, Bo.", b"You are Bo."])

    assert code == 0
    assert _said(server.requests[1]) == [
        ("user", "I am Bo."),
        ("assistant", "Hello, Bo."),
        ("user", "Who am I?"),
    ]
    with SqliteEventStore(store) as events:
        runs = events.list_runs()
        assert len(runs) == 2
        newest = runs[0].run_id
        started = events.read(newest)[0]
    assert started.data["continues"] == runs[1].run_id
    assert started.type is EventType.RUN_STARTED

    code, _ = session([b"And now?\r"], [b"Bo, still."], "--continue", newest)
    assert code == 0
    assert [c for _, c in _said(server.requests[2])] == [
        "I am Bo.",
        "Hello, Bo.",
        "Who am I?",
        "You are Bo.",
        "And now?",
    ]


def test_chat_commands_are_handled_not_sent_and_the_end_says_how_to_go_on(
    server: FakeOpenAIServer, tmp_path: Path
) -> None:
    """Lines a person types to the chat itself (help, an unknown !command, a blank line, the
    /quit other chat tools use) never reach the model; the chat's end names the command that
    continues it. Piped stdin, as a script would drive it."""
    store = tmp_path / "chat.db"
    server.enqueue(text_reply("Hello, Bo."))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FSM_KERNEL_MAX_RETRIES": "0"}
    typed = "/help\n!nope now\n\nI am Bo.\n/quit\nnever sent\n"

    done = subprocess.run(
        [sys.executable, "-m", "fsm_kernel", "chat", "default", "--base-url", server.base_url,
         "--model", "m", "--store", str(store)],
        input=typed, capture_output=True, text=True, env=env, timeout=60, check=False,
    )  # fmt: skip

    assert done.returncode == 0, done.stderr
    assert done.stdout == "Hello, Bo.\n"
    assert [_said(r) for r in server.requests] == [[("user", "I am Bo.")]]
    with SqliteEventStore(store) as events:
        (run,) = events.list_runs()
    lines = done.stderr.replace("> ", "\n").splitlines()
    assert (
        "each line you type is a run that continues this conversation; !exit (or /exit, "
        "/quit, Ctrl-D, Ctrl-C at the prompt) ends the chat; Ctrl-C while a run works stops "
        "that run" in lines
    )
    assert "unknown chat command !nope (!help, !exit)" in lines
    assert lines[-1] == f"(to go on later: fsm-kernel chat default --continue {run.run_id})"


def test_chat_ctrl_c_stops_the_run_at_work_then_ends_the_chat_at_the_prompt(
    server: FakeOpenAIServer, tmp_path: Path
) -> None:
    import signal

    from tests.fakes.openai_server import hang

    store = tmp_path / "chat.db"
    server.enqueue(hang(60, text_reply("too late")))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FSM_KERNEL_MAX_RETRIES": "0"}
    main, child = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fsm_kernel", "chat", "default", "--base-url", server.base_url,
         "--model", "m", "--store", str(store)],
        stdin=child, stdout=child, stderr=child, env=env, close_fds=True,
    )  # fmt: skip
    os.close(child)
    seen = bytearray()
    try:
        _read_until(main, b"> ", seen)
        os.write(main, b"take your time\r")
        server.wait_for_requests(1)
        proc.send_signal(signal.SIGINT)  # while the model works: that run stops
        _read_until(main, b"(cancelled)", seen)
        del seen[: seen.index(b"(cancelled)")]
        _read_until(main, b"> ", seen)
        proc.send_signal(signal.SIGINT)  # at the prompt: the chat ends
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(main)

    assert code == 0
    with SqliteEventStore(store) as events:
        (run,) = events.list_runs()
        last = events.read(run.run_id)[-1]
    assert (last.type, last.data["reason"]) == (EventType.RUN_TERMINATED, "cancelled")


def test_chat_has_no_json_mode(capsys: pytest.CaptureFixture[str]) -> None:
    refused = cli(capsys, "chat", "default", "--json")
    assert refused.code == 2
    assert refused.json() == {
        "error": "chat talks to a person: it has no --json (use run --continue)",
        "exit_code": 2,
    }
