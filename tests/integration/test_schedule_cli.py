"""`fsm-kernel schedule --once`, `fsm-kernel dispatches` and scheduler config errors, end to end:
the CLI in process, kernel runs over real HTTP against FakeOpenAIServer, the dispatch queue and
the event log in one SQLite file under tmp_path, STATE.md on disk.

The config (tests/data/scheduler/three_agents.yaml) uses relative paths, so every test runs with
tmp_path as its working directory. The two enabled agents run in parallel, so the fake server
answers through one callable that tells them apart by the prompt in the user message.
"""

from __future__ import annotations

import importlib
import json
import re
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from fsm_kernel.cli import main
from fsm_kernel.scheduler import Dispatch, engine, open_queue
from tests.fakes.openai_server import (
    FakeOpenAIServer,
    Reply,
    call,
    http_error,
    text_reply,
    tool_reply,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "scheduler"
CONFIG = DATA / "three_agents.yaml"
KERNEL = "cli"
SEED = "# STATE\nseed-marker-41c7: nothing learned yet\n"
NEW_STATE = "# STATE\nwriter-marker-93b0: the writer was here\n"
WRITER, BREAKER = "WRITER-TASK", "BREAKER-TASK"
WRITER_REQUESTS, BREAKER_REQUESTS = 2, 1  # write_state, then the final answer; one 400
SUMMARY = re.compile(
    r"^tick \S+: dispatched (\d+), succeeded (\d+), failed (\d+), skipped (\d+)$", re.M
)


@dataclass
class Outcome:
    code: int
    out: str
    err: str


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tmp_path as the working directory: the config's state/ and kernel.db land there."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> Outcome:
    code = main(list(argv))
    captured = capsys.readouterr()
    return Outcome(code, captured.out, captured.err)


def schedule_once(
    capsys: pytest.CaptureFixture[str], server: FakeOpenAIServer, *extra: str
) -> Outcome:
    return cli(capsys, "schedule", str(CONFIG), "--once", "--base-url", server.base_url, *extra)


def user_prompt(body: dict[str, Any]) -> str:
    return next(m["content"] for m in body["messages"] if m["role"] == "user")


def requests_for(server: FakeOpenAIServer, marker: str) -> list[dict[str, Any]]:
    return [r for r in server.requests if marker in user_prompt(r)]


def model(*, breaker_fails: bool) -> Callable[[dict[str, Any]], Reply]:
    """The model of both agents: the writer calls write_state once, then answers; the breaker
    gets a 400 (or, when it should succeed, a plain answer)."""

    def reply(body: dict[str, Any]) -> Reply:
        prompt = user_prompt(body)
        answered = any(m["role"] == "tool" for m in body["messages"])
        if WRITER in prompt:
            if answered:
                return text_reply("STATE.md updated")
            return tool_reply(call("write_state", {"content": NEW_STATE}))
        if BREAKER in prompt:
            return http_error(400) if breaker_fails else text_reply("no change")
        return http_error(500, "unexpected prompt")

    return reply


def script(server: FakeOpenAIServer, *, breaker_fails: bool, cycles: int = 1) -> None:
    """One callable per expected request, so assert_complete() checks the request count."""
    replies = model(breaker_fails=breaker_fails)
    server.enqueue(*[replies] * ((WRITER_REQUESTS + BREAKER_REQUESTS) * cycles))


def state_file(workdir: Path) -> Path:
    return workdir / "state" / KERNEL / "STATE.md"


def dispatch_rows(capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    result = cli(capsys, "dispatches", str(CONFIG), "--json")
    assert result.code == 0, result.err
    rows: list[dict[str, Any]] = json.loads(result.out)
    return rows


def summary(out: str) -> tuple[int, int, int, int]:
    """(dispatched, succeeded, failed, skipped) of the one cycle line printed."""
    found = SUMMARY.findall(out)
    assert len(found) == 1, f"expected one cycle summary line, got {out!r}"
    dispatched, succeeded, failed, skipped = (int(n) for n in found[0])
    return dispatched, succeeded, failed, skipped


class SteppedClock:
    """The scheduler engine's wall clock, moved by hand (the tick is taken from it)."""

    def __init__(self) -> None:
        self.moment = datetime(2031, 5, 6, 7, 8, 9, 250_000, tzinfo=UTC)

    def now(self) -> datetime:
        return self.moment

    def monotonic(self) -> float:
        return self.moment.timestamp()


@pytest.fixture
def engine_clock(monkeypatch: pytest.MonkeyPatch) -> SteppedClock:
    """Every Scheduler the CLI builds ticks at `clock.moment`."""
    clock = SteppedClock()
    monkeypatch.setattr(engine, "SystemClock", lambda: clock)
    return clock


# --- one cycle ---------------------------------------------------------------------------------


def test_once_runs_the_enabled_agents_and_one_failure_does_not_stop_the_other(
    workdir: Path, server: FakeOpenAIServer, capsys: pytest.CaptureFixture[str]
) -> None:
    script(server, breaker_fails=True)

    result = schedule_once(capsys, server)

    assert result.code == 1, result.err  # one dispatch failed
    assert summary(result.out) == (2, 1, 1, 1)
    assert re.search(r"^\s+done\s+writer\s+run \S+ final_answer$", result.out, re.M)
    assert re.search(r"^\s+failed\s+breaker\s+run \S+ agent_error — .*400", result.out, re.M)
    assert "skipped" not in result.out.replace("skipped 1", "")  # skips go to stderr
    assert re.search(r"^skipped off: disabled \(enabled: false in the config\)$", result.err, re.M)
    assert "Traceback" not in result.err
    ids = {r["agent_id"]: r["dispatch_id"] for r in dispatch_rows(capsys)}
    started = re.findall(r"^running (\w+) \(dispatch (\S+)\)$", result.err, re.M)
    assert sorted(started) == sorted(ids.items())  # each run's start shown as it starts
    server.assert_complete()  # exactly 2 writer requests and 1 breaker request
    assert len(requests_for(server, WRITER)) == WRITER_REQUESTS
    assert len(requests_for(server, BREAKER)) == BREAKER_REQUESTS
    assert not any("OFF-TASK" in user_prompt(r) for r in server.requests)
    assert state_file(workdir).read_text(encoding="utf-8") == NEW_STATE


def test_once_exits_0_when_every_dispatch_succeeds_and_json_prints_one_cycle(
    workdir: Path, server: FakeOpenAIServer, capsys: pytest.CaptureFixture[str]
) -> None:
    script(server, breaker_fails=False)

    result = schedule_once(capsys, server, "--json")

    assert result.code == 0, result.err
    lines = result.out.splitlines()
    assert len(lines) == 1, result.out  # printed once, not also through on_cycle
    assert "running" not in result.err  # JSON mode: no progress lines
    cycle = json.loads(lines[0])
    counts = {k: cycle[k] for k in ("dispatched", "succeeded", "failed", "skipped")}
    assert counts == {"dispatched": 2, "succeeded": 2, "failed": 0, "skipped": 1}
    assert cycle["tick_skipped"] is None
    assert {d["agent_id"]: d["status"] for d in cycle["details"]} == {
        "writer": "done",
        "breaker": "done",
    }
    assert sorted(d["dispatch_id"] for d in cycle["details"]) == sorted(cycle["enqueued_ids"])
    assert cycle["skipped_agents"] == [
        {"agent_id": "off", "reason": "disabled", "dispatch_id": None}
    ]
    server.assert_complete()


def test_the_state_tools_are_offered_to_every_agent(
    workdir: Path, server: FakeOpenAIServer, capsys: pytest.CaptureFixture[str]
) -> None:
    script(server, breaker_fails=False)

    assert schedule_once(capsys, server).code == 0

    for body in server.requests:
        offered = {t["function"]["name"] for t in body.get("tools") or ()}
        assert {"read_state", "write_state"} <= offered, offered


# --- STATE.md ----------------------------------------------------------------------------------


def test_the_seeded_state_is_injected_into_every_agents_prompt(
    workdir: Path, server: FakeOpenAIServer, capsys: pytest.CaptureFixture[str]
) -> None:
    script(server, breaker_fails=True)
    assert not state_file(workdir).exists()

    schedule_once(capsys, server)

    for marker in (WRITER, BREAKER):
        first = requests_for(server, marker)[0]
        assert SEED in user_prompt(first), marker
        assert "{STATE}" not in user_prompt(first)


def test_seed_state_never_overwrites_an_existing_state_file(
    workdir: Path, server: FakeOpenAIServer, capsys: pytest.CaptureFixture[str]
) -> None:
    existing = "# STATE\nhand-written-marker-5e1d\r\nkept {braces} as they are\n"
    state_file(workdir).parent.mkdir(parents=True)
    state_file(workdir).write_bytes(existing.encode())
    script(server, breaker_fails=True)  # the breaker fails, so only the writer changes it

    schedule_once(capsys, server)

    for marker in (WRITER, BREAKER):
        prompt = user_prompt(requests_for(server, marker)[0])
        assert existing in prompt
        assert "seed-marker-41c7" not in prompt
    assert state_file(workdir).read_text(encoding="utf-8") == NEW_STATE


def test_the_seed_is_written_once_and_the_next_cycle_sees_the_agents_update(
    workdir: Path,
    server: FakeOpenAIServer,
    capsys: pytest.CaptureFixture[str],
    engine_clock: SteppedClock,
) -> None:
    script(server, breaker_fails=False, cycles=2)

    schedule_once(capsys, server)
    engine_clock.moment += timedelta(minutes=10)
    schedule_once(capsys, server)

    breaker_prompts = [user_prompt(r) for r in requests_for(server, BREAKER)]
    assert len(breaker_prompts) == 2
    assert SEED in breaker_prompts[0]
    assert NEW_STATE in breaker_prompts[1]  # the writer's update, not the seed again
    assert "seed-marker-41c7" not in breaker_prompts[1]
    assert state_file(workdir).read_text(encoding="utf-8") == NEW_STATE


# --- dispatches --------------------------------------------------------------------------------


def test_dispatches_json_lists_each_dispatch_with_its_outcome_and_run(
    workdir: Path, server: FakeOpenAIServer, capsys: pytest.CaptureFixture[str]
) -> None:
    script(server, breaker_fails=True)
    schedule_once(capsys, server)

    rows = dispatch_rows(capsys)

    assert sorted((r["agent_id"], r["status"]) for r in rows) == [
        ("breaker", "failed"),
        ("writer", "done"),
    ]
    by_agent = {r["agent_id"]: r for r in rows}
    assert by_agent["writer"]["termination_reason"] == "final_answer"
    assert by_agent["writer"]["error"] is None
    assert by_agent["breaker"]["termination_reason"] == "agent_error"
    assert "400" in by_agent["breaker"]["error"]
    for row in rows:
        assert row["kernel_id"] == KERNEL
        assert row["attempts"] == 1
        assert row["lease_expires_at"] is None  # released on completion
        created, started, finished = (
            datetime.fromisoformat(row[k]) for k in ("created_at", "started_at", "finished_at")
        )
        assert created.utcoffset() == timedelta(0)
        assert created <= started <= finished


def test_every_dispatchs_run_is_in_the_configs_event_store(
    workdir: Path, server: FakeOpenAIServer, capsys: pytest.CaptureFixture[str]
) -> None:
    script(server, breaker_fails=True)
    schedule_once(capsys, server)
    rows = dispatch_rows(capsys)
    assert len({r["run_id"] for r in rows}) == 2

    for row in rows:
        shown = cli(capsys, "runs", "show", row["run_id"], "--store", "kernel.db")
        assert shown.code == 0, shown.err
        assert row["run_id"] in shown.out
        assert row["termination_reason"] in shown.out


def test_dispatches_without_any_dispatch_says_so(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = cli(capsys, "dispatches", str(CONFIG))

    assert result.code == 0
    assert result.out == ""
    assert "no dispatches for cli yet" in result.err


# --- a second cycle ----------------------------------------------------------------------------


def test_a_second_once_a_minute_later_dispatches_the_finished_agents_again(
    workdir: Path,
    server: FakeOpenAIServer,
    capsys: pytest.CaptureFixture[str],
    engine_clock: SteppedClock,
) -> None:
    script(server, breaker_fails=True, cycles=2)
    first = schedule_once(capsys, server)
    first_ids = {r["dispatch_id"] for r in dispatch_rows(capsys)}

    engine_clock.moment += timedelta(minutes=1)
    second = schedule_once(capsys, server)

    assert (first.code, second.code) == (1, 1)
    assert summary(second.out) == (2, 1, 1, 1)
    rows = dispatch_rows(capsys)
    assert len(rows) == 4
    new = [r for r in rows if r["dispatch_id"] not in first_ids]
    assert sorted(r["agent_id"] for r in new) == ["breaker", "writer"]
    assert Counter(r["status"] for r in rows) == {"done": 2, "failed": 2}
    server.assert_complete()


def test_a_second_once_in_the_same_second_dispatches_the_finished_agents_again(
    workdir: Path,
    server: FakeOpenAIServer,
    capsys: pytest.CaptureFixture[str],
    engine_clock: SteppedClock,
) -> None:
    """`--once` right after `--once`: both land in the same wall-clock second (the engine clock
    is held still so that this is deterministic). The first cycle's dispatches are finished,
    so the second must dispatch both agents again, with new dispatch ids."""
    script(server, breaker_fails=True, cycles=2)
    schedule_once(capsys, server)
    first_ids = {r["dispatch_id"] for r in dispatch_rows(capsys)}

    engine_clock.moment += timedelta(milliseconds=500)
    second = schedule_once(capsys, server)

    rows = dispatch_rows(capsys)
    new = [r for r in rows if r["dispatch_id"] not in first_ids]
    assert sorted(r["agent_id"] for r in new) == ["breaker", "writer"], second.out
    assert summary(second.out) == (2, 1, 1, 1)


# --- bad configs -------------------------------------------------------------------------------


def copy_config(name: str, workdir: Path) -> str:
    """The data file copied into the working directory, named relatively (as a user would)."""
    shutil.copy(DATA / name, workdir / name)
    return name


@pytest.mark.parametrize(
    ("name", "where", "message"),
    [
        ("bad_cron.yaml", "bad_cron.yaml:2:11:", "schedule"),
        ("unknown_key.yaml", "unknown_key.yaml:5:5:", "agents[0].retries: unknown setting"),
    ],
)
@pytest.mark.parametrize("command", ["schedule", "worker", "dispatches"])
def test_an_invalid_config_exits_2_pointing_at_the_offending_node(
    workdir: Path,
    server: FakeOpenAIServer,
    capsys: pytest.CaptureFixture[str],
    command: str,
    name: str,
    where: str,
    message: str,
) -> None:
    config = copy_config(name, workdir)
    argv = [command, config, *(["--once"] if command == "schedule" else [])]

    result = cli(capsys, *argv)

    assert result.code == 2
    assert result.out == ""
    line = result.err.strip()
    assert line.startswith(f"error: {where} "), line
    assert message in line
    assert "\n" not in line
    assert "Traceback" not in line
    assert server.requests == []


@pytest.mark.parametrize("command", ["schedule", "worker"])
def test_an_agent_naming_a_missing_workflow_exits_2_naming_it_before_anything_runs(
    workdir: Path, server: FakeOpenAIServer, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    config = copy_config("missing_workflow.yaml", workdir)
    argv = [command, config, "--base-url", server.base_url]
    if command == "schedule":
        argv.append("--once")

    result = cli(capsys, *argv)

    assert result.code == 2
    assert "no_such_workflow_9d2e" in result.err
    assert "Traceback" not in result.err
    assert server.requests == []
    assert not (workdir / "kernel.db").exists()  # failed before the first tick
    assert not (workdir / "state").exists()


# --- a killed scheduler's dispatches -----------------------------------------------------------

DEAD_WORKER = "host:4242:dead"


def leave_writer_leased(lease_seconds: float) -> Dispatch:
    """A writer dispatch claimed by a scheduler that was then killed: it stays running under
    that worker's lease. The prompt is the writer's, so a reclaim runs it like a writer."""
    queue = open_queue("kernel.db")  # the config's store, in the working directory
    try:
        queue.enqueue(KERNEL, "writer", f"{WRITER} (before the crash)", 0, "before-the-crash")
        leased = queue.claim(KERNEL, DEAD_WORKER, lease_seconds, 3)
    finally:
        queue.close()
    assert leased is not None
    assert leased.lease_expires_at is not None
    return leased


def test_once_names_the_agent_a_dead_workers_live_lease_blocks_and_until_when(
    workdir: Path, server: FakeOpenAIServer, capsys: pytest.CaptureFixture[str]
) -> None:
    leased = leave_writer_leased(1800)
    server.enqueue(*[model(breaker_fails=False)] * BREAKER_REQUESTS)

    result = schedule_once(capsys, server)

    assert result.code == 0, result.err
    assert summary(result.out) == (1, 1, 0, 2)  # only the breaker ran
    assert leased.lease_expires_at is not None
    expiry = re.escape(leased.lease_expires_at.isoformat(timespec="seconds"))
    line = (
        rf"^skipped writer: running: dispatch {leased.dispatch_id} is held by worker "
        rf"{DEAD_WORKER}, lease expires at {expiry} \(in (29m \d+s|30m 0s)\); if that worker "
        r"is dead, the dispatch is reclaimed then$"
    )
    assert re.search(line, result.err, re.M), result.err
    assert re.search(r"^skipped off: disabled", result.err, re.M)
    server.assert_complete()


def test_once_json_lists_the_leased_dispatch_with_its_worker_and_lease_expiry(
    workdir: Path, server: FakeOpenAIServer, capsys: pytest.CaptureFixture[str]
) -> None:
    leased = leave_writer_leased(1800)
    server.enqueue(*[model(breaker_fails=False)] * BREAKER_REQUESTS)

    result = schedule_once(capsys, server, "--json")

    assert result.code == 0, result.err
    cycle = json.loads(result.out)
    assert leased.lease_expires_at is not None
    assert cycle["skipped_agents"] == [
        {
            "agent_id": "writer",
            "reason": "running",
            "dispatch_id": leased.dispatch_id,
            "worker_id": DEAD_WORKER,
            "lease_expires_at": leased.lease_expires_at.isoformat(),
        },
        {"agent_id": "off", "reason": "disabled", "dispatch_id": None},
    ]
    assert "skipped" not in result.err  # the JSON says it all


def test_once_reclaims_a_dead_workers_dispatch_once_its_lease_expired(
    workdir: Path, server: FakeOpenAIServer, capsys: pytest.CaptureFixture[str]
) -> None:
    leased = leave_writer_leased(0.01)
    time.sleep(0.05)  # the lease runs out
    script(server, breaker_fails=False)

    result = schedule_once(capsys, server)

    assert result.code == 0, result.err
    assert summary(result.out) == (1, 2, 0, 2)  # the breaker's new one and the reclaimed one
    assert leased.lease_expires_at is not None
    expiry = re.escape(leased.lease_expires_at.isoformat(timespec="seconds"))
    line = (
        rf"^skipped writer: running: dispatch {leased.dispatch_id} of worker {DEAD_WORKER}, "
        rf"whose lease expired at {expiry}; any worker may reclaim it now$"
    )
    assert re.search(line, result.err, re.M), result.err
    rows = {r["dispatch_id"]: r for r in dispatch_rows(capsys)}
    assert (rows[leased.dispatch_id]["status"], rows[leased.dispatch_id]["attempts"]) == ("done", 2)
    server.assert_complete()


# --- workflows with their own Python code ------------------------------------------------------

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_guard"
TICKET_CONFIG = """\
kernel_id: tickets
schedule: "*/10 * * * *"
state_dir: state
store: kernel.db
agents:
  - agent_id: support
    workflow: {workflow}
    prompt: "Was ticket OPS-7 about the printer fixed? {{STATE}}"
"""


@pytest.fixture
def fresh_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    """ticket_agent not imported yet (another test may have), and sys.path restored after the
    scheduler put workflow folders on it."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in [m for m in sys.modules if m == "ticket_agent" or m.startswith("ticket_agent.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError):
        importlib.import_module("ticket_agent")


def ticket_config(workdir: Path, workflow: Path) -> str:
    (workdir / "tickets.yaml").write_text(TICKET_CONFIG.format(workflow=workflow), "utf-8")
    return "tickets.yaml"


def test_a_workflow_with_its_own_python_code_runs_as_a_dispatch(
    workdir: Path,
    server: FakeOpenAIServer,
    capsys: pytest.CaptureFixture[str],
    fresh_imports: None,
) -> None:
    config = ticket_config(workdir, EXAMPLE / "workflow.yaml")
    server.enqueue(
        text_reply("OPS-7"),  # triage; the example's own guard routes to its own action
        tool_reply(call("lookup_ticket", {"ticket_id": "OPS-7"})),  # the example's own tool
        text_reply("OPS-7 is closed."),
    )

    result = cli(capsys, "schedule", config, "--once", "--base-url", server.base_url)

    assert result.code == 0, result.err
    assert summary(result.out) == (1, 1, 0, 0)
    assert re.search(r"^\s+done\s+support\s+run \S+ final_answer$", result.out, re.M)
    assert "WARNING" not in result.err
    lookup = server.requests[2]["messages"][-1]
    assert lookup["role"] == "tool"
    assert '"status": "closed"' in lookup["content"]
    server.assert_complete()


def test_a_dispatch_whose_workflow_cannot_load_fails_with_one_warning_line(
    workdir: Path,
    server: FakeOpenAIServer,
    capsys: pytest.CaptureFixture[str],
    fresh_imports: None,
) -> None:
    orphan = workdir / "orphan" / "workflow.yaml"  # the example without its ticket_agent
    orphan.parent.mkdir()
    shutil.copy(EXAMPLE / "workflow.yaml", orphan)
    config = ticket_config(workdir, orphan)

    quiet = cli(capsys, "schedule", config, "--once", "--base-url", server.base_url)
    verbose = cli(capsys, "schedule", config, "--once", "--base-url", server.base_url, "-v")

    assert quiet.code == 1
    assert summary(quiet.out) == (1, 0, 1, 0)
    assert re.search(r"^\s+failed\s+support\s+run -\s+— WorkflowValidationError: ", quiet.out, re.M)
    warnings = [line for line in quiet.err.splitlines() if "WARNING" in line]
    assert len(warnings) == 1, quiet.err
    assert "(support) failed: WorkflowValidationError:" in warnings[0]
    assert "cannot import module 'ticket_agent'" in warnings[0]
    assert "Traceback" not in quiet.err
    assert "Traceback" in verbose.err  # at DEBUG, for -v
    assert server.requests == []
