"""The public Python API: `fsm_kernel.run/arun`, `Agent` (concurrent runs, resume, replay,
stream), the pinned `__all__`, and the "Embed in Python" guide's examples, run for real
against the fake server over loopback HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

import fsm_kernel
from fsm_kernel.errors import AgentConnectionError, ConfigError
from fsm_kernel.protocol import Completion, EventType, Message, Tool
from fsm_kernel.store import SqliteEventStore
from fsm_kernel.streaming import emit_text
from fsm_kernel.testing import ScriptedChatModel, call
from tests.fakes.openai_server import FakeOpenAIServer, http_error, text_reply, tool_reply
from tests.fakes.openai_server import call as wire_call

REPO = Path(__file__).resolve().parents[2]

PUBLIC = [
    "Agent",
    "AgentError",
    "AnswerError",
    "ChatModel",
    "ConfigError",
    "EventStore",
    "FsmKernelError",
    "HumanAnswer",
    "HumanChannel",
    "IterationCompleted",
    "Question",
    "ReplayReport",
    "ResumeError",
    "RunEnded",
    "RunError",
    "RunLockedError",
    "RunNotFoundError",
    "RunResult",
    "StateEntered",
    "StoreError",
    "StreamEvent",
    "TerminationReason",
    "TextDelta",
    "ToolCallFinished",
    "ToolCallStarted",
    "ToolError",
    "ToolExecutor",
    "ToolFatalError",
    "TransitionTaken",
    "WorkflowError",
    "WorkflowSpec",
    "__version__",
    "arun",
    "load_workflow",
    "reads",
    "run",
    "tool",
    "writes",
]


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        monkeypatch.setenv("FSM_KERNEL_BASE_URL", fake.base_url)
        yield fake


def test_the_public_names_are_pinned() -> None:
    assert fsm_kernel.__all__ == PUBLIC  # a change to the API changes this test too
    for name in PUBLIC:
        assert getattr(fsm_kernel, name) is not None
    with pytest.raises(AttributeError):
        fsm_kernel.not_a_name  # noqa: B018


def test_import_lists_the_public_names_from_a_fresh_interpreter() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import fsm_kernel; print(fsm_kernel.__all__)"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert out.strip() == str(PUBLIC)


def test_run_one_prompt(server: FakeOpenAIServer) -> None:
    server.enqueue(tool_reply(wire_call("datetime")), text_reply("It is noon."))

    result = fsm_kernel.run("default", "What time is it?")

    assert result.ok
    assert result.termination_reason is fsm_kernel.TerminationReason.FINAL_ANSWER
    assert [r.call.name for r in result.tool_calls] == ["datetime"]


def test_bad_options_are_errors_not_runs(tmp_path: Path) -> None:
    with pytest.raises(fsm_kernel.WorkflowError):
        fsm_kernel.run(tmp_path / "missing.yaml", "hi")
    with pytest.raises(ConfigError):
        fsm_kernel.run("default", "hi", store="mysql://x")


def test_an_agent_runs_prompts_concurrently_and_records_them(tmp_path: Path) -> None:
    async def answer(messages: Sequence[Message], tools: Sequence[Tool]) -> str:
        await asyncio.sleep(0.05)
        return f"echo: {messages[-1].content}"

    async def main() -> list[str]:
        model = fsm_kernel_function_model(answer)
        async with fsm_kernel.Agent("default", chat_model=model, store=tmp_path / "r.db") as a:
            results = await asyncio.gather(*(a.run(f"p{i}") for i in range(5)))
        return [r.response for r in results]

    assert asyncio.run(main()) == [f"echo: p{i}" for i in range(5)]
    with SqliteEventStore(tmp_path / "r.db") as store:
        assert len(store.list_runs()) == 5


def test_stream_yields_states_text_tools_and_the_result() -> None:
    class Streams:
        def __init__(self) -> None:
            self.script = ScriptedChatModel([call("datetime"), "It is noon."])

        async def complete(self, messages: Sequence[Message], tools: Sequence[Tool]) -> Completion:
            completion = await self.script.complete(messages, tools)
            for word in completion.message.content.split():
                emit_text(word + " ")
            return completion

    async def main() -> list[object]:
        async with fsm_kernel.Agent("default", chat_model=Streams()) as agent:
            return [event async for event in agent.stream("What time is it?")]

    events = asyncio.run(main())

    kinds = [type(e).__name__ for e in events]
    assert kinds[0] == "StateEntered"
    assert "ToolCallStarted" in kinds
    assert kinds.index("ToolCallStarted") < kinds.index("ToolCallFinished")
    text = "".join(e.text for e in events if isinstance(e, fsm_kernel.TextDelta))
    assert text == "It is noon. "
    assert isinstance(events[-1], fsm_kernel.RunEnded)
    assert events[-1].result.response == "It is noon."
    assert kinds.count("RunEnded") == 1


def test_stream_over_http_yields_the_servers_text_deltas(server: FakeOpenAIServer) -> None:
    server.enqueue(tool_reply(wire_call("datetime")), text_reply("It is noon, UTC."))

    async def main() -> list[object]:
        async with fsm_kernel.Agent("default") as agent:  # FSM_KERNEL_BASE_URL: the fake
            return [event async for event in agent.stream("What time is it?")]

    events = asyncio.run(main())

    deltas = [e.text for e in events if isinstance(e, fsm_kernel.TextDelta)]
    assert len(deltas) > 1  # the server streamed the answer in pieces
    assert "".join(deltas) == "It is noon, UTC."
    assert server.requests[0]["stream"] is True
    assert isinstance(events[-1], fsm_kernel.RunEnded)
    assert events[-1].result.response == "It is noon, UTC."


def test_leaving_the_stream_early_cancels_the_run(tmp_path: Path) -> None:
    class Slow:
        async def complete(self, messages: Sequence[Message], tools: Sequence[Tool]) -> Completion:
            await asyncio.sleep(30)
            raise AssertionError("never answers")

    async def left_early(agent: fsm_kernel.Agent) -> None:
        async for event in agent.stream("hi"):
            if isinstance(event, fsm_kernel.StateEntered) and event.state == "think":
                break

    async def closed_at_once(agent: fsm_kernel.Agent) -> None:
        async with contextlib.aclosing(agent.stream("hi")) as events:
            async for event in events:
                if isinstance(event, fsm_kernel.StateEntered) and event.state == "think":
                    break
        runs = [r for r in agent.store.list_runs() if r.termination_reason]  # type: ignore[union-attr]
        assert [r.termination_reason for r in runs] == ["cancelled"]  # before the agent closes

    async def main() -> list[str | None]:
        async with fsm_kernel.Agent("default", chat_model=Slow(), store=tmp_path / "r.db") as a:
            await closed_at_once(a)
            await left_early(a)
        with SqliteEventStore(tmp_path / "r.db") as store:
            return [r.termination_reason for r in store.list_runs()]

    assert asyncio.run(main()) == ["cancelled", "cancelled"]


def test_agent_resume_and_replay(server: FakeOpenAIServer, tmp_path: Path) -> None:
    server.enqueue(tool_reply(wire_call("datetime")), http_error(503))

    async def main() -> tuple[str, str, bool]:
        async with fsm_kernel.Agent("default", store=tmp_path / "r.db", max_retries=0) as a:
            failed = await a.run("What time is it?")
            server.enqueue(text_reply("Noon."))
            resumed = await a.resume(failed.run_id)
            report = await a.replay(failed.run_id)
        return failed.termination_reason, resumed.response, report.identical

    assert asyncio.run(main()) == ("agent_error", "Noon.", True)


def test_resume_needs_a_store_and_known_options() -> None:
    async def main() -> None:
        async with fsm_kernel.Agent("default") as agent:
            with pytest.raises(ConfigError, match="needs a store"):
                await agent.resume("x")

    asyncio.run(main())


def test_the_agent_closes_what_it_opened(tmp_path: Path) -> None:
    async def main() -> fsm_kernel.Agent:
        async with fsm_kernel.Agent("default", store=tmp_path / "r.db") as agent:
            pass
        return agent

    agent = asyncio.run(main())
    with pytest.raises(fsm_kernel.StoreError):
        agent.store.read("x")  # type: ignore[union-attr]


def fsm_kernel_function_model(fn: object) -> object:
    from fsm_kernel.testing import FunctionChatModel

    return FunctionChatModel(fn)  # type: ignore[arg-type]


# --- the docs' examples (docs/how-to/python.md), run as written in a fresh process ---------


def guide_examples() -> list[str]:
    text = (REPO / "docs" / "how-to" / "python.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, re.S)


@pytest.mark.parametrize("index", range(3))
def test_the_python_guide_examples_run(
    index: int, server: FakeOpenAIServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    examples = guide_examples()
    assert len(examples) == 3
    monkeypatch.chdir(tmp_path)
    server.enqueue(
        tool_reply(wire_call("datetime")), text_reply("It is noon."), text_reply("Hello!")
    )

    proc = subprocess.run(
        [sys.executable, "-c", examples[index]], capture_output=True, text=True, timeout=60,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip

    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout.strip()


def test_a_model_failure_is_a_result_not_an_exception() -> None:
    class Down:
        async def complete(self, messages: Sequence[Message], tools: Sequence[Tool]) -> Completion:
            raise AgentConnectionError("cannot reach model server: refused")

    result = fsm_kernel.run("default", "hi", chat_model=Down())

    assert result.termination_reason == "agent_error"
    assert [e.type for e in result.events][-3:] == [
        EventType.MODEL_FAILED,
        EventType.ITERATION_COMPLETED,
        EventType.RUN_TERMINATED,
    ]
