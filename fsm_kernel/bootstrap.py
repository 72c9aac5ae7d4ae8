"""Cold start: build a Kernel from configuration.

Precedence, lowest first: built-in defaults < the workflow file < FSM_KERNEL_* environment <
explicit options (the CLI's flags). Tests skip this module and pass fakes to Kernel directly.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import urlsplit

from pydantic import ValidationError

from fsm_kernel.config import AgentSettings, agent_settings_from_env, package_data_dir
from fsm_kernel.errors import ConfigError, ResumeError, WorkflowValidationError
from fsm_kernel.memory import build_system_prompt, load_memory
from fsm_kernel.protocol import ChatModel, EventStore
from fsm_kernel.tools import ToolRegistry, builtin_registry
from fsm_kernel.tools.mcp_client import McpRef, McpServers, parse_ref
from fsm_kernel.tools.registry import build_tool, import_tools
from fsm_kernel.workflow.compiler import compile_workflow
from fsm_kernel.workflow.human import HumanChannel
from fsm_kernel.workflow.loader import find_workflow, load_workflow, load_workflow_text
from fsm_kernel.workflow.spec import Limits, WorkflowSpec

if TYPE_CHECKING:  # imported where a run is built: `fsm-kernel validate` needs neither
    from fsm_kernel.kernel import Kernel
    from fsm_kernel.replay import RecordedRun

__all__ = [
    "RunOptions",
    "attach_mcp",
    "build_kernel",
    "build_tools",
    "list_stock_workflows",
    "load_spec",
    "mcp_refs",
    "recorded_options",
    "resolve_workflow",
    "run_limits",
    "same_origin",
]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class RunOptions:
    """Explicit overrides (the CLI's flags); None means "not given"."""

    model: str | None = None
    base_url: str | None = None
    api_key: str | None = None
    request_timeout: float | None = None
    max_retries: int | None = None
    max_response_bytes: int | None = None
    stream: bool | None = None
    max_iterations: int | None = None
    timeout_seconds: float | None = None
    system_prompt: str | None = None
    memory: str | None = None
    workspace: str | None = None
    full_system_prompt: str | None = None
    """The complete system prompt, memory included (a recorded run's): used as it is."""
    limits: Mapping[str, Any] | None = None
    """A complete `limits:` block replacing the workflow's (a recorded run's); the
    max_iterations and timeout_seconds options still apply on top."""
    extra_tools: list[Any] = field(default_factory=list)
    """Extra tool functions to register and offer (the scheduler's state tools)."""

    def given(self) -> dict[str, Any]:
        """The options that were set (not None), by name: what overrides a recorded run."""
        skip = {"extra_tools", "limits", "full_system_prompt"}
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in skip and getattr(self, f.name) is not None
        }

    def over(self, base: RunOptions) -> RunOptions:
        """`base` with every option set here applied on top."""
        return replace(base, **self.given())


RECORDED_SETTINGS = (
    "model",
    "base_url",
    "request_timeout",
    "max_retries",
    "max_response_bytes",
    "stream",
)
"""The agent settings `run.started` records (with `workspace`) that a resume takes back."""


def recorded_options(config: Mapping[str, Any]) -> RunOptions:
    """The options a recorded run ran with (see `RecordedRun.config`): its server, model,
    timeouts, retries, workspace, system prompt and limits. Never a secret: the API key comes
    from the environment, as for a new run."""
    settings = config.get("settings") or {}
    return RunOptions(
        **{k: settings[k] for k in RECORDED_SETTINGS if settings.get(k) is not None},
        workspace=settings.get("workspace"),
        full_system_prompt=config.get("system_prompt"),
        limits=config.get("limits"),
    )


def load_spec(name_or_path: str) -> WorkflowSpec:
    """Load a workflow by path or stock name. Its folder and the current directory are put on
    sys.path first, so its `package.module:function` references import like a project's own
    code (as `python -m` would)."""
    path = resolve_workflow(name_or_path)
    for folder in (str(Path.cwd()), str(path.resolve().parent)):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    return load_workflow(path)


def pinned_spec(text: str, path: str | None) -> WorkflowSpec:
    """The workflow a run recorded, from its text: as if still at its recorded path, so a
    relative `memory:` or called workflow resolves against the original file's folder, and its
    `package.module:function` references import from the environment as `load_spec` lets them.
    A cycle not proven bounded is accepted: the run was recorded before `validate` proved
    cycles, and the kernel's limits (max_transitions) bound it still.

    Raises:
        WorkflowValidationError: the recorded text no longer validates (e.g. a Python
            reference it names is gone).
    """
    where = path or "<recorded>"
    for folder in (str(Path.cwd()), str(Path(where).resolve().parent)):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    return load_workflow_text(text, path=where, proofs=False)


def recorded_workflow(run: RecordedRun) -> WorkflowSpec | str:
    """The definition a recorded run follows: the text it recorded (run.started, or the
    run.resumed that moved it), as a spec pinned to its recorded path; for a log an older
    fsm-kernel wrote, without the text, the recorded path (the caller loads the file and checks
    it against the recorded sha256 as it needs).

    Raises:
        ResumeError: the run recorded neither its workflow's text nor a path.
    """
    text = run.definition[1]
    path = run.started.data.get("workflow_path")
    if text is not None:
        return pinned_spec(text, str(path) if path else None)
    if not path:
        raise ResumeError(
            f"run {run.run_id} recorded neither its workflow text nor a path; pass --workflow",
            run_id=run.run_id,
        )
    return str(path)


def resolve_workflow(name_or_path: str | Path) -> Path:
    """A path that exists wins; otherwise a stock workflow by name ("react" or "react.yaml")."""
    return find_workflow(name_or_path)


def list_stock_workflows() -> list[tuple[str, str]]:
    """(name, description) of every stock workflow."""
    stock = package_data_dir("workflows")
    if stock is None:
        return []
    out = []
    for path in sorted(stock.glob("*.yaml")):
        try:
            out.append((path.stem, load_workflow(path).description))
        except WorkflowValidationError as exc:  # a broken stock file must not hide the others
            out.append((path.stem, f"(invalid: {exc})"))
    return out


def agent_settings(
    spec: WorkflowSpec, options: RunOptions, environ: Mapping[str, str] | None = None
) -> AgentSettings:
    """Defaults < workflow `agent:` block < environment < options."""
    settings = AgentSettings().merged(spec.agent.model_dump())  # tool_choice included
    settings = settings.merged(agent_settings_from_env(environ))
    return settings.merged(
        {
            "model": options.model,
            "base_url": options.base_url,
            "api_key": options.api_key,
            "request_timeout": options.request_timeout,
            "max_retries": options.max_retries,
            "max_response_bytes": options.max_response_bytes,
            "stream": options.stream,
        }
    )


def _memory_dir(spec: WorkflowSpec, options: RunOptions) -> Path | None:
    if options.memory is not None:
        return Path(options.memory)  # explicit: load_memory reports it if it is missing
    if spec.memory is None:
        return None
    relative = Path(spec.memory)
    if relative.is_absolute():
        return relative
    candidates = [Path.cwd() / relative, Path(spec.path).parent / relative]
    stock = package_data_dir(relative.name)
    if stock is not None:
        candidates.append(stock)
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    logger.warning("memory folder %r not found; running without memory", spec.memory)
    return None


def _register(registry: ToolRegistry, func: Any) -> str:
    """Register `func`; returns the name it got (its @tool name or its function name)."""
    entry = build_tool(func)
    registry.add(entry)
    return entry.name


class BuiltTools(NamedTuple):
    """A workflow's tools, ready for its runs."""

    registry: ToolRegistry
    """The built-ins, the workflow's own and the extras."""
    offered: list[str]
    """The names the model is offered."""
    approval: frozenset[str]
    """The names a person approves each call of (`approval: required`)."""


def build_tools(spec: WorkflowSpec, options: RunOptions) -> BuiltTools:
    """The registry (built-ins, the workflow's own, extras), the names to offer and the ones
    that need a person's approval."""
    registry = builtin_registry(options.workspace or ".")
    offered: list[str] = []
    approval: set[str] = set()
    for i, entry in enumerate(spec.tools):
        ref = entry.name
        if parse_ref(ref) is not None:
            continue  # an MCP server's tools: offered once it has started (attach_mcp)
        if ":" in ref or "." in ref:
            try:
                names = [_register(registry, f) for f in import_tools(ref)]
            except ConfigError as exc:
                where = spec.location("tools", i)
                raise WorkflowValidationError(exc.message, location=where) from None
        elif ref in registry:
            names = [ref]
        else:
            known = ", ".join(registry.names())
            raise WorkflowValidationError(
                f"unknown tool {ref!r} (built-in: {known}; or package.module:function)",
                location=spec.location("tools", i),
            )
        offered += names
        if entry.approval == "required":
            approval.update(names)
    offered += [_register(registry, f) for f in options.extra_tools]
    if not mcp_refs(spec):  # else checked once the servers have listed their tools
        _check_state_tools(spec, offered)
        _check_tool_choices(spec, offered)
    return BuiltTools(registry, offered, frozenset(approval))


def _check_state_tools(spec: WorkflowSpec, offered: Sequence[str]) -> None:
    for sid, state in spec.states.items():
        for j, name in enumerate(state.tools or ()):
            if name not in offered:
                raise WorkflowValidationError(
                    f"state tool {name!r} is not in the workflow's tools",
                    location=spec.location("states", sid, "tools", j),
                )


def mcp_refs(spec: WorkflowSpec) -> list[tuple[McpRef, bool]]:
    """The workflow's `tools:` entries naming MCP tools, each with whether a person approves
    its calls."""
    out = []
    for entry in spec.tools:
        ref = parse_ref(entry.name)
        if ref is not None:
            out.append((ref, entry.approval == "required"))
    return out


async def attach_mcp(kernel: Kernel, spec: WorkflowSpec, servers: McpServers) -> None:
    """Start the workflow's MCP servers (once: `servers` keeps them) and offer the tools its
    `mcp:` entries select to the kernel's runs, with their approval settings; `run.started`
    records them with the servers (never an env value or a header). Idempotent.

    Raises:
        ConfigError: a server did not start in time, or lacks a tool an entry names.
        WorkflowValidationError: a state's `tools:` names a tool no entry offers.
    """
    refs = mcp_refs(spec)
    if not refs:
        return
    if not isinstance(kernel.tools, ToolRegistry):
        raise ConfigError("MCP tools need the kernel's own tool registry")
    got = await servers.register([ref for ref, _ in refs], kernel.tools)
    names = [name for _, selected in got for name in selected]
    new = [n for n in dict.fromkeys(names) if n not in kernel.tool_names]
    kernel.tool_names = (*kernel.tool_names, *new)
    approval = {
        name
        for (_, selected), (_, required) in zip(got, refs, strict=True)
        if required
        for name in selected
    }
    if approval:
        kernel.approval_required = kernel.approval_required | approval
        kernel.settings["approval"] = sorted(kernel.approval_required)
    kernel.settings["tools"] = list(kernel.tool_names)
    kernel.settings["mcp_servers"] = {
        name: server.recorded() for name, server in spec.mcp_servers.items()
    }
    _check_state_tools(spec, kernel.tool_names)
    _check_tool_choices(spec, list(kernel.tool_names))


def _check_tool_choices(spec: WorkflowSpec, offered: list[str]) -> None:
    """A `tool_choice:` names a keyword or a tool offered where it applies; `required` or a
    tool's name where no tool is offered could never be honoured."""
    places: list[tuple[tuple[str, ...], str | None, list[str]]] = [
        (("agent", "tool_choice"), spec.agent.tool_choice, offered)
    ]
    places += [
        (("states", sid, "tool_choice"), s.tool_choice, offered if s.tools is None else s.tools)
        for sid, s in spec.states.items()
    ]
    places += [
        (("states", sid, "agent", "tool_choice"), s.agent.tool_choice, offered)
        for sid, s in spec.states.items()
        if s.agent is not None
    ]
    for where, choice, tools in places:
        if choice is None or choice in ("auto", "none", "omit"):
            continue
        if choice == "required" and not tools:
            message = "tool_choice 'required' where no tool is offered"
        elif choice != "required" and choice not in tools:
            shown = ", ".join(tools) or "none"
            message = f"tool_choice {choice!r} is not a tool offered here (offered: {shown})"
        else:
            continue
        raise WorkflowValidationError(message, location=spec.location(*where))


def run_limits(spec: WorkflowSpec, options: RunOptions) -> Limits:
    """The limits a run gets: the workflow's (or a recorded run's, `options.limits`) with the
    iteration cap / timeout overridden by options (validated)."""
    flags = {"max_iterations": "--max-iterations", "timeout_seconds": "--timeout"}
    updates = {k: getattr(options, k) for k in flags if getattr(options, k) is not None}
    if not updates and options.limits is None:
        return spec.limits
    base = dict(options.limits) if options.limits is not None else spec.limits.model_dump()
    try:
        limits = Limits.model_validate({**base, **updates})
    except ValidationError as exc:
        err = exc.errors()[0]
        key = str(err["loc"][0])
        raise ConfigError(f"{flags.get(key, f'limits.{key}')}: {err['msg']}") from None
    return limits


BUNDLED_NOTICE = (
    "no model server at {url}; using the bundled SmolLM2-135M (tiny, for trying the loop) — "
    "set --base-url or --model for real work"
)
_PROBE_SECONDS = 0.3


def _server_answers(base_url: str) -> bool:
    """Whether something accepts connections at the URL's host and port (no request sent)."""
    url = urlsplit(base_url)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "localhost", port), _PROBE_SECONDS):
            return True
    except OSError:
        return False


def _nothing_configured(
    spec: WorkflowSpec, options: RunOptions, environ: Mapping[str, str]
) -> bool:
    """No server and no model chosen anywhere: flags, environment, the workflow."""
    given = (
        options.base_url,
        options.model,
        spec.agent.base_url,
        spec.agent.model,
        environ.get("FSM_KERNEL_BASE_URL"),
        environ.get("FSM_KERNEL_MODEL"),
    )
    return not any(given)


def local_model_available() -> bool:
    """Whether the bundled model can run here (fsm_kernel.agent.local's check, imported when
    asked: the model clients load only when a run is built, not to validate a workflow)."""
    from fsm_kernel.agent.local import local_model_available as available

    return available()


def choose_model(
    spec: WorkflowSpec, options: RunOptions, environ: Mapping[str, str] | None = None
) -> tuple[AgentSettings, str | None]:
    """The settings to run with, and the notice to show when the bundled model stands in.

    With nothing configured and nothing answering at the default Ollama address, the bundled
    model runs instead, if the `local` extra is installed (else the run reports that Ollama
    is unreachable, naming both ways out)."""
    from fsm_kernel.agent.local import BUNDLED

    environ = os.environ if environ is None else environ
    settings = agent_settings(spec, options, environ)
    if (
        _nothing_configured(spec, options, environ)
        and local_model_available()
        and not _server_answers(settings.base_url)
    ):
        return settings.merged({"model": BUNDLED}), BUNDLED_NOTICE.format(url=settings.base_url)
    return settings, None


def chat_model_for(settings: AgentSettings, environ: Mapping[str, str] | None = None) -> ChatModel:
    """The HTTP client, or the in-process llama.cpp model for `local` / `local:PATH.gguf`."""
    from fsm_kernel.agent import HttpChatModel
    from fsm_kernel.agent.local import (
        LocalChatModel,
        is_local_model,
        resolve_gguf,
        small_model_setting,
    )

    if not is_local_model(settings.model):
        return HttpChatModel(settings)
    environ = os.environ if environ is None else environ
    return LocalChatModel(
        resolve_gguf(settings.model),
        n_ctx=_env_count(environ, "FSM_KERNEL_LOCAL_CONTEXT") or 4096,
        n_threads=_env_count(environ, "FSM_KERNEL_LOCAL_THREADS"),
        max_tokens=_env_count(environ, "FSM_KERNEL_LOCAL_MAX_TOKENS") or 512,  # a tiny model
        tool_choice=settings.tool_choice,
        # A small model calls a tool again instead of reading its result: it answers.
        answer_after_result=small_model_setting(environ),
    )


def _origin(base_url: str) -> tuple[str, str, int | None]:
    url = urlsplit(base_url)
    try:
        port = url.port
    except ValueError:
        port = None
    return url.scheme.lower(), (url.hostname or "").lower(), port


def same_origin(a: str, b: str) -> bool:
    """Whether two base URLs are one server (scheme, host, port): where an API key may go."""
    return _origin(a) == _origin(b)


def state_agent_settings(spec: WorkflowSpec, run: AgentSettings) -> dict[str, AgentSettings]:
    """The settings of each state with its own `agent:` block: its keys over the run's (which
    are the workflow's block < environment < flags), so a state can pin a fallback model.

    The run's API key goes only to a state server with the run's origin (scheme, host, port):
    a key is never sent to another server the workflow names.
    """
    out: dict[str, AgentSettings] = {}
    for sid, state in spec.states.items():
        if state.agent is None:
            continue
        settings = run.merged(state.agent.model_dump())
        if _origin(settings.base_url) != _origin(run.base_url):
            settings = replace(settings, api_key=None)
        out[sid] = settings
    return out


def _state_models(
    spec: WorkflowSpec,
    run: AgentSettings,
    run_model: ChatModel,
    environ: Mapping[str, str] | None,
) -> dict[str, ChatModel]:
    """One model per distinct state setting (states with the run's own settings share its)."""
    built: dict[AgentSettings, ChatModel] = {run: run_model}
    models: dict[str, ChatModel] = {}
    for sid, settings in state_agent_settings(spec, run).items():
        if settings not in built:
            built[settings] = chat_model_for(settings, environ)
        models[sid] = built[settings]
    return models


def _recorded_state_agents(spec: WorkflowSpec, run: AgentSettings) -> dict[str, Any]:
    """What `run.started` records of the states' `agent:` blocks: the keys each sets, as the
    run resolved them (never a key)."""
    recorded: dict[str, Any] = {}
    for sid, settings in state_agent_settings(spec, run).items():
        block = spec.states[sid].agent
        keys = block.model_dump(exclude_none=True) if block is not None else {}
        recorded[sid] = {k: getattr(settings, k) for k in keys}
    return recorded


def _env_count(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name)
    if not raw:
        return None
    if not raw.strip().isdigit() or int(raw) < 1:
        raise ConfigError(f"{name}={raw!r} is not a whole number >= 1")
    return int(raw)


def _system_prompt(spec: WorkflowSpec, options: RunOptions) -> str:
    """The recorded prompt of a resumed run as it was; otherwise the workflow's (or
    --system-prompt) with the memory files appended."""
    if options.full_system_prompt is not None and options.system_prompt is None:
        return options.full_system_prompt
    base_prompt = options.system_prompt if options.system_prompt is not None else spec.system_prompt
    memory = load_memory(_memory_dir(spec, options))
    logger.debug("memory loaded: %s", [m.name for m in memory])
    return build_system_prompt(base_prompt, memory)


def build_kernel(
    spec: WorkflowSpec,
    options: RunOptions | None = None,
    *,
    store: EventStore | None = None,
    environ: Mapping[str, str] | None = None,
    chat_model: ChatModel | None = None,
    human: HumanChannel | None = None,
) -> tuple[Kernel, ChatModel]:
    """A Kernel wired to the model (`chat_model`, else the HTTP client for the settings), the
    tool registry, memory, `store` and the channel to a person (`human`; default: runs that
    need one suspend).

    A model this builds must be closed (`await model.aclose()`) after the runs, and so must
    the states' own (`kernel.state_models`, built from their `agent:` blocks unless
    `chat_model` is given: then every state uses it).
    """
    from fsm_kernel.agent.local import LocalChatModel
    from fsm_kernel.kernel import Kernel

    options = options or RunOptions()
    limits = run_limits(spec, options)
    settings, notice = (
        (agent_settings(spec, options, environ), None)
        if chat_model is not None
        else choose_model(spec, options, environ)
    )
    registry, offered, approval = build_tools(spec, options)
    system_prompt = _system_prompt(spec, options)
    model = chat_model if chat_model is not None else chat_model_for(settings, environ)
    if notice:
        logger.warning("%s", notice)
    described = model.describe() if isinstance(model, LocalChatModel) else {}
    state_models = {} if chat_model is not None else _state_models(spec, settings, model, environ)
    state_agents = _recorded_state_agents(spec, settings)
    kernel = Kernel(
        compile_workflow(spec),
        model=model,
        tools=registry,
        store=store,
        system_prompt=system_prompt,
        settings={
            **settings.public_dict(),
            **({"local": described} if described else {}),
            **({"fallback": notice} if notice else {}),
            "tools": offered,
            **({"approval": sorted(approval)} if approval else {}),
            "workspace": str(Path(options.workspace or ".").resolve()),
            **({"state_agents": state_agents} if state_agents else {}),
        },
        tool_names=offered,
        limits=limits,
        human=human,
        approval_required=approval,
        state_models=state_models,
    )
    return kernel, model
