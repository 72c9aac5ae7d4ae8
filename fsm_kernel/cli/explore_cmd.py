"""Exploring a workflow from the command line: `fsm-kernel test --explore WORKFLOW [--examples
N] [--seed S]` runs it on random model replies, tool results and answers (fsm_kernel.testing's
explorer, built on Hypothesis) and prints the shrunk counterexample of the first run that
breaks an invariant.

`add_explore_args` adds the flags to a parser and `run_explore` carries them out, so the
`test` command (or any other) can offer them.
"""

from __future__ import annotations

import argparse
import json
import sys

from fsm_kernel.errors import ConfigError

__all__ = ["add_explore_args", "run_explore"]

EXIT_OK, EXIT_FAIL = 0, 1

EXPLORE_HELP = (
    "run WORKFLOW (a file or a stock name) on random model replies, tool results and a "
    "person's answers, and check every run: it ends with exactly one reason within its limits, "
    "nothing raises, and its replay is identical; a run that breaks one is shrunk to a small "
    "one and printed (exit 1). Needs Hypothesis (pip install 'fsm-kernel[test]')."
)


def add_explore_args(parser: argparse.ArgumentParser) -> None:
    """Add `--explore WORKFLOW`, `--examples N` and `--seed S` to `parser`."""
    parser.add_argument("--explore", metavar="WORKFLOW", help=EXPLORE_HELP)
    parser.add_argument(
        "--examples",
        type=_positive,
        metavar="N",
        help="with --explore: how many runs to try (default 100); a failing one is then shrunk",
    )
    parser.add_argument(
        "--seed",
        type=int,
        metavar="S",
        help="with --explore: draw the runs from this seed (default: the same runs every time)",
    )


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def run_explore(args: argparse.Namespace) -> int:
    """Explore `args.explore`; print the summary (and the counterexample); 0 when every run
    kept the invariants, 1 when one did not. Without Hypothesis, ConfigError (exit 2)."""
    try:
        import hypothesis  # noqa: F401  # the explorer is built on it
    except ImportError:
        raise ConfigError(
            "--explore needs Hypothesis, which is not installed: pip install 'fsm-kernel[test]' "
            "(or pip install hypothesis)"
        ) from None
    from fsm_kernel.testing._explore import DEFAULT_EXAMPLES, explore

    examples = args.examples or DEFAULT_EXAMPLES
    report = explore(args.explore, examples=examples, seed=args.seed)
    if getattr(args, "json", False):
        print(json.dumps(report.to_dict(), ensure_ascii=False, indent=2))
    else:
        for note in report.notes:
            print(f"note: {note}", file=sys.stderr)
        if report.counterexample is not None:
            print(report.counterexample)
        print(report.summary())
    return EXIT_OK if report.passed else EXIT_FAIL
