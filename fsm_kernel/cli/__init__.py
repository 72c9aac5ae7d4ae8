"""The `fsm-kernel` command: parse, call, print, exit code. The only layer that prints.

Every command exits with one of four codes (EXIT_CODES_HELP, shown in every `--help`):
0 success; 1 the run did not succeed (it ended with another reason, a replay diverged, or
something failed at run time); 2 bad input (a flag, a value, a workflow or config file, an
unknown or ambiguous run id, a run that cannot be resumed as asked); 3 the run waits for a
person.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

from fsm_kernel import __version__
from fsm_kernel.cli.args import check_text_arguments
from fsm_kernel.cli.terminal import safe_stdio
from fsm_kernel.errors import (
    ConfigError,
    FsmKernelError,
    MemoryStoreError,
    ResumeError,
    RunLockedError,
    RunNotFoundError,
    ScheduleError,
    WorkflowError,
)

__all__ = ["EXIT_CODES_HELP", "UsageError", "main"]

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2

EXIT_CODES_HELP = (
    "Exit codes: 0 success; 1 the run did not succeed (it ended with a reason other than "
    "final_answer or done, a replay diverged, or something failed at run time: the model "
    "server, the store, a run another process holds); 2 bad input (an unknown option, a bad "
    "value, an invalid workflow or config file, an unknown or ambiguous run or dispatch id, a "
    "run that cannot be resumed as asked); 3 the run waits for a person (answer it with "
    "'fsm-kernel resume RUN_ID --approve | --reject WHY | --input TEXT') or, in a waiting "
    "state, for an event or its timer (send the event with the signal command)."
)
"""The one table of exit codes: the epilog of every command's --help, and the docs' reference."""

_BAD_INPUT: tuple[type[FsmKernelError], ...] = (
    WorkflowError,
    ConfigError,
    ScheduleError,
    MemoryStoreError,
    RunNotFoundError,
    ResumeError,  # AnswerError included; RunLockedError is caught before, as a failure
)
"""What the user gave is wrong (exit 2): fixing the command line or a file fixes it."""

Handler = Callable[[argparse.Namespace], int]


class UsageError(Exception):
    """argparse refused the command line (the message is argparse's)."""

    def __init__(self, message: str, parser: argparse.ArgumentParser) -> None:
        super().__init__(message)
        self.parser = parser
        self.parsers = [parser]
        """The parser that refused, then each parser above it that passed the error on."""


class _Parser(argparse.ArgumentParser):
    """Every (sub)parser accepts the global flags, so `--debug` and `-v` work before or after
    the command name; errors are raised for main() to report (as JSON too, under --json)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("epilog", EXIT_CODES_HELP)
        super().__init__(*args, **kwargs)
        # SUPPRESS: a flag given before the command is not reset by the subcommand's parser.
        self.add_argument(
            "--debug",
            action="store_true",
            default=argparse.SUPPRESS,
            help="show tracebacks (for bug reports)",
        )
        self.add_argument(
            "-v",
            "--verbose",
            action="store_true",
            default=argparse.SUPPRESS,
            help="debug logs on stderr, each line tagged with the run id",
        )

    def error(self, message: str) -> None:  # type: ignore[override]  # argparse's is NoReturn
        raise UsageError(message, self)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """argparse's, but an option it does not know is named before an argument it misses
        (as git and click do): `fsm-kernel --bogus` says `--bogus` is unrecognised, not that
        COMMAND is required."""
        try:
            return super().parse_known_args(args, namespace)
        except UsageError as exc:
            if not str(exc).startswith(_REQUIRED):
                raise
            if self not in exc.parsers:  # a command's parser refused: the options before it
                exc.parsers.append(self)  # are this one's (`fsm-kernel --bogus run`)
            unknown = _unknown_options(exc.parsers, list(sys.argv[1:] if args is None else args))
            if not unknown:
                raise
            raise UsageError(f"unrecognized arguments: {' '.join(unknown)}", exc.parser) from None


_REQUIRED = "the following arguments are required"
_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


def _unknown_options(parsers: Sequence[argparse.ArgumentParser], args: list[str]) -> list[str]:
    """The arguments that look like options none of `parsers` has (nor abbreviates)."""
    known = {option for parser in parsers for option in parser._option_string_actions}
    long_names = [option for option in known if option.startswith("--")]
    unknown = []
    for arg in args:
        if arg == "--":
            break
        if not arg.startswith("-") or arg == "-" or _NUMBER.match(arg):
            continue
        if arg.startswith("--"):
            name = arg.split("=", 1)[0]
            if not any(option.startswith(name) for option in long_names):
                unknown.append(arg)
        elif arg[:2] not in known:
            unknown.append(arg)
    return unknown


COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("run", "commands", "run a workflow on a prompt"),
    ("chat", "chat_cmd", "talk with an agent in the terminal, each line a run continuing the last"),
    (
        "validate",
        "commands",
        "check workflow files; prints path: ok, or every error as path:line:col: message",
    ),
    (
        "tools",
        "commands",
        "list the built-in tools (or a workflow's, MCP servers' included) with their parameters",
    ),
    ("schema", "commands", "print the workflow file's JSON Schema (for editors)"),
    ("workflows", "commands", "list the stock workflows and when to choose each"),
    ("runs", "runs", "inspect recorded runs (list, show, events, export, coverage)"),
    (
        "resume",
        "runs",
        "continue a run that was killed, lost its model server, or waits for a person",
    ),
    (
        "replay",
        "runs",
        "re-run a recorded run (or every stored run: --all) from its log and compare transitions",
    ),
    ("signal", "signal_cmd", "deliver a named event to a run that waits for one, and continue it"),
    (
        "test",
        "test_cmd",
        "run workflow test files (*.test.yaml) without a model server; --generate one",
    ),
    ("diagram", "diagram_cmd", "draw a workflow (and a run on it) as dot, svg, png or mermaid"),
    (
        "schedule",
        "schedule_cmd",
        "run the persistent agent: cron ticks dispatch the configured agents",
    ),
    ("worker", "schedule_cmd", "an extra worker that only executes queued dispatches"),
    ("dispatches", "schedule_cmd", "recent dispatches of a scheduler config; --cancel stops one"),
    ("ui", "ui_cmd", "browse runs in a web browser: live on their diagrams, with their timelines"),
)
"""Every command, in the order `fsm-kernel --help` lists them: its name, the module under
fsm_kernel.cli whose `register(sub)` adds its arguments (and its description), and its line in
that list. The line is kept here so that the list needs none of the modules (as pip's
commands_dict does)."""


class _Commands(argparse._SubParsersAction):  # type: ignore[type-arg]
    """The COMMAND argument. Each command's parser is made empty, with its line of help; its
    module fills it when the command is chosen (`fill`), so `fsm-kernel --help` and a usage
    error import none of the command modules and build none of their arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._unfilled: dict[str, list[str]] = {}
        """Module name -> the commands it fills, for the modules not imported yet."""

    def add_command(self, name: str, module: str, line: str) -> None:
        self.add_parser(name, help=line)
        self._unfilled.setdefault(module, []).append(name)

    def fill(self, name: str | None = None) -> None:
        """Give the command `name` (every command, without a name) its arguments."""
        modules = [m for m, names in self._unfilled.items() if name is None or name in names]
        for module in modules:
            del self._unfilled[module]
            register = importlib.import_module(f"fsm_kernel.cli.{module}").register
            register(_Filling(self._name_parser_map))

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        self.fill(values[0])
        super().__call__(parser, namespace, values, option_string)


class _Filling:
    """What a command module's `register(sub)` is given by `_Commands.fill`: `add_parser` hands
    back the parser already made for the command, with the module's description set."""

    def __init__(self, parsers: dict[str, argparse.ArgumentParser]) -> None:
        self._parsers = parsers

    def add_parser(self, name: str, *, description: str | None = None) -> argparse.ArgumentParser:
        parser = self._parsers.get(name)
        if parser is None:  # a bug, caught by every test that builds the whole parser
            raise LookupError(f"command {name!r} is missing from fsm_kernel.cli.COMMANDS")
        parser.description = description
        return parser


def build_parser(*, lazy: bool = False) -> argparse.ArgumentParser:
    """The whole parser; with `lazy`, each command's arguments are added when it is chosen
    (main's way: a command's parser is then built exactly as here, just later)."""
    parser = _Parser(
        prog="fsm-kernel",
        description="Run agents whose loop is a finite-state machine written in YAML.",
        epilog="Run 'fsm-kernel COMMAND --help' for a command's options. Model server: "
        "FSM_KERNEL_BASE_URL, FSM_KERNEL_MODEL, FSM_KERNEL_API_KEY (or OPENAI_API_KEY); "
        f"event store: FSM_KERNEL_STORE. {EXIT_CODES_HELP}",
    )
    parser.add_argument("--version", action="version", version=f"fsm-kernel {__version__}")
    sub = cast(
        _Commands,
        parser.add_subparsers(
            dest="command", metavar="COMMAND", parser_class=_Parser, action=_Commands
        ),
    )
    sub.required = True
    for name, module, line in COMMANDS:
        sub.add_command(name, module, line)
    if not lazy:
        sub.fill()
    return parser


@contextmanager
def configure_logging(verbose: bool) -> Iterator[None]:
    """Log lines on stderr, each with the id of the run it belongs to; the previous logging
    setup is restored afterwards (main() also runs in-process, from tests and scripts).
    logging is imported here, not at the top: `fsm-kernel --help` never logs."""
    import logging

    class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
        """Writes to whatever sys.stderr is at the time (tests swap it)."""

        @property
        def stream(self) -> Any:
            return sys.stderr

        @stream.setter
        def stream(self, _value: Any) -> None:
            pass

    class _RunIdFilter(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            # Imported at the first line logged: commands that run nothing (validate) never
            # load the kernel for it.
            from fsm_kernel.kernel import current_run_id

            record.run_id = current_run_id.get()
            return True

    handler = _StderrHandler()
    handler.addFilter(_RunIdFilter())
    fmt = (
        "%(asctime)s %(levelname)-5s [%(run_id)s] %(name)s: %(message)s"
        if verbose
        else "%(levelname)s [%(run_id)s]: %(message)s"
    )
    handler.setFormatter(logging.Formatter(fmt))
    root = logging.getLogger("fsm_kernel")
    saved = (root.handlers[:], root.level, root.propagate)
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.WARNING)
    root.propagate = False
    # The OpenTelemetry SDK logs each retry of an export; fsm_kernel.telemetry says once what
    # was not exported. Its errors still show; everything with --verbose.
    otel = logging.getLogger("opentelemetry")
    otel_level = otel.level
    otel.setLevel(logging.NOTSET if verbose else logging.ERROR)
    try:
        yield
    finally:
        root.handlers[:], root.level, root.propagate = saved
        otel.setLevel(otel_level)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code.

    Everything printed goes through the terminal's SafeStream (secrets redacted, control
    characters escaped). Under --json, every failure still prints one JSON object on stdout.
    """
    arguments = list(sys.argv[1:] if argv is None else argv)
    with safe_stdio():
        try:
            args = build_parser(lazy=True).parse_args(arguments)
            check_text_arguments(args)
        except UsageError as exc:
            hint = f" (see '{exc.parser.prog} --help')"
            return _fail(f"{exc}{hint}", EXIT_USAGE, as_json="--json" in arguments)
        except ConfigError as exc:
            return _fail(f"{exc}", EXIT_USAGE, as_json="--json" in arguments)
        args.debug = getattr(args, "debug", False)
        args.verbose = getattr(args, "verbose", False)
        with configure_logging(args.verbose):
            return _call(args)


def _fail(message: str, code: int, *, as_json: bool) -> int:
    """Report a failure on one line of stderr, and as one JSON object on stdout under --json."""
    message = " ".join(message.split())  # a driver's multi-line message stays one line
    print(f"error: {message}", file=sys.stderr)
    if as_json:
        print(json.dumps({"error": message, "exit_code": code}, ensure_ascii=False))
    return code


def _call(args: argparse.Namespace) -> int:
    handler: Handler = args.handler
    as_json = bool(getattr(args, "json", False))
    try:
        return handler(args)
    except KeyboardInterrupt:
        return _fail("interrupted", EXIT_FAIL, as_json=as_json)
    except BrokenPipeError:
        return EXIT_FAIL
    except Exception as exc:
        if args.debug:
            raise
        message, code = _failure(exc)
        return _fail(message, code, as_json=as_json)


def _failure(exc: Exception) -> tuple[str, int]:
    """The one line and the exit code of a command that raised (called while handling it)."""
    if isinstance(exc, RunLockedError):  # the request is right; another process has the run
        return str(exc), EXIT_FAIL
    if isinstance(exc, _BAD_INPUT):
        return str(exc), EXIT_USAGE
    if isinstance(exc, FsmKernelError):
        return str(exc), EXIT_FAIL
    # a bug: one line, not a traceback, unless --debug
    import logging

    logging.getLogger(__name__).debug("internal error", exc_info=True)
    return (
        f"internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)",
        EXIT_FAIL,
    )


def entry() -> None:  # pragma: no cover - thin wrapper used by `python -m fsm_kernel`
    sys.exit(main())
