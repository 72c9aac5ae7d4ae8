"""Where the answer shows, seen from a real terminal (a pty) and from pipes.

On a terminal a person sees the answer once: it streams onto stdout as it comes and is not
printed again (in `run`, `resume` and `chat`). Redirected or piped, stdout holds the whole
answer once and nothing else the model said, and stderr, when it is the same file (`2>&1`),
does not repeat it."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.openai_server import FakeOpenAIServer, StreamStyle, call, text_reply, tool_reply

ANSWER = "The answer is forty-two, plainly and simply."
PREAMBLE = "Let me look at the clock first."
EXE = str(Path(sys.executable).with_name("fsm-kernel"))


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer(stream_style=StreamStyle(text_piece=3)) as fake:
        yield fake


def run_argv(server: FakeOpenAIServer, store: Path) -> list[str]:
    return [EXE, "run", "default", "-p", "hi", "--base-url", server.base_url,
            "--store", str(store)]  # fmt: skip


def in_terminal(argv: list[str], stdin: bytes | None = None) -> tuple[int, str]:
    """Run `argv` with stdout and stderr on one pseudo-terminal, as in a person's shell (stdin
    a pipe holding `stdin`, or nothing); what the terminal showed, with newlines as `\\n`."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
        stdout=slave,
        stderr=slave,
    )
    os.close(slave)
    if stdin is not None:
        assert proc.stdin is not None
        proc.stdin.write(stdin)
        proc.stdin.close()
    shown = bytearray()
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the program and its children closed the terminal
            break
        if not data:
            break
        shown.extend(data)
    os.close(master)
    code = proc.wait(timeout=60)
    return code, shown.decode("utf-8", "replace").replace("\r\n", "\n")


def piped(argv: list[str], *, merged: bool = False, stdin: bytes = b"") -> tuple[int, str, str]:
    """Run `argv` with stdout a pipe; stderr another pipe, or the same one (`2>&1`)."""
    proc = subprocess.run(
        argv,
        input=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merged else subprocess.PIPE,
        timeout=60,
        check=False,
    )
    err = "" if merged else proc.stderr.decode()
    return proc.returncode, proc.stdout.decode(), err


def test_a_terminal_shows_the_streamed_answer_once(
    server: FakeOpenAIServer, tmp_path: Path
) -> None:
    server.enqueue(text_reply(ANSWER))

    code, shown = in_terminal(run_argv(server, tmp_path / "r.db"))

    assert code == 0, shown
    assert server.requests[0]["stream"] is True
    assert shown.count(ANSWER) == 1, shown
    assert "termination: final_answer" in shown
    assert "Traceback" not in shown


def test_a_secret_streamed_in_pieces_never_reaches_the_terminal(
    server: FakeOpenAIServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the answer streams 3 characters a piece: the configured key and a bearer token are
    # split between pieces, and each piece alone holds no whole secret
    key = "local-key-0123456789"
    monkeypatch.setenv("FSM_KERNEL_API_KEY", key)
    server.enqueue(text_reply(f"Your key is {key}, sent as Bearer\n  tok987654321 there."))

    code, shown = in_terminal(run_argv(server, tmp_path / "r.db"))

    assert code == 0, shown
    assert "0123456789" not in shown, shown
    assert "tok987654321" not in shown, shown
    assert shown.count("Your key is [REDACTED], sent as Bearer") == 1, shown


def test_a_terminal_shows_every_call_s_text_once_and_the_answer_once(
    server: FakeOpenAIServer, tmp_path: Path
) -> None:
    # what the model says before a tool call streams too; only the last call's text is the
    # answer, which is then not printed again
    server.enqueue(tool_reply(call("datetime"), content=PREAMBLE), text_reply(ANSWER))

    code, shown = in_terminal(run_argv(server, tmp_path / "r.db"))

    assert code == 0, shown
    assert shown.count(ANSWER) == 1, shown
    assert shown.count(PREAMBLE) == 1, shown
    assert shown.index(PREAMBLE) < shown.index("tool datetime") < shown.index(ANSWER)


def test_an_answer_given_through_done_is_printed_once_on_a_terminal(
    server: FakeOpenAIServer, tmp_path: Path
) -> None:
    # done(answer) streams no text: the answer is printed at the end, on a line of its own,
    # once (the call's arguments show in the progress and in the list of tool calls)
    server.enqueue(tool_reply(call("done", {"answer": ANSWER})))

    code, shown = in_terminal(run_argv(server, tmp_path / "r.db"))

    assert code == 0, shown
    assert shown.count(f"\n{ANSWER}\n") == 1, shown
    assert "termination: done" in shown


def test_piped_stdout_holds_the_whole_answer_and_only_the_answer(
    server: FakeOpenAIServer, tmp_path: Path
) -> None:
    server.enqueue(tool_reply(call("datetime"), content=PREAMBLE), text_reply(ANSWER))

    code, out, err = piped(run_argv(server, tmp_path / "r.db"))

    assert code == 0, err
    assert out.startswith(ANSWER + "\n")  # the whole answer, first, once
    assert out.count(ANSWER) == 1
    assert PREAMBLE not in out  # what the model said before its tool call is not the answer
    assert "termination: final_answer" in out
    assert f"  {ANSWER}" in err  # a person watching stderr saw it stream
    assert PREAMBLE in err


def test_stderr_merged_into_piped_stdout_does_not_repeat_the_answer(
    server: FakeOpenAIServer, tmp_path: Path
) -> None:
    server.enqueue(text_reply(ANSWER))

    code, both, _ = piped(run_argv(server, tmp_path / "r.db"), merged=True)

    assert code == 0, both
    assert both.count(ANSWER) == 1, both
    assert "■ final_answer" in both  # the progress is still there


def test_chat_on_a_terminal_shows_each_answer_once(
    server: FakeOpenAIServer, tmp_path: Path
) -> None:
    server.enqueue(text_reply(ANSWER), text_reply("A second, different answer."))
    argv = [EXE, "chat", "default", "--base-url", server.base_url,
            "--store", str(tmp_path / "r.db")]  # fmt: skip

    code, shown = in_terminal(argv, stdin=b"hi\nand again\n")

    assert code == 0, shown
    assert shown.count(ANSWER) == 1, shown
    assert shown.count("A second, different answer.") == 1, shown


def test_chat_piped_prints_each_whole_answer_on_stdout(
    server: FakeOpenAIServer, tmp_path: Path
) -> None:
    server.enqueue(text_reply(ANSWER), text_reply("A second, different answer."))
    argv = [EXE, "chat", "default", "--base-url", server.base_url,
            "--store", str(tmp_path / "r.db")]  # fmt: skip

    code, out, err = piped(argv, stdin=b"hi\nand again\n")

    assert code == 0, err
    assert out == f"{ANSWER}\nA second, different answer.\n"
    assert f"  {ANSWER}" in err  # streamed with the progress


def test_chat_with_stderr_merged_into_piped_stdout_says_each_answer_once(
    server: FakeOpenAIServer, tmp_path: Path
) -> None:
    server.enqueue(text_reply(ANSWER))
    argv = [EXE, "chat", "default", "--base-url", server.base_url,
            "--store", str(tmp_path / "r.db")]  # fmt: skip

    code, both, _ = piped(argv, merged=True, stdin=b"hi\n")

    assert code == 0, both
    assert both.count(ANSWER) == 1, both
