"""ToolRegistry: schemas from signatures, validation, execution outcomes, the @tool marker."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import sys
import threading
import time
import types
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import Enum
from typing import Any, Literal

import pydantic
import pytest

from fsm_kernel.errors import ConfigError, ToolFatalError, ToolNotFoundError
from fsm_kernel.protocol import Tool, ToolCall, ToolExecutor
from fsm_kernel.tools import ToolRegistry, collect_tools, import_tools, is_tool, tool


def call(tool_name: str, /, **arguments: Any) -> ToolCall:
    return ToolCall(id="call_1", name=tool_name, arguments=arguments)


def run(registry: ToolRegistry, tool_call: ToolCall) -> Any:
    return asyncio.run(registry.execute(tool_call))


def schema_of(func: Any) -> dict[str, Any]:
    registry = ToolRegistry()
    registry.register(func)
    return registry.list_tools()[0].parameters


# --- schema derivation ---------------------------------------------------------------------


def test_schema_for_scalar_types_and_required() -> None:
    def f(s: str, i: int, x: float, b: bool) -> str:
        return ""

    assert schema_of(f) == {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "s": {"type": "string"},
            "i": {"type": "integer"},
            "x": {"type": "number"},
            "b": {"type": "boolean"},
        },
        "required": ["s", "i", "x", "b"],
    }


def test_schema_for_list_optional_defaults_and_literal() -> None:
    def f(
        tags: list[str],
        limit: int = 5,
        note: str | None = None,
        mode: Literal["fast", "slow"] = "fast",
    ) -> str:
        return ""

    schema = schema_of(f)
    assert schema["required"] == ["tags"]
    props = schema["properties"]
    assert props["tags"] == {"type": "array", "items": {"type": "string"}}
    assert props["limit"] == {"type": "integer", "default": 5}
    assert props["note"] == {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None}
    assert props["mode"] == {"type": "string", "enum": ["fast", "slow"], "default": "fast"}


class Point(pydantic.BaseModel):
    x: int
    y: int


class Opaque:
    """Not a type pydantic can build a schema for."""


def test_schema_has_no_title_noise_but_keeps_a_parameter_named_title() -> None:
    def f(title: str, where: Point) -> str:
        return ""

    schema = schema_of(f)
    assert set(schema["properties"]) == {"title", "where"}
    assert not _string_titles(schema)
    assert schema["$defs"]["Point"]["properties"] == {
        "x": {"type": "integer"},
        "y": {"type": "integer"},
    }


def _string_titles(node: Any) -> list[str]:
    """Every `"title": "<string>"` pair anywhere in a JSON document."""
    if isinstance(node, list):
        return [t for item in node for t in _string_titles(item)]
    if not isinstance(node, dict):
        return []
    found = [v for k, v in node.items() if k == "title" and isinstance(v, str)]
    return found + [t for v in node.values() for t in _string_titles(v)]


def test_parameter_names_that_clash_with_basemodel_attributes_work() -> None:
    registry = ToolRegistry()

    @registry.register
    def f(json: str, copy: int = 1) -> str:
        return f"{json}:{copy}"

    assert set(registry.list_tools()[0].parameters["properties"]) == {"json", "copy"}
    assert run(registry, call("f", json="j", copy=2)).content == "j:2"


def test_unannotated_parameter_accepts_anything() -> None:
    def f(x) -> str:  # type: ignore[no-untyped-def]  # the case under test
        return repr(x)

    registry = ToolRegistry()
    registry.register(f)
    assert registry.list_tools()[0].parameters["required"] == ["x"]
    assert run(registry, call("f", x=[1, "a"])).content == "[1, 'a']"


def test_no_parameters_gives_an_empty_object_schema() -> None:
    def ping() -> str:
        return "pong"

    assert schema_of(ping) == {"type": "object", "properties": {}, "additionalProperties": False}


def test_description_and_argument_docs_from_google_docstring() -> None:
    def search(query: str, limit: int = 10) -> str:
        """Search the index
        for documents.

        Longer explanation that is not sent.

        Args:
            query: Words to look for.
            limit (int): How many results
                to return at most.

        Returns:
            The matches.
        """
        return ""

    registry = ToolRegistry()
    registry.register(search)
    definition = registry.list_tools()[0]
    assert definition.description == "Search the index for documents."
    assert definition.parameters["properties"]["query"]["description"] == "Words to look for."
    assert (
        definition.parameters["properties"]["limit"]["description"]
        == "How many results to return at most."
    )


def test_no_docstring_means_empty_description() -> None:
    def f(a: int) -> str:
        return ""

    registry = ToolRegistry()
    registry.register(f)
    assert registry.list_tools()[0].description == ""
    assert "description" not in registry.list_tools()[0].parameters["properties"]["a"]


def test_docstring_starting_with_args_section_has_no_summary() -> None:
    def f(a: int) -> str:
        """Args:
        a: The a.
        """
        return ""

    registry = ToolRegistry()
    registry.register(f)
    assert registry.list_tools()[0].description == ""


# --- registration ---------------------------------------------------------------------------


def test_register_as_plain_call_decorator_and_decorator_with_options() -> None:
    registry = ToolRegistry()

    def first(a: int) -> int:
        return a

    returned = registry.register(first)

    @registry.register
    def second() -> str:
        return ""

    @registry.register(name="third_tool", description="Custom.", timeout=2.0)
    def third() -> str:
        """Ignored docstring."""
        return ""

    assert returned is first
    assert callable(second)
    assert callable(third)
    assert registry.names() == ["first", "second", "third_tool"]
    entry = registry.get("third_tool")
    assert entry is not None
    assert entry.description == "Custom."
    assert entry.timeout == 2.0
    assert entry.handler is third
    assert "first" in registry
    assert "third" not in registry
    assert registry.get("missing") is None
    assert len(registry) == 3


def test_duplicate_name_is_a_config_error() -> None:
    registry = ToolRegistry()

    def f() -> str:
        return ""

    registry.register(f)
    with pytest.raises(ConfigError, match="already registered"):
        registry.register(f)


@pytest.mark.parametrize("name", ["has space", "", "x" * 65, "dot.name"])
def test_invalid_names_are_rejected(name: str) -> None:
    def f() -> str:
        return ""

    with pytest.raises(ConfigError, match="invalid tool name"):
        ToolRegistry().register(f, name=name)


def test_star_args_are_rejected() -> None:
    def f(*args: int) -> str:
        return ""

    def g(**kwargs: int) -> str:
        return ""

    for func in (f, g):
        with pytest.raises(ConfigError, match="must be a plain or keyword-only"):
            ToolRegistry().register(func)


def test_unsupported_parameter_type_is_a_config_error() -> None:
    def f(x: Opaque) -> str:
        return ""

    with pytest.raises(ConfigError, match="unsupported parameter type"):
        ToolRegistry().register(f)


def test_unresolvable_annotation_is_a_config_error() -> None:
    class Local:
        pass

    def f(x: Local) -> str:  # a string annotation (future import) naming a local class
        return ""

    with pytest.raises(ConfigError, match="cannot resolve its type annotations"):
        ToolRegistry().register(f)


def test_non_positive_timeout_and_output_cap_are_rejected() -> None:
    def f() -> str:
        return ""

    with pytest.raises(ConfigError, match="timeout must be positive"):
        ToolRegistry().register(f, timeout=0)
    with pytest.raises(ConfigError, match="output_cap"):
        ToolRegistry(output_cap=0)


def test_list_tools_all_in_order_or_exactly_the_names_given() -> None:
    registry = ToolRegistry()
    for name in ("a", "b", "c"):
        registry.register(lambda: "", name=name)
    assert [t.name for t in registry.list_tools()] == ["a", "b", "c"]
    assert [t.name for t in registry.list_tools(["c", "a"])] == ["c", "a"]
    assert registry.list_tools([]) == []
    assert all(isinstance(t, Tool) for t in registry.list_tools())


def test_list_tools_with_unknown_name_raises_tool_not_found() -> None:
    registry = ToolRegistry()
    registry.register(lambda: "", name="a")
    with pytest.raises(ToolNotFoundError, match="unknown tool 'zzz'; available tools: a") as info:
        registry.list_tools(["a", "zzz"])
    assert info.value.tool_name == "zzz"


def test_registry_satisfies_the_tool_executor_protocol() -> None:
    assert isinstance(ToolRegistry(), ToolExecutor)


def test_copy_is_independent() -> None:
    registry = ToolRegistry(output_cap=100, default_timeout=5.0)
    registry.register(lambda: "", name="a")
    clone = registry.copy()
    clone.register(lambda: "", name="b")
    assert registry.names() == ["a"]
    assert clone.names() == ["a", "b"]
    assert (clone.output_cap, clone.default_timeout) == (100, 5.0)


def test_merged_appends_other_tools_and_refuses_duplicates_unless_override() -> None:
    base = ToolRegistry()
    base.register(lambda: "base-a", name="a")
    base.register(lambda: "base-b", name="b")
    user = ToolRegistry()
    user.register(lambda: "user-c", name="c")
    merged = base.merged(user)
    assert merged.names() == ["a", "b", "c"]
    assert base.names() == ["a", "b"]

    clash = ToolRegistry()
    clash.register(lambda: "user-a", name="a")
    with pytest.raises(ConfigError, match="defined twice"):
        base.merged(clash)
    overridden = base.merged(clash, override=True)
    assert overridden.names() == ["a", "b"]
    assert run(overridden, call("a")).content == "user-a"


# --- the @tool marker -------------------------------------------------------------------------


@tool
def marked_plain(query: str) -> str:
    """Search for something."""
    return f"found {query}"


@tool(name="renamed", description="Marked with options.", timeout=3.0)
def marked_with_options(x: int) -> int:
    return x * 2


def not_marked() -> str:
    return ""


def test_tool_marker_leaves_the_function_callable() -> None:
    assert marked_plain("q") == "found q"
    assert marked_with_options(2) == 4
    assert is_tool(marked_plain)
    assert is_tool(marked_with_options)
    assert not is_tool(not_marked)
    assert not is_tool("marked_plain")


def test_register_uses_marker_options_and_explicit_arguments_win() -> None:
    registry = ToolRegistry()
    registry.register(marked_plain)
    registry.register(marked_with_options)
    assert registry.names() == ["marked_plain", "renamed"]
    entry = registry.get("renamed")
    assert entry is not None
    assert (entry.description, entry.timeout) == ("Marked with options.", 3.0)

    other = ToolRegistry()
    other.register(marked_with_options, name="again", timeout=1.0)
    entry = other.get("again")
    assert entry is not None
    assert (entry.description, entry.timeout) == ("Marked with options.", 1.0)


def test_collect_tools_finds_marked_functions_in_definition_order() -> None:
    found = collect_tools(sys.modules[__name__])
    assert found == [marked_plain, marked_with_options]


def test_import_tools_by_reference() -> None:
    module = types.ModuleType("fsm_test_user_tools")
    module.alpha = tool(lambda: "a")  # type: ignore[attr-defined]  # a synthetic module
    module.beta = lambda: "b"  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    try:
        assert import_tools("fsm_test_user_tools") == [module.alpha]
        assert import_tools("fsm_test_user_tools:beta") == [module.beta]
        with pytest.raises(ConfigError, match="has no function 'gamma'"):
            import_tools("fsm_test_user_tools:gamma")
    finally:
        del sys.modules[module.__name__]
    with pytest.raises(ConfigError, match="cannot import tool module"):
        import_tools("fsm_no_such_module_here:f")


# --- execution: successes ---------------------------------------------------------------------


def test_sync_handler_runs_in_a_worker_thread() -> None:
    registry = ToolRegistry()
    seen: list[str] = []

    @registry.register
    def where() -> str:
        seen.append(threading.current_thread().name)
        return "ok"

    result = run(registry, call("where"))
    assert (result.content, result.is_error, result.truncated) == ("ok", False, False)
    assert seen
    assert seen[0] != threading.main_thread().name


def test_sync_handler_without_a_timeout_runs_inline_on_the_loop() -> None:
    registry = ToolRegistry(default_timeout=None)
    seen: list[int] = []

    @registry.register
    def where() -> str:
        seen.append(threading.get_ident())
        return "ok"

    async def main() -> tuple[int, str]:
        result = await registry.execute(call("where"))
        return threading.get_ident(), result.content

    loop_thread, content = asyncio.run(main())
    assert content == "ok"
    assert seen == [loop_thread]


def test_sync_handlers_with_a_timeout_share_reused_daemon_threads() -> None:
    registry = ToolRegistry()
    seen: list[threading.Thread] = []

    @registry.register
    def where() -> str:
        seen.append(threading.current_thread())
        return "ok"

    async def main() -> int:
        for _ in range(20):  # one after the other: a thread idle again is taken again
            assert (await registry.execute(call("where"))).content == "ok"
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert len(seen) == 20
    assert all(t.daemon and t.ident != loop_thread for t in seen)
    assert len({t.ident for t in seen}) < 20  # not a new thread per call


def test_a_timed_out_sync_handler_keeps_its_thread_and_the_next_call_gets_another() -> None:
    registry = ToolRegistry()
    release = threading.Event()
    threads: list[int] = []

    @registry.register(timeout=0.05)
    def stuck() -> str:
        threads.append(threading.get_ident())
        release.wait(10)
        return "late"

    @registry.register
    def quick() -> str:
        threads.append(threading.get_ident())
        return "quick"

    async def main() -> list[str]:
        first = await registry.execute(call("stuck"))
        second = await registry.execute(call("quick"))
        return [first.error_type or "", second.content]

    try:
        assert asyncio.run(main()) == ["ToolTimeoutError", "quick"]
        assert threads[0] != threads[1]  # the hung handler still holds its thread
    finally:
        release.set()


def test_a_sync_handler_slow_last_time_is_awaited_and_one_quick_again_is_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A handler quick last time is waited for on the loop's thread (briefly, blocked); one
    # that outlasted QUICK_SECONDS is awaited, the loop running other work meanwhile.
    from fsm_kernel.tools.registry import _POOL

    # 10 ms, not 0.2: a loaded machine may deschedule the quick handler's thread for longer
    # than 0.2 ms; the slow calls (50 ms) still outlast it
    monkeypatch.setattr(_POOL, "QUICK_SECONDS", 0.01)

    registry = ToolRegistry()
    pause = [0.05]

    @registry.register
    def varies_in_speed_7() -> str:
        if pause[0]:  # a quick call sleeps not at all: time.sleep(0) would give up the GIL,
            time.sleep(pause[0])  # and the ticker spinning on the loop could hold it 5 ms
        return "done"

    async def call_while_ticking() -> tuple[str, int]:
        ticks = 0
        stop = False

        async def tick() -> None:
            nonlocal ticks
            while not stop:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.ensure_future(tick())
        await asyncio.sleep(0)
        before = ticks
        result = await registry.execute(call("varies_in_speed_7"))
        stop = True
        await ticker
        return result.content, ticks - before

    async def main() -> list[tuple[str, int, bool]]:
        out = []
        for seconds in (0.05, 0.05, 0.0, 0.0):
            pause[0] = seconds
            content, ticks = await call_while_ticking()
            out.append((content, ticks, "varies_in_speed_7" in _POOL._slow))
        return out

    first, second, quick, again = asyncio.run(main())
    assert [first[0], second[0], quick[0], again[0]] == ["done"] * 4
    assert (first[2], second[2]) == (True, True)  # slow: awaited from now on
    assert min(first[1], second[1]) > 1  # the loop ran the ticker while the tool slept
    assert quick[2] is False  # its call was quick (it ran in under QUICK_SECONDS) again


def test_an_outcome_that_comes_just_after_the_wait_gave_up_is_not_lost() -> None:
    from fsm_kernel.tools.registry import _Handoff

    async def main() -> list[Any]:
        loop = asyncio.get_running_loop()
        handoff = _Handoff(loop, contextvars.copy_context(), lambda: "value")
        assert handoff.wait(0) is False  # nothing ran yet
        handoff.work()()  # the pool's thread runs and delivers before the caller awaits
        first = await handoff.settled()
        failing = _Handoff(loop, contextvars.copy_context(), lambda: 1 / 0)
        failing.work()()
        with pytest.raises(ZeroDivisionError):
            await failing.settled()
        late = _Handoff(loop, contextvars.copy_context(), lambda: "late")
        waiting = asyncio.ensure_future(late.settled())
        await asyncio.sleep(0)  # awaiting its future now
        await asyncio.to_thread(lambda: late.work()())  # delivered from another thread
        return [first, await waiting]

    assert asyncio.run(main()) == ["value", "late"]


def test_async_handler_is_awaited() -> None:
    registry = ToolRegistry()

    @registry.register
    async def add(a: int, b: int) -> int:
        await asyncio.sleep(0)
        return a + b

    assert run(registry, call("add", a=2, b=3)).content == "5"


def test_async_callable_object_is_awaited() -> None:
    class Greeter:
        async def __call__(self, who: str) -> str:
            return f"hi {who}"

    registry = ToolRegistry()
    registry.register(Greeter(), name="greet")
    assert registry.list_tools()[0].parameters["required"] == ["who"]
    assert run(registry, call("greet", who="bob")).content == "hi bob"


def test_partial_keeps_the_wrapped_function_types_and_docstring() -> None:
    def greet(name: str, greeting: str) -> str:
        """Greet someone."""
        return f"{greeting} {name}"

    registry = ToolRegistry()
    registry.register(functools.partial(greet, greeting="hello"), name="hello")
    definition = registry.list_tools()[0]
    assert definition.description == "Greet someone."
    assert definition.parameters["properties"]["name"] == {"type": "string"}
    assert definition.parameters["required"] == ["name"]
    assert run(registry, call("hello", name="ann")).content == "hello ann"


def test_bound_method_is_registered_without_self() -> None:
    class Counter:
        def __init__(self) -> None:
            self.total = 0

        def bump(self, by: int) -> int:
            """Add to the counter."""
            self.total += by
            return self.total

    counter = Counter()
    registry = ToolRegistry()
    registry.register(counter.bump)
    assert registry.list_tools()[0].parameters["required"] == ["by"]
    assert run(registry, call("bump", by=3)).content == "3"
    assert counter.total == 3


def test_defaults_are_applied_and_lax_coercion_is_allowed() -> None:
    registry = ToolRegistry()

    @registry.register
    def f(n: int, flag: bool = True) -> str:
        return f"{n!r} {flag!r}"

    assert run(registry, call("f", n="7")).content == "7 True"


class Color(Enum):
    RED = "red"


@dataclass
class Item:
    name: str
    made: datetime


class Model(pydantic.BaseModel):
    count: int


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("plain text", "plain text"),
        (None, ""),
        (42, "42"),
        ({"b": [1, 2], "u": "é"}, '{"b": [1, 2], "u": "é"}'),
        (
            Item(name="x", made=datetime(2026, 1, 2, tzinfo=UTC)),
            '{"name": "x", "made": "2026-01-02T00:00:00+00:00"}',
        ),
        (Model(count=3), '{"count": 3}'),
        ([Color.RED], '["red"]'),
    ],
)
def test_return_values_are_rendered(value: Any, expected: str) -> None:
    registry = ToolRegistry()
    registry.register(lambda: value, name="f")
    assert run(registry, call("f")).content == expected


def test_unserialisable_return_value_is_an_execution_error() -> None:
    registry = ToolRegistry()
    registry.register(lambda: object(), name="f")
    result = run(registry, call("f"))
    assert result.is_error
    assert result.error_type == "ToolExecutionError"
    assert "returned a object that cannot be sent back" in result.content


def test_output_over_the_cap_is_truncated_with_a_note() -> None:
    registry = ToolRegistry(output_cap=100)
    registry.register(lambda: "x" * 250, name="big")
    registry.register(lambda: "y" * 100, name="exact")
    result = run(registry, call("big"))
    assert result.truncated
    assert not result.is_error
    assert result.content == "x" * 100 + "\n[output truncated: 250 chars, showing the first 100]"
    exact = run(registry, call("exact"))
    assert (exact.content, exact.truncated) == ("y" * 100, False)


# --- execution: failures become results ------------------------------------------------------


def test_unknown_tool_is_an_error_result_listing_available_tools() -> None:
    registry = ToolRegistry()
    registry.register(lambda: "", name="alpha")
    registry.register(lambda: "", name="beta")
    result = run(registry, call("gamma"))
    assert result.is_error
    assert result.error_type == "ToolNotFoundError"
    assert result.content == "unknown tool 'gamma'; available tools: alpha, beta"
    assert not result.fatal


def test_invalid_arguments_are_rejected_before_the_handler_runs() -> None:
    registry = ToolRegistry()
    calls: list[int] = []

    @registry.register
    def f(a: int, b: str) -> str:
        calls.append(a)
        return ""

    wrong_type = run(registry, call("f", a="seven", b="x"))
    missing = run(registry, call("f", a=1))
    extra = run(registry, call("f", a=1, b="x", c=3))
    assert calls == []
    for result in (wrong_type, missing, extra):
        assert result.is_error
        assert result.error_type == "ToolArgumentsError"
    assert wrong_type.content.startswith("invalid arguments for 'f': a: Input should be a valid")
    assert "(got 'seven')" in wrong_type.content
    assert missing.content == "invalid arguments for 'f': b: Field required"
    assert extra.content == "invalid arguments for 'f': c: Extra inputs are not permitted"


def test_literal_violation_names_the_field() -> None:
    registry = ToolRegistry()

    def g(mode: Literal["a", "b"]) -> str:
        return mode

    registry.register(g)
    result = run(registry, call("g", mode="c"))
    assert result.error_type == "ToolArgumentsError"
    assert "mode: Input should be 'a' or 'b' (got 'c')" in result.content


def test_unparseable_arguments_are_an_argument_error() -> None:
    registry = ToolRegistry()
    called: list[bool] = []
    registry.register(lambda: called.append(True), name="f")
    broken = ToolCall(id="c", name="f", raw_arguments="{oops", arguments_error="Expecting value")
    result = run(registry, broken)
    assert result.error_type == "ToolArgumentsError"
    assert "not valid JSON: Expecting value" in result.content
    assert called == []


def test_handler_exception_is_an_execution_error() -> None:
    registry = ToolRegistry()

    @registry.register
    def boom() -> str:
        raise ValueError("bad input value")

    result = run(registry, call("boom"))
    assert result.is_error
    assert result.error_type == "ToolExecutionError"
    assert result.content == "ValueError: bad input value"
    assert not result.fatal


def test_handlers_own_timeout_error_is_an_execution_error_not_a_timeout() -> None:
    registry = ToolRegistry()

    @registry.register
    async def flaky() -> str:
        raise TimeoutError("upstream timed out")

    result = run(registry, call("flaky"))
    assert result.error_type == "ToolExecutionError"
    assert result.content == "TimeoutError: upstream timed out"


def test_slow_async_handler_times_out_and_is_cancelled() -> None:
    registry = ToolRegistry()
    cancelled: list[bool] = []

    @registry.register(timeout=0.05)
    async def slow() -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return "never"

    result = run(registry, call("slow"))
    assert result.is_error
    assert result.error_type == "ToolTimeoutError"
    assert result.content == "tool 'slow' did not finish within 0.05s"
    assert cancelled == [True]


def test_default_timeout_applies_to_sync_handlers() -> None:
    registry = ToolRegistry(default_timeout=0.05)
    release = threading.Event()

    @registry.register
    def blocked() -> str:
        release.wait(10)
        return "late"

    async def scenario() -> Any:
        try:
            return await registry.execute(call("blocked"))
        finally:
            release.set()

    result = asyncio.run(scenario())
    assert result.error_type == "ToolTimeoutError"
    assert result.content == "tool 'blocked' did not finish within 0.05s"


def test_a_hung_sync_handler_does_not_block_event_loop_shutdown() -> None:
    registry = ToolRegistry(default_timeout=0.05)
    release = threading.Event()
    finished = threading.Event()

    @registry.register
    def stuck() -> str:
        release.wait(10)
        finished.set()
        return "late"

    try:
        # asyncio.run() returns although the handler's thread is still blocked.
        result = run(registry, call("stuck"))
        assert result.error_type == "ToolTimeoutError"
        assert not finished.is_set()
    finally:
        release.set()
    assert finished.wait(10)


def test_sync_handler_sees_the_callers_context_variables() -> None:
    request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id")
    registry = ToolRegistry()
    registry.register(lambda: request_id.get("unset"), name="whoami")

    async def scenario() -> str:
        request_id.set("req-7")
        return (await registry.execute(call("whoami"))).content

    assert asyncio.run(scenario()) == "req-7"


def test_sync_handler_base_exception_is_reraised_in_the_caller() -> None:
    registry = ToolRegistry()

    @registry.register
    def interrupt() -> str:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(registry, call("interrupt"))


def test_fatal_error_from_handler_is_a_fatal_result() -> None:
    registry = ToolRegistry()

    @registry.register
    def give_up() -> str:
        raise ToolFatalError("the database is gone")

    result = run(registry, call("give_up"))
    assert result.is_error
    assert result.fatal
    assert result.error_type == "ToolFatalError"
    assert result.content == "the database is gone"


def test_error_messages_are_capped_too() -> None:
    registry = ToolRegistry(output_cap=50)

    @registry.register
    def loud() -> str:
        raise RuntimeError("e" * 500)

    result = run(registry, call("loud"))
    assert result.is_error
    assert result.truncated
    assert result.content.startswith("RuntimeError: eeee")
    assert result.content.endswith("[output truncated: 514 chars, showing the first 50]")


def test_cancellation_propagates() -> None:
    registry = ToolRegistry()
    started = asyncio.Event()

    @registry.register
    async def wait_forever() -> str:
        started.set()
        await asyncio.sleep(10)
        return ""

    async def scenario() -> None:
        task = asyncio.create_task(registry.execute(call("wait_forever")))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())


def test_each_execution_is_logged_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    registry = ToolRegistry()
    registry.register(lambda: "ok", name="f")
    with caplog.at_level(logging.DEBUG, logger="fsm_kernel.tools.registry"):
        run(registry, call("f"))
        run(registry, call("nope"))
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("tool f (call call_1) finished") for m in messages)
    assert any("error_type=ToolNotFoundError" in m for m in messages)
