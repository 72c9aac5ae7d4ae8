"""AgentSettings, the FSM_KERNEL_* environment, the store location, and the layering
defaults < workflow < environment < flags."""

from __future__ import annotations

from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest

from fsm_kernel.bootstrap import RunOptions, agent_settings, apply_limits
from fsm_kernel.config import (
    DEFAULT_BASE_URL,
    DEFAULT_MODEL,
    DEFAULT_STORE,
    AgentSettings,
    agent_settings_from_env,
    default_store_location,
    package_data_dir,
)
from fsm_kernel.errors import ConfigError
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
    assert s.temperature is None


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
        "UNRELATED": "x",
    }

    assert agent_settings_from_env(env) == {
        "base_url": "http://env:2/v1",
        "model": "mistral",
        "api_key": "k1",
        "request_timeout": 7.5,
        "max_retries": 0,
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

    changed = apply_limits(spec, RunOptions(max_iterations=0, timeout_seconds=1.5))

    assert changed.limits.max_iterations == 0
    assert changed.limits.timeout_seconds == 1.5
    assert changed.limits.max_tool_failures == spec.limits.max_tool_failures
    assert (changed.path, changed.content_hash) == (spec.path, spec.content_hash)
    assert spec.limits.max_iterations == 10
    assert apply_limits(spec, RunOptions()) is spec


@pytest.mark.parametrize(
    "options",
    [RunOptions(max_iterations=-1), RunOptions(timeout_seconds=-5.0)],
    ids=["iterations", "timeout"],
)
def test_flag_limits_are_validated(options: RunOptions) -> None:
    spec = load_workflow_text(WITH_AGENT_BLOCK)

    with pytest.raises(ConfigError):
        apply_limits(spec, options)
