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
    """One reply of the model: text (or `json:`, a value sent as its JSON text), tool calls,
    both; or `error:`, the model server failing instead of answering."""

    text: str | None = None
    json_value: Any = Field(default=None, alias="json")
    tool_calls: list[CallSpec] | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = Field(
        default=None, description="`length`: the reply was cut off by the model's token limit"
    )
    error: str | None = Field(
        default=None,
        description="The model server fails with this message instead of answering: with "
        "`status:` an HTTP error (5xx, 408, 409 and 429 are retried; others are not), without "
        "it the server could not be reached",
    )
    status: int | None = Field(default=None, ge=400, le=599)

    @model_validator(mode="after")
    def _something(self) -> ReplySpec:
        given = sum(
            (self.text is not None, "json_value" in self.model_fields_set, bool(self.tool_calls))
        )
        if self.error is not None:
            if given:
                raise ValueError("a reply is an answer or an `error:`, not both")
            return self
        if self.status is not None:
            raise ValueError("`status:` goes with `error:`")
        if not given:
            raise ValueError("a reply needs `text:`, `json:`, `tool_calls:` or `error:`")
        if self.text is not None and "json_value" in self.model_fields_set:
            raise ValueError("give `text:` or `json:`, not both")
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
    tools_called: list[str] | None = Field(
        default=None, description="The tools the run called, in order (each call once)"
    )
    error_contains: str | None = Field(default=None, description="Text the run's error holds")
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
    files: dict[str, str] = Field(
        default_factory=dict,
        description="Files to put in the scratch workspace the unscripted tools run in: "
        "relative path -> text",
    )
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
    where = locs.get((), SourceLocation(str(p), 1, 1))
    if not isinstance(data, dict):
        raise WorkflowValidationError("a test file is a mapping: workflow, cases", location=where)
    if "cases" not in data and "states" in data:  # a workflow given where its tests belong
        raise WorkflowValidationError(
            f"this is a workflow, not a test file (one with 'workflow:' and 'cases:'); "
            f"'fsm-kernel test --generate {p}' writes one for it",
            location=where,
        )
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
