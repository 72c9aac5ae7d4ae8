"""AgentSettings, the FSM_KERNEL_* environment, the store location, and the layering
defaults < workflow < environment < flags."""

from __future__ import annotations

import math
from dataclasses import FrozenInstanceError
from pathlib import Path
from typing import Any

import pytest

from fsm_kernel.bootstrap import RunOptions, agent_settings, run_limits
from fsm_kernel.config import (
    DEFAULT_BASE_URL,
    DEFAULT_MAX_RESPONSE_BYTES,
    DEFAULT_MODEL,
    DEFAULT_STORE,
    AgentSettings,
    agent_settings_from_env,
    default_store_location,
    package_data_dir,
)
from fsm_kernel.errors import ConfigError, WorkflowValidationError
from fsm_kernel.workflow.loader import load_workflow_text

REPO = Path(__file__).resolve().parents[2]

WITH_AGENT_BLOCK = """\
name: tuned
agent: {model: llama3, base_url: "http://workflow:1/v1", temperature: 0.2, max_retries: 5}
initial: start
states:
  start: {action: session.observe}
  end: {final: true}
transitions:
  - {source: start, target: end, reason: final_answer}
"""


def test_defaults() -> None:
    s = AgentSettings()

    assert s.base_url == DEFAULT_BASE_URL == "http://localhost:11434/v1"
    assert s.model == DEFAULT_MODEL == "qwen3"
    assert s.api_key is None
    assert s.max_retries == 3
    assert s.request_timeout == 120.0
    assert s.connect_timeout == 10.0
    assert s.temperature is None
    assert s.max_response_bytes == DEFAULT_MAX_RESPONSE_BYTES == 8 * 1024 * 1024
    assert s.stream is True


def test_settings_are_frozen() -> None:
    with pytest.raises(FrozenInstanceError):
        AgentSettings().model = "other"  # type: ignore[misc]


def test_merged_applies_values_and_skips_none() -> None:
    base = AgentSettings(model="a", max_retries=1)

    merged = base.merged({"model": "b", "max_retries": None, "temperature": 0.0})

    assert merged.model == "b"
    assert merged.max_retries == 1
    assert merged.temperature == 0.0
    assert base.model == "a"


def test_merged_rejects_unknown_settings() -> None:
    with pytest.raises(ConfigError, match="unknown agent setting\\(s\\): colour, size"):
        AgentSettings().merged({"size": 1, "colour": "red", "model": "x"})


def test_api_key_never_shows() -> None:
    s = AgentSettings(api_key="sk-secret-123")

    assert s.public_dict()["api_key"] == "***"
    assert "sk-secret-123" not in repr(s)
    assert "sk-secret-123" not in str(s.public_dict())
    assert AgentSettings().public_dict()["api_key"] is None
    assert s.api_key == "sk-secret-123"


def test_environment_overrides() -> None:
    env = {
        "FSM_KERNEL_BASE_URL": "http://env:2/v1",
        "FSM_KERNEL_MODEL": "mistral",
        "FSM_KERNEL_API_KEY": "k1",
        "OPENAI_API_KEY": "k2",
        "FSM_KERNEL_REQUEST_TIMEOUT": "7.5",
        "FSM_KERNEL_MAX_RETRIES": "0",
        "FSM_KERNEL_MAX_RESPONSE_BYTES": "4096",
        "UNRELATED": "x",
    }

    assert agent_settings_from_env(env) == {
        "base_url": "http://env:2/v1",
        "model": "mistral",
        "api_key": "k1",
        "request_timeout": 7.5,
        "max_retries": 0,
        "max_response_bytes": 4096,
    }


def test_openai_key_is_the_fallback() -> None:
    assert agent_settings_from_env({"OPENAI_API_KEY": "k2"}) == {"api_key": "k2"}


def test_empty_and_unset_variables_are_ignored() -> None:
    assert agent_settings_from_env({}) == {}
    assert agent_settings_from_env({"FSM_KERNEL_MODEL": "", "FSM_KERNEL_MAX_RETRIES": ""}) == {}


@pytest.mark.parametrize(
    ("name", "value"),
    [("FSM_KERNEL_MAX_RETRIES", "three"), ("FSM_KERNEL_REQUEST_TIMEOUT", "soon")],
)
def test_bad_numbers_name_the_variable(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"{name}='{value}' is not a number"):
        agent_settings_from_env({name: value})


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "Infinity"])
def test_environment_numbers_must_be_finite(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        agent_settings_from_env({"FSM_KERNEL_REQUEST_TIMEOUT": value})

    assert str(info.value) == f"FSM_KERNEL_REQUEST_TIMEOUT={value!r} is not a finite number"


@pytest.mark.parametrize("value", ["0", "-1", "lots", "1.5", "8MB"])
def test_max_response_bytes_from_the_environment_must_be_positive(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        agent_settings_from_env({"FSM_KERNEL_MAX_RESPONSE_BYTES": value})

    assert str(info.value) == (
        f"FSM_KERNEL_MAX_RESPONSE_BYTES={value!r} is not a positive whole number"
    )


@pytest.mark.parametrize(
    ("value", "expected"),
    [("1", True), ("true", True), ("TRUE", True), (" True ", True), ("0", False), ("false", False)],
)
def test_stream_from_the_environment(value: str, expected: bool) -> None:
    assert agent_settings_from_env({"FSM_KERNEL_STREAM": value}) == {"stream": expected}
    assert AgentSettings().merged(agent_settings_from_env({"FSM_KERNEL_STREAM": value})).stream is (
        expected
    )


@pytest.mark.parametrize("value", ["yes", "no", "on", "2", "-1", "t"])
def test_stream_from_the_environment_must_be_a_boolean(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        agent_settings_from_env({"FSM_KERNEL_STREAM": value})

    assert str(info.value) == (
        f"FSM_KERNEL_STREAM={value!r} is not a boolean (use 1, 0, true or false)"
    )


def test_an_empty_stream_variable_is_ignored() -> None:
    assert agent_settings_from_env({"FSM_KERNEL_STREAM": ""}) == {}


# --- validation: every way in goes through AgentSettings.__post_init__ ---------------------

BAD_SETTINGS = [
    pytest.param(
        {"request_timeout": math.nan},
        "request timeout must be a finite number of seconds >= 0, 0 for no limit (got nan) — "
        "check --request-timeout, FSM_KERNEL_REQUEST_TIMEOUT or agent.request_timeout in the "
        "workflow",
        id="request-timeout-nan",
    ),
    pytest.param({"request_timeout": math.inf}, "(got inf)", id="request-timeout-inf"),
    pytest.param({"request_timeout": -1.0}, "(got -1.0)", id="request-timeout-negative"),
    pytest.param({"request_timeout": "10"}, "(got '10')", id="request-timeout-text"),
    pytest.param(
        {"connect_timeout": 0},
        "connect timeout must be a finite number of seconds > 0 (got 0)",
        id="connect-timeout-zero",
    ),
    pytest.param({"connect_timeout": math.nan}, "(got nan)", id="connect-timeout-nan"),
    pytest.param(
        {"temperature": math.nan},
        "temperature must be a finite number (got nan) — check agent.temperature in the workflow",
        id="temperature-nan",
    ),
    pytest.param({"temperature": -math.inf}, "(got -inf)", id="temperature-inf"),
    pytest.param(
        {"max_retries": -1},
        "max retries must be a whole number from 0 to 100 (got -1) — check --max-retries, "
        "FSM_KERNEL_MAX_RETRIES or agent.max_retries in the workflow",
        id="max-retries-negative",
    ),
    pytest.param({"max_retries": 101}, "(got 101)", id="max-retries-too-many"),
    pytest.param({"max_retries": 2.5}, "(got 2.5)", id="max-retries-fraction"),
    pytest.param({"max_retries": True}, "(got True)", id="max-retries-bool"),
    pytest.param(
        {"max_response_bytes": 0},
        "max response bytes must be a whole number of bytes > 0 (got 0) — check "
        "--max-response-bytes, FSM_KERNEL_MAX_RESPONSE_BYTES or agent.max_response_bytes in the "
        "workflow",
        id="max-response-bytes-zero",
    ),
    pytest.param({"max_response_bytes": -5}, "(got -5)", id="max-response-bytes-negative"),
    pytest.param(
        {"stream": "false"},
        "stream must be true or false (got 'false') — check --no-stream or FSM_KERNEL_STREAM",
        id="stream-text",
    ),
    pytest.param({"stream": 1}, "(got 1)", id="stream-number"),
]


@pytest.mark.parametrize(("values", "message"), BAD_SETTINGS)
def test_insane_settings_are_refused(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        AgentSettings(**values)

    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("values", "message"), BAD_SETTINGS)
def test_merged_validates_too(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        AgentSettings().merged(values)

    assert message in str(info.value)


def test_edge_values_are_accepted() -> None:
    s = AgentSettings(
        request_timeout=0,
        connect_timeout=0.001,
        max_retries=100,
        temperature=0.0,
        max_response_bytes=1,
    )

    assert (s.request_timeout, s.max_retries, s.max_response_bytes) == (0, 100, 1)
    assert AgentSettings(max_retries=0, request_timeout=1).max_retries == 0


@pytest.mark.parametrize(
    ("environ", "options", "named"),
    [
        ({"FSM_KERNEL_MAX_RETRIES": "1000"}, RunOptions(), "FSM_KERNEL_MAX_RETRIES"),
        ({"FSM_KERNEL_REQUEST_TIMEOUT": "-3"}, RunOptions(), "FSM_KERNEL_REQUEST_TIMEOUT"),
        ({}, RunOptions(request_timeout=math.nan), "--request-timeout"),
        ({}, RunOptions(max_retries=-2), "--max-retries"),
    ],
    ids=["env-retries", "env-timeout", "flag-timeout-nan", "flag-retries"],
)
def test_bad_values_from_env_and_flags_fail_when_layered(
    environ: dict[str, str], options: RunOptions, named: str
) -> None:
    spec = load_workflow_text(WITH_AGENT_BLOCK)

    with pytest.raises(ConfigError, match=named):
        agent_settings(spec, options, environ)


def test_a_nan_temperature_in_the_workflow_is_refused_at_its_line() -> None:
    text = WITH_AGENT_BLOCK.replace("temperature: 0.2", "temperature: .nan")

    with pytest.raises(WorkflowValidationError, match=r"<string>:\d+:\d+: temperature: .*finite"):
        load_workflow_text(text)


def test_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSM_KERNEL_MODEL", "from-env")

    found = agent_settings_from_env()

    assert found["model"] == "from-env"
    assert found["base_url"] == "http://127.0.0.1:9/v1"  # conftest's dead port


def test_store_location(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert default_store_location({}) == DEFAULT_STORE == ".fsm-kernel/runs.db"
    assert default_store_location({"FSM_KERNEL_STORE": ""}) == DEFAULT_STORE
    assert default_store_location({"FSM_KERNEL_STORE": "/x/y.db"}) == "/x/y.db"
    monkeypatch.setenv("FSM_KERNEL_STORE", str(tmp_path / "s.db"))
    assert default_store_location() == str(tmp_path / "s.db")


def test_package_data_dir() -> None:
    workflows = package_data_dir("workflows")

    assert workflows is not None
    assert (workflows / "default.yaml").is_file()
    assert package_data_dir("no_such_folder_anywhere") is None


def test_layering_defaults_workflow_environment_flags() -> None:
    spec = load_workflow_text(WITH_AGENT_BLOCK)
    env = {"FSM_KERNEL_BASE_URL": "http://env:2/v1", "FSM_KERNEL_MAX_RETRIES": "2"}

    from_file = agent_settings(spec, RunOptions(), {})
    from_env = agent_settings(spec, RunOptions(), env)
    from_flags = agent_settings(spec, RunOptions(base_url="http://flag:3/v1", max_retries=0), env)

    assert (from_file.model, from_file.base_url, from_file.max_retries) == (
        "llama3",
        "http://workflow:1/v1",
        5,
    )
    assert from_file.temperature == 0.2
    assert from_file.request_timeout == 120.0  # the built-in default survives
    assert (from_env.base_url, from_env.max_retries) == ("http://env:2/v1", 2)
    assert from_env.model == "llama3"
    assert (from_flags.base_url, from_flags.max_retries) == ("http://flag:3/v1", 0)
    assert from_flags.model == "llama3"


def test_flag_limits_override_the_workflow() -> None:
    spec = load_workflow_text(WITH_AGENT_BLOCK)

    changed = run_limits(spec, RunOptions(max_iterations=0, timeout_seconds=1.5))

    assert changed.max_iterations == 0
    assert changed.timeout_seconds == 1.5
    assert changed.max_tool_failures == spec.limits.max_tool_failures
    assert spec.limits.max_iterations == 10
    assert run_limits(spec, RunOptions()) is spec.limits


def test_recorded_limits_replace_the_workflows_and_flags_still_apply() -> None:
    spec = load_workflow_text(WITH_AGENT_BLOCK)
    recorded = {**spec.limits.model_dump(), "max_iterations": 6, "max_tool_failures": 1}

    limits = run_limits(spec, RunOptions(limits=recorded, timeout_seconds=9.0))

    assert (limits.max_iterations, limits.max_tool_failures) == (6, 1)
    assert limits.timeout_seconds == 9.0


@pytest.mark.parametrize(
    "options",
    [RunOptions(max_iterations=-1), RunOptions(timeout_seconds=-5.0)],
    ids=["iterations", "timeout"],
)
def test_flag_limits_are_validated(options: RunOptions) -> None:
    spec = load_workflow_text(WITH_AGENT_BLOCK)

    with pytest.raises(ConfigError):
        run_limits(spec, options)
