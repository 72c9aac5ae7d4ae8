"""`fsm-kernel chat WORKFLOW`: a conversation in the terminal, each line a run that continues the
previous one (so the whole conversation is in the event log, and `chat --continue RUN_ID` picks
it up later)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Any

from fsm_kernel.cli.args import MAX_PROMPT_BYTES
from fsm_kernel.errors import ConfigError

__all__ = ["register"]

EXIT_OK = 0
_QUIT = frozenset({"!exit", "!quit", "/exit", "/quit", "/bye"})
_HELP = frozenset({"!help", "/help", "/?"})
_HELP_TEXT = (
    "each line you type is a run that continues this conversation; !exit (or /exit, /quit, "
    "Ctrl-D, Ctrl-C at the prompt) ends the chat; Ctrl-C while a run works stops that run"
)


def register(sub: Any) -> None:
    from fsm_kernel.cli.commands import add_model_flags

    p = sub.add_parser(
        "chat",
        description="Each line you type is a run of WORKFLOW that continues the conversation "
        "so far (recorded as such in the event log); its progress shows on stderr, its answer "
        "on stdout (streamed there as it comes when stdout is a terminal). !exit (or /exit, "
        "/quit), Ctrl-D, or Ctrl-C at the prompt end the chat (exit 0) and say how to pick it "
        "up later; !help says this; any other line starting with ! is refused, not sent. "
        "Ctrl-C while a run works stops that run (it ends 'cancelled') and gives the prompt "
        "back. --continue RUN_ID picks up a conversation later.",
    )
    p.add_argument("workflow", metavar="WORKFLOW", nargs="?", default="default")
    p.add_argument(
        "--continue",
        dest="continue_run",
        metavar="RUN_ID",
        help="continue the conversation that run ended (its id or a unique prefix)",
    )
    p.add_argument("--system-prompt", help="replace the workflow's system prompt")
    add_model_flags(p)
    p.set_defaults(handler=cmd_chat, memory=None)


def cmd_chat(args: argparse.Namespace) -> int:
    import asyncio  # here, not at the top: building the parsers (`--help`) stays cheap

    from fsm_kernel.api import Agent
    from fsm_kernel.bootstrap import load_spec
    from fsm_kernel.cli import output
    from fsm_kernel.cli.commands import agent_options, options_from_args, run_cancellable
    from fsm_kernel.cli.human import TerminalChannel, interactive
    from fsm_kernel.config import default_store_location

    if args.json:
        raise ConfigError("chat talks to a person: it has no --json (use run --continue)")
    spec = load_spec(args.workflow)
    human = TerminalChannel() if interactive(False) else None
    live = output.live_output(sys.stdout, sys.stderr)

    async def go() -> None:
        agent = Agent(
            spec,
            **agent_options(options_from_args(args)),
            store=args.store or default_store_location(),
            on_event=live,
            human=human,
            otel=getattr(args, "otel", None),
        )
        async with agent:
            previous: str | None = None
            if args.continue_run:
                assert agent.store is not None
                previous = agent.store.find_run(args.continue_run)
                print(f"(continuing run {previous})", file=sys.stderr)
            while (text := await _next_prompt()) is not None:
                result = await run_cancellable(agent.run(text, continue_from=previous))
                previous = result.run_id
                live.finish()
                _show(result, shown=live.shown(result.response))
            if previous is not None:
                again = f"fsm-kernel chat {shlex.quote(args.workflow)} --continue {previous}"
                print(f"(to go on later: {again})", file=sys.stderr)

    asyncio.run(go())
    return EXIT_OK


async def _next_prompt() -> str | None:
    """The next line to send to the model; None when the chat ends. Chat commands (a line
    starting with !, and /exit, /quit, /bye, /help, /?) are handled here, never sent."""
    while True:
        line = await _read_line("> ")
        if line is None:
            return None
        text = line.strip()
        if text in _QUIT:
            return None
        if text in _HELP:
            print(_HELP_TEXT, file=sys.stderr)
        elif text.startswith("!"):
            print(f"unknown chat command {text.split()[0]} (!help, !exit)", file=sys.stderr)
        elif text:
            return text


async def _read_line(prompt: str) -> str | None:
    """A line from stdin, or None at its end or on Ctrl-C (the chat ends either way).

    Read on the event loop as the terminal makes input available (no thread left blocked in
    a read when the chat ends)."""
    import asyncio
    import signal

    loop = asyncio.get_running_loop()
    interrupted = asyncio.Event()
    try:  # before the prompt shows: a Ctrl-C right after it ends the chat too
        loop.add_signal_handler(signal.SIGINT, interrupted.set)
    except (NotImplementedError, RuntimeError):  # pragma: no cover - non-Unix
        pass
    sys.stderr.write(prompt)
    sys.stderr.flush()
    reading = asyncio.ensure_future(_stdin.line())
    stopping = asyncio.ensure_future(interrupted.wait())
    try:
        await asyncio.wait({reading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        stopping.cancel()
    if not reading.done():  # Ctrl-C
        reading.cancel()
        sys.stderr.write("\n")
        return None
    line = reading.result()
    if line is None:  # Ctrl-D
        sys.stderr.write("\n")
    return line


class _Stdin:
    """Lines of stdin read as they come, what follows a line kept for the next one."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._ended = False

    async def line(self) -> str | None:
        """The next line; None at the end of input.

        Raises:
            ConfigError: a line longer than a prompt may be (MAX_PROMPT_BYTES).
        """
        while b"\n" not in self._buffer and not self._ended:
            if len(self._buffer) > MAX_PROMPT_BYTES:
                raise ConfigError(
                    f"a line of input is longer than {MAX_PROMPT_BYTES // 1024 // 1024} MiB, "
                    "the most a prompt may be"
                )
            chunk = await self._chunk()
            if chunk:
                self._buffer.extend(chunk)
            else:
                self._ended = True
        if not self._buffer:
            return None
        end = self._buffer.find(b"\n")
        end = len(self._buffer) if end < 0 else end + 1
        raw, self._buffer = bytes(self._buffer[:end]), self._buffer[end:]
        return raw.decode("utf-8", "replace")

    async def _chunk(self) -> bytes:
        import asyncio

        fd = sys.stdin.fileno()
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        try:
            loop.add_reader(fd, wake)
        except (OSError, ValueError):  # a regular file: it never blocks
            return os.read(fd, 4096)
        try:
            await ready
        finally:
            loop.remove_reader(fd)
        return os.read(fd, 4096)


_stdin = _Stdin()


def _show(result: Any, *, shown: bool) -> None:
    """A run's answer on stdout (unless `shown`: it streamed there), or why there is none."""
    if result.waiting_for is not None:
        print(f"(waiting for a person: fsm-kernel resume {result.run_id} ...)", flush=True)
    elif result.termination_reason == "cancelled":
        print("(cancelled)", file=sys.stderr, flush=True)
    elif result.response and not shown:
        print(result.response, flush=True)
    if not result.ok and result.error and result.termination_reason != "cancelled":
        print(f"({result.termination_reason}: {result.error})", file=sys.stderr, flush=True)
