"""RunContext: the per-run state that actions change and guards read.

This is the object a user's own `package.module:function` action or guard receives: the run's
parameters, its collaborators (`services`: model, tools, clock, recorder; typed by Protocols,
also reachable as `ctx.model`, `ctx.tools`, `ctx.clock`, `ctx.record`) and its state.
"""

from __future__ import annotations

import asyncio
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
from fsm_kernel.workflow.human import HumanAnswer, HumanChannel, SuspendingChannel
from fsm_kernel.workflow.spec import ContextSpec, Limits, StateSpec

if TYPE_CHECKING:
    from fsm_kernel.workflow.children import ChildResult, ChildRunner
    from fsm_kernel.workflow.deadlines import Deadline, RecordedDeadlines
    from fsm_kernel.workflow.decide import Choice
    from fsm_kernel.workflow.output import OutputSchema
    from fsm_kernel.workflow.window import Summary

_OWN_MESSAGES = InMemorySession.messages
"""InMemorySession's own `messages`: a subclass that keeps it reads its history as it is."""

__all__ = [
    "CaughtError",
    "KernelNotes",
    "Recorder",
    "RunContext",
    "RunServices",
    "Sleep",
    "ToolCallRecord",
]

Recorder = Callable[[EventType, dict[str, Any]], object]
Sleep = Callable[[float], Awaitable[None]]


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
class CaughtError:
    """A failure of a state's action, as the run keeps it: what `catch:` routed (`ctx.caught`,
    read by the `caught` guard), or the failure a catch edge is about to route."""

    state: str
    """The state whose action failed."""
    error: str
    """`agent_error` (the model server failed) or `error` (anything else the action raised)."""
    type: str
    """The exception's class name (AgentServerError, ValueError, ...)."""
    message: str
    attempts: int = 1
    """How many times the action ran (1 + the retries)."""
    iteration: int = 0
    """The run's iteration when it failed."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "error": self.error,
            "type": self.type,
            "message": self.message,
            "attempts": self.attempts,
            "iteration": self.iteration,
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
    human: HumanChannel = field(default_factory=SuspendingChannel)
    """How the run reaches a person (tool approval, `human.input`): by default it suspends."""
    state_models: Mapping[str, ChatModel] = field(default_factory=dict)
    """The model of each state with its own `agent:` block; the others use `model`."""
    sleep: Sleep = asyncio.sleep
    """Waits between the attempts of a state's `retry:` (inside the run's timeout)."""
    recorded_failures: Mapping[tuple[str, int, int], Exception] = field(default_factory=dict)
    """A re-driven run's recorded action failures (not the model's, which its model serves):
    by (state, visit, attempt), raised instead of running the action again."""
    children: ChildRunner | None = None
    """Runs the child runs of `workflow.call` / `workflow.map` states."""
    recorded_children: Sequence[str] = ()
    """A re-driven run's child run ids, in the order it started them (`child.started`)."""
    recorded_deadlines: RecordedDeadlines | None = None
    """A re-driven run's compound-state deadlines: where they fired (see deadlines.py)."""

    def model_for(self, state: str) -> ChatModel | None:
        """The model the calls of `state` go to."""
        return self.state_models.get(state, self.model)


@dataclass(kw_only=True)
class KernelNotes:
    """The kernel's own bookkeeping for one run (not for actions or guards)."""

    fired: int | None = None
    """The index of the transition the machine just took (set by its `on` callback)."""
    tried: list[dict[str, Any]] = field(default_factory=list)
    """The edges the machine tried in the step it is taking, in order, each with the checks
    it evaluated and their values (see `FiredTransition.tried`): filled by the compiled
    guards as the engine calls them."""
    recorded_iteration: int = 0
    """The last iteration whose `iteration.completed` event was written."""
    failure: CaughtError | None = None
    """The failure of the action that just ran, which a catch edge is about to route."""
    visits: dict[str, int] = field(default_factory=dict)
    """How many times each state with `retry:`/`catch:` had its action run (retries aside)."""
    deadline: asyncio.Timeout | None = None
    """The run's wall-clock deadline while the kernel drives it (a child gets what is left)."""
    children_started: int = 0
    """Child runs started so far (the index of the next one in `recorded_children`)."""
    shared_calls: int | None = None
    """The model calls this run drew from the calls a map's children share (None: it is no
    child of a map with a cap); recorded in its ending, so its replay draws as many."""
    trigger: tuple[str, str | int] | None = None
    """What a waiting state is woken by, while its edges are tried: ("event", name) or
    ("timer", edge index); None otherwise (its event and timer edges do not pass)."""
    deadlines: dict[str, list[Deadline]] = field(default_factory=dict)
    """The `after:` timers of the compound states the run is inside, by state (deadlines.py)."""


@dataclass(eq=False, kw_only=True)
class RunContext:
    """Everything a run knows: its parameters, its collaborators (`services`) and its state.
    Actions change the state; guards only read it."""

    # -- the run's parameters, fixed when it starts --
    run_id: str = ""
    goal: str = ""
    workflow_path: str = ""
    """The workflow's file (a `workflow.call` state's relative path starts from its folder)."""
    system_prompt: str = ""
    limits: Limits = field(default_factory=Limits)
    tool_names: Sequence[str] = ()
    """The tools the workflow offers (a state's `tools:` may narrow it)."""
    approval_required: frozenset[str] = frozenset()
    """The tools whose every call a person approves first (`approval: required`)."""
    parallel_tool_calls: bool = False
    """The workflow's `parallel_tool_calls` (a state's own overrides it)."""
    context_window: ContextSpec | None = None
    """The workflow's `context:`: each request made to fit the model's window."""
    services: RunServices = field(default_factory=RunServices)
    outputs: Mapping[str, OutputSchema] = field(default_factory=dict)
    """The output schema of each state that has one (see `output_schema`)."""
    choices: Mapping[str, Sequence[Choice]] = field(default_factory=dict)
    """The `choice:` edges of each agent.decide state, with their guards (workflow/decide.py)."""

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
    vars: dict[str, Any] = field(default_factory=dict)
    """The declared variables (`variables:`), set by `assign:` and by Python actions."""
    output_error: str | None = None
    """Why the last reply failed its state's output schema (it is then malformed output)."""
    usage: Usage = field(default_factory=Usage)
    summary: str = ""
    """A one-line state summary written by the evaluate step, kept in the iteration record."""
    last_request_estimate: int = 0
    """The estimated prompt tokens of the last request (see workflow/window.py)."""
    context_summary: Summary | None = None
    """The `summarize` strategy's summary of the run's older turns, once it made one."""
    answers: list[HumanAnswer] = field(default_factory=list)
    """What a person answered in the last step that asked (approvals of its tool calls, or
    the text of a `human.input` state); the guards `approved` and `rejected` read them."""
    scratch: dict[str, Any] = field(default_factory=dict)
    """Free space for users' own actions and guards (the kernel never writes here)."""
    event: dict[str, Any] | None = None
    """The last event delivered to the run (`fsm-kernel signal`): {"name": ..., "data": ...};
    guards and templates (`{event.data.x}`) read it."""
    caught: CaughtError | None = None
    """The last failure a state's `catch:` routed (None until one does; the next replaces it):
    which state failed, how, and the error text. The `caught` guard reads it."""
    children: list[ChildResult] = field(default_factory=list)
    """The child runs of the last `workflow.call` (one) or `workflow.map` (one per item, in
    item order) state; the guards `child_succeeded` and `child_failed` read them."""
    child_iterations: int = 0
    """Model calls made by the run's children: they count against `limits.max_iterations`."""
    attempt: int = 1
    """The attempt of the running action: 2 and up when a state's `retry:` runs it again
    (agent.think then neither re-adds the state's prompt nor counts a new iteration)."""
    offered_choices: tuple[str, ...] = ()
    """The choices the last agent.decide state offered the model: those whose edges' guards
    held (empty: none did, and the model was not asked)."""
    choice: str | None = None
    """The choice the model picked there; None when it picked none (none was offered, or its
    replies were malformed until `limits.max_malformed_outputs`)."""
    notes: KernelNotes = field(default_factory=KernelNotes, repr=False)

    @property
    def iterations_used(self) -> int:
        """The run's model calls and its children's: what `limits.max_iterations` caps."""
        return self.iteration + self.child_iterations

    @property
    def model(self) -> ChatModel | None:
        """The model of the current state: its own `agent:` block's, else the run's."""
        return self.services.model_for(self.current_state)

    @property
    def tools(self) -> ToolExecutor | None:
        return self.services.tools

    @property
    def clock(self) -> Clock:
        return self.services.clock

    def record(self, type_: EventType, data: dict[str, Any]) -> None:
        """Append an event to the run's log."""
        self.services.record(type_, data)

    def add_message(self, message: Message) -> None:
        """Add a message to the conversation and record it (`message.added`), so a resume or
        a `--continue` rebuilds the same conversation from the log."""
        self.session.add(message)
        self.record(EventType.MESSAGE_ADDED, {"message": message.to_dict()})

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

    def messages_for_model(self) -> Sequence[Message]:
        """System prompt (with memory) followed by the conversation so far: a snapshot the
        model may keep. From an InMemorySession, made without copying the history (the cost
        of a model call stays flat however long the run); from another Session, its copy."""
        head = (Message.system(self.system_prompt),) if self.system_prompt else ()
        session = self.session
        if isinstance(session, InMemorySession) and type(session).messages is _OWN_MESSAGES:
            return session.history(head)  # (a subclass reading its own way is asked for a copy)
        return [*head, *session.messages()]
