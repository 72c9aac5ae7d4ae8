"""One table of exit codes for every command: 0 success, 1 the run did not succeed, 2 bad input
(an unknown or ambiguous run id included, and a run that cannot be resumed), 3 waiting for a
person. Each command's --help shows it, and each command follows it."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from fsm_kernel.cli import EXIT_CODES_HELP, build_parser
from tests.clikit import Outcome, cli
from tests.fakes.openai_server import FakeOpenAIServer, call, text_reply, tool_reply

UNKNOWN = "0123abcd-ffff-7fff-bfff-ffffffffffff"


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


@pytest.fixture
def store(tmp_path: Path, server: FakeOpenAIServer, capsys: pytest.CaptureFixture[str]) -> Path:
    """A store holding two finished runs (their ids share a prefix: UUIDv7s of one minute)."""
    path = tmp_path / "runs.db"
    server.enqueue(text_reply("One."), text_reply("Two."))
    for _ in range(2):
        assert run(capsys, server, path, "--json").code == 0
    return path


def run(
    capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer, store: Path, *extra: str
) -> Outcome:
    return cli(capsys, "run", "default", "-p", "hi", "--base-url", server.base_url,
               "--store", str(store), *extra)  # fmt: skip


def assert_bad_input(outcome: Outcome, says: str) -> None:
    assert outcome.code == 2, outcome
    assert outcome.err.count("\n") == 1, outcome.err  # one line
    assert outcome.err.startswith("error: ")
    assert says in outcome.err


def _commands(parser: argparse.ArgumentParser, prog: str = "") -> Iterator[tuple[str, str]]:
    """(name, help text) of the parser and of every command under it."""
    yield prog or parser.prog, parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, f"{prog} {name}".strip())


def test_every_command_s_help_shows_the_exit_code_table() -> None:
    commands = dict(_commands(build_parser()))

    assert {"run", "chat", "resume", "replay", "runs list", "runs show", "dispatches", "ui"} <= (
        set(commands)
    )
    for name, text in commands.items():
        flat = " ".join(text.split())
        assert " ".join(EXIT_CODES_HELP.split()) in flat, name
    assert "3 the run waits for a person" in EXIT_CODES_HELP
    assert "2 bad input" in EXIT_CODES_HELP
    assert "unknown or ambiguous run" in EXIT_CODES_HELP


@pytest.mark.parametrize(
    "argv",
    [
        ["resume", UNKNOWN],
        ["replay", UNKNOWN],
        ["runs", "show", UNKNOWN],
        ["runs", "events", UNKNOWN],
        ["runs", "export", UNKNOWN, "-o", "out.jsonl"],
        ["diagram", "--run", UNKNOWN],
        ["run", "default", "-p", "hi", "--continue", UNKNOWN],
        ["chat", "default", "--continue", UNKNOWN],
    ],
    ids=lambda argv: " ".join(a for a in argv if a != UNKNOWN and not a.startswith("-")),
)
def test_an_unknown_run_id_is_bad_input_for_every_command(
    argv: list[str], store: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = [tmp_path / a if a == "out.jsonl" else a for a in argv]  # type: ignore[misc]

    outcome = cli(capsys, *argv, "--store", str(store))

    assert_bad_input(outcome, f"no run with id or id prefix '{UNKNOWN}'")


@pytest.mark.parametrize("argv", [["resume"], ["replay"], ["runs", "show"]])
def test_an_ambiguous_run_id_is_bad_input(
    argv: list[str], store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    outcome = cli(capsys, *argv, "01", "--store", str(store))

    assert_bad_input(outcome, "ambiguous")


def test_an_unknown_dispatch_id_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "agents.yaml"
    document = {
        "kernel_id": "k",
        "state_dir": str(tmp_path / "state"),
        "store": str(tmp_path / "runs.db"),
        "agents": [{"agent_id": "a", "prompt": "p"}],
    }
    config.write_text(yaml.safe_dump(document), encoding="utf-8")

    outcome = cli(capsys, "dispatches", str(config), "--cancel", UNKNOWN)

    assert_bad_input(outcome, "no dispatch")


@pytest.mark.parametrize("answer", [[], ["--approve"], ["--reject", "no"], ["--input", "x"]])
def test_resuming_an_ended_run_is_bad_input_with_an_answer_or_without(
    answer: list[str], store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = cli(capsys, "runs", "list", "--json", "--store", str(store)).out.split('"')[3]

    outcome = cli(capsys, "resume", run_id, *answer, "--store", str(store))

    assert_bad_input(outcome, f"run {run_id} already terminated (final_answer)")
    if answer:
        assert f"it does not wait for a person ({answer[0]})" in outcome.err


def test_a_waiting_run_exits_3_until_it_ends_0(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "runs.db"
    server.enqueue(tool_reply(call("read_file", {"path": "a.txt"})), text_reply("Nothing."))
    waiting = cli(capsys, "run", "approve_tools", "-p", "read a", "--base-url",
                  server.base_url, "--store", str(store), "--json")  # fmt: skip
    run_id = waiting.json()["run_id"]
    assert waiting.code == 3

    # rejected: approve_tools asks the person how to go on, so it waits again
    rejected = cli(capsys, "resume", run_id, "--reject", "no", "--store", str(store), "--json")
    assert (rejected.code, rejected.json()["waiting_for"]["kind"]) == (3, "input"), rejected

    answered = cli(capsys, "resume", run_id, "--input", "skip it", "--store", str(store),
                   "--json")  # fmt: skip
    assert (answered.code, answered.json()["response"]) == (0, "Nothing."), answered


def test_a_run_that_did_not_succeed_exits_1(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.enqueue(tool_reply(call("datetime")))

    outcome = run(capsys, server, tmp_path / "r.db", "--max-iterations", "1", "--json")

    assert outcome.code == 1
    assert outcome.json()["termination_reason"] == "max_iterations"


def test_an_unknown_option_is_named_before_a_missing_command(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for argv in (
        ["--bogus"],
        ["run", "--bogus"],
        ["runs", "show", "--bogus"],
        ["--bogus", "run"],  # before the command whose argument is missing
        ["--bogus", "runs", "show"],
        ["runs", "--bogus", "show"],
    ):
        outcome = cli(capsys, *argv)

        assert_bad_input(outcome, "unrecognized arguments: --bogus")
        assert "required" not in outcome.err
    # a command line without an unknown option still says what is missing
    assert_bad_input(cli(capsys, "--debug"), "the following arguments are required: COMMAND")
    assert_bad_input(cli(capsys, "run", "-p", "x"), "required: WORKFLOW")
    assert_bad_input(cli(capsys, "--debug", "run", "-v"), "required: WORKFLOW")
