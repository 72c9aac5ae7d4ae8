"""OpenTelemetry traces of runs, built from their events (the `otel` extra:
`pip install -e '.[otel]'`).

`RunTracer` is a watcher like the CLI's progress printer: it sees each run's events as they are
recorded and turns them into spans, following the OpenTelemetry GenAI semantic conventions:

- a root span per run, `invoke_agent WORKFLOW` (`gen_ai.operation.name` invoke_agent,
  `gen_ai.agent.name`, `fsm_kernel.run_id`; at the end `fsm_kernel.termination_reason` and the
  run's token usage), a child of the span current where the run started (a scheduler's
  dispatch), or, for a child run, of its parent's calling state;
- a span per state visit, `state NAME`, with each transition out of it as a span event
  (`fsm_kernel.transition`: source, target, guard, reason);
- a span per model call, `chat MODEL` (`gen_ai.request.model`, `gen_ai.provider.name`,
  `gen_ai.usage.input_tokens` / `output_tokens`, `gen_ai.response.finish_reasons`), and per
  tool call, `execute_tool NAME` (`gen_ai.tool.name`, `gen_ai.tool.call.id`), each with an
  error status when it failed.

Message contents (prompts, replies, tool arguments and results) are recorded only when
`OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true`, as the conventions say; they are
redacted like the log. Span times are the events' own timestamps.

Tracing is on when `--otel` (or `Agent(otel=True)`) asks for it, or when the standard
environment does (`OTEL_TRACES_EXPORTER` or an `OTEL_EXPORTER_OTLP_*ENDPOINT`, unless
`OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`). Spans go to the global TracerProvider
when the application set one; otherwise fsm-kernel sets up the SDK with the exporters
`OTEL_TRACES_EXPORTER` names (`otlp`, the default: OTLP/HTTP configured by the standard
`OTEL_EXPORTER_OTLP_*` variables; `console`: to stderr; `none`), and flushes it when the agent
closes, waiting at most FLUSH_SECONDS: a collector that is down or never answers costs a
warning, not a stalled exit.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from fsm_kernel.errors import ConfigError
from fsm_kernel.protocol import Event, EventType
from fsm_kernel.redact import redact

__all__ = ["RunTracer", "capture_content", "dispatch_span", "exporter_names", "tracing_wanted"]

logger = logging.getLogger(__name__)

CAPTURE_ENV = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
_ENDPOINT_ENVS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
_EXPORTERS = ("otlp", "console", "none")
FLUSH_SECONDS = 3.0
"""How long closing an agent waits for its traces to reach the collector (the SDK's exporter
retries for up to 10 s against one that is down, and waits 10 s for one that never answers);
the process's exit waits no longer than that again, and not at all once a flush gave up."""
_CONTENT_CHARS = 8_000
"""The most characters of one message or tool result a span attribute takes."""


def tracing_wanted(flag: bool | None, environ: Mapping[str, str] | None = None) -> bool:
    """`flag` when given (--otel, Agent(otel=...)), else what the OTEL_* environment says:
    off with OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none, on with any other
    OTEL_TRACES_EXPORTER or an OTLP endpoint."""
    env = os.environ if environ is None else environ
    if flag is not None:
        return flag
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return any(env.get(name) for name in _ENDPOINT_ENVS)


def exporter_names(environ: Mapping[str, str] | None = None) -> list[str]:
    """The span exporters OTEL_TRACES_EXPORTER names, as the SDK reads it: a comma-separated
    list of `otlp` (the default), `console` (to stderr here: stdout carries the answer) and
    `none` (no exporter).

    Raises:
        ConfigError: a name fsm-kernel does not export to.
    """
    env = os.environ if environ is None else environ
    value = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    names = [n.strip() for n in value.split(",") if n.strip()] or ["otlp"]
    for name in names:
        if name not in _EXPORTERS:
            raise ConfigError(
                f"OTEL_TRACES_EXPORTER names {name!r}: fsm-kernel exports traces to "
                + ", ".join(_EXPORTERS)
            )
    return [n for n in dict.fromkeys(names) if n != "none"]


def capture_content(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get(CAPTURE_ENV, "").strip().lower() == "true"


def _trace_api() -> Any:
    try:
        from opentelemetry import trace
    except ImportError:
        raise ConfigError(
            "tracing (--otel or OTEL_* settings) needs the otel extra: "
            "pip install 'fsm-kernel[otel]'"
        ) from None
    return trace


def tracer_provider() -> tuple[Any, Callable[[], None] | None]:
    """The provider spans go to, and what flushes it (None: the application owns it).

    Raises:
        ConfigError: the opentelemetry packages are not installed.
    """
    trace = _trace_api()
    current = trace.get_tracer_provider()
    if type(current).__name__ not in ("ProxyTracerProvider", "NoOpTracerProvider"):
        return current, None  # the application configured one
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    exporters = [_exporter(name) for name in exporter_names()]
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "fsm-kernel")})
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)  # see stop()
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    flushed = threading.Event()  # set while the last flush finished in time
    flushed.set()

    def flush() -> None:
        """Export the spans still pending, waiting at most FLUSH_SECONDS."""
        if _within(provider.force_flush, FLUSH_SECONDS):
            flushed.set()
            return
        flushed.clear()
        logger.warning(
            "traces not exported within %gs (is the OTLP collector at %s up?); "
            "the spans still pending are dropped at exit",
            FLUSH_SECONDS,
            _endpoint(),
        )

    def stop() -> None:
        # The SDK's own exit hook would wait for an export stuck on a collector that is down
        # or never answers (10 s and more); this one waits FLUSH_SECONDS at most, and not at
        # all after a flush that gave up. flush() has said what was not exported; the SDK's
        # shutdown chatter adds nothing.
        logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)
        _within(provider.shutdown, FLUSH_SECONDS if flushed.is_set() else 0.0)

    atexit.register(stop)
    return provider, flush


def _exporter(name: str) -> Any:
    """The SDK's span exporter called `name` (see exporter_names)."""
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter(out=sys.stderr)
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise ConfigError(
            "exporting traces needs the OTLP exporter: pip install 'fsm-kernel[otel]'"
        ) from None
    return OTLPSpanExporter()


def _within(work: Callable[[], Any], seconds: float) -> bool:
    """Run `work` on a daemon thread and wait at most `seconds` for it: whether it finished.
    (A daemon thread left running never holds the process's exit.)"""
    thread = threading.Thread(target=work, name="otel-export", daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()


def _endpoint() -> str:
    """Where the OTLP/HTTP exporter sends traces, as the standard variables say."""
    traces = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if traces:
        return traces
    base = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "http://localhost:4318"
    return base.rstrip("/") + "/v1/traces"


def _ns(event: Event) -> int:
    return int(event.timestamp.timestamp() * 1_000_000_000)


def _text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return redact(text)[:_CONTENT_CHARS]


@dataclass
class _RunSpans:
    """The open spans of one run."""

    root: Any
    state: Any = None
    model: Any = None
    tools: dict[str, Any] = field(default_factory=dict)
    model_name: str = ""
    provider: str = ""
    input_tokens: int = 0
    output_tokens: int = 0


class RunTracer:
    """Turns the events of runs into spans (see the module's text). One instance may watch
    many runs at once (an Agent's, their children's)."""

    def __init__(self, provider: Any = None, *, content: bool | None = None) -> None:
        trace = _trace_api()
        self._trace = trace
        provider = provider or trace.get_tracer_provider()
        self.tracer = provider.get_tracer("fsm_kernel")
        self.content = capture_content() if content is None else content
        self._runs: dict[str, _RunSpans] = {}

    def __call__(self, item: Any) -> None:
        if not isinstance(item, Event):
            return  # streamed text: not a span
        try:
            self._on(item)
        except Exception:  # tracing never breaks a run
            logger.debug("tracing failed on event %s", item.type, exc_info=True)

    def _on(self, event: Event) -> None:
        kind = event.type
        if kind in (EventType.RUN_STARTED, EventType.RUN_RESUMED):
            self._start_run(event)
            return
        spans = self._runs.get(event.run_id)
        if spans is None:
            return
        handler = _HANDLERS.get(kind)
        if handler is not None:
            handler(self, spans, event)

    # -- the run ----------------------------------------------------------------------------

    def _start_run(self, event: Event) -> None:
        data = event.data
        previous = self._runs.pop(event.run_id, None)
        if previous is not None:  # a re-drive in this process: close what was left open
            self._close(previous, _ns(event))
        workflow = str(data.get("workflow") or "")
        settings = data.get("settings") or {}
        parent = self._parent_context(data)
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.name": workflow,
            "gen_ai.conversation.id": event.run_id,
            "fsm_kernel.run_id": event.run_id,
            "fsm_kernel.workflow": workflow,
        }
        if event.type == EventType.RUN_RESUMED:
            attributes["fsm_kernel.resumed"] = True
        if data.get("parent_run_id"):
            attributes["fsm_kernel.parent_run_id"] = str(data["parent_run_id"])
        if self.content and data.get("goal"):
            attributes["fsm_kernel.goal"] = _text(data["goal"])
        root = self.tracer.start_span(
            f"invoke_agent {workflow}".strip(),
            context=parent,
            attributes=attributes,
            start_time=_ns(event),
        )
        spans = _RunSpans(root=root)
        spans.model_name = str(settings.get("model") or "")
        spans.provider = _provider(settings)
        self._runs[event.run_id] = spans

    def _parent_context(self, data: Mapping[str, Any]) -> Any:
        """A child run's parent: its parent run's state span; else the current span (a
        scheduler's dispatch), if any."""
        parent_id = data.get("parent_run_id")
        parent = self._runs.get(str(parent_id)) if parent_id else None
        if parent is not None:
            return self._trace.set_span_in_context(parent.state or parent.root)
        return None  # the current context (a dispatch span, when there is one)

    def _ended(self, spans: _RunSpans, event: Event) -> None:
        data = event.data
        root = spans.root
        reason = data.get("reason")
        if event.type == EventType.RUN_SUSPENDED:
            root.set_attribute("fsm_kernel.status", "waiting")
        else:
            root.set_attribute("fsm_kernel.termination_reason", str(reason))
            root.set_attribute("fsm_kernel.iterations", int(data.get("iterations") or 0))
        root.set_attribute("gen_ai.usage.input_tokens", spans.input_tokens)
        root.set_attribute("gen_ai.usage.output_tokens", spans.output_tokens)
        if data.get("error"):
            root.set_status(self._trace.Status(self._trace.StatusCode.ERROR, _text(data["error"])))
        self._close(spans, _ns(event))
        self._runs.pop(event.run_id, None)

    def _close(self, spans: _RunSpans, end: int) -> None:
        for span in (*spans.tools.values(), spans.model, spans.state, spans.root):
            if span is not None and span.is_recording():
                span.end(end_time=end)

    # -- states and transitions ---------------------------------------------------------------

    def _state(self, spans: _RunSpans, event: Event) -> None:
        if spans.state is not None:
            spans.state.end(end_time=_ns(event))
        context = self._trace.set_span_in_context(spans.root)
        spans.state = self.tracer.start_span(
            f"state {event.state}",
            context=context,
            attributes={
                "fsm_kernel.state": str(event.state),
                "fsm_kernel.iteration": event.iteration,
            },
            start_time=_ns(event),
        )

    def _transition(self, spans: _RunSpans, event: Event) -> None:
        data = event.data
        attributes = {
            "fsm_kernel.source": str(data.get("source")),
            "fsm_kernel.target": str(data.get("target")),
            "fsm_kernel.guard": str(data.get("guard") or ""),
        }
        if data.get("reason"):
            attributes["fsm_kernel.reason"] = str(data["reason"])
        (spans.state or spans.root).add_event(
            "fsm_kernel.transition", attributes=attributes, timestamp=_ns(event)
        )

    # -- model calls ----------------------------------------------------------------------------

    def _model_requested(self, spans: _RunSpans, event: Event) -> None:
        purpose = event.data.get("purpose")
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.request.model": spans.model_name,
            "gen_ai.provider.name": spans.provider,
        }
        if purpose:
            attributes["fsm_kernel.purpose"] = str(purpose)
        tools = event.data.get("tools") or []
        if tools:
            attributes["fsm_kernel.tools_offered"] = [str(t) for t in tools]
        context = self._trace.set_span_in_context(spans.state or spans.root)
        spans.model = self.tracer.start_span(
            f"chat {spans.model_name}".strip(),
            context=context,
            attributes=attributes,
            start_time=_ns(event),
        )

    def _model_responded(self, spans: _RunSpans, event: Event) -> None:
        span = spans.model
        if span is None:
            return
        completion = event.data.get("completion") or {}
        usage = completion.get("usage") or {}
        prompt, output = (
            int(usage.get("prompt_tokens") or 0),
            int(usage.get("completion_tokens") or 0),
        )
        spans.input_tokens += prompt
        spans.output_tokens += output
        span.set_attribute("gen_ai.usage.input_tokens", prompt)
        span.set_attribute("gen_ai.usage.output_tokens", output)
        if completion.get("finish_reason"):
            span.set_attribute("gen_ai.response.finish_reasons", [str(completion["finish_reason"])])
        if completion.get("model"):
            span.set_attribute("gen_ai.response.model", str(completion["model"]))
        if self.content:
            span.set_attribute("gen_ai.output.messages", _text([completion.get("message")]))
        span.end(end_time=_ns(event))
        spans.model = None

    def _model_failed(self, spans: _RunSpans, event: Event) -> None:
        span = spans.model
        if span is None:
            return
        error = event.data.get("error") or {}
        span.set_attribute("error.type", str(error.get("type") or "AgentError"))
        span.set_status(
            self._trace.Status(self._trace.StatusCode.ERROR, _text(error.get("message") or ""))
        )
        span.end(end_time=_ns(event))
        spans.model = None

    def _message(self, spans: _RunSpans, event: Event) -> None:
        if self.content and spans.state is not None:
            spans.state.add_event(
                "gen_ai.user.message",
                attributes={"content": _text((event.data.get("message") or {}).get("content", ""))},
                timestamp=_ns(event),
            )

    # -- tool calls ------------------------------------------------------------------------------

    def _tool_started(self, spans: _RunSpans, event: Event) -> None:
        call = event.data.get("call") or {}
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": str(call.get("name")),
            "gen_ai.tool.call.id": str(call.get("id")),
            "gen_ai.tool.type": "function",
        }
        if self.content:
            attributes["gen_ai.tool.call.arguments"] = _text(call.get("arguments"))
        context = self._trace.set_span_in_context(spans.state or spans.root)
        spans.tools[str(call.get("id"))] = self.tracer.start_span(
            f"execute_tool {call.get('name')}",
            context=context,
            attributes=attributes,
            start_time=_ns(event),
        )

    def _tool_finished(self, spans: _RunSpans, event: Event) -> None:
        call = event.data.get("call") or {}
        span = spans.tools.pop(str(call.get("id")), None)
        if span is None:
            return
        result = event.data.get("result") or {}
        if self.content:
            span.set_attribute("gen_ai.tool.call.result", _text(result.get("content", "")))
        if result.get("is_error"):
            span.set_attribute("error.type", str(result.get("error_type") or "ToolError"))
            span.set_status(
                self._trace.Status(self._trace.StatusCode.ERROR, _text(result.get("content", "")))
            )
        span.end(end_time=_ns(event))


def _provider(settings: Mapping[str, Any]) -> str:
    """`gen_ai.provider.name`: openai for api.openai.com, else the server kind we can tell."""
    if isinstance(settings.get("local"), Mapping):
        return "llama.cpp"
    url = str(settings.get("base_url") or "")
    if "api.openai.com" in url:
        return "openai"
    if ":11434" in url:
        return "ollama"
    return "openai_compatible"


_HANDLERS: dict[EventType, Callable[[RunTracer, _RunSpans, Event], None]] = {
    EventType.STATE_ENTERED: RunTracer._state,
    EventType.TRANSITION_TAKEN: RunTracer._transition,
    EventType.MODEL_REQUESTED: RunTracer._model_requested,
    EventType.MODEL_RESPONDED: RunTracer._model_responded,
    EventType.MODEL_FAILED: RunTracer._model_failed,
    EventType.MESSAGE_ADDED: RunTracer._message,
    EventType.TOOL_STARTED: RunTracer._tool_started,
    EventType.TOOL_FINISHED: RunTracer._tool_finished,
    EventType.RUN_TERMINATED: RunTracer._ended,
    EventType.RUN_SUSPENDED: RunTracer._ended,
}


@contextlib.contextmanager
def dispatch_span(agent_id: str, dispatch_id: str | None = None) -> Iterator[None]:
    """A span around one scheduler dispatch (when tracing is wanted): the run it starts is its
    child, so a dispatch and its run are one trace."""
    if not tracing_wanted(None):
        yield
        return
    trace = _trace_api()
    tracer_provider()
    tracer = trace.get_tracer("fsm_kernel")
    attributes = {"fsm_kernel.agent_id": agent_id}
    if dispatch_id:
        attributes["fsm_kernel.dispatch_id"] = dispatch_id
    with tracer.start_as_current_span(f"dispatch {agent_id}", attributes=attributes):
        yield
