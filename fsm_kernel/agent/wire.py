"""Conversion between protocol types and the OpenAI chat-completions JSON, smoothing over the
quirks of compatible servers (Ollama, vLLM, llama.cpp, LM Studio, ...), streamed answers
(server-sent events) included. Pure: no I/O, no httpx. Imports only fsm_kernel.protocol,
fsm_kernel.errors and fsm_kernel.redact.

Whatever a server sends is read within bounds (`loads_json`): JSON nested deeper than Python
can walk is cut, not a RecursionError, and a tool call's arguments nested deeper than
MAX_JSON_DEPTH are malformed output, fed back to the model like arguments that are not JSON.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fsm_kernel.errors import AgentResponseError
from fsm_kernel.protocol import (
    MAX_JSON_DEPTH,
    TOO_DEEP,
    TOOL_CHOICES,
    Completion,
    Message,
    ResponseFormat,
    Role,
    Tool,
    ToolCall,
    Usage,
    nests_deeper,
)
from fsm_kernel.redact import encodable

__all__ = [
    "MAX_JSON_DEPTH",
    "SseDecoder",
    "SseEvent",
    "StreamAssembler",
    "StreamFormatError",
    "StreamServerError",
    "chunk_from_sse",
    "completion_from_wire",
    "loads_json",
    "message_from_wire",
    "messages_from_wire",
    "messages_to_wire",
    "messages_with_instructions",
    "new_call_id",
    "response_format_to_wire",
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


def response_format_to_wire(fmt: ResponseFormat) -> dict[str, Any]:
    """The `response_format` of a request that asks for JSON under a schema."""
    schema: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema}
    if fmt.strict:
        schema["strict"] = True
    return {"type": "json_schema", "json_schema": schema}


def messages_with_instructions(messages: Sequence[Message], text: str) -> list[Message]:
    """`messages` with `text` appended to the first system message (one is put first when there
    is none): chat templates that allow a single system message, at the start, accept it."""
    out = list(messages)
    for i, message in enumerate(out):
        if message.role is Role.SYSTEM:
            joined = f"{message.content}\n\n{text}" if message.content else text
            out[i] = Message.system(joined)
            return out
    return [Message.system(text), *out]


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
    if reason in _TERMINAL_REASONS or mapped in _TERMINAL_REASONS:  # aliases too: max_tokens
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
        problem = f"the tool call is a JSON {_json_type(entry)}, not an object"
        dumped = json.dumps(entry, ensure_ascii=False)
        return ToolCall(id=call_id, name="", raw_arguments=dumped, arguments_error=problem)
    # Stale llama.cpp docs show calls without the `function` wrapper.
    fn: dict[str, Any] = entry["function"] if isinstance(entry.get("function"), dict) else entry
    raw_name = fn.get("name")
    name = raw_name.strip() if isinstance(raw_name, str) else ""
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
    if isinstance(raw, dict):  # llama.cpp #20198, Ollama native (ToolCall checks its depth)
        return raw, None, None
    if not isinstance(raw, str):
        return {}, _canonical_json(raw), f"arguments are a JSON {_json_type(raw)}, not an object"
    if not raw.strip():
        return {}, None, None
    try:
        parsed = loads_json(raw)
    except json.JSONDecodeError as exc:
        return {}, raw, f"arguments are not valid JSON: {exc.msg} at position {exc.pos}"
    if parsed is None:
        return {}, None, None
    if not isinstance(parsed, dict):
        return {}, raw, f"arguments are a JSON {_json_type(parsed)}, not an object"
    if nests_deeper(parsed, MAX_JSON_DEPTH):
        return {}, raw, TOO_DEEP
    return parsed, None, None


def _canonical_json(value: Any) -> str:
    # The same form as ToolCall.arguments_json(), so a parsed call survives a round trip.
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    names: dict[type, str] = {str: "string", list: "array", dict: "object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


# --- JSON within bounds -------------------------------------------------------------------------

_READ_DEPTH = 200
"""How deep `loads_json` reads: a container nested deeper is read as null. A reply's envelope
(choices, message, tool_calls, function) takes 7 levels, so arguments cut here still nest past
MAX_JSON_DEPTH, and are malformed."""

_STRUCTURE = re.compile(r'["\[\]{}]')
_STRING_REST = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_SURROGATE_TEXT = re.compile(r"\\u[dD][89a-fA-F]|[\ud800-\udfff]")
_SURROGATE_BYTES = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def loads_json(text: str | bytes) -> Any:
    """`json.loads` for what a server sends: it never raises RecursionError (arrays and objects
    nested deeper than _READ_DEPTH are read as null, whatever their size) and gives no lone
    surrogate (an escape such as `\\ud800` alone reads as U+FFFD), so every string encodes.

    Raises:
        json.JSONDecodeError: not JSON.
        UnicodeDecodeError: bytes that are not text.
    """
    try:
        value = json.loads(text)
    except RecursionError:
        value = _loads_cut(text)
    else:
        if _opens(text) > _READ_DEPTH and nests_deeper(value, _READ_DEPTH):
            value = _loads_cut(text)  # read whole, but too deep for the walks that follow
    surrogate = _SURROGATE_BYTES if isinstance(text, bytes) else _SURROGATE_TEXT
    if surrogate.search(text):  # type: ignore[arg-type]  # the pattern matches the text's type
        value = _repaired(value)
    return value


def _opens(text: str | bytes) -> int:
    """How many arrays and objects `text` could open at most (a count at C speed)."""
    if isinstance(text, bytes):
        return text.count(b"[") + text.count(b"{")
    return text.count("[") + text.count("{")


def _loads_cut(text: str | bytes) -> Any:
    cut = _cut_deeper(text.decode("utf-8") if isinstance(text, bytes) else text, _READ_DEPTH)
    try:
        return json.loads(cut)
    except RecursionError:  # the caller's own stack is already deep
        raise json.JSONDecodeError("nested too deeply", cut, 0) from None


def _cut_deeper(text: str, limit: int) -> str:
    """`text` with each array or object opened deeper than `limit` replaced by null: one scan
    from bracket to bracket, stepping over strings. Text that is not JSON stays text that
    json.loads refuses (an unclosed string or container ends the scan)."""
    parts: list[str] = []
    depth, kept, pos = 0, 0, 0  # kept: where the text not yet copied begins
    while (found := _STRUCTURE.search(text, pos)) is not None:
        char, pos = found.group(), found.end()
        if char == '"':
            rest = _STRING_REST.match(text, pos)
            if rest is None:
                break
            pos = rest.end()
        elif char in "[{":
            depth += 1
            if depth == limit + 1:  # cut from here to its close
                parts.append(text[kept : found.start()])
                kept = -1
        else:
            depth -= 1
            if depth == limit and kept == -1:
                parts.append("null")
                kept = pos
    if kept >= 0:  # else it ended inside a cut container: not JSON, and stays so
        parts.append(text[kept:])
    return "".join(parts)


def _repaired(value: Any) -> Any:
    """A value just parsed, with lone surrogates replaced in each string and key (changed in
    place: it is nobody else's yet; no recursion)."""
    if isinstance(value, str):
        return encodable(value)
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            fixed = {encodable(k): _text_repaired(v) for k, v in item.items()}
            item.clear()
            item.update(fixed)
            stack.extend(v for v in fixed.values() if isinstance(v, dict | list))
        elif isinstance(item, list):
            item[:] = [_text_repaired(v) for v in item]
            stack.extend(v for v in item if isinstance(v, dict | list))
    return value


def _text_repaired(value: Any) -> Any:
    return encodable(value) if isinstance(value, str) else value


# --- streamed answers: server-sent events -> the body of an unstreamed answer -------------------

_LINE_END = re.compile(rb"\r\n|\r|\n")
_FIELD_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*\Z")
_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"
# Statuses that an in-stream error's `code`/`type` words stand for, checked in order.
_ERROR_WORDS: tuple[tuple[str, int], ...] = (
    ("insufficient_quota", 429),
    ("rate_limit", 429),
    ("invalid_api_key", 401),
    ("authentication", 401),
    ("permission", 403),
    ("not_found", 404),
    ("invalid_request", 400),
    ("bad_request", 400),
    ("tool_use_failed", 400),  # Groq
    ("context_length", 400),
)


class StreamFormatError(ValueError):
    """The answer is not server-sent events carrying chat-completion chunks: a line that is no
    SSE field, data that is not a JSON object, a chunk of the wrong shape."""


class StreamServerError(Exception):
    """A chunk reports an error instead of a delta (`data: {"error": ...}` while the HTTP status
    stays 200: OpenAI, Groq, vLLM). `body` is the chunk; `status` the HTTP status its code or
    type stands for (500 when it says nothing usable)."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(_one_line(body.get("error", body)))
        self.body = body
        self.status = _error_status(body.get("error", body))


def _error_status(error: Any) -> int:
    if not isinstance(error, dict):
        return 500
    for key in ("status", "status_code", "code"):  # llama.cpp and vLLM send an HTTP code
        value = error.get(key)
        if isinstance(value, str) and value.isdigit():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool) and 400 <= value < 600:
            return value
    words = f"{error.get('code') or ''} {error.get('type') or ''}".lower()
    return next((status for word, status in _ERROR_WORDS if word in words), 500)


@dataclass(frozen=True)
class SseEvent:
    """One server-sent event: its `data` lines joined by newlines, and its `event` name."""

    data: str
    event: str = "message"

    @property
    def is_done(self) -> bool:
        """OpenAI's end-of-stream marker, `data: [DONE]`."""
        return self.data.strip() == "[DONE]"


class SseDecoder:
    """Server-sent events from the bytes of a stream, fed in pieces as they arrive.

    Lines may end in LF, CRLF or CR (a CRLF split across two pieces included); comment lines
    (`: ping`) and the `id`/`retry` fields are skipped; the event still open when the stream ends
    is given by `close()`. A line that is no SSE field at all (NDJSON, an HTML page) raises
    StreamFormatError, where the SSE spec would skip it, so a server that answers in another
    format is caught.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._scanned = 0  # bytes of the buffer known to hold no line end
        self._data: list[str] = []
        self._event = ""
        self._first = True

    def feed(self, data: bytes) -> list[SseEvent]:
        """The events that `data` completes.

        Raises:
            StreamFormatError: a line is not UTF-8 or not an SSE field.
        """
        self._buffer += data
        return self._events(self._lines(final=False))

    def close(self) -> list[SseEvent]:
        """The events left when the stream ends (an unterminated last line or event)."""
        return self._events([*self._lines(final=True), ""])

    def _lines(self, *, final: bool) -> list[str]:
        buffer, lines, start = self._buffer, [], 0
        for match in _LINE_END.finditer(buffer, self._scanned):
            if match.group() == b"\r" and match.end() == len(buffer) and not final:
                break  # maybe the first half of a CRLF
            lines.append(self._decode(bytes(buffer[start : match.start()])))
            start = match.end()
        del buffer[:start]
        if final and buffer:
            lines.append(self._decode(bytes(buffer)))
            buffer.clear()
        self._scanned = max(len(buffer) - 1, 0)
        return lines

    def _decode(self, raw: bytes) -> str:
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise StreamFormatError("the stream is not UTF-8 text") from None
        if self._first:
            self._first = False
            line = line.removeprefix("\ufeff")
        return line

    def _events(self, lines: Sequence[str]) -> list[SseEvent]:
        events = [self._line(line) for line in lines]
        return [e for e in events if e is not None]

    def _line(self, line: str) -> SseEvent | None:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif not _FIELD_NAME.match(name):
            raise StreamFormatError(f"not a server-sent event line: {_one_line(line, 80)!r}")
        return None

    def _dispatch(self) -> SseEvent | None:
        data, event = self._data, self._event or "message"
        self._data, self._event = [], ""
        return SseEvent("\n".join(data), event) if data else None


def chunk_from_sse(event: SseEvent) -> dict[str, Any] | None:
    """The chunk an event carries; None for `[DONE]` and empty data. An `event: error` (Groq)
    gives an error chunk whatever its data.

    Raises:
        StreamFormatError: the data is not a JSON object.
    """
    data = event.data.strip()
    if not data or event.is_done:
        return None
    try:
        chunk = loads_json(data)
    except json.JSONDecodeError:
        if event.event == "error":
            return {"error": {"message": data}}
        raise StreamFormatError(f"an event's data is not JSON: {_one_line(data, 80)!r}") from None
    if event.event == "error" and not (isinstance(chunk, dict) and chunk.get("error")):
        return {"error": chunk}
    if not isinstance(chunk, dict):
        raise StreamFormatError(f"an event's data is a JSON {_json_type(chunk)}, not an object")
    return chunk


@dataclass
class _StreamedCall:
    """One tool call being assembled from deltas."""

    id: str | None = None
    name: str = ""
    parts: list[str] = field(default_factory=list)
    value: Any = None
    """Arguments sent whole as a JSON value (llama.cpp, Ollama), not as string fragments."""

    def add_arguments(self, raw: Any) -> None:
        if isinstance(raw, str):
            if raw or self.value is None:
                self.parts.append(raw)
                self.value = None
        elif raw is not None:
            self.parts.clear()
            self.value = raw

    @property
    def arguments(self) -> Any:
        return "".join(self.parts) if self.parts else self.value

    def is_complete(self) -> bool:
        """Whether the arguments so far are a whole JSON object (cheap test first)."""
        if self.value is not None:
            return True
        last = next((p for p in reversed(self.parts) if p.strip()), "")
        if not last.rstrip().endswith("}"):
            return False
        try:
            return isinstance(loads_json("".join(self.parts)), dict)
        except json.JSONDecodeError:
            return False

    def to_wire(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


class _ThinkFilter:
    """The part of streamed content to show: `<think>…</think>` blocks left out (a tag split
    across deltas included) and leading whitespace dropped, as `_split_reasoning` does."""

    def __init__(self) -> None:
        self._held = ""
        self._inside = False
        self._shown = False

    def feed(self, text: str) -> str:
        held, out = self._held + text, []
        while held:
            tag = _THINK_CLOSE if self._inside else _THINK_OPEN
            at = held.find(tag)
            if at < 0:
                keep = _partial_tag(held, tag)
                if not self._inside:
                    out.append(held[: len(held) - keep])
                held = held[len(held) - keep :]
                break
            if not self._inside:
                out.append(held[:at])
            held = held[at + len(tag) :]
            self._inside = not self._inside
        self._held = held
        return self._show("".join(out))

    def end(self) -> str:
        held, self._held = self._held, ""
        return "" if self._inside else self._show(held)

    def _show(self, text: str) -> str:
        if not self._shown:
            text = text.lstrip()
            self._shown = bool(text)
        return text


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def _stream_id(raw: Any) -> str | None:
    if isinstance(raw, int) and not isinstance(raw, bool):
        return str(raw)
    return raw if isinstance(raw, str) and raw.strip() else None


def _has_name(fn: dict[str, Any]) -> bool:
    name = fn.get("name")
    return isinstance(name, str) and bool(name.strip())


def _has_arguments(fn: dict[str, Any]) -> bool:
    raw = fn["arguments"] if "arguments" in fn else fn.get("parameters")
    return raw is not None and not (isinstance(raw, str) and not raw.strip())


class StreamAssembler:
    """The chunks of a streamed answer, in order, assembled into the body the same request would
    have got unstreamed: `completion_from_wire(assembler.body())` then normalises both alike.

    Absorbs the servers' streaming quirks (llm-servers.md §1.3, §4): argument fragments keyed
    by `index` with the id and name in the first only (OpenAI); whole calls in one delta, all at
    index 0 (Ollama #15457: a new id with a name starts a new call; so does a named delta with
    arguments after a complete call, for Ollama builds without ids) or with no index at all;
    missing ids (synthesised later); names resent with every fragment (vLLM #13078); arguments
    as a JSON object; `reasoning_content`/`reasoning`/`thinking` deltas; usage in a last chunk
    with empty `choices`, or none; a null finish reason at the end. Only the first choice counts.
    """

    def __init__(self) -> None:
        self._content: list[str] = []
        self._refusal: list[str] = []
        self._reasoning: dict[str, list[str]] = {}
        self._calls: list[_StreamedCall] = []
        self._by_index: dict[int, _StreamedCall] = {}
        self._by_id: dict[str, _StreamedCall] = {}
        self._finish: str | None = None
        self._top: dict[str, Any] = {}
        self._has_choice = False
        self._shown = _ThinkFilter()

    @property
    def finished(self) -> bool:
        """Whether a finish reason arrived (the answer is whole even if `[DONE]` never does)."""
        return self._finish is not None

    def add(self, chunk: Any) -> str:
        """Take the next chunk. Returns the answer text it adds, to show as it arrives: never
        reasoning, and not `<think>` blocks (text that may begin a tag is held back until the
        next chunk or `end()`).

        Raises:
            StreamServerError: the chunk reports an error.
            StreamFormatError: the chunk is not shaped like a chat-completion chunk.
        """
        if not isinstance(chunk, dict):
            raise StreamFormatError(f"a chunk is a JSON {_json_type(chunk)}, not an object")
        if chunk.get("error"):
            raise StreamServerError(chunk)
        self._take_top(chunk)
        choices = chunk.get("choices")
        if choices is None:
            return ""
        if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
            raise StreamFormatError("a chunk's choices are not a list of objects")
        return "".join(self._take_choice(c) for c in choices if c.get("index") in (0, None))

    def end(self) -> str:
        """The shown text still held back when the stream ends (a lone `<thi`, say)."""
        return self._shown.end()

    def body(self) -> dict[str, Any]:
        """A chat-completion body with what arrived so far (no choices if none did)."""
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self._content)}
        for key, parts in self._reasoning.items():
            message[key] = "".join(parts)
        if self._refusal:
            message["refusal"] = "".join(self._refusal)
        if self._calls:
            message["tool_calls"] = [c.to_wire() for c in self._calls]
        choice = {"index": 0, "message": message, "finish_reason": self._finish}
        choices = [choice] if self._has_choice else []
        return {"object": "chat.completion", **self._top, "choices": choices}

    def _take_top(self, chunk: dict[str, Any]) -> None:
        for key in ("id", "model"):
            if isinstance(chunk.get(key), str) and key not in self._top:
                self._top[key] = chunk[key]
        if isinstance(chunk.get("usage"), dict):  # null on every chunk but the last (OpenAI)
            self._top["usage"] = chunk["usage"]

    def _take_choice(self, choice: dict[str, Any]) -> str:
        self._has_choice = True
        reason = choice.get("finish_reason")
        if isinstance(reason, str) and reason:
            self._finish = reason
        delta = choice["delta"] if "delta" in choice else choice.get("message")
        if delta is None:
            return ""
        if not isinstance(delta, dict):
            raise StreamFormatError(f"a chunk's delta is a JSON {_json_type(delta)}")
        for key in _REASONING_FIELDS:
            value = delta.get(key)
            if isinstance(value, str) and value:
                self._reasoning.setdefault(key, []).append(value)
        if isinstance(delta.get("refusal"), str):
            self._refusal.append(delta["refusal"])
        self._take_calls(delta.get("tool_calls"))
        text = _content_text(delta.get("content"))
        self._content.append(text)
        return self._shown.feed(text)

    def _take_calls(self, raw: Any) -> None:
        if raw is None:
            return
        entries = [raw] if isinstance(raw, dict) else raw
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise StreamFormatError("a chunk's tool_calls are not a list of objects")
        for entry in entries:
            # Stale llama.cpp docs show calls without the `function` wrapper.
            fn = entry["function"] if isinstance(entry.get("function"), dict) else entry
            call = self._call_for(entry, fn)
            call_id = _stream_id(entry.get("id"))
            if call.id is None and call_id is not None:  # the first id given counts
                call.id = call_id
                self._by_id.setdefault(call_id, call)
            if _has_name(fn) and not call.name:  # set once: vLLM resends it with each fragment
                call.name = fn["name"].strip()
            call.add_arguments(fn["arguments"] if "arguments" in fn else fn.get("parameters"))

    def _call_for(self, entry: dict[str, Any], fn: dict[str, Any]) -> _StreamedCall:
        index = entry.get("index", fn.get("index"))  # Ollama native nests it in `function`
        call_id = _stream_id(entry.get("id"))
        if isinstance(index, int) and not isinstance(index, bool):
            current = self._by_index.get(index)
            if current is None or self._starts_new(current, call_id, fn):
                current = self._by_index[index] = self._new_call()
            return current
        if call_id is not None:  # no index (Ollama before 0.4.7, some proxies)
            return self._by_id.get(call_id) or self._new_call()
        if _has_name(fn) or not self._calls:
            return self._new_call()
        return self._calls[-1]  # an anonymous fragment continues the last call

    @staticmethod
    def _starts_new(current: _StreamedCall, call_id: str | None, fn: dict[str, Any]) -> bool:
        if not _has_name(fn):
            return False
        if call_id is not None and current.id is not None and call_id != current.id:
            return True
        return call_id is None and _has_arguments(fn) and current.is_complete()

    def _new_call(self) -> _StreamedCall:
        call = _StreamedCall()
        self._calls.append(call)
        return call
