# ruff: noqa: C901, E501 -- a report script: wide tables, one function per part
"""fsm-kernel against LangGraph and Apache Burr on the same agent loop, in one run.

    pip install -e '.[bench]'
    python benchmarks/compare.py [--json results.json]          # the full run, ~5-6 minutes
    python benchmarks/compare.py --quick                         # a smoke run, ~30 seconds
    python benchmarks/compare.py --pg-dsn postgresql://...       # adds fsm-kernel on PostgreSQL
    python benchmarks/compare.py --pg                            # ... on a throwaway cluster

Four parts (`--parts overhead,growth,concurrency,startup` picks some):

1. overhead: the loop of _loop.py (a zero-latency scripted model, one `echo` tool call per
   iteration, N iterations) in every contender, each in its own process (_contenders.py),
   asked in turn round after round (round-robin); per contender the median µs per iteration,
   bytes written per iteration (/proc/self/io: write_bytes, pages dirtied towards the disk,
   and wchar, bytes handed to write calls, including closing the store) and the store's size;
   medians of per-round ratios against the floor and each peer. Every run's final
   conversation is checked against the reference. fsm-kernel runs as a user gets it, its
   tool's 30 s timeout enforced on a pool thread (the targets are assessed so), and also
   with no timeout (`_inline`), its tool called on the loop's thread as the peers call theirs.
2. growth: one run of --growth-n (1,000) iterations per contender sampling the I/O counters at
   each iteration, then --growth-rounds (5) runs timed by the clock alone; cycle time (model
   call to model call) and bytes per iteration at iterations 1-10 against the last 10 (the
   median of each window's iterations of every timed round, pooled), written (wchar) and
   stored (the payload each framework stores per iteration; for LangGraph and Burr,
   checkpoints and writes grouped by step, two steps an iteration).
3. concurrency: --runs (500) runs of --conc-iterations (5) model calls in one process against a
   fake OpenAI server with --latency (50 ms) per request (a separate process: _asyncio_llm.py,
   the test suite's replies from a minimal asyncio server, since the thread-per-connection
   tests/fakes server, `--server tests` via _fake_llm.py, costs more CPU than the client);
   model calls per second of fsm-kernel (no store, SQLite; `Agent`, plain answers) against raw
   httpx requests per second at the same concurrency (a minimal loop: _concurrency.py; the
   target), and against the same loop on fsm-kernel's one-shot transport (its leanest peer), and
   the peak RSS of each process; medians over --conc-rounds.
4. startup: wall time of `fsm-kernel --help` and `fsm-kernel validate workflows/default.yaml`
   (and of `python -c pass` for scale), median of --startup-runs.

These 2-core machines are noisy: compare ratios measured in one run, not absolute times.
Prints a table; `--json PATH` writes every figure. Exits 0 (targets are reported, not enforced).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import quote

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PY = sys.executable

IN_MEMORY = [
    "floor",
    "fsm_memory",
    "fsm_memory_inline",
    "langgraph_memory",
    "langgraph_lean_memory",
    "burr_memory",
]
DURABLE = [
    "fsm_sqlite",
    "fsm_sqlite_inline",
    "fsm_jsonl",
    "langgraph_sqlite_async",
    "langgraph_sqlite_sync",
    "langgraph_lean_sqlite_sync",
    "burr_sqlite",
]
PEERS = [
    "floor",
    "fsm_memory",
    "langgraph_memory",
    "langgraph_lean_memory",
    "burr_memory",
    "fsm_sqlite",
    "langgraph_sqlite_sync",
    "langgraph_lean_sqlite_sync",
    "burr_sqlite",
]
LABELS = {
    "floor": "hand-written Python loop (floor)",
    "fsm_memory": "fsm-kernel, no store",
    "fsm_sqlite": "fsm-kernel, SQLite store",
    "fsm_jsonl": "fsm-kernel, JSONL store",
    "fsm_memory_inline": "fsm-kernel, no store, tool inline",
    "fsm_sqlite_inline": "fsm-kernel, SQLite, tool inline",
    "fsm_postgres": "fsm-kernel, PostgreSQL store",
    "langgraph_memory": "LangGraph, no checkpointer",
    "langgraph_sqlite_async": "LangGraph, SqliteSaver, durability=async",
    "langgraph_sqlite_sync": "LangGraph, SqliteSaver, durability=sync",
    "langgraph_lean_memory": "LangGraph lean (dict state), no checkpointer",
    "langgraph_lean_sqlite_sync": "LangGraph lean (dict state), SqliteSaver sync",
    "burr_memory": "Burr, no persister",
    "burr_sqlite": "Burr, SQLitePersister",
}


# --- a throwaway PostgreSQL (--pg) --------------------------------------------------------------


@contextmanager
def throwaway_postgres() -> Iterator[str]:
    """initdb + pg_ctl into a temp dir (Unix socket only), with the server's durable defaults
    (fsync, synchronous_commit), stopped and removed afterwards."""
    bins = [Path("/usr/lib/postgresql") / v / "bin" for v in ("17", "16", "15", "14")]
    found = {
        n: next((str(b / n) for b in bins if (b / n).exists()), shutil.which(n))
        for n in ("initdb", "pg_ctl")
    }
    if not all(found.values()):
        raise SystemExit("--pg needs initdb and pg_ctl (apt-get install postgresql)")
    as_pg = (
        (lambda cmd: ["runuser", "-u", "postgres", "--", *cmd])
        if os.geteuid() == 0
        else (lambda cmd: cmd)
    )
    root = Path(tempfile.mkdtemp(prefix="fsmk-compare-pg-"))
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
    data, port = root / "data", 57000 + os.getpid() % 900
    try:
        subprocess.run(
            as_pg([found["initdb"], "-D", str(data), "-A", "trust", "-U", "postgres"]),
            check=True,
            capture_output=True,
        )
        opts = f"-p {port} -k {root} -c listen_addresses=''"
        subprocess.run(
            as_pg(
                [
                    found["pg_ctl"],
                    "-D",
                    str(data),
                    "-l",
                    str(root / "log"),
                    "-w",
                    "-o",
                    opts,
                    "start",
                ]
            ),
            check=True,
            capture_output=True,
        )
        yield f"postgresql:///postgres?host={quote(str(root), safe='')}&port={port}&user=postgres"
    finally:
        subprocess.run(
            as_pg([found["pg_ctl"], "-D", str(data), "-m", "fast", "-w", "stop"]),
            capture_output=True,
            check=False,
        )
        shutil.rmtree(root, ignore_errors=True)


# --- workers ---------------------------------------------------------------------------------


class Worker:
    """One contender's process (see _contenders.py)."""

    def __init__(self, name: str, pg_dsn: str | None) -> None:
        self.name = name
        cmd = [PY, str(HERE / "_contenders.py"), name]
        if pg_dsn:
            cmd += ["--pg-dsn", pg_dsn]
        env = {**os.environ, "PYTHONHASHSEED": "0", "LANGSMITH_TRACING": "false"}
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO
        )

    def ready(self) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != "READY":
            raise RuntimeError(f"{self.name}: worker failed to start (exit {self.proc.wait()})")

    def ask(self, n: int, **flags: bool) -> dict[str, Any]:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        # Each run starts on a quiet disk: the writes another contender left in the page cache
        # (a 1,000-iteration LangGraph run leaves about 1 GB) are on disk first, so no run's
        # syncs queue behind them.
        os.sync()
        self.proc.stdin.write(json.dumps({"n": n, **flags}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name}: worker died (exit {self.proc.wait()})")
        result: dict[str, Any] = json.loads(line)
        return result

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start_workers(names: Sequence[str], pg_dsn: str | None) -> dict[str, Worker]:
    workers = {name: Worker(name, pg_dsn) for name in names}
    for w in workers.values():
        w.ready()
    return workers


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


# --- 1. overhead -----------------------------------------------------------------------------


def overhead(workers: dict[str, Worker], n: int, rounds: int) -> dict[str, Any]:
    names = list(workers)
    per_round: list[dict[str, float]] = []
    raw: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]  # rotate who goes first
        this: dict[str, float] = {}
        for name in order:
            out = workers[name].ask(n)
            if "error" in out:
                raise RuntimeError(f"{name}: {out['error']}")
            out.pop("calls", None)
            raw[name].append(out)
            this[name] = out["seconds"] / n * 1e6
        per_round.append(this)
        print(
            f"  round {r + 1}/{rounds}: " + ", ".join(f"{k} {v:.0f}" for k, v in this.items()),
            file=sys.stderr,
        )
    results: dict[str, Any] = {}
    for name in names:
        runs = raw[name]
        results[name] = {
            "label": LABELS.get(name, name),
            "us_per_iteration": _median([x[name] for x in per_round]),
            "us_per_iteration_rounds": [round(x[name], 1) for x in per_round],
            "write_bytes_per_iteration": _median([o["write_bytes"] for o in runs]) / n,
            "wchar_per_iteration": _median([o["wchar"] for o in runs]) / n,
            "store_bytes": _median([o["store_bytes"] for o in runs]),
            "history_ok": all(o["ok"] for o in runs),
        }
    ratios = {
        a: {b: _median([x[a] / x[b] for x in per_round]) for b in names if b != a} for a in names
    }
    return {"n": n, "rounds": rounds, "contenders": results, "ratios": ratios}


# --- 2. growth -------------------------------------------------------------------------------


def _window(rounds: Sequence[Sequence[float]], first: bool, size: int = 10) -> float:
    """The median of the first (or last) `size` samples of every round, pooled."""
    return _median([v for values in rounds for v in (values[:size] if first else values[-size:])])


def growth(workers: dict[str, Worker], n: int, rounds: int = 5) -> dict[str, Any]:
    """Each contender's growth: first one run that samples the I/O counters at every iteration
    (bytes per iteration), then `rounds` runs timed with nothing but the clock (reading
    /proc/self/io costs 40-80 µs a time, and how much varies: it put phases of +15% into the
    cycle times). Rounds go round-robin; the I/O run comes first, so every timed run is a
    process's second run of that length or later. A window's time is the median of that
    window's iterations in every timed round, pooled; each round's own ratio is beside it."""
    sampled = {
        name: _growth_round(name, worker, n, sample_io=True) for name, worker in workers.items()
    }
    timed: dict[str, list[dict[str, Any]]] = {name: [] for name in workers}
    for _ in range(rounds):
        for name, worker in workers.items():
            timed[name].append(_growth_round(name, worker, n, sample_io=False))
    results: dict[str, Any] = {}
    for name, samples in timed.items():
        entry = results[name] = _growth_entry(name, samples, sampled[name])
        print(
            f"  growth {name}: x{entry['time_ratio']:.2f} (rounds {entry['rounds_time_ratio']}), "
            f"x{entry['time_ratio_100']:.2f} over 100 (rounds {entry['rounds_time_ratio_100']})",
            file=sys.stderr,
        )
    return {"n": n, "rounds": rounds, "contenders": results}


def _growth_round(name: str, worker: Worker, n: int, *, sample_io: bool) -> dict[str, Any]:
    """One run of `n` iterations: per iteration, its cycle time (µs, model call to model
    call), and with `sample_io` the bytes handed to write calls, dirtied towards the disk and
    stored."""
    t0 = time.perf_counter()
    out = worker.ask(n, sample_io=sample_io, stored=sample_io)
    if "error" in out:
        raise RuntimeError(f"{name}: {out['error']}")
    calls, io = out["calls"], out.get("io", [])
    stored = out.get("stored_per_iteration")
    return {
        "ok": out["ok"],
        "seconds": time.perf_counter() - t0,
        "us_per_iteration": out["seconds"] / n * 1e6,
        "store_bytes": out["store_bytes"],
        "cycles": [(b - a) * 1e6 for a, b in itertools.pairwise(calls[: n + 1])],
        "written": [float(b[1] - a[1]) for a, b in itertools.pairwise(io[: n + 1])],
        "disk": [float(b[0] - a[0]) for a, b in itertools.pairwise(io[: n + 1])],
        "stored": [float(v) for v in stored[1 : n + 1]] if stored else None,
    }


def _growth_entry(
    name: str, timed: Sequence[dict[str, Any]], sampled: dict[str, Any]
) -> dict[str, Any]:
    cycles = [s["cycles"] for s in timed]
    written, disk = [sampled["written"]], [sampled["disk"]]
    entry: dict[str, Any] = {
        "label": LABELS.get(name, name),
        "history_ok": sampled["ok"] and all(s["ok"] for s in timed),
        "seconds": round(sampled["seconds"] + sum(s["seconds"] for s in timed), 2),
        "us_per_iteration": _median([s["us_per_iteration"] for s in timed]),
        "cycle_us_first10": _window(cycles, True),
        "cycle_us_last10": _window(cycles, False),
        "cycle_us_first100": _window(cycles, True, 100),
        "cycle_us_last100": _window(cycles, False, 100),
        # Medians: a checkpoint (SQLite) or a page split lands in one window or not.
        "wchar_first10": _window(written, True),
        "wchar_last10": _window(written, False),
        "write_bytes_first10": _window(disk, True),
        "write_bytes_last10": _window(disk, False),
        "wchar_mean_first100": sum(written[0][:100]) / 100,
        "wchar_mean_last100": sum(written[0][-100:]) / 100,
        "store_bytes": sampled["store_bytes"],
    }
    entry["time_ratio"] = entry["cycle_us_last10"] / entry["cycle_us_first10"]
    entry["time_ratio_100"] = entry["cycle_us_last100"] / entry["cycle_us_first100"]
    entry["rounds_time_ratio"] = [
        round(_window([c], False) / _window([c], True), 3) for c in cycles
    ]
    entry["rounds_time_ratio_100"] = [
        round(_window([c], False, 100) / _window([c], True, 100), 3) for c in cycles
    ]
    if entry["wchar_first10"]:
        entry["wchar_ratio"] = entry["wchar_last10"] / entry["wchar_first10"]
    if sampled["stored"]:
        entry["stored_first10"] = _window([sampled["stored"]], True)
        entry["stored_last10"] = _window([sampled["stored"]], False)
        entry["stored_ratio"] = entry["stored_last10"] / entry["stored_first10"]
    return entry


# --- 3. concurrency --------------------------------------------------------------------------


def concurrency(
    runs: int, iterations: int, latency: float, rounds: int, modes: Sequence[str], server_kind: str
) -> dict[str, Any]:
    script = "_asyncio_llm.py" if server_kind == "asyncio" else "_fake_llm.py"
    server = subprocess.Popen(
        [
            PY,
            str(HERE / script),
            "--latency",
            str(latency),
            "--iterations",
            str(iterations),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert server.stdout is not None
        ready = server.stdout.readline().split()
        if not ready or ready[0] != "READY":
            raise RuntimeError("the fake model server did not start")
        base_url = ready[1]
        samples: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        for r in range(rounds):
            for mode in modes:
                cmd = [
                    PY,
                    str(HERE / "_concurrency.py"),
                    mode,
                    "--base-url",
                    base_url,
                    "--runs",
                    str(runs),
                    "--iterations",
                    str(iterations),
                ]
                done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900)
                if done.returncode != 0:
                    raise RuntimeError(f"concurrency {mode}: {done.stderr.strip()[-500:]}")
                out = json.loads(done.stdout.strip().splitlines()[-1])
                out["per_second"] = out["requests"] / out["seconds"]
                samples[mode].append(out)
                print(
                    f"  concurrency round {r + 1} {mode}: {out['per_second']:.0f}/s",
                    file=sys.stderr,
                )
    finally:
        if server.stdin is not None:
            server.stdin.close()
        server.terminate()
        server.wait(timeout=10)
    results = {
        mode: {
            "per_second": _median([s["per_second"] for s in samples[mode]]),
            "seconds": _median([s["seconds"] for s in samples[mode]]),
            "peak_rss_mib": max(s["peak_rss_mib"] for s in samples[mode]),
        }
        for mode in modes
    }
    for mode in modes:
        for peer in ("raw", "raw_oneshot"):
            if mode.startswith("fsm") and peer in samples:
                ratios = [
                    s["per_second"] / r["per_second"]
                    for s, r in zip(samples[mode], samples[peer], strict=True)
                ]
                results[mode][f"ratio_to_{peer}"] = _median(ratios)
    return {
        "server": server_kind,
        "runs": runs,
        "iterations": iterations,
        "latency_s": latency,
        "rounds": rounds,
        "results": results,
    }


# --- 4. start-up -----------------------------------------------------------------------------


def startup(runs: int) -> dict[str, Any]:
    # The console script installed beside this interpreter, not a shim found on PATH (pyenv's
    # shims are bash scripts that add ~0.1 s of their own).
    script = Path(PY).parent / "fsm-kernel"
    exe = str(script) if script.exists() else shutil.which("fsm-kernel")
    base = [exe] if exe else [PY, "-m", "fsm_kernel"]
    commands = {
        "python -c pass": [PY, "-c", "pass"],
        "fsm-kernel --help": [*base, "--help"],
        "fsm-kernel validate workflows/default.yaml": [*base, "validate", "workflows/default.yaml"],
    }
    results: dict[str, Any] = {}
    for label, cmd in commands.items():
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            subprocess.run(cmd, cwd=REPO, capture_output=True, check=True)
            times.append(time.perf_counter() - t0)
        results[label] = {"seconds": _median(times), "all": [round(t, 3) for t in times]}
    return results


# --- the report ------------------------------------------------------------------------------


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, limit: float, less: bool = True) -> None:
        if value is None:
            return
        ok = value <= limit if less else value >= limit
        out.append({"target": name, "value": round(value, 3), "limit": limit, "met": ok})

    ov = report.get("overhead")
    if ov:
        r = ov["ratios"]
        c = ov["contenders"]
        # issue 30's goals, against each peer's leanest form (a skeptic's comparison)
        if "langgraph_lean_memory" in r.get("fsm_memory", {}):
            add(
                "in memory: fsm-kernel / LangGraph lean",
                r["fsm_memory"]["langgraph_lean_memory"],
                0.5,
            )
        if "langgraph_lean_sqlite_sync" in r.get("fsm_sqlite", {}):
            add(
                "SQLite: fsm-kernel / LangGraph lean SqliteSaver sync",
                r["fsm_sqlite"]["langgraph_lean_sqlite_sync"],
                0.33,
            )
        if "burr_sqlite" in r.get("fsm_sqlite", {}):
            add("SQLite: fsm-kernel / Burr SQLitePersister", r["fsm_sqlite"]["burr_sqlite"], 0.25)
        if "fsm_sqlite" in c and "langgraph_sqlite_sync" in c:
            for key in ("write_bytes_per_iteration", "wchar_per_iteration"):
                lg = c["langgraph_sqlite_sync"][key]
                if lg:
                    add(
                        f"bytes written/iteration ({key.split('_per')[0]}): fsm-kernel SQLite / LangGraph sync",
                        c["fsm_sqlite"][key] / lg,
                        0.5,
                    )
    gr = report.get("growth")
    if gr:
        for name in ("fsm_memory", "fsm_sqlite", "fsm_jsonl"):
            e = gr["contenders"].get(name)
            if e:
                # issue 30: time growth <= 1.05x (issue 11's 1.1x still holds for the bytes)
                add(f"growth {name}: time, last 10 / first 10", e["time_ratio"], 1.05)
                add(f"growth {name}: time, last 100 / first 100", e["time_ratio_100"], 1.05)
                if "wchar_ratio" in e:
                    add(f"growth {name}: bytes written, last 10 / first 10", e["wchar_ratio"], 1.1)
                if "stored_ratio" in e:
                    add(f"growth {name}: bytes stored, last 10 / first 10", e["stored_ratio"], 1.1)
    co = report.get("concurrency")
    if co:
        for mode, e in co["results"].items():
            if "ratio_to_raw" in e:
                add(
                    f"concurrency {mode}: model calls/s / raw httpx requests/s",
                    e["ratio_to_raw"],
                    0.8,  # issue 30 (issue 11's was 0.5)
                    less=False,
                )
    st = report.get("startup")
    if st:
        add("start-up: fsm-kernel --help (s)", st["fsm-kernel --help"]["seconds"], 0.1)
    return out


def _kib(value: float) -> str:
    return f"{value / 1024:,.1f}"


def print_report(report: dict[str, Any]) -> None:
    ov = report.get("overhead")
    if ov:
        n = ov["n"]
        print(f"\n1. Overhead per iteration, N = {n}, {ov['rounds']} rounds round-robin (medians)")
        peers = [p for p in PEERS if p in ov["contenders"]]
        head = f"{'contender':44} {'µs/iter':>9} {'KiB written/iter':>16} {'KiB wchar/iter':>14} {'store KiB':>9} {'history':>7}"
        print(head + "".join(f" {'/' + p[:14]:>16}" for p in peers))
        for name, c in ov["contenders"].items():
            line = (
                f"{c['label']:44} {c['us_per_iteration']:9,.1f} {_kib(c['write_bytes_per_iteration']):>16} "
                f"{_kib(c['wchar_per_iteration']):>14} {_kib(c['store_bytes']):>9} "
                f"{'ok' if c['history_ok'] else 'WRONG':>7}"
            )
            line += "".join(
                f" {ov['ratios'][name][p]:16.2f}" if p != name else f" {'—':>16}" for p in peers
            )
            print(line)
    gr = report.get("growth")
    if gr:
        print(
            f"\n2. Growth: iterations 1-10 vs the last 10 of a {gr['n']}-iteration run (window medians / means)"
        )
        print(
            f"{'contender':44} {'µs/iter':>9} {'cycle µs 1-10':>13} {'last 10':>9} {'x':>5} {'x (100)':>7}"
            f" {'wchar B 1-10':>12} {'last 10':>9} {'x':>5} {'stored B 1-10':>13} {'last 10':>9} {'x':>5}"
        )
        for c in gr["contenders"].values():
            print(
                f"{c['label']:44} {c['us_per_iteration']:9,.0f} {c['cycle_us_first10']:13,.1f} "
                f"{c['cycle_us_last10']:9,.1f} {c['time_ratio']:5.2f} {c['time_ratio_100']:7.2f} "
                f"{c['wchar_first10']:12,.0f} {c['wchar_last10']:9,.0f} {c.get('wchar_ratio', float('nan')):5.2f} "
                f"{c.get('stored_first10', 0):13,.0f} {c.get('stored_last10', 0):9,.0f} "
                f"{c.get('stored_ratio', float('nan')):5.2f}"
            )
    co = report.get("concurrency")
    if co:
        print(
            f"\n3. Concurrency: {co['runs']} runs x {co['iterations']} model calls, "
            f"{co['latency_s'] * 1000:.0f} ms per request, one process, {co['rounds']} round(s)"
        )
        for mode, e in co["results"].items():
            ratio = f"{e['ratio_to_raw']:.2f}x raw" if "ratio_to_raw" in e else ""
            if "ratio_to_raw_oneshot" in e:
                ratio += f", {e['ratio_to_raw_oneshot']:.2f}x raw on the one-shot transport"
            print(
                f"  {mode:20} {e['per_second']:8,.0f} calls/s  {e['seconds']:6.2f} s  "
                f"peak RSS {e['peak_rss_mib']:6.1f} MiB  {ratio}"
            )
    st = report.get("startup")
    if st:
        print("\n4. Start-up (median wall time)")
        for label, e in st.items():
            print(f"  {label:44} {e['seconds']:.3f} s")
    print("\nTargets")
    for t in report["targets"]:
        mark = "met " if t["met"] else "MISS"
        op = ">=" if "concurrency" in t["target"] else "<="
        print(f"  [{mark}] {t['target']}: {t['value']} ({op} {t['limit']})")


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in (
        "fsm-kernel",
        "python-statemachine",
        "langgraph",
        "langgraph-checkpoint-sqlite",
        "langchain-core",
        "apache-burr",
        "httpx",
    ):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="overhead,growth,concurrency,startup")
    parser.add_argument("--contenders", help="comma-separated (default: all installed)")
    parser.add_argument("-n", type=int, default=50, help="iterations per overhead run (50)")
    parser.add_argument("--rounds", type=int, default=15, help="overhead rounds (15)")
    parser.add_argument("--growth-n", type=int, default=1000)
    parser.add_argument("--growth-rounds", type=int, default=5)
    parser.add_argument("--growth-contenders", help="comma-separated (default: all)")
    parser.add_argument("--runs", type=int, default=500, help="concurrent runs (500)")
    parser.add_argument("--conc-iterations", type=int, default=5)
    parser.add_argument("--latency", type=float, default=0.05)
    parser.add_argument("--conc-rounds", type=int, default=3)
    parser.add_argument("--conc-modes", default="raw,raw_oneshot,fsm_memory,fsm_sqlite")
    parser.add_argument(
        "--server",
        choices=["asyncio", "tests"],
        default="asyncio",
        help="the fake model server: a minimal asyncio one (default) or the test suite's "
        "thread-per-connection FakeOpenAIServer (its own CPU then limits raw httpx too)",
    )
    parser.add_argument("--startup-runs", type=int, default=7)
    parser.add_argument("--pg-dsn", help="also measure fsm-kernel on this PostgreSQL database")
    parser.add_argument(
        "--pg", action="store_true", help="start a throwaway PostgreSQL (initdb) for fsm_postgres"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: 5 rounds, growth over 200 (2 timed runs), 100 concurrent runs",
    )
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args(argv)
    if args.pg and not args.pg_dsn:
        with throwaway_postgres() as dsn:
            return main([*(argv if argv is not None else sys.argv[1:]), "--pg-dsn", dsn])
    if args.quick:
        args.rounds, args.growth_n, args.growth_rounds = 5, 200, 2
        args.runs, args.conc_rounds, args.startup_runs = 100, 1, 3
    parts = set(args.parts.split(","))
    names = list(LABELS) if args.contenders is None else args.contenders.split(",")
    if not args.pg_dsn:
        names = [n for n in names if n != "fsm_postgres"]
    missing = [n for n in names if n.startswith(("langgraph", "burr")) and not _installed(n)]
    if missing:
        print(f"skipping {', '.join(missing)}: pip install -e '.[bench]'", file=sys.stderr)
        names = [n for n in names if n not in missing]
    report: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "versions": versions(),
    }
    started = time.perf_counter()
    if parts & {"overhead", "growth"}:
        print(f"starting {len(names)} contender processes...", file=sys.stderr)
        workers = start_workers(names, args.pg_dsn)
        try:
            if "overhead" in parts:
                report["overhead"] = overhead(workers, args.n, args.rounds)
            if "growth" in parts:
                chosen = (
                    names if args.growth_contenders is None else args.growth_contenders.split(",")
                )
                report["growth"] = growth(
                    {k: v for k, v in workers.items() if k in chosen},
                    args.growth_n,
                    args.growth_rounds,
                )
        finally:
            for w in workers.values():
                w.close()
    if "concurrency" in parts:
        modes = args.conc_modes.split(",")
        if "raw" not in modes:
            modes.insert(0, "raw")
        report["concurrency"] = concurrency(
            args.runs, args.conc_iterations, args.latency, args.conc_rounds, modes, args.server
        )
    if "startup" in parts:
        report["startup"] = startup(args.startup_runs)
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["targets"] = targets(report)
    print_report(report)
    print(f"\n({report['seconds']} s; {report['versions']})")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _installed(name: str) -> bool:
    dist = "langgraph-checkpoint-sqlite" if name.startswith("langgraph") else "apache-burr"
    try:
        metadata.version(dist)
    except metadata.PackageNotFoundError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
