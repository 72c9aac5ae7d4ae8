"""Input the CLI cannot trust is bounded: a prompt is at most MAX_PROMPT_BYTES from any source
(read at most one byte past it, so an endless source is refused at once), and an error repeats
at most the start of a refused argument. Answers to a run's question are text, like prompts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsm_kernel.cli.args import MAX_PROMPT_BYTES
from tests.clikit import Outcome
from tests.fakes.openai_server import FakeOpenAIServer, call, text_reply, tool_reply

EXE = os.fsencode(Path(sys.executable).with_name("fsm-kernel"))


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


def console(*argv: str | bytes, stdin: Path | None = None) -> Outcome:
    """The console script in a subprocess; argv may hold raw bytes, stdin may be a file."""
    with open(stdin or os.devnull, "rb") as source:
        proc = subprocess.run(
            [EXE, *(a if isinstance(a, bytes) else a.encode() for a in argv)],
            stdin=source,
            capture_output=True,
            timeout=60,
            env={**os.environ, "LC_ALL": "C.UTF-8", "PYTHONUTF8": "1"},
            check=False,
        )
    out, err = proc.stdout.decode("utf-8", "replace"), proc.stderr.decode("utf-8", "replace")
    assert "Traceback" not in out + err
    return Outcome(proc.returncode, out, err)


def assert_refused(outcome: Outcome, says: str) -> None:
    assert outcome.code == 2, outcome
    assert outcome.err.count("\n") == 1, outcome.err
    assert says in outcome.err


def test_an_endless_prompt_file_is_refused_at_the_limit(tmp_path: Path) -> None:
    # unbounded, this reads until the memory runs out (2.7 GB, then MemoryError)
    outcome = console("run", "default", "--prompt-file", "/dev/zero", "--store",
                      str(tmp_path / "r.db"))  # fmt: skip

    assert_refused(
        outcome, "error: --prompt-file /dev/zero: the prompt is longer than 4 MiB, the most"
    )
    assert not (tmp_path / "r.db").exists()  # refused before anything was recorded


def test_an_endless_prompt_on_stdin_is_refused_at_the_limit(tmp_path: Path) -> None:
    outcome = console("run", "default", "--prompt", "-", stdin=Path("/dev/zero"))

    assert_refused(outcome, "error: --prompt - (stdin): the prompt is longer than 4 MiB")


def test_a_prompt_one_byte_over_the_limit_is_refused_and_one_at_it_runs(
    tmp_path: Path, server: FakeOpenAIServer
) -> None:
    over, at = tmp_path / "over.txt", tmp_path / "at.txt"
    over.write_bytes(b"a" * (MAX_PROMPT_BYTES + 1))
    at.write_bytes(b"a" * MAX_PROMPT_BYTES)
    server.enqueue(text_reply("Many a's."))
    store = str(tmp_path / "r.db")

    refused = console("run", "default", "--prompt-file", str(over), "--store", store)
    ran = console("run", "default", "--prompt-file", str(at), "--store", store,
                  "--base-url", server.base_url, "--json")  # fmt: skip

    assert_refused(refused, "the prompt is longer than 4 MiB")
    assert ran.code == 0, ran.err
    assert server.requests[0]["messages"][-1]["content"] == "a" * MAX_PROMPT_BYTES


def test_an_endless_chat_line_ends_the_chat_with_one_line(tmp_path: Path) -> None:
    outcome = console("chat", "default", "--store", str(tmp_path / "r.db"),
                      stdin=Path("/dev/zero"))  # fmt: skip

    assert outcome.code == 2, outcome
    assert "error: a line of input is longer than 4 MiB, the most a prompt may be" in outcome.err


def test_an_undecodable_argument_is_echoed_by_its_start_and_size() -> None:
    name = b"flow-" + b"\xff" * 100_000 + b".yaml"

    outcome = console("run", name, "-p", "hi")

    assert_refused(outcome, "error: workflow 'flow-")
    assert f"… ({5 + 3 * 100_000 + 5:,} bytes) is not valid UTF-8" in outcome.err
    assert len(outcome.err) < 300


def test_an_undecodable_answer_is_text_like_a_prompt(
    tmp_path: Path, server: FakeOpenAIServer
) -> None:
    store = str(tmp_path / "r.db")
    server.enqueue(tool_reply(call("read_file", {"path": "a.txt"})), text_reply("Understood."))
    waiting = console("run", "approve_tools", "-p", "read a", "--base-url", server.base_url,
                      "--store", store, "--json")  # fmt: skip
    run_id = json.loads(waiting.out)["run_id"]
    assert console("resume", run_id, "--reject", b"no \xff", "--store", store).code == 3
    answer = b"skip it " + b"\xfe" * 100_000

    answered = console("resume", run_id, "--input", answer, "--store", store, "--json")

    assert answered.code == 0, answered.err[:300]
    asked = server.requests[-1]["messages"]
    assert asked[-1]["content"] == "skip it " + "\ufffd" * 100_000
    assert any(m.get("content") == "rejected by the user: no \ufffd" for m in asked)
