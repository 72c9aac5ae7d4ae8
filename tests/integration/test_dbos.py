"""fsm-kernel on DBOS (fsm_kernel.integrations.dbos), with real DBOS on SQLite and on PostgreSQL
(system database and event log in one database): a run SIGKILLed in the middle of a tool call
is recovered by DBOS in a new process and finishes with no completed step made again; a run
waiting for an approval is answered through DBOS by `fsm-kernel resume`, also after the process
that waited was killed; the CLI refuses what DBOS does itself; events and timers in process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("dbos")

from dbos import DBOS

from fsm_kernel import Agent
from fsm_kernel.errors import AgentHTTPError, AnswerError, ResumeError
from fsm_kernel.integrations.dbos import (
    DBOSAgent,
    _Failure,
    _without_password,
)
from fsm_kernel.kernel import RunResult
from fsm_kernel.protocol import Event, EventType
from fsm_kernel.replay import replay_run
from fsm_kernel.store import open_store
from fsm_kernel.testing import ScriptedChatModel, call
from fsm_kernel.workflow.compiler import compile_workflow
from fsm_kernel.workflow.human import HumanAnswer
from fsm_kernel.workflow.loader import load_workflow

ROOT = Path(__file__).resolve().parents[2]
APP = Path(__file__).parent / "dbos_app"


def _pg_url(dsn: str) -> str:
    """A libpq key=value DSN as the URL both DBOS (SQLAlchemy) and the store take."""
    import psycopg

    info = psycopg.conninfo.conninfo_to_dict(dsn)
    return (
        f"postgresql://{info.get('user', 'postgres')}@/{info['dbname']}"
        f"?host={info['host']}&port={info['port']}"
    )


@pytest.fixture(params=["sqlite", "postgres"])
def make_app(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., App]]:
    """Builds the App over DBOS's system database and the event store on SQLite, or both in
    one PostgreSQL database; kills its processes after the test."""
    if request.param == "sqlite":
        databases = (f"sqlite:///{tmp_path / 'dbos.sqlite'}", str(tmp_path / "runs.db"))
    else:
        request.applymarker(pytest.mark.postgres)
        url = _pg_url(request.getfixturevalue("pg_dsn"))
        databases = (url, url)
    apps: list[App] = []

    def make(workflow: str, calls: int) -> App:
        apps.append(App(tmp_path, *databases, workflow=workflow, calls=calls))
        return apps[-1]

    yield make
    for app in apps:
        app.close()


class App:
    """The test application (dbos_app/app.py) in subprocesses, over one folder and databases."""

    def __init__(self, folder: Path, system_db: str, store: str, workflow: str, calls: int):
        self.folder, self.store = folder, store
        self.procs: list[subprocess.Popen[str]] = []
        self.args = ["--dir", str(folder), "--system-db", system_db, "--store", store,
                     "--workflow", workflow, "--calls", str(calls)]  # fmt: skip

    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(ROOT), "FSM_KERNEL_DBOS_URL": self.args[3]}

    def popen(self, *how: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.dbos_app.app", *self.args, *how],
            cwd=ROOT, env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        """Kill what a failed test left running."""
        for proc in self.procs:
            if proc.poll() is None:
                _kill(proc)

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "fsm_kernel", *args, "--store", self.store],
            cwd=ROOT, env=self.env(), capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    def lines(self, name: str) -> list[str]:
        path = self.folder / name
        return path.read_text().splitlines() if path.exists() else []

    def events(self, run_id: str) -> list[Event]:
        store = open_store(self.store)
        try:
            return store.read(run_id)
        finally:
            store.close()


def _wait_until(check: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=10)  # reaped, its pipes closed


def _result(proc: subprocess.Popen[str]) -> dict[str, object]:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    result: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    return result


def _types(events: list[Event]) -> list[str]:
    return [e.type.value for e in events]


def _replays_identically(app: App, run_id: str) -> None:
    store = open_store(app.store)
    try:
        workflow = compile_workflow(load_workflow(APP / "work.yaml"))
        report = asyncio.run(replay_run(workflow, store, run_id))
    finally:
        store.close()
    assert report.identical, report.first_divergence


# --- a run killed in a tool call ---------------------------------------------------------------


def test_killed_during_a_tool_call_recovers_in_a_new_process(make_app: Callable[..., App]) -> None:
    app = make_app("work", 2)
    (app.folder / "slow-2").touch()  # the second call hangs until the process is killed
    first = app.popen("--start", "r1", "do two pieces of work")
    _wait_until(lambda: "start 2" in app.lines("tools.log"), "the second tool call")
    _kill(first)
    (app.folder / "slow-2").unlink()
    refused = app.cli("resume", "r1")  # DBOS recovers it: resume must not run it a second time
    assert refused.returncode == 2
    assert "runs under DBOS (workflow fsm-kernel.dbos_work): DBOS recovers it" in refused.stderr

    result = _result(app.popen("--recover", "r1"))

    assert result["termination_reason"] == "final_answer"
    assert result["response"] == "all 2 done"
    # the first call finished before the kill: not made again; the second, cut off, is redone
    assert app.lines("tools.log") == ["start 1", "end 1", "start 2", "start 2", "end 2"]
    # the model was asked once for each step: DBOS served the replies it had recorded
    assert app.lines("model.log") == ["asked after 0", "asked after 1", "asked after 2"]
    events = app.events("r1")
    finished = [e.data["call"]["id"] for e in events if e.type == EventType.TOOL_FINISHED]
    assert finished == ["call_1", "call_2"]
    resumed = [e for e in events if e.type == EventType.RUN_RESUMED]
    assert len(resumed) == 1
    assert resumed[0].data["overrides"] == {"engine": "dbos"}
    assert resumed[0].data["rerun_tool_calls"] == ["call_2"]
    assert _types(events).count("run.terminated") == 1
    assert events[0].data["settings"]["engine"]["name"] == "dbos"
    _replays_identically(app, "r1")


# --- a run waiting for an approval --------------------------------------------------------------


def _waiting(app: App, run_id: str) -> Callable[[], bool]:
    def check() -> bool:
        events = app.events(run_id)
        return bool(events) and events[-1].type == EventType.RUN_SUSPENDED

    return check


def test_a_waiting_run_is_answered_through_dbos(make_app: Callable[..., App]) -> None:
    app = make_app("approve", 1)
    proc = app.popen("--start", "r1", "one piece of work, approved")
    _wait_until(_waiting(app, "r1"), "the run to wait for its approval")
    listed = app.cli("runs", "list", "--waiting", "--json")
    assert [r["run_id"] for r in json.loads(listed.stdout)] == ["r1"]
    assert app.lines("tools.log") == []  # nothing runs before the person says yes

    sent = app.cli("resume", "r1", "--approve", "--by", "ana")

    assert sent.returncode == 0, sent.stderr
    assert "DBOS workflow (fsm-kernel.dbos_approve)" in sent.stdout
    result = _result(proc)
    assert result["termination_reason"] == "final_answer"
    assert app.lines("tools.log") == ["start 1", "end 1"]
    events = app.events("r1")
    answered = [e for e in events if e.type == EventType.HUMAN_ANSWERED]
    assert [(e.data["approved"], e.data["by"]) for e in answered] == [(True, "ana")]
    assert answered[0].data["tool_call_id"] == "call_1"
    i = _types(events).index("run.suspended")
    assert _types(events)[i : i + 3] == ["run.suspended", "run.resumed", "human.answered"]
    _replays_identically(app, "r1")


def test_a_run_killed_while_waiting_is_answered_in_the_process_that_recovered_it(
    make_app: Callable[..., App],
) -> None:
    app = make_app("approve", 1)
    first = app.popen("--start", "r1", "one piece of work, approved")
    _wait_until(_waiting(app, "r1"), "the run to wait for its approval")
    _kill(first)
    second = app.popen("--recover", "r1")
    _wait_until(
        lambda: _types(app.events("r1")).count("run.suspended") == 2, "the recovered run to wait"
    )

    sent = app.cli("resume", "r1", "--reject", "not today")

    assert sent.returncode == 0, sent.stderr
    result = _result(second)
    assert result["termination_reason"] == "final_answer"
    assert app.lines("tools.log") == []  # rejected: the tool never ran
    assert app.lines("model.log") == ["asked after 0", "asked after 1"]  # once per step
    rejected = [e.data for e in app.events("r1") if e.type == EventType.HUMAN_ANSWERED]
    assert [(d["approved"], d["reason"]) for d in rejected] == [(False, "not today")]


def test_the_cli_sends_only_answers_to_a_run_under_dbos(make_app: Callable[..., App]) -> None:
    app = make_app("approve", 1)
    proc = app.popen("--start", "r1", "one piece of work, approved")
    _wait_until(_waiting(app, "r1"), "the run to wait for its approval")
    try:
        bare = app.cli("resume", "r1")
        wrong = app.cli("resume", "r1", "--input", "hello")
        assert bare.returncode == 2
        assert "waits for approval" in bare.stderr
        assert wrong.returncode == 2
        assert "--input given" in wrong.stderr
        assert app.events("r1")[-1].type == EventType.RUN_SUSPENDED  # nothing was recorded
    finally:
        _kill(proc)
    killed = app.cli("resume", "r1", "--approve")  # its workflow is not running now: sent
    assert killed.returncode == 0, killed.stderr


# --- cancellation -------------------------------------------------------------------------------


def test_a_run_cancelled_through_dbos_ends_cancelled_in_its_log(
    make_app: Callable[..., App],
) -> None:
    from dbos import DBOSClient

    app = make_app("work", 2)
    (app.folder / "slow-1").touch()
    proc = app.popen("--start", "r1", "two pieces of work")
    _wait_until(lambda: "start 1" in app.lines("tools.log"), "the first tool call")
    client = DBOSClient(system_database_url=app.args[3])
    try:
        client.cancel_workflow("r1")
    finally:
        client.destroy()
    (app.folder / "slow-1").unlink()  # the call in flight ends; the run stops at its next step

    assert _result(proc) == {"run_id": "r1", "dbos": "CANCELLED"}
    ended = [e.data for e in app.events("r1") if e.type == EventType.RUN_TERMINATED]
    assert [(d["reason"], d.get("error")) for d in ended] == [("cancelled", "run cancelled")]
    assert app.lines("tools.log") == ["start 1", "end 1"]  # the second call never started
    assert app.lines("model.log") == ["asked after 0"]


# --- in process: events, timers, the Python API ------------------------------------------------

WAITING = """\
name: deploy_on_ci
reasons:
  timed_out: {description: CI never answered}
initial: plan
states:
  plan: {action: agent.think, prompt: Plan the deploy.}
  wait_for_ci: {description: waits for CI or gives up}
  deploy: {action: agent.think, prompt: Deploy it.}
  done: {final: true}
  gave_up: {final: true}
transitions:
  - {source: plan, target: wait_for_ci}
  - {source: wait_for_ci, target: deploy, event: ci_passed}
  - {source: wait_for_ci, target: gave_up, after: AFTER, reason: timed_out}
  - {source: deploy, target: done, reason: final_answer}
"""


@pytest.fixture
def launched(tmp_path: Path) -> Iterator[Callable[..., DBOSAgent]]:
    """Build a DBOSAgent (a waiting workflow with its timer after AFTER, a scripted model;
    `suspended` is set when a run suspends), then launch DBOS on SQLite in this process;
    destroyed after the test."""
    built: list[DBOSAgent] = []

    def build(
        after: str,
        replies: list[str],
        suspended: asyncio.Event | None = None,
        on_result: Callable[[object], None] | None = None,
    ) -> DBOSAgent:
        DBOS(config={"name": "fsm-kernel-tests", "log_level": "WARNING",
                     "system_database_url": f"sqlite:///{tmp_path / 'dbos.sqlite'}",
                     "notification_listener_polling_interval_sec": 0.05})  # fmt: skip

        def watch(event: object) -> None:
            if suspended is not None and getattr(event, "type", None) == EventType.RUN_SUSPENDED:
                suspended.set()

        path = tmp_path / "deploy.yaml"
        path.write_text(WAITING.replace("AFTER", after))
        model = ScriptedChatModel(replies)
        agent = Agent(path, store=tmp_path / "runs.db", chat_model=model, on_event=watch)
        built.append(DBOSAgent(agent, on_result=on_result))
        DBOS.launch()
        return built[0]

    yield build
    for agent in built:
        asyncio.run(agent.agent.aclose())
    DBOS.destroy(destroy_registry=True)


def test_an_event_is_delivered_through_dbos(launched) -> None:
    async def go() -> tuple[object, list[Event]]:
        suspended = asyncio.Event()
        agent = launched("30m", ["a plan", "deployed"], suspended)
        run_id = await agent.start("deploy")
        await _suspended(agent, run_id, suspended)
        with pytest.raises(AnswerError, match="for ci_passed, not event 'nope'"):
            await agent.signal(run_id, "nope")
        with pytest.raises(ResumeError, match="runs under dbos: answer it through its engine"):
            await agent.agent.signal(run_id, "ci_passed")  # a plain Agent would run it twice
        await agent.signal(run_id, "ci_passed", {"sha": "abc"}, by="ci")
        result = await agent.result(run_id)
        return result, agent.store.read(run_id)

    result, events = asyncio.run(go())
    assert result.termination_reason == "final_answer"
    assert result.response == "deployed"
    delivered = [e.data for e in events if e.type == EventType.EVENT_DELIVERED]
    assert delivered == [{"name": "ci_passed", "data": {"sha": "abc"}, "by": "ci"}]
    assert [e.data["edge"] for e in events if e.type == EventType.TIMER_CANCELLED] == [2]


def test_a_timer_fires_under_dbos(launched) -> None:
    async def go() -> tuple[object, list[Event]]:
        agent = launched("1s", ["a plan"])
        result = await agent.run("deploy")
        return result, agent.store.read(result.run_id)

    result, events = asyncio.run(go())
    assert result.termination_reason == "timed_out"
    fired = [e.data["edge"] for e in events if e.type == EventType.TIMER_FIRED]
    assert fired == [2]
    assert _types(events).count("run.suspended") == 1


# --- cancelling: the log and DBOS agree, whenever the cancel comes -----------------------------


async def _dbos_status(run_id: str, until: str | None = None) -> str:
    """The run's workflow status in DBOS (waiting up to 30 s for it to be `until`)."""
    deadline = time.monotonic() + 30
    while True:
        status = await DBOS.get_workflow_status_async(run_id)
        assert status is not None
        if until is None or status.status == until or time.monotonic() > deadline:
            return str(status.status)
        await asyncio.sleep(0.05)


def _endings(events: list[Event]) -> list[str]:
    return [e.data["reason"] for e in events if e.type == EventType.RUN_TERMINATED]


async def _suspended(agent: DBOSAgent, run_id: str, seen: asyncio.Event) -> None:
    """Until the run's suspension is in its log (up to 30 s): `on_event` sees an event as it
    is recorded, a moment before the commit that signal and cancel read."""
    await asyncio.wait_for(seen.wait(), 30)
    deadline = time.monotonic() + 30
    while not any(e.type == EventType.RUN_SUSPENDED for e in agent.store.read(run_id)):
        assert time.monotonic() < deadline, "run.suspended was seen but never committed"
        await asyncio.sleep(0.01)


async def _ended(agent: DBOSAgent, run_id: str) -> list[Event]:
    """The run's log once it ended (waiting up to 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        events = agent.store.read(run_id)
        if _endings(events) or time.monotonic() > deadline:
            return events
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("via", ["agent", "dbos"])
def test_a_waiting_run_cancelled_ends_cancelled_at_once_in_both(
    launched, tmp_path: Path, via: str
) -> None:
    """Through DBOSAgent.cancel, or DBOS's own cancel from another process (a DBOSClient)."""
    from dbos import DBOSClient

    async def go() -> tuple[str, str, list[Event]]:
        suspended = asyncio.Event()
        agent = launched("30m", ["a plan"], suspended)
        run_id = await agent.start("deploy")
        await _suspended(agent, run_id, suspended)
        if via == "agent":
            said = await agent.cancel(run_id)
        else:
            client = DBOSClient(system_database_url=f"sqlite:///{tmp_path / 'dbos.sqlite'}")
            await asyncio.to_thread(client.cancel_workflow, run_id)
            client.destroy()
            said = "cancelled run: it was waiting; it ends 'cancelled' now"
        events = await _ended(agent, run_id)
        return said, await _dbos_status(run_id), events

    said, status, events = asyncio.run(go())
    assert said.endswith("it was waiting; it ends 'cancelled' now")
    assert _endings(events) == ["cancelled"]  # now, not when its 30-minute timer fires
    assert status == "CANCELLED"


def test_cancelling_a_run_that_ended_is_refused_and_changes_nothing(launched) -> None:
    async def go() -> tuple[str, str]:
        agent = launched("1s", ["a plan"])
        result = await agent.run("deploy")
        with pytest.raises(ResumeError, match=r"already ended \(timed_out\): nothing to cancel"):
            await agent.cancel(result.run_id)
        return str(result.termination_reason), await _dbos_status(result.run_id)

    assert asyncio.run(go()) == ("timed_out", "SUCCESS")


def test_a_cancel_after_the_last_step_leaves_dbos_with_the_logs_ending(
    launched, tmp_path: Path
) -> None:
    """The cancel lands after the run's last event and before its workflow returns (injected
    in on_result, which runs there): the workflow is resumed and DBOS records the run's end."""
    from dbos import DBOSClient

    cancelled: list[str] = []

    def cancel_once(result: object) -> None:
        if not cancelled:  # the resumed execution calls it again
            run_id = str(result.run_id)
            client = DBOSClient(system_database_url=f"sqlite:///{tmp_path / 'dbos.sqlite'}")
            try:
                client.cancel_workflow(run_id)
            finally:
                client.destroy()
            cancelled.append(run_id)

    async def go() -> tuple[str, list[Event], object]:
        agent = launched("1s", ["a plan"], on_result=cancel_once)
        run_id = await agent.start("deploy")
        status = await _dbos_status(run_id, until="SUCCESS")
        return status, agent.store.read(run_id), await agent.result(run_id)

    status, events, result = asyncio.run(go())
    assert len(cancelled) == 1
    assert status == "SUCCESS"
    assert _endings(events) == ["timed_out"]  # the log's one ending, never rewritten
    assert result.termination_reason == "timed_out"


# --- a child run that waits for a person ---------------------------------------------------------

PARENT = """\
name: parent
initial: delegate
states:
  delegate: {action: workflow.call, workflow: child.yaml}
  done: {final: true}
transitions:
  - {source: delegate, target: done, reason: final_answer}
"""

CHILD = """\
name: child
initial: ask
states:
  ask: {action: human.input, prompt: "Which branch?"}
  work: {action: agent.think}
  done: {final: true}
transitions:
  - {source: ask, target: work}
  - {source: work, target: done, reason: final_answer}
"""


@pytest.mark.parametrize("via", ["cli", "python"])
def test_a_child_waiting_for_a_person_is_answered_through_its_parents_workflow(
    tmp_path: Path, via: str
) -> None:
    """The parent's workflow waits in `recv` for the child's answer (not ending waiting): the
    child is answered with `fsm-kernel resume CHILD --input` or DBOSAgent.resume, both sent
    through DBOS, and the parent goes on in its own workflow to its end."""
    (tmp_path / "parent.yaml").write_text(PARENT)
    (tmp_path / "child.yaml").write_text(CHILD)
    url = f"sqlite:///{tmp_path / 'dbos.sqlite'}"
    DBOS(config={"name": "fsm-kernel-tests", "log_level": "WARNING", "system_database_url": url,
                 "notification_listener_polling_interval_sec": 0.05})  # fmt: skip
    store = tmp_path / "runs.db"
    model = ScriptedChatModel(["Took the main branch."])
    agent = DBOSAgent(Agent(tmp_path / "parent.yaml", store=store, chat_model=model),
                      system_database_url=url)  # fmt: skip
    DBOS.launch()
    try:

        async def go() -> tuple[RunResult, str, str]:
            run_id = await agent.start("ship it")
            child = await _waiting_child(agent, run_id)
            if via == "python":
                await agent.resume(child, answer=HumanAnswer.input("main", by="alice"))
            else:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "fsm_kernel", "resume", child, "--input", "main",
                    "--by", "alice", "--store", str(store), cwd=tmp_path,
                    env={**os.environ, "PYTHONPATH": str(ROOT)},
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                )  # fmt: skip
                out, err = await proc.communicate()
                assert proc.returncode == 0, err.decode()
                assert out.decode().startswith(f"sent to run {child}: its DBOS workflow")
            result = await agent.result(run_id)
            status = await _dbos_status(run_id)
            await agent.agent.aclose()
            return result, child, status

        result, child, status = asyncio.run(go())
    finally:
        DBOS.destroy(destroy_registry=True)

    assert result.termination_reason == "final_answer"
    assert result.response == "Took the main branch."
    assert status == "SUCCESS"
    with open_store(str(store)) as events:
        parent_log, child_log = events.read(result.run_id), events.read(child)
    assert "run.suspended" not in _types(parent_log)  # the parent waited inside its step
    assert _endings(child_log) == ["final_answer"]
    answered = [e.data for e in child_log if e.type == EventType.HUMAN_ANSWERED]
    assert [(a["text"], a["by"]) for a in answered] == [("main", "alice")]
    assert _endings(parent_log) == ["final_answer"]


async def _waiting_child(agent: DBOSAgent, run_id: str) -> str:
    """The id of the run's child once the child waits for a person (up to 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        started = [e for e in agent.store.read(run_id) if e.type == EventType.CHILD_STARTED]
        if started:
            child = str(started[0].data["run_id"])
            if "run.suspended" in _types(agent.store.read(child)):
                return child
        assert time.monotonic() < deadline, "the child never waited"
        await asyncio.sleep(0.05)


# --- MCP tools under DBOS -------------------------------------------------------------------------


def test_an_mcp_servers_tool_call_is_a_dbos_step(tmp_path: Path) -> None:
    """A tool of an MCP server (a real stdio server) is called as the DBOS step
    `fsm-kernel.tool:NAME`, its result checkpointed: a recovered run is served it, never
    calling the server again (the step mechanism the SIGKILL test proves for Python tools)."""
    pytest.importorskip("mcp")
    server = ROOT / "tests" / "data" / "mcp_server.py"
    path = tmp_path / "mcp.yaml"
    path.write_text(
        "name: mcp_dbos\n"
        f"mcp_servers: {{calc: {{command: {json.dumps(sys.executable)}, "
        f"args: [{json.dumps(str(server))}]}}}}\n"
        "tools: [mcp:calc/add]\n"
        "initial: think\n"
        "states:\n"
        "  think: {action: agent.think}\n"
        "  act: {action: tools.execute}\n"
        "  done: {final: true}\n"
        "transitions:\n"
        "  - {source: think, target: act, guard: has_tool_calls}\n"
        "  - {source: think, target: done, reason: final_answer}\n"
        "  - {source: act, target: think}\n"
    )
    DBOS(config={"name": "fsm-kernel-tests", "log_level": "WARNING",
                 "system_database_url": f"sqlite:///{tmp_path / 'dbos.sqlite'}"})  # fmt: skip
    model = ScriptedChatModel([call("add", {"a": 2, "b": 40}), "It is 42."])
    agent = DBOSAgent(Agent(path, store=tmp_path / "runs.db", chat_model=model))
    DBOS.launch()
    try:

        async def go() -> tuple[RunResult, list[dict[str, Any]]]:
            result = await agent.run("2 + 40?")
            steps = await DBOS.list_workflow_steps_async(result.run_id)
            await agent.agent.aclose()
            return result, [dict(s) for s in steps]

        result, steps = asyncio.run(go())
    finally:
        DBOS.destroy(destroy_registry=True)

    assert result.response == "It is 42."
    tool_steps = [s for s in steps if s["function_name"] == "fsm-kernel.tool:add"]
    assert len(tool_steps) == 1
    assert tool_steps[0]["output"].content == "42"
    assert [s["function_name"] for s in steps].count("fsm-kernel.model") == 2


# --- units ---------------------------------------------------------------------------------------


def test_a_model_failure_is_kept_as_data_and_raised_again_alike() -> None:
    error = AgentHTTPError("HTTP 503", base_url="http://x", status_code=503, retry_after=2.0)
    again = _Failure.of(error).error()
    assert type(again) is AgentHTTPError
    assert (str(again), again.status_code, again.retry_after) == ("HTTP 503", 503, 2.0)
    assert again.base_url == "http://x"


def test_the_recorded_system_database_has_no_password() -> None:
    assert _without_password("postgresql://u:secret@db:5432/x") == "postgresql://u@db:5432/x"
    assert _without_password("sqlite:///a/b.sqlite") == "sqlite:///a/b.sqlite"
