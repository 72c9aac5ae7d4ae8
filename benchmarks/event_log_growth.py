"""Event log growth: synthetic runs of 50 to 500 iterations written to a fresh SQLite store each,
one durable append per event, to show that the log grows linearly with the iteration count
(every model answer and tool output stored once, never re-stored as snapshots).

    python benchmarks/event_log_growth.py [--sizes 50,100,250,500] [--json] [--keep DIR]

Exits 1 when bytes/iteration at the largest size exceed 1.5x those at the smallest.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from fsm_kernel.protocol import Event, EventType, new_id
from fsm_kernel.store import SqliteEventStore

MAX_RATIO = 1.5
STATES = ("observe", "think", "act", "evaluate")
T0 = datetime(2026, 1, 1, tzinfo=UTC)
WORDS = (
    "the file lists three modules and a test suite; next I will read the config, check the "
    "schema, compare the totals, and call the tool again with the corrected path"
).split()


@dataclass(frozen=True)
class Row:
    iterations: int
    events: int
    db_bytes: int
    bytes_per_iteration: float
    events_per_s: float


def _text(rng: random.Random, size: int) -> str:
    """About `size` characters of varied prose (so nothing is repeated verbatim)."""
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < size:
        words.append(rng.choice(WORDS))
    return " ".join(words)[:size]


def _iteration(run_id: str, n: int, rng: random.Random) -> Iterator[tuple[EventType, str, dict]]:
    """The events of one iteration, as (type, state, data)."""
    call_id = f"call_{n}"
    for i, state in enumerate(STATES):
        yield EventType.STATE_ENTERED, state, {}
        target = STATES[(i + 1) % len(STATES)]
        yield EventType.TRANSITION_TAKEN, state, {"source": state, "target": target}
        if state == "think":
            yield EventType.MODEL_REQUESTED, state, {"messages": 2 + 2 * n, "tools": 4}
            message = {
                "role": "assistant",
                "content": _text(rng, 300),
                "tool_calls": [
                    {"id": call_id, "name": "read_file", "arguments": {"path": f"src/m{n}.py"}}
                ],
            }
            usage = {"prompt_tokens": 900 + 40 * n, "completion_tokens": 80, "total_tokens": 0}
            yield (
                EventType.MODEL_RESPONDED,
                state,
                {"message": message, "finish_reason": "tool_calls", "usage": usage, "latency": 1.2},
            )
        if state == "act":
            yield EventType.TOOL_STARTED, state, {"id": call_id, "name": "read_file"}
            yield (
                EventType.TOOL_FINISHED,
                state,
                {
                    "id": call_id,
                    "name": "read_file",
                    "is_error": False,
                    "content": _text(rng, 500),
                    "duration": 0.01,
                },
            )
    summary = {"decision": "tool_calls", "tool": "read_file", "summary": f"read src/m{n}.py"}
    yield EventType.ITERATION_COMPLETED, "evaluate", summary


def synthetic_run(iterations: int, *, seed: int = 7) -> list[Event]:
    """A whole run: run.started, `iterations` iterations, run.terminated."""
    rng = random.Random(seed)
    run_id = new_id()
    specs: list[tuple[EventType, str | None, dict, int]] = [
        (EventType.RUN_STARTED, None, {"workflow": "default", "goal": "summarize src/"}, 0)
    ]
    for n in range(1, iterations + 1):
        specs.extend((t, s, d, n) for t, s, d in _iteration(run_id, n, rng))
    specs.append((EventType.RUN_TERMINATED, None, {"reason": "max_iterations"}, iterations))
    return [
        Event(
            run_id=run_id,
            seq=seq,
            type=type_,
            timestamp=T0 + timedelta(milliseconds=seq),
            iteration=iteration,
            state=state,
            data=data,
        )
        for seq, (type_, state, data, iteration) in enumerate(specs, start=1)
    ]


def measure(iterations: int, directory: Path) -> Row:
    path = directory / f"run-{iterations}.db"
    events = synthetic_run(iterations)
    with SqliteEventStore(path) as store:
        start = time.perf_counter()
        for event in events:
            store.append([event])  # one durable transaction per event: the worst case
        elapsed = time.perf_counter() - start
        assert len(store.read(events[0].run_id)) == len(events)
    # Closing the last connection checkpoints the WAL into the main file.
    size = sum(p.stat().st_size for p in directory.glob(f"{path.name}*"))
    return Row(
        iterations=iterations,
        events=len(events),
        db_bytes=size,
        bytes_per_iteration=size / iterations,
        events_per_s=len(events) / elapsed,
    )


def _print_table(rows: list[Row], ratio: float) -> None:
    print(f"{'iterations':>10} {'events':>7} {'db bytes':>10} {'bytes/iter':>10} {'events/s':>9}")
    for r in rows:
        print(
            f"{r.iterations:>10} {r.events:>7} {r.db_bytes:>10} "
            f"{r.bytes_per_iteration:>10.0f} {r.events_per_s:>9.0f}"
        )
    first, last = rows[0].iterations, rows[-1].iterations
    verdict = "linear" if ratio <= MAX_RATIO else f"NOT linear (limit {MAX_RATIO})"
    print(f"bytes/iteration at {last} vs {first}: {ratio:.2f}x -> {verdict}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", default="50,100,250,500", help="iteration counts, comma-separated"
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--keep", type=Path, help="write the databases here and keep them")
    args = parser.parse_args(argv)
    sizes = sorted(int(s) for s in args.sizes.split(","))
    with tempfile.TemporaryDirectory(prefix="fsmk-growth-") as tmp:
        directory = args.keep or Path(tmp)
        directory.mkdir(parents=True, exist_ok=True)
        rows = [measure(n, directory) for n in sizes]
    ratio = rows[-1].bytes_per_iteration / rows[0].bytes_per_iteration
    ok = ratio <= MAX_RATIO
    if args.json:
        print(json.dumps({"rows": [asdict(r) for r in rows], "ratio": ratio, "ok": ok}, indent=2))
    else:
        _print_table(rows, ratio)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
