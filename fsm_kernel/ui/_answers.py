"""Answering a run that waits for a person, from its page: the very `fsm-kernel resume RUN_ID
--approve | --reject WHY | --input TEXT --by NAME` a person would type, started as a process of
its own, so the resumed run is recorded like any other, the page follows it live, and stopping
the viewer does not stop it."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from fsm_kernel.workflow.human import default_by

__all__ = ["Answer", "AnswerRejected", "parse_answer", "start_resume"]

_FLAGS = {"approve": "--approve", "reject": "--reject", "input": "--input"}
_KINDS = {"approve": "approval", "reject": "approval", "input": "input"}
_SETTLE_SECONDS = 1.5
"""How long the viewer waits for a resume that fails at once (a usage error, a lock held)."""


class AnswerRejected(Exception):
    """The answer cannot be taken: a one-line reason for the page (and its HTTP status)."""

    def __init__(self, message: str, status: int = 409) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Answer:
    action: str
    """approve, reject or input."""
    text: str = ""
    """The reason of a rejection, or the input."""

    @property
    def kind(self) -> str:
        return _KINDS[self.action]

    def arguments(self) -> list[str]:
        flag = _FLAGS[self.action]
        return [flag] if self.action == "approve" else [f"{flag}={self.text}"]


def parse_answer(fields: dict[str, str], waiting_kind: str) -> Answer:
    """The answer a form carries, of the kind the run waits for."""
    action = fields.get("action", "")
    if action not in _FLAGS:
        raise AnswerRejected(f"unknown answer {action[:40]!r}", 400)
    answer = Answer(action, fields.get("text", ""))
    if answer.kind != waiting_kind:
        raise AnswerRejected(f"the run waits for {waiting_kind}, not {action}")
    if action == "input" and not answer.text.strip():
        raise AnswerRejected("the input is empty", 400)
    return answer


def start_resume(location: str, run_id: str, answer: Answer, *, by: str | None = None) -> None:
    """Start `fsm-kernel resume` with the answer; return once it runs (or ended well). The store
    location goes by the environment, never on a command line others can read (`ps`).

    Raises:
        AnswerRejected: the resume refused at once (another resume holds the run, the run no
            longer waits for this...), with its one-line error.
    """
    who = by or f"{default_by()} (fsm-kernel ui)"
    command = [sys.executable, "-m", "fsm_kernel", "resume", run_id, *answer.arguments()]
    command += ["--by", who, "--json"]
    env = {**os.environ, "FSM_KERNEL_STORE": location}
    with tempfile.TemporaryDirectory(prefix="fsm-kernel-ui-") as tmp:
        errors = Path(tmp) / "stderr"
        with errors.open("wb") as err:
            process = subprocess.Popen(
                command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                start_new_session=True,  # lives on if the viewer stops
            )
        deadline = time.monotonic() + _SETTLE_SECONDS
        while process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if process.returncode == 2:
            lines = errors.read_text("utf-8", "replace").strip().splitlines()
            message = lines[-1].removeprefix("error: ") if lines else "resume refused"
            raise AnswerRejected(message)
