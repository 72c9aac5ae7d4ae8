"""The `fsm-kernel` command: parse, call, print, exit code. The only layer that prints.

Exit codes: 0 the run ended with final_answer or done (or the command succeeded); 1 any other
termination reason or a runtime failure; 2 bad usage or an invalid workflow/config file.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from fsm_kernel import __version__
from fsm_kernel.errors import (
    ConfigError,
    FsmKernelError,
    MemoryStoreError,
    ScheduleError,
    WorkflowError,
)

__all__ = ["main"]

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2

Handler = Callable[[argparse.Namespace], int]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]  # argparse's is NoReturn
        self.print_usage(sys.stderr)
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


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
    parser.add_argument("--debug", action="store_true", help="show tracebacks (for bug reports)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    commands.register(sub)
    return parser


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever sys.stderr is at the time (tests swap it)."""

    @property  # type: ignore[override]
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
    try:
        yield
    finally:
        root.handlers[:], root.level, root.propagate = saved


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    with configure_logging(getattr(args, "verbose", False)):
        return _call(args)


def _call(args: argparse.Namespace) -> int:
    handler: Handler = args.handler
    try:
        return handler(args)
    except (WorkflowError, ConfigError, ScheduleError, MemoryStoreError) as exc:
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except FsmKernelError as exc:
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAIL
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return EXIT_FAIL
    except BrokenPipeError:
        return EXIT_FAIL
    except Exception as exc:  # a bug: one line, not a traceback, unless --debug
        if args.debug:
            raise
        logging.getLogger(__name__).debug("internal error", exc_info=True)
        print(
            f"error: internal error: {type(exc).__name__}: {exc} (rerun with --debug for "
            "the traceback)",
            file=sys.stderr,
        )
        return EXIT_FAIL


def entry() -> None:  # pragma: no cover - thin wrapper used by `python -m fsm_kernel`
    sys.exit(main())
