"""The workflow file's schema (pydantic) and the source locations of its nodes.

Pure data: no YAML parsing here (loader.py) and no python-statemachine (compiler.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    PrivateAttr,
    WithJsonSchema,
    model_validator,
)

from fsm_kernel.config import DEFAULT_MAX_TOKENS

__all__ = [
    "CHILD_GUARDS",
    "COMPLETED",
    "DEFAULT_MAP_ITEMS",
    "ERROR_KINDS",
    "MAX_MAP_ITEMS",
    "SUCCESS_REASONS",
    "TERMINATION_REASONS",
    "AgentBlock",
    "CatchEdge",
    "CatchSpec",
    "ContextSpec",
    "ErrorKind",
    "Limits",
    "McpServerSpec",
    "NotifySpec",
    "ReasonSpec",
    "RetrySpec",
    "SourceLocation",
    "StateSpec",
    "TerminationReason",
    "ToolEntry",
    "TransitionSpec",
    "WorkflowSpec",
    "as_reason",
    "edge_number",
    "parse_duration",
]


class TerminationReason(StrEnum):
    """Every reason a run may end for: exactly one per run. A StrEnum, so each compares equal
    to its name as written in workflow files and the event log ("max_iterations")."""

    FINAL_ANSWER = "final_answer"
    DONE = "done"
    MAX_ITERATIONS = "max_iterations"
    BUDGET_EXCEEDED = "budget_exceeded"
    FATAL_TOOL_ERROR = "fatal_tool_error"
    NO_PROGRESS = "no_progress"
    TOOL_FAILURES = "tool_failures"
    MALFORMED_OUTPUT = "malformed_output"
    TRUNCATED = "truncated"
    AGENT_ERROR = "agent_error"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    ERROR = "error"

    @property
    def description(self) -> str:
        return TERMINATION_REASONS[self]


TERMINATION_REASONS: dict[TerminationReason, str] = {
    TerminationReason.FINAL_ANSWER: "the model answered without calling a tool",
    TerminationReason.DONE: "the model called the done tool",
    TerminationReason.MAX_ITERATIONS: "the iteration cap was reached",
    TerminationReason.BUDGET_EXCEEDED: (
        "the run's model calls used limits.max_tokens tokens (prompt + completion)"
    ),
    TerminationReason.FATAL_TOOL_ERROR: "a tool failed in a way the run cannot recover from",
    TerminationReason.NO_PROGRESS: "the same tool call with the same arguments repeated too often",
    TerminationReason.TOOL_FAILURES: "too many tool failures in a row",
    TerminationReason.MALFORMED_OUTPUT: "too many malformed model replies in a row",
    TerminationReason.TRUNCATED: (
        "the model's reply was cut off by its length limit (max tokens or context window)"
    ),
    TerminationReason.AGENT_ERROR: "the model server failed after retries",
    TerminationReason.CANCELLED: "the run was cancelled (Ctrl-C)",
    TerminationReason.TIMEOUT: "the run's wall-clock timeout expired",
    TerminationReason.ERROR: "an action raised (a bug)",
}
"""Every reason a run may end for, with what it means."""

SUCCESS_REASONS = frozenset({TerminationReason.FINAL_ANSWER, TerminationReason.DONE})
"""The built-in reasons a run succeeded for (exit code 0); a workflow may declare more
(`reasons:` with `success: true`, see `WorkflowSpec.is_success`). A run about to end with a
success reason while the last model reply was cut off by the length limit ends `truncated`
instead (the kernel's rule)."""


def edge_number(index: object) -> object:
    """How an edge recorded by its index (`tried`, timers) is shown to people: its 1-based
    place in the workflow's `transitions:` (the catch edges counted after them), the number
    the diagrams print beside it; anything but an index (a hand-edited log) as it is. The
    log and JSON output keep the index itself."""
    return index + 1 if isinstance(index, int) and not isinstance(index, bool) else index


def as_reason(name: str) -> TerminationReason | str:
    """A built-in reason as its enum member; a workflow's own (`reasons:`) as the plain string."""
    return TerminationReason(name) if name in TERMINATION_REASONS else name


@dataclass(frozen=True)
class SourceLocation:
    """Where a node is in a file; 1-based line and column."""

    path: str
    line: int
    col: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.col}"


def _as_list(value: Any) -> Any:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return value


NameList = Annotated[
    list[str],
    BeforeValidator(_as_list),
    WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}),
]
"""A name or a list of names (`guard: x` is `guard: [x]`)."""


OUTPUT_REF = r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_.]*$"
"""A `package.module:Model` reference as `output:` takes it."""


def _output(value: Any) -> Any:
    if isinstance(value, dict):
        return value
    if isinstance(value, str) and re.match(OUTPUT_REF, value):
        return value
    raise ValueError(
        "must be a JSON Schema (a mapping) or a 'package.module:Model' reference to a pydantic "
        "model"
    )


OutputValue = Annotated[
    dict[str, Any] | str,
    PlainValidator(_output),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "object", "description": "A JSON Schema"},
                {
                    "type": "string",
                    "pattern": OUTPUT_REF,
                    "description": "package.module:Model, a pydantic model",
                },
            ]
        }
    ),
]
"""Structured output: a JSON Schema, or a reference to a pydantic model."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


_TOOL_CHOICE_PATTERN = r"^[A-Za-z_][A-Za-z0-9_.-]*$"
_TOOL_CHOICE_HELP = (
    "how the model may use the offered tools: auto (it decides), none, required, omit (send no "
    "tool_choice, for servers that reject it), or the name of the one tool it must call."
)


class ToolEntry(_Model):
    """A tool of the workflow with its settings (a bare name in `tools:` is one with none)."""

    name: str = Field(description="Built-in tool name or package.module:function")
    approval: Literal["required", "never"] = Field(
        default="never",
        description="required: a person approves each call before it runs (interactively, or "
        "the run suspends until `fsm-kernel resume --approve/--reject`)",
    )


def _tool_entries(value: Any) -> Any:
    return [{"name": v} if isinstance(v, str) else v for v in _as_list(value)]


ToolList = Annotated[
    list[ToolEntry],
    BeforeValidator(_tool_entries),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "items": {
                        "anyOf": [{"type": "string"}, ToolEntry.model_json_schema()],
                    },
                },
            ]
        }
    ),
]
"""`tools:` entries: names, or mappings `{name: x, approval: required}`."""


class AgentBlock(_Model):
    """Model server settings; environment variables and flags override these."""

    model: str | None = None
    base_url: str | None = None
    temperature: float | None = Field(default=None, allow_inf_nan=False)
    request_timeout: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="Seconds for one model request, the whole answer included; 0 = none",
    )
    max_retries: int | None = Field(default=None, ge=0, le=100)
    max_response_bytes: int | None = Field(
        default=None, gt=0, description="Largest model response accepted, in bytes"
    )
    stream: bool | None = Field(
        default=None,
        strict=True,
        description="Ask for streamed answers (default true; false for a server that streams "
        "badly)",
    )
    tool_choice: str | None = Field(
        default=None,
        pattern=_TOOL_CHOICE_PATTERN,
        description=_TOOL_CHOICE_HELP + " Default auto.",
    )
    max_tokens: int | None = Field(
        default=None,
        ge=0,
        strict=True,
        description="The most tokens one model reply may have, sent to the server as max_tokens "
        "(max_completion_tokens to a server that asks for it); a reply cut off by it ends with "
        f"finish_reason length. Default {DEFAULT_MAX_TOKENS}; 0 sends no cap (the server's own "
        "default applies)",
    )


MCP_NAME = r"^[A-Za-z][A-Za-z0-9_-]*$"
"""A name in `mcp_servers:` (what `tools:` entries `mcp:NAME` refer to)."""


class McpServerSpec(_Model):
    """An MCP tool server: a command the run starts (stdio) or a URL (streamable HTTP)."""

    command: str | None = Field(
        default=None, description="stdio: the program to start (e.g. npx, uvx, python)"
    )
    args: list[str] = Field(default_factory=list, description="stdio: its arguments")
    env: dict[str, str] = Field(
        default_factory=dict,
        description="stdio: environment variables for it (${NAME} takes one of ours; never "
        "recorded)",
    )
    cwd: str | None = Field(default=None, description="stdio: its working directory")
    url: str | None = Field(
        default=None,
        pattern=r"^https?://",
        description="streamable HTTP: the server's endpoint (e.g. http://localhost:8000/mcp)",
    )
    headers: dict[str, str] = Field(
        default_factory=dict,
        description="HTTP: headers sent with every request; ${NAME} takes an environment "
        "variable (e.g. Authorization: Bearer ${GITHUB_TOKEN}); never logged or recorded",
    )
    startup_timeout: float = Field(
        default=20.0,
        gt=0,
        le=600,
        allow_inf_nan=False,
        description="Seconds for the server to start and list its tools",
    )
    call_timeout: float = Field(
        default=60.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="Seconds one tool call may take; then the call is an error result",
    )

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerSpec:
        if (self.command is None) == (self.url is None):
            raise ValueError("give either command (stdio) or url (streamable HTTP)")
        if self.url is not None and (self.args or self.env or self.cwd):
            raise ValueError("args, env and cwd are for a command (stdio), not a url")
        if self.command is not None and self.headers:
            raise ValueError("headers are for a url (streamable HTTP), not a command")
        return self

    def recorded(self) -> dict[str, Any]:
        """What a run's log keeps of it: never env values or headers (they carry secrets)."""
        if self.url is not None:
            return {"url": self.url, "headers": sorted(self.headers)}
        return {
            "command": self.command,
            "args": self.args,
            "cwd": self.cwd,
            "env": sorted(self.env),
        }


NOTIFY_EVENTS = ("ended", "failed", "waiting", "dispatch_failed")
"""What a `notify:` webhook may be sent for: a run ended (any reason), ended without success,
waits for a person; a scheduler's dispatch failed."""


NotifyEvent = Literal["ended", "failed", "waiting", "dispatch_failed"]
_NOTIFY_DEFAULT: tuple[NotifyEvent, ...] = ("failed", "waiting", "dispatch_failed")


class NotifySpec(_Model):
    """A webhook told when a run ends, fails or waits (and, in a scheduler config, when a
    dispatch fails)."""

    url: str = Field(
        pattern=r"^(https?://|\$\{)",
        description="Where to POST; ${NAME} takes an environment variable (a Slack webhook URL "
        "is a secret: keep it in the environment). Never recorded whole: the log keeps its "
        "scheme and host",
    )
    on: list[NotifyEvent] = Field(
        default_factory=lambda: list(_NOTIFY_DEFAULT),
        min_length=1,
        description="ended (every ending), failed (an ending that is not a success), waiting "
        "(for a person), dispatch_failed (scheduler configs). Default: failed, waiting, "
        "dispatch_failed",
    )
    format: Literal["json", "slack"] = Field(
        default="json",
        description="json: the run's id, workflow, status, reason, answer (cut to 500 "
        "characters), error and a hint; slack: a {text} message for a Slack incoming webhook",
    )
    headers: dict[str, str] = Field(
        default_factory=dict,
        description="Headers of the POST; ${NAME} takes an environment variable (never logged)",
    )
    retries: int = Field(
        default=3, ge=0, le=10, strict=True, description="Attempts after the first that failed"
    )
    timeout_seconds: float = Field(
        default=5.0, gt=0, le=120, allow_inf_nan=False, description="Seconds for one attempt"
    )


class Limits(_Model):
    """Caps the kernel enforces in code, whatever the transitions say."""

    max_iterations: int = Field(default=10, ge=0, description="Model calls per run; 0 = unlimited")
    max_transitions: int = Field(
        default=1000, ge=1, description="Transitions per run, so a guard loop still ends"
    )
    timeout_seconds: float = Field(default=600.0, ge=0, description="Wall clock; 0 = none")
    max_tool_failures: int = Field(default=3, ge=1, description="Failed tool calls in a row")
    no_progress_repeats: int = Field(
        default=3, ge=2, description="Same tool, same arguments, this many times in a row"
    )
    max_malformed_outputs: int = Field(
        default=3, ge=1, description="Malformed model replies in a row"
    )
    max_tool_calls_per_reply: int = Field(
        default=16,
        ge=1,
        le=1000,
        description="Tool calls executed from one model reply; the rest are answered with an "
        "error result",
    )
    max_parallel_tool_calls: int = Field(
        default=4,
        ge=1,
        le=64,
        description="Tool calls of one reply run at the same time where parallel_tool_calls is "
        "true",
    )
    max_tokens: int = Field(
        default=0,
        ge=0,
        description="Tokens per run: prompt + completion tokens summed over the run's model "
        "calls, as the server reports them; the run ends budget_exceeded once they reach it. "
        "0 = no cap",
    )


_REASON_NAME = r"^[a-z][a-z0-9_]*$"


class ContextSpec(_Model):
    """How a run's requests stay inside the model's context window."""

    max_tokens: int = Field(
        ge=256,
        strict=True,
        description="The most prompt tokens a request may have: the model's window, or a budget "
        "below it (estimated: 4 characters a token, scaled by what the server reported)",
    )
    strategy: Literal["truncate_tool_results", "drop_oldest", "summarize"] = Field(
        default="truncate_tool_results",
        description="truncate_tool_results: shorten the oldest tool results first; "
        "drop_oldest: keep the system prompt, the goal and the latest turns; summarize: a "
        "model call condenses the turns before the latest ones into one message (it counts "
        "as an iteration and is recorded)",
    )
    keep: int = Field(
        default=4,
        ge=0,
        strict=True,
        description="truncate_tool_results: the latest tool results kept whole; drop_oldest "
        "and summarize: the latest turns always kept as they are",
    )


class ReasonSpec(_Model):
    """A termination reason the workflow declares for its own edges into final states."""

    success: bool = Field(
        default=False,
        strict=True,
        description="Whether a run that ends for this reason succeeded: true exits 0 "
        "(RunResult.ok), false exits 1",
    )
    description: str = Field(default="", description="What the reason means, for readers")


class MigrationSpec(_Model):
    """How runs pinned to an older version of this workflow map onto this one, for
    `resume --migrate`: the states renamed since that version (old id -> new id)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    from_version: int = Field(
        alias="from",
        ge=1,
        strict=True,
        description="The version this entry moves runs from; entries apply in order from a "
        "run's recorded version up to this file's",
    )
    rename_states: dict[str, str] = Field(
        default_factory=dict,
        description="State ids renamed since that version: old id -> id in this file",
    )


ErrorKind = Literal["agent_error", "error", "any"]
"""Which failures of a state's action a `retry:` or `catch:` entry handles: `agent_error` (the
model server failed after the client's own retries: AgentError), `error` (anything else the
action raised) or `any` (both). Cancellation, the run's timeout and the kernel's own failures
(the store, a replay's divergence) are never handled."""

ERROR_KINDS: tuple[str, ...] = ("agent_error", "error", "any")

DEFAULT_MAP_ITEMS = 100
"""A `workflow.map`'s `max_items` when the state does not say."""
MAX_MAP_ITEMS = 10_000
"""The most `max_items` may be: each item is a run of its own in the event log."""
CHILD_GUARDS = frozenset({"child_failed", "child_succeeded"})

COMPLETED = "completed"
"""The built-in guard of an edge out of a compound state: the run is in one of that state's
final children (the compiler gives it its source; see compiler.py)."""
"""The built-in guards that read a calling state's children's outcome."""

_ERROR_HELP = (
    "which failures: agent_error (the model server failed after the client's own retries), "
    "error (the action raised anything else) or any (both)"
)


class RetrySpec(_Model):
    """Run a state's action again when it raises, as Step Functions' Retry: after a failure,
    wait `backoff_seconds` × `backoff_rate`^(retry − 1) (at most `max_backoff_seconds`) and
    run it again, up to `max_attempts` more times."""

    error: ErrorKind = Field(default="any", description="Retry " + _ERROR_HELP + ". Default any")
    max_attempts: int = Field(
        default=3,
        ge=0,
        le=100,
        strict=True,
        description="Retries after the first failure (Step Functions' MaxAttempts): the action "
        "runs at most 1 + max_attempts times. Default 3; 0 = never retried",
    )
    backoff_seconds: float = Field(
        default=1.0,
        ge=0,
        le=3600,
        allow_inf_nan=False,
        description="Seconds to wait before the first retry (Step Functions' IntervalSeconds); "
        "the wait counts against the run's timeout. Default 1",
    )
    backoff_rate: float = Field(
        default=2.0,
        ge=1,
        le=100,
        allow_inf_nan=False,
        description="Each further wait is this many times the previous one. Default 2",
    )
    max_backoff_seconds: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="The longest wait between two attempts (Step Functions' MaxDelaySeconds)",
    )

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number `retry` (1-based)."""
        wait = self.backoff_seconds * self.backoff_rate ** (retry - 1)
        return min(wait, self.max_backoff_seconds) if self.max_backoff_seconds else wait


class CatchSpec(_Model):
    """Where a run goes when the state's action still fails (after its retries), instead of
    ending: the first entry whose `error` matches routes the run to `target`."""

    error: ErrorKind = Field(description="Catch " + _ERROR_HELP)
    target: str = Field(description="The state the run goes to; the error is in ctx.caught")
    reason: str | None = Field(
        default=None, description="Termination reason; required when the target is final"
    )
    description: str = ""


class StateSpec(_Model):
    """One state of the loop: the action it runs when entered."""

    action: str | None = Field(
        default=None, description="Built-in action (agent.think) or package.module:function"
    )
    description: str = ""
    final: bool = False
    prompt: str | None = Field(
        default=None,
        description="For agent actions: an instruction added as a user message before the call",
    )
    tools: NameList | None = Field(
        default=None, description="For agent actions: the tools offered here (default: all)"
    )
    tool_choice: str | None = Field(
        default=None,
        pattern=_TOOL_CHOICE_PATTERN,
        description="For agent actions: " + _TOOL_CHOICE_HELP + " Default: the agent's.",
    )
    parallel_tool_calls: bool | None = Field(
        default=None,
        strict=True,
        description="For tools.execute states: run the calls of one reply at the same time "
        "(at most limits.max_parallel_tool_calls). Default: the workflow's",
    )
    answer: bool = Field(
        default=True,
        strict=True,  # only true/false: YAML 1.2 `no` is a string here, never False
        description="For states whose action calls the model (agent.think): whether a text reply "
        "here is the run's answer (its response). false for intermediate text such as a plan, "
        "a thought or a critique, so a run cut short there still answers with the latest real "
        "answer. Guards are unaffected (they read the last reply). Setting false on a state "
        "whose action does not call the model is a validation error.",
    )
    retry: RetrySpec | None = Field(
        default=None,
        description="Run the action again when it raises (each attempt is recorded as an "
        "action.failed event)",
    )
    catch: list[CatchSpec] = Field(
        default_factory=list,
        description="When the action still fails, the first entry whose error matches routes "
        "the run to its target instead of ending it (tried before the state's transitions)",
    )
    agent: AgentBlock | None = Field(
        default=None,
        description="For states whose action calls the model: model server settings for this "
        "state's calls, over the run's (workflow agent: block, environment, flags), e.g. a "
        "fallback model",
    )
    output: OutputValue | None = Field(
        default=None,
        description="For states whose action calls the model: the JSON Schema (a mapping) or "
        "the pydantic model (package.module:Model) its text reply must match. The reply is asked "
        "for as JSON under it and validated; an invalid one is malformed output. Default: the "
        "workflow's `output:` where `answer` is true.",
    )
    assign: dict[str, str] = Field(
        default_factory=dict,
        description="After the action: variable -> CEL expression (e.g. output.steps), each "
        "result checked against the variable's schema and recorded (vars.assigned)",
    )
    workflow: str | None = Field(
        default=None,
        description="For workflow.call and workflow.map: the workflow each child run runs: a "
        "stock name (react) or a path to a YAML file (relative to this file's folder)",
    )
    input: str | None = Field(
        default=None,
        description="For workflow.call and workflow.map: the child's prompt, a template with "
        "{goal}, {answer}, {output}, {output.KEY}, {child.answer}, {child.output.KEY}, "
        "{children}, {scratch.KEY} and, in a map, {item} (objects as JSON) and {index} "
        "(from 1). Default {goal} (call), {item} (map)",
    )
    items: str | None = Field(
        default=None,
        description="For workflow.map: where the list comes from: output.KEY (the last "
        "validated structured output), output, child.output.KEY or scratch.KEY",
    )
    max_concurrency: int | None = Field(
        default=None,
        ge=1,
        le=64,
        strict=True,
        description="For workflow.map: the most child runs at the same time. Default 4",
    )
    fail_fast: bool | None = Field(
        default=None,
        strict=True,
        description="For workflow.map: the first failed item cancels the others (default "
        "false: every item runs)",
    )
    max_items: int | None = Field(
        default=None,
        ge=1,
        le=MAX_MAP_ITEMS,
        strict=True,
        description="For workflow.map: the most items it runs; a longer list fails the state "
        "before any child is recorded (an error its catch: may route). Default "
        f"{DEFAULT_MAP_ITEMS}, at most {MAX_MAP_ITEMS:,}",
    )

    initial: str | None = Field(
        default=None,
        description="A compound state's child entered first (with `states:`, it makes this "
        "state compound: no action of its own, its children run)",
    )
    states: dict[str, StateSpec] | None = Field(
        default=None,
        description="A compound state's children (ids unique across the whole workflow); an "
        "edge out of this state is tried first from every state inside it",
    )
    history: Literal["shallow", "deep"] | None = Field(
        default=None,
        description="A compound state keeps where the run left it: shallow, its child; deep, "
        "the state at any depth. A transition with `enter: history` returns there",
    )

    _routes_children: bool = PrivateAttr(default=False)

    @property
    def is_compound(self) -> bool:
        """A state with children of its own (`initial:` and `states:`)."""
        return self.states is not None

    @property
    def routes_child_outcome(self) -> bool:
        """An edge out of this state is guarded on its children's outcome (`child_failed` or
        `child_succeeded`, as guard or unless): a failed child is then the workflow's to route;
        otherwise it fails the state (see workflow.children). Set by the WorkflowSpec holding
        the state; False for a state on its own."""
        return self._routes_children


_DURATION = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(s|m|h|d)$")
_UNIT_SECONDS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float | None:
    """`90s`, `30m`, `2h`, `1d` (a number and one unit) in seconds; None for anything else or
    for zero (a timer that fires at once is no timer)."""
    match = _DURATION.match(text.strip()) if isinstance(text, str) else None
    if match is None:
        return None
    seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    return seconds if seconds > 0 else None


class TransitionSpec(_Model):
    """An edge; out of one state, edges are tried in file order, the first that passes fires."""

    source: str
    target: str
    guard: NameList = Field(default_factory=list, description="All must be true")
    unless: NameList = Field(default_factory=list, description="All must be false")
    when: str | None = Field(
        default=None,
        description="A CEL expression that must hold too (beside guard and unless), e.g. "
        "vars.attempts < 3; validate parses and type-checks it",
    )
    assign: dict[str, str] = Field(
        default_factory=dict,
        description="When the edge is taken: variable -> CEL expression, each result checked "
        "against the variable's schema and recorded (vars.assigned)",
    )
    reason: str | None = Field(
        default=None, description="Termination reason; required on edges into final states"
    )
    description: str = ""
    enter: Literal["initial", "history"] = Field(
        default="initial",
        description="Into a compound state: initial (its initial child) or history (where the "
        "run last left it, as its `history:` says; its initial child the first time)",
    )
    event: str | None = Field(
        default=None,
        description="Fires when this named event is delivered (fsm-kernel signal RUN NAME); "
        "only on edges out of a state without an action (a waiting state)",
    )
    after: str | None = Field(
        default=None,
        description="Fires once the run has waited this long in the source state: a number and "
        "a unit, s, m, h or d (90s, 30m, 2h, 1d); only out of a state without an action",
    )
    choice: str | None = Field(
        default=None,
        description="Out of an agent.decide state: the text of this choice, offered to the "
        "model when the edge's guards hold; the edge fires when the model picks it (unique per "
        "state)",
    )

    @property
    def waits(self) -> bool:
        """An edge that fires on a named event or a timer (its source is a waiting state)."""
        return self.event is not None or self.after is not None

    @property
    def is_choice(self) -> bool:
        """An edge the model picks (`choice:`, out of an agent.decide state)."""
        return self.choice is not None

    @property
    def after_seconds(self) -> float | None:
        """`after:` in seconds (None when absent or not a duration; validate reports that)."""
        return parse_duration(self.after) if self.after is not None else None

    @property
    def has_user_guard(self) -> bool:
        """A guard or unless of the user's own (`package.module:function`): maybe impure."""
        return any(":" in name for name in (*self.guard, *self.unless))

    @property
    def is_guarded(self) -> bool:
        """It fires only when something holds: a guard, its event or timer, or the model's pick
        (a `choice:` edge)."""
        return bool(self.guard or self.unless or self.when) or self.waits or self.is_choice

    def label(self) -> str:
        parts = list(self.guard) + [f"not {name}" for name in self.unless]
        if self.when is not None:  # in parentheses beside other guards: CEL has its own and/or
            parts.append(f"({self.when})" if parts else self.when)
        if self.event is not None:
            parts.insert(0, f"event {self.event}")
        if self.after is not None:
            parts.insert(0, f"after {self.after}")
        if self.choice is not None:
            parts.insert(0, f'choice "{self.choice}"')
        return " and ".join(parts)


@dataclass(frozen=True)
class CatchEdge:
    """A state's `catch:` entry as an edge of the machine. Edges are numbered in one list: the
    declared transitions first, then every catch entry (states in file order, entries in list
    order); `index` is the number `transition.taken` records."""

    index: int
    source: str
    position: int
    """The entry's place in its state's `catch:` list."""
    spec: CatchSpec

    @property
    def target(self) -> str:
        return self.spec.target

    @property
    def reason(self) -> str | None:
        return self.spec.reason

    @property
    def error(self) -> str:
        return self.spec.error

    def label(self) -> str:
        """The guard label of the edge: `catch agent_error`."""
        return f"catch {self.spec.error}"


class WorkflowSpec(_Model):
    """A whole workflow file."""

    name: str = Field(pattern=r"^[A-Za-z][A-Za-z0-9_\-]*$")
    description: str = ""
    version: int | None = Field(
        default=None,
        ge=1,
        strict=True,
        description="The definition's version (a positive integer). A run records the "
        "workflow's text and follows it to its end; `runs show` says which version it is pinned "
        "to, `resume --migrate` moves it to the current file",
    )
    migrations: list[MigrationSpec] = Field(
        default_factory=list,
        description="How runs pinned to older versions map onto this one for `resume "
        "--migrate`: e.g. [{from: 1, rename_states: {investigate: research}}]. A migrated run "
        "must still decide every recorded step identically, under the new names",
    )
    agent: AgentBlock = Field(default_factory=AgentBlock)
    system_prompt: str = "You are a careful agent. Use tools instead of guessing."
    memory: str | None = Field(
        default=None, description="Folder of *.md files appended to the system prompt"
    )
    tools: ToolList = Field(
        default_factory=list,
        description="Built-in tool names or package.module:function, or mappings "
        "{name: ..., approval: required} for tools a person must approve before each call",
    )
    notify: list[NotifySpec] = Field(
        default_factory=list,
        description="Webhooks told when a run of this workflow ends, fails or waits for a "
        "person: a POST in the background, retried with backoff, never delaying or failing the "
        "run; each attempt is recorded as a notify.attempted event",
    )
    mcp_servers: dict[str, McpServerSpec] = Field(
        default_factory=dict,
        description="MCP tool servers by name; `tools:` entries mcp:NAME (all its tools) or "
        "mcp:NAME/TOOL offer their tools",
        json_schema_extra={"propertyNames": {"pattern": MCP_NAME}},
    )
    parallel_tool_calls: bool = Field(
        default=False,
        strict=True,
        description="Run the tool calls of one model reply at the same time (at most "
        "limits.max_parallel_tool_calls); their results go back in the calls' order. A state's "
        "own parallel_tool_calls overrides it",
    )
    limits: Limits = Field(default_factory=Limits)
    context: ContextSpec | None = Field(
        default=None,
        description="Keep each request inside the model's context window: the request is made "
        "to fit (the run's history is not changed) and a context.trimmed event says how",
    )
    output: OutputValue | None = Field(
        default=None,
        description="Structured output: the JSON Schema (a mapping) or the pydantic model "
        "(package.module:Model) the run's answer must match, for every state whose action calls "
        "the model and whose `answer` is true (a state's own `output:` wins). The validated "
        "value is the run's `output`.",
    )
    reasons: dict[str, ReasonSpec] = Field(
        default_factory=dict,
        description="The workflow's own termination reasons, for its edges into final states: "
        "snake_case names that are not built-in reasons, each with `success` (exit 0) or not",
        json_schema_extra={
            "propertyNames": {
                "pattern": _REASON_NAME,
                "not": {"enum": [str(r) for r in TERMINATION_REASONS]},
            }
        },
    )
    variables: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="The run's declared data: name -> JSON Schema (with an optional "
        "`default`, else null). Read as vars.NAME in expressions and ctx.vars in Python, set "
        "by `assign:`; every value is checked against its schema when assigned",
        json_schema_extra={"propertyNames": {"pattern": r"^[A-Za-z_][A-Za-z0-9_]*$"}},
    )
    initial: str
    states: dict[str, StateSpec]
    transitions: list[TransitionSpec]

    _path: str = PrivateAttr(default="<string>")
    _content_hash: str = PrivateAttr(default="")
    _text: str = PrivateAttr(default="")
    _locations: dict[tuple[Any, ...], SourceLocation] = PrivateAttr(default_factory=dict)
    _parents: dict[str, str] = PrivateAttr(default_factory=dict)
    _keys: dict[str, tuple[Any, ...]] = PrivateAttr(default_factory=dict)
    _twins: list[tuple[str, tuple[Any, ...]]] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _flatten(self) -> WorkflowSpec:
        """Put every state, at any depth, in `states` by its id (ids are unique across the
        workflow, as in SCXML), parents before their children: what the rest of fsm-kernel
        reads. The tree as written stays in each compound state's own `states`; `parent()`
        says where each state sits. A second state with an id already taken is left out and
        kept in `_twins` (with the keys of its place in the file) for validate to report."""
        flat: dict[str, StateSpec] = {}

        def walk(states: dict[str, StateSpec], keys: tuple[Any, ...], parent: str | None) -> None:
            for sid, state in states.items():
                where = (*keys, sid)
                if sid in flat:
                    self._twins.append((sid, where))
                    continue
                flat[sid] = state
                self._keys[sid] = where
                if parent is not None:
                    self._parents[sid] = parent
                if state.states is not None:
                    walk(state.states, (*where, "states"), sid)

        walk(dict(self.states), ("states",), None)
        self.states.clear()
        self.states.update(flat)
        return self

    @model_validator(mode="after")
    def _mark_child_routing(self) -> WorkflowSpec:
        """Tell each state whether its edges route on its children's outcome."""
        routed = {
            t.source for t in self.transitions if CHILD_GUARDS.intersection((*t.guard, *t.unless))
        }
        for sid, state in self.states.items():
            state._routes_children = sid in routed
        return self

    @property
    def path(self) -> str:
        return self._path

    @property
    def content_hash(self) -> str:
        """sha256 of the file's bytes: resume refuses a changed workflow."""
        return self._content_hash

    @property
    def text(self) -> str:
        """The file's text as loaded ("" when built in Python): run.started records it."""
        return self._text

    def location(self, *keys: Any) -> SourceLocation | None:
        """Where the node at `keys` (e.g. "transitions", 3, "target") is in the file; a nested
        state is found by its id alone ("states", "think", "action")."""
        if len(keys) > 1 and keys[0] == "states" and keys[1] in self._keys:
            keys = (*self._keys[keys[1]], *keys[2:])
        for n in range(len(keys), -1, -1):
            loc = self._locations.get(tuple(keys[:n]))
            if loc is not None:
                return loc
        return None

    def is_success(self, reason: str) -> bool:
        """Whether a run that ends for `reason` succeeded (exit code 0): `final_answer`, `done`,
        or a reason the workflow declares with `success: true`."""
        if reason in TERMINATION_REASONS:
            return reason in SUCCESS_REASONS
        declared = self.reasons.get(reason)
        return declared is not None and declared.success

    def success_reasons(self) -> frozenset[str]:
        """Every reason a run of this workflow succeeds for."""
        return SUCCESS_REASONS | {name for name in self.reasons if self.is_success(name)}

    @property
    def tool_names(self) -> list[str]:
        """The names (or references) in `tools:`, in order."""
        return [t.name for t in self.tools]

    def final_states(self) -> list[str]:
        """The top-level final states: the ones that end a run (a final child of a compound
        state only completes its parent)."""
        return [sid for sid, s in self.states.items() if s.final and sid not in self._parents]

    def twins(self) -> list[tuple[str, SourceLocation | None]]:
        """States declared with an id already taken (left out of `states`), with where."""
        return [(sid, self._locations.get((*keys, "<key>"))) for sid, keys in self._twins]

    def parent(self, sid: str) -> str | None:
        """The compound state `sid` is a child of; None at the top level."""
        return self._parents.get(sid)

    def ancestors(self, sid: str) -> list[str]:
        """The compound states `sid` is inside, outermost first."""
        out: list[str] = []
        here = self._parents.get(sid)
        while here is not None:
            out.insert(0, here)
            here = self._parents.get(here)
        return out

    def state_path(self, sid: str) -> str:
        """`sid` with the compound states it is inside: research.think."""
        return ".".join([*self.ancestors(sid), sid])

    @property
    def has_compound(self) -> bool:
        """Some state has children (`initial:` and `states:`)."""
        return bool(self._parents)

    def ends_run(self, sid: str) -> bool:
        """A top-level final state: entering it ends the run."""
        return self.states[sid].final and sid not in self._parents

    def entry(self, sid: str) -> str:
        """The state a run is in once it enters `sid`: `sid`, or for a compound state its
        initial child's entry (a run is always in a state without children)."""
        state = self.states[sid]
        while state.states is not None and state.initial in self.states:
            sid = state.initial
            state = self.states[sid]
        return sid

    def inside(self, sid: str, compound: str) -> bool:
        """`sid` is `compound` or a state at any depth inside it."""
        return sid == compound or compound in self.ancestors(sid)

    def transitions_from(self, source: str) -> list[tuple[int, TransitionSpec]]:
        return [(i, t) for i, t in enumerate(self.transitions) if t.source == source]

    def transition_triples(self) -> set[tuple[str, str, str]]:
        """(source, target, guard label) for every declared transition."""
        return {(t.source, t.target, t.label()) for t in self.transitions}

    def catch_edges(self) -> list[CatchEdge]:
        """Every state's `catch:` entries as edges, numbered after the declared transitions."""
        edges: list[CatchEdge] = []
        for sid, state in self.states.items():
            for position, entry in enumerate(state.catch):
                index = len(self.transitions) + len(edges)
                edges.append(CatchEdge(index, sid, position, entry))
        return edges

    def edge_reasons(self) -> list[str]:
        """The termination reasons the declared transitions and `catch:` entries end runs
        with, in file order, each once."""
        named = [t.reason for t in self.transitions if t.reason]
        named += [c.reason for c in self.catch_edges() if c.reason]
        return list(dict.fromkeys(str(r) for r in named))

    def catch_edge(self, index: int) -> CatchEdge | None:
        """The catch edge numbered `index`, or None (a declared transition, or no such edge)."""
        position = index - len(self.transitions)
        if position < 0:
            return None
        edges = self.catch_edges()
        return edges[position] if position < len(edges) else None
