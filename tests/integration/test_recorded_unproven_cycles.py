"""A run recorded before `validate` proved every cycle bounded is still the user's record: its
definition is read back without the proof, so it still shows, replays and resumes, while a new
run of the same file is refused (the kernel's limits bounded the old run all along)."""

from __future__ import annotations

from pathlib import Path

import pytest

import fsm_kernel
from fsm_kernel.errors import AgentConnectionError
from fsm_kernel.testing import ScriptedChatModel
from fsm_kernel.workflow import validate
from tests.clikit import cli
from tests.fakes.openai_server import FakeOpenAIServer, text_reply

LOOPY = """\
name: loopy
initial: think
states:
  think: {action: agent.think}
  check: {action: kernel.evaluate}
  recheck: {action: kernel.evaluate}
  done: {final: true}
transitions:
  - {source: think, target: check}
  - {source: check, target: recheck, guard: has_tool_calls}
  - {source: check, target: done, reason: final_answer}
  - {source: recheck, target: check}
"""


@pytest.fixture
def recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, str]:
    """A run of LOOPY recorded as an fsm-kernel without the cycle proof recorded it."""
    workflow, store = tmp_path / "loopy.yaml", tmp_path / "runs.db"
    workflow.write_text(LOOPY)
    with monkeypatch.context() as older:
        older.setattr(validate, "cycle_errors", lambda spec, import_code=True: [])
        result = fsm_kernel.run(
            str(workflow), "hi", chat_model=ScriptedChatModel(["Hello."]), store=str(store)
        )
    assert result.termination_reason == "final_answer"
    return workflow, store, result.run_id


def test_a_new_run_of_the_file_is_refused_at_the_cycle(
    recorded: tuple[Path, Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    workflow, _, _ = recorded

    ran = cli(capsys, "validate", str(workflow))

    assert ran.code == 2
    assert f"{workflow}:10:5: check → recheck → check can repeat without a model call" in ran.err


def test_the_old_run_still_shows_and_replays_identically(
    recorded: tuple[Path, Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    _, store, run_id = recorded

    shown = cli(capsys, "runs", "show", run_id, "--store", str(store))
    replayed = cli(capsys, "replay", run_id, "--store", str(store))

    assert shown.code == 0, shown.err
    assert "final_answer" in shown.out
    assert replayed.code == 0, replayed.out + replayed.err
    assert "identical: 2 transitions, reason final_answer" in replayed.out


class Down:
    """A model server that cannot be reached: the run ends agent_error, resumable."""

    async def complete(self, messages: object, tools: object, **_: object) -> object:
        raise AgentConnectionError("cannot reach model server: refused")


def test_a_run_recorded_then_cut_off_resumes_to_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    workflow, store = tmp_path / "loopy.yaml", tmp_path / "runs.db"
    workflow.write_text(LOOPY)
    with monkeypatch.context() as older:
        older.setattr(validate, "cycle_errors", lambda spec, import_code=True: [])
        cut = fsm_kernel.run(str(workflow), "hi", chat_model=Down(), store=str(store))
    assert cut.termination_reason == "agent_error"

    with FakeOpenAIServer() as server:
        server.enqueue(text_reply("Hello."))
        resumed = cli(
            capsys, "resume", cut.run_id, "--store", str(store), "--base-url", server.base_url,
            "--model", "m", "--json",
        )  # fmt: skip

    assert resumed.code == 0, resumed.err
    assert resumed.json()["run_id"] == cut.run_id
    assert resumed.json()["termination_reason"] == "final_answer"
    assert resumed.json()["response"] == "Hello."
