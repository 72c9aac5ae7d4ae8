"""The window is a hard limit (issue 26): with a 2,000-token window and tool results of 16 KB
(each four times the window on its own), every request sent stays inside the window with each
strategy, the latest result shortened too, with a note of how much was cut; the condensing
request of `summarize` keeps to it as well."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fsm_kernel.protocol import EventType, Message, Role, ToolCall, ToolResult
from fsm_kernel.store import SqliteEventStore
from fsm_kernel.workflow.spec import ContextSpec
from fsm_kernel.workflow.window import estimate_tokens, fit
from tests.clikit import cli
from tests.fakes.openai_server import FakeOpenAIServer, call, text_reply, tool_reply
from tests.integration.test_context_window import as_messages

ROOT = Path(__file__).resolve().parents[2]
WINDOW = 2_000
READS = 6
RESULT = 16_000  # characters: the registry's output cap, about 4,000 tokens


def workflow(tmp_path: Path, strategy: str) -> str:
    text = (ROOT / "workflows" / "default.yaml").read_text()
    text = text.replace("name: default", "name: hard_window")
    text = text.replace("  max_iterations: 10\n", "  max_iterations: 30\n")
    path = tmp_path / "windowed.yaml"
    path.write_text(text + f"context: {{max_tokens: {WINDOW}, strategy: {strategy}}}\n")
    return str(path)


def reply(i: int) -> Any:
    """The i-th answer; the server counts the prompt as the project's estimate does."""

    def answer(request: dict[str, Any]) -> Any:
        prompt = estimate_tokens(as_messages(request))
        usage = {"prompt_tokens": prompt, "completion_tokens": 10, "total_tokens": prompt + 10}
        if "Condense the conversation" in str(request["messages"][0]["content"]):
            return text_reply("Read the big files; they are all b's.", usage=usage)
        if i == READS:
            return text_reply("It is all b's.", usage=usage)
        return tool_reply(call("read_file", {"path": f"big{i}.txt"}, id=f"r{i}"), usage=usage)

    return answer


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["truncate_tool_results", "drop_oldest", "summarize"])
def test_every_request_stays_inside_a_window_smaller_than_one_tool_result(
    strategy: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for i in range(READS):
        (tmp_path / f"big{i}.txt").write_text("b" * RESULT)
    store = tmp_path / "runs.db"
    with FakeOpenAIServer() as fake:
        fake.enqueue(*(reply(i) for i in range(READS + 1)), *(reply(0) for _ in range(READS)))
        done = cli(
            capsys, "run", workflow(tmp_path, strategy), "-p", "What is in the big files?",
            "--base-url", fake.base_url, "--model", "m", "--store", str(store),
            "--workspace", str(tmp_path), "--json", "--max-retries", "0",
        )  # fmt: skip
        requests = list(fake.requests)

    assert done.code == 0, done.err
    assert done.json()["response"] == "It is all b's."
    sizes = [estimate_tokens(as_messages(r)) for r in requests]
    assert max(sizes) <= WINDOW, sizes  # 4,000 to 16,000 before
    last = as_messages(requests[-1])
    assert last[-1].role is Role.TOOL
    assert last[-1].content.startswith("b" * 1_000)  # the newest result: as much as fits
    assert last[-1].content.endswith(" characters to fit the context window]")
    with SqliteEventStore(store) as events:
        log = events.read(done.json()["run_id"])
    trimmed = [e.data for e in log if e.type is EventType.CONTEXT_TRIMMED]
    assert all(t.get("estimated_tokens_after", 0) <= WINDOW for t in trimmed)
    assert last[-1].tool_call_id in trimmed[-1]["shortened_tool_results"]
    replayed = cli(capsys, "replay", done.json()["run_id"], "--store", str(store), "--json")
    assert json.loads(replayed.out)["identical"] is True


def test_the_cut_note_says_how_much_was_cut_and_the_start_is_kept() -> None:
    tool_call = ToolCall(id="c1", name="read_file", arguments={"path": "x"})
    text = "".join(f"{i:05d}" for i in range(4_000))  # 20,000 characters, each part distinct
    history = [
        Message.system("You are terse."),
        Message.user("goal"),
        Message.assistant("", [tool_call]),
        Message.tool(tool_call, ToolResult(content=text)),
    ]

    fitted = fit(history, ContextSpec(max_tokens=1_000, keep=4))

    result = fitted.messages[-1].content
    kept, _, note = result.rpartition("\n")
    assert text.startswith(kept)
    assert note == f"[cut {len(text) - len(kept)} of 20000 characters to fit the context window]"
    assert fitted.after == estimate_tokens(fitted.messages) <= 1_000
    assert fitted.after > 1_000 - 20  # it cut no more than it had to
    assert fitted.messages[:3] == history[:3]
    assert fitted.shortened == ["c1"]


def test_when_even_the_goal_is_over_the_window_it_is_cut_too() -> None:
    history = [Message.system("You are terse."), Message.user("g" * 40_000)]
    for strategy in ("truncate_tool_results", "drop_oldest", "summarize"):
        spec = ContextSpec(max_tokens=256, strategy=strategy)

        fitted = fit(history, spec)

        assert fitted.after <= 256
        assert fitted.messages[0] == history[0]  # the instructions stay
        assert fitted.messages[1].content.endswith("characters to fit the context window]")
        assert fitted.to_dict(strategy)["cut_messages"] == 1
