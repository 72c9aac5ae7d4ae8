"""A workflow's `context:` keeps every request inside the model's window: a 200-iteration run
whose history would overflow an 8k-token window stays under it with each strategy, against the
fake server over loopback; what was cut is recorded; a replay is identical; a tool call is never
separated from its results."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from fsm_kernel.protocol import EventType, Message, Role, ToolCall, ToolResult
from fsm_kernel.store import SqliteEventStore
from fsm_kernel.workflow.spec import ContextSpec
from fsm_kernel.workflow.window import estimate_tokens, fit
from tests.clikit import cli
from tests.fakes.openai_server import FakeOpenAIServer, call, text_reply, tool_reply

ROOT = Path(__file__).resolve().parents[2]
WINDOW = 8_000
ITERATIONS = 200


def as_messages(request: dict[str, Any]) -> list[Message]:
    """The request's messages as the kernel's (from OpenAI's wire form)."""
    out = []
    for m in request["messages"]:
        calls = tuple(
            ToolCall(
                id=c["id"],
                name=c["function"]["name"],
                arguments=json.loads(c["function"]["arguments"] or "{}"),
            )
            for c in m.get("tool_calls") or ()
        )
        out.append(
            Message(
                role=Role(m["role"]),
                content=m.get("content") or "",
                tool_calls=calls,
                tool_call_id=m.get("tool_call_id"),
            )
        )
    return out


def workflow(tmp_path: Path, context: str) -> Path:
    (tmp_path / "notes.txt").write_text("n" * 2_000)  # about 500 tokens a read
    text = (ROOT / "workflows" / "default.yaml").read_text()
    text = text.replace("name: default", "name: windowed")
    text = text.replace("  max_iterations: 10\n", f"  max_iterations: {ITERATIONS + 5}\n")
    text = text.replace("  no_progress_repeats: 3\n", f"  no_progress_repeats: {ITERATIONS + 5}\n")
    path = tmp_path / "windowed.yaml"
    path.write_text(text + context)
    return path


def counted(request: dict[str, Any], factor: float) -> int:
    """The prompt tokens a server that counts `factor` times our estimate reports."""
    return round(estimate_tokens(as_messages(request)) * factor)


def long_run(
    server: FakeOpenAIServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    context: str,
    factor: float = 1.0,
) -> dict[str, Any]:
    def read(i: int) -> Any:
        def reply(request: dict[str, Any]) -> Any:
            usage = {"prompt_tokens": counted(request, factor), "completion_tokens": 10}
            usage["total_tokens"] = usage["prompt_tokens"] + 10
            if i == ITERATIONS:
                return text_reply("Read it 200 times.", usage=usage)
            return tool_reply(call("read_file", {"path": "notes.txt"}, id=f"r{i}"), usage=usage)

        return reply

    server.enqueue(*(read(i) for i in range(ITERATIONS + 1)))
    store = tmp_path / "runs.db"
    outcome = cli(
        capsys, "run", workflow(tmp_path, context), "-p", "Read notes.txt 200 times.",
        "--base-url", server.base_url, "--model", "m", "--store", store,
        "--workspace", tmp_path, "--json", "--max-retries", "0",
    )  # fmt: skip
    assert outcome.code == 0, outcome.err
    result = outcome.json()
    result["store"] = store
    return result


@pytest.fixture
def server() -> Any:
    with FakeOpenAIServer() as fake:
        yield fake


@pytest.mark.timeout(300)  # 200 model calls over loopback
def test_without_a_window_the_history_overflows(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    long_run(server, tmp_path, capsys, "")
    assert estimate_tokens(as_messages(server.requests[-1])) > 10 * WINDOW


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("strategy", "factor"),
    [("truncate_tool_results", 1.0), ("drop_oldest", 1.0), ("truncate_tool_results", 1.5)],
)
def test_a_long_run_stays_inside_the_window(
    strategy: str,
    factor: float,
    server: FakeOpenAIServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    result = long_run(
        server,
        tmp_path,
        capsys,
        f"context: {{max_tokens: {WINDOW}, strategy: {strategy}}}\n",
        factor,
    )

    sizes = [counted(r, factor) for r in server.requests]  # as the server counts them
    assert len(sizes) == ITERATIONS + 1
    assert max(sizes[1:]) <= WINDOW  # after the first reply, the server's count is known
    assert result["response"] == "Read it 200 times."
    last = as_messages(server.requests[-1])
    assert last[1] == Message.user("Read notes.txt 200 times.")  # the goal always stays
    assert last[-1].role is Role.TOOL
    assert len(last[-1].content) == 2_000  # the newest result whole
    calls = {c.id for m in last for c in m.tool_calls}
    assert {m.tool_call_id for m in last if m.role is Role.TOOL} <= calls  # none orphaned
    with SqliteEventStore(result["store"]) as events:
        trimmed = [
            e.data for e in events.read(result["run_id"]) if e.type is EventType.CONTEXT_TRIMMED
        ]
    assert trimmed, "the cuts are recorded"
    assert all(t["strategy"] == strategy for t in trimmed)
    assert all(
        t["estimated_tokens_after"] <= WINDOW < t["estimated_tokens_before"] for t in trimmed
    )
    replay = cli(capsys, "replay", result["run_id"], "--store", result["store"], "--json")
    assert json.loads(replay.out)["identical"] is True


def _reply(i: int) -> list[Message]:
    tool_call = ToolCall(id=f"c{i}", name="read_file", arguments={"path": "x"})
    return [
        Message.assistant("", [tool_call]),
        Message.tool(tool_call, ToolResult(content=str(i) * 1_000)),
    ]


def test_drop_oldest_keeps_a_reply_with_its_results_and_the_latest_turns() -> None:
    history = [Message.system("s"), Message.user("goal")]
    for i in range(10):
        history += _reply(i)
    spec = ContextSpec(max_tokens=1_000, strategy="drop_oldest", keep=2)

    fitted = fit(history, spec)

    assert fitted.messages[:2] == history[:2]
    kept = fitted.messages[2:]
    assert kept == history[-len(kept) :]  # the latest replies, each with its result
    assert len(kept) % 2 == 0  # whole turns
    assert len(kept) >= 4  # at least `keep` of them
    assert fitted.dropped == len(history) - len(fitted.messages)
    assert fitted.after <= 1_000 < fitted.before
    one_more = history[:2] + history[-len(kept) - 2 :]
    assert estimate_tokens(one_more) > 1_000  # it dropped no more than it had to


def test_truncate_keeps_the_latest_results_whole_and_stops_once_it_fits() -> None:
    history = [Message.user("goal")]
    for i in range(6):
        history += _reply(i)
    spec = ContextSpec(max_tokens=800, strategy="truncate_tool_results", keep=1)

    fitted = fit(history, spec)

    tools = [m for m in fitted.messages if m.role is Role.TOOL]
    assert tools[-1].content == "5" * 1_000
    n = len(fitted.shortened)
    assert fitted.shortened == [f"c{i}" for i in range(n)]  # oldest first
    assert 0 < n < 6
    assert tools[0].content.endswith("[shortened: 1000 chars]")
    assert all(t.content == str(i) * 1_000 for i, t in enumerate(tools) if i >= n)
    assert fitted.after <= 800
    fewer = fit(history, ContextSpec(max_tokens=fitted.after + 200, keep=1))
    assert len(fewer.shortened) < n  # it stops once the request fits
    unchanged = fit(history, ContextSpec(max_tokens=100_000))
    assert unchanged.messages is history
    assert not unchanged.changed


def test_the_servers_count_scales_the_estimate() -> None:
    history = [Message.user("goal"), *_reply(0), *_reply(1)]
    spec = ContextSpec(max_tokens=600, strategy="truncate_tool_results", keep=0)
    assert not fit(history, spec).changed  # about 520 tokens by the estimate
    assert fit(history, spec, scale=1.5).changed  # the server counted half again as many


def test_validate_points_at_a_bad_context(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = workflow(tmp_path, "context: {max_tokens: 8000, strategy: forget}\n")
    refused = cli(capsys, "validate", bad)
    assert refused.code == 2
    assert f"{bad}:" in refused.err
    assert "strategy" in refused.err


@pytest.mark.timeout(300)
def test_summarize_condenses_the_older_turns_with_a_recorded_model_call(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reads = {"n": 0}
    summaries: list[list[Message]] = []

    def reply(request: dict[str, Any]) -> Any:
        messages = as_messages(request)
        usage = {"prompt_tokens": counted(request, 1.0), "completion_tokens": 10}
        usage["total_tokens"] = usage["prompt_tokens"] + 10
        if messages[0].content.startswith("Condense the conversation"):
            summaries.append(messages)
            return text_reply(f"Read notes.txt {reads['n']} times so far.", usage=usage)
        reads["n"] += 1
        if reads["n"] > ITERATIONS:
            return text_reply("Read it 200 times.", usage=usage)
        read = call("read_file", {"path": "notes.txt"}, id=f"r{reads['n']}")
        return tool_reply(read, usage=usage)

    server.enqueue(*[reply] * (3 * ITERATIONS))
    store = tmp_path / "runs.db"
    path = workflow(tmp_path, f"context: {{max_tokens: {WINDOW}, strategy: summarize}}\n")
    text = path.read_text().replace(f"max_iterations: {ITERATIONS + 5}", "max_iterations: 0")
    path.write_text(text)
    outcome = cli(
        capsys, "run", path, "-p", "Read notes.txt 200 times.",
        "--base-url", server.base_url, "--model", "m", "--store", store,
        "--workspace", tmp_path, "--json", "--max-retries", "0",
    )  # fmt: skip

    assert outcome.code == 0, outcome.err
    result = outcome.json()
    assert result["response"] == "Read it 200 times."
    sizes = [counted(r, 1.0) for r in server.requests]
    assert max(sizes) <= WINDOW
    assert summaries, "the older turns were condensed"
    assert result["iterations"] == ITERATIONS + 1 + len(summaries)  # each summary counts
    last = as_messages(server.requests[-1])
    assert last[1] == Message.user("Read notes.txt 200 times.")  # the goal stays
    assert last[2].content.startswith("A summary of the earlier conversation:\nRead notes.txt")
    assert len(last[-1].content) == 2_000  # the latest turns as they are
    second = summaries[1][1].content if len(summaries) > 1 else ""
    assert second.startswith("Summary so far: Read notes.txt")  # each builds on the last
    with SqliteEventStore(store) as events:
        log = events.read(result["run_id"])
    asked = [e.data for e in log if e.type is EventType.MODEL_REQUESTED]
    assert sum(1 for a in asked if a.get("purpose") == "summarize") == len(summaries)
    trimmed = [e.data for e in log if e.type is EventType.CONTEXT_TRIMMED]
    assert {t["strategy"] for t in trimmed} == {"summarize"}
    # every iteration has its record, each summary's too (with the summary as its answer)
    records = [e.data for e in log if e.type is EventType.ITERATION_COMPLETED]
    assert [r["step"] for r in records] == list(range(1, result["iterations"] + 1))
    condensed = [r for r in records if r["decision"] == "summarize"]
    assert len(condensed) == len(summaries)
    assert condensed[0]["answer"].startswith("Read notes.txt ")
    assert (condensed[0]["tools"], condensed[0]["next_state"]) == ([], "think")
    shown = cli(capsys, "runs", "show", result["run_id"], "--store", store, "--json").json()
    assert [it["decision"] for it in shown["iterations"]].count("summarize") == len(summaries)
    replay = cli(capsys, "replay", result["run_id"], "--store", store, "--json")
    report = json.loads(replay.out)
    assert report["identical"] is True, (report["first_divergence"], report["error"])


def test_a_summary_missing_from_a_log_written_before_its_record_resumes_without_divergence(
    server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A log written before a summary had its own `iteration.completed` lacks that record: a
    resume re-drives it as written (no divergence, no model call asked again)."""
    from tests.fakes.openai_server import http_error

    def reply(request: dict[str, Any]) -> Any:
        if as_messages(request)[0].content.startswith("Condense the conversation"):
            return text_reply("Read notes.txt a few times so far.")
        return tool_reply(call("read_file", {"path": "notes.txt"}))

    server.enqueue(*[reply] * 8, http_error(500))  # the 9th call fails: a resumable ending
    store = tmp_path / "runs.db"
    path = workflow(tmp_path, "context: {max_tokens: 1500, strategy: summarize, keep: 2}\n")
    first = cli(
        capsys, "run", path, "-p", "Read notes.txt.", "--base-url", server.base_url,
        "--model", "m", "--store", store, "--workspace", tmp_path, "--json", "--max-retries", "0",
    )  # fmt: skip
    assert first.json()["termination_reason"] == "agent_error"
    run_id = first.json()["run_id"]
    with SqliteEventStore(store) as events:
        log = events.read(run_id)
    summary_records = [
        e.seq for e in log
        if e.type is EventType.ITERATION_COMPLETED and e.data["decision"] == "summarize"
    ]  # fmt: skip
    assert summary_records, "the window made the run summarize"
    with sqlite3.connect(store) as conn:  # as an older fsm-kernel wrote it
        conn.executemany(
            "DELETE FROM events"
            " WHERE key = (SELECT run_no FROM runs WHERE run_id = ?) * 4294967296 + ?",
            [(run_id, seq) for seq in summary_records],
        )
    asked = len(server.requests)
    server.enqueue(text_reply("Done reading."))

    resumed = cli(capsys, "resume", run_id, "--store", store, "--base-url", server.base_url,
                  "--model", "m", "--json", "--verbose")  # fmt: skip

    assert resumed.json()["termination_reason"] == "final_answer", resumed.err
    assert "diverged" not in resumed.err
    assert len(server.requests) == asked + 1  # only the call that had failed is asked again
