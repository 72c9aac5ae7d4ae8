"""Settings and their layering: built-in defaults < workflow file < FSM_KERNEL_* environment <
command-line flags. Pure: reads the environment only when asked, no I/O at import time.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from fsm_kernel.errors import ConfigError

__all__ = [
    "DEFAULT_BASE_URL",
    "DEFAULT_MAX_RESPONSE_BYTES",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_MODEL",
    "DEFAULT_STORE",
    "MAX_RETRIES_LIMIT",
    "AgentSettings",
    "agent_settings_from_env",
    "default_store_location",
    "package_data_dir",
]

DEFAULT_BASE_URL = "http://localhost:11434/v1"
DEFAULT_MODEL = "qwen3"
DEFAULT_STORE = ".fsm-kernel/runs.db"
DEFAULT_MAX_RESPONSE_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_TOKENS = 4096
"""The cap on each model reply when the workflow sets none (`agent.max_tokens`), sent as the
request's `max_tokens`. Without a cap the server decides, and many decide "until the context is
full": against a real llama.cpp server a tiny model ran 3,856 tokens of repetition until its
4,096-token context was full, one reply taking minutes. 4,096 is far above any useful tool call
or answer of an agent step (a long one is a few hundred tokens) and within the output limit of
current hosted models (OpenAI's smallest is 4,096), while small enough to stop a runaway reply.
A reply that reaches it ends with finish_reason "length": the run ends `truncated` (or the reply
counts as malformed), so a cut is always visible. A server that refuses the default cap because
the prompt leaves less room than that in its context (vLLM, older OpenAI models) is asked
without it (see HttpChatModel)."""
MAX_RETRIES_LIMIT = 100
"""More retries than this is a typo, not a policy (with backoff capped at 8 s it is ~13 min)."""


@dataclass(frozen=True, kw_only=True)
class AgentSettings:
    """How to reach the model server.

    Every instance is validated when it is built (`__post_init__`), and `merged` builds a new
    one, so the workflow `agent:` block, the environment and the flags all go through the same
    checks: a bad value is a ConfigError before any request is made.
    """

    base_url: str = DEFAULT_BASE_URL
    model: str = DEFAULT_MODEL
    api_key: str | None = None
    """Sent as a Bearer token; never logged, printed or stored (see `public_dict`)."""
    request_timeout: float = 120.0
    """Deadline in seconds for one HTTP attempt, sending and reading the whole answer;
    0 means no limit."""
    connect_timeout: float = 10.0
    max_retries: int = 3
    """Retries after the first attempt, on connection errors, timeouts, 408/409/429 and 5xx."""
    temperature: float | None = None
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    """The most bytes one answer may have; a bigger one is refused, not read whole."""
    tool_choice: str = "auto"
    """Sent with every request that offers tools (see protocol.TOOL_CHOICES)."""
    stream: bool = True
    """Ask for the answer as server-sent events and hand its text on as it arrives; a server
    that streams badly is then asked without (see HttpChatModel)."""
    max_tokens: int | None = None
    """The most tokens one reply may have, sent to the server; None: DEFAULT_MAX_TOKENS (the
    HTTP client's; the in-process model keeps its own), 0: no cap is sent."""

    def __post_init__(self) -> None:
        _check_number(
            self.request_timeout,
            "request_timeout",
            minimum=0.0,
            what="request timeout must be a finite number of seconds >= 0, 0 for no limit",
        )
        _check_number(
            self.connect_timeout,
            "connect_timeout",
            minimum=0.0,
            inclusive=False,
            what="connect timeout must be a finite number of seconds > 0",
        )
        if self.temperature is not None:
            _check_number(
                self.temperature, "temperature", what="temperature must be a finite number"
            )
        _check_int(
            self.max_retries,
            "max_retries",
            minimum=0,
            maximum=MAX_RETRIES_LIMIT,
            what=f"max retries must be a whole number from 0 to {MAX_RETRIES_LIMIT}",
        )
        _check_int(
            self.max_response_bytes,
            "max_response_bytes",
            minimum=1,
            what="max response bytes must be a whole number of bytes > 0",
        )
        if self.max_tokens is not None:
            _check_int(
                self.max_tokens,
                "max_tokens",
                minimum=0,
                what="max tokens must be a whole number of tokens >= 0, 0 for no cap",
            )
        if not isinstance(self.stream, bool):  # "false" would be truthy: refuse, never guess
            raise _invalid("stream", "stream must be true or false", self.stream)

    def merged(self, overrides: Mapping[str, Any]) -> AgentSettings:
        """A copy with every non-None value of `overrides` applied.

        Raises:
            ConfigError: an unknown setting, or a value the checks of `__post_init__` refuse.
        """
        known = {f.name for f in fields(self)}
        unknown = set(overrides) - known
        if unknown:
            raise ConfigError(f"unknown agent setting(s): {', '.join(sorted(unknown))}")
        values = {k: v for k, v in overrides.items() if v is not None}
        return replace(self, **values)

    def public_dict(self) -> dict[str, Any]:
        """The settings with the secret removed, for logs and the event log."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["api_key"] = "***" if self.api_key else None
        return d

    def __repr__(self) -> str:  # never let the key reach a log through repr()
        inner = ", ".join(f"{k}={v!r}" for k, v in self.public_dict().items())
        return f"AgentSettings({inner})"


_WHERE_SET: Mapping[str, str] = {
    "request_timeout": (
        "--request-timeout, FSM_KERNEL_REQUEST_TIMEOUT or agent.request_timeout in the workflow"
    ),
    "connect_timeout": "AgentSettings.connect_timeout",
    "temperature": "agent.temperature in the workflow",
    "max_retries": "--max-retries, FSM_KERNEL_MAX_RETRIES or agent.max_retries in the workflow",
    "max_response_bytes": (
        "--max-response-bytes, FSM_KERNEL_MAX_RESPONSE_BYTES or agent.max_response_bytes in the "
        "workflow"
    ),
    "stream": "--no-stream or FSM_KERNEL_STREAM",
    "max_tokens": "agent.max_tokens in the workflow",
}
"""Where each checked setting comes from, so the error says what to fix."""


def _invalid(name: str, what: str, value: Any) -> ConfigError:
    return ConfigError(f"{what} (got {value!r}) — check {_WHERE_SET[name]}")


def _check_number(
    value: Any,
    name: str,
    *,
    what: str,
    minimum: float | None = None,
    inclusive: bool = True,
) -> None:
    """A real, finite number above `minimum`: NaN slips through every `<` comparison and an
    infinite timeout would silently mean "wait forever", so both are refused here."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _invalid(name, what, value)
    if minimum is not None and (value < minimum or (not inclusive and value == minimum)):
        raise _invalid(name, what, value)


def _check_int(
    value: Any, name: str, *, what: str, minimum: int, maximum: int | None = None
) -> None:
    """A whole number (not a bool, not a float) within bounds."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(name, what, value)
    if value < minimum or (maximum is not None and value > maximum):
        raise _invalid(name, what, value)


def _env(environ: Mapping[str, str], name: str) -> str | None:
    value = environ.get(name)
    return value if value else None


def _env_number(environ: Mapping[str, str], name: str, kind: type[float] | type[int]) -> Any:
    raw = _env(environ, name)
    if raw is None:
        return None
    try:
        value = kind(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if not math.isfinite(value):  # float() reads "nan" and "inf"; neither is a usable setting
        raise ConfigError(f"{name}={raw!r} is not a finite number")
    return value


def _env_positive_int(environ: Mapping[str, str], name: str) -> int | None:
    raw = _env(environ, name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ConfigError(f"{name}={raw!r} is not a positive whole number")
    return value


_TRUE = frozenset({"1", "true"})
_FALSE = frozenset({"0", "false"})


def _env_bool(environ: Mapping[str, str], name: str) -> bool | None:
    raw = _env(environ, name)
    if raw is None:
        return None
    value = raw.strip().lower()
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise ConfigError(f"{name}={raw!r} is not a boolean (use 1, 0, true or false)")


def agent_settings_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The agent overrides the environment gives (unset ones omitted)."""
    environ = os.environ if environ is None else environ
    found: dict[str, Any] = {
        "base_url": _env(environ, "FSM_KERNEL_BASE_URL"),
        "model": _env(environ, "FSM_KERNEL_MODEL"),
        "api_key": _env(environ, "FSM_KERNEL_API_KEY") or _env(environ, "OPENAI_API_KEY"),
        "request_timeout": _env_number(environ, "FSM_KERNEL_REQUEST_TIMEOUT", float),
        "max_retries": _env_number(environ, "FSM_KERNEL_MAX_RETRIES", int),
        "max_response_bytes": _env_positive_int(environ, "FSM_KERNEL_MAX_RESPONSE_BYTES"),
        "stream": _env_bool(environ, "FSM_KERNEL_STREAM"),
    }
    return {k: v for k, v in found.items() if v is not None}


def default_store_location(environ: Mapping[str, str] | None = None) -> str:
    """Where runs are recorded: FSM_KERNEL_STORE, else .fsm-kernel/runs.db under the cwd."""
    environ = os.environ if environ is None else environ
    return _env(environ, "FSM_KERNEL_STORE") or DEFAULT_STORE


def package_data_dir(name: str) -> Path | None:
    """A stock data folder ("workflows" or "memory") shipped with fsm-kernel.

    Installed, it is fsm_kernel/data/<name>; in a source checkout, <repo>/<name>.
    """
    here = Path(__file__).resolve().parent
    for candidate in (here / "data" / name, here.parent / name):
        if candidate.is_dir():
            return candidate
    return None
