"""The conversation a run keeps: the Session Protocol and the thread-safe InMemorySession.
Imports only protocol from fsm_kernel; the kernel consumes protocol.Message natively.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from fsm_kernel.protocol import Message, ToolCall, new_id

__all__ = ["InMemorySession", "Session"]


@runtime_checkable
class Session(Protocol):
    """An ordered message history with a stable id."""

    @property
    def id(self) -> str: ...

    def add(self, message: Message) -> None:
        """Append one message."""
        ...

    def extend(self, messages: Iterable[Message]) -> None:
        """Append several messages, in order, as one step."""
        ...

    def messages(self) -> list[Message]:
        """A copy of the history, oldest first; changing it leaves the session alone."""
        ...

    def clear(self) -> None:
        """Forget every message; the id stays."""
        ...

    def __len__(self) -> int: ...


class InMemorySession:
    """A Session held in process memory; safe to share between threads."""

    def __init__(self, id: str | None = None, messages: Iterable[Message] = ()) -> None:
        self._id = id or new_id()
        self._lock = threading.RLock()
        self._messages: list[Message] = [_detached(m) for m in messages]

    @property
    def id(self) -> str:
        return self._id

    def add(self, message: Message) -> None:
        message = _detached(message)
        with self._lock:
            self._messages.append(message)

    def extend(self, messages: Iterable[Message]) -> None:
        batch = [_detached(m) for m in messages]  # consume a generator outside the lock
        with self._lock:
            self._messages.extend(batch)

    def messages(self) -> list[Message]:
        with self._lock:
            snapshot = list(self._messages)
        return [_detached(m) for m in snapshot]

    def clear(self) -> None:
        with self._lock:
            self._messages.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._messages)

    def __repr__(self) -> str:
        return f"InMemorySession(id={self._id!r}, messages={len(self)})"


def _detached(message: Message) -> Message:
    """`message` sharing no mutable state with the original.

    Message and ToolCall are frozen and tool_calls is a tuple, but ToolCall.arguments is a dict:
    without copying it, a caller could change a stored call's arguments in place.
    """
    if not message.tool_calls:
        return message
    return dataclasses.replace(message, tool_calls=tuple(_copy_call(c) for c in message.tool_calls))


def _copy_call(call: ToolCall) -> ToolCall:
    return dataclasses.replace(call, arguments=copy.deepcopy(call.arguments))
