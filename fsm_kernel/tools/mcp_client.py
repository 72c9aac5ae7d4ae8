"""MCP (Model Context Protocol) tool servers as tools of a run, through the official `mcp` SDK
(the `mcp` extra: `pip install -e '.[mcp]'`).

A workflow declares servers under `mcp_servers:` (a command started over stdio, or a
streamable HTTP URL) and offers their tools with `tools:` entries `mcp:NAME` (all of them) or
`mcp:NAME/TOOL`. `McpServers` starts each server once (on first use, within its
`startup_timeout`), lists its tools, and registers them in a ToolRegistry as `McpTool`s, named as
the server names them unless that collides with another tool (then `NAME__tool`). A call goes to
the server under its `call_timeout`; a server that fails the call, hangs, or has died turns the
call into an error result and the run goes on (the kernel's `max_tool_failures` ends it if it
keeps failing).

Each server's SDK client lives in a task of its own, which enters and leaves it (the SDK's
streams belong to the task that opened them); calls from the run's tasks are sent through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import pydantic

from fsm_kernel.errors import ConfigError, ToolArgumentsError, ToolExecutionError
from fsm_kernel.protocol import ToolCall
from fsm_kernel.redact import register_secret
from fsm_kernel.tools.registry import RegisteredTool, ToolRegistry

__all__ = ["MCP_PREFIX", "McpRef", "McpServers", "McpTool", "parse_ref"]

logger = logging.getLogger(__name__)

MCP_PREFIX = "mcp:"
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_INVALID = re.compile(r"[^A-Za-z0-9_-]")
_STDERR_SHOWN = 600
"""How much of a server's stderr a start-up error quotes (its last characters)."""


class McpRef(NamedTuple):
    """A `tools:` entry naming MCP tools: a server, and one of its tools or all (None)."""

    server: str
    tool: str | None


def parse_ref(ref: str) -> McpRef | None:
    """`mcp:NAME` or `mcp:NAME/TOOL` as an McpRef; None for any other tool reference."""
    if not ref.startswith(MCP_PREFIX):
        return None
    server, _, tool = ref[len(MCP_PREFIX) :].partition("/")
    return McpRef(server, tool or None)


def expand(value: str, environ: Mapping[str, str], what: str) -> str:
    """`value` with each `${NAME}` replaced by the environment's NAME (registered as a secret,
    so the log, the progress output and errors redact it).

    Raises:
        ConfigError: a NAME is not set (naming `what`, never the value).
    """

    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in environ:
            raise ConfigError(f"{what} uses ${{{name}}}, which is not set in the environment")
        register_secret(environ[name])  # never in the log, whatever echoes it
        return environ[name]

    return _ENV_REF.sub(one, value)


class _Passthrough(pydantic.BaseModel):
    """MCP tools validate their own arguments: the kernel passes them on as the model sent
    them (a JSON object)."""

    model_config = pydantic.ConfigDict(extra="allow")


@dataclass(frozen=True, kw_only=True)
class McpTool(RegisteredTool):
    """A tool of an MCP server, registered under the name the model is offered."""

    server: str
    remote: str
    """Its name on the server."""

    def bind(self, call: ToolCall) -> dict[str, Any]:
        if call.arguments_error is not None:
            raise ToolArgumentsError(
                f"arguments for {self.name!r} are not valid JSON: {call.arguments_error}",
                tool_name=self.name,
            )
        return dict(call.arguments)


class _Server:
    """One server's connection, owned by a task of its own (see the module's text)."""

    def __init__(self, name: str, spec: Any, environ: Mapping[str, str]) -> None:
        self.name = name
        self.spec = spec
        self.environ = environ
        self.client: Any = None
        self.failure: BaseException | None = None
        self._ready: asyncio.Future[list[Any]] | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stderr: Any = None
        self._http: Any = None

    async def start(self) -> list[Any]:
        """Start the server and return its tools (the SDK's Tool objects).

        Raises:
            ConfigError: the SDK is missing, or the server did not start or list its tools
                within its startup_timeout.
        """
        target = self._target()
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        self._task = asyncio.create_task(self._own(target), name=f"mcp server {self.name}")
        try:
            async with asyncio.timeout(self.spec.startup_timeout):
                return await asyncio.shield(self._ready)
        except TimeoutError:
            tail = self._stderr_tail()
            await self.stop()
            raise ConfigError(
                f"MCP server {self.name!r} did not start within "
                f"{self.spec.startup_timeout:g}s (mcp_servers.{self.name}.startup_timeout)" + tail
            ) from None
        except ConfigError:
            await self.stop()
            raise
        except Exception as exc:
            tail = self._stderr_tail()
            await self.stop()
            raise ConfigError(
                f"MCP server {self.name!r} failed to start: {_reason(exc)}" + tail
            ) from None

    def _target(self) -> Any:
        try:
            from mcp import StdioServerParameters
            from mcp.client.stdio import get_default_environment, stdio_client
            from mcp.client.streamable_http import (  # type: ignore[attr-defined]
                create_mcp_http_client,
                streamable_http_client,
            )
        except ImportError:
            raise ConfigError(
                "the workflow declares MCP servers (mcp_servers:), which need the mcp extra: "
                "pip install 'fsm-kernel[mcp]'"
            ) from None
        spec = self.spec
        where = f"mcp_servers.{self.name}"
        if spec.url is not None:
            headers = {
                k: expand(v, self.environ, f"{where}.headers.{k}") for k, v in spec.headers.items()
            }
            self._http = create_mcp_http_client(headers=headers)  # ours to close
            return streamable_http_client(spec.url, http_client=self._http)
        env = {
            **get_default_environment(),
            **{k: expand(v, self.environ, f"{where}.env.{k}") for k, v in spec.env.items()},
        }
        params = StdioServerParameters(
            command=spec.command, args=list(spec.args), env=env, cwd=spec.cwd
        )
        self._stderr = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")
        return stdio_client(params, errlog=self._stderr)

    async def _own(self, target: Any) -> None:
        from mcp import Client

        assert self._ready is not None
        try:
            async with Client(target) as client:
                self.client = client
                listed = await client.list_tools()
                if not self._ready.done():
                    self._ready.set_result(list(listed.tools))
                await self._stop.wait()
        except BaseException as exc:  # the server died, or never started: calls fail from now
            self.failure = exc
            started = self._ready.done()
            if not started:  # start() reports it, as the run's one error line
                self._ready.set_exception(exc if isinstance(exc, Exception) else RuntimeError())
            if isinstance(exc, asyncio.CancelledError):
                raise
            if started:
                logger.warning("MCP server %s stopped: %s", self.name, _reason(exc))
        finally:
            self.client = None
            if self._http is not None:
                with contextlib.suppress(Exception):
                    await self._http.aclose()

    async def call(self, tool: str, arguments: dict[str, Any]) -> str:
        """The text of a tool call's result.

        Raises:
            ToolExecutionError: the server reported an error, or is not running.
        """
        client = self.client
        if client is None or self.failure is not None:
            why = f": {_reason(self.failure)}" if self.failure is not None else ""
            raise ToolExecutionError(
                f"MCP server {self.name!r} is not running{why}", tool_name=tool
            )
        try:
            result = await client.call_tool(tool, arguments)
        except Exception as exc:
            raise ToolExecutionError(
                f"MCP server {self.name!r} failed the call: {_reason(exc)}", tool_name=tool
            ) from exc
        text = _result_text(result)
        if getattr(result, "is_error", False):
            raise ToolExecutionError(text or "the tool reported an error", tool_name=tool)
        return text

    async def stop(self) -> None:
        self._stop.set()
        task = self._task
        if task is not None and not task.done():
            try:
                async with asyncio.timeout(5):
                    await asyncio.shield(task)
            except (TimeoutError, Exception):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def _stderr_tail(self) -> str:
        if self._stderr is None:
            return ""
        try:
            self._stderr.seek(0)
            text = self._stderr.read().strip()
        except (OSError, ValueError):
            return ""
        return f"; its stderr ends: {text[-_STDERR_SHOWN:]}" if text else ""


def _reason(exc: BaseException | None) -> str:
    """One line about an exception (the first of a group's)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if exc is None:
        return "unknown"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _result_text(result: Any) -> str:
    """A CallToolResult as text: its text blocks, a note for other blocks, or its structured
    content as JSON when it has no blocks."""
    parts = []
    for block in getattr(result, "content", None) or ():
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(str(block.text))
        elif kind == "resource" and hasattr(getattr(block, "resource", None), "text"):
            parts.append(str(block.resource.text))
        else:
            mime = getattr(block, "mime_type", None) or getattr(block, "mimeType", None) or kind
            parts.append(f"[{mime} content]")
    if not parts and getattr(result, "structured_content", None) is not None:
        return json.dumps(result.structured_content, ensure_ascii=False)
    return "\n".join(parts)


class McpServers:
    """The MCP servers of one workflow for one Agent (or one run): each started once, on first
    use, and stopped by `aclose`."""

    def __init__(self, specs: Mapping[str, Any], environ: Mapping[str, str] | None = None):
        self.specs = dict(specs)
        self.environ = os.environ if environ is None else environ
        self._servers: dict[str, _Server] = {}
        self._listed: dict[str, list[Any]] = {}
        self._lock = asyncio.Lock()

    async def listed(self, name: str) -> list[Any]:
        """The tools server `name` lists (starting it the first time)."""
        async with self._lock:
            if name not in self._listed:
                server = _Server(name, self.specs[name], self.environ)
                self._listed[name] = await server.start()
                self._servers[name] = server
            return self._listed[name]

    async def register(
        self, refs: Sequence[McpRef], registry: ToolRegistry
    ) -> list[tuple[McpRef, list[str]]]:
        """Start the servers `refs` name and register the tools they select in `registry`;
        returns the names each ref got, in order. A tool keeps its server's name unless that
        name is taken or invalid: then `SERVER__tool`.

        Raises:
            ConfigError: a server did not start, or has no tool of the name a ref gives.
        """
        out: list[tuple[McpRef, list[str]]] = []
        for ref in refs:
            tools = await self.listed(ref.server)
            chosen = [t for t in tools if ref.tool is None or t.name == ref.tool]
            if ref.tool is not None and not chosen:
                names = ", ".join(sorted(t.name for t in tools)) or "none"
                raise ConfigError(
                    f"MCP server {ref.server!r} has no tool {ref.tool!r} (it has: {names})"
                )
            given: list[str] = []
            for tool in chosen:
                existing = _registered(registry, ref.server, tool.name)
                name = existing or _free_name(registry, ref.server, tool.name)
                if existing is None:
                    registry.add(self._entry(name, ref.server, tool))
                given.append(name)
            out.append((ref, given))
        return out

    def _entry(self, name: str, server: str, tool: Any) -> McpTool:
        schema = getattr(tool, "input_schema", None) or getattr(tool, "inputSchema", None) or {}
        description = (tool.description or "").strip() or f"{tool.name} (MCP server {server})"
        spec = self.specs[server]
        servers = self._servers

        async def call(**arguments: Any) -> str:
            return await servers[server].call(tool.name, arguments)

        return McpTool(
            name=name,
            description=description,
            parameters=dict(schema) or {"type": "object", "properties": {}},
            handler=call,
            arguments_model=_Passthrough,
            parameter_names=(),
            timeout=spec.call_timeout,
            server=server,
            remote=tool.name,
        )

    async def aclose(self) -> None:
        """Stop every server that was started (safe to call twice)."""
        servers, self._servers = list(self._servers.values()), {}
        self._listed = {}
        for server in servers:
            await server.stop()


def _registered(registry: ToolRegistry, server: str, remote: str) -> str | None:
    """The name a server's tool already has in `registry` (two refs may select it)."""
    for entry in registry:
        if isinstance(entry, McpTool) and (entry.server, entry.remote) == (server, remote):
            return entry.name
    return None


def _free_name(registry: ToolRegistry, server: str, remote: str) -> str:
    """The remote name if it is valid and free, else `SERVER__remote` (made valid, ≤ 64)."""
    if remote not in registry and not _INVALID.search(remote) and 0 < len(remote) <= 64:
        return remote
    base = _INVALID.sub("_", f"{server}__{remote}")[:64]
    name, n = base, 2
    while name in registry:
        suffix = f"_{n}"
        name, n = base[: 64 - len(suffix)] + suffix, n + 1
    return name
