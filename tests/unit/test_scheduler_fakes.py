"""Test doubles shared by the scheduler tests: a manual clock, a gated sleep that lets a test
step the cron loop tick by tick, and scripted agent runners. (No tests of its own.)"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

from fsm_kernel.scheduler import AgentSpec, RunOutcome, SchedulerConfig

START = datetime(2026, 2, 11, 10, 0, 30, tzinfo=UTC)


class FakeClock:
    """Time stands still until the test advances it."""

    def __init__(self, start: datetime = START) -> None:
        self._now = start
        self._mono = 1000.0

    def now(self) -> datetime:
        return self._now

    def monotonic(self) -> float:
        return self._mono

    def advance(self, seconds: float) -> None:
        self._now += timedelta(seconds=seconds)
        self._mono += seconds


class GatedSleep:
    """An injected sleep that blocks until the test calls `advance()`, which moves the fake clock
    by the requested delay (plus `extra`, to simulate a stalled process) and wakes the sleeper."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self._requests: asyncio.Queue[tuple[float, asyncio.Event]] = asyncio.Queue()

    async def __call__(self, seconds: float) -> None:
        permit = asyncio.Event()
        await self._requests.put((seconds, permit))
        await permit.wait()

    async def advance(self, *, extra: float = 0.0) -> float:
        seconds, permit = await asyncio.wait_for(self._requests.get(), 5)
        self.clock.advance(seconds + extra)
        permit.set()
        return seconds


async def wait_until(predicate: Callable[[], bool], *, what: str = "condition") -> None:
    """Yield to the loop (and its worker threads) until `predicate` holds; fail after ~5 s."""
    for _ in range(1000):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


class ScriptedRunner:
    """A fake AgentRunner. `behaviours` maps agent_id to ok | fail | raise | hang | block
    (block waits for `release`). Records every call and the peak number of concurrent runs;
    with `hold_until_peak`, each run waits until that many runs are active (or 2 s pass), so the
    peak is reached deterministically when the engine does run them in parallel."""

    def __init__(
        self, behaviours: dict[str, str] | None = None, *, hold_until_peak: int = 0
    ) -> None:
        self.behaviours = behaviours or {}
        self.hold_until_peak = hold_until_peak
        self.calls: list[tuple[str, str]] = []
        self.active = 0
        self.peak = 0
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self._peak_reached = asyncio.Event()
        self.cancelled: list[str] = []

    async def __call__(self, agent: AgentSpec, prompt: str) -> RunOutcome:
        self.calls.append((agent.agent_id, prompt))
        self.active += 1
        self.peak = max(self.peak, self.active)
        self.started.set()
        if self.hold_until_peak and self.active >= self.hold_until_peak:
            self._peak_reached.set()
        try:
            return await self._behave(agent.agent_id)
        except asyncio.CancelledError:
            self.cancelled.append(agent.agent_id)
            raise
        finally:
            self.active -= 1

    async def _behave(self, agent_id: str) -> RunOutcome:
        if self.hold_until_peak:
            try:
                await asyncio.wait_for(self._peak_reached.wait(), 2)
            except TimeoutError:
                pass  # the peak assertion will report it
        behaviour = self.behaviours.get(agent_id, "ok")
        if behaviour == "fail":
            return RunOutcome(ok=False, run_id=f"run-{agent_id}", termination_reason="no_progress")
        if behaviour == "raise":
            raise RuntimeError(f"boom in {agent_id}\nsecond line of the traceback text")
        if behaviour == "hang":
            await asyncio.Event().wait()
        if behaviour == "block":
            await self.release.wait()
        return RunOutcome(ok=True, run_id=f"run-{agent_id}", termination_reason="done")

    def agent_ids(self) -> list[str]:
        return [agent_id for agent_id, _ in self.calls]


def make_config(
    tmp_path: Path,
    agents: Iterable[dict[str, Any] | str] = (),
    **overrides: Any,
) -> SchedulerConfig:
    """A config with its state dir and SQLite store under tmp_path; agents given as ids or dicts."""
    specs = [
        {"agent_id": a, "prompt": f"{a}: {{STATE}}"} if isinstance(a, str) else a for a in agents
    ]
    values: dict[str, Any] = {
        "kernel_id": "k1",
        "state_dir": str(tmp_path / "state"),
        "store": str(tmp_path / "runs.db"),
        "agents": specs,
    }
    values.update(overrides)
    return SchedulerConfig.model_validate(values)


def pg_url(dsn: str) -> str:
    """The pg_dsn fixture's key=value DSN as a postgresql:// URL (what open_queue recognises)."""
    from psycopg.conninfo import conninfo_to_dict

    info = conninfo_to_dict(dsn)
    dbname = info.pop("dbname", "postgres")
    query = "&".join(f"{k}={quote(str(v), safe='')}" for k, v in sorted(info.items()))
    return f"postgresql:///{dbname}?{query}"
