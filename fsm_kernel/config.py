"""Settings and their layering: built-in defaults < workflow file < FSM_KERNEL_* environment <
command-line flags. Pure: reads the environment only when asked, no I/O at import time.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from fsm_kernel.errors import ConfigError

__all__ = [
    "DEFAULT_BASE_URL",
    "DEFAULT_MODEL",
    "DEFAULT_STORE",
    "AgentSettings",
    "agent_settings_from_env",
    "default_store_location",
    "package_data_dir",
]

DEFAULT_BASE_URL = "http://localhost:11434/v1"
DEFAULT_MODEL = "qwen3"
DEFAULT_STORE = ".fsm-kernel/runs.db"


@dataclass(frozen=True, kw_only=True)
class AgentSettings:
    """How to reach the model server."""

    base_url: str = DEFAULT_BASE_URL
    model: str = DEFAULT_MODEL
    api_key: str | None = None
    """Sent as a Bearer token; never logged, printed or stored (see `public_dict`)."""
    request_timeout: float = 120.0
    """Seconds to wait for one HTTP answer."""
    connect_timeout: float = 10.0
    max_retries: int = 3
    """Retries after the first attempt, on connection errors, timeouts, 408/409/429 and 5xx."""
    temperature: float | None = None

    def merged(self, overrides: Mapping[str, Any]) -> AgentSettings:
        """A copy with every non-None value of `overrides` applied."""
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


def _env(environ: Mapping[str, str], name: str) -> str | None:
    value = environ.get(name)
    return value if value else None


def _env_number(environ: Mapping[str, str], name: str, kind: type[float] | type[int]) -> Any:
    raw = _env(environ, name)
    if raw is None:
        return None
    try:
        return kind(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None


def agent_settings_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The agent overrides the environment gives (unset ones omitted)."""
    environ = os.environ if environ is None else environ
    found: dict[str, Any] = {
        "base_url": _env(environ, "FSM_KERNEL_BASE_URL"),
        "model": _env(environ, "FSM_KERNEL_MODEL"),
        "api_key": _env(environ, "FSM_KERNEL_API_KEY") or _env(environ, "OPENAI_API_KEY"),
        "request_timeout": _env_number(environ, "FSM_KERNEL_REQUEST_TIMEOUT", float),
        "max_retries": _env_number(environ, "FSM_KERNEL_MAX_RETRIES", int),
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
