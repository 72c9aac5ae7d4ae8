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
A stdio server runs under fsm-kernel's own transport (`_stdio`), so that its deadlines hold:
`startup_timeout` bounds the whole start (spawn, initialize, list_tools), a server that did not
start is killed at once, and stopping a started one takes at most `_STOP_GRACE` plus
`2 * _SIGNAL_WAIT` seconds (its stdin closed, then SIGTERM, then SIGKILL to its process group).
A line on its stdout that is not JSON-RPC is skipped with one warning line (no traceback).

What a server's tools return is redacted before the model sees it: the values given to it
(`env:`, `headers:`) are registered as secrets, so a server echoing one cannot leak it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import pydantic

from fsm_kernel.errors import ConfigError, ToolArgumentsError, ToolExecutionError
from fsm_kernel.protocol import ToolCall
from fsm_kernel.redact import redact, register_secret
from fsm_kernel.tools.registry import RegisteredTool, ToolRegistry

__all__ = ["MAX_TOOLS_PER_SERVER", "MCP_PREFIX", "McpRef", "McpServers", "McpTool", "parse_ref"]

logger = logging.getLogger(__name__)

MCP_PREFIX = "mcp:"
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_INVALID = re.compile(r"[^A-Za-z0-9_-]")
_STDERR_SHOWN = 600
"""How much of a server's stderr a start-up error quotes (its last characters)."""
MAX_TOOLS_PER_SERVER = 1_000
"""The most tools one `mcp:NAME` entry offers the model (a server may list more: entries
`mcp:NAME/TOOL` pick from any number). A model is offered at most a few hundred tools anyway."""
_NAMES_SHOWN = 20
"""How many of a server's tool names an error lists."""
_STOP_GRACE = 1.0
"""Seconds a started stdio server has to exit on its own once its stdin is closed."""
_SIGNAL_WAIT = 1.0
"""Seconds to wait for a server process after SIGTERM, and again after SIGKILL."""
_LINE_LIMIT = 64 * 1024 * 1024
"""The longest line a stdio server may write (bytes): a longer one ends the connection."""


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
        self.grace = _STOP_GRACE
        """Seconds its process has to exit on its own when stopped (0: killed at once)."""
        self._ready: asyncio.Future[list[Any]] | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stderr: Any = None
        self._http: Any = None

    async def start(self) -> list[Any]:
        """Start the server and return its tools (the SDK's Tool objects), all within its
        startup_timeout: a server that misses it is stopped at once.

        Raises:
            ConfigError: the SDK is missing, the command is empty, or the server did not start
                or list its tools within its startup_timeout.
        """
        target = self._target()
        ready = self._ready = asyncio.get_running_loop().create_future()
        ready.add_done_callback(_retrieved)  # an outcome after a timeout is nobody's
        self._task = asyncio.create_task(self._own(target), name=f"mcp server {self.name}")
        try:
            async with asyncio.timeout(self.spec.startup_timeout):
                return await asyncio.shield(ready)
        except TimeoutError:
            message = (
                f"MCP server {self.name!r} did not start within "
                f"{self.spec.startup_timeout:g}s (mcp_servers.{self.name}.startup_timeout)"
            )
        except ConfigError:
            await self.stop(now=True)
            raise
        except Exception as exc:
            message = f"MCP server {self.name!r} failed to start: {_reason(exc)}"
        message += self._stderr_tail()
        await self.stop(now=True)
        raise ConfigError(redact(message)) from None

    def _target(self) -> Any:
        try:
            from mcp.client.stdio import get_default_environment
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
                k: _given(v, self.environ, f"{where}.headers.{k}") for k, v in spec.headers.items()
            }
            self._http = create_mcp_http_client(headers=headers)  # ours to close
            return streamable_http_client(spec.url, http_client=self._http)
        if not (spec.command or "").strip():
            raise ConfigError(f"{where}.command is empty: give the program that starts the server")
        env = {
            **get_default_environment(),
            **{k: _given(v, self.environ, f"{where}.env.{k}") for k, v in spec.env.items()},
        }
        self._stderr = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")
        return _stdio(self, [spec.command, *spec.args], env)

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
        """The text of a tool call's result, redacted (see the module's text).

        Raises:
            ToolExecutionError: the server reported an error, or is not running.
        """
        client = self.client
        if client is None or self.failure is not None:
            why = f": {_reason(self.failure)}" if self.failure is not None else ""
            raise ToolExecutionError(
                redact(f"MCP server {self.name!r} is not running{why}"), tool_name=tool
            )
        try:
            result = await client.call_tool(tool, arguments)
        except Exception as exc:
            raise ToolExecutionError(
                redact(f"MCP server {self.name!r} failed the call: {_reason(exc)}"), tool_name=tool
            ) from exc
        text = redact(_result_text(result))
        if getattr(result, "is_error", False):
            raise ToolExecutionError(text or "the tool reported an error", tool_name=tool)
        return text

    async def stop(self, *, now: bool = False) -> None:
        """Stop the server: a started one is asked to close and given `grace` seconds; one
        that never started (`now`) is killed at once. Bounded: the process is killed after
        `grace` + 2 * _SIGNAL_WAIT seconds whatever it does."""
        if now:
            self.grace = 0.0
        self._stop.set()
        task = self._task
        if task is not None and not task.done():
            if now:
                task.cancel()
            await asyncio.wait({task}, timeout=self.grace + 2 * _SIGNAL_WAIT + 0.5)
            if not task.done():  # the SDK's close hangs: its transport still ends the process
                task.cancel()
                await asyncio.wait({task}, timeout=2 * _SIGNAL_WAIT + 0.5)
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


def _given(value: str, environ: Mapping[str, str], what: str) -> str:
    """A value given to a server (an env variable, a header) with `${NAME}`s expanded, and
    registered as a secret: whatever the server echoes of it is redacted."""
    given = expand(value, environ, what)
    register_secret(given)
    return given


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Mark a future's exception as seen (asyncio warns of one never retrieved)."""
    if not future.cancelled():
        future.exception()


# -- the stdio transport ---------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _stdio(server: _Server, argv: list[str], env: dict[str, str]) -> AsyncIterator[Any]:
    """A stdio server's process, as the (read, write) message streams the SDK's Client takes:
    newline-delimited JSON-RPC on its stdin and stdout, stopped by `_end` (bounded)."""
    import anyio

    process = await anyio.open_process(
        argv, env=env, cwd=server.spec.cwd, stderr=server._stderr, start_new_session=True
    )
    reads_in, reads = anyio.create_memory_object_stream[Any](0)
    writes, writes_out = anyio.create_memory_object_stream[Any](0)
    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(_read_lines, process.stdout, reads_in, server.name)
            tasks.start_soon(_write_lines, process.stdin, writes_out, reads_in)
            try:
                yield reads, writes
            finally:
                tasks.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await _end(process, server.grace)
        for stream in (reads, reads_in, writes, writes_out):
            stream.close()


async def _read_lines(stdout: Any, send: Any, name: str) -> None:
    """Each line of the server's stdout, parsed, to `send`; a line that is not JSON-RPC is
    skipped (the first with a warning); a line over _LINE_LIMIT ends the connection."""
    import anyio

    held: list[bytes] = []
    size = 0
    warned = False
    with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
        async with send:
            async for chunk in stdout:
                *lines, rest = chunk.split(b"\n")
                if lines:
                    lines[0] = b"".join([*held, lines[0]])
                    held, size = [], 0
                for line in lines:
                    message = _message(line)
                    if message is None and line.strip():
                        log = logger.debug if warned else logger.warning
                        log("MCP server %s wrote a line that is not JSON-RPC on its stdout "
                            "(skipped): %.80r", name, line.decode("utf-8", "replace"))  # fmt: skip
                        warned = True
                    elif message is not None:
                        await send.send(message)
                held.append(rest)
                size += len(rest)
                if size > _LINE_LIMIT:
                    logger.warning("MCP server %s wrote a line over %d bytes", name, _LINE_LIMIT)
                    return


def _message(line: bytes) -> Any:
    """One line as the SDK's SessionMessage; None when it is blank or not JSON-RPC."""
    import mcp_types
    from mcp.shared.message import SessionMessage

    if not line.strip():
        return None
    try:
        return SessionMessage(mcp_types.jsonrpc_message_adapter.validate_json(line, by_name=False))
    except ValueError:
        return None


async def _write_lines(stdin: Any, receive: Any, reads: Any) -> None:
    """The session's messages to the server's stdin, one JSON line each. A server that stops
    reading ends the connection (the session sees it close, instead of waiting forever)."""
    import anyio

    try:
        async with receive:
            async for item in receive:
                line = item.message.model_dump_json(by_alias=True, exclude_unset=True) + "\n"
                await stdin.send(line.encode("utf-8"))
    except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
        await reads.aclose()


async def _end(process: Any, grace: float) -> None:
    """Stop a server's process within `grace` + 2 * _SIGNAL_WAIT seconds: close its stdin (the
    MCP way to ask it to exit), wait up to `grace`, then SIGTERM its process group and, if
    that does not do, SIGKILL."""
    import anyio

    with contextlib.suppress(Exception):
        await process.stdin.aclose()
    if not (grace and await _exited(process, grace)):
        for sig in (signal.SIGTERM, signal.SIGKILL):
            _signal(process, sig)
            if await _exited(process, _SIGNAL_WAIT):
                break
        else:
            logger.warning("MCP server process %d did not die; left behind", process.pid)
    with anyio.move_on_after(_SIGNAL_WAIT), contextlib.suppress(Exception):
        await process.aclose()  # its pipes


async def _exited(process: Any, seconds: float) -> bool:
    """Whether the process exits within `seconds` (polled: `wait()` would also wait for its
    pipes, which a child it left behind may hold)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while process.returncode is None:
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def _signal(process: Any, sig: signal.Signals) -> None:
    """Send `sig` to the server's process group (it and whatever it started)."""
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    except AttributeError:  # pragma: no cover - no process groups (Windows)
        process.kill()


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
        name is taken or invalid: then `SERVER__tool`. Linear in the tools listed.

        Raises:
            ConfigError: a server did not start, has no tool of the name a ref gives, or lists
                more than MAX_TOOLS_PER_SERVER tools for a ref that takes them all.
        """
        names = {(e.server, e.remote): e.name for e in registry if isinstance(e, McpTool)}
        out: list[tuple[McpRef, list[str]]] = []
        for ref in refs:
            given: list[str] = []
            for tool in _chosen(ref, await self.listed(ref.server)):
                key = (ref.server, tool.name)
                if key not in names:
                    names[key] = _free_name(registry, ref.server, tool.name)
                    registry.add(self._entry(names[key], ref.server, tool))
                given.append(names[key])
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


def _chosen(ref: McpRef, tools: list[Any]) -> list[Any]:
    """The listed tools `ref` selects.

    Raises:
        ConfigError: the server has no tool of the name the ref gives, or more than
            MAX_TOOLS_PER_SERVER for a ref that takes them all.
    """
    if ref.tool is None:
        if len(tools) > MAX_TOOLS_PER_SERVER:
            raise ConfigError(
                f"MCP server {ref.server!r} lists {len(tools)} tools, more than the "
                f"{MAX_TOOLS_PER_SERVER} an entry mcp:{ref.server} may offer: name the ones "
                f"to offer (mcp:{ref.server}/TOOL)"
            )
        return tools
    chosen = [t for t in tools if t.name == ref.tool]
    if not chosen:
        names = sorted(str(t.name) for t in tools)
        shown = ", ".join(names[:_NAMES_SHOWN]) or "none"
        if len(names) > _NAMES_SHOWN:
            shown += f" and {len(names) - _NAMES_SHOWN} more"
        raise ConfigError(f"MCP server {ref.server!r} has no tool {ref.tool!r} (it has: {shown})")
    return chosen[:1]


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
