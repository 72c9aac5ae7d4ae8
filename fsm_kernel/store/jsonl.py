"""JSON Lines: an EventStore for fixtures and offline inspection, and the export/import format
that moves runs between stores.

One event per line: Event.to_dict() plus a "crc32" of the rest (checked when present, so
hand-written fixtures may leave it out). Appends are fsynced (a batch written with
`durable=False` waits for the next fsync) and serialized between processes with flock; a torn
last line left by a crash is ignored and cut off by the next append. Unlike the databases, a
crash in the middle of a multi-event write may keep that batch's first lines.

On Linux, a store that appends reserves disk space past the end of the file ahead of its
appends (see `_Reservation`), so a sync writes no block allocation and the file keeps few
extents as it grows; readers never see the reserved space, and close gives back what is left.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import logging
import os
import sys
import tempfile
import threading
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any

from fsm_kernel.errors import (
    RunNotFoundError,
    StoreConflictError,
    StoreError,
    StoreSchemaError,
)
from fsm_kernel.protocol import Event, EventStore, RunFilter, RunSummary
from fsm_kernel.redact import redact_data
from fsm_kernel.store._runlock import RUN_LOCKS_SUFFIX, RunLockFile
from fsm_kernel.store._schema import (
    AMBIGUOUS_SHOWN,
    INTERRUPTED,
    RUNNING,
    SUMMARY_STATUSES,
    WAITING,
    check_events,
    check_page,
    clean_prefix,
    encode_data,
    make_event,
    parse_ts,
    resolve_run,
    summarize_batch,
    unique_prefix,
)
from fsm_kernel.store._synccost import SyncCost

__all__ = ["JsonlEventStore", "export_run", "import_events"]

logger = logging.getLogger(__name__)

_CRC_KEY = "crc32"

_RESERVE_MIN = 4 << 20
"""Bytes a store first reserves past the end of the file, before its first append."""

_RESERVE_MAX = 64 << 20
"""The most it reserves at once; in between, as much as the file holds already."""


@dataclass(frozen=True)
class _Prepared:
    """A batch ready to write: its events, and each one's line."""

    batch: list[Event]
    lines: list[bytes]
    payload: bytes


class JsonlEventStore:
    """Append-only event log in one .jsonl file, kept in memory and re-read as it grows.

    Several stores (threads or processes) may share a file: every call first reads what others
    appended since, and appends hold an exclusive flock. Local filesystems only.

    The events this store appends are kept as their lines and decoded when first read: a
    process that records a run never reads it back, and tens of thousands of decoded events,
    scattered through its memory, slowed the run's own walks over its history as it grew.

    With `read_only=True` the file must exist; it is opened read-only and appends fail.
    """

    def __init__(self, path: str | Path, *, read_only: bool = False) -> None:
        self.path = Path(path).expanduser()
        self.read_only = read_only
        self._lock = threading.Lock()
        self._fd: int | None = _open_read_only(self.path) if read_only else _open(self.path)
        self._offset = 0
        self._lineno = 0
        self._torn = False
        self._needs_newline = False
        self._sync_cost = SyncCost()
        self._reservation = _Reservation()
        self._events: dict[str, dict[int, Event | bytes]] = {}
        """Per run, per seq: the event, or its line while no read has decoded it."""
        self._runs: dict[str, RunSummary] = {}
        self._run_locks = RunLockFile(self.path.with_name(self.path.name + RUN_LOCKS_SUFFIX))
        try:
            with self._lock, self._flocked(fcntl.LOCK_SH):
                self._catch_up()
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return f"JsonlEventStore({str(self.path)!r})"

    def __enter__(self) -> JsonlEventStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def append(self, events: Sequence[Event], *, durable: bool = True) -> None:
        """Append a batch with one write and, unless `durable` is False, one fsync.

        With `durable=False` the lines are written (every reader sees them, and they survive
        this process dying) but reach the disk with the next durable append's fsync.

        Raises:
            StoreConflictError: a (run_id, seq) of the batch exists already (or twice in it);
                nothing of the batch is written.
            StoreError: the file could not be written.
        """
        prepared = self._prepare(events)
        if prepared is None:
            return
        self._writable()
        with self._lock, self._flocked(fcntl.LOCK_EX):
            self._append_locked(prepared, durable=durable)

    def append_if_idle(self, events: Sequence[Event], *, durable: bool = False) -> bool:
        """`append(events, durable=durable)` done at once on the calling thread when neither
        another thread nor another process holds the file; False, with nothing done,
        otherwise. An append without fsync is a few microseconds of work, so the run recorder
        makes it on the event loop rather than handing it to a thread. A durable one waits
        for the disk, so it is made only while this store's fsyncs are fast (see SyncCost),
        else False.

        Raises:
            StoreConflictError, StoreError: as `append`.
        """
        if durable and not self._sync_cost.cheap:
            return False
        prepared = self._prepare(events)
        if prepared is None:
            return True
        self._writable()
        if not self._lock.acquire(blocking=False):
            return False
        try:
            fd = self._live()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            except OSError as exc:
                raise StoreError(f"{self.path}: cannot lock: {exc}") from exc
            try:
                self._append_locked(prepared, durable=durable)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            self._lock.release()
        return True

    def _writable(self) -> None:
        if self.read_only:
            raise StoreError(f"{self.path}: the event store is open read-only")

    def _prepare(self, events: Sequence[Event]) -> _Prepared | None:
        batch = list(events)
        if not batch:
            return None
        check_events(batch)
        lines = [_encode_line(e) for e in batch]
        return _Prepared(batch, lines, b"".join(lines))

    def _append_locked(self, prepared: _Prepared, *, durable: bool) -> None:
        self._catch_up()
        self._check_conflicts(prepared.batch)
        self._repair_tail()
        payload = prepared.payload
        if self._needs_newline:
            payload = b"\n" + payload
        self._reservation.cover(self._live(), self._offset, len(payload))
        self._write(payload, durable=durable)
        self._needs_newline = False
        self._offset += len(payload)
        self._lineno += len(prepared.batch)
        for event, line in zip(prepared.batch, prepared.lines, strict=True):
            self._events.setdefault(event.run_id, {})[event.seq] = line
        # Summarized as a reopened store will: the data is read now, the times in UTC.
        self._summarize([_in_utc(e) for e in prepared.batch])

    def read(self, run_id: str) -> list[Event]:
        """Every event of the run in seq order; [] for an unknown run."""
        with self._lock, self._flocked(fcntl.LOCK_SH):
            self._catch_up()
            by_seq = self._events.get(run_id, {})
            return [self._decoded(run_id, by_seq, seq) for seq in sorted(by_seq)]

    def _decoded(self, run_id: str, by_seq: dict[int, Event | bytes], seq: int) -> Event:
        """The event at `seq`, decoded from its line (once: kept decoded) if need be."""
        stored = by_seq[seq]
        if isinstance(stored, Event):
            return stored
        event = _decode_line(stored, f"{self.path}: run {run_id} seq {seq}")
        assert event is not None  # the line this store wrote
        by_seq[seq] = event
        return event

    def next_seq(self, run_id: str) -> int:
        """1 + the run's last seq; 1 for a run with no events."""
        with self._lock, self._flocked(fcntl.LOCK_SH):
            self._catch_up()
            seqs = self._events.get(run_id)
            return max(seqs) + 1 if seqs else 1

    def list_runs(
        self,
        *,
        limit: int = 50,
        waiting: bool = False,
        where: RunFilter | None = None,
        before: str | None = None,
        after: str | None = None,
    ) -> list[RunSummary]:
        """The `limit` most recently started runs that `where` keeps (only the ones waiting for
        a person when `waiting`), newest first; `before` and `after` (run ids) page as in the
        SQL stores (see SqlEventStore.list_runs).

        Raises:
            RunNotFoundError: `before` or `after` names no run.
        """
        check_page(limit, before, after)
        if waiting:
            where = replace(where or RunFilter(), status=WAITING)
        with self._lock, self._flocked(fcntl.LOCK_SH):
            self._catch_up()
            runs = [r for r in map(self._shown, self._runs.values()) if _keeps(where, r)]
            cursor = before if before is not None else after
            if cursor is not None and cursor not in self._runs:
                raise RunNotFoundError(f"no run with id {cursor!r}", run_id=cursor)
            mark = None if cursor is None else _order(self._runs[cursor])
        runs.sort(key=_order, reverse=True)
        if mark is None:
            return runs[:limit]
        if before is not None:
            return [r for r in runs if _order(r) < mark][:limit]
        newer = [r for r in runs if _order(r) > mark]
        return newer[max(0, len(newer) - limit) :]

    def count_runs(self, *, where: RunFilter | None = None) -> int:
        """How many runs `where` keeps."""
        with self._lock, self._flocked(fcntl.LOCK_SH):
            self._catch_up()
            return sum(1 for r in map(self._shown, self._runs.values()) if _keeps(where, r))

    def is_running(self, run_id: str) -> bool:
        """True while a process holds the run's lock (see lock_run); creates no file."""
        self._live()
        return self._run_locks.is_held(run_id)

    def _shown(self, run: RunSummary) -> RunSummary:
        """The summary with `interrupted` for a run recorded as running that nothing drives."""
        if run.status == RUNNING and not self._run_locks.is_held(run.run_id):
            return replace(run, status=INTERRUPTED)
        return run

    def short_id(self, run_id: str) -> str:
        """The shortest prefix of `run_id` (8 characters at least) that names it alone among
        the stored runs (see unique_prefix)."""
        with self._lock, self._flocked(fcntl.LOCK_SH):
            self._catch_up()
            before = max((r for r in self._runs if r < run_id), default=None)
            after = min((r for r in self._runs if r > run_id), default=None)
        return unique_prefix(run_id, before, after)

    def find_run(self, prefix: str) -> str:
        """The full id of the run `prefix` names (a full id or a unique prefix of one).

        Raises:
            RunNotFoundError: no run matches, or several do (the message lists them).
        """
        cleaned = clean_prefix(prefix)
        with self._lock, self._flocked(fcntl.LOCK_SH):
            self._catch_up()
            matches = sorted(r for r in self._runs if r.startswith(cleaned))
        return resolve_run(cleaned, matches[: AMBIGUOUS_SHOWN + 1])

    def lock_run(self, run_id: str) -> contextlib.AbstractContextManager[None]:
        """Hold the run's exclusive lock (see EventStore.lock_run) in `<path>.locks`.

        Raises:
            RunLockedError: another process, or another holder in this one, has it.
            StoreError: the store is closed or the lock file cannot be opened.
        """
        self._live()
        return self._run_locks.hold(run_id)

    def close(self) -> None:
        """Give back the space reserved past the end, and close the file (idempotent)."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            try:
                self._reservation.release(fd, self.path)
            finally:
                os.close(fd)

    def _live(self) -> int:
        if self._fd is None:
            raise StoreError(f"{self.path}: event store is closed")
        return self._fd

    @contextlib.contextmanager
    def _flocked(self, mode: int) -> Iterator[int]:
        fd = self._live()
        try:
            fcntl.flock(fd, mode)
        except OSError as exc:
            raise StoreError(f"{self.path}: cannot lock: {exc}") from exc
        try:
            yield fd
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _catch_up(self) -> None:
        """Index the lines appended (by anyone) since the last call."""
        data = self._read_new()
        if not data:
            return
        lines, tail = _split(data)
        events: list[Event] = []
        seen: set[tuple[str, int]] = set()
        for i, line in enumerate(lines, self._lineno + 1):
            event = _decode_line(line, f"{self.path}:{i}")
            if event is None:
                continue
            key = (event.run_id, event.seq)
            if key in seen or event.seq in self._events.get(event.run_id, {}):
                raise StoreError(f"{self.path}:{i}: run {key[0]} seq {key[1]} appears twice")
            seen.add(key)
            events.append(event)
        self._offset += len(data) - len(tail)
        self._lineno += len(lines)
        if tail and not self._torn:
            logger.warning("%s: ignoring a torn last line (%d bytes)", self.path, len(tail))
        self._torn = bool(tail)
        self._needs_newline = not tail and not data.endswith(b"\n")
        self._index(events)

    def _read_new(self) -> bytes:
        """The bytes past what is indexed (a torn tail is read again each time)."""
        fd = self._live()
        try:
            size = os.fstat(fd).st_size
            if size < self._offset:
                raise StoreError(f"{self.path}: the file shrank while open (edited by hand?)")
            return os.pread(fd, size - self._offset, self._offset)
        except OSError as exc:
            raise StoreError(f"{self.path}: cannot read: {exc}") from exc

    def _index(self, events: Sequence[Event]) -> None:
        for event in events:
            self._events.setdefault(event.run_id, {})[event.seq] = event
        self._summarize(events)

    def _summarize(self, events: Sequence[Event]) -> None:
        for delta in summarize_batch(events):
            self._runs[delta.run_id] = delta.merge_into(self._runs.get(delta.run_id))

    def _check_conflicts(self, batch: Sequence[Event]) -> None:
        seen: set[tuple[str, int]] = set()
        for event in batch:
            key = (event.run_id, event.seq)
            if key in seen:
                raise StoreConflictError(
                    f"run {event.run_id}: seq {event.seq} appears twice in one batch"
                )
            if event.seq in self._events.get(event.run_id, {}):
                raise StoreConflictError(f"run {event.run_id}: seq {event.seq} already exists")
            seen.add(key)

    def _repair_tail(self) -> None:
        """Cut off a torn last line (a crash mid-append) before appending after it."""
        if not self._torn:
            return
        try:
            os.ftruncate(self._live(), self._offset)
        except OSError as exc:
            raise StoreError(f"{self.path}: cannot cut off a torn last line: {exc}") from exc
        self._reservation.end = 0  # the cut gave back the space reserved past it too
        logger.warning("%s: cut off a torn last line at byte %d", self.path, self._offset)
        self._torn = False

    def _write(self, payload: bytes, *, durable: bool) -> None:
        fd = self._live()
        try:
            _write_all(fd, payload)
            if durable:
                with self._sync_cost.timing(durable):
                    os.fsync(fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, self._offset)  # leave no half-written batch behind
            self._reservation.end = 0  # and no space reserved past the end
            raise StoreError(f"{self.path}: append failed: {exc}") from exc


class _Reservation:
    """Disk space reserved past the end of the file ahead of the appends that will fill it
    (fallocate with FALLOC_FL_KEEP_SIZE, Linux only).

    Without it, each sync allocates the blocks its lines were just written to (ext4's delayed
    allocation), and the file, allocated a little at a time beside other files' writes,
    splits into more extents than the inode holds (4 on ext4): from then on every sync also
    writes an extent block, an I/O per sync more (7 writes an iteration instead of 6 for the
    run recorder's two syncs, from about the 100th iteration of a run on). With the space
    reserved, a sync only marks reserved blocks written, in the inode.

    The file's size is untouched: readers (other stores, `runs`, the viewer, `cat`) see the
    lines and nothing else, and a crash leaves the space reserved, not garbage in the file.
    Each reservation is as large as the file already is (between _RESERVE_MIN and
    _RESERVE_MAX), so a growing file needs few, and holds few extents. A file system without
    fallocate, or refusing it (no space), is simply appended to as before."""

    def __init__(self) -> None:
        self.end = 0
        """The end of the space this store reserved; 0 before its first append."""
        self.enabled = sys.platform.startswith("linux")

    def cover(self, fd: int, offset: int, size: int) -> None:
        """Reserve space for `size` bytes written at `offset` (the end of the file), and
        beyond, unless this store already did."""
        if not self.enabled or offset + size <= self.end:
            return
        length = max(size, min(max(_RESERVE_MIN, offset), _RESERVE_MAX))
        try:
            _fallocate_keep_size(fd, offset, length)
        except OSError as exc:  # not supported here, or no space: append as before
            logger.debug("not reserving space past the end of the event log: %s", exc)
            self.enabled = False
            return
        self.end = offset + length

    def release(self, fd: int, path: Path) -> None:
        """Give back the space reserved past the end of the file: cut the file at its size,
        under the exclusive lock, so no other process's line is cut (another process's own
        reservation may go too; its appends then allocate as they write)."""
        if not self.end:
            return
        self.end = 0
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                os.ftruncate(fd, os.fstat(fd).st_size)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError as exc:  # the log is intact; only the reserved space stays
            logger.warning("%s: cannot give back the space reserved past the end: %s", path, exc)


_FALLOC_FL_KEEP_SIZE = 1


def _fallocate_keep_size(fd: int, offset: int, length: int) -> None:
    """Linux fallocate(fd, FALLOC_FL_KEEP_SIZE, offset, length): the blocks, not the size
    (Python's os.posix_fallocate changes the size).

    Raises:
        OSError: the call failed (EOPNOTSUPP, ENOSPC...), or libc has no fallocate.
    """
    function = _libc_fallocate()
    if function is None:
        raise OSError(errno.ENOSYS, "no fallocate in the C library")
    if function(fd, _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        import ctypes

        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


@functools.cache
def _libc_fallocate() -> Any:
    """The C library's fallocate, or None. ctypes is imported here, at the first append:
    1 ms of import that commands which only read never pay."""
    import ctypes

    function = getattr(ctypes.CDLL(None, use_errno=True), "fallocate", None)
    if function is not None:
        function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        function.restype = ctypes.c_int
    return function


def export_run(store: EventStore, run_id: str, path: str | Path) -> int:
    """Write every event of one run to a .jsonl file (replaced atomically); returns the count.

    Raises:
        RunNotFoundError: the store has no events for `run_id`.
        StoreError: the file could not be written.
    """
    events = store.read(run_id)
    if not events:
        raise RunNotFoundError(f"no run with id {run_id!r}", run_id=run_id)
    target = Path(path).expanduser()
    try:
        # Redacted again: a log written before redaction existed must not leak through export.
        lines = (_encode_line(replace(e, data=redact_data(e.data))) for e in events)
        _atomic_write(target, b"".join(lines))
    except OSError as exc:
        raise StoreError(f"{target}: cannot export run {run_id}: {exc}") from exc
    logger.info("exported %d events of run %s to %s", len(events), run_id, target)
    return len(events)


def import_events(store: EventStore, path: str | Path) -> int:
    """Append every event of a .jsonl file to `store` in one batch; returns the count.

    Raises:
        StoreConflictError: some event already exists in `store` (nothing is imported).
        StoreError: the file cannot be read or a line is not an event.
    """
    source = Path(path).expanduser()
    try:
        data = source.read_bytes()
    except OSError as exc:
        raise StoreError(f"{source}: cannot read: {exc}") from exc
    lines, tail = _split(data)
    if tail:
        logger.warning("%s: ignoring a torn last line (%d bytes)", source, len(tail))
    decoded = (_decode_line(line, f"{source}:{i}") for i, line in enumerate(lines, 1))
    events = [e for e in decoded if e is not None]
    store.append(events)
    logger.info("imported %d events from %s", len(events), source)
    return len(events)


def _in_utc(event: Event) -> Event:
    """The event with its timestamp in UTC, as it reads back from its line."""
    ts = event.timestamp
    return event if ts.tzinfo is UTC else replace(event, timestamp=ts.astimezone(UTC))


def _order(run: RunSummary) -> tuple[datetime, str]:
    return run.started_at, run.run_id


def _keeps(where: RunFilter | None, run: RunSummary) -> bool:
    if where is None:
        return True
    if where.workflow and run.workflow != where.workflow:
        return False
    if where.top_level and run.parent_run_id is not None:
        return False
    statuses = (*SUMMARY_STATUSES, INTERRUPTED)
    if where.status in statuses and run.status != where.status:
        return False
    if where.status not in statuses and where.status:
        if run.termination_reason != where.status:  # only an ended run has one
            return False
    if where.text:
        # Like the databases' LIKE/ILIKE: ASCII letters in either case, anything else exactly.
        needle = _ascii_lower(where.text)
        return needle in _ascii_lower(run.run_id) or needle in _ascii_lower(run.goal)
    return True


def _ascii_lower(text: str) -> str:
    return text.translate(_ASCII_LOWER)


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def _open(path: Path) -> int:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = path.exists()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        if not existed:
            _fsync_dir(path.parent)  # the new file's name must survive a crash too
    except OSError as exc:
        raise StoreError(f"{path}: cannot open event log: {exc}") from exc
    return fd


def _open_read_only(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise StoreError(f"{path}: no such event store") from None
    except OSError as exc:
        raise StoreError(f"{path}: cannot open event log: {exc}") from exc


def _fsync_dir(directory: Path) -> None:
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _write_all(fd: int, payload: bytes) -> None:
    view = memoryview(payload)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _atomic_write(target: Path, payload: bytes) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        try:
            _write_all(fd, payload)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
        _fsync_dir(target.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _split(data: bytes) -> tuple[list[bytes], bytes]:
    """Complete lines and the torn remainder. A last line without its newline that parses is
    complete (a hand-written fixture); the next append writes its newline first."""
    end = data.rfind(b"\n") + 1
    lines, tail = data[:end].split(b"\n")[:-1], data[end:]
    if tail.strip() and _is_json_object(tail):
        return [*lines, tail], b""
    return lines, tail


def _is_json_object(raw: bytes) -> bool:
    try:
        return isinstance(json.loads(raw), dict)
    except ValueError:
        return False


def _canonical(d: dict[str, Any]) -> bytes:
    text = json.dumps(d, ensure_ascii=False, allow_nan=False, sort_keys=True, separators=(",", ":"))
    return text.encode("utf-8")


def _encode_line(event: Event) -> bytes:
    encode_data(event)  # the same "plain JSON only" check and message as the databases
    d = event.to_dict()
    d[_CRC_KEY] = f"{zlib.crc32(_canonical(d)):08x}"
    return _canonical(d) + b"\n"


def _decode_line(line: bytes, where: str) -> Event | None:
    """The event on one line; None for a blank line; StoreError naming `where` otherwise."""
    if not line.strip():
        return None
    try:
        d = json.loads(line)
        if not isinstance(d, dict):
            raise ValueError("not a JSON object")
        crc = d.pop(_CRC_KEY, None)
        if crc is not None and crc != f"{zlib.crc32(_canonical(d)):08x}":
            raise ValueError("checksum mismatch (the line was altered or damaged)")
        return make_event(
            run_id=str(d["run_id"]),
            seq=int(d["seq"]),
            type_=str(d["type"]),
            ts=parse_ts(str(d["ts"])),
            iteration=int(d.get("iteration", 0)),
            state=d.get("state"),
            version=int(d.get("v", 1)),
            data=dict(d.get("data") or {}),
        )
    except StoreSchemaError as exc:
        raise StoreSchemaError(f"{where}: {exc}") from exc
    except (KeyError, TypeError, ValueError) as exc:
        raise StoreError(f"{where}: not an event: {exc}") from exc
