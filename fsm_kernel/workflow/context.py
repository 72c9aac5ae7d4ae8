"""RunContext: the per-run state that actions change and guards read.

This is the object a user's own `package.module:function` action or guard receives: the run's
parameters, its collaborators (`services`: model, tools, clock, recorder; typed by Protocols,
also reachable as `ctx.model`, `ctx.tools`, `ctx.clock`, `ctx.record`) and its state.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from fsm_kernel.workflow.output import OutputSchema

__all__ = ["KernelNotes", "Recorder", "RunContext", "RunServices", "ToolCallRecord"]

Recorder = Callable[[EventType, dict[str, Any]], object]


def _no_record(_type: EventType, _data: dict[str, Any]) -> None:
    return None


async def _no_flush() -> None:
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


@dataclass(frozen=True, kw_only=True)
class RunServices:
    """What a run works with, fixed for the run: the model, the tools, the clock and the event
    recorder. They belong to the run, not to the Kernel, so a resume (which serves recorded
    answers) and a new run on the same Kernel never share or swap them."""

    model: ChatModel | None = None
    tools: ToolExecutor | None = None
    clock: Clock = field(default_factory=SystemClock)
    record: Recorder = _no_record
    """Appends an event to the run's log (the kernel wires this; a no-op in unit tests)."""
    flush: Callable[[], Awaitable[None]] = _no_flush
    """Makes the events recorded so far durable (before a side effect, e.g. a tool call)."""


@dataclass(kw_only=True)
class KernelNotes:
    """The kernel's own bookkeeping for one run (not for actions or guards)."""

    fired: int | None = None
    """The index of the transition the machine just took (set by its `on` callback)."""
    recorded_iteration: int = 0
    """The last iteration whose `iteration.completed` event was written."""


@dataclass(eq=False, kw_only=True)
class RunContext:
    """Everything a run knows: its parameters, its collaborators (`services`) and its state.
    Actions change the state; guards only read it."""

    # -- the run's parameters, fixed when it starts --
    run_id: str = ""
    goal: str = ""
    system_prompt: str = ""
    limits: Limits = field(default_factory=Limits)
    tool_names: Sequence[str] = ()
    """The tools the workflow offers (a state's `tools:` may narrow it)."""
    services: RunServices = field(default_factory=RunServices)
    outputs: Mapping[str, OutputSchema] = field(default_factory=dict)
    """The output schema of each state that has one (see `output_schema`)."""

    # -- the run's state --
    session: Session = field(default_factory=InMemorySession)
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
    output: Any = None
    """The run's structured output: `answer` validated against its state's output schema (the
    pydantic model's instance, or the parsed JSON); None when that answer had no schema."""
    last_output: Any = None
    """The last reply's answer validated against its state's output schema, whichever the state
    (for guards and own actions); None when it had no schema or failed it."""
    output_error: str | None = None
    """Why the last reply failed its state's output schema (it is then malformed output)."""
    usage: Usage = field(default_factory=Usage)
    summary: str = ""
    """A one-line state summary written by the evaluate step, kept in the iteration record."""
    scratch: dict[str, Any] = field(default_factory=dict)
    """Free space for users' own actions and guards (the kernel never writes here)."""
    notes: KernelNotes = field(default_factory=KernelNotes, repr=False)

    @property
    def model(self) -> ChatModel | None:
        return self.services.model

    @property
    def tools(self) -> ToolExecutor | None:
        return self.services.tools

    @property
    def clock(self) -> Clock:
        return self.services.clock

    def record(self, type_: EventType, data: dict[str, Any]) -> None:
        """Append an event to the run's log."""
        self.services.record(type_, data)

    async def flush(self) -> None:
        """Wait until the events recorded so far are durable (call before a side effect)."""
        await self.services.flush()

    @property
    def output_schema(self) -> OutputSchema | None:
        """The output schema of the current state, if it has one."""
        return self.outputs.get(self.current_state)

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
