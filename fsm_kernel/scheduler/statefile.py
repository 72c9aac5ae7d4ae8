"""STATE.md: the kernel's opaque state document. Read as text, seeded once, written atomically
under a lock on a separate `.lock` file, and exposed to agents as two tools. Never parsed.

Local filesystems only: fcntl.flock is not reliable on NFS.
"""

# No `from __future__ import annotations` here: the tool functions' annotations must be real
# types for whoever builds their JSON schema from the signature.

import contextlib
import fcntl
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from fsm_kernel.errors import StoreError, ToolExecutionError

__all__ = ["StateFile", "state_tools"]

logger = logging.getLogger(__name__)

_FILE_MODE = 0o644


class StateFile:
    """One STATE.md file and its lock file (`STATE.md.lock`, never replaced)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        self.lock_path = self.path.with_name(self.path.name + ".lock")

    def __repr__(self) -> str:
        return f"StateFile({str(self.path)!r})"

    def read(self) -> str:
        """The whole document; "" when the file does not exist yet.

        Readers take no lock: the file is only ever swapped in whole by os.replace.

        Raises:
            StoreError: the file exists but cannot be read.
        """
        try:
            return self.path.read_bytes().decode("utf-8")  # bytes: keep \r\n as written
        except FileNotFoundError:
            return ""
        except (OSError, UnicodeDecodeError) as exc:
            raise StoreError(f"cannot read {self.path}: {exc}") from exc

    def write(self, content: str) -> None:
        """Replace the document atomically and durably (temp file, fsync, rename, fsync dir).

        Raises:
            StoreError: the file could not be written; the old content is then intact.
        """
        with self.locked():
            self._write_unlocked(content)

    def seed(self, content: str) -> bool:
        """Create the file with `content` unless it already exists. True when it wrote."""
        with self.locked():
            if self.path.exists():
                return False
            self._write_unlocked(content)
        logger.info("seeded %s (%d characters)", self.path, len(content))
        return True

    def remove_stale_temps(self) -> int:
        """Delete temp files a crashed writer left next to STATE.md; returns how many."""
        if not self.path.parent.is_dir():
            return 0
        removed = 0
        with self.locked():  # writers hold the lock while their temp file exists
            for stale in self.path.parent.glob(f".{self.path.name}.*.tmp"):
                with contextlib.suppress(FileNotFoundError):
                    stale.unlink()
                    removed += 1
        if removed:
            logger.warning("removed %d stale temp file(s) next to %s", removed, self.path)
        return removed

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the exclusive lock (blocking) for the duration of the block."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, _FILE_MODE)
        except OSError as exc:
            raise StoreError(f"cannot open lock file {self.lock_path}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the flock

    def _write_unlocked(self, content: str) -> None:
        try:
            _atomic_write(self.path, content)
        except (OSError, UnicodeError) as exc:
            raise StoreError(f"cannot write {self.path}: {exc}") from exc


def _atomic_write(path: Path, content: str) -> None:
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
            handle.write(content)
            handle.flush()
            os.fsync(handle.fileno())  # the data is durable before the name points at it
        os.chmod(tmp_name, _FILE_MODE)  # mkstemp creates 0600
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)  # makes the rename itself durable
    finally:
        os.close(dir_fd)


def state_tools(state_file: StateFile | str | Path) -> list[Callable[..., str]]:
    """The two tools through which agents see and change STATE.md: read_state, write_state.

    Plain typed functions with Google-style docstrings, ready for the tool registry.
    """
    if not isinstance(state_file, StateFile):
        state_file = StateFile(state_file)

    def read_state() -> str:
        """Read the kernel's STATE.md document.

        Returns:
            The whole document as text, or an empty string when it does not exist yet.
        """
        try:
            return state_file.read()
        except StoreError as exc:
            raise ToolExecutionError(str(exc), tool_name="read_state") from exc

    def write_state(content: str) -> str:
        """Replace the kernel's STATE.md document with new content.

        The whole document is replaced, so pass everything that should remain in it.

        Args:
            content: The complete new text of STATE.md.

        Returns:
            A confirmation with the number of characters written.
        """
        try:
            state_file.write(content)
        except StoreError as exc:
            raise ToolExecutionError(str(exc), tool_name="write_state") from exc
        return f"STATE.md updated ({len(content)} characters)"

    return [read_state, write_state]
