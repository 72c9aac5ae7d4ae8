"""The built-in tools (datetime, read_file, list_directory, done), registered through the same
ToolRegistry as user tools. File tools are confined to one workspace root.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from fsm_kernel.errors import ToolArgumentsError, ToolExecutionError
from fsm_kernel.protocol import Clock, SystemClock
from fsm_kernel.tools.registry import DEFAULT_OUTPUT_CAP, ToolRegistry

__all__ = ["DONE_TOOL", "READ_LIMIT_BYTES", "builtin_registry"]

logger = logging.getLogger(__name__)

DONE_TOOL = "done"
"""The tool whose call ends a run; the kernel recognises it by this name."""
READ_LIMIT_BYTES = 1_000_000
"""read_file reads at most this much of a file."""


def builtin_registry(
    workspace: Path | str = ".",
    *,
    clock: Clock | None = None,
    output_cap: int = DEFAULT_OUTPUT_CAP,
) -> ToolRegistry:
    """A registry holding the built-in tools, file access confined to `workspace`."""
    root = Path(workspace).resolve()
    registry = ToolRegistry(output_cap=output_cap)
    registry.register(_datetime_tool(clock or SystemClock()), name="datetime")
    registry.register(_read_file_tool(root), name="read_file")
    registry.register(_list_directory_tool(root), name="list_directory")
    registry.register(done, name=DONE_TOOL)
    return registry


def done(answer: str) -> str:
    """Finish the task. Call this once, when the task is complete, with your final answer.

    Args:
        answer: The final answer for the user.
    """
    return answer


def _datetime_tool(clock: Clock) -> Callable[..., str]:
    def current_datetime(timezone: str | None = None) -> str:
        """Get the current date and time (ISO 8601, in UTC and in local time, with weekday).

        Args:
            timezone: IANA time zone name for the local time, such as 'Europe/Paris'. Defaults
                to the machine's time zone.
        """
        now = clock.now()
        local = now.astimezone(_zone(timezone)) if timezone else now.astimezone()
        zone_name = timezone or local.tzname() or "local"
        return f"utc: {_stamp(now.astimezone(UTC))}\nlocal: {_stamp(local)} [{zone_name}]"

    return current_datetime


def _zone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ToolArgumentsError(
            f"unknown time zone {name!r}: use an IANA name such as 'Europe/Paris' or 'UTC'",
            tool_name="datetime",
        ) from exc


def _stamp(moment: datetime) -> str:
    return f"{moment.isoformat(timespec='seconds')} ({moment.strftime('%A')})"


def _read_file_tool(root: Path) -> Callable[..., str]:
    def read_file(path: str) -> str:
        """Read a text file from the workspace.

        Args:
            path: File path relative to the workspace root.
        """
        target = _inside(root, path, "read_file")
        if not target.exists():
            raise ToolExecutionError(f"{path!r} does not exist", tool_name="read_file")
        if target.is_dir():
            raise ToolExecutionError(
                f"{path!r} is a directory; use list_directory", tool_name="read_file"
            )
        return _read_text(target, path)

    return read_file


def _read_text(target: Path, shown: str) -> str:
    try:
        with target.open("rb") as fh:
            data = fh.read(READ_LIMIT_BYTES + 1)
        size = target.stat().st_size
    except OSError as exc:
        raise ToolExecutionError(
            f"cannot read {shown!r}: {exc.strerror or exc}", tool_name="read_file"
        ) from exc
    if b"\x00" in data:
        raise ToolExecutionError(
            f"{shown!r} is a binary file (it contains NUL bytes); only text files can be read",
            tool_name="read_file",
        )
    text = data[:READ_LIMIT_BYTES].decode("utf-8", errors="replace")
    if len(data) > READ_LIMIT_BYTES:
        text += f"\n[file is {size} bytes; read the first {READ_LIMIT_BYTES}]"
    return text


def _list_directory_tool(root: Path) -> Callable[..., str]:
    def list_directory(path: str = ".") -> str:
        """List a workspace directory: one entry per line, sorted, directories ending in '/',
        files with their size.

        Args:
            path: Directory path relative to the workspace root.
        """
        target = _inside(root, path, "list_directory")
        if not target.exists():
            raise ToolExecutionError(f"{path!r} does not exist", tool_name="list_directory")
        if not target.is_dir():
            raise ToolExecutionError(
                f"{path!r} is a file, not a directory; use read_file", tool_name="list_directory"
            )
        try:
            entries = sorted(target.iterdir(), key=lambda p: p.name)
        except OSError as exc:
            raise ToolExecutionError(
                f"cannot list {path!r}: {exc.strerror or exc}", tool_name="list_directory"
            ) from exc
        return "\n".join(_describe_entry(e) for e in entries) or "(empty directory)"

    return list_directory


def _describe_entry(entry: Path) -> str:
    try:
        if entry.is_dir():
            return f"{entry.name}/"
        return f"{entry.name} ({entry.stat().st_size} bytes)"
    except OSError:  # a dangling symlink or a file removed meanwhile
        return f"{entry.name} (unreadable)"


def _inside(root: Path, path: str, tool_name: str) -> Path:
    """`path` resolved (symlinks followed) against `root`; refused if it lands outside."""
    try:
        target = (root / path).resolve()
    except (OSError, ValueError, RuntimeError) as exc:
        raise ToolArgumentsError(f"invalid path {path!r}: {exc}", tool_name=tool_name) from exc
    if not target.is_relative_to(root):
        logger.debug("refused path %r outside workspace %s", path, root)
        raise ToolArgumentsError(
            f"path {path!r} is outside the workspace; use a path inside it, relative to its root",
            tool_name=tool_name,
        )
    return target
