"""The conversation a run keeps: the Session Protocol and the thread-safe InMemorySession.
Imports only protocol from fsm_kernel; the kernel consumes protocol.Message natively.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NoReturn, Protocol, overload, runtime_checkable

from fsm_kernel.protocol import Message, ToolCall, new_id

__all__ = ["FrozenDict", "FrozenList", "History", "InMemorySession", "Session"]


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
        """A copy of the history, oldest first; changing it leaves the session alone (the
        in-memory session shares its frozen messages, whose tool-call arguments refuse
        changes)."""
        ...

    def clear(self) -> None:
        """Forget every message; the id stays."""
        ...

    def __len__(self) -> int: ...


class InMemorySession:
    """A Session held in process memory; safe to share between threads.

    Messages are stored once, detached from the caller's objects, and shared from then on:
    Message and ToolCall are frozen and each stored call's arguments are frozen copies (a dict
    and lists that refuse changes), so `messages()` is a list of the stored messages that no
    reader can change. Adding copies a call's arguments once; reading copies only the list,
    and `history()` not even that.
    """

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
            return self._messages.copy()

    def history(self, head: Sequence[Message] = ()) -> History:
        """The history as it is now, after `head`, without copying it: what the kernel hands
        the model each call, in constant time however long the conversation. Later changes to
        the session do not show in it (messages are only ever appended to the list it reads;
        `clear` starts a new one)."""
        with self._lock:
            return History(tuple(head), self._messages, len(self._messages))

    def clear(self) -> None:
        with self._lock:
            self._messages = []  # a new list: the histories handed out keep theirs whole

    def __len__(self) -> int:
        with self._lock:
            return len(self._messages)

    def __repr__(self) -> str:
        return f"InMemorySession(id={self._id!r}, messages={len(self)})"


class History(Sequence[Message]):
    """An unchangeable snapshot of a conversation: `head` (a system prompt, say) followed by
    the first `end` messages of a list that is only ever appended to. Made in constant time
    (`InMemorySession.history`); reads like a tuple of its messages (index, slice, iterate,
    `==` with a list or tuple of the same messages)."""

    __slots__ = ("_body", "_end", "_head")

    def __init__(self, head: tuple[Message, ...], body: list[Message], end: int) -> None:
        self._head = head
        self._body = body
        self._end = end

    def __len__(self) -> int:
        return len(self._head) + self._end

    @overload
    def __getitem__(self, index: int) -> Message: ...
    @overload
    def __getitem__(self, index: slice) -> list[Message]: ...
    def __getitem__(self, index: int | slice) -> Message | list[Message]:
        if isinstance(index, slice):
            return list(self)[index]
        size = len(self)
        if index < 0:
            index += size
        if not 0 <= index < size:
            raise IndexError("history index out of range")
        first = len(self._head)
        return self._head[index] if index < first else self._body[index - first]

    def __iter__(self) -> Iterator[Message]:
        return itertools.chain(self._head, itertools.islice(self._body, self._end))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, History | list | tuple):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which have none

    def __repr__(self) -> str:
        return f"History({list(self)!r})"


def _detached(message: Message) -> Message:
    """`message` sharing no mutable state with the original, and giving none to its readers.

    Message and ToolCall are frozen and tool_calls is a tuple, but ToolCall.arguments is a dict:
    each call gets a frozen deep copy of its arguments, so neither the caller who added it nor
    anyone reading the session can change a stored call's arguments in place. A message whose
    calls are frozen already (one read from this or another session) is kept as it is.
    """
    if not message.tool_calls or all(type(c.arguments) is FrozenDict for c in message.tool_calls):
        return message
    calls = tuple(_frozen_call(c) for c in message.tool_calls)
    return dataclasses.replace(message, tool_calls=calls)


def _frozen_call(call: ToolCall) -> ToolCall:
    if type(call.arguments) is FrozenDict:
        return call
    return dataclasses.replace(call, arguments=FrozenDict(call.arguments))


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return FrozenDict(value)
    if isinstance(value, list):
        return FrozenList(value)
    if isinstance(value, tuple):
        return tuple(_freeze(v) for v in value)
    return value


def _refuse(self: object, *args: object, **kwargs: object) -> NoReturn:
    raise TypeError(f"a stored tool call's arguments cannot be changed ({type(self).__name__})")


class FrozenDict(dict[str, Any]):
    """A dict that refuses changes, its dict and list values frozen too (a deep copy of the
    mapping it is made from). Still a dict: `json.dumps`, `==` and `isinstance(x, dict)` work as
    for a plain one; `dict(frozen)` or `frozen.copy()` gives a plain, changeable copy."""

    __slots__ = ()

    def __init__(self, source: Mapping[str, Any] = (), /) -> None:  # type: ignore[assignment]
        super().__init__((k, _freeze(v)) for k, v in dict(source).items())

    def __reduce__(self) -> tuple[Any, ...]:  # copy, deepcopy and pickle rebuild it whole
        return (type(self), (dict(self),))

    __setitem__ = __delitem__ = __ior__ = _refuse
    clear = pop = popitem = setdefault = update = _refuse


class FrozenList(list[Any]):
    """A list that refuses changes, its dict and list items frozen too (see FrozenDict)."""

    __slots__ = ()

    def __init__(self, source: Iterable[Any] = (), /) -> None:
        super().__init__(_freeze(v) for v in source)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (list(self),))

    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse
    append = clear = extend = insert = pop = remove = reverse = sort = _refuse
