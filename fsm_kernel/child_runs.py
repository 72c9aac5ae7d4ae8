"""The live ChildRunner: runs the children of `workflow.call` / `workflow.map` states for the
runs of one Agent (so for the CLI, the scheduler and users' code alike).

A child run gets the parent's model server settings (model, base URL, key, timeouts, retries,
workspace; not its limits, system prompt or memory, which are the child workflow's own) and
the parent's store. Given the id its parent recorded, it is found in the store first: a child
that ended is not run again (its outcome is read from its log, even an ending a direct `resume`
could reopen, since that is the outcome the parent went on with), one that was cut off (killed,
or waiting for a person with the answer now given) is resumed, and one the store does not
have is started.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from fsm_kernel.bootstrap import (
    RunOptions,
    attach_mcp,
    build_kernel,
    recorded_options,
    same_origin,
)
from fsm_kernel.errors import RunNotFoundError
from fsm_kernel.kernel import Kernel, Watcher
from fsm_kernel.protocol import ChatModel, EventStore, EventType, Usage
from fsm_kernel.replay import RecordedRun, resume_run
from fsm_kernel.tools.mcp_client import McpServers
from fsm_kernel.workflow.children import (
    ChildRequest,
    ChildResult,
    bounded_limits,
    charge_shared_calls,
)
from fsm_kernel.workflow.human import HumanChannel
from fsm_kernel.workflow.loader import find_workflow, load_workflow
from fsm_kernel.workflow.spec import WorkflowSpec

__all__ = ["LiveChildren"]

_INHERITED = (
    "model",
    "base_url",
    "api_key",
    "request_timeout",
    "max_retries",
    "max_response_bytes",
    "stream",
    "workspace",
)
"""The parent's options a child run gets (the server it talks to, where it works)."""


class LiveChildren:
    """Starts, resumes or reuses child runs (see the module's docstring)."""

    def __init__(
        self,
        options: RunOptions,
        *,
        store: EventStore | None,
        parent_model: ChatModel,
        chat_model: ChatModel | None = None,
        human: HumanChannel | None = None,
        on_event: Watcher | None = None,
        closers: list[Callable[[], Any]] | None = None,
        parent_base_url: str = "",
    ) -> None:
        self.options = RunOptions(**{k: getattr(options, k) for k in _INHERITED})
        self.store = store
        self.parent_model = parent_model
        self.chat_model = chat_model
        self.human = human
        self.on_event = on_event
        self.closers = closers if closers is not None else []
        self.parent_base_url = parent_base_url
        """Where the parent's model is: a child naming another origin gets no API key."""
        self.settings: dict[str, Any] = {}
        """Settings every child's kernel adds to its own (recorded in its `run.started`): an
        engine running the parent (fsm_kernel.integrations.dbos) marks its children so."""
        self._kernels: dict[Path, Kernel] = {}
        self._mcp: dict[Path, McpServers] = {}
        self._building = asyncio.Lock()

    async def run(self, request: ChildRequest) -> ChildResult:
        path = find_workflow(request.workflow, relative_to=request.caller)
        recorded = self._recorded(request.run_id)
        if recorded is not None:
            return await self._again(recorded, path, request)
        kernel = await self._kernel(path)
        limits = bounded_limits(kernel.limits, request.max_iterations, request.timeout_seconds)
        result = await kernel.run(
            request.prompt,
            run_id=request.run_id,
            limits=limits,
            parent_run_id=request.parent_run_id,
        )
        return result.as_child()

    def _recorded(self, run_id: str) -> RecordedRun | None:
        if self.store is None:
            return None
        try:
            return RecordedRun.load(self.store, run_id)
        except RunNotFoundError:
            return None

    async def _again(self, run: RecordedRun, path: Path, request: ChildRequest) -> ChildResult:
        """A child the store has: its outcome when it ended, else it goes on (resumed)."""
        assert self.store is not None
        spec = self._spec(run, path)
        if run.terminated is not None:  # it ended (even resumably): the parent saw this ending
            ended = _from_log(run, spec)
            charge_shared_calls(_drawn(run, ended))  # as it drew on its map's shared calls
            return ended
        answer = None
        if run.waiting_for is not None:
            answer = request.take_answer()
            if answer is None:  # still nobody to answer: the parent waits on
                return _from_log(run, spec)
        options = RunOptions(**self.options.given()).over(recorded_options(run.config()))
        kernel = self._build(spec, options)
        await attach_mcp(kernel, spec, self._servers(path, spec))
        result = await resume_run(kernel, self.store, run.run_id, answer=answer)
        return result.as_child()

    def _inherited(
        self, own: dict[str, Any], options: RunOptions
    ) -> tuple[RunOptions, dict[str, str]]:
        """The options and environment a child's kernel is built from: the parent's, except
        what the child's own `agent:` block sets (its keys win), and without the API key when
        it names a server of another origin than its parent's (a key never goes elsewhere)."""
        cleared: dict[str, Any] = {k: None for k in own if k in _ENV_NAMES}
        dropped = {name for k in own for name in _ENV_NAMES.get(k, ())}
        base_url = own.get("base_url")
        if base_url is not None and not same_origin(str(base_url), self.parent_base_url):
            cleared["api_key"] = None
            dropped.update(_KEY_NAMES)
        environ = {k: v for k, v in os.environ.items() if k not in dropped}
        return replace(options, **cleared), environ

    def _spec(self, run: RecordedRun, path: Path) -> WorkflowSpec:
        recorded = run.started.data.get("workflow_path")
        if recorded and Path(str(recorded)).is_file():
            return load_workflow(str(recorded))
        return load_workflow(path)

    async def _kernel(self, path: Path) -> Kernel:
        """The kernel of a child workflow, built once (its MCP tools attached before any child
        of a map uses it: the children starting together wait for the first)."""
        key = _key(path)
        async with self._building:
            kernel = self._kernels.get(key)
            if kernel is None:
                spec = load_workflow(path)
                kernel = self._build(spec, self.options)
                await attach_mcp(kernel, spec, self._servers(path, spec))
                self._kernels[key] = kernel
        return kernel

    def _servers(self, path: Path, spec: WorkflowSpec) -> McpServers:
        """The MCP servers of a child workflow, started once for all its children."""
        key = _key(path)
        servers = self._mcp.get(key)
        if servers is None:
            servers = self._mcp[key] = McpServers(spec.mcp_servers)
            self.closers.append(servers.aclose)
        return servers

    def _build(self, spec: WorkflowSpec, options: RunOptions) -> Kernel:
        """A kernel for the child's workflow: the parent's model when the child's workflow
        names no server settings of its own (`agent:`), else one of its own (closed with the
        agent), whose `agent:` keys win over the settings inherited from the parent."""
        own = spec.agent.model_dump(exclude_none=True)
        shared = self.chat_model or (None if own else self.parent_model)
        inherited, environ = self._inherited(own, options)
        kernel, model = build_kernel(
            spec,
            inherited,
            store=self.store,
            chat_model=shared,
            human=self.human,
            environ=environ,
        )
        kernel.on_event = self.on_event
        kernel.children = self
        if self.settings:
            kernel.settings = {**kernel.settings, **self.settings}
        if model is not shared and hasattr(model, "aclose"):
            self.closers.append(model.aclose)
        return kernel


_ENV_NAMES: dict[str, tuple[str, ...]] = {
    "base_url": ("FSM_KERNEL_BASE_URL",),
    "model": ("FSM_KERNEL_MODEL",),
    "request_timeout": ("FSM_KERNEL_REQUEST_TIMEOUT",),
    "max_retries": ("FSM_KERNEL_MAX_RETRIES",),
    "max_response_bytes": ("FSM_KERNEL_MAX_RESPONSE_BYTES",),
    "stream": ("FSM_KERNEL_STREAM",),
}
"""The environment variables that set each agent key (see config.agent_settings_from_env)."""
_KEY_NAMES = ("FSM_KERNEL_API_KEY", "OPENAI_API_KEY")


def _key(path: Path) -> Path:
    """One key per workflow file, however it was named."""
    return path.resolve()


def _from_log(run: RecordedRun, spec: WorkflowSpec) -> ChildResult:
    """A child's outcome as its log records it (it ended, or it waits for a person)."""
    usage = Usage()
    iterations = 0
    for e in run.events:
        if e.type == EventType.MODEL_RESPONDED:
            usage = usage + Usage.from_dict(e.data["completion"].get("usage") or {})
        iterations = max(iterations, e.iteration)
    ended = run.terminated.data if run.terminated is not None else {}
    reason = ended.get("reason")
    return ChildResult(
        run_id=run.run_id,
        workflow=spec.name,
        reason=None if reason is None else str(reason),
        ok=reason is not None and spec.is_success(str(reason)),
        answer=str(ended.get("answer") or ""),
        output=ended.get("output"),
        iterations=int(ended.get("iterations", iterations)) + int(ended.get("child_iterations", 0)),
        usage=usage,
        error=ended.get("error"),
        waiting_for=run.waiting_for,
    )


def _drawn(run: RecordedRun, ended: ChildResult) -> int:
    """The model calls a child that ended drew on the pools of the maps it is a child of: its
    own (`shared_calls`, as its ending records them) and its children's."""
    data = run.terminated.data if run.terminated is not None else {}
    own = data.get("shared_calls")
    if own is None:  # a log from before pools were recorded: all its model calls
        return ended.iterations
    return int(own) + int(data.get("child_iterations", 0))
