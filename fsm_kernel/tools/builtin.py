"""The built-in tools (datetime, read_file, list_directory, done), registered through the same
ToolRegistry as user tools. File tools are confined to one workspace root.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections import deque
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
        fd = _open_in_workspace(root, path, "read_file")
        try:
            mode = os.fstat(fd).st_mode
            if stat.S_ISDIR(mode):
                raise ToolExecutionError(
                    f"{path!r} is a directory; use list_directory", tool_name="read_file"
                )
            if not stat.S_ISREG(mode):
                raise ToolExecutionError(
                    f"{path!r} is a {_kind(mode)}, not a regular file; only regular files can be"
                    " read",
                    tool_name="read_file",
                )
            return _read_text(fd, path)
        finally:
            os.close(fd)

    return read_file


def _read_text(fd: int, shown: str) -> str:
    try:
        data = _read_up_to(fd, READ_LIMIT_BYTES + 1)
        size = os.fstat(fd).st_size
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


def _read_up_to(fd: int, limit: int) -> bytes:
    """At most `limit` bytes from `fd`; os.read may return less than asked before the end."""
    chunks: list[bytes] = []
    remaining = limit
    while remaining > 0:
        chunk = os.read(fd, remaining)
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _list_directory_tool(root: Path) -> Callable[..., str]:
    def list_directory(path: str = ".") -> str:
        """List a workspace directory: one entry per line, sorted, directories ending in '/',
        files with their size, symlinks as 'name -> target (symlink)'. Names with control
        characters or spaces at either end are shown quoted.

        Args:
            path: Directory path relative to the workspace root.
        """
        fd = _open_in_workspace(root, path, "list_directory")
        try:
            if not stat.S_ISDIR(os.fstat(fd).st_mode):
                raise ToolExecutionError(
                    f"{path!r} is a file, not a directory; use read_file",
                    tool_name="list_directory",
                )
            with os.scandir(fd) as scan:
                entries = sorted(scan, key=lambda entry: entry.name)
            lines = [_describe_entry(entry, fd) for entry in entries]
        except OSError as exc:
            raise ToolExecutionError(
                f"cannot list {path!r}: {exc.strerror or exc}", tool_name="list_directory"
            ) from exc
        finally:
            os.close(fd)
        return "\n".join(lines) or "(empty directory)"

    return list_directory


def _describe_entry(entry: os.DirEntry[str], dir_fd: int) -> str:
    """One listing line. lstat semantics: a symlink shows as a link, never with the size or
    type of what it points to, which may lie outside the workspace."""
    name = _shown_name(entry.name)
    try:
        info = entry.stat(follow_symlinks=False)
        if stat.S_ISLNK(info.st_mode):
            target = os.readlink(entry.name, dir_fd=dir_fd)
            return f"{name} -> {_shown_name(target)} (symlink)"
    except OSError:  # removed or replaced meanwhile
        return f"{name} (unreadable)"
    if stat.S_ISDIR(info.st_mode):
        return f"{name}/"
    if stat.S_ISREG(info.st_mode):
        return f"{name} ({info.st_size} bytes)"
    return f"{name} ({_kind(info.st_mode)})"


def _shown_name(name: str) -> str:
    """`name` as is, or repr-quoted when it could be misread: a non-printable character (a
    newline would forge a listing line, an ANSI escape would rewrite the user's terminal),
    spaces at either end, or a leading quote (so that a plain name never passes for a quoted
    one)."""
    odd = not name.isprintable() or name != name.strip() or name.startswith(("'", '"'))
    return repr(name) if odd else name


_SPECIAL_KINDS: tuple[tuple[Callable[[int], bool], str], ...] = (
    (stat.S_ISFIFO, "FIFO"),
    (stat.S_ISSOCK, "socket"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
)


def _kind(mode: int) -> str:
    """What a file that is neither a regular file, a directory nor a symlink is."""
    return next((label for is_kind, label in _SPECIAL_KINDS if is_kind(mode)), "special file")


# --- confinement ------------------------------------------------------------------------------

_MAX_SYMLINKS = 40
"""Symlinks followed while opening one path before calling it a loop, as Linux does (ELOOP)."""
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_LAST_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
"""For the last component, file or directory. O_NONBLOCK: opening a FIFO cannot hang the tool
(its type is checked on the descriptor afterwards); O_NOCTTY: a terminal never becomes ours."""


def _open_in_workspace(root: Path, path: str, tool_name: str) -> int:
    """A read-only descriptor of `path`, opened without ever leaving `root`; the caller closes it.

    Raises:
        ToolArgumentsError: the path, or a symlink on the way, leads outside the workspace; a
            symlink loop; a path the OS cannot take (a NUL byte).
        ToolExecutionError: the path does not exist or cannot be opened.
    """
    try:
        return _Walk(root, path, tool_name).open()
    except ValueError as exc:
        raise ToolArgumentsError(f"invalid path {path!r}: {exc}", tool_name=tool_name) from exc
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            raise ToolExecutionError(f"{path!r} does not exist", tool_name=tool_name) from exc
        raise ToolExecutionError(
            f"cannot open {path!r}: {exc.strerror or exc}", tool_name=tool_name
        ) from exc


class _Walk:
    """Opens one path beneath the root one component at a time, each relative to its parent's
    descriptor and with O_NOFOLLOW.

    Checking a resolved path and then opening it by name is racy: a directory swapped for a
    symlink in between sends the open outside. Here the kernel never follows a symlink. The
    walk follows them itself: a relative target continues from the link's directory, an
    absolute one from the root (it must name a place under the root). `..` closes the current
    descriptor and goes back to its parent's, already held, so no step climbs above the root.
    """

    def __init__(self, root: Path, path: str, tool_name: str) -> None:
        self._root = root
        self._path = path
        self._tool_name = tool_name
        self._pending = deque(self._parts(path))
        self._links_followed = 0

    def open(self) -> int:
        chain = [os.open(self._root, _DIR_FLAGS)]  # the root, then each directory walked into
        try:
            while self._pending:
                self._step(chain, self._pending.popleft())
            return chain.pop()
        finally:
            for fd in chain:
                os.close(fd)

    def _step(self, chain: list[int], name: str) -> None:
        if name == "..":
            if len(chain) == 1:
                raise self._outside()
            os.close(chain.pop())
            return
        flags = _DIR_FLAGS if self._pending else _LAST_FLAGS
        try:
            chain.append(os.open(name, flags, dir_fd=chain[-1]))
        except OSError:
            target = _link_target(name, chain[-1])
            if target is None:  # not a symlink: the open's own error stands
                raise
            self._follow(chain, target)

    def _follow(self, chain: list[int], target: str) -> None:
        self._links_followed += 1
        if self._links_followed > _MAX_SYMLINKS:
            raise ToolArgumentsError(
                f"invalid path {self._path!r}: more than {_MAX_SYMLINKS} symlinks to follow"
                " (a symlink loop?)",
                tool_name=self._tool_name,
            )
        if target.startswith("/"):
            while len(chain) > 1:
                os.close(chain.pop())
        self._pending.extendleft(reversed(self._parts(target)))

    def _parts(self, text: str) -> list[str]:
        """The components of `text` to walk: from the root when it is absolute, in which case
        it must name a place under the root (there is no descriptor above it to walk from)."""
        parts = [part for part in text.split("/") if part not in ("", ".")]
        if not text.startswith("/"):
            return parts
        base = list(self._root.parts[1:])
        if parts[: len(base)] != base:
            raise self._outside()
        return parts[len(base) :]

    def _outside(self) -> ToolArgumentsError:
        logger.debug("refused path %r outside workspace %s", self._path, self._root)
        return ToolArgumentsError(
            f"path {self._path!r} is outside the workspace; use a path inside it, relative to"
            " its root",
            tool_name=self._tool_name,
        )


def _link_target(name: str, dir_fd: int) -> str | None:
    """Where the symlink `name` in `dir_fd` points, or None if it is not (or no longer) one."""
    try:
        return os.readlink(name, dir_fd=dir_fd)
    except OSError:
        return None
