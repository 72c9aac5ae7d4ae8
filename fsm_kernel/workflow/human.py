"""A person in the loop: the questions a run asks (approve a tool call, give some input), the
answers, and the channels that carry them.

A run asks through its `HumanChannel` (a per-run collaborator, `RunServices.human`). A channel
either answers now (a person at a terminal) or raises `Suspended`: then the kernel records
`run.suspended` with the question and the run stops, not over, until `fsm-kernel resume
--approve/--reject/--input` (or `Agent.resume(..., answer=...)`) re-drives it from its log with
the answer. Every answer is recorded as a `human.answered` event, so a re-drive serves the
recorded answers first (`AnsweringChannel`) and never asks the same question twice.
"""

from __future__ import annotations

import asyncio
import getpass
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from fsm_kernel.errors import AnswerError
from fsm_kernel.protocol import ToolCall

__all__ = [
    "AnsweringChannel",
    "HumanAnswer",
    "HumanChannel",
    "OffTheClock",
    "Question",
    "Suspended",
    "SuspendingChannel",
    "default_by",
    "kind_text",
]

Kind = Literal["approval", "input"]


@dataclass(frozen=True, kw_only=True)
class Question:
    """What a run waits for: approval of one tool call, or text from a person."""

    kind: Kind
    state: str
    tool_call: ToolCall | None = None
    """The call to approve (approval only)."""
    prompt: str | None = None
    """The question shown to the person (input only)."""
    child_run_id: str | None = None
    """The child run that asks (the parent waits with it; resume the parent to answer)."""

    def to_dict(self) -> dict[str, Any]:
        """The `waiting_for` object of `run.suspended`, `--json` and the Python result."""
        d: dict[str, Any] = {"kind": self.kind, "state": self.state}
        if self.tool_call is not None:
            d["tool_call"] = {
                "id": self.tool_call.id,
                "name": self.tool_call.name,
                "arguments": self.tool_call.arguments,
            }
        if self.prompt is not None:
            d["prompt"] = self.prompt
        if self.child_run_id is not None:
            d["child_run_id"] = self.child_run_id
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Question:
        """A question as `to_dict` wrote it (a run's `waiting_for`)."""
        call = d.get("tool_call")
        tool_call = None
        if isinstance(call, Mapping):
            tool_call = ToolCall(
                id=str(call.get("id")),
                name=str(call.get("name")),
                arguments=dict(call.get("arguments") or {}),
            )
        child = d.get("child_run_id")
        return cls(
            kind="input" if d.get("kind") == "input" else "approval",
            state=str(d.get("state") or ""),
            tool_call=tool_call,
            prompt=d.get("prompt"),
            child_run_id=str(child) if child else None,
        )


def default_by() -> str:
    """Who answers when nobody says: the USER environment variable (else the login name)."""
    user = os.environ.get("USER")
    if user:
        return user
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # no passwd entry in a container
        return "unknown"


@dataclass(frozen=True, kw_only=True)
class HumanAnswer:
    """A person's answer: approve or reject a tool call, or some text."""

    kind: Kind
    approved: bool = False
    """approval: whether the call may run."""
    text: str = ""
    """approval: why it was rejected (may be empty); input: the text."""
    by: str = field(default_factory=default_by)

    @classmethod
    def approve(cls, *, by: str | None = None) -> HumanAnswer:
        return cls(kind="approval", approved=True, by=by or default_by())

    @classmethod
    def reject(cls, reason: str = "", *, by: str | None = None) -> HumanAnswer:
        return cls(kind="approval", approved=False, text=reason, by=by or default_by())

    @classmethod
    def input(cls, text: str, *, by: str | None = None) -> HumanAnswer:
        return cls(kind="input", text=text, by=by or default_by())

    @property
    def flag(self) -> str:
        """How the CLI gives this answer (for messages)."""
        if self.kind == "input":
            return "--input"
        return "--approve" if self.approved else "--reject"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind, "by": self.by}
        if self.kind == "approval":
            d["approved"] = self.approved
            if not self.approved:
                d["reason"] = self.text
        else:
            d["text"] = self.text
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HumanAnswer:
        kind: Kind = "input" if d.get("kind") == "input" else "approval"
        text = d.get("text") if kind == "input" else d.get("reason")
        return cls(
            kind=kind,
            approved=bool(d.get("approved", False)),
            text=str(text or ""),
            by=str(d.get("by") or "unknown"),
        )


class Suspended(Exception):
    """Raised by a channel that cannot answer now: the run suspends until a person answers.

    Not an error of the run: recovery (`catch:`) and error handling must let it through."""

    def __init__(self, question: Question) -> None:
        super().__init__(f"waiting for {question.kind} in state {question.state!r}")
        self.question = question


@runtime_checkable
class HumanChannel(Protocol):
    """How a run reaches a person."""

    async def ask(self, question: Question) -> HumanAnswer:
        """The person's answer, or raise `Suspended` to wait for it in another process."""
        ...


class SuspendingChannel:
    """Nobody to ask now (no terminal, `--json`, the scheduler, the Python API): suspend."""

    async def ask(self, question: Question) -> HumanAnswer:
        raise Suspended(question)


class AnsweringChannel:
    """A re-driven run's channel: the recorded answers in order, then the answer given to
    `resume` (once), then `live` (which may suspend again)."""

    def __init__(
        self,
        recorded: Sequence[HumanAnswer],
        *,
        given: HumanAnswer | None = None,
        live: HumanChannel | None = None,
    ) -> None:
        self._recorded = list(recorded)
        self._given = given
        self.live: HumanChannel = live or SuspendingChannel()
        self.served = 0

    @property
    def given_used(self) -> bool:
        return self._given is None

    def take_given(self) -> HumanAnswer | None:
        """The answer given to `resume`, once (for a child run that waits: it takes it)."""
        given, self._given = self._given, None
        return given

    async def ask(self, question: Question) -> HumanAnswer:
        if self._recorded:
            self.served += 1
            return self._recorded.pop(0)
        if self._given is not None:
            given, self._given = self._given, None
            if given.kind != question.kind:
                raise AnswerError(f"the run waits for {kind_text(question.kind)}, not {given.flag}")
            return given
        return await self.live.ask(question)


def kind_text(kind: str) -> str:
    """How to answer a question of `kind` (for messages)."""
    return "approval (--approve or --reject)" if kind == "approval" else "input (--input)"


class OffTheClock:
    """A run's channel with the time spent waiting for a person taken off the run's clock
    (`limits.timeout_seconds` counts the run's own work, not a person's thinking)."""

    def __init__(self, channel: HumanChannel) -> None:
        self.channel = channel
        self.deadline: asyncio.Timeout | None = None
        """The run's deadline (the kernel sets it while it drives the run)."""

    def take_given(self) -> HumanAnswer | None:
        """The wrapped channel's unused resume answer, if it has one (see AnsweringChannel)."""
        take = getattr(self.channel, "take_given", None)
        return take() if callable(take) else None

    async def ask(self, question: Question) -> HumanAnswer:
        deadline, loop = self.deadline, asyncio.get_running_loop()
        when = deadline.when() if deadline is not None else None
        if deadline is not None:
            deadline.reschedule(None)  # no deadline while a person decides
        started = loop.time()
        try:
            return await self.channel.ask(question)
        finally:
            if deadline is not None and when is not None:
                deadline.reschedule(when + loop.time() - started)
