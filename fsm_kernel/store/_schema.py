"""The logical schema every event store shares: the DDL and ordered migrations for SQLite and
PostgreSQL, and the mapping between Event and stored rows (JSON, never pickle).

Imports only fsm_kernel.errors and fsm_kernel.protocol; the backends import this module.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

from fsm_kernel.errors import RunNotFoundError, StoreError, StoreSchemaError
from fsm_kernel.protocol import Event, EventType, RunSummary
from fsm_kernel.redact import SharedData

__all__ = [
    "AMBIGUOUS_SHOWN",
    "COMPONENT",
    "ENDED",
    "EVENT_SEQ",
    "INTERRUPTED",
    "MIGRATIONS",
    "POSTGRES_MIGRATIONS_TABLE",
    "RUNNING",
    "RUN_EVENTS",
    "RUN_KEY_SHIFT",
    "RUN_SUSPENDED",
    "SCHEMA_VERSION",
    "SHORT_ID_LENGTH",
    "SQLITE_MIGRATIONS_TABLE",
    "SUMMARY_STATUSES",
    "WAITING",
    "Migration",
    "RunDelta",
    "check_events",
    "check_page",
    "clean_prefix",
    "decode_data",
    "encode_data",
    "format_ts",
    "make_event",
    "parse_ts",
    "plan_migrations",
    "resolve_run",
    "status_after",
    "summarize_batch",
    "tokens_of",
    "unique_prefix",
]

COMPONENT = "events"
"""Our rows in `schema_migrations`: other stores (the dispatch queue) may share the database."""

SQLITE_MIGRATIONS_TABLE = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    component  TEXT    NOT NULL,
    version    INTEGER NOT NULL,
    name       TEXT    NOT NULL,
    applied_at TEXT    NOT NULL,
    PRIMARY KEY (component, version)
)"""

POSTGRES_MIGRATIONS_TABLE = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    component  TEXT        NOT NULL,
    version    INTEGER     NOT NULL,
    name       TEXT        NOT NULL,
    applied_at TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (component, version)
)"""


@dataclass(frozen=True, kw_only=True)
class Migration:
    """One named schema step; applied in `version` order, each exactly once."""

    version: int
    name: str
    sqlite: tuple[str, ...]
    postgres: tuple[str, ...]


_SQLITE_EVENT_COLUMNS = """run_id    TEXT    NOT NULL,
        seq       INTEGER NOT NULL,
        type      TEXT    NOT NULL,
        ts        TEXT    NOT NULL,
        iteration INTEGER NOT NULL,
        state     TEXT,
        version   INTEGER NOT NULL,
        data      TEXT    NOT NULL"""
"""The columns of an event in SQLite (schema v1, and v5 beside its key)."""

_SQLITE_V1 = (
    f"""CREATE TABLE events (
        {_SQLITE_EVENT_COLUMNS},
        PRIMARY KEY (run_id, seq)
    )""",
    """CREATE TABLE runs (
        run_id             TEXT    PRIMARY KEY,
        workflow           TEXT    NOT NULL,
        goal               TEXT    NOT NULL,
        started_at         TEXT    NOT NULL,
        iterations         INTEGER NOT NULL DEFAULT 0,
        termination_reason TEXT,
        updated_at         TEXT    NOT NULL
    )""",
    "CREATE INDEX runs_started_at ON runs (started_at DESC, run_id DESC)",
)

_POSTGRES_V1 = (
    """CREATE TABLE events (
        run_id    TEXT        NOT NULL,
        seq       BIGINT      NOT NULL,
        type      TEXT        NOT NULL,
        ts        TIMESTAMPTZ NOT NULL,
        iteration INTEGER     NOT NULL,
        state     TEXT,
        version   INTEGER     NOT NULL,
        data      JSONB       NOT NULL,
        PRIMARY KEY (run_id, seq)
    )""",
    """CREATE TABLE runs (
        run_id             TEXT        PRIMARY KEY,
        workflow           TEXT        NOT NULL,
        goal               TEXT        NOT NULL,
        started_at         TIMESTAMPTZ NOT NULL,
        iterations         INTEGER     NOT NULL DEFAULT 0,
        termination_reason TEXT,
        updated_at         TIMESTAMPTZ NOT NULL
    )""",
    "CREATE INDEX runs_started_at ON runs (started_at DESC, run_id DESC)",
)

_RUN_STATUS = (
    "ALTER TABLE runs ADD COLUMN status TEXT NOT NULL DEFAULT 'running'",
    "UPDATE runs SET status = 'ended' WHERE termination_reason IS NOT NULL",
    "CREATE INDEX runs_waiting ON runs (started_at DESC, run_id DESC) WHERE status = 'waiting'",
)
"""v2: a run's status (running, waiting for a person, ended) and an index of the waiting ones."""

# v3: what the run viewer lists and filters on without reading events: the tokens a run's
# model calls used (filled in from the events of the runs already recorded), and an index per
# filter, newest first like runs_started_at, so a filtered page costs what an unfiltered one
# does.
_TOKENS_BACKFILL = """UPDATE runs SET tokens = COALESCE(
    (SELECT SUM(COALESCE(NULLIF(COALESCE({prompt}, 0) + COALESCE({completion}, 0), 0),
                         {total}, 0))
     FROM events e WHERE e.run_id = runs.run_id AND e.type = 'model.responded'), 0)"""
_FILTER_INDEXES = (
    "CREATE INDEX runs_workflow ON runs (workflow, started_at DESC, run_id DESC)",
    "CREATE INDEX runs_status ON runs (status, started_at DESC, run_id DESC)",
    "CREATE INDEX runs_reason ON runs (termination_reason, started_at DESC, run_id DESC)",
)


def _usage(sqlite: bool, key: str) -> str:
    if sqlite:
        return f"json_extract(e.data, '$.completion.usage.{key}')"
    return f"(e.data->'completion'->'usage'->>'{key}')::bigint"


def _tokens_backfill(*, sqlite: bool) -> str:
    return _TOKENS_BACKFILL.format(
        prompt=_usage(sqlite, "prompt_tokens"),
        completion=_usage(sqlite, "completion_tokens"),
        total=_usage(sqlite, "total_tokens"),
    )


_SQLITE_V3 = (
    "ALTER TABLE runs ADD COLUMN tokens INTEGER NOT NULL DEFAULT 0",
    _tokens_backfill(sqlite=True),
    *_FILTER_INDEXES,
)

_POSTGRES_V3 = (
    "ALTER TABLE runs ADD COLUMN tokens BIGINT NOT NULL DEFAULT 0",
    _tokens_backfill(sqlite=False),
    *_FILTER_INDEXES,
)

_PARENT = (
    "ALTER TABLE runs ADD COLUMN parent_run_id TEXT",
    "CREATE INDEX runs_parent ON runs (parent_run_id, started_at DESC, run_id DESC)",
)
"""v4: the run a child run (workflow.call, workflow.map) belongs to; NULL for a top-level run.
Runs recorded before it have no children, so nothing to fill in."""

RUN_KEY_SHIFT = 32
"""SQLite keys each event by its run's number and its seq: (run_no << 32) | seq."""

_SQLITE_KEYED = (
    "ALTER TABLE runs ADD COLUMN run_no INTEGER",
    # a row for any run whose events have none (this code always writes both together)
    """INSERT INTO runs (run_id, workflow, goal, started_at, updated_at)
       SELECT run_id, '', '', MIN(ts), MAX(ts) FROM events
       WHERE run_id NOT IN (SELECT run_id FROM runs) GROUP BY run_id""",
    "UPDATE runs SET run_no = rowid",
    "CREATE UNIQUE INDEX runs_no ON runs (run_no)",
    f"""CREATE TABLE events_keyed (
        key       INTEGER PRIMARY KEY,
        {_SQLITE_EVENT_COLUMNS}
    )""",
    f"""INSERT INTO events_keyed
        SELECT (r.run_no << {RUN_KEY_SHIFT}) | e.seq, e.run_id, e.seq, e.type, e.ts,
               e.iteration, e.state, e.version, e.data
        FROM events e JOIN runs r ON r.run_id = e.run_id ORDER BY 1""",
    "DROP TABLE events",
    "ALTER TABLE events_keyed RENAME TO events",
)
"""v5 (SQLite only): events keyed by an integer, (run_no << 32) | seq, instead of a separate
index on (run_id, seq). An append then writes the table's rightmost pages only, not also an
index of 36-character run ids that grows a level deeper as the log grows: about 40% fewer
pages per commit, and no deeper with the run's length. Each run gets its number (run_no) when
its row is created."""

_RUN_LOW = f"r.run_no * {1 << RUN_KEY_SHIFT}"
RUN_EVENTS = (
    f"runs r JOIN events e ON e.key BETWEEN {_RUN_LOW} AND {_RUN_LOW} + {(1 << RUN_KEY_SHIFT) - 1}"
)
"""Each run's events (SQLite, v5 on; aliases r and e): the keys in its number's range."""
EVENT_SEQ = f"e.key - {_RUN_LOW}"
"""An event's seq, from its key (SQLite, v6 on: the row holds no seq of its own)."""
_SQLITE_COMPACT = (
    """CREATE TABLE events_compact (
        key       INTEGER PRIMARY KEY,
        type      TEXT    NOT NULL,
        ts        TEXT    NOT NULL,
        iteration INTEGER NOT NULL,
        state     TEXT,
        version   INTEGER NOT NULL,
        data      TEXT    NOT NULL
    )""",
    """INSERT INTO events_compact
        SELECT key, type, ts, iteration, state, version, data FROM events ORDER BY key""",
    "DROP TABLE events",
    "ALTER TABLE events_compact RENAME TO events",
    f"""CREATE VIEW run_events AS
        SELECT r.run_id AS run_id, {EVENT_SEQ} AS seq, e.type AS type, e.ts AS ts,
               e.iteration AS iteration, e.state AS state, e.version AS version, e.data AS data
        FROM {RUN_EVENTS}""",
)
"""v6 (SQLite only): an event's row no longer repeats its run's id and its seq, which its key
holds already: about a quarter of an iteration's bytes (13 events × 38 bytes). The view
`run_events` shows the events as before, by run_id and seq, for anyone reading the file."""

MIGRATIONS: tuple[Migration, ...] = (
    Migration(version=1, name="create_events_and_runs", sqlite=_SQLITE_V1, postgres=_POSTGRES_V1),
    Migration(version=2, name="add_runs_status", sqlite=_RUN_STATUS, postgres=_RUN_STATUS),
    Migration(version=3, name="add_runs_tokens", sqlite=_SQLITE_V3, postgres=_POSTGRES_V3),
    Migration(version=4, name="add_runs_parent", sqlite=_PARENT, postgres=_PARENT),
    Migration(version=5, name="key_events_by_run_number", sqlite=_SQLITE_KEYED, postgres=()),
    Migration(version=6, name="drop_event_run_ids", sqlite=_SQLITE_COMPACT, postgres=()),
)
SCHEMA_VERSION = MIGRATIONS[-1].version


def plan_migrations(applied: Mapping[int, str], *, where: str) -> list[Migration]:
    """The migrations still to apply, given the applied {version: name} of a database.

    Raises:
        StoreSchemaError: the database was migrated by newer code, or by different code.
    """
    newest = max(applied, default=0)
    if newest > SCHEMA_VERSION:
        raise StoreSchemaError(
            f"{where}: event store schema version {newest} is newer than this fsm-kernel "
            f"supports ({SCHEMA_VERSION}); upgrade fsm-kernel"
        )
    known = {m.version: m.name for m in MIGRATIONS}
    for version, name in applied.items():
        if known.get(version) != name:
            raise StoreSchemaError(
                f"{where}: unknown event store migration {version} {name!r} in schema_migrations"
            )
    return [m for m in MIGRATIONS if m.version not in applied]


def format_ts(ts: datetime) -> str:
    """UTC ISO-8601 with fixed microseconds, so text order is time order (SQLite, JSONL):
    `ts.astimezone(UTC).isoformat(timespec="microseconds")`, byte for byte. The text up to
    the microseconds is kept for the second last formatted (the store's thread formats tens
    of thousands of timestamps a second when hundreds of runs share it, nearly all within
    the same second as the one before): then only the microseconds are added, three digits
    at a time from a table, in a quarter of the time `isoformat` takes (0.22 µs, 0.85)."""
    if ts.tzinfo is not UTC:
        ts = ts.astimezone(UTC)
    second, prefix = _LAST_SECOND[0]
    since = ts - second  # both in UTC: plain arithmetic, no offsets asked for
    if since.days or since.seconds:  # another second (earlier ones have days == -1)
        second = ts.replace(microsecond=0)
        prefix = second.isoformat()[: -len(_UTC_SUFFIX)] + "."
        _LAST_SECOND[0] = (second, prefix)  # one tuple: a thread reads both or neither
    thousands, units = divmod(ts.microsecond, 1000)
    return f"{prefix}{_DIGITS[thousands]}{_DIGITS[units]}{_UTC_SUFFIX}"


_UTC_SUFFIX = "+00:00"
_DIGITS = tuple(f"{n:03d}" for n in range(1000))
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_LAST_SECOND: list[tuple[datetime, str]] = [(_EPOCH, "1970-01-01T00:00:00.")]
"""The second format_ts formatted last (in UTC, without microseconds) and its text up to
them."""


def parse_ts(text: str) -> datetime:
    return datetime.fromisoformat(text).astimezone(UTC)


_ENCODER = json.JSONEncoder(
    ensure_ascii=False, allow_nan=False, sort_keys=True, separators=(",", ":")
)
"""One encoder for every event (json.dumps with these options would build one per call)."""


def _chunks_encoder() -> Callable[[Any, int], Sequence[str]] | None:
    """The C encoder `_ENCODER.encode` builds at every call, built once: half the cost of
    encoding an event's small dict is that set-up. Without a circular-reference check (its
    table would be shared by every thread, and an error leaves it dirty): event data is a
    tree, and a cycle still fails, as a RecursionError. None when this Python's `_json` lacks
    it or builds it differently (then `_ENCODER.encode` is used)."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # pragma: no cover - CPython has it
        return None
    try:
        chunks = cast(
            Callable[[Any, int], Sequence[str]],
            make(
                None,
                _ENCODER.default,
                json.encoder.encode_basestring,
                None,
                _ENCODER.key_separator,
                _ENCODER.item_separator,
                True,
                False,
                False,
            ),
        )
        sample = {"b": [1, 2.5, None, True], "a": '\u00e9\n"', "c": {"z": {}, "y": []}}
        if "".join(chunks(sample, 0)) != _ENCODER.encode(sample):
            return None  # pragma: no cover - another Python's encoder
    except Exception:  # pragma: no cover - another signature
        return None
    return chunks


_CHUNKS = _chunks_encoder()


def _encode(data: Any) -> str:
    if _CHUNKS is None:  # pragma: no cover - see _chunks_encoder
        return _ENCODER.encode(data)
    return "".join(_CHUNKS(data, 0))


def encode_data(event: Event) -> str:
    """The event's data as compact JSON; StoreError when it is not plain JSON. Data shared by
    many events (SharedData: a transition decided before, say) is encoded once."""
    data = event.data
    try:
        if type(data) is SharedData:
            encoded = data.encoded
            if encoded is None:
                encoded = data.encoded = _encode(data)
            return encoded
        return _encode(data)
    except (TypeError, ValueError, RecursionError) as exc:
        raise StoreError(
            f"event {event.run_id}#{event.seq} ({event.type}): data is not plain JSON: {exc}"
        ) from exc


def decode_data(value: str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    try:
        decoded = json.loads(value)
    except ValueError as exc:
        raise StoreError(f"stored event data is not valid JSON: {exc}") from exc
    if not isinstance(decoded, dict):
        raise StoreError(f"stored event data is not a JSON object: {value[:80]!r}")
    return decoded


def make_event(
    *,
    run_id: str,
    seq: int,
    type_: str,
    ts: datetime,
    iteration: int,
    state: str | None,
    version: int,
    data: dict[str, Any],
) -> Event:
    """An Event from stored columns; StoreSchemaError for a type this code does not know."""
    try:
        event_type = EventType(type_)
    except ValueError as exc:
        raise StoreSchemaError(
            f"run {run_id} seq {seq}: unknown event type {type_!r} (written by a newer fsm-kernel?)"
        ) from exc
    return Event(
        run_id=run_id,
        seq=int(seq),
        type=event_type,
        timestamp=ts.astimezone(UTC),
        iteration=int(iteration),
        state=state,
        data=data,
        version=int(version),
    )


def check_events(events: Sequence[Event]) -> None:
    """Reject what no backend may store: an empty run id, seq < 1, a naive timestamp."""
    for event in events:
        if not event.run_id:
            raise StoreError(f"event seq {event.seq} has an empty run_id")
        if event.seq < 1:
            raise StoreError(f"event {event.run_id}#{event.seq}: seq must be >= 1")
        ts = event.timestamp
        if ts.tzinfo is not UTC and (ts.tzinfo is None or ts.utcoffset() is None):
            raise StoreError(f"event {event.run_id}#{event.seq}: timestamp must be timezone-aware")


RUNNING = "running"
WAITING = "waiting"
ENDED = "ended"
SUMMARY_STATUSES = frozenset({RUNNING, WAITING, ENDED})
"""The values of the runs table's status column."""
INTERRUPTED = "interrupted"
"""RunSummary.status of a run recorded as running whose lock no process holds: the process
driving it died (killed, crashed, the machine stopped). Decided when read, never stored:
a resume makes it `running` again."""
RUN_SUSPENDED = "run.suspended"
"""The event a run that waits for a person (an approval, an input) ends its log with. Compared
by its value: the status of a run is read the same way whichever code wrote the log."""


def status_after(event: Event) -> str | None:
    """The run's status once `event` happened, None when the event does not change it:
    `running` from its start or a resume (which reopens an ending or a suspension), `waiting`
    from a suspension, `ended` from its end (see RunSummary.status)."""
    kind = event.type.value
    if kind in (EventType.RUN_STARTED, EventType.RUN_RESUMED):
        return RUNNING
    if kind == RUN_SUSPENDED:
        return WAITING
    if kind == EventType.RUN_TERMINATED:
        return ENDED
    return None


def tokens_of(event: Event) -> int:
    """The tokens a model answer used (prompt + completion as the server reported them, else
    its total); 0 for any other event."""
    if event.type is not EventType.MODEL_RESPONDED:
        return 0
    completion = event.data.get("completion")
    usage = completion.get("usage") if isinstance(completion, dict) else None
    if not isinstance(usage, dict):
        return 0
    try:
        counts = [int(usage.get(key) or 0) for key in _USAGE_KEYS]
    except (TypeError, ValueError):
        return 0
    prompt, completion_tokens, total = counts
    return prompt + completion_tokens or total


_USAGE_KEYS = ("prompt_tokens", "completion_tokens", "total_tokens")


@dataclass(kw_only=True, slots=True)
class RunDelta:
    """What one appended batch changes in one run's `runs` row."""

    run_id: str
    first_ts: datetime
    last_ts: datetime
    workflow: str | None = None
    goal: str | None = None
    parent_run_id: str | None = None
    started_at: datetime | None = None
    iterations: int = 0
    termination_reason: str | None = None
    tokens: int = 0
    """Tokens the batch's model answers used (added to the run's)."""
    status: str | None = None
    """The run's status after the batch; None when the batch does not change it."""

    @property
    def reopens(self) -> bool:
        """The batch leaves the run running (a start or a resume): no earlier ending stands."""
        return self.status == RUNNING

    @property
    def is_quiet(self) -> bool:
        """The batch changes nothing in an existing `runs` row (bookkeeping events only)."""
        return (
            self.started_at is None
            and self.iterations == 0
            and self.termination_reason is None
            and self.tokens == 0
            and self.status is None
        )

    @property
    def is_progress(self) -> bool:
        """The batch changes at most the iterations, tokens and times of the run: it holds no
        start, resumption, suspension or ending, each of which sets the status (and only they
        set workflow, goal, started_at or termination_reason)."""
        return self.status is None

    def apply(self, event: Event) -> None:
        ts = event.timestamp
        if ts < self.first_ts:
            self.first_ts = ts
        elif ts > self.last_ts:
            self.last_ts = ts
        if event.type not in _SUMMARIZED:
            return  # bookkeeping: only the times
        self.tokens += tokens_of(event)
        self.status = status_after(event) or self.status
        # Its model calls so far, as RunResult.iterations counts them: a run that waits for
        # a person, or ended, in the middle of an iteration has made that iteration's call.
        self.iterations = max(self.iterations, event.iteration)
        if event.type is EventType.RUN_RESUMED:
            self.termination_reason = None  # the ending it reopens is no longer the run's
        if event.type is EventType.RUN_STARTED:
            self.workflow = str(event.data.get("workflow") or "")
            self.goal = str(event.data.get("goal") or "")
            parent = event.data.get("parent_run_id")
            self.parent_run_id = str(parent) if parent else None
            self.started_at = event.timestamp
        elif event.type is EventType.RUN_TERMINATED:
            reason = event.data.get("reason")
            self.termination_reason = None if reason is None else str(reason)

    def merge_into(self, summary: RunSummary | None) -> RunSummary:
        """The run's summary after this batch (used by stores that keep summaries in memory)."""
        if summary is None:
            return RunSummary(
                run_id=self.run_id,
                workflow=self.workflow or "",
                goal=self.goal or "",
                parent_run_id=self.parent_run_id,
                started_at=self.started_at or self.first_ts,
                iterations=self.iterations,
                termination_reason=self.termination_reason,
                tokens=self.tokens,
                status=self.status or RUNNING,
                updated_at=self.last_ts,
            )
        if self.is_quiet:
            return summary
        updated = summary.updated_at
        reason = self.termination_reason
        if not self.reopens:
            reason = reason or summary.termination_reason
        return RunSummary(
            run_id=self.run_id,
            workflow=summary.workflow if self.workflow is None else self.workflow,
            goal=summary.goal if self.goal is None else self.goal,
            parent_run_id=summary.parent_run_id if self.started_at is None else self.parent_run_id,
            started_at=summary.started_at if self.started_at is None else self.started_at,
            iterations=max(summary.iterations, self.iterations),
            termination_reason=reason,
            tokens=summary.tokens + self.tokens,
            status=self.status or summary.status,
            updated_at=self.last_ts if updated is None else max(updated, self.last_ts),
        )


_SUMMARIZED = frozenset(
    {
        EventType.RUN_STARTED,
        EventType.RUN_RESUMED,
        EventType.RUN_SUSPENDED,
        EventType.RUN_TERMINATED,
        EventType.ITERATION_COMPLETED,
        EventType.MODEL_RESPONDED,
    }
)
"""The events that change a run's summary beyond its times (see RunDelta.apply)."""


def summarize_batch(events: Iterable[Event]) -> list[RunDelta]:
    """One RunDelta per run touched by the batch, in order of first appearance."""
    deltas: dict[str, RunDelta] = {}
    for event in events:
        delta = deltas.get(event.run_id)
        if delta is None:
            delta = RunDelta(run_id=event.run_id, first_ts=event.timestamp, last_ts=event.timestamp)
            deltas[event.run_id] = delta
        delta.apply(event)
    return list(deltas.values())


def check_page(limit: int, before: str | None, after: str | None) -> None:
    """Refuse a negative page size, or paging both ways at once."""
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if before is not None and after is not None:
        raise ValueError("give before or after, not both")


AMBIGUOUS_SHOWN = 10
"""How many candidates an ambiguous prefix error lists; backends fetch one more."""


def clean_prefix(prefix: str) -> str:
    """The prefix to look up; RunNotFoundError for an empty one (it would match every run)."""
    cleaned = prefix.strip()
    if not cleaned:
        raise RunNotFoundError("no run id given", run_id=prefix)
    return cleaned


SHORT_ID_LENGTH = 8
"""The fewest characters of a run id shown where the full id would not fit."""


def unique_prefix(
    run_id: str, before: str | None, after: str | None, *, at_least: int = SHORT_ID_LENGTH
) -> str:
    """The shortest prefix of `run_id` (at least `at_least` characters, never ending in `-`)
    that no other stored id starts with, given its neighbours in byte order (`before` and
    `after`, None at either end): every other id shares less with it than they do."""
    shared = max(_common_length(run_id, before), _common_length(run_id, after))
    length = max(at_least, shared + 1)
    while length < len(run_id) and run_id[length - 1] == "-":
        length += 1
    return run_id[:length]


def _common_length(a: str, b: str | None) -> int:
    if b is None:
        return 0
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def resolve_run(prefix: str, matches: Sequence[str]) -> str:
    """The one run id `prefix` names, from the sorted ids starting with it (at most
    AMBIGUOUS_SHOWN + 1 of them).

    Raises:
        RunNotFoundError: no run matches, or several do (the message lists them).
    """
    if prefix in matches:
        return prefix
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise RunNotFoundError(f"no run with id or id prefix {prefix!r}", run_id=prefix)
    shown = ", ".join(matches[:AMBIGUOUS_SHOWN])
    more = ", ..." if len(matches) > AMBIGUOUS_SHOWN else ""
    raise RunNotFoundError(
        f"run id prefix {prefix!r} is ambiguous; it matches {shown}{more}", run_id=prefix
    )
