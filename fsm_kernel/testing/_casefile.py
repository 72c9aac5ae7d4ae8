"""Workflow test files (`*.test.yaml`): their shape, and loading one with every mistake reported
at its `file:line:col`.

```yaml
workflow: default                    # a stock name or a path relative to this file
cases:
  answers_after_a_tool:
    prompt: What time is it?
    model:                           # the model's replies, in order; the last one repeats
      - tool_calls: [{name: datetime, arguments: {}}]
      - text: It is noon.
    tools:                           # per tool, its results by attempt; the last one repeats
      datetime: [{return: "12:00 UTC"}]
    expect:
      reason: final_answer
      path: [observe, think, act, evaluate, observe, think, terminate]
      response_contains: noon
```
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fsm_kernel.errors import WorkflowError, WorkflowValidationError
from fsm_kernel.workflow.loader import Locations, parse_yaml_with_locations, pydantic_errors
from fsm_kernel.workflow.spec import SourceLocation

__all__ = [
    "AnswerSpec",
    "CaseSpec",
    "ChildSpec",
    "ExpectSpec",
    "ReplySpec",
    "TestFile",
    "ToolResultSpec",
    "load_test_file",
]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class CallSpec(_Model):
    """One tool call in a scripted reply."""

    name: str
    arguments: dict[str, Any] | str = Field(
        default_factory=dict,
        description="The call's arguments; a string is sent as the raw arguments text (a "
        "string that is not JSON makes the reply malformed)",
    )


class ReplySpec(_Model):
    """One reply of the model: text, tool calls, or both."""

    text: str | None = None
    tool_calls: list[CallSpec] | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = Field(
        default=None, description="`length`: the reply was cut off by the model's token limit"
    )

    @model_validator(mode="after")
    def _something(self) -> ReplySpec:
        if self.text is None and not self.tool_calls:
            raise ValueError("a reply needs `text:` or `tool_calls:`")
        return self


class ToolResultSpec(_Model):
    """One scripted result of a tool: what it returns, or its error."""

    returns: Any = Field(default=None, alias="return")
    error: str | None = None
    fatal: bool = Field(default=False, description="An error the run cannot recover from")

    @model_validator(mode="after")
    def _one(self) -> ToolResultSpec:
        given = "return" in self.model_fields_set or "returns" in self.model_fields_set
        if given == (self.error is not None):
            raise ValueError("a tool result is `return: VALUE` or `error: MESSAGE`")
        if self.fatal and self.error is None:
            raise ValueError("`fatal: true` goes with `error:`")
        return self


class AnswerSpec(_Model):
    """What a person or the outside world answers when the run asks: one key of approve,
    reject, input, event (with `data:`) or timer."""

    approve: Literal[True] | None = None
    reject: str | None = Field(default=None, description="Rejected, with the reason")
    input: str | None = None
    event: str | None = Field(default=None, description="The named event delivered")
    data: Any = Field(default=None, description="The event's JSON data")
    timer: int | str | None = Field(
        default=None,
        description="The timer that fires: the index of its `after:` edge, or its duration as "
        "written (`30m`)",
    )
    by: str = "test"

    @model_validator(mode="after")
    def _one(self) -> AnswerSpec:
        given = [k for k in ("approve", "reject", "input", "event", "timer") if getattr(self, k)]
        if self.timer == 0:
            given.append("timer")
        if len(given) != 1:
            raise ValueError("an answer is one of approve, reject, input, event or timer")
        if self.data is not None and self.event is None:
            raise ValueError("`data:` goes with `event:`")
        return self


class ChildSpec(_Model):
    """How a child run (workflow.call / workflow.map) ends, without running it."""

    ok: bool = True
    reason: str | None = None
    answer: str = ""
    output: Any = None
    iterations: int = Field(
        default=0, ge=0, description="The model calls it made (they count for the caller)"
    )


class ExpectSpec(_Model):
    """What the case checks; every key is optional."""

    reason: str | None = None
    status: Literal["ended", "waiting"] | None = None
    path: list[str] | None = Field(
        default=None,
        description="The states the run was in, in order, ending with the final one: leaf ids "
        "(think) or full paths (research.think)",
    )
    response: str | None = None
    response_contains: str | None = None
    output: Any = None
    vars: dict[str, Any] | None = None
    iterations: int | None = Field(default=None, ge=0)
    waiting_for: str | None = Field(
        default=None, description="What a waiting run waits for: approval, input or event"
    )


class CaseSpec(_Model):
    """One scripted run and what it must do."""

    description: str = ""
    prompt: str
    model: list[ReplySpec] = Field(default_factory=list)
    tools: dict[str, list[ToolResultSpec]] = Field(default_factory=dict)
    answers: list[AnswerSpec] = Field(default_factory=list)
    children: list[ChildSpec] | None = Field(
        default=None,
        description="How the child runs end, in the order they start (default: they run, "
        "asking the same scripted model)",
    )
    limits: dict[str, Any] = Field(default_factory=dict)
    expect: ExpectSpec


class TestFile(_Model):
    """A whole test file."""

    __test__ = False  # not a pytest test class

    workflow: str
    cases: dict[str, CaseSpec]


@dataclass(frozen=True)
class LoadedTests:
    """A test file as loaded: its cases, where each is, and the workflow they test."""

    path: Path
    spec: TestFile
    workflow: Path | str
    """The workflow file (a path relative to the test file resolved), or a stock name."""
    locations: Locations

    def where(self, case: str) -> SourceLocation | str:
        return self.locations.get(("cases", case, "<key>")) or str(self.path)


def load_test_file(path: str | Path) -> LoadedTests:
    """Parse and check a test file.

    Raises:
        WorkflowSyntaxError: not YAML.
        WorkflowValidationError: not a test file; the first mistake in file order, every one
            in `errors`, each at its `file:line:col`.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkflowValidationError(f"{p}: cannot read: {exc}") from None
    data, locs = parse_yaml_with_locations(text, str(p))
    if not isinstance(data, dict):
        where = locs.get((), SourceLocation(str(p), 1, 1))
        raise WorkflowValidationError("a test file is a mapping: workflow, cases", location=where)
    try:
        spec = TestFile.model_validate(data)
    except ValidationError as exc:
        errors: list[WorkflowError] = pydantic_errors(exc, locs, str(p))
        first = errors[0]
        raise WorkflowValidationError(
            first.message, location=first.location, errors=errors
        ) from None
    beside = p.parent / spec.workflow
    workflow: Path | str = beside if beside.is_file() else spec.workflow
    return LoadedTests(p, spec, workflow, locs)
