"""RunContext: the per-run state that actions change and guards read.

This is the object a user's own `package.module:function` action or guard receives. It holds
the run's counters and its collaborators (model, tools, session), all typed by Protocols.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fsm_kernel.protocol import (
    ChatModel,
    Clock,
    Completion,
    EventType,
    Message,
    SystemClock,
    Tool,
    ToolCall,
    ToolExecutor,
    ToolResult,
    Usage,
)
from fsm_kernel.session import InMemorySession, Session
from fsm_kernel.workflow.spec import Limits, StateSpec

__all__ = ["Recorder", "RunContext", "ToolCallRecord"]

Recorder = Callable[[EventType, dict[str, Any]], None]


def _no_record(_type: EventType, _data: dict[str, Any]) -> None:
    return None


@dataclass(frozen=True, kw_only=True)
class ToolCallRecord:
    """One executed (or refused) tool call, as reported in the run's result."""

    iteration: int
    call: ToolCall
    result: ToolResult
    duration_ms: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "iteration": self.iteration,
            "id": self.call.id,
            "name": self.call.name,
            "arguments": self.call.arguments
            if self.call.arguments_error is None
            else self.call.raw_arguments,
            "result": self.result.content,
            "is_error": self.result.is_error,
        }


@dataclass(eq=False, kw_only=True)
class RunContext:
    """Everything a run knows. Actions mutate it; guards only read it."""

    run_id: str = ""
    goal: str = ""
    system_prompt: str = ""
    limits: Limits = field(default_factory=Limits)
    tool_names: Sequence[str] = ()
    """The tools the workflow offers (a state's `tools:` may narrow it)."""
    model: ChatModel | None = None
    tools: ToolExecutor | None = None
    session: Session = field(default_factory=InMemorySession)
    clock: Clock = field(default_factory=SystemClock)
    record: Recorder = _no_record
    """Appends an event to the run's log (the kernel wires this; a no-op in unit tests)."""

    current_state: str = ""
    state_spec: StateSpec = field(default_factory=StateSpec)
    """The spec of the state whose action is running (its prompt and tools)."""

    iteration: int = 0
    """Model calls made so far (one pass through a thinking state each)."""
    last_completion: Completion | None = None
    completion_iteration: int = 0
    """The iteration `last_completion` answered."""
    malformed_reason: str | None = None
    """Why the last model reply was malformed (bad JSON arguments, a tool not offered)."""
    last_results: list[ToolCallRecord] = field(default_factory=list)
    """The tool calls of the last act step."""
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    """Every tool call of the run, in order."""
    failure_streak: int = 0
    malformed_streak: int = 0
    repeat_count: int = 0
    last_call_key: str | None = None
    done_answer: str | None = None
    fatal_error: str | None = None
    answer: str = ""
    """The run's response: the latest text reply of a state whose `answer:` is true (every
    state by default; a plan or a critique is not the answer)."""
    usage: Usage = field(default_factory=Usage)
    summary: str = ""
    """A one-line state summary written by the evaluate step, kept in the iteration record."""
    scratch: dict[str, Any] = field(default_factory=dict)
    """Free space for users' own actions and guards."""

    def offered_tools(self) -> list[Tool]:
        """The tools to offer in the current state."""
        if self.tools is None:
            return []
        names = self.state_spec.tools if self.state_spec.tools is not None else self.tool_names
        return self.tools.list_tools(list(names)) if names else []

    def messages_for_model(self) -> list[Message]:
        """System prompt (with memory) followed by the conversation so far."""
        head = [Message.system(self.system_prompt)] if self.system_prompt else []
        return head + self.session.messages()

    def counters(self) -> dict[str, Any]:
        """The counters a resume restores (small: never the message list)."""
        return {
            "iteration": self.iteration,
            "failure_streak": self.failure_streak,
            "malformed_streak": self.malformed_streak,
            "repeat_count": self.repeat_count,
            "last_call_key": self.last_call_key,
            "done_answer": self.done_answer,
            "fatal_error": self.fatal_error,
            "answer": self.answer,
            "usage": self.usage.to_dict(),
            "scratch": self.scratch,
        }

    def restore_counters(self, data: dict[str, Any]) -> None:
        for key in ("iteration", "failure_streak", "malformed_streak", "repeat_count"):
            setattr(self, key, int(data.get(key, 0)))
        self.last_call_key = data.get("last_call_key")
        self.done_answer = data.get("done_answer")
        self.fatal_error = data.get("fatal_error")
        self.answer = data.get("answer", "")
        self.usage = Usage.from_dict(data.get("usage"))
        self.scratch = dict(data.get("scratch") or {})
