"""Keeping a run's requests inside the model's context window (a workflow's `context:`).

Pure functions of the conversation: the request sent to the model is the conversation made to
fit, the session itself is never changed, so a resume or a replay (which rebuild the same
conversation) send the same requests. The kernel records what was shortened or dropped as a
`context.trimmed` event.

The window is a hard limit (a server rejects a prompt over its context, or silently cuts it):
when the strategy cannot make the request fit (the turns it keeps whole are over the window by
themselves), `_cut_to_fit` shortens what is left, the latest tool results included, each with a
note of how much was cut, then drops even the latest turns.

Token counts are estimates: 4 characters a token, plus 4 tokens a message (its role and
framing), plus the tool calls' names and arguments. When the server reported the prompt tokens
of the previous request, the estimate is scaled by how far off it was then."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fsm_kernel.protocol import Message, Role
from fsm_kernel.workflow.spec import ContextSpec

__all__ = ["Fitted", "Summary", "estimate_tokens", "fit", "summarized", "to_condense"]

_CHARS_PER_TOKEN = 4
_PER_MESSAGE = 4
_SHORTENED_CHARS = 200
"""What a shortened tool result keeps of its text."""
_CUT_NOTE = "[cut {cut} of {total} characters to fit the context window]"
"""Ends a message the window shortened as a last resort."""


def estimate_tokens(messages: Sequence[Message]) -> int:
    """The documented estimate of a request's prompt tokens (see the module's text)."""
    total = 0
    for m in messages:
        chars = len(m.content or "")
        for call in m.tool_calls:
            chars += len(call.name) + len(json.dumps(call.arguments, ensure_ascii=False))
        total += _PER_MESSAGE + math.ceil(chars / _CHARS_PER_TOKEN)
    return total


@dataclass(frozen=True)
class Fitted:
    """A request made to fit, and what was done to it."""

    messages: list[Message]
    before: int
    after: int
    shortened: list[str] = field(default_factory=list)
    """Tool call ids whose results were shortened."""
    dropped: int = 0
    """Messages left out."""
    cut: int = 0
    """Messages other than tool results shortened to fit (the last resort)."""

    @property
    def changed(self) -> bool:
        return bool(self.shortened or self.dropped or self.cut)

    def to_dict(self, strategy: str) -> dict[str, Any]:
        data: dict[str, Any] = {
            "strategy": strategy,
            "estimated_tokens_before": self.before,
            "estimated_tokens_after": self.after,
            "shortened_tool_results": self.shortened,
            "dropped_messages": self.dropped,
        }
        if self.cut:
            data["cut_messages"] = self.cut
        return data


def fit(messages: list[Message], spec: ContextSpec, scale: float = 1.0) -> Fitted:
    """`messages` (system prompt first, if any) made to fit `spec.max_tokens` by its strategy;
    as they are when they fit already, or when the strategy can do no more."""

    def size(ms: Sequence[Message]) -> int:
        return math.ceil(estimate_tokens(ms) * scale)

    before = size(messages)
    if before <= spec.max_tokens:
        return Fitted(messages, before, before)
    shortened: list[str] = []
    out = messages
    if spec.strategy == "truncate_tool_results":
        out, shortened = _shorten(messages, spec, size)
        if size(out) <= spec.max_tokens:
            return Fitted(out, before, size(out), shortened=shortened)
    # drop_oldest, or shortening was not enough: the oldest turns go
    out, dropped = _drop_oldest(out, spec, size)
    if size(out) <= spec.max_tokens:
        return Fitted(out, before, size(out), shortened=shortened, dropped=dropped)
    out, ids, more, cut = _cut_to_fit(out, spec, scale)
    shortened += [i for i in ids if i not in shortened]
    return Fitted(out, before, size(out), shortened, dropped + more, cut)


def _cut_to_fit(
    messages: list[Message], spec: ContextSpec, scale: float
) -> tuple[list[Message], list[str], int, int]:
    """The last resort, when what the strategy keeps is over the window by itself: shorten the
    tool results (oldest first, the latest too), then the other messages after the goal, each
    to what the window leaves it; then drop turns, the latest too; then shorten the goal and
    the system prompt. Returns the messages, the tool call ids shortened, the messages dropped
    and the others shortened."""
    head = _split(messages)[0]
    after_goal = range(len(head), len(messages))
    tools = [i for i in after_goal if messages[i].role is Role.TOOL]
    others = [i for i in after_goal if messages[i].role is not Role.TOOL]
    out, cut = _cut_in_order(messages, [*tools, *others], spec, scale)
    ids = [out[i].tool_call_id or "" for i in cut if out[i].role is Role.TOOL]
    changed = len(cut) - len(ids)
    dropped = 0
    if _over(out, spec, scale) > 0:
        out, dropped = _drop_oldest(
            out, spec.model_copy(update={"keep": 0}), lambda ms: _size(ms, scale)
        )
        goal_first = range(len(head) - 1, -1, -1)
        out, cut = _cut_in_order(out, goal_first, spec, scale)
        changed += len(cut)
    return out, ids, dropped, changed


def _size(messages: Sequence[Message], scale: float) -> int:
    return math.ceil(estimate_tokens(messages) * scale)


def _over(messages: Sequence[Message], spec: ContextSpec, scale: float) -> int:
    """By how many (scaled) tokens `messages` are over the window."""
    return _size(messages, scale) - spec.max_tokens


def _cut_in_order(
    messages: list[Message], order: Sequence[int], spec: ContextSpec, scale: float
) -> tuple[list[Message], list[int]]:
    """`messages` with those at `order` shortened, in that order, until they fit: each loses
    what the window needs of it (keeping its start), ending with a note of how much was cut.
    Linear: the estimate is kept up to date message by message."""
    out = list(messages)
    raw = estimate_tokens(out)
    cut: list[int] = []
    for i in order:
        over = math.ceil(raw * scale) - spec.max_tokens
        if over <= 0:
            break
        shorter = _cut(out[i], over, scale)
        if shorter is not None:
            raw += estimate_tokens([shorter]) - estimate_tokens([out[i]])
            out[i] = shorter
            cut.append(i)
    return out, cut


def _cut(message: Message, over: int, scale: float) -> Message | None:
    """`message` with enough of its text cut to save `over` scaled tokens (all of it, if that
    is not enough), or None when cutting would not make it shorter."""
    text = message.content or ""
    note = _CUT_NOTE.format(cut=len(text), total=len(text))  # the longest it can be
    drop = _CHARS_PER_TOKEN * (math.ceil(over / scale) + 2) + len(note) + 1
    keep = max(len(text) - drop, 0)
    note = _CUT_NOTE.format(cut=len(text) - keep, total=len(text))
    shorter = f"{text[:keep]}\n{note}" if keep else note
    if len(shorter) >= len(text):
        return None
    return replace(message, content=shorter)


def _shorten(
    messages: list[Message], spec: ContextSpec, size: Any
) -> tuple[list[Message], list[str]]:
    """Shorten the oldest tool results first, the last `keep` whole: to their first 200
    characters, then (when that is not enough) to a note of their length."""
    out = list(messages)
    tools = [i for i, m in enumerate(out) if m.role is Role.TOOL]
    candidates = tools[: max(len(tools) - spec.keep, 0)]
    shortened: list[str] = []
    total = size(out)
    for keep_chars in (_SHORTENED_CHARS, 0):
        for i in candidates:
            if total <= spec.max_tokens:
                return out, shortened
            m = out[i]
            original = messages[i].content
            if len(m.content) <= keep_chars or (keep_chars and m.content != original):
                continue
            text = f"{original[:keep_chars]} [shortened: {len(original)} chars]".lstrip()
            out[i] = replace(m, content=text)
            if m.tool_call_id not in shortened:
                shortened.append(m.tool_call_id or "")
            total = size(out)
    return out, shortened


def _drop_oldest(
    messages: list[Message], spec: ContextSpec, size: Any
) -> tuple[list[Message], int]:
    """Keep the system prompt, the goal (the first user message) and the last `keep` turns;
    drop whole turns, oldest first (a reply with tool calls goes with its results)."""
    head = [m for m in messages[:1] if m.role is Role.SYSTEM]
    rest = messages[len(head) :]
    goal_at = next((i for i, m in enumerate(rest) if m.role is Role.USER), None)
    if goal_at is None:
        return messages, 0
    head += rest[: goal_at + 1]
    turns = _turns(rest[goal_at + 1 :])
    dropped = 0
    while len(turns) > spec.keep and size(head + [m for t in turns for m in t]) > spec.max_tokens:
        dropped += len(turns.pop(0))
    return head + [m for t in turns for m in t], dropped


@dataclass(frozen=True)
class Summary:
    """What the `summarize` strategy condensed so far: the first `covered` messages after the
    goal, replaced by `text`."""

    covered: int
    text: str

    def message(self) -> Message:
        return Message.user(f"A summary of the earlier conversation:\n{self.text}")


def _split(messages: list[Message]) -> tuple[list[Message], list[Message]]:
    """(the system prompt and the goal, the rest)."""
    head = [m for m in messages[:1] if m.role is Role.SYSTEM]
    rest = messages[len(head) :]
    goal_at = next((i for i, m in enumerate(rest) if m.role is Role.USER), None)
    if goal_at is None:
        return head, rest
    return head + rest[: goal_at + 1], rest[goal_at + 1 :]


def summarized(messages: list[Message], summary: Summary | None) -> list[Message]:
    """The request with the part `summary` covers replaced by it."""
    if summary is None:
        return messages
    head, rest = _split(messages)
    return [*head, summary.message(), *rest[summary.covered :]]


def to_condense(
    messages: list[Message], spec: ContextSpec, summary: Summary | None, scale: float = 1.0
) -> list[Message]:
    """The messages the next summary must take in (after what `summary` covers, all but the
    last `spec.keep` turns); none while the request fits or only the latest turns are left."""
    request = summarized(messages, summary)
    if math.ceil(estimate_tokens(request) * scale) <= spec.max_tokens:
        return []
    _, rest = _split(messages)
    turns = _turns(rest[summary.covered if summary else 0 :])
    old = turns[: max(len(turns) - spec.keep, 0)]
    return [m for t in old for m in t]


def _turns(messages: Sequence[Message]) -> list[list[Message]]:
    """Messages grouped so that tool results stay with the reply that asked for them."""
    turns: list[list[Message]] = []
    for m in messages:
        if m.role is Role.TOOL and turns:
            turns[-1].append(m)
        else:
            turns.append([m])
    return turns
