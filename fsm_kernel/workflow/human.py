"""A person in the loop: the questions a run asks (approve a tool call, give some input), the
answers, and the channels that carry them.

A run asks through its `HumanChannel` (a per-run collaborator, `RunServices.human`). A channel
either answers now (a person at a terminal) or raises `Suspended`: then the kernel records
`run.suspended` with the question and the run stops, not over, until `fsm-kernel resume
--approve/--reject/--input` (or `Agent.resume(..., answer=...)`) re-drives it from its log with
the answer. Every answer is recorded as a `human.answered` event, so a re-drive serves the
recorded answers first (`AnsweringChannel`) and never asks the same question twice.

An approval is bound to the call it answers: its id and `arguments_digest` of the arguments the
person was shown. A re-drive gives an approval (or a rejection) only to a question about that
very call, so a log changed after the question was shown cannot make a person's "yes" run
other arguments.
"""

from __future__ import annotations

import asyncio
import dataclasses
import getpass
import hashlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from fsm_kernel.errors import AnswerError
from fsm_kernel.protocol import ToolCall
from fsm_kernel.redact import encodable, find_lone_surrogate, redact_data

__all__ = [
    "AnsweringChannel",
    "HumanAnswer",
    "HumanChannel",
    "OffTheClock",
    "Question",
    "Suspended",
    "SuspendingChannel",
    "arguments_digest",
    "default_by",
    "kind_text",
]

logger = logging.getLogger(__name__)

Kind = Literal["approval", "input", "event"]


def arguments_digest(arguments: Mapping[str, Any]) -> str:
    """The sha256 of a call's arguments as a person is shown them (redacted, as every way out
    shows them; canonical JSON: sorted keys), which an approval records to name what it
    approves."""
    shown = json.dumps(redact_data(dict(arguments)), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(shown.encode()).hexdigest()


@dataclass(frozen=True, kw_only=True)
class Question:
    """What a run waits for: approval of one tool call, text from a person, or (a waiting
    state) one of its named events or its earliest timer."""

    kind: Kind
    state: str
    tool_call: ToolCall | None = None
    """The call to approve (approval only)."""
    prompt: str | None = None
    """The question shown to the person (input only)."""
    child_run_id: str | None = None
    """The child run that asks (the parent waits with it; resume the parent to answer)."""
    events: tuple[str, ...] = ()
    """The events a waiting state awaits (event only)."""
    due: str | None = None
    """When its earliest timer is due, ISO 8601 UTC (event only; None without a timer)."""

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
        if self.kind == "event":
            d["events"] = list(self.events)
            d["due"] = self.due
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
        child, due = d.get("child_run_id"), d.get("due")
        return cls(
            kind=_kind(d.get("kind")),
            state=str(d.get("state") or ""),
            tool_call=tool_call,
            prompt=d.get("prompt"),
            child_run_id=str(child) if child else None,
            events=tuple(str(e) for e in d.get("events") or ()),
            due=str(due) if due else None,
        )


def _kind(value: object) -> Kind:
    return "input" if value == "input" else "event" if value == "event" else "approval"


def default_by() -> str:
    """Who answers when nobody says: the USER environment variable (else the login name)."""
    user = os.environ.get("USER")
    if user:
        return encodable(user)  # undecodable bytes in the environment read as surrogates
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
    tool_call_id: str | None = None
    """approval: the id of the call it answers; None until bound (see `bound_to`)."""
    arguments_sha256: str | None = None
    """approval: `arguments_digest` of the arguments it answers; None until bound."""
    event: str | None = None
    """event: the name of the event delivered (None for a timer that fired)."""
    data: Any = None
    """event: the event's data (JSON), for guards and templates (`ctx.event`)."""
    timer: int | None = None
    """event: the index of the `after:` edge whose timer fired (None for a named event)."""

    def __post_init__(self) -> None:
        """Refuse text no store can record (a lone surrogate), before anything is recorded."""
        if self.data is not None:
            at = find_lone_surrogate(json.dumps(self.data, ensure_ascii=False))
            if at >= 0:
                raise AnswerError("the event's data is not valid text: it holds a lone surrogate")
        for name in ("text", "by"):
            value = getattr(self, name)
            at = find_lone_surrogate(value)
            if at >= 0:
                raise AnswerError(
                    f"the answer's {name} is not valid text: it holds {value[at]!a} at character "
                    f"{at}, a lone surrogate, which UTF-8 cannot encode"
                )

    @classmethod
    def approve(
        cls, *, by: str | None = None, call: ToolCall | Mapping[str, Any] | None = None
    ) -> HumanAnswer:
        """Approve the call a run waits for; `call` (a ToolCall, or `waiting_for["tool_call"]`
        as the person saw it) binds the approval to that call: resume refuses it if the run
        now asks about another one."""
        answer = cls(kind="approval", approved=True, by=by or default_by())
        return answer if call is None else answer.bound_to(call)

    @classmethod
    def reject(
        cls,
        reason: str = "",
        *,
        by: str | None = None,
        call: ToolCall | Mapping[str, Any] | None = None,
    ) -> HumanAnswer:
        """Reject the call a run waits for (`call`: as for `approve`)."""
        answer = cls(kind="approval", approved=False, text=reason, by=by or default_by())
        return answer if call is None else answer.bound_to(call)

    @classmethod
    def input(cls, text: str, *, by: str | None = None) -> HumanAnswer:
        return cls(kind="input", text=text, by=by or default_by())

    @classmethod
    def signal(cls, name: str, data: Any = None, *, by: str | None = None) -> HumanAnswer:
        """Deliver the event `name` (with its JSON `data`) to a run in a waiting state."""
        return cls(kind="event", event=name, data=data, by=by or default_by())

    @classmethod
    def timer_fired(cls, edge: int) -> HumanAnswer:
        """The timer of the `after:` edge `edge` fired (the kernel's answer, not a person's)."""
        return cls(kind="event", timer=edge, by="timer")

    @property
    def flag(self) -> str:
        """How the CLI gives this answer (for messages)."""
        if self.kind == "input":
            return "--input"
        if self.kind == "event":
            return f"signal {self.event}" if self.event is not None else "a timer"
        return "--approve" if self.approved else "--reject"

    def bound_to(self, call: ToolCall | Mapping[str, Any]) -> HumanAnswer:
        """This approval bound to `call` (its id and arguments); an answer already bound, or
        one that is no approval, is returned as it is."""
        if self.kind != "approval" or self.tool_call_id is not None:
            return self
        call_id, arguments = _id_and_arguments(call)
        return dataclasses.replace(
            self, tool_call_id=call_id, arguments_sha256=arguments_digest(arguments)
        )

    def answers(self, call: ToolCall | Mapping[str, Any]) -> bool:
        """Whether this answer may be given to a question about `call`: it is bound to no call,
        or to this one (the same id and arguments)."""
        call_id, arguments = _id_and_arguments(call)
        if self.tool_call_id is not None and self.tool_call_id != call_id:
            return False
        digest = self.arguments_sha256
        return digest is None or digest == arguments_digest(arguments)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind, "by": self.by}
        if self.kind == "approval":
            d["approved"] = self.approved
            if not self.approved:
                d["reason"] = self.text
            if self.tool_call_id is not None:
                d["tool_call_id"] = self.tool_call_id
            if self.arguments_sha256 is not None:
                d["arguments_sha256"] = self.arguments_sha256
        elif self.kind == "event":
            if self.timer is not None:
                d["timer"] = self.timer
            else:
                d["name"], d["data"] = self.event, self.data
        else:
            d["text"] = self.text
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HumanAnswer:
        kind = _kind(d.get("kind"))
        if kind == "event":
            timer = d.get("timer")
            if timer is not None:
                return cls.timer_fired(int(timer))
            return cls.signal(str(d.get("name")), d.get("data"), by=str(d.get("by") or "unknown"))
        text = d.get("text") if kind == "input" else d.get("reason")
        call_id, digest = d.get("tool_call_id"), d.get("arguments_sha256")
        return cls(
            kind=kind,
            approved=bool(d.get("approved", False)),
            text=str(text or ""),
            by=str(d.get("by") or "unknown"),
            tool_call_id=str(call_id) if call_id is not None and kind == "approval" else None,
            arguments_sha256=str(digest) if digest is not None and kind == "approval" else None,
        )


def _id_and_arguments(call: ToolCall | Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    if isinstance(call, ToolCall):
        return call.id, call.arguments
    arguments = call.get("arguments")
    return str(call.get("id")), arguments if isinstance(arguments, Mapping) else {}


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
        """The next recorded answer, else the given one, else the live channel's. An approval
        bound to another call than the one asked about is not given: the question goes to the
        live channel (which suspends the run again, so it waits for the call it now asks)."""
        if self._recorded and _fits(self._recorded[0], question):
            self.served += 1
            return self._recorded.pop(0)
        if self._recorded:  # the log was changed: a recorded "yes" is for another call
            self._recorded.clear()
        elif self._given is not None:
            given, self._given = self._given, None
            if given.kind != question.kind:
                raise AnswerError(f"the run waits for {kind_text(question.kind)}, not {given.flag}")
            if _fits(given, question):
                return given
        return await self.live.ask(question)


def _fits(answer: HumanAnswer, question: Question) -> bool:
    """Whether `answer` may answer `question`: an approval bound to another call may not."""
    call = question.tool_call
    if answer.kind != "approval" or call is None or answer.answers(call):
        return True
    logger.warning(
        "an answer for tool call %s is not given to a question about call %s (%s): its "
        "arguments or id differ from those the person was shown",
        answer.tool_call_id,
        call.id,
        call.name,
    )
    return False


def kind_text(kind: str) -> str:
    """How to answer a question of `kind` (for messages)."""
    if kind == "event":
        return "an event (fsm-kernel signal RUN_ID NAME)"
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
            answer = await self.channel.ask(question)
        finally:
            if deadline is not None and when is not None:
                deadline.reschedule(when + loop.time() - started)
        call = question.tool_call
        if call is None:
            return answer
        if not _fits(answer, question):
            raise AnswerError(
                f"an answer for tool call {answer.tool_call_id} was given to a question about "
                f"call {call.id} ({call.name}): its arguments or id differ"
            )
        return answer.bound_to(call)  # recorded so: a re-drive gives it to this call only
