"""The public way to run workflows from Python: `Agent`, and `run`/`arun` for one prompt.

The CLI and the scheduler build their runs through this module too, so a behaviour fixed here
is fixed everywhere. An Agent is built once from a workflow and options (the CLI's), owns the
model client and the store it opened, and may run many prompts concurrently::

    async with Agent("default", base_url="http://localhost:11434/v1", model="qwen3") as agent:
        result = await agent.run("What time is it?")
        async for event in agent.stream("List the files here"):
            ...
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TypeAlias

from fsm_kernel.bootstrap import (
    RunOptions,
    attach_mcp,
    build_kernel,
    build_tools,
    load_spec,
    recorded_options,
    run_limits,
)
from fsm_kernel.child_runs import LiveChildren
from fsm_kernel.errors import ConfigError, ResumeError
from fsm_kernel.kernel import Kernel, RunResult, Watcher
from fsm_kernel.notify import Notifier
from fsm_kernel.protocol import (
    ChatModel,
    Event,
    EventStore,
    EventType,
    Message,
    ToolCall,
    ToolResult,
)
from fsm_kernel.regression import migration_check
from fsm_kernel.replay import (
    RecordedRun,
    ReplayReport,
    check_answer,
    recorded_conversation,
    replay_run,
    resume_run,
)
from fsm_kernel.streaming import TextDelta
from fsm_kernel.telemetry import RunTracer, tracer_provider, tracing_wanted
from fsm_kernel.tools.mcp_client import McpServers
from fsm_kernel.workflow.compiler import compile_workflow
from fsm_kernel.workflow.human import HumanAnswer, HumanChannel
from fsm_kernel.workflow.spec import NotifySpec, WorkflowSpec

__all__ = [
    "Agent",
    "IterationCompleted",
    "RunEnded",
    "StateEntered",
    "StreamEvent",
    "TextDelta",
    "ToolCallFinished",
    "ToolCallStarted",
    "TransitionTaken",
    "arun",
    "run",
]


# --- what agent.stream() yields ------------------------------------------------------------


@dataclass(frozen=True)
class StateEntered:
    state: str
    iteration: int


@dataclass(frozen=True)
class TransitionTaken:
    source: str
    target: str
    guard: str
    """The guard label ("has_tool_calls"), "" for the fallback."""
    reason: str | None
    """The termination reason of an edge into a final state."""


@dataclass(frozen=True)
class ToolCallStarted:
    call: ToolCall
    iteration: int


@dataclass(frozen=True)
class ToolCallFinished:
    call: ToolCall
    result: ToolResult
    duration_ms: float
    iteration: int


@dataclass(frozen=True)
class IterationCompleted:
    step: int
    record: dict[str, Any]
    """The `iteration.completed` event's data: decision, tools, answer, error, summary."""


@dataclass(frozen=True)
class RunEnded:
    result: RunResult


StreamEvent = (
    StateEntered
    | TransitionTaken
    | TextDelta
    | ToolCallStarted
    | ToolCallFinished
    | IterationCompleted
    | RunEnded
)


def _typed(event: Event) -> StreamEvent | None:
    """The stream's view of a recorded event; None for the ones it does not show."""
    data = event.data
    if event.type == EventType.STATE_ENTERED:
        return StateEntered(event.state or "", event.iteration)
    if event.type == EventType.TRANSITION_TAKEN:
        return TransitionTaken(
            data["source"], data["target"], data.get("guard") or "", data.get("reason")
        )
    if event.type == EventType.TOOL_STARTED:
        return ToolCallStarted(ToolCall.from_dict(data["call"]), event.iteration)
    if event.type == EventType.TOOL_FINISHED:
        return ToolCallFinished(
            ToolCall.from_dict(data["call"]),
            ToolResult.from_dict(data["result"]),
            float(data.get("duration_ms", 0.0)),
            event.iteration,
        )
    if event.type == EventType.ITERATION_COMPLETED:
        return IterationCompleted(int(data["step"]), dict(data))
    return None


Continuation: TypeAlias = "str | RunResult | Sequence[Message] | None"
"""What a run may continue from: a run id, a RunResult, or a list of Messages."""


# --- the agent -----------------------------------------------------------------------------


@dataclass
class _Owned:
    """What an Agent opened and must close."""

    closers: list[Callable[[], Any]] = field(default_factory=list)
    streams: set[asyncio.Task[RunResult]] = field(default_factory=set)
    """Runs of streams still in flight (a loop left early ends its run when the generator is
    closed, which Python does soon after, not at once)."""


class Agent:
    """A workflow ready to run prompts: built once, used for many runs, closed once.

    Args:
        workflow: a stock workflow's name ("default", "react", ...), a path to a YAML file, or a
            loaded WorkflowSpec. A file's folder is importable, for its own Python code.
        model, base_url, api_key, request_timeout, max_retries, max_response_bytes: the model
            server (else the environment's FSM_KERNEL_*, else the workflow's `agent:` block).
        max_iterations, timeout: override the workflow's limits (`timeout` in seconds).
        system_prompt, memory, workspace: as the CLI's flags.
        store: where runs are recorded: a location ("runs.db", "events.jsonl",
            "postgresql://…") opened and closed by the agent, or an EventStore you own; None (the
            default) keeps events in each RunResult only (no resume).
        tools: extra tool functions to offer, besides the workflow's.
        chat_model: a ChatModel to use instead of the HTTP client (a test double, your own).
        on_event: sees every run's events and streamed text as they happen: an event as it
            is recorded, a moment before its commit (the store, hence `signal`, `resume`
            and `cancel`, may not show it yet; the run's result comes after it).
        human: how runs reach a person (tool approval, `human.input` states): a HumanChannel
            whose `ask(question)` returns a HumanAnswer; None (the default) suspends such runs
            (`result.status == "waiting"`) until `resume(run_id, answer=...)`.
        otel: trace every run with OpenTelemetry (True), never (False), or when the standard
            OTEL_* environment asks for it (None, the default); see fsm_kernel.telemetry.
        notify: webhooks told about the runs, besides the workflow's own `notify:` (see
            fsm_kernel.notify).
        mcp_servers: the workflow's MCP servers, shared with other agents and closed by the
            caller (default: the agent starts its own on the first run and stops them).
    """

    def __init__(
        self,
        workflow: str | Path | WorkflowSpec = "default",
        *,
        model: str | None = None,
        base_url: str | None = None,
        api_key: str | None = None,
        request_timeout: float | None = None,
        max_retries: int | None = None,
        max_response_bytes: int | None = None,
        max_iterations: int | None = None,
        timeout: float | None = None,
        system_prompt: str | None = None,
        memory: str | Path | None = None,
        workspace: str | Path | None = None,
        store: str | Path | EventStore | None = None,
        tools: Sequence[Callable[..., Any]] = (),
        chat_model: ChatModel | None = None,
        stream: bool | None = None,
        on_event: Watcher | None = None,
        human: HumanChannel | None = None,
        otel: bool | None = None,
        notify: Sequence[NotifySpec] = (),
        mcp_servers: McpServers | None = None,
    ) -> None:
        self.spec = workflow if isinstance(workflow, WorkflowSpec) else load_spec(str(workflow))
        self.options = RunOptions(
            model=model,
            base_url=base_url,
            api_key=api_key,
            request_timeout=request_timeout,
            max_retries=max_retries,
            max_response_bytes=max_response_bytes,
            max_iterations=max_iterations,
            timeout_seconds=timeout,
            system_prompt=system_prompt,
            memory=None if memory is None else str(memory),
            workspace=None if workspace is None else str(workspace),
            stream=stream,
            extra_tools=list(tools),
        )
        self._chat_model = chat_model
        self._human = human
        self._owned = _Owned()
        self.store = self._open_store(store)
        self._on_event = self._watchers(on_event, otel, [*self.spec.notify, *notify])
        self._mcp = mcp_servers or McpServers(self.spec.mcp_servers)
        if mcp_servers is None:
            self._owned.closers.append(self._mcp.aclose)
        build_tools(self.spec, self.options)  # a workflow's tool problems show here, at once
        run_limits(self.spec, self.options)  # and so do bad limits
        self._default_kernel: Kernel | None = None

    @property
    def kernel(self) -> Kernel:
        """The kernel of this agent's runs, with its options; built (the model client opened)
        on first use, so an agent used only to resume or replay runs never builds it."""
        if self._default_kernel is None:
            self._default_kernel = self._kernel(self.options)
        return self._default_kernel

    @property
    def mcp_servers(self) -> McpServers:
        """The workflow's MCP servers: started on the first run, stopped with the agent (unless
        the caller passed its own, shared across agents: the scheduler, once per process)."""
        return self._mcp

    # -- life cycle -------------------------------------------------------------------------

    async def __aenter__(self) -> Agent:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Cancel streamed runs still going, then close the model client and the store the
        agent opened (safe to call twice)."""
        for task in list(self._owned.streams):
            if not task.cancelling():
                task.cancel()
        if self._owned.streams:
            await asyncio.gather(*self._owned.streams, return_exceptions=True)
        closers, self._owned.closers = self._owned.closers, []
        for close in reversed(closers):
            outcome = close()
            if asyncio.iscoroutine(outcome):
                await outcome

    # -- runs -------------------------------------------------------------------------------

    async def run(
        self, prompt: str, *, run_id: str | None = None, continue_from: Continuation = None
    ) -> RunResult:
        """Run the workflow on `prompt` to its end; never raises for how the run ended (see
        `RunResult.termination_reason`, `.ok`, `.error`).

        `continue_from` starts the conversation where another one left off: a run (its id, or
        its RunResult: with a store, its conversation is read back from the log, so resume and
        replay rebuild it the same way) or a list of Messages (recorded in `run.started`)."""
        history, continues = self._continuation(continue_from)
        await attach_mcp(self.kernel, self.spec, self._mcp)
        return await self.kernel.run(prompt, run_id=run_id, history=history, continues=continues)

    def _continuation(self, source: Continuation) -> tuple[list[Message], str | None]:
        """The history a run starts from, and the id of the run it continues (if one)."""
        if source is None:
            return [], None
        if isinstance(source, str | RunResult):
            run_id = source if isinstance(source, str) else source.run_id
            if self.store is None:
                if isinstance(source, RunResult):
                    return list(source.messages), source.run_id
                raise ConfigError("continuing a run by its id needs a store: Agent(store=...)")
            run_id = self.store.find_run(run_id)
            return recorded_conversation(self.store, run_id), run_id
        return list(source), None

    async def stream(
        self, prompt: str, *, run_id: str | None = None, continue_from: Continuation = None
    ) -> AsyncIterator[StreamEvent]:
        """Run `prompt`, yielding what happens as it happens: states, transitions, the model's
        text as it streams, tool calls, iterations, and last `RunEnded` with the result.
        Leaving the loop early cancels the run (it ends `cancelled`, recorded) as soon as the
        generator is closed: at once with `contextlib.aclosing(agent.stream(...))`, else when
        Python finalises it, and at the latest when the agent closes."""
        queue: asyncio.Queue[StreamEvent] = asyncio.Queue()

        def watch(item: Event | TextDelta) -> None:
            typed = item if isinstance(item, TextDelta) else _typed(item)
            if typed is not None:
                queue.put_nowait(typed)

        history, continues = self._continuation(continue_from)
        await attach_mcp(self.kernel, self.spec, self._mcp)
        task = asyncio.ensure_future(
            self.kernel.run(
                prompt, run_id=run_id, watch=watch, history=history, continues=continues
            )
        )
        self._owned.streams.add(task)
        task.add_done_callback(self._owned.streams.discard)
        try:
            while True:
                getter = asyncio.ensure_future(queue.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield getter.result()
                    continue
                getter.cancel()
                while not queue.empty():
                    yield queue.get_nowait()
                yield RunEnded(task.result())
                return
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def resume(
        self,
        run_id: str,
        *,
        force: bool = False,
        answer: HumanAnswer | None = None,
        migrate: bool = False,
        **overrides: Any,
    ) -> RunResult:
        """Continue a run recorded in the agent's store (killed, ended by a model server that
        could not be reached, or waiting for a person) with the settings it recorded;
        `overrides` (the keyword arguments of Agent, e.g. `base_url=`) replace some and are
        recorded. A run that waits for a person needs `answer` (`HumanAnswer.approve()`,
        `.reject("why")` or `.input("text")`, of the kind `result.waiting_for` names). An
        approval or rejection answers the tool call the run showed (`waiting_for["tool_call"]`);
        `HumanAnswer.approve(call=result.waiting_for["tool_call"])` binds it to the call you
        saw, so it is refused if the run now asks about another one.

        The run goes on under the definition it is pinned to (the workflow text it recorded),
        unless `force` (go on under this agent's workflow, unchecked) or `migrate`: move it to
        this agent's workflow once replaying its recorded steps under it decides identically,
        with the states renamed as its `migrations:` declare (see `migration_check`).

        Raises:
            ConfigError: the agent has no store, or an unknown override.
            AnswerError: a waiting run without its answer, the wrong kind of answer, or an
                approval of another call than the one the run's log asks about (nothing runs).
            RunNotFoundError, ResumeError, RunLockedError: see `fsm_kernel.replay.resume_run`;
                ResumeError also for a run an engine drives (`RecordedRun.engine`: DBOS).
        """
        store = self._require_store("resume")
        run = RecordedRun.load(store, run_id)
        if run.engine is not None:  # resumed here, it would run a second time beside its engine
            raise ResumeError(
                f"run {run.run_id} runs under {run.engine}: answer it through its engine "
                "(DBOSAgent.resume, or fsm-kernel resume, which sends the answer there)",
                run_id=run.run_id,
            )
        moving = await migration_check(store, run.run_id, self.spec) if migrate else None
        answer = check_answer(run, answer)  # before building anything
        given = _options(overrides)
        kernel = self._kernel(given.over(recorded_options(run.config())))
        await attach_mcp(kernel, self.spec, self._mcp)
        return await resume_run(
            kernel,
            store,
            run.run_id,
            force=force or migrate,
            overrides=given.given(),
            answer=answer,
            migrating=moving,
        )

    async def signal(
        self,
        run_id: str,
        name: str,
        data: Any = None,
        *,
        by: str | None = None,
        force: bool = False,
        migrate: bool = False,
        **overrides: Any,
    ) -> RunResult:
        """Deliver the event `name` (with its JSON `data`: guards read `ctx.event`, templates
        `{event.data.KEY}`) to a run waiting in a state whose edges carry `event: NAME`, and
        continue it (as `resume` does; `force`, `migrate` and `overrides` as there). To fire a
        due timer, `resume(run_id)` without an answer.

        Raises:
            AnswerError: the run does not wait for this event, or its timer is already due
                (nothing is recorded then).
            RunNotFoundError, ResumeError, RunLockedError: as for `resume`.
        """
        answer = HumanAnswer.signal(name, data, by=by)
        return await self.resume(run_id, force=force, answer=answer, migrate=migrate, **overrides)

    async def replay(self, run_id: str) -> ReplayReport:
        """Re-run a recorded run from its log (no model, no tools) and compare its steps."""
        store = self._require_store("replay")
        workflow = self._default_kernel.workflow if self._default_kernel else None
        return await replay_run(workflow or compile_workflow(self.spec), store, run_id)

    # -- building ---------------------------------------------------------------------------

    def _watchers(
        self, on_event: Watcher | None, otel: bool | None, hooks: Sequence[NotifySpec]
    ) -> Watcher | None:
        """What watches every run: `on_event`, OpenTelemetry spans when tracing is wanted, and
        the webhooks of `notify:` (told in the background; closing waits a little for them)."""
        watchers: list[Watcher] = [on_event] if on_event is not None else []
        if tracing_wanted(otel):
            provider, flush = tracer_provider()
            if flush is not None:
                self._owned.closers.append(flush)
            watchers.append(RunTracer(provider))
        if hooks:
            notifier = Notifier(
                hooks, store=self.store, is_success=self.spec.is_success, workflow=self.spec.name
            )
            self._owned.closers.append(notifier.aclose)
            watchers.append(notifier)
        if len(watchers) <= 1:
            return watchers[0] if watchers else None

        def every(item: Event | TextDelta) -> None:
            for watch in watchers:
                watch(item)

        return every

    def _open_store(self, store: str | Path | EventStore | None) -> EventStore | None:
        if store is None or isinstance(store, EventStore):
            return store
        from fsm_kernel.store import open_store

        opened = open_store(store)
        self._owned.closers.append(opened.close)
        return opened

    def _kernel(self, options: RunOptions) -> Kernel:
        kernel, model = build_kernel(
            self.spec, options, store=self.store, chat_model=self._chat_model, human=self._human
        )
        kernel.on_event = self._on_event
        kernel.children = LiveChildren(
            options,
            store=self.store,
            parent_model=model,
            chat_model=self._chat_model,
            human=self._human,
            on_event=self._on_event,
            closers=self._owned.closers,
            parent_base_url=str(kernel.settings.get("base_url") or ""),
        )
        if model is not self._chat_model and hasattr(model, "aclose"):
            self._owned.closers.append(model.aclose)
        for state_model in {id(m): m for m in kernel.state_models.values()}.values():
            if state_model is not model and hasattr(state_model, "aclose"):
                self._owned.closers.append(state_model.aclose)
        return kernel

    def _require_store(self, what: str) -> EventStore:
        if self.store is None:
            raise ConfigError(f"{what} needs a store: build the Agent with store=...")
        return self.store


_OPTION_NAMES = {
    "model": "model",
    "base_url": "base_url",
    "api_key": "api_key",
    "request_timeout": "request_timeout",
    "max_retries": "max_retries",
    "max_response_bytes": "max_response_bytes",
    "max_iterations": "max_iterations",
    "timeout": "timeout_seconds",
    "workspace": "workspace",
    "stream": "stream",
}


def _options(overrides: dict[str, Any]) -> RunOptions:
    unknown = set(overrides) - set(_OPTION_NAMES)
    if unknown:
        raise ConfigError(
            f"unknown resume option(s) {', '.join(sorted(unknown))} "
            f"(known: {', '.join(sorted(_OPTION_NAMES))})"
        )
    return RunOptions(**{_OPTION_NAMES[k]: v for k, v in overrides.items()})


# --- one prompt --------------------------------------------------------------------------


async def arun(workflow: str | Path | WorkflowSpec, prompt: str, **options: Any) -> RunResult:
    """Run one prompt through a workflow and close everything after (see Agent for options)."""
    async with Agent(workflow, **options) as agent:
        return await agent.run(prompt)


def run(workflow: str | Path | WorkflowSpec, prompt: str, **options: Any) -> RunResult:
    """`arun` for code without an event loop."""
    return asyncio.run(arun(workflow, prompt, **options))
