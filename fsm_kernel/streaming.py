"""Live output of a model call: text deltas and stream notices, passed from whichever model
produces them to whoever watches the run, without either knowing the other.

The kernel installs a sink for the run it drives (`deltas_to`); a model that streams calls
`emit_text(...)` as tokens arrive and `emit_notice(...)` when something about the stream is worth
recording (a fallback to a plain request). The sink lives in a context variable, so it follows
the run's task into threads started with `asyncio.to_thread`, and models need no extra argument:
a user's ChatModel that knows nothing of streaming keeps working.

Deltas are streamed, never stored: the event log keeps the assembled message.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "StreamNotice",
    "StreamSink",
    "TextDelta",
    "deltas_to",
    "emit_notice",
    "emit_notice_once",
    "emit_text",
    "is_watched",
]


@dataclass(frozen=True)
class TextDelta:
    """A piece of the model's text, as it arrived: of its answer, or (`tool_call`, the tool's
    name) of a tool call being generated, shown as progress (the local model streams its calls
    as `Tool call: name({...})`; they are not part of any answer)."""

    text: str
    tool_call: str | None = None


@dataclass(frozen=True)
class StreamNotice:
    """Something about the stream that the run's log should record (e.g. a fallback)."""

    kind: str
    detail: dict[str, Any] = field(default_factory=dict)


StreamSink = Callable[[TextDelta | StreamNotice], None]

_sink: ContextVar[StreamSink | None] = ContextVar("fsm_kernel_stream_sink", default=None)
_noticed: ContextVar[set[str] | None] = ContextVar("fsm_kernel_stream_noticed", default=None)
"""The kinds `emit_notice_once` has sent to the current sink."""


@contextmanager
def deltas_to(sink: StreamSink | None) -> Iterator[None]:
    """Send what models emit in this context (and the tasks and threads it starts) to `sink`."""
    token = _sink.set(sink)
    noticed = _noticed.set(set())
    try:
        yield
    finally:
        _noticed.reset(noticed)
        _sink.reset(token)


def is_watched() -> bool:
    """Whether anyone receives deltas here (a model may skip work nobody sees)."""
    return _sink.get() is not None


def emit_text(text: str, *, tool_call: str | None = None) -> None:
    """Hand a piece of answer text (or of the call of the tool `tool_call`) to the watcher,
    if any."""
    sink = _sink.get()
    if sink is not None and text:
        sink(TextDelta(text, tool_call))


def emit_notice(kind: str, **detail: Any) -> None:
    """Hand a notice to the watcher, if any (the kernel records it in the run's log)."""
    sink = _sink.get()
    if sink is not None:
        sink(StreamNotice(kind, dict(detail)))


def emit_notice_once(kind: str, **detail: Any) -> None:
    """`emit_notice`, at most once per kind for the current sink (one run): for a condition a
    model meets again on every call, such as a server that refuses a request field."""
    noticed = _noticed.get()
    if noticed is None or kind in noticed:
        return
    noticed.add(kind)
    emit_notice(kind, **detail)
