"""fsm-kernel on DBOS: each run a DBOS workflow, its model calls, tool calls and child runs DBOS
steps, its waits for a person, an event or a timer DBOS `recv` with a durable timeout.

    from dbos import DBOS
    from fsm_kernel import Agent
    from fsm_kernel.integrations.dbos import DBOSAgent

    DBOS(config={"name": "agents", "system_database_url": "postgresql://…/dbos"})
    agent = DBOSAgent(Agent("react", store="postgresql://…/runs"))  # before DBOS.launch()
    DBOS.launch()
    result = await agent.run("What changed in the last release?")

How the two records relate. DBOS's system database holds the workflow and the outcome of each
step (a model's reply, a tool's result, a child run's outcome, a delivered answer); the
fsm-kernel event log stays the record users inspect, replay and view, written by the kernel as
always. The workflow is the kernel driving the run from its start. When DBOS recovers it (the
process was killed: this process on restart, or another one on the same system database),
the workflow runs again from the start: every step DBOS recorded is served from DBOS (no
completed model call, tool call or child run is made again, including one whose result the
event log had not committed yet), and the kernel's recorder catches up with the event log
as `fsm-kernel resume` does, matching each event against the recorded one instead of writing
it again; it records live past the log's end, after a `run.resumed` marker (`overrides`:
`{"engine": "dbos"}`). So the log only ever gains what the DBOS steps returned: the two cannot
disagree. A step that was cut off (killed in the middle of a tool call) has no recorded
outcome in either and runs again, as a DBOS step always may.

Waiting. A question for a person (approval, `human.input`) or a waiting state (`event:`,
`after:`) is recorded as in any run (`run.suspended` with `waiting_for`, so `fsm-kernel runs
--waiting`, `runs show` and the viewer show it), then the workflow waits with `DBOS.recv` on
the topic `fsm-kernel.answer`, until the earliest timer is due when there is one (a durable
timeout: a recovered run waits only for what is left). The answer is a `HumanAnswer` sent with
`DBOS.send`: `DBOSAgent.resume`/`signal`, or `fsm-kernel resume`/`signal` (and the viewer's
buttons, which run `fsm-kernel resume`) on a run whose `run.started` says it runs under DBOS
(`settings.engine`). The run then records `run.resumed` and goes on in the process that runs
its workflow. A timer that comes due fires there too.

Cancelling (`cancel_run`, `DBOSAgent.cancel`). The log decides how a run ended and the DBOS
status is made to agree: a run that ended is not cancelled (refused); a waiting one sees the
cancel within a second (its `recv` asks) and ends `cancelled`; a running one ends `cancelled`
at its next step; and one whose workflow is cancelled after its last event (a race) is resumed
by DBOS, so its workflow catches up with the log and records the run's own ending.

Child runs are steps: a child run ended is never run again; one cut off is resumed from its own
log by fsm-kernel (its steps inside are not DBOS steps). A child that waits for a person makes
its parent's workflow wait in `recv` on the child's own topic (`child_topic`); its answer is
sent to the root run's workflow (`send_to_run`, `DBOSAgent.resume`), and the child goes on in
a step of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import dataclasses
import logging
import os
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

from dbos import DBOS, DBOSClient, SetWorkflowID, WorkflowHandleAsync
from dbos._error import DBOSWorkflowCancelledError, DBOSWorkflowConflictIDError

from fsm_kernel import errors
from fsm_kernel.api import Agent
from fsm_kernel.bootstrap import attach_mcp
from fsm_kernel.child_runs import LiveChildren
from fsm_kernel.errors import ConfigError, FsmKernelError, ResumeError, RunNotFoundError
from fsm_kernel.kernel import Kernel, RunResult
from fsm_kernel.protocol import (
    ChatModel,
    Completion,
    EventStore,
    EventType,
    Message,
    Tool,
    ToolCall,
    ToolExecutor,
    ToolResult,
    new_id,
)
from fsm_kernel.recorder import RunRecorder
from fsm_kernel.replay import RecordedRun, check_answer
from fsm_kernel.workflow.children import ChildRequest, ChildResult, ChildRunner
from fsm_kernel.workflow.deadlines import recorded_deadlines
from fsm_kernel.workflow.human import HumanAnswer, Question, Suspended

__all__ = [
    "ANSWER_TOPIC",
    "CANCEL_POLL_SECONDS",
    "Canceller",
    "DBOSAgent",
    "DBOSChannel",
    "DBOSChatModel",
    "DBOSChildRunner",
    "DBOSToolExecutor",
    "cancel_run",
    "child_topic",
    "dbos_engine",
    "send_to_run",
]

logger = logging.getLogger(__name__)

ANSWER_TOPIC = "fsm-kernel.answer"
"""The DBOS message topic a waiting run receives its answers on (`HumanAnswer.to_dict()`)."""

CANCEL_POLL_SECONDS = 1.0
"""How often a run waiting in `recv` asks whether its workflow was cancelled meanwhile (a
cancel only writes DBOS's status, which wakes no `recv`)."""

_DBOS_ATTEMPTS = 100
"""DBOS's own default `max_recovery_attempts`."""

_WAIT_SLICE = 24 * 3600.0
"""Seconds one `recv` waits when no timer is due sooner (it is asked again after)."""


# --- steps -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Failure:
    """An fsm-kernel error a step raised, kept as data: DBOS records it as the step's output
    (the errors' keyword-only constructors do not survive pickling), and a recovered run
    raises it again where the run did."""

    kind: str
    message: str
    attributes: dict[str, Any]

    @classmethod
    def of(cls, exc: FsmKernelError) -> _Failure:
        return cls(type(exc).__name__, str(exc), dict(vars(exc)))

    def error(self) -> Exception:
        kind = getattr(errors, self.kind, None)
        if not (isinstance(kind, type) and issubclass(kind, FsmKernelError)):
            return FsmKernelError(self.message)
        exc: Exception = Exception.__new__(kind)
        Exception.__init__(exc, self.message)
        vars(exc).update(self.attributes)
        return exc


async def _step(name: str, work: Any, *args: Any, **kwargs: Any) -> Any:
    """`await work(*args, **kwargs)` as the DBOS step `name`: its outcome checkpointed, and
    served from the checkpoint when the workflow runs again (an fsm-kernel error included)."""

    async def checkpointed() -> Any:
        try:
            return await work(*args, **kwargs)
        except FsmKernelError as exc:
            return _Failure.of(exc)

    async with _cancellation():
        outcome = await DBOS.run_step_async({"name": name}, checkpointed)
    if isinstance(outcome, _Failure):
        raise outcome.error()
    return outcome


@contextlib.asynccontextmanager
async def _cancellation() -> AsyncIterator[None]:
    """A DBOS operation of the workflow (a step, a `recv`): its workflow cancelled
    (DBOS.cancel_workflow, `cancel_run`) becomes asyncio.CancelledError, which the kernel
    records as the run's `cancelled` ending."""
    try:
        yield
    except DBOSWorkflowCancelledError:
        raise asyncio.CancelledError from None
    except DBOSWorkflowConflictIDError:  # cancelled, or another execution owns it now
        if await _cancelled():
            raise asyncio.CancelledError from None
        raise  # the owner records the run, not this execution


async def _cancelled() -> bool:
    """The current workflow was cancelled (DBOS.cancel_workflow, `dispatches --cancel`).
    Asked outside the workflow's context: inside it, the question would be a step of its own."""
    workflow_id = DBOS.workflow_id
    if workflow_id is None:
        return False
    asking = DBOS.get_workflow_status_async(workflow_id)
    task = asyncio.get_running_loop().create_task(asking, context=contextvars.Context())
    status = await task
    return status is not None and status.status == "CANCELLED"


class DBOSChatModel:
    """A ChatModel whose every call is a DBOS step (`fsm-kernel.model`)."""

    def __init__(self, model: ChatModel) -> None:
        self.model = model

    async def complete(
        self, messages: Sequence[Message], tools: Sequence[Tool], **options: Any
    ) -> Completion:
        completion: Completion = await _step(
            "fsm-kernel.model", self.model.complete, messages, tools, **options
        )
        return completion


class DBOSToolExecutor:
    """A ToolExecutor whose every call is a DBOS step (`fsm-kernel.tool:NAME`)."""

    def __init__(self, tools: ToolExecutor) -> None:
        self.tools = tools

    def list_tools(self, names: Sequence[str] | None = None) -> list[Tool]:
        return self.tools.list_tools(names)

    async def execute(self, call: ToolCall) -> ToolResult:
        result: ToolResult = await _step(f"fsm-kernel.tool:{call.name}", self.tools.execute, call)
        return result


class DBOSChildRunner:
    """A ChildRunner whose every child run is a DBOS step (`fsm-kernel.child`). A child that
    waits for a person (or an event) makes its parent's workflow wait for the answer with
    `recv` (topic `fsm-kernel.answer:CHILD_RUN_ID`, sent by `send_to_run`), then the child goes
    on in a step of its own, the answer given: durable as the parent's own waits are."""

    def __init__(self, children: ChildRunner) -> None:
        self.children = children

    async def run(self, request: ChildRequest) -> ChildResult:
        result: ChildResult = await _step("fsm-kernel.child", self.children.run, request)
        while result.waiting_for is not None:
            asked = Question.from_dict(result.waiting_for)
            # the child's own timer is not watched here: it fires once the child is answered
            answer = await _receive(
                child_topic(request.run_id), dataclasses.replace(asked, due=None)
            )
            assert answer is not None  # no timer: only an answer ends the wait
            request = dataclasses.replace(request, take_answer=_once(answer))
            result = await _step("fsm-kernel.child", self.children.run, request)
        return result


def child_topic(run_id: str) -> str:
    """The topic a waiting child run's answers go to, in its root run's workflow."""
    return f"{ANSWER_TOPIC}:{run_id}"


def _once(answer: HumanAnswer) -> Callable[[], HumanAnswer | None]:
    given = [answer]
    return lambda: given.pop() if given else None


# --- waiting ---------------------------------------------------------------------------------


class DBOSChannel:
    """A run's way to a person (and to its events and timers) under DBOS: the question is
    recorded as the run's suspension, then the workflow waits with `DBOS.recv` (until the
    earliest timer is due, if one is). A recovered run that already had its answer gets it
    from DBOS at once, recording nothing again."""

    def __init__(self, recorder: RunRecorder, settings: Mapping[str, Any]) -> None:
        self.recorder = recorder
        self.settings = settings

    async def ask(self, question: Question) -> HumanAnswer:
        live = not self.recorder.catching_up
        if live:
            self.recorder.record(EventType.RUN_SUSPENDED, {"waiting_for": question.to_dict()})
            await self.recorder.flush()
        answer = await _receive(ANSWER_TOPIC, question)
        if live:
            self.recorder.record(EventType.RUN_RESUMED, self._resumed())
            await self.recorder.flush()
        if answer is None:  # the timer is due: the waiting state fires it
            raise Suspended(question)
        return answer

    def _resumed(self) -> dict[str, Any]:
        return {
            "settings": dict(self.settings),
            "overrides": {"engine": "dbos"},
            "reopened": "waiting",
            "rerun_tool_calls": [],
        }


async def _receive(topic: str, question: Question) -> HumanAnswer | None:
    """The first answer on `topic` that fits the question; None once its timer is due. An
    answer of another kind (sent by mistake) is logged and dropped: the run goes on waiting."""
    while True:
        timeout = _WAIT_SLICE if question.due is None else _seconds_until(question.due)
        message = await _recv_unless_cancelled(topic, timeout)
        if message is None:
            if question.due is not None:  # it waited until the timer was due
                return None
            continue
        answer = HumanAnswer.from_dict(dict(message))
        if answer.kind == question.kind:
            return answer
        logger.warning("dropped an answer of kind %s: the run waits for %s", answer.kind,
                       question.kind)  # fmt: skip


async def _recv_unless_cancelled(topic: str, seconds: float) -> Any:
    """`DBOS.recv_async(topic)` for up to `seconds` (one DBOS operation however long it
    waits), given up as soon as the workflow is seen cancelled (asked every
    CANCEL_POLL_SECONDS): the run then ends `cancelled`, nothing consumed.

    Raises:
        asyncio.CancelledError: the workflow was cancelled (DBOS.cancel_workflow, `cancel_run`).
    """
    receiving = asyncio.ensure_future(DBOS.recv_async(topic, timeout_seconds=seconds))
    try:
        while True:
            done, _ = await asyncio.wait({receiving}, timeout=CANCEL_POLL_SECONDS)
            if done:
                async with _cancellation():
                    return receiving.result()
            if await _cancelled():
                raise asyncio.CancelledError
    finally:
        if not receiving.done():
            receiving.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await receiving


def _seconds_until(due: str) -> float:
    """Seconds from now until `due` (ISO 8601 with its zone), at least a millisecond."""
    when = datetime.fromisoformat(due)
    return max(0.001, (when - datetime.now(tz=when.tzinfo)).total_seconds())


# --- the agent -------------------------------------------------------------------------------


class DBOSAgent:
    """An Agent whose runs are DBOS workflows (see the module's docstring).

    Build it before `DBOS.launch()` (DBOS registers its workflow then, so it can recover runs
    of it), in every process that may run or recover its runs.

    Args:
        agent: the Agent to run; it needs a store (`Agent(store=...)`): the event log.
        name: the DBOS workflow's name is `fsm-kernel.NAME` (default: the workflow's name); two
            DBOSAgents in one application need two names.
        system_database_url: DBOS's system database, recorded in each run's `run.started`
            (without its password) so `fsm-kernel resume`/`signal` can send answers there; else
            they read FSM_KERNEL_DBOS_URL or DBOS_SYSTEM_DATABASE_URL.
        max_recovery_attempts: how often DBOS recovers a run before it gives up on it (its
            workflow then ends MAX_RECOVERY_ATTEMPTS_EXCEEDED); default DBOS's, 100.
        on_result: told each run's result when its workflow ends, in the process that ran it.
    """

    def __init__(
        self,
        agent: Agent,
        *,
        name: str | None = None,
        system_database_url: str | None = None,
        max_recovery_attempts: int | None = None,
        on_result: Callable[[RunResult], None] | None = None,
    ) -> None:
        if agent.store is None:
            raise ConfigError("DBOSAgent needs an Agent with a store: Agent(store=...)")
        self.agent = agent
        self.store: EventStore = agent.store
        self.name = f"fsm-kernel.{name or agent.spec.name}"
        self.engine = {"name": "dbos", "workflow": self.name}
        if system_database_url:
            self.engine["system_database"] = _without_password(system_database_url)
        self._kernel: Kernel | None = None

        self.on_result = on_result

        async def run_workflow(run_id: str, prompt: str) -> RunResult:
            return await self._run_workflow(run_id, prompt)

        attempts = _DBOS_ATTEMPTS if max_recovery_attempts is None else max_recovery_attempts
        self.workflow = DBOS.workflow(name=self.name, max_recovery_attempts=attempts)(run_workflow)
        """The DBOS workflow of a run, `(run_id, prompt)`: to enqueue it on a DBOS queue."""

    # -- runs -------------------------------------------------------------------------------

    async def run(self, prompt: str, *, run_id: str | None = None) -> RunResult:
        """Run `prompt` as a DBOS workflow (its id is the run's id) and wait for its end, or
        for its wait: a run waiting for a person returns `status == "waiting"` only once its
        workflow ends, so to answer while it waits use `start`, then `resume`/`signal`."""
        run_id = await self.start(prompt, run_id=run_id)
        return await self.result(run_id)

    async def start(self, prompt: str, *, run_id: str | None = None) -> str:
        """Start `prompt` as a DBOS workflow and return the run's id at once. Starting an id
        that exists already does not start it again (DBOS's idempotency)."""
        run_id = run_id or new_id()
        with SetWorkflowID(run_id):
            await DBOS.start_workflow_async(self.workflow, run_id, prompt)
        return run_id

    async def result(self, run_id: str) -> RunResult:
        """Wait for the run's workflow to end (in this process or any other) and return its
        result."""
        handle: WorkflowHandleAsync[RunResult] = await DBOS.retrieve_workflow_async(run_id)
        result = await handle.get_result()
        return result

    async def resume(self, run_id: str, *, answer: HumanAnswer) -> None:
        """Send `answer` to a run that waits for it (checked against its log first, as
        `Agent.resume` checks it); the run goes on in the process that runs its workflow.

        Raises:
            AnswerError: the run does not wait for this answer (nothing is sent).
        """
        run = RecordedRun.load(self.store, run_id)
        checked = check_answer(run, answer)
        assert checked is not None  # an answer was given, so one is returned
        destination, topic = _address(run, run.root_run_id(self.store))
        await DBOS.send_async(destination, checked.to_dict(), topic)

    async def cancel(self, run_id: str) -> str:
        """Cancel the run so that its log and DBOS agree on how it ended (see `cancel_run`);
        returns what happens, in one line.

        Raises:
            ResumeError: the run already ended: nothing is cancelled.
        """
        return await asyncio.to_thread(cancel_run, self.store, run_id, DBOS)

    async def signal(
        self, run_id: str, name: str, data: Any = None, *, by: str | None = None
    ) -> None:
        """Send the event `name` (with its JSON `data`) to a run waiting for it."""
        await self.resume(run_id, answer=HumanAnswer.signal(name, data, by=by))

    # -- the workflow -----------------------------------------------------------------------

    async def _run_workflow(self, run_id: str, prompt: str) -> RunResult:
        """The DBOS workflow: drive the run from its start (see the module's docstring)."""
        kernel = await self._durable_kernel()
        result = await drive(kernel, run_id, prompt)
        if self.on_result is not None:
            self.on_result(result)
        if result.termination_reason != "cancelled" and await _cancelled():
            _record_its_end(run_id, result)
        return result

    async def _durable_kernel(self) -> Kernel:
        """The agent's kernel with each collaborator a DBOS step, and the engine recorded in
        its settings (built once)."""
        if self._kernel is None:
            base = self.agent.kernel
            await attach_mcp(base, self.agent.spec, self.agent.mcp_servers)
            kernel = copy.copy(base)
            kernel.model = DBOSChatModel(base.model)
            kernel.tools = DBOSToolExecutor(base.tools)
            kernel.state_models = {s: DBOSChatModel(m) for s, m in base.state_models.items()}
            if base.children is not None:
                if isinstance(base.children, LiveChildren):  # children record the engine
                    base.children.settings = {"engine": {**self.engine, "child": True}}
                kernel.children = DBOSChildRunner(base.children)
            kernel.settings = {**base.settings, "engine": dict(self.engine)}
            self._kernel = kernel
        return self._kernel


def _record_its_end(run_id: str, result: RunResult) -> None:
    """The run's workflow was cancelled after the run's last step (its log says it ended
    `reason`), so DBOS would keep CANCELLED: resume the workflow, outside this execution, so
    that it runs again from its start, every step served from DBOS and every event matched by
    the log, and ends with the run's own outcome. The log decides how a run ended."""
    logger.warning("run %s: cancelled after it ended (%s); resuming its workflow so DBOS "
                   "records that end", run_id, result.termination_reason)  # fmt: skip

    async def resume() -> None:
        await DBOS.resume_workflow_async(run_id)

    loop = asyncio.get_running_loop()
    task = loop.create_task(resume(), context=contextvars.Context())
    _HEALING.add(task)
    task.add_done_callback(_HEALING.discard)


_HEALING: set[asyncio.Task[None]] = set()
"""Resumptions under way (a task needs a reference until it is done)."""


async def drive(kernel: Kernel, run_id: str, prompt: str) -> RunResult:
    """Drive the run `run_id` from its start on `kernel` (whose collaborators are DBOS steps):
    a new run records `run.started`; one the log has is caught up with its log (the workflow
    recovered), then recorded live after a `run.resumed` marker.

    Raises:
        ResumeError: the log's run follows another definition than `kernel`'s.
    """
    store = kernel.store
    assert store is not None
    with kernel.lock(run_id):
        events = store.read(run_id)
        if not events:
            recorder = kernel.recorder(run_id)
            recorder.record(EventType.RUN_STARTED, kernel.started_data(prompt, kernel.limits))
            ctx = kernel.new_context(
                run_id, prompt, recorder, human=DBOSChannel(recorder, kernel.settings)
            )
        else:
            run = RecordedRun.load(store, run_id)
            recorder = await _catching_up(kernel, run)
            ctx = kernel.new_context(
                run.run_id,
                run.goal,
                recorder,
                human=DBOSChannel(recorder, kernel.settings),
                recorded_failures=run.action_failures,
                history=run.history(store),
                limits=kernel.limits,
                recorded_children=run.children,
                recorded_deadlines=recorded_deadlines(run.events),
            )
        machine = kernel.workflow.instantiate(ctx)
        recorder.state = machine.state
        recorder.record(EventType.STATE_ENTERED, machine.entered_data())
        await recorder.flush()
        result = await kernel.drive(ctx, machine, recorder)
    if recorder.diverged_at is not None:
        logger.warning("run %s: the recovered steps left the log at seq %d", run_id,
                       recorder.diverged_at.seq)  # fmt: skip
    return result


async def _catching_up(kernel: Kernel, run: RecordedRun) -> RunRecorder:
    """The recorder of a recovered run: it matches the log's events, then records live (after
    a `run.resumed` marker, unless the run had ended: its workflow only had not returned)."""
    digest = run.definition[0]
    if digest != kernel.spec.content_hash:
        raise ResumeError(
            f"run {run.run_id} follows another definition of {kernel.spec.name} (sha256 "
            f"{str(digest)[:12]}) than this process's ({kernel.spec.content_hash[:12]}); DBOS "
            "recovers a run only with the workflow it started with",
            run_id=run.run_id,
        )
    watchers = (kernel.on_event,) if kernel.on_event is not None else ()
    next_seq = max(e.seq for e in run.events) + 1
    if run.terminated is None:
        marker = RunRecorder(run.run_id, kernel.store, clock=kernel.clock, next_seq=next_seq,
                             watchers=watchers)  # fmt: skip
        marker.record(EventType.RUN_RESUMED, _recovered(kernel, run))
        await marker.flush()
        next_seq += 1
    return RunRecorder(
        run.run_id,
        kernel.store,
        clock=kernel.clock,
        expected=run.replayable_events(),
        next_seq=next_seq,
        watchers=watchers,
    )


def _recovered(kernel: Kernel, run: RecordedRun) -> dict[str, Any]:
    return {
        "workflow_hash": kernel.spec.content_hash,
        "forced": False,
        "workflow_version": kernel.spec.version,
        "settings": kernel.settings,
        "limits": kernel.limits.model_dump(),
        "system_prompt": kernel.system_prompt,
        "overrides": {"engine": "dbos"},
        "reopened": "waiting" if run.waiting_for is not None else None,
        "rerun_tool_calls": sorted(run.unfinished),
        "iteration": max((e.iteration for e in run.events), default=0),
    }


# --- answering from outside ------------------------------------------------------------------


def dbos_engine(run: RecordedRun) -> dict[str, Any] | None:
    """How a run runs under DBOS (`run.started`'s `settings.engine`), or None: not under DBOS."""
    settings = run.started.data.get("settings") or {}
    engine = settings.get("engine") if isinstance(settings, Mapping) else None
    if isinstance(engine, Mapping) and engine.get("name") == "dbos":
        return dict(engine)
    return None


class Canceller(Protocol):
    """What cancels a workflow: the `DBOS` class in a launched process, a `DBOSClient` from
    any other."""

    def cancel_workflow(self, workflow_id: str) -> Any: ...


def cancel_run(store: EventStore, run_id: str, dbos: Canceller) -> str:
    """Cancel a run under DBOS so that its log and DBOS agree on how it ended, and say what
    happens (one line):

    - never started (queued: no log yet): cancelled, it never starts;
    - waiting (for a person, an event or a timer): it ends `cancelled` within a second
      (CANCEL_POLL_SECONDS), in its log as in DBOS;
    - running: it ends `cancelled` at its next step; one whose last step comes first ends as
      its log says, and its workflow then makes DBOS record that end (see `_record_its_end`).

    Raises:
        ResumeError: the run already ended in its log: nothing is cancelled.
    """
    try:
        run: RecordedRun | None = RecordedRun.load(store, run_id)
    except RunNotFoundError:  # queued, never started: no log yet
        run = None
    if run is not None and run.terminated is not None:
        reason = run.terminated.data.get("reason")
        raise ResumeError(f"run {run_id} already ended ({reason}): nothing to cancel",
                          run_id=run_id)  # fmt: skip
    dbos.cancel_workflow(run_id)
    if run is None:
        return f"cancelled run {run_id}: queued, it never starts"
    if run.waiting_for is not None:
        return f"cancelled run {run_id}: it was waiting; it ends 'cancelled' now"
    return f"cancelled run {run_id}: running, it ends 'cancelled' at its next step"


def _address(run: RecordedRun, root: str | None) -> tuple[str, str]:
    """Where an answer to `run` goes: (workflow id, topic). A child run's answers go to its
    root's workflow, on the child's own topic."""
    if root is None or root == run.run_id:
        return run.run_id, ANSWER_TOPIC
    return root, child_topic(run.run_id)


def send_to_run(run: RecordedRun, answer: HumanAnswer | None, *, root: str | None = None) -> str:
    """Send `answer` (checked against the log: `check_answer`) to the DBOS workflow of `run`
    from any process, without launching DBOS: what `fsm-kernel resume`/`signal` do for a run
    under DBOS. The system database is FSM_KERNEL_DBOS_URL, else DBOS_SYSTEM_DATABASE_URL,
    else the one its `run.started` recorded (a password comes from the environment then, as
    libpq reads PGPASSWORD). A child run's answer goes to the workflow of its `root` run (see
    `RecordedRun.root_run_id`), which waits for it. Returns the workflow's name.

    Raises:
        ResumeError: the run is not waiting for an answer (DBOS recovers a killed run, and
            fires a due timer, itself), or no system database is known.
    """
    engine = dbos_engine(run) or {}
    workflow = str(engine.get("workflow") or "fsm-kernel")
    if answer is None:
        doing = "fires its timer" if run.waiting_for else "recovers it once a process launches it"
        raise ResumeError(
            f"run {run.run_id} runs under DBOS (workflow {workflow}): DBOS {doing}; resume "
            "and signal only send it the answer it waits for",
            run_id=run.run_id,
        )
    url = (
        os.environ.get("FSM_KERNEL_DBOS_URL")
        or os.environ.get("DBOS_SYSTEM_DATABASE_URL")
        or engine.get("system_database")
    )
    if not url:
        raise ResumeError(
            f"run {run.run_id} runs under DBOS but recorded no system database: set "
            "FSM_KERNEL_DBOS_URL to it",
            run_id=run.run_id,
        )
    bound = check_answer(run, answer) or answer  # an approval names the call it answers
    destination, topic = _address(run, root)
    client = DBOSClient(system_database_url=str(url))
    try:
        client.send(destination, bound.to_dict(), topic)
    finally:
        client.destroy()
    return workflow


def _without_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username}@{host}" if parts.username else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))
