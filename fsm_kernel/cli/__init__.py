"""The `fsm-kernel` command: parse, call, print, exit code. The only layer that prints.

Exit codes: 0 the run ended with final_answer or done (or the command succeeded); 1 any other
termination reason or a runtime failure; 2 bad usage or an invalid workflow/config file.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from fsm_kernel import __version__
from fsm_kernel.cli.args import check_text_arguments
from fsm_kernel.cli.terminal import safe_stdio
from fsm_kernel.errors import (
    AnswerError,
    ConfigError,
    FsmKernelError,
    MemoryStoreError,
    ScheduleError,
    WorkflowError,
)

__all__ = ["UsageError", "main"]

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2

Handler = Callable[[argparse.Namespace], int]


class UsageError(Exception):
    """argparse refused the command line (the message is argparse's)."""

    def __init__(self, message: str, parser: argparse.ArgumentParser) -> None:
        super().__init__(message)
        self.parser = parser


class _Parser(argparse.ArgumentParser):
    """Every (sub)parser accepts the global flags, so `--debug` and `-v` work before or after
    the command name; errors are raised for main() to report (as JSON too, under --json)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
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


def build_parser() -> argparse.ArgumentParser:
    from fsm_kernel.cli import commands

    parser = _Parser(
        prog="fsm-kernel",
        description="Run agents whose loop is a finite-state machine written in YAML.",
        epilog="Run 'fsm-kernel COMMAND --help' for a command's options. Model server: "
        "FSM_KERNEL_BASE_URL, FSM_KERNEL_MODEL, FSM_KERNEL_API_KEY (or OPENAI_API_KEY); "
        "event store: FSM_KERNEL_STORE.",
    )
    parser.add_argument("--version", action="version", version=f"fsm-kernel {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    commands.register(sub)
    return parser


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever sys.stderr is at the time (tests swap it)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


@contextmanager
def configure_logging(verbose: bool) -> Iterator[None]:
    """Log lines on stderr, each with the id of the run it belongs to; the previous logging
    setup is restored afterwards (main() also runs in-process, from tests and scripts)."""
    from fsm_kernel.kernel import current_run_id

    class _RunIdFilter(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
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
            args = build_parser().parse_args(arguments)
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
    except (WorkflowError, ConfigError, ScheduleError, MemoryStoreError, AnswerError) as exc:
        if args.debug:
            raise
        return _fail(str(exc), EXIT_USAGE, as_json=as_json)
    except FsmKernelError as exc:
        if args.debug:
            raise
        return _fail(str(exc), EXIT_FAIL, as_json=as_json)
    except KeyboardInterrupt:
        return _fail("interrupted", EXIT_FAIL, as_json=as_json)
    except BrokenPipeError:
        return EXIT_FAIL
    except Exception as exc:  # a bug: one line, not a traceback, unless --debug
        if args.debug:
            raise
        logging.getLogger(__name__).debug("internal error", exc_info=True)
        return _fail(
            f"internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)",
            EXIT_FAIL,
            as_json=as_json,
        )


def entry() -> None:  # pragma: no cover - thin wrapper used by `python -m fsm_kernel`
    sys.exit(main())
