"""The bundled model ends quickly, whatever it does: a generation caught in a loop is stopped at
its third saying (a tool call's arguments then are malformed output, fed back to the model; an
answer keeps the text before the loop), a tool call streams as it is generated, a cut-off answer
names the local cap in force, and the help a small model gets depends on what the model is,
not on the name of its file.

The slow tests run the real model (SmolLM2-135M) through the CLI, told to repeat what the user
says, on prompts that make it loop every time (its seed is fixed): without the guard each would
run to the token cap.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from fsm_kernel.agent.local import (
    LocalChatModel,
    bundled_gguf,
    local_model_available,
    small_model_setting,
)
from fsm_kernel.bootstrap import chat_model_for
from fsm_kernel.config import AgentSettings
from fsm_kernel.errors import ConfigError

needs_local = pytest.mark.skipif(
    not local_model_available(), reason="the 'local' extra is not installed"
)
LOOPING_CALL = "Repeat after me: " + " ".join(["ha"] * 16)
"""SmolLM2-135M says `ha` in done()'s arguments until it is stopped."""
LOOPING_ANSWER = "Repeat after me: " + ", ".join(["the cat"] * 8)
"""SmolLM2-135M says `the cat` in its answer until it is stopped (the repeat penalty of free
text breaks the `ha ha` loop)."""
CAP = 200
"""The token cap of these runs: a loop that ran to it would be far over the bound asserted."""
LOOP_BOUND = 64
"""The most tokens a loop may take before it is stopped: `_LOOP_SPAN` (24) is when it is seen."""


def console(
    *argv: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("fsm-kernel")
    return subprocess.run(
        [str(exe), *argv],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=cwd,
        env={**os.environ, "FSM_KERNEL_LOCAL_MAX_TOKENS": str(CAP), **(env or {})},
        check=False,
    )


def run_json(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.stdout, proc.stderr
    value = json.loads(proc.stdout)
    assert isinstance(value, dict)
    return value


def events(run_id: str, cwd: Path) -> list[dict[str, Any]]:
    proc = console("runs", "events", run_id, "--json", cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def responded(log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e["data"]["completion"] for e in log if e["type"] == "model.responded"]


# --- the setting (no model run) ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("", None), ("auto", None), (" AUTO ", None), ("on", True), ("off", False)],
)
def test_the_small_model_setting_reads_auto_on_off(raw: str, expected: bool | None) -> None:
    environ = {"FSM_KERNEL_LOCAL_SMALL_MODEL": raw} if raw else {}
    assert small_model_setting(environ) is expected


@needs_local
@pytest.mark.parametrize(("raw", "recorded"), [("on", True), ("off", False), ("auto", "auto")])
def test_the_cli_model_records_the_small_model_setting(raw: str, recorded: object) -> None:
    model = chat_model_for(
        AgentSettings(model="local"), environ={"FSM_KERNEL_LOCAL_SMALL_MODEL": raw}
    )
    assert isinstance(model, LocalChatModel)
    assert model.describe()["answer_after_result"] == recorded


@needs_local
def test_a_bad_small_model_setting_is_one_line_and_exit_2(tmp_path: Path) -> None:
    proc = console(
        "run", "default", "-p", "hi", "--model", "local", cwd=tmp_path,
        env={"FSM_KERNEL_LOCAL_SMALL_MODEL": "maybe"},
    )  # fmt: skip

    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: FSM_KERNEL_LOCAL_SMALL_MODEL='maybe' is not one of auto, on, off"
    ]


def test_generation_leaves_a_core_to_the_rest_of_the_machine(tmp_path: Path) -> None:
    """Threads that wait on each other after every step collapse when another program takes
    a core: by default one core is left over (a machine of one core uses it)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    described = LocalChatModel(tmp_path / "m.gguf").describe()
    assert described["n_threads"] == max((cpus or 1) - 1, 1)


# --- loops, with the real model ------------------------------------------------------------------

LOOP_WORKFLOW = textwrap.dedent("""\
    name: echo_done
    system_prompt: Repeat exactly what the user says.
    tools: [done]
    limits: {max_iterations: 3, max_malformed_outputs: 2}
    initial: think
    states:
      think: {action: agent.think, tool_choice: done}
      act: {action: tools.execute}
      terminate: {final: true}
    transitions:
      - {source: think, target: act, guard: has_tool_calls}
      - {source: think, target: think, guard: malformed_output, unless: retries_exhausted}
      - {source: think, target: terminate, guard: malformed_output, reason: malformed_output}
      - {source: think, target: terminate, reason: final_answer}
      - {source: act, target: terminate, guard: done_called, reason: done}
      - {source: act, target: terminate, reason: final_answer}
""")


@pytest.mark.slow
@pytest.mark.timeout(300)
@needs_local
def test_a_tool_call_caught_in_a_loop_is_stopped_and_fed_back(tmp_path: Path) -> None:
    (tmp_path / "echo_done.yaml").write_text(LOOP_WORKFLOW)

    proc = console("run", "echo_done.yaml", "--model", "local", "-p", LOOPING_CALL, cwd=tmp_path)

    assert "Tool call: done(" in proc.stderr  # the call streams as it is generated
    run_id = next(
        line.split()[-1] for line in proc.stdout.splitlines() if line.startswith("run id:")
    )
    log = events(run_id, tmp_path)
    first = responded(log)[0]
    call = first["message"]["tool_calls"][0]
    assert "went round in a loop" in call["arguments_error"]
    assert first["usage"]["completion_tokens"] <= LOOP_BOUND
    assert len(call["raw_arguments"]) < 80  # the text before the loop, not the loop
    fed_back = [e for e in log if e["type"] == "tool.finished" and e["data"].get("malformed")]
    assert fed_back, "the looping call went back to the model as malformed output"
    assert "went round in a loop" in fed_back[0]["data"]["result"]["content"]
    notices = [e["data"] for e in log if e["type"] == "model.notice"]
    assert {"kind": "loop_stopped", "step": "arguments", "tokens": call_tokens(first)} in notices
    ended = next(e["data"] for e in log if e["type"] == "run.terminated")
    assert ended["reason"] in ("malformed_output", "done", "final_answer")


def call_tokens(completion: dict[str, Any]) -> int:
    """The tokens of the arguments' generation: all but the (here skipped) choice of a step."""
    return int(completion["usage"]["completion_tokens"])


ANSWER_WORKFLOW = textwrap.dedent("""\
    name: echo
    system_prompt: Repeat exactly what the user says.
    tools: []
    initial: think
    states:
      think: {action: agent.think}
      terminate: {final: true}
    transitions:
      - {source: think, target: terminate, reason: final_answer}
""")


@pytest.mark.slow
@pytest.mark.timeout(300)
@needs_local
def test_an_answer_caught_in_a_loop_keeps_the_text_before_it(tmp_path: Path) -> None:
    (tmp_path / "echo.yaml").write_text(ANSWER_WORKFLOW)

    proc = console(
        "run", "echo.yaml", "--model", "local", "-p", LOOPING_ANSWER, "--json", cwd=tmp_path
    )  # fmt: skip

    result = run_json(proc)
    assert result["termination_reason"] == "final_answer", result.get("error")
    assert "cat" in result["response"].lower()
    assert len(result["response"]) < 40, result["response"]  # one saying, not eight or more
    assert result["usage"]["completion_tokens"] <= LOOP_BOUND
    log = events(result["run_id"], tmp_path)
    assert [e["data"]["kind"] for e in log if e["type"] == "model.notice"] == ["loop_stopped"]


# --- the cap in force ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
@needs_local
def test_a_cut_off_answer_names_the_local_cap(tmp_path: Path) -> None:
    proc = console(
        "run", "single_shot", "--model", "local", "-p", "Tell me a long story about a dragon.",
        "--json", cwd=tmp_path, env={"FSM_KERNEL_LOCAL_MAX_TOKENS": "6"},
    )  # fmt: skip

    result = run_json(proc)
    assert proc.returncode == 1
    assert result["termination_reason"] == "truncated"
    assert "the local model's cap of 6 tokens" in result["error"]
    assert "FSM_KERNEL_LOCAL_MAX_TOKENS" in result["error"]
    assert "agent.max_tokens" not in result["error"]


# --- the same file under another name ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
@needs_local
def test_the_bundled_file_renamed_behaves_as_local(tmp_path: Path) -> None:
    """The help a small model gets (answering in text after a tool's result) follows its
    parameter count: named by path, the bundled file answers as `--model local` does (it
    ended no_progress, calling datetime again and again)."""
    bundled = bundled_gguf()
    assert bundled is not None
    renamed = tmp_path / "x" / "renamed.gguf"
    renamed.parent.mkdir()
    renamed.symlink_to(bundled)

    ends = []
    for model in ("local", f"local:{renamed}"):
        proc = console(
            "run", "default", "--prompt", "What time is it?", "--model", model, "--json",
            cwd=tmp_path,
        )  # fmt: skip
        result = run_json(proc)
        calls = [c["name"] for c in result["tool_calls"]]
        # Not the answer's wording, nor its length: it tells the time, which moved on between
        # the runs, so one answer may run into the token cap (truncated) where the other does
        # not. Either way it answered in text after one reading of the clock.
        answered = result["termination_reason"] in ("final_answer", "truncated")
        ends.append((answered, calls, result["iterations"]))

    assert ends[0] == (True, ["datetime"], 2)
    assert ends[1] == ends[0]


def test_a_bad_setting_raises_config_error() -> None:
    with pytest.raises(ConfigError, match="FSM_KERNEL_LOCAL_SMALL_MODEL"):
        small_model_setting({"FSM_KERNEL_LOCAL_SMALL_MODEL": "yes"})


@pytest.mark.slow
@pytest.mark.timeout(300)
@needs_local
def test_a_tool_call_streams_as_progress_marked_with_its_tool_never_as_answer_text() -> None:
    from fsm_kernel.protocol import Message
    from fsm_kernel.streaming import StreamNotice, TextDelta, deltas_to
    from fsm_kernel.tools import builtin_registry

    model = chat_model_for(AgentSettings(model="local"), environ={})
    tools = builtin_registry().list_tools(["datetime"])
    seen: list[TextDelta] = []

    def sink(item: TextDelta | StreamNotice) -> None:
        if isinstance(item, TextDelta):
            seen.append(item)

    async def ask() -> Any:
        with deltas_to(sink):
            try:
                return await model.complete([Message.user("What time is it?")], tools)
            finally:
                await model.aclose()

    completion = asyncio.run(ask())
    assert [c.name for c in completion.message.tool_calls] == ["datetime"]
    assert seen, "the call streamed nothing"
    assert {d.tool_call for d in seen} == {"datetime"}  # no piece passes for answer text
    assert "".join(d.text for d in seen).startswith("Tool call: datetime(")


@needs_local
def test_a_process_that_used_llama_cpp_ends_without_its_unclosed_file_warnings() -> None:
    """llama_cpp opens two /dev/null files when imported and never closes them: a process run
    with ResourceWarning shown (`python -X dev`, pytest's `-W error`) would end with two
    'unclosed file' lines that are not its own. fsm-kernel closes them at exit."""
    code = "from fsm_kernel.agent.local import _import_llama_cpp; _import_llama_cpp()"
    ran = subprocess.run(
        [sys.executable, "-X", "dev", "-W", "error::ResourceWarning", "-c", code],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip

    assert ran.returncode == 0, ran.stderr
    assert "ResourceWarning" not in ran.stderr, ran.stderr
