"""Reply shorthands for fake chat models: `call(...)`, `calls(...)`, `bad_call(...)`, text replies,
and `as_completion`, which turns any of them into a Completion. Pure: no model, no kernel.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from fsm_kernel.protocol import Completion, Message, Role, ToolCall, Usage

__all__ = [
    "ReplyLike",
    "as_completion",
    "bad_call",
    "call",
    "calls",
    "text_reply",
    "tool_call",
]

ReplyLike = Completion | Message | str
"""What a fake model may answer: a Completion, an assistant Message, or a str (a text answer)."""

_call_ids = itertools.count(1)


def tool_call(
    name: str, arguments: Mapping[str, Any] | None = None, *, id: str | None = None
) -> ToolCall:
    """One tool call (an id like `call_7` is made up when none is given)."""
    return ToolCall(id=id or f"call_{next(_call_ids)}", name=name, arguments=dict(arguments or {}))


def text_reply(
    content: str, *, reasoning: str | None = None, usage: Usage | None = None
) -> Completion:
    """A plain answer (what a bare str in a script means)."""
    message = Message(role=Role.ASSISTANT, content=content, reasoning=reasoning)
    return Completion(message=message, finish_reason="stop", usage=usage or Usage())


def call(
    name: str,
    arguments: Mapping[str, Any] | None = None,
    *,
    id: str | None = None,
    content: str = "",
) -> Completion:
    """A reply asking for one tool call: `call("read_file", {"path": "a.txt"})`."""
    return calls(tool_call(name, arguments, id=id), content=content)


def calls(
    *items: ToolCall | Completion | tuple[str, Mapping[str, Any]], content: str = ""
) -> Completion:
    """A reply asking for several tool calls at once (parallel calls).

    Each item is a ToolCall, a `call(...)` reply (its calls are taken) or a `(name, arguments)`
    pair: `calls(("datetime", {}), call("read_file", {"path": "a.txt"}))`.
    """
    tool_calls: list[ToolCall] = []
    for item in items:
        if isinstance(item, ToolCall):
            tool_calls.append(item)
        elif isinstance(item, Completion):
            tool_calls.extend(item.message.tool_calls)
        elif isinstance(item, tuple) and len(item) == 2:
            tool_calls.append(tool_call(item[0], item[1]))
        else:
            raise TypeError(f"calls() takes ToolCall, call(...) or (name, arguments), not {item!r}")
    message = Message.assistant(content, tool_calls)
    return Completion(message=message, finish_reason="tool_calls")


def bad_call(name: str, raw_arguments: str = "{not json", *, id: str | None = None) -> Completion:
    """A reply whose tool call has arguments that are not JSON: `agent.think` flags it as
    malformed output (what a model server's broken tool call turns into)."""
    broken = ToolCall(
        id=id or f"call_{next(_call_ids)}",
        name=name,
        raw_arguments=raw_arguments,
        arguments_error="Expecting property name enclosed in double quotes",
    )
    return Completion(message=Message.assistant("", [broken]), finish_reason="tool_calls")


def as_completion(item: ReplyLike) -> Completion:
    """A Completion from any reply shorthand (TypeError for anything else)."""
    if isinstance(item, Completion):
        return item
    if isinstance(item, str):
        return text_reply(item)
    if isinstance(item, Message):
        finish = "tool_calls" if item.tool_calls else "stop"
        return Completion(message=item, finish_reason=finish)
    raise TypeError(
        f"a reply must be a Completion, an assistant Message or a str, not {type(item).__name__}"
    )
