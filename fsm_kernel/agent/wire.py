"""Conversion between protocol types and the OpenAI chat-completions JSON, smoothing over the
quirks of compatible servers (Ollama, vLLM, llama.cpp, LM Studio, ...). Pure: no I/O, no httpx.
Imports only fsm_kernel.protocol and fsm_kernel.errors.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable, Sequence
from typing import Any

from fsm_kernel.errors import AgentResponseError
from fsm_kernel.protocol import TOOL_CHOICES, Completion, Message, Role, Tool, ToolCall, Usage

__all__ = [
    "completion_from_wire",
    "message_from_wire",
    "messages_from_wire",
    "messages_to_wire",
    "new_call_id",
    "tool_choice_to_wire",
    "tools_to_wire",
]

IdFactory = Callable[[], str]

_ID_ALPHABET = string.ascii_letters + string.digits
_FINISH_REASONS: dict[str, str] = {
    "stop": "stop",
    "end_turn": "stop",  # LiteLLM-proxied Gemini
    "eos": "stop",
    "stop_sequence": "stop",
    "tool_calls": "tool_calls",
    "function_call": "tool_calls",  # the deprecated single-call API
    "tool": "tool_calls",  # old llama.cpp docs
    "tool_use": "tool_calls",
    "length": "length",
    "max_tokens": "length",
    "content_filter": "content_filter",
    "refusal": "content_filter",
}
_TERMINAL_REASONS = frozenset({"length", "content_filter", "error"})
_THINK_BLOCK = re.compile(r"<think>(.*?)</think>", re.DOTALL)
_LEAKED_CALL_MARKUP = re.compile(r"(?:<tool_call>|<function=).*\Z", re.DOTALL)
_REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")


def new_call_id() -> str:
    """A fresh tool-call id: 9 characters of [A-Za-z0-9], the one format every server accepts
    (Mistral templates reject anything else)."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))


# --- protocol -> wire ---------------------------------------------------------------------------


def messages_to_wire(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The `messages` array of a chat-completions request.

    Reasoning is never sent back. An assistant message with tool calls carries `content: ""`
    rather than null, which Ollama rejects (pydantic-ai#5206).
    """
    return [_message_to_wire(m) for m in messages]


def _message_to_wire(message: Message) -> dict[str, Any]:
    wire: dict[str, Any] = {"role": message.role.value, "content": message.content or ""}
    if message.role is Role.ASSISTANT and message.tool_calls:
        wire["tool_calls"] = [_tool_call_to_wire(tc) for tc in message.tool_calls]
    if message.role is Role.TOOL:
        wire["tool_call_id"] = message.tool_call_id or ""
        if message.name:
            wire["name"] = message.name
    return wire


def _tool_call_to_wire(call: ToolCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments_json()},
    }


def tools_to_wire(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """The `tools` array of a chat-completions request."""
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description,
                "parameters": t.parameters,
            },
        }
        for t in tools
    ]


def tool_choice_to_wire(choice: str) -> str | dict[str, Any]:
    """The `tool_choice` of a request: a keyword as it is, a tool's name as the object that
    forces that tool (`omit` is the caller's business: it sends no field at all)."""
    if choice in TOOL_CHOICES:
        return choice
    return {"type": "function", "function": {"name": choice}}


# --- wire -> protocol ---------------------------------------------------------------------------


def completion_from_wire(body: Any, *, id_factory: IdFactory = new_call_id) -> Completion:
    """Normalise a chat-completions response body into a Completion.

    Tolerates: arguments as a JSON string, an object or ""; arguments that are not JSON (kept in
    `raw_arguments` with `arguments_error` set); missing, empty or duplicate call ids
    (synthesised); null content; null or unknown finish reasons; reasoning in a
    `reasoning`/`reasoning_content`/`thinking` field or in `<think>` blocks; no usage.

    Raises:
        AgentResponseError: the body is not a JSON object with a usable `choices[0].message`.
    """
    choice = _first_choice(body)
    message = message_from_wire(choice["message"], id_factory=id_factory)
    refusal = choice["message"].get("refusal")
    if isinstance(refusal, str) and refusal and not message.tool_calls:
        if not message.content:
            message = Message(role=Role.ASSISTANT, content=refusal, reasoning=message.reasoning)
        finish = "content_filter"
    else:
        finish = _finish_reason(choice.get("finish_reason"), has_calls=bool(message.tool_calls))
    model = body.get("model")
    return Completion(
        message=message,
        finish_reason=finish,
        usage=_usage_from_wire(body.get("usage")),
        model=model if isinstance(model, str) else "",
    )


def _first_choice(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise AgentResponseError(f"response is a JSON {type(body).__name__}, not an object")
    if "error" in body and not body.get("choices"):
        raise AgentResponseError(f"response carries an error: {_one_line(body['error'])}")
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices:
        raise AgentResponseError("response has no choices")
    choice = choices[0]
    if not isinstance(choice, dict) or not isinstance(choice.get("message"), dict):
        raise AgentResponseError("response has no choices[0].message object")
    return choice


def _one_line(value: Any, limit: int = 200) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    if isinstance(value, dict) and isinstance(value.get("message"), str):
        text = value["message"]
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _finish_reason(raw: Any, *, has_calls: bool) -> str:
    if not isinstance(raw, str) or not raw:
        return "tool_calls" if has_calls else "stop"
    reason = raw.strip().lower()
    mapped = _FINISH_REASONS.get(reason, "unknown")
    if reason in _TERMINAL_REASONS:
        return mapped
    if has_calls:
        # vLLM 0.7.3 and SGLang say "stop" for tool turns: the calls decide (llm-servers.md §5.1).
        return "tool_calls"
    # "tool_calls" with no calls left after normalisation: a plain answer.
    return "stop" if mapped == "tool_calls" else mapped


def _usage_from_wire(raw: Any) -> Usage:
    if not isinstance(raw, dict):
        return Usage()
    prompt = _count(raw.get("prompt_tokens"))
    completion = _count(raw.get("completion_tokens"))
    total = _count(raw.get("total_tokens")) or prompt + completion
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=total)


def _count(value: Any) -> int:
    if isinstance(value, bool):
        return 0
    if isinstance(value, int | float):
        return max(int(value), 0)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return 0


def messages_from_wire(
    wire: Sequence[Any], *, id_factory: IdFactory = new_call_id
) -> list[Message]:
    """Parse a request's `messages` array back into Messages (tests, replays, fakes).

    Raises:
        AgentResponseError: an entry is not an object or has an unknown role.
    """
    return [message_from_wire(m, id_factory=id_factory) for m in wire]


def message_from_wire(wire: Any, *, id_factory: IdFactory = new_call_id) -> Message:
    """Normalise one wire message (a request entry or a response's `choices[0].message`)."""
    if not isinstance(wire, dict):
        raise AgentResponseError(f"message is a JSON {type(wire).__name__}, not an object")
    role = _role(wire.get("role", "assistant"))
    content, think = _split_reasoning(_content_text(wire.get("content")))
    tool_calls = _tool_calls_from_wire(wire.get("tool_calls"), id_factory)
    if tool_calls:
        content = _LEAKED_CALL_MARKUP.sub("", content).rstrip()
    reasoning = _join_reasoning([_reasoning_field(wire), think])
    tool_call_id = wire.get("tool_call_id")
    name = wire.get("name") or wire.get("tool_name")  # Ollama native says tool_name
    return Message(
        role=role,
        content=content,
        tool_calls=tool_calls,
        tool_call_id=str(tool_call_id) if tool_call_id is not None else None,
        name=name if isinstance(name, str) and role is Role.TOOL else None,
        reasoning=reasoning,
    )


def _role(raw: Any) -> Role:
    if raw == "developer":  # OpenAI's newer name for the system role
        return Role.SYSTEM
    try:
        return Role(raw)
    except ValueError:
        raise AgentResponseError(f"message has unknown role {raw!r}") from None


def _content_text(raw: Any) -> str:
    """Content may be null, absent, a string or a list of parts; always give a string."""
    if raw is None:
        return ""
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        parts = [
            p if isinstance(p, str) else p.get("text") for p in raw if isinstance(p, str | dict)
        ]
        return "".join(p for p in parts if isinstance(p, str))
    return str(raw)


def _reasoning_field(wire: dict[str, Any]) -> str | None:
    # vLLM moved reasoning_content -> reasoning; Ollama /v1 says reasoning, native says thinking.
    for key in _REASONING_FIELDS:
        value = wire.get(key)
        if isinstance(value, str) and value.strip():
            return value
    return None


def _split_reasoning(content: str) -> tuple[str, str | None]:
    """Move `<think>…</think>` text out of the content.

    Also handles a missing opening tag (DeepSeek-R1 / Qwen3 "thinking forced open" output that
    starts inside the block) and an unclosed block (output cut off while thinking).
    """
    if "<think>" not in content and "</think>" not in content:
        return content, None
    found: list[str] = []
    head, sep, tail = content.partition("</think>")
    if sep and "<think>" not in head:
        found.append(head)
        content = tail
    found.extend(_THINK_BLOCK.findall(content))
    content = _THINK_BLOCK.sub("", content)
    head, sep, tail = content.partition("<think>")
    if sep:
        found.append(tail)
        content = head
    return content.strip(), _join_reasoning(found)


def _join_reasoning(parts: Sequence[str | None]) -> str | None:
    kept = [p.strip() for p in parts if p and p.strip()]
    return "\n\n".join(kept) if kept else None


def _tool_calls_from_wire(raw: Any, id_factory: IdFactory) -> tuple[ToolCall, ...]:
    if raw is None:
        return ()
    if isinstance(raw, dict):
        raw = [raw]
    if not isinstance(raw, list):
        raise AgentResponseError(f"tool_calls is a JSON {type(raw).__name__}, not a list")
    calls: list[ToolCall] = []
    used: set[str] = set()
    for entry in raw:
        call_id = _unique_id(entry.get("id") if isinstance(entry, dict) else None, used, id_factory)
        used.add(call_id)
        calls.append(_tool_call_from_wire(entry, call_id))
    return tuple(calls)


def _unique_id(raw: Any, used: set[str], id_factory: IdFactory) -> str:
    """The server's id when it is usable, else a fresh one (missing, "", null or duplicate ids
    come from llama.cpp, Gemini, LM Studio and old Ollama)."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        raw = str(raw)
    if isinstance(raw, str) and raw.strip() and raw not in used:
        return raw
    for _ in range(100):
        candidate = id_factory()
        if candidate not in used:
            return candidate
    raise AgentResponseError("could not synthesise a unique tool-call id")


def _tool_call_from_wire(entry: Any, call_id: str) -> ToolCall:
    if not isinstance(entry, dict):
        raw = json.dumps(entry, ensure_ascii=False)
        error = f"the tool call is a JSON {_json_type(entry)}, not an object"
        return ToolCall(id=call_id, name="", raw_arguments=raw, arguments_error=error)
    # Stale llama.cpp docs show calls without the `function` wrapper.
    fn = entry.get("function") if isinstance(entry.get("function"), dict) else entry
    name = fn.get("name")
    name = name.strip() if isinstance(name, str) else ""
    # Some models say `parameters` (Ollama PR #12413).
    raw_args = fn["arguments"] if "arguments" in fn else fn.get("parameters")
    arguments, raw, error = _parse_arguments(raw_args)
    if not name and error is None:
        raw = raw_args if isinstance(raw_args, str) else _canonical_json(arguments)
        error = "the tool call has no name"
    return ToolCall(
        id=call_id, name=name, arguments=arguments, raw_arguments=raw, arguments_error=error
    )


def _parse_arguments(raw: Any) -> tuple[dict[str, Any], str | None, str | None]:
    """(arguments, raw_arguments, arguments_error). Never raises."""
    if raw is None:
        return {}, None, None
    if isinstance(raw, dict):  # llama.cpp #20198, Ollama native
        return raw, None, None
    if not isinstance(raw, str):
        return {}, _canonical_json(raw), f"arguments are a JSON {_json_type(raw)}, not an object"
    if not raw.strip():
        return {}, None, None
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError as exc:
        return {}, raw, f"arguments are not valid JSON: {exc.msg} at position {exc.pos}"
    if parsed is None:
        return {}, None, None
    if not isinstance(parsed, dict):
        return {}, raw, f"arguments are a JSON {_json_type(parsed)}, not an object"
    return parsed, None, None


def _canonical_json(value: Any) -> str:
    # The same form as ToolCall.arguments_json(), so a parsed call survives a round trip.
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)
