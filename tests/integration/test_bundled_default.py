"""The main job works on a fresh machine: with no model server configured or running, the
bundled model (the `local` extra) stands in, says so on one line, and answers "What time is
it?" by calling datetime; `--model local:PATH` runs any GGUF chat model; a bad local model is
one line, exit 2."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fsm_kernel import bootstrap
from fsm_kernel.agent.local import bundled_gguf, local_model_available
from fsm_kernel.bootstrap import RunOptions, choose_model
from fsm_kernel.workflow.loader import load_workflow

REPO = Path(__file__).resolve().parents[2]
DEFAULT = REPO / "workflows" / "default.yaml"

needs_local = pytest.mark.skipif(
    not local_model_available(), reason="the 'local' extra is not installed"
)


def ollama_listens() -> bool:
    with socket.socket() as s:
        s.settimeout(0.3)
        return s.connect_ex(("127.0.0.1", 11434)) == 0


def console(*argv: str, cwd: Path, drop: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in drop}
    exe = Path(sys.executable).with_name("fsm-kernel")
    return subprocess.run(
        [str(exe), *argv], capture_output=True, text=True, timeout=240, cwd=cwd, env=env,
        check=False,
    )  # fmt: skip


# --- the choice (no model needed) --------------------------------------------------------------


@pytest.fixture
def nothing_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bootstrap, "_server_answers", lambda url: False)
    monkeypatch.setattr(bootstrap, "local_model_available", lambda: True)


@pytest.mark.usefixtures("nothing_answers")
def test_with_nothing_configured_and_no_server_the_bundled_model_stands_in() -> None:
    settings, notice = choose_model(load_workflow(DEFAULT), RunOptions(), environ={})

    assert settings.model == "local"
    assert notice == (
        "no model server at http://localhost:11434/v1; using the bundled SmolLM2-135M (tiny, "
        "for trying the loop) — set --base-url or --model for real work"
    )


@pytest.mark.usefixtures("nothing_answers")
@pytest.mark.parametrize(
    ("options", "environ"),
    [
        (RunOptions(base_url="http://h:1/v1"), {}),
        (RunOptions(model="qwen3"), {}),
        (RunOptions(), {"FSM_KERNEL_BASE_URL": "http://h:1/v1"}),
        (RunOptions(), {"FSM_KERNEL_MODEL": "qwen3"}),
    ],
    ids=["flag-url", "flag-model", "env-url", "env-model"],
)
def test_anything_configured_keeps_the_configured_server(
    options: RunOptions, environ: dict[str, str]
) -> None:
    settings, notice = choose_model(load_workflow(DEFAULT), options, environ=environ)

    assert settings.model != "local"
    assert notice is None


def test_a_running_server_or_a_missing_extra_keeps_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = load_workflow(DEFAULT)
    monkeypatch.setattr(bootstrap, "local_model_available", lambda: True)
    monkeypatch.setattr(bootstrap, "_server_answers", lambda url: True)
    assert choose_model(spec, RunOptions(), environ={})[1] is None
    monkeypatch.setattr(bootstrap, "_server_answers", lambda url: False)
    monkeypatch.setattr(bootstrap, "local_model_available", lambda: False)
    assert choose_model(spec, RunOptions(), environ={})[1] is None


@pytest.mark.parametrize(
    ("model", "fragment"),
    [
        ("local:{tmp}/missing.gguf", "no model file at"),
        ("local:{tmp}/notes.txt", "is not a gguf model file"),
    ],
)
def test_a_bad_local_model_is_one_line_and_exit_2(
    tmp_path: Path, model: str, fragment: str
) -> None:
    (tmp_path / "notes.txt").write_text("not a model")

    proc = console(
        "run", str(DEFAULT), "-p", "hi", "--model", model.format(tmp=tmp_path), "--json",
        cwd=tmp_path,
    )  # fmt: skip

    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert fragment in proc.stderr.lower()
    assert json.loads(proc.stdout)["exit_code"] == 2


# --- the real bundled model --------------------------------------------------------------------


def as_json(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.returncode == 0, proc.stderr
    value = json.loads(proc.stdout)
    assert isinstance(value, dict)
    return value


@pytest.mark.slow
@pytest.mark.timeout(600)
@needs_local
@pytest.mark.skipif(ollama_listens(), reason="a model server runs at the default address")
def test_the_readme_main_job_answers_with_the_bundled_model(tmp_path: Path) -> None:
    proc = console(
        "run", str(DEFAULT), "--prompt", "What time is it?", "--json", cwd=tmp_path,
        drop=("FSM_KERNEL_BASE_URL", "FSM_KERNEL_MODEL", "OPENAI_API_KEY", "FSM_KERNEL_API_KEY"),
    )  # fmt: skip

    result = as_json(proc)
    assert result["termination_reason"] == "final_answer"
    assert [c["name"] for c in result["tool_calls"]] == ["datetime"]
    assert not result["tool_calls"][0]["is_error"]
    assert result["response"].strip()
    assert "using the bundled SmolLM2-135M" in proc.stderr
    shown = console("runs", "show", result["run_id"], cwd=tmp_path)
    assert "the bundled model stood in" in shown.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
@needs_local
def test_any_gguf_by_path(tmp_path: Path) -> None:
    path = bundled_gguf()
    assert path is not None

    proc = console(
        "run", "default", "--prompt", "What time is it?", "--model", f"local:{path}", "--json",
        "--max-iterations", "4", cwd=tmp_path,
    )  # fmt: skip

    result = as_json(proc) if proc.returncode == 0 else json.loads(proc.stdout)
    assert result["termination_reason"] != "malformed_output"
    assert result["tool_calls"], "a valid tool call happened"
    assert "using the bundled" not in proc.stderr  # a configured model: no stand-in
