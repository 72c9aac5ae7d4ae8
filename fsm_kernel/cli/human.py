"""A person at the terminal: answers a run's questions inline (approve a tool call, give
input), so an interactive `run` or `resume` goes on in the same process."""

from __future__ import annotations

import json
import sys
from typing import TextIO

from fsm_kernel.workflow.actions import in_thread
from fsm_kernel.workflow.human import HumanAnswer, Question, Suspended, default_by

__all__ = ["TerminalChannel", "interactive"]


def interactive(as_json: bool) -> bool:
    """Whether to ask inline: a person's mode (not --json) with a terminal on stdin."""
    return not as_json and sys.stdin is not None and sys.stdin.isatty()


class TerminalChannel:
    """Asks on stderr, reads the answer from stdin (in a thread: the run's loop goes on).
    End of input means nobody is there: the run suspends instead."""

    def __init__(
        self, *, by: str | None = None, stdin: TextIO | None = None, out: TextIO | None = None
    ) -> None:
        self.by = by or default_by()
        self._stdin = stdin
        self._out = out

    async def ask(self, question: Question) -> HumanAnswer:
        if question.kind == "event":  # delivered by `fsm-kernel signal`, not typed here
            raise Suspended(question)
        if question.kind == "approval":
            call = question.tool_call
            shown = "?" if call is None else f"{call.name}({_args(call.arguments)})"
            reply = await self._line(question, f"approve {shown}? [y/N] ")
            if reply.strip().lower() in ("y", "yes"):
                return HumanAnswer.approve(by=self.by)
            reason = await self._line(question, "why not (sent to the model; Enter to skip)? ")
            return HumanAnswer.reject(reason.strip(), by=self.by)
        text = await self._line(question, f"{question.prompt or 'Your input?'}\n> ")
        return HumanAnswer.input(text.rstrip("\n"), by=self.by)

    async def _line(self, question: Question, prompt: str) -> str:
        out = self._out or sys.stderr
        out.write(prompt)
        out.flush()
        stdin = self._stdin or sys.stdin
        line: str = await in_thread(stdin.readline)
        if not line:  # end of input: nobody to answer here
            out.write("\n")
            raise Suspended(question)
        return line


def _args(arguments: object) -> str:
    return json.dumps(arguments, ensure_ascii=False, sort_keys=True)
