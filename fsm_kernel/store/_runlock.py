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
import struct
import sys
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
_FLOCK_LAYOUTS = {"linux": "@hhqqi", "darwin": "@qqihh"}
"""struct flock as F_GETLK reads it: l_type, l_whence, l_start, l_len, l_pid on Linux;
l_start, l_len, l_pid, l_type, l_whence on macOS (off_t is 64 bits on both)."""


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

    def is_held(self, run_id: str) -> bool:
        """True when some process (this one included) holds `run_id`'s lock now. Asks the
        kernel (F_GETLK) without taking the lock, so it never makes a holder-to-be fail; opens
        the lock file read-only and creates nothing. A platform whose `struct flock` is not
        known here answers True (a live run is never shown as interrupted)."""
        offset = run_lock_key(run_id, bits=_FILE_LOCK_BITS)
        with _held_guard:  # no lock_run may open the file (and be dropped by our close) meanwhile
            entry = _held.get(self._key)
            if entry is not None and offset in entry.offsets:
                return True
            if self.path is None:
                return False
            if entry is not None and entry.fd is not None:
                return _someone_holds(entry.fd, offset)
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return False  # no run was ever locked in this store
            except OSError as exc:
                raise StoreError(f"{self.path}: cannot open the run lock file: {exc}") from exc
            try:
                return _someone_holds(fd, offset)
            finally:
                os.close(fd)  # this process holds no lock in the file (no entry): none dropped

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


def _someone_holds(fd: int, offset: int) -> bool:
    """Whether another process holds a record lock on byte `offset` of `fd`'s file (F_GETLK:
    nothing is locked by asking)."""
    layout = _FLOCK_LAYOUTS.get(sys.platform)
    if layout is None:
        return True
    fields = {"type": fcntl.F_WRLCK, "whence": os.SEEK_SET, "start": offset, "len": 1, "pid": 0}
    order = ("type", "whence", "start", "len", "pid")
    if sys.platform == "darwin":
        order = ("start", "len", "pid", "type", "whence")
    query = struct.pack(layout, *(fields[name] for name in order))
    try:
        answer = fcntl.fcntl(fd, fcntl.F_GETLK, query)
    except OSError:
        return True
    kind = dict(zip(order, struct.unpack(layout, answer), strict=True))["type"]
    return bool(kind != fcntl.F_UNLCK)
