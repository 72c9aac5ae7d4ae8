"""A run's timeline: its events folded into what a person reads, iteration by iteration: each
model request with the messages added since the one before and its answer (tokens, latency),
each tool call with its arguments and result, each transition with the guard that fired and
why: the edges its step tried, with the check that decided each.

Pure: events in, entries out (their data already redacted by the caller). Rendering is the
templates' job.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from fsm_kernel.protocol import Event, EventType
from fsm_kernel.store import RUN_SUSPENDED, tokens_of
from fsm_kernel.workflow.spec import edge_number

__all__ = ["MAX_TEXT", "Entry", "Section", "Timeline", "build_timeline", "clip", "pretty"]

MAX_TEXT = 20_000
"""Characters of one text shown inline; the raw event has the rest."""

HUMAN_ANSWERED = "human.answered"


def clip(text: str, limit: int = MAX_TEXT) -> tuple[str, int]:
    """(the first `limit` characters, how many were left out)."""
    if len(text) <= limit:
        return text, 0
    return text[:limit], len(text) - limit


def pretty(value: Any) -> str:
    """JSON for people: indented, non-ASCII kept."""
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True, default=str)


@dataclass
class Entry:
    """One line of the timeline (a template per kind)."""

    kind: str
    """start, model, tool, transition, message, notice, iteration, resumed, waiting, answered,
    child, child-end, notified, end, or event (anything else, shown as its JSON)."""
    seq: int
    ts: datetime
    state: str | None
    iteration: int
    data: dict[str, Any] = field(default_factory=dict)
    """What the kind's template shows (already redacted)."""
    states: tuple[str, ...] = ()
    """The diagram states this entry belongs to (clicking one filters to them)."""
    edge: str | None = None
    """`source->target` for a transition (clicking the edge filters to it)."""


@dataclass
class Section:
    """The entries of one iteration: the model call that opens it and what followed, up to
    the next call (0: before the first model call)."""

    iteration: int
    entries: list[Entry] = field(default_factory=list)


@dataclass
class Timeline:
    sections: list[Section]
    model_calls: int
    tool_calls: int
    prompt_tokens: int
    completion_tokens: int
    tokens: int


class _Builder:
    def __init__(self) -> None:
        self.sections: list[Section] = []
        self.pending_messages: list[dict[str, Any]] = []
        self.open_model: Entry | None = None
        self.open_tools: dict[str, Entry] = {}
        self.model_calls = 0
        self.tool_calls = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.tokens = 0

    def add(self, entry: Entry) -> Entry:
        # An iteration is one model call: it opens with the request and holds what followed.
        if not self.sections or self.sections[-1].iteration != self.model_calls:
            self.sections.append(Section(self.model_calls))
        self.sections[-1].entries.append(entry)
        return entry

    def entry(self, kind: str, event: Event, data: dict[str, Any], **extra: Any) -> Entry:
        states = extra.pop("states", (event.state,) if event.state else ())
        return self.add(
            Entry(kind=kind, seq=event.seq, ts=event.timestamp, state=event.state,
                  iteration=event.iteration, data=data, states=states, **extra)
        )  # fmt: skip

    def feed(self, event: Event) -> None:
        handler = _HANDLERS.get(event.type.value, _generic)
        handler(self, event)

    def build(self) -> Timeline:
        return Timeline(
            sections=self.sections,
            model_calls=self.model_calls,
            tool_calls=self.tool_calls,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            tokens=self.tokens,
        )


def _started(b: _Builder, event: Event) -> None:
    d = event.data
    system = str(d.get("system_prompt") or "")
    if system:
        b.pending_messages.append({"role": "system", "content": system})
    b.pending_messages.append({"role": "user", "content": str(d.get("goal") or "")})
    settings = {k: v for k, v in (d.get("settings") or {}).items() if k != "api_key"}
    b.entry("start", event, {"goal": d.get("goal"), "workflow": d.get("workflow"),
                             "settings": settings, "limits": d.get("limits") or {},
                             "system_prompt": system})  # fmt: skip


def _message(b: _Builder, event: Event) -> None:
    message = event.data.get("message")
    if isinstance(message, dict):
        b.pending_messages.append(message)
        b.entry("message", event, {"message": message})


def _requested(b: _Builder, event: Event) -> None:
    b.model_calls += 1
    data = {
        "number": b.model_calls,
        "messages": event.data.get("messages"),
        "tools": event.data.get("tools") or [],
        "new_messages": b.pending_messages,
        "response": None,
        "error": None,
    }
    b.pending_messages = []
    b.open_model = b.entry("model", event, data)


def _model_entry(b: _Builder, event: Event) -> Entry:
    """The open request this answer (or failure) belongs to; a new entry if there is none."""
    if b.open_model is None:
        _requested(b, event)
    assert b.open_model is not None
    return b.open_model


def _responded(b: _Builder, event: Event) -> None:
    entry = _model_entry(b, event)
    b.open_model = None
    completion = event.data.get("completion") or {}
    message = completion.get("message") or {}
    usage = completion.get("usage") or {}
    b.prompt_tokens += int(usage.get("prompt_tokens") or 0)
    b.completion_tokens += int(usage.get("completion_tokens") or 0)
    b.tokens += tokens_of(event)
    entry.data["response"] = {
        "content": message.get("content") or "",
        "reasoning": message.get("reasoning"),
        "tool_calls": message.get("tool_calls") or [],
        "finish_reason": completion.get("finish_reason"),
        "model": completion.get("model"),
        "usage": usage,
        "tokens": tokens_of(event),
        "latency_ms": event.data.get("latency_ms"),
        "seq": event.seq,
    }
    assistant = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("tool_calls"):
        assistant["tool_calls"] = message["tool_calls"]
    b.pending_messages.append(assistant)


def _failed(b: _Builder, event: Event) -> None:
    entry = _model_entry(b, event)
    entry.data["error"] = event.data.get("error") or event.data


def _tool_started(b: _Builder, event: Event) -> None:
    call = event.data.get("call") or {}
    b.tool_calls += 1
    data = {"call": call, "result": None, "duration_ms": None, "malformed": False}
    b.open_tools[str(call.get("id"))] = b.entry("tool", event, data)


def _tool_finished(b: _Builder, event: Event) -> None:
    call = event.data.get("call") or {}
    entry = b.open_tools.pop(str(call.get("id")), None)
    if entry is None:  # answered without starting (a malformed call, or a resumed run)
        b.tool_calls += 1
        entry = b.entry("tool", event, {"call": call})
    result = event.data.get("result") or {}
    entry.data.update(
        result=result,
        duration_ms=event.data.get("duration_ms"),
        malformed=bool(event.data.get("malformed")),
        result_seq=event.seq,
    )
    b.pending_messages.append(
        {"role": "tool", "name": call.get("name"), "tool_call_id": call.get("id"),
         "content": result.get("content", "")}
    )  # fmt: skip


def _transition(b: _Builder, event: Event) -> None:
    d = event.data
    source, target = str(d.get("source")), str(d.get("target"))
    data = dict(d)
    tried = d.get("tried")
    if isinstance(tried, list):  # a log written before `tried` was recorded has none
        data["why"] = [_why_row(t) for t in tried if isinstance(t, dict)]
    b.entry("transition", event, data, states=(source, target), edge=f"{source}->{target}")


def _why_row(tried: dict[str, Any]) -> dict[str, Any]:
    """One edge the step tried, with the checks that decided it: all of the taken edge's, the
    false one of an edge passed over (the engine stops at the first false check)."""
    checks = [c for c in tried.get("checks") or () if isinstance(c, dict)]
    passed = bool(tried.get("passed"))
    decided = checks if passed else [c for c in checks if not c.get("value")][:1] or checks
    return {
        "edge": tried.get("edge"),
        "number": edge_number(tried.get("edge")),
        "target": tried.get("target"),
        "passed": passed,
        "checks": [{"check": str(c.get("check")), "value": bool(c.get("value"))} for c in decided],
    }


def _iteration(b: _Builder, event: Event) -> None:
    b.entry("iteration", event, dict(event.data))


def _terminated(b: _Builder, event: Event) -> None:
    b.entry("end", event, dict(event.data))


def _resumed(b: _Builder, event: Event) -> None:
    b.entry("resumed", event, dict(event.data))


def _notice(b: _Builder, event: Event) -> None:
    b.entry("notice", event, dict(event.data))


def _suspended(b: _Builder, event: Event) -> None:
    b.entry("waiting", event, dict(event.data))


def _answered(b: _Builder, event: Event) -> None:
    b.entry("answered", event, dict(event.data))


def _child(b: _Builder, event: Event) -> None:
    """A child run started or ended (workflow.call, workflow.map): its link and outcome."""
    kind = "child" if event.type is EventType.CHILD_STARTED else "child-end"
    data = dict(event.data)
    if "item" in data:
        data["item"] = int(data["item"]) + 1
    b.entry(kind, event, data)


def _notified(b: _Builder, event: Event) -> None:
    b.entry("notified", event, dict(event.data))


def _generic(b: _Builder, event: Event) -> None:
    if event.type is EventType.STATE_ENTERED:
        return  # the transitions say it, with their guards
    b.entry("event", event, {"type": event.type.value, "json": pretty(event.data)})


_HANDLERS = {
    EventType.RUN_STARTED.value: _started,
    EventType.MESSAGE_ADDED.value: _message,
    EventType.MODEL_REQUESTED.value: _requested,
    EventType.MODEL_RESPONDED.value: _responded,
    EventType.MODEL_FAILED.value: _failed,
    EventType.MODEL_NOTICE.value: _notice,
    EventType.TOOL_STARTED.value: _tool_started,
    EventType.TOOL_FINISHED.value: _tool_finished,
    EventType.TRANSITION_TAKEN.value: _transition,
    EventType.ITERATION_COMPLETED.value: _iteration,
    EventType.RUN_RESUMED.value: _resumed,
    EventType.RUN_TERMINATED.value: _terminated,
    RUN_SUSPENDED: _suspended,
    HUMAN_ANSWERED: _answered,
    EventType.CHILD_STARTED.value: _child,
    EventType.CHILD_FINISHED.value: _child,
    EventType.NOTIFY_ATTEMPTED.value: _notified,
}


def build_timeline(events: list[Event]) -> Timeline:
    """The timeline of one run's events (in seq order, data redacted)."""
    builder = _Builder()
    for event in events:
        builder.feed(event)
    return builder.build()
