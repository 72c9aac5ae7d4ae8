"""ToolRegistry and the @tool marker: registering tools, and executing calls with argument
validation, timeouts, output caps, and tool failures turned into error results. The JSON schema
and validator come from _signature. Imports only protocol and errors from fsm_kernel (tools never
import agent, session, memory or store).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import importlib
import inspect
import json
import logging
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import date, datetime
from datetime import time as dt_time
from enum import Enum
from pathlib import PurePath
from types import ModuleType
from typing import Any, TypeVar, overload

import pydantic

from fsm_kernel.errors import (
    ConfigError,
    ToolArgumentsError,
    ToolError,
    ToolExecutionError,
    ToolFatalError,
    ToolNotFoundError,
    ToolTimeoutError,
)
from fsm_kernel.protocol import Tool, ToolCall, ToolResult
from fsm_kernel.tools._signature import describe_validation, read_signature

__all__ = [
    "DEFAULT_OUTPUT_CAP",
    "DEFAULT_TIMEOUT",
    "RegisteredTool",
    "ToolOptions",
    "ToolRegistry",
    "build_tool",
    "collect_tools",
    "import_tools",
    "is_tool",
    "tool",
]

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT_CAP = 16_000
DEFAULT_TIMEOUT = 30.0

F = TypeVar("F", bound=Callable[..., Any])

_MARKER = "__fsm_kernel_tool__"
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""What OpenAI-compatible servers accept as a function name."""


@dataclass(frozen=True, kw_only=True)
class ToolOptions:
    """What @tool recorded on a function; explicit `register()` arguments win over it."""

    name: str | None = None
    description: str | None = None
    timeout: float | None = None


@overload
def tool(
    func: F,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout: float | None = None,
) -> F: ...


@overload
def tool(
    func: None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout: float | None = None,
) -> Callable[[F], F]: ...


def tool(
    func: F | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout: float | None = None,
) -> F | Callable[[F], F]:
    """Mark a function as a tool, with or without options, leaving it otherwise unchanged.

    A marked function can be registered later (`registry.register(func)`), found by
    `collect_tools(module)` or named in a workflow as `package.module:function`.
    """
    options = ToolOptions(name=name, description=description, timeout=timeout)

    def mark(f: F) -> F:
        setattr(f, _MARKER, options)
        return f

    return mark(func) if func is not None else mark


def is_tool(obj: object) -> bool:
    """True for a function marked with @tool."""
    return callable(obj) and isinstance(getattr(obj, _MARKER, None), ToolOptions)


def collect_tools(module: ModuleType) -> list[Callable[..., Any]]:
    """The @tool-marked functions defined at the top level of `module`, in definition order."""
    return [obj for obj in vars(module).values() if is_tool(obj)]


def import_tools(ref: str) -> list[Callable[..., Any]]:
    """Import tools by reference: `package.module:function` for one function (marked or not),
    `package.module` for every @tool-marked function in it.

    Raises:
        ConfigError: the module cannot be imported or has no such function.
    """
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import tool module {module_name!r}: {exc}") from exc
    if not attr:
        return collect_tools(module)
    func = getattr(module, attr, None)
    if not callable(func):
        raise ConfigError(f"{ref!r}: module {module_name!r} has no function {attr!r}")
    return [func]


@dataclass(frozen=True, kw_only=True)
class RegisteredTool:
    """One registered tool: its public definition plus what is needed to call it."""

    name: str
    description: str
    parameters: dict[str, Any]
    """JSON schema of the arguments object."""
    handler: Callable[..., Any]
    arguments_model: type[pydantic.BaseModel]
    """Validates the arguments; field i is parameter i, aliased to the parameter's name."""
    parameter_names: tuple[str, ...]
    timeout: float | None = None
    """Seconds; None means the registry's default."""

    @functools.cached_property
    def definition(self) -> Tool:
        """The tool as offered to the model (built once: Tool is frozen)."""
        return Tool(name=self.name, description=self.description, parameters=self.parameters)

    @functools.cached_property
    def is_async(self) -> bool:
        return _is_async_callable(self.handler)

    def bind(self, call: ToolCall) -> dict[str, Any]:
        """Validated keyword arguments for the handler; ToolArgumentsError otherwise."""
        if call.arguments_error is not None:
            raise ToolArgumentsError(
                f"arguments for {self.name!r} are not valid JSON: {call.arguments_error}",
                tool_name=self.name,
            )
        try:
            model = self.arguments_model.model_validate(call.arguments)
        except pydantic.ValidationError as exc:
            raise ToolArgumentsError(
                f"invalid arguments for {self.name!r}: {describe_validation(exc)}",
                tool_name=self.name,
            ) from exc
        return {name: getattr(model, f"p{i}") for i, name in enumerate(self.parameter_names)}


class ToolRegistry:
    """Named tools, offered to the model as JSON schemas and executed on its calls.

    `execute` never raises for a tool's problem: unknown names, bad arguments, exceptions,
    timeouts and fatal errors all come back as error `ToolResult`s. Only cancellation escapes.
    Async handlers run on the event loop under `asyncio.timeout`. Sync handlers with a timeout
    run on a daemon thread of a shared pool (threads are reused, not started per call): a
    timed-out one keeps running (threads cannot be killed) and its result is discarded, but it
    neither holds a slot of the event loop's default executor nor keeps the process from
    exiting; the pool starts another thread for the next call. A sync handler without a timeout
    (`default_timeout=None` and none of its own) runs inline, on the event loop's thread: it
    blocks the loop while it runs, so give blocking tools a timeout.
    """

    def __init__(
        self,
        *,
        output_cap: int = DEFAULT_OUTPUT_CAP,
        default_timeout: float | None = DEFAULT_TIMEOUT,
    ) -> None:
        if output_cap <= 0:
            raise ConfigError(f"output_cap must be positive, got {output_cap}")
        self.output_cap = output_cap
        self.default_timeout = default_timeout
        self._tools: dict[str, RegisteredTool] = {}

    @overload
    def register(
        self,
        func: F,
        /,
        *,
        name: str | None = None,
        description: str | None = None,
        timeout: float | None = None,
    ) -> F: ...

    @overload
    def register(
        self,
        func: None = None,
        /,
        *,
        name: str | None = None,
        description: str | None = None,
        timeout: float | None = None,
    ) -> Callable[[F], F]: ...

    def register(
        self,
        func: F | None = None,
        /,
        *,
        name: str | None = None,
        description: str | None = None,
        timeout: float | None = None,
    ) -> F | Callable[[F], F]:
        """Register `func` as a tool; usable as a call or as a decorator (bare or with options).

        Options default to what @tool recorded on the function, then to the function's name and
        docstring. Raises ConfigError for a duplicate or invalid name or an unusable signature.
        """
        explicit = ToolOptions(name=name, description=description, timeout=timeout)

        def add(f: F) -> F:
            self.add(build_tool(f, _merge_options(getattr(f, _MARKER, None), explicit)))
            return f

        return add(func) if func is not None else add

    def add(self, entry: RegisteredTool) -> None:
        """Add an already built tool; ConfigError if the name is taken."""
        if entry.name in self._tools:
            raise ConfigError(f"tool {entry.name!r} is already registered")
        self._tools[entry.name] = entry

    def names(self) -> list[str]:
        return list(self._tools)

    def get(self, name: str) -> RegisteredTool | None:
        return self._tools.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)

    def __iter__(self) -> Iterator[RegisteredTool]:
        return iter(list(self._tools.values()))

    def list_tools(self, names: Sequence[str] | None = None) -> list[Tool]:
        """All tools in registration order, or exactly `names` in that order.

        Raises:
            ToolNotFoundError: one of `names` is not registered.
        """
        if names is None:
            return [entry.definition for entry in self._tools.values()]
        return [self._require(name).definition for name in names]

    def copy(self) -> ToolRegistry:
        """An independent registry with the same tools and settings."""
        clone = ToolRegistry(output_cap=self.output_cap, default_timeout=self.default_timeout)
        clone._tools = dict(self._tools)
        return clone

    def merged(self, other: ToolRegistry, *, override: bool = False) -> ToolRegistry:
        """A new registry: these tools, then `other`'s, keeping this registry's settings.

        A name in both is a ConfigError unless `override`, in which case `other`'s tool wins.
        """
        clone = self.copy()
        for entry in other:
            if entry.name in clone._tools and not override:
                raise ConfigError(f"tool {entry.name!r} is defined twice")
            clone._tools[entry.name] = entry
        return clone

    async def execute(self, call: ToolCall) -> ToolResult:
        """Run one call and return its result; tool problems come back as error results."""
        started = time.monotonic()
        try:
            result = await self._run(call)
        except ToolError as exc:
            if not exc.tool_name:
                exc.tool_name = call.name
            result = self._error_result(exc)
        logger.debug(
            "tool %s (call %s) finished in %.3fs: error_type=%s truncated=%s",
            call.name,
            call.id,
            time.monotonic() - started,
            result.error_type,
            result.truncated,
        )
        return result

    async def _run(self, call: ToolCall) -> ToolResult:
        entry = self._require(call.name)
        kwargs = entry.bind(call)
        value = await self._invoke(entry, kwargs)
        content, truncated = self._cap(_render(entry.name, value))
        return ToolResult(content=content, truncated=truncated)

    def _require(self, name: str) -> RegisteredTool:
        entry = self._tools.get(name)
        if entry is None:
            available = ", ".join(self._tools) or "(none)"
            raise ToolNotFoundError(
                f"unknown tool {name!r}; available tools: {available}", tool_name=name
            )
        return entry

    async def _invoke(self, entry: RegisteredTool, kwargs: dict[str, Any]) -> Any:
        limit = entry.timeout if entry.timeout is not None else self.default_timeout
        try:
            async with asyncio.timeout(limit):
                return await _call_handler(entry, kwargs, limit)
        except TimeoutError as exc:
            # Only the deadline lands here: a handler's own TimeoutError became a
            # ToolExecutionError inside _call_handler.
            raise ToolTimeoutError(
                f"tool {entry.name!r} did not finish within {limit:g}s", tool_name=entry.name
            ) from exc

    def _cap(self, text: str) -> tuple[str, bool]:
        if len(text) <= self.output_cap:
            return text, False
        note = f"\n[output truncated: {len(text)} chars, showing the first {self.output_cap}]"
        return text[: self.output_cap] + note, True

    def _error_result(self, exc: ToolError) -> ToolResult:
        content, truncated = self._cap(str(exc))
        return ToolResult(
            content=content,
            is_error=True,
            error_type=type(exc).__name__,
            fatal=isinstance(exc, ToolFatalError),
            truncated=truncated,
        )


async def _call_handler(entry: RegisteredTool, kwargs: dict[str, Any], limit: float | None) -> Any:
    try:
        if entry.is_async:
            return await entry.handler(**kwargs)
        if limit is None:  # nothing to enforce: no thread hop
            return entry.handler(**kwargs)
        return await _POOL.run(entry.name, functools.partial(entry.handler, **kwargs))
    except ToolError:
        raise
    except Exception as exc:
        raise ToolExecutionError(f"{type(exc).__name__}: {exc}", tool_name=entry.name) from exc


_Job = Callable[[], Callable[[], None]]
"""Runs a handler; returns what delivers its outcome to the awaiting loop."""


class _DaemonPool:
    """Daemon threads for sync tool handlers, reused from call to call.

    Not a concurrent.futures.ThreadPoolExecutor (nor asyncio.to_thread): their threads are
    joined when the interpreter exits, so one hung sync tool would keep the CLI from ever
    exiting after its timeout. Here every thread is a daemon; an idle one waits for the next
    call up to IDLE_SECONDS, then ends. A call finding no idle thread starts one, so a hung
    handler never delays another call. Contextvars are copied, as asyncio.to_thread does.

    A handler that was quick last time (it returned within QUICK_SECONDS) is waited for on
    the loop's thread, blocked, for up to QUICK_SECONDS: a quick call's outcome is then taken
    straight from the pool's thread, without waking the event loop through its self-pipe and
    resuming the task (about half the cost of the hand-off). Past QUICK_SECONDS, or for a
    handler that was slow last time, the call is awaited as usual, under the same timeout
    (the wait counts towards it), so a slow or hung handler holds the loop QUICK_SECONDS at
    most, once.
    """

    IDLE_SECONDS = 30.0
    QUICK_SECONDS = 0.0002

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._idle = 0
        self._slow: set[str] = set()
        """The tools whose last call outlasted QUICK_SECONDS: awaited at once."""

    async def run(self, name: str, func: Callable[[], Any]) -> Any:
        """Await `func()` run on one of the pool's threads."""
        handoff = _Handoff(asyncio.get_running_loop(), contextvars.copy_context(), func)
        self._submit(handoff.work, name)
        if name not in self._slow:
            if handoff.wait(self.QUICK_SECONDS):
                return handoff.result()
            self._slow.add(name)
        value = await handoff.settled()
        if handoff.elapsed < self.QUICK_SECONDS:
            self._slow.discard(name)
        return value

    def _submit(self, job: _Job, name: str) -> None:
        with self._lock:
            if self._idle:
                self._idle -= 1
                self._jobs.put(job)
                return
        threading.Thread(target=self._work, args=(job,), name=f"tool-{name}", daemon=True).start()

    def _work(self, job: _Job) -> None:
        while True:
            deliver = job()
            with self._lock:  # idle before the caller hears back: its next call reuses this
                self._idle += 1
            deliver()
            try:
                job = self._jobs.get(timeout=self.IDLE_SECONDS)
            except queue.Empty:
                with self._lock:
                    try:  # a call counted on this thread just as it timed out
                        job = self._jobs.get_nowait()
                    except queue.Empty:
                        self._idle -= 1
                        return


_POOL = _DaemonPool()


class _Handoff:
    """One call's outcome, handed from a pool thread to the loop's thread: to a caller
    blocked in `wait` (at once), or to the future of `settled` (through the event loop),
    whichever the caller is doing when the outcome is ready (decided under `_mutex`)."""

    __slots__ = ("_context", "_func", "_future", "_loop", "_mutex", "_outcome", "_ready", "elapsed")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, context: contextvars.Context, func: Callable[[], Any]
    ) -> None:
        self._loop, self._context, self._func = loop, context, func
        self._mutex = threading.Lock()
        self._ready = threading.Lock()
        self._ready.acquire()  # released once the outcome is in
        self._outcome: tuple[Any, BaseException | None] | None = None
        self._future: asyncio.Future[Any] | None = None
        self.elapsed = 0.0
        """Seconds the handler ran (set on the pool's thread)."""

    def work(self) -> Callable[[], None]:
        """On a pool thread: run the handler; what delivers its outcome (a `_Job`)."""
        started = time.perf_counter()
        try:
            outcome: tuple[Any, BaseException | None] = (self._context.run(self._func), None)
        except BaseException as exc:  # handed to the awaiting coroutine, which re-raises it
            outcome = (None, exc)
        self.elapsed = time.perf_counter() - started
        return functools.partial(self._deliver, outcome)

    def _deliver(self, outcome: tuple[Any, BaseException | None]) -> None:
        with self._mutex:
            self._outcome = outcome
            future = self._future
        self._ready.release()
        if future is not None:  # the caller awaits it: wake the loop
            try:
                self._loop.call_soon_threadsafe(_settle, future, outcome)
            except RuntimeError:  # the loop closed while the handler ran: nobody waits
                logger.debug("tool thread finished after its event loop closed")

    def wait(self, seconds: float) -> bool:
        """On the loop's thread, blocked (the GIL released): whether the outcome came within
        `seconds`."""
        return self._ready.acquire(timeout=seconds)

    def result(self) -> Any:
        assert self._outcome is not None
        value, error = self._outcome
        if error is not None:
            raise error
        return value

    async def settled(self) -> Any:
        """Await the outcome through the event loop."""
        with self._mutex:
            if self._outcome is None:
                self._future = future = self._loop.create_future()
            else:  # it came just after `wait` gave up
                return self.result()
        return await future


def _settle(future: asyncio.Future[Any], outcome: tuple[Any, BaseException | None]) -> None:
    if future.done():  # cancelled by a timeout or by the caller meanwhile
        return
    value, error = outcome
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def _is_async_callable(func: Callable[..., Any]) -> bool:
    if inspect.iscoroutinefunction(func):
        return True
    call = getattr(func, "__call__", None)  # noqa: B004 -- an object with an async __call__
    return call is not None and inspect.iscoroutinefunction(call)


def _merge_options(marked: ToolOptions | None, explicit: ToolOptions) -> ToolOptions:
    base = marked if isinstance(marked, ToolOptions) else ToolOptions()
    return ToolOptions(
        name=explicit.name if explicit.name is not None else base.name,
        description=explicit.description if explicit.description is not None else base.description,
        timeout=explicit.timeout if explicit.timeout is not None else base.timeout,
    )


def build_tool(func: Callable[..., Any], options: ToolOptions | None = None) -> RegisteredTool:
    """Derive a RegisteredTool from a typed function (schema, description, validator)."""
    options = options or ToolOptions()
    name = options.name if options.name is not None else getattr(func, "__name__", "")
    if not _NAME_RE.match(name):
        raise ConfigError(f"invalid tool name {name!r}: use 1-64 letters, digits, '_' or '-'")
    if options.timeout is not None and options.timeout <= 0:
        raise ConfigError(f"tool {name!r}: timeout must be positive, got {options.timeout}")
    signature = read_signature(name, func)
    return RegisteredTool(
        name=name,
        description=options.description if options.description is not None else signature.summary,
        parameters=signature.parameters,
        handler=func,
        arguments_model=signature.arguments_model,
        parameter_names=signature.parameter_names,
        timeout=options.timeout,
    )


def _render(name: str, value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, default=_json_default, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ToolExecutionError(
            f"tool {name!r} returned a {type(value).__name__} that cannot be sent back: {exc}",
            tool_name=name,
        ) from exc


def _json_default(value: Any) -> Any:
    if isinstance(value, pydantic.BaseModel):
        return value.model_dump(mode="json")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, datetime | date | dt_time):
        return value.isoformat()
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, set | frozenset):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
