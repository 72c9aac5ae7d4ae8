"""Core data types every layer speaks: messages, tool calls, completions, events, and the
Protocols the kernel's collaborators implement. Imports only fsm_kernel.errors.

All value types are frozen dataclasses with `to_dict()` / `from_dict()` for our own JSON (the
event log). The OpenAI wire format lives in fsm_kernel.agent.wire, not here.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "MAX_JSON_DEPTH",
    "ChatModel",
    "Clock",
    "Completion",
    "Event",
    "EventStore",
    "EventType",
    "Message",
    "ResponseFormat",
    "Role",
    "RunFilter",
    "RunSummary",
    "SystemClock",
    "Tool",
    "ToolCall",
    "ToolExecutor",
    "ToolResult",
    "Usage",
    "nests_deeper",
    "new_id",
]

MAX_JSON_DEPTH = 100
"""How deeply a tool call's arguments may nest objects and arrays (the arguments object is
level 1). Deeper arguments are malformed output, whichever model sent them: no tool needs
them, and every walk of them (redaction, the event log, the tools' validation) stays far from
Python's recursion limit."""


def nests_deeper(value: Any, limit: int) -> bool:
    """Whether `value` nests lists and dicts more than `limit` levels deep (level by level, no
    recursion, so any depth is measured)."""
    level, depth = [value], 0
    while level:
        containers = [v for v in level if isinstance(v, dict | list)]
        if not containers:
            return False
        depth += 1
        if depth > limit:
            return True
        level = [x for c in containers for x in (c.values() if isinstance(c, dict) else c)]
    return False


def new_id() -> str:
    """A UUIDv7 string: time-ordered, so ids sort by creation time (RFC 9562)."""
    ms = time.time_ns() // 1_000_000
    rand = int.from_bytes(secrets.token_bytes(10), "big")
    value = (ms & ((1 << 48) - 1)) << 80
    value |= 0x7 << 76  # version 7
    value |= ((rand >> 64) & 0xFFF) << 64  # rand_a, 12 bits
    value |= 0b10 << 62  # RFC 4122 variant
    value |= rand & ((1 << 62) - 1)  # rand_b, 62 bits
    h = f"{value:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class Role(StrEnum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


TOO_DEEP = f"arguments nest objects and arrays deeper than {MAX_JSON_DEPTH} levels"
"""The `arguments_error` of a call whose arguments nest deeper than MAX_JSON_DEPTH."""


@dataclass(frozen=True, kw_only=True)
class ToolCall:
    """One tool call requested by the model."""

    id: str
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    """Parsed arguments; empty when they could not be parsed (see `arguments_error`)."""
    raw_arguments: str | None = None
    """The arguments exactly as the server sent them, when they were not valid JSON."""
    arguments_error: str | None = None
    """Why the arguments could not be parsed; a reply with such a call is malformed output."""

    def __post_init__(self) -> None:
        # Whatever model made the call (a server, the local model, your own ChatModel).
        if self.arguments_error is None and nests_deeper(self.arguments, MAX_JSON_DEPTH):
            object.__setattr__(self, "arguments", {})
            object.__setattr__(self, "arguments_error", TOO_DEEP)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "name": self.name, "arguments": self.arguments}
        if self.raw_arguments is not None:
            d["raw_arguments"] = self.raw_arguments
        if self.arguments_error is not None:
            d["arguments_error"] = self.arguments_error
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ToolCall:
        return cls(
            id=d["id"],
            name=d["name"],
            arguments=dict(d.get("arguments") or {}),
            raw_arguments=d.get("raw_arguments"),
            arguments_error=d.get("arguments_error"),
        )

    def arguments_json(self) -> str:
        """Arguments as the canonical JSON string (sorted keys), for the wire and for
        comparing calls."""
        if self.raw_arguments is not None and self.arguments_error is not None:
            return self.raw_arguments
        return json.dumps(self.arguments, sort_keys=True, ensure_ascii=False)


@dataclass(frozen=True, kw_only=True)
class Message:
    """One conversation message (the session's unit)."""

    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    """For role=tool: the id of the call this message answers."""
    name: str | None = None
    """For role=tool: the tool's name (some servers want it)."""
    reasoning: str | None = None
    """Model reasoning (`<think>` text or a `reasoning` field): recorded, never sent back as the
    answer."""

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"role": self.role.value, "content": self.content}
        if self.tool_calls:
            d["tool_calls"] = [tc.to_dict() for tc in self.tool_calls]
        for key in ("tool_call_id", "name", "reasoning"):
            value = getattr(self, key)
            if value is not None:
                d[key] = value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Message:
        return cls(
            role=Role(d["role"]),
            content=d.get("content") or "",
            tool_calls=tuple(ToolCall.from_dict(tc) for tc in d.get("tool_calls") or ()),
            tool_call_id=d.get("tool_call_id"),
            name=d.get("name"),
            reasoning=d.get("reasoning"),
        )

    @classmethod
    def system(cls, content: str) -> Message:
        return cls(role=Role.SYSTEM, content=content)

    @classmethod
    def user(cls, content: str) -> Message:
        return cls(role=Role.USER, content=content)

    @classmethod
    def assistant(cls, content: str = "", tool_calls: Sequence[ToolCall] = ()) -> Message:
        return cls(role=Role.ASSISTANT, content=content, tool_calls=tuple(tool_calls))

    @classmethod
    def tool(cls, call: ToolCall, result: ToolResult) -> Message:
        return cls(role=Role.TOOL, content=result.content, tool_call_id=call.id, name=call.name)


@dataclass(frozen=True, kw_only=True)
class Tool:
    """A tool as offered to the model: name, description, JSON-schema parameters."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "parameters": self.parameters}


@dataclass(frozen=True, kw_only=True)
class ToolResult:
    """What a tool call produced. Errors are results too: they go back to the model."""

    content: str
    is_error: bool = False
    error_type: str | None = None
    """For errors: which kind (ToolNotFoundError, ToolArgumentsError, ...)."""
    fatal: bool = False
    """The tool failed in a way the run cannot recover from (ends the run as fatal_tool_error)."""
    truncated: bool = False

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"content": self.content, "is_error": self.is_error}
        if self.error_type:
            d["error_type"] = self.error_type
        if self.fatal:
            d["fatal"] = True
        if self.truncated:
            d["truncated"] = True
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ToolResult:
        return cls(
            content=d.get("content", ""),
            is_error=bool(d.get("is_error")),
            error_type=d.get("error_type"),
            fatal=bool(d.get("fatal")),
            truncated=bool(d.get("truncated")),
        )


@dataclass(frozen=True, kw_only=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            completion_tokens=self.completion_tokens + other.completion_tokens,
            total_tokens=self.total_tokens + other.total_tokens,
        )

    def to_dict(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Usage:
        d = d or {}
        return cls(
            prompt_tokens=int(d.get("prompt_tokens") or 0),
            completion_tokens=int(d.get("completion_tokens") or 0),
            total_tokens=int(d.get("total_tokens") or 0),
        )


@dataclass(frozen=True, kw_only=True)
class Completion:
    """One model answer, normalised."""

    message: Message
    """The assistant message (content without reasoning, tool calls with unique ids)."""
    finish_reason: str = "stop"
    """One of stop, tool_calls, length, content_filter, unknown."""
    usage: Usage = field(default_factory=Usage)
    model: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "message": self.message.to_dict(),
            "finish_reason": self.finish_reason,
            "usage": self.usage.to_dict(),
            "model": self.model,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Completion:
        return cls(
            message=Message.from_dict(d["message"]),
            finish_reason=d.get("finish_reason", "stop"),
            usage=Usage.from_dict(d.get("usage")),
            model=d.get("model", ""),
        )


class EventType(StrEnum):
    """Stored event types: a schema. Never rename a value."""

    RUN_STARTED = "run.started"
    RUN_RESUMED = "run.resumed"
    STATE_ENTERED = "state.entered"
    MESSAGE_ADDED = "message.added"
    TRANSITION_TAKEN = "transition.taken"
    MODEL_REQUESTED = "model.requested"
    MODEL_RESPONDED = "model.responded"
    MODEL_FAILED = "model.failed"
    MODEL_NOTICE = "model.notice"
    TOOL_STARTED = "tool.started"
    TOOL_FINISHED = "tool.finished"
    ITERATION_COMPLETED = "iteration.completed"
    HUMAN_ANSWERED = "human.answered"
    RUN_SUSPENDED = "run.suspended"
    RUN_TERMINATED = "run.terminated"
    ACTION_FAILED = "action.failed"
    """An attempt of a state's action raised and its `retry:` runs it again."""
    VARS_ASSIGNED = "vars.assigned"
    """An `assign:` set a declared variable: its name, value and the state or transition."""
    ERROR_CAUGHT = "error.caught"
    """A state's action failed for good and a `catch:` entry routes the run (its catch edge's
    `transition.taken` follows)."""
    CONTEXT_TRIMMED = "context.trimmed"
    """A request was made to fit the workflow's `context:` window (what was shortened or
    dropped); the run's history itself is unchanged."""
    CHILD_STARTED = "child.started"
    """A `workflow.call` / `workflow.map` state chose a child run's id (recorded before the
    child starts, so a resume of this run finds the child again)."""
    CHILD_FINISHED = "child.finished"
    """A child run ended (or waits for a person): its reason, answer and output."""
    NOTIFY_ATTEMPTED = "notify.attempted"
    """A `notify:` webhook was POSTed (after the run ended or suspended): the outcome of one
    attempt."""
    TIMER_SET = "timer.set"
    """A waiting state's `after:` edge started its timer: the edge and when it is due."""
    TIMER_FIRED = "timer.fired"
    """A timer came due while the run waited in its state: its edge is tried."""
    TIMER_CANCELLED = "timer.cancelled"
    """The run left a waiting state another way (an event, another timer): a timer it set
    there will not fire."""
    EVENT_DELIVERED = "event.delivered"
    """A named event (`fsm-kernel signal`) was delivered to a run in a waiting state: its name
    and data, and who sent it."""


LIVE_ONLY_EVENTS = frozenset(
    {EventType.MODEL_FAILED, EventType.MODEL_NOTICE, EventType.NOTIFY_ATTEMPTED}
)
"""Events about the live model call (a failure, a stream fallback) and the webhooks told about
the run: a re-drive from recorded answers never reproduces them, so resume does not expect them
back."""

EVENT_SCHEMA_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class Event:
    """One thing that happened in a run; the log is the append-only list of these."""

    run_id: str
    seq: int
    type: EventType
    timestamp: datetime
    iteration: int = 0
    state: str | None = None
    data: dict[str, Any] = field(default_factory=dict)
    version: int = EVENT_SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {
            "v": self.version,
            "run_id": self.run_id,
            "seq": self.seq,
            "type": self.type.value,
            "ts": self.timestamp.isoformat(),
            "iteration": self.iteration,
            "state": self.state,
            "data": self.data,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Event:
        return cls(
            version=int(d.get("v", EVENT_SCHEMA_VERSION)),
            run_id=d["run_id"],
            seq=int(d["seq"]),
            type=EventType(d["type"]),
            timestamp=datetime.fromisoformat(d["ts"]),
            iteration=int(d.get("iteration", 0)),
            state=d.get("state"),
            data=dict(d.get("data") or {}),
        )

    def with_seq(self, seq: int) -> Event:
        return replace(self, seq=seq)


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    """One row of `fsm-kernel runs list`, derived from a run's events."""

    run_id: str
    workflow: str
    started_at: datetime
    goal: str
    iterations: int = 0
    termination_reason: str | None = None
    """None while the run is in flight, waits for a person, or was killed (a resume clears
    the reason of the ending it reopens)."""
    status: str = "running"
    """`running` (a process drives it now), `interrupted` (recorded as running, but no process
    holds its lock: it was killed, and `resume` continues it), `waiting` (for a person's
    answer) or `ended` (for termination_reason)."""
    tokens: int = 0
    """Tokens its model calls used (prompt + completion, as the servers reported them)."""
    updated_at: datetime | None = None
    """When the summary last changed: its end, for a run that ended."""
    parent_run_id: str | None = None
    """The run this one is a child of (workflow.call, workflow.map); None for a top-level run."""

    @property
    def shown_status(self) -> str:
        """The status as people read it: running, interrupted, waiting, or the termination
        reason."""
        if self.status == "ended" and self.termination_reason:
            return self.termination_reason
        return self.status

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "workflow": self.workflow,
            "started_at": self.started_at.isoformat(),
            "goal": self.goal,
            "iterations": self.iterations,
            "status": self.status,
            "termination_reason": self.termination_reason,
            "tokens": self.tokens,
            "updated_at": None if self.updated_at is None else self.updated_at.isoformat(),
            "parent_run_id": self.parent_run_id,
        }


@dataclass(frozen=True, kw_only=True)
class ResponseFormat:
    """Structured output: the JSON Schema a text reply must follow (a workflow's `output:`).

    A model honours it by asking the server for JSON under the schema (OpenAI's
    `response_format` of type `json_schema`) or by constraining its decoding to it; a model
    that can do neither puts `instructions()` in the prompt. The kernel validates the reply
    either way."""

    name: str
    """The schema's name: [A-Za-z0-9_-], at most 64 characters (what OpenAI accepts)."""
    schema: dict[str, Any]
    """The JSON Schema."""
    strict: bool = False
    """The schema meets OpenAI's strict mode (every object lists all its properties as required
    and sets `additionalProperties: false`), so servers may be asked to enforce it exactly."""

    def instructions(self, *, tools: bool = False) -> str:
        """The request in words, for the prompt of a model that cannot be given the schema."""
        lead = "When you answer instead of calling a tool, reply" if tools else "Reply"
        return (
            f"{lead} with one JSON value and nothing else (no prose, no code fence) that "
            "conforms to this JSON Schema:\n" + json.dumps(self.schema, ensure_ascii=False)
        )


@dataclass(frozen=True, kw_only=True)
class RunFilter:
    """Which runs a listing keeps (every condition given must hold)."""

    workflow: str | None = None
    """The workflow's name, exactly."""
    status: str | None = None
    """`running`, `waiting`, `ended` (any ending) or a termination reason, exactly (see
    RunSummary.shown_status)."""
    text: str | None = None
    """Text the run id or the goal contains (case-insensitive for ASCII letters)."""
    top_level: bool = False
    """Only runs that are no other run's child."""

    def is_empty(self) -> bool:
        return not (self.workflow or self.status or self.text or self.top_level)


TOOL_CHOICES = ("auto", "none", "required", "omit")
"""How a request lets the model use the tools it offers: `auto` (it decides; sent explicitly,
since some servers, llama.cpp's among them, leave the tools out of the prompt without it),
`none`, `required`, or `omit` (send no tool_choice, for servers that reject the field). Any
other value names the one tool the model must call."""


@runtime_checkable
class ChatModel(Protocol):
    """Anything that answers a message list: the HTTP client, or a test double."""

    async def complete(self, messages: Sequence[Message], tools: Sequence[Tool]) -> Completion:
        """Ask the model. Raises AgentError when no usable answer could be had.

        `messages` is a read-only sequence (the kernel passes a `session.History`, a snapshot
        made without copying the conversation): index, slice or iterate it, or `list(...)`
        it for a list of your own; it never changes after the call.

        A state with its own `tool_choice:` calls `complete(messages, tools,
        tool_choice=...)`: models used with such workflows accept that keyword (TOOL_CHOICES
        or a tool's name); without it, the model's own default applies. Likewise a state with
        an output schema (`output:`) calls `complete(..., response_format=ResponseFormat(...))`
        and validates the reply; a model that ignores the schema still works, its replies
        checked all the same."""
        ...


@runtime_checkable
class ToolExecutor(Protocol):
    """The tool registry as the kernel sees it."""

    def list_tools(self, names: Sequence[str] | None = None) -> list[Tool]:
        """The tools to offer (all, or just `names`, in that order)."""
        ...

    async def execute(self, call: ToolCall) -> ToolResult:
        """Run one call. Never raises for tool problems: they come back as error results."""
        ...


@runtime_checkable
class EventStore(Protocol):
    """Append-only event log keyed (run_id, seq)."""

    def append(self, events: Sequence[Event]) -> None:
        """Append atomically and durably. StoreConflictError if a (run_id, seq) exists."""
        ...

    def read(self, run_id: str) -> list[Event]:
        """Every event of a run in seq order; empty list for an unknown run."""
        ...

    def list_runs(self, *, limit: int = 50, waiting: bool = False) -> list[RunSummary]:
        """Most recent runs first; only the ones waiting for a person when `waiting`."""
        ...

    def find_run(self, prefix: str) -> str:
        """The full run id for an id or a unique prefix of one; RunNotFoundError otherwise."""
        ...

    def lock_run(self, run_id: str) -> AbstractContextManager[None]:
        """Hold the run's exclusive lock for a `with` block, so one process at a time appends
        to a run (two would collide on its next seq). Takes the full run id (see find_run).

        Non-blocking: raises RunLockedError at once when another process, or another holder in
        this one, has it. Released when the block exits, and also when the holding process dies
        (even by kill -9), so a crashed run can be resumed right away.
        """
        ...

    def close(self) -> None: ...


@runtime_checkable
class Clock(Protocol):
    def now(self) -> datetime:
        """Timezone-aware UTC wall time."""
        ...

    def monotonic(self) -> float:
        """Seconds from an arbitrary point, for durations and timeouts."""
        ...


class SystemClock:
    """The real clock."""

    def now(self) -> datetime:
        return datetime.now(UTC)

    def monotonic(self) -> float:
        return time.monotonic()
