"""Answering a run that waits for a person, from its page: the very `fsm-kernel resume RUN_ID
--approve | --reject WHY | --input TEXT --by NAME` a person would type (for a run in a waiting
state, `fsm-kernel signal RUN_ID NAME --data JSON --by NAME`), started as a process of its own,
so the resumed run is recorded like any other, the page follows it live, and stopping the
viewer does not stop it.

`Resumes` keeps the answers this viewer started: one question takes one answer (the others get
409 while it is being resumed), each resume process is waited for on a thread of its own (no
zombies), and a resume that fails after the page was answered is remembered for the run's page.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO

from fsm_kernel.redact import redact
from fsm_kernel.workflow.human import default_by

__all__ = ["Answer", "AnswerFailure", "AnswerRejected", "Resumes", "parse_answer"]

_FLAGS = {"approve": "--approve", "reject": "--reject", "input": "--input", "signal": "--data"}
_KINDS = {"approve": "approval", "reject": "approval", "input": "input", "signal": "event"}
_SETTLE_SECONDS = 1.5
"""How long an answer's request waits for a resume that fails at once (a usage error, a lock
held), to refuse it with the resume's own error."""
_ERROR_TAIL_BYTES = 4096
_MESSAGE_CHARS = 500

_EVENT = re.compile(r"^[a-z][a-z0-9_]*$")
"""An event name as `validate` allows it (the run refuses one its state does not await)."""

StillWaiting = Callable[[str, int], bool]
"""Whether run `run_id` still waits on the question of seq `seq` (the answer did not take)."""


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
    """The reason of a rejection, the input, or an event's data (JSON; may be empty)."""
    event: str = ""
    """signal: the event delivered."""

    @property
    def kind(self) -> str:
        return _KINDS[self.action]

    def arguments(self) -> list[str]:
        flag = _FLAGS[self.action]
        if self.action == "signal":
            return [self.event, f"{flag}={self.text}"] if self.text.strip() else [self.event]
        return [flag] if self.action == "approve" else [f"{flag}={self.text}"]

    def command(self, run_id: str) -> list[str]:
        """The fsm-kernel command that gives this answer to run `run_id`."""
        verb = "signal" if self.action == "signal" else "resume"
        return [verb, run_id, *self.arguments()]


@dataclass(frozen=True)
class AnswerFailure:
    """A resume this viewer started for a question that ended in error."""

    seq: int
    """The question (its `run.suspended` seq) the answer was for."""
    message: str
    """The resume's one-line error (redacted)."""


def parse_answer(fields: dict[str, str], waiting_kind: str, events: Sequence[str] = ()) -> Answer:
    """The answer a form carries, of the kind the run waits for (an event: one of `events`,
    the ones its waiting state awaits)."""
    action = fields.get("action", "")
    if action not in _FLAGS:
        raise AnswerRejected(f"unknown answer {action[:40]!r}", 400)
    answer = Answer(action, fields.get("text", ""), fields.get("event", ""))
    if answer.kind != waiting_kind:
        raise AnswerRejected(f"the run waits for {waiting_kind}, not {action}")
    if action == "input" and not answer.text.strip():
        raise AnswerRejected("the input is empty", 400)
    if action == "signal" and not _EVENT.match(answer.event):
        raise AnswerRejected("name the event to deliver", 400)
    if action == "signal" and answer.event not in events:
        awaited = ", ".join(events) or "no event"
        wanted = f"event {answer.event!r} (it waits for {awaited})"
        raise AnswerRejected(f"the run does not wait for {wanted}")
    return answer


@dataclass
class _Resume:
    """One resume process and how it ended (once it has)."""

    seq: int
    process: subprocess.Popen[bytes]
    errors: IO[bytes]
    done: threading.Event
    message: str | None = None
    """Its error, when it exited with a non-zero code."""


class Resumes:
    """The resumes this viewer started, one per run at a time (see the module docstring)."""

    def __init__(self, still_waiting: StillWaiting) -> None:
        self._still_waiting = still_waiting
        self._lock = threading.Lock()
        self._running: dict[str, _Resume] = {}
        self._failed: dict[str, AnswerFailure] = {}

    def start(
        self, location: str, run_id: str, seq: int, answer: Answer, *, by: str | None = None
    ) -> None:
        """Start `fsm-kernel resume` with the answer to question `seq`; return once it runs
        (or ended well). The store location goes by the environment, never on a command line
        others can read (`ps`).

        Raises:
            AnswerRejected: an answer from this viewer is being resumed for the run already, or
                the resume failed at once (another process holds the run, the run no longer
                waits for this...), with its one-line error.
        """
        with self._lock:
            if run_id in self._running:
                raise AnswerRejected(
                    "the run is being answered already (from this viewer): reload the page"
                )
            resume = _spawn(location, run_id, seq, answer, by)
            self._running[run_id] = resume
            self._failed.pop(run_id, None)
        threading.Thread(
            target=self._wait, args=(run_id, resume), name="fsm-kernel-ui-resume", daemon=True
        ).start()
        if resume.done.wait(_SETTLE_SECONDS) and resume.message is not None:
            if self._still_waiting(run_id, seq):
                with self._lock:
                    self._failed.pop(run_id, None)  # told now, on the answer's own page
                raise AnswerRejected(resume.message)

    def failure(self, run_id: str, seq: int) -> AnswerFailure | None:
        """How the answer this viewer sent to question `seq` of the run failed, if it did."""
        with self._lock:
            failed = self._failed.get(run_id)
        return failed if failed is not None and failed.seq == seq else None

    def _wait(self, run_id: str, resume: _Resume) -> None:
        """Reap the process and keep its error (a failed answer leaves the run waiting)."""
        code = resume.process.wait()
        if code != 0:
            resume.message = _last_error(resume.errors, code)
        resume.errors.close()
        with self._lock:
            if resume.message is not None:
                self._failed[run_id] = AnswerFailure(resume.seq, resume.message)
            del self._running[run_id]
        resume.done.set()


def _spawn(location: str, run_id: str, seq: int, answer: Answer, by: str | None) -> _Resume:
    who = by or f"{default_by()} (fsm-kernel ui)"
    command = [sys.executable, "-m", "fsm_kernel", *answer.command(run_id)]
    command += ["--by", who, "--json"]
    env = {**os.environ, "FSM_KERNEL_STORE": location}
    errors = tempfile.TemporaryFile(prefix="fsm-kernel-ui-")
    try:
        process = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=errors,
            start_new_session=True,  # lives on if the viewer stops
        )
    except OSError as exc:
        errors.close()
        raise AnswerRejected(
            f"cannot start fsm-kernel resume: {exc.strerror or exc}", 500
        ) from None
    return _Resume(seq, process, errors, threading.Event())


def _last_error(errors: IO[bytes], code: int) -> str:
    """The resume's last `error:` line (else its last line), redacted and cut short."""
    errors.seek(0, os.SEEK_END)
    errors.seek(max(0, errors.tell() - _ERROR_TAIL_BYTES))
    lines = errors.read().decode("utf-8", "replace").strip().splitlines()
    chosen = next((line for line in reversed(lines) if line.startswith("error:")), None)
    message = (chosen or (lines[-1] if lines else "")).removeprefix("error:").strip()
    message = message or f"fsm-kernel resume exited with code {code}"
    return redact(message)[:_MESSAGE_CHARS]
