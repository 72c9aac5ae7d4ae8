"""OpenTelemetry traces of real runs, checked with the SDK's in-memory exporter: the span tree
(run → state → model call / tool call), the GenAI attributes, transitions as span events,
message contents only when asked for, child runs and scheduler dispatches in their parent's
trace, and when tracing is on at all."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)

from fsm_kernel import Agent
from fsm_kernel.telemetry import dispatch_span, tracing_wanted
from tests.clikit import cli
from tests.fakes.openai_server import (
    FakeOpenAIServer,
    call,
    http_error,
    text_reply,
    tool_reply,
)

ROOT = Path(__file__).resolve().parents[2]
EXPORTER = InMemorySpanExporter()


@pytest.fixture(autouse=True)
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """The process's tracer provider exports to memory (set once: OpenTelemetry allows one)."""
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
        trace.set_tracer_provider(provider)
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", raising=False)
    EXPORTER.clear()
    yield EXPORTER
    EXPORTER.clear()


@pytest.fixture
def fake() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as server:
        yield server


def by_name(finished: tuple[ReadableSpan, ...], prefix: str) -> list[ReadableSpan]:
    return [s for s in finished if s.name.startswith(prefix)]


def parent_of(span: ReadableSpan, finished: tuple[ReadableSpan, ...]) -> ReadableSpan | None:
    if span.parent is None:
        return None
    return next((s for s in finished if s.context.span_id == span.parent.span_id), None)


def run_default(
    capsys: pytest.CaptureFixture[str], fake: FakeOpenAIServer, tmp_path: Path, *flags: str
) -> Any:
    fake.enqueue(tool_reply(call("datetime", {}, id="c1")), text_reply("It is noon."))
    return cli(
        capsys, "run", "default", "-p", "What time is it?", "--base-url", fake.base_url,
        "--model", "m", "--store", tmp_path / "r.db", "--json", *flags,
    )  # fmt: skip


def test_a_run_is_a_trace_of_states_model_calls_and_tool_calls(
    capsys: pytest.CaptureFixture[str],
    fake: FakeOpenAIServer,
    tmp_path: Path,
    spans: InMemorySpanExporter,
) -> None:
    done = run_default(capsys, fake, tmp_path, "--otel")

    assert done.code == 0, done.err
    run_id = done.json()["run_id"]
    finished = spans.get_finished_spans()
    (root,) = by_name(finished, "invoke_agent")
    assert root.name == "invoke_agent default"
    assert root.parent is None
    attrs = dict(root.attributes or {})
    assert attrs["gen_ai.operation.name"] == "invoke_agent"
    assert attrs["gen_ai.agent.name"] == "default"
    assert attrs["fsm_kernel.run_id"] == run_id
    assert attrs["fsm_kernel.termination_reason"] == "final_answer"
    assert attrs["gen_ai.usage.input_tokens"] == 20  # the fake server's 10 + 10
    assert {s.context.trace_id for s in finished} == {root.context.trace_id}

    states = by_name(finished, "state ")
    assert [s.name for s in states] == [
        "state observe", "state think", "state act", "state evaluate", "state observe",
        "state think",
    ]  # fmt: skip
    assert all(parent_of(s, finished) is root for s in states)
    chats = by_name(finished, "chat ")
    assert [s.name for s in chats] == ["chat m", "chat m"]
    assert all(parent_of(s, finished).name == "state think" for s in chats)  # type: ignore[union-attr]
    first = dict(chats[0].attributes or {})
    assert first["gen_ai.operation.name"] == "chat"
    assert first["gen_ai.request.model"] == "m"
    assert first["gen_ai.usage.input_tokens"] == 10
    assert first["gen_ai.usage.output_tokens"] == 5
    assert first["gen_ai.response.finish_reasons"] == ("tool_calls",)
    (tool,) = by_name(finished, "execute_tool")
    assert tool.name == "execute_tool datetime"
    assert parent_of(tool, finished).name == "state act"  # type: ignore[union-attr]
    tool_attrs = dict(tool.attributes or {})
    assert tool_attrs["gen_ai.tool.name"] == "datetime"
    assert tool_attrs["gen_ai.tool.call.id"] == "c1"
    assert tool.status.is_ok
    transitions = [e for s in states for e in s.events if e.name == "fsm_kernel.transition"]
    assert [(e.attributes or {}).get("fsm_kernel.guard") for e in transitions][:2] == [
        "",
        "has_tool_calls",
    ]
    last = dict(transitions[-1].attributes or {})
    assert (last["fsm_kernel.target"], last["fsm_kernel.reason"]) == ("terminate", "final_answer")
    for span in finished:  # nothing of the conversation unless asked for
        assert "gen_ai.output.messages" not in (span.attributes or {})
        assert "gen_ai.tool.call.result" not in (span.attributes or {})
    assert root.start_time is not None
    assert chats[0].start_time is not None
    assert root.start_time <= chats[0].start_time <= chats[0].end_time <= root.end_time  # type: ignore[operator]


def test_message_contents_only_when_the_conventions_variable_says_so(
    capsys: pytest.CaptureFixture[str],
    fake: FakeOpenAIServer,
    tmp_path: Path,
    spans: InMemorySpanExporter,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "true")

    run_default(capsys, fake, tmp_path, "--otel")

    finished = spans.get_finished_spans()
    last_chat = by_name(finished, "chat ")[-1]
    messages = json.loads(str((last_chat.attributes or {})["gen_ai.output.messages"]))
    assert messages[0]["content"] == "It is noon."
    (tool,) = by_name(finished, "execute_tool")
    assert "gen_ai.tool.call.result" in (tool.attributes or {})


def test_no_spans_without_otel(
    capsys: pytest.CaptureFixture[str],
    fake: FakeOpenAIServer,
    tmp_path: Path,
    spans: InMemorySpanExporter,
) -> None:
    run_default(capsys, fake, tmp_path)

    assert spans.get_finished_spans() == ()


def test_failures_are_error_spans(
    capsys: pytest.CaptureFixture[str],
    fake: FakeOpenAIServer,
    tmp_path: Path,
    spans: InMemorySpanExporter,
) -> None:
    fake.enqueue(tool_reply(call("read_file", {"path": "missing.txt"}, id="c1")), http_error(400))

    done = cli(
        capsys, "run", "default", "-p", "x", "--base-url", fake.base_url, "--model", "m",
        "--store", tmp_path / "r.db", "--json", "--otel", "--max-retries", "0",
        "--workspace", tmp_path,
    )  # fmt: skip

    assert done.json()["termination_reason"] == "agent_error"
    finished = spans.get_finished_spans()
    (tool,) = by_name(finished, "execute_tool")
    assert not tool.status.is_ok
    failed = by_name(finished, "chat ")[-1]
    assert not failed.status.is_ok
    assert (failed.attributes or {})["error.type"] == "AgentBadRequestError"
    (root,) = by_name(finished, "invoke_agent")
    assert not root.status.is_ok
    assert (root.attributes or {})["fsm_kernel.termination_reason"] == "agent_error"


def test_child_runs_join_their_parents_trace(
    capsys: pytest.CaptureFixture[str],
    fake: FakeOpenAIServer,
    tmp_path: Path,
    spans: InMemorySpanExporter,
) -> None:
    fake.enqueue(text_reply("the child's answer"))

    done = cli(
        capsys, "run", ROOT / "tests" / "data" / "children" / "delegate.yaml", "-p", "x",
        "--base-url", fake.base_url, "--model", "m", "--store", tmp_path / "r.db", "--json",
        "--otel",
    )  # fmt: skip

    assert done.code == 0, done.err
    finished = spans.get_finished_spans()
    roots = {s.name: s for s in by_name(finished, "invoke_agent")}
    parent, child = roots["invoke_agent delegate"], roots["invoke_agent step"]
    assert child.context.trace_id == parent.context.trace_id
    assert parent_of(child, finished).name == "state hand_over"  # type: ignore[union-attr]
    assert (child.attributes or {})["fsm_kernel.parent_run_id"] == done.json()["run_id"]


def test_a_scheduler_dispatch_is_the_parent_of_its_run(
    fake: FakeOpenAIServer,
    spans: InMemorySpanExporter,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")  # tracing on by the environment
    fake.enqueue(text_reply("done"))

    async def dispatch() -> None:
        async with Agent("single_shot", base_url=fake.base_url, model="m") as agent:
            with dispatch_span("nightly"):
                await agent.run("go")

    asyncio.run(dispatch())

    finished = spans.get_finished_spans()
    (outer,) = by_name(finished, "dispatch ")
    (root,) = by_name(finished, "invoke_agent")
    assert outer.name == "dispatch nightly"
    assert parent_of(root, finished) is outer


@pytest.mark.parametrize(
    ("flag", "env", "wanted"),
    [
        (None, {}, False),
        (True, {}, True),
        (False, {"OTEL_TRACES_EXPORTER": "otlp"}, False),
        (None, {"OTEL_TRACES_EXPORTER": "otlp"}, True),
        (None, {"OTEL_TRACES_EXPORTER": "none"}, False),
        (None, {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}, False),
        (None, {"OTEL_TRACES_EXPORTER": "console"}, True),
        (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        (None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True),
        (
            None,
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"},
            False,
        ),
    ],
)
def test_when_tracing_is_on(flag: bool | None, env: dict[str, str], wanted: bool) -> None:
    assert tracing_wanted(flag, env) is wanted
