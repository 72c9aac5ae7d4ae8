"""The CLI shows the model's text as it streams (on the progress stream, stderr), prints the
final answer once on stdout, keeps `--json` to one object, and `--no-stream` asks for whole
answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsm_kernel.cli import main
from tests.fakes.openai_server import FakeOpenAIServer, StreamStyle, text_reply

REPO = Path(__file__).resolve().parents[2]
DEFAULT = REPO / "workflows" / "default.yaml"


def run(server: FakeOpenAIServer, tmp_path: Path, *extra: str) -> int:
    return main(
        ["run", str(DEFAULT), "-p", "hi", "--base-url", server.base_url,
         "--store", str(tmp_path / "r.db"), *extra]
    )  # fmt: skip


def test_tokens_stream_on_stderr_and_the_answer_is_printed_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with FakeOpenAIServer(stream_style=StreamStyle(text_piece=3)) as server:
        server.enqueue(text_reply("A streamed answer."))
        assert run(server, tmp_path) == 0

    out, err = capsys.readouterr()
    assert server.requests[0]["stream"] is True
    assert "  A streamed answer." in err  # shown as it arrived, inside the progress
    assert out.count("A streamed answer.") == 1  # the final answer, once, on stdout
    assert out.startswith("A streamed answer.")


def test_json_prints_one_object_and_no_text_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with FakeOpenAIServer() as server:
        server.enqueue(text_reply("Quiet."))
        assert run(server, tmp_path, "--json") == 0

    out, err = capsys.readouterr()
    assert json.loads(out)["response"] == "Quiet."
    assert "Quiet." not in err


def test_no_stream_asks_for_whole_answers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with FakeOpenAIServer() as server:
        server.enqueue(text_reply("Whole."))
        assert run(server, tmp_path, "--no-stream", "--json") == 0

    assert "stream" not in server.requests[0]
    assert json.loads(capsys.readouterr().out)["response"] == "Whole."
