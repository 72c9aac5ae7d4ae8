"""Fake chat models for tests: ScriptedChatModel answers from a script, FunctionChatModel from a
function of the request; both record every request. No model server, no kernel.
"""

from __future__ import annotations

import inspect
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

from fsm_kernel.protocol import Completion, Message, ResponseFormat, Tool
from fsm_kernel.testing._replies import ReplyLike, as_completion
from fsm_kernel.workflow.human import HumanAnswer, Question, Suspended

__all__ = [
    "FunctionChatModel",
    "ModelFn",
    "ModelRequest",
    "ScriptExhaustedError",
    "ScriptItem",
    "ScriptedChatModel",
    "ScriptedHuman",
]

logger = logging.getLogger(__name__)

ScriptItem = ReplyLike | BaseException
"""A ScriptedChatModel's script item: a reply, or an exception instance to raise."""
ModelFn = Callable[[list[Message], list[Tool]], ReplyLike | Awaitable[ReplyLike]]


class ScriptExhaustedError(AssertionError):
    """A ScriptedChatModel was asked for more replies than its script holds."""


@dataclass(frozen=True)
class ModelRequest:
    """One call a fake model received."""

    messages: tuple[Message, ...]
    tools: tuple[Tool, ...]
    tool_choice: str | None = None
    """The state's `tool_choice:`, when it set one."""
    response_format: ResponseFormat | None = None
    """The state's output schema (`output:`), when it has one."""

    @property
    def tool_names(self) -> list[str]:
        return [t.name for t in self.tools]

    @property
    def last_message(self) -> Message | None:
        return self.messages[-1] if self.messages else None


class ScriptedChatModel:
    """A ChatModel answering from a script, in order; it records every request.

    Script items: a str (a text answer), `call(...)` / `calls(...)` (tool calls), a Completion
    or assistant Message, or an exception instance, which is raised (e.g.
    `AgentConnectionError("down")` ends a run as `agent_error`)::

        model = ScriptedChatModel([call("datetime"), "It is Monday."])
        ...
        assert model.requests[1].last_message.role == "tool"
        model.assert_complete()

    Asked once more than scripted, it raises ScriptExhaustedError (an AssertionError) and keeps
    it in `failure`; `WorkflowHarness.run` raises it again so the test fails with that message.
    """

    def __init__(self, replies: Iterable[ScriptItem] = ()) -> None:
        self._script: deque[Completion | BaseException] = deque()
        self.requests: list[ModelRequest] = []
        self.failure: ScriptExhaustedError | None = None
        """Set when the script ran out (inside a run the kernel turns the raise into an `error`
        termination; `WorkflowHarness.run` raises it again)."""
        self.add(*replies)

    def add(self, *replies: ScriptItem) -> None:
        """Append replies to the script."""
        for item in replies:
            self._script.append(item if isinstance(item, BaseException) else as_completion(item))

    @property
    def remaining(self) -> int:
        """Replies not used yet."""
        return len(self._script)

    async def complete(
        self,
        messages: Sequence[Message],
        tools: Sequence[Tool],
        *,
        tool_choice: str | None = None,
        response_format: ResponseFormat | None = None,
    ) -> Completion:
        self.requests.append(
            ModelRequest(tuple(messages), tuple(tools), tool_choice, response_format)
        )
        if not self._script:
            self.failure = ScriptExhaustedError(self._exhausted_message())
            logger.warning("scripted model: %s", self.failure)
            raise self.failure
        item = self._script.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    def _exhausted_message(self) -> str:
        used = len(self.requests) - 1
        last = self.requests[-1].last_message
        preview = (
            f"; the last message was {last.role.value}: {last.content[:120]!r}" if last else ""
        )
        return (
            f"the scripted model got request #{used + 1} but only {used} reply(ies) were "
            f"scripted{preview}"
        )

    def assert_complete(self) -> None:
        """AssertionError if scripted replies were never requested."""
        __tracebackhide__ = True
        if self._script:
            raise AssertionError(
                f"{len(self._script)} scripted reply(ies) never requested "
                f"(the model was asked {len(self.requests)} time(s))"
            )


class FunctionChatModel:
    """A ChatModel whose replies a function builds from the request: for answers that depend
    on the conversation. `fn(messages, tools)` returns a reply shorthand (str, Completion, ...)
    and may be async; what it raises propagates like a model error::

        def echo(messages, tools):
            return f"you said: {messages[-1].content}"

        harness.run("hello", model=FunctionChatModel(echo))
    """

    def __init__(self, fn: ModelFn) -> None:
        self._fn = fn
        self.requests: list[ModelRequest] = []
        self.failure: AssertionError | None = None
        """The first AssertionError `fn` raised (a failed check inside the model function would
        otherwise only end the run as `error`; `WorkflowHarness.run` raises it again)."""

    async def complete(
        self,
        messages: Sequence[Message],
        tools: Sequence[Tool],
        *,
        tool_choice: str | None = None,
        response_format: ResponseFormat | None = None,
    ) -> Completion:
        self.requests.append(
            ModelRequest(tuple(messages), tuple(tools), tool_choice, response_format)
        )
        try:
            result = self._fn(list(messages), list(tools))
            if inspect.isawaitable(result):
                result = await result
        except AssertionError as exc:
            self.failure = self.failure or exc
            raise
        return as_completion(result)


class ScriptedHuman:
    """A person who answers from a script, in order, and records each question asked; once
    the script is used up, the run suspends (as with nobody to ask)."""

    def __init__(self, answers: Iterable[HumanAnswer]) -> None:
        self._answers = deque(answers)
        self.questions: list[Question] = []

    async def ask(self, question: Question) -> HumanAnswer:
        self.questions.append(question)
        if not self._answers:
            raise Suspended(question)
        return self._answers.popleft()
