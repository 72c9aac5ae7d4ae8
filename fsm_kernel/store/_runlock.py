"""Per-run exclusive locks shared by the stores: a POSIX record lock on one byte of a sidecar
file for the file stores (SQLite, JSONL), and the run-id hash the PostgreSQL store's advisory
locks use. Both die with the holding process, even by SIGKILL: no stale lock outlives a crash.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from fsm_kernel.errors import RunLockedError, StoreError

__all__ = ["RUN_LOCKS_SUFFIX", "RunLockFile", "run_lock_key", "run_locked_error"]

RUN_LOCKS_SUFFIX = ".locks"
"""The run lock sidecar of a file store: `<store path>.locks`, created by the first lock_run."""
_FILE_LOCK_BITS = 62  # a byte offset: offset + 1 must still fit a signed 64-bit off_t
_LOCK_BUSY = frozenset({errno.EACCES, errno.EAGAIN})  # POSIX allows either for a held lock


def run_lock_key(run_id: str, *, bits: int) -> int:
    """A stable non-negative `bits`-bit number for a run id (blake2b, 8 bytes, masked): the byte
    a file store locks (62 bits) or a PostgreSQL advisory lock key (63 bits, a signed bigint)."""
    digest = hashlib.blake2b(run_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") & ((1 << bits) - 1)


def run_locked_error(run_id: str, holder: str = "another process") -> RunLockedError:
    """The one message every backend gives for a run someone else is running."""
    return RunLockedError(
        f"run {run_id} is being run by {holder}; wait for it to end or stop it", run_id=run_id
    )


@dataclass
class _HeldLocks:
    """The open lock file of one path and the bytes this process holds in it."""

    fd: int | None
    offsets: set[int] = field(default_factory=set)


# POSIX record locks belong to the process, not to a descriptor: a second lockf by this process
# succeeds, and closing *any* descriptor of the file drops all of them. So each lock file is
# opened once per process, shared by every store on it, closed only when it holds nothing, and
# a second holder inside the process is refused here.
_held: dict[str, _HeldLocks] = {}
_held_guard = threading.Lock()


class RunLockFile:
    """Exclusive per-run locks for a file store: a POSIX record lock on one byte of one sidecar
    file, the byte chosen by a hash of the run id. The kernel drops record locks when their
    process dies, even by SIGKILL: no stale lock outlives a crash. Local filesystems only.

    `path` None (an in-memory store, which no other process can see) locks within this object.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._key = str(path.resolve()) if path is not None else f"memory:{id(self)}"

    @contextlib.contextmanager
    def hold(self, run_id: str) -> Iterator[None]:
        """Hold `run_id`'s lock for the block; RunLockedError at once if it is taken."""
        offset = run_lock_key(run_id, bits=_FILE_LOCK_BITS)
        with _held_guard:
            self._acquire(run_id, offset)
        try:
            yield
        finally:
            with _held_guard:
                self._release(offset)

    def _acquire(self, run_id: str, offset: int) -> None:
        entry = _held.get(self._key) or _HeldLocks(fd=self._open())
        if offset in entry.offsets:
            raise run_locked_error(run_id, "another task of this process")
        if entry.fd is not None:
            try:
                fcntl.lockf(entry.fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, offset)
            except OSError as exc:
                if not entry.offsets:
                    os.close(entry.fd)
                if exc.errno in _LOCK_BUSY:
                    raise run_locked_error(run_id) from None
                raise StoreError(f"{self.path}: cannot lock run {run_id}: {exc}") from exc
        entry.offsets.add(offset)
        _held[self._key] = entry

    def _release(self, offset: int) -> None:
        entry = _held[self._key]
        entry.offsets.discard(offset)
        if entry.offsets:
            if entry.fd is not None:
                with contextlib.suppress(OSError):  # the process's exit releases it anyway
                    fcntl.lockf(entry.fd, fcntl.LOCK_UN, 1, offset)
            return
        del _held[self._key]
        if entry.fd is not None:
            os.close(entry.fd)  # drops the last lock with it

    def _open(self) -> int | None:
        """The lock file, created on first use (read-only commands never create it)."""
        if self.path is None:
            return None
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise StoreError(f"{self.path}: cannot open the run lock file: {exc}") from exc
