"""Validate one value against a JSON Schema under a deadline, in a process of its own: run as a
script by `fsm_kernel.workflow.output` for schemas with `pattern`s (a pattern is the workflow
author's, the text it is matched against the model's, and Python's `re` can backtrack for
hours on a short string). A timer signal interrupts the match (`re` checks for signals while it
runs), and the parent kills the process if even that does not come back in time.

Reads one JSON object on stdin: `validator` (a jsonschema validator class name), `schema`,
`data`, `seconds`. Writes one JSON object on stdout: `{"errors": [[path, message], ...]}`, or
`{"stopped": "timeout" | "depth"}`. Imports nothing of fsm_kernel, so it starts quickly.
"""

from __future__ import annotations

import json
import signal
import sys
from typing import Any

import jsonschema.validators


class _Deadline(Exception):
    """The timer fired: the check took longer than it may."""


def _expire(_signum: int, _frame: Any) -> None:
    raise _Deadline


def check(request: dict[str, Any]) -> dict[str, Any]:
    """The errors of `request["data"]` against `request["schema"]`, each as (path, message)."""
    cls = getattr(jsonschema.validators, str(request["validator"]))
    validator = cls(request["schema"])
    signal.signal(signal.SIGALRM, _expire)
    signal.setitimer(signal.ITIMER_REAL, float(request["seconds"]))
    try:
        found = [(list(e.absolute_path), e.message) for e in validator.iter_errors(request["data"])]
    except _Deadline:
        return {"stopped": "timeout"}
    except RecursionError:
        return {"stopped": "depth"}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return {"errors": found}


def main() -> None:
    request = json.loads(sys.stdin.read())
    json.dump(check(request), sys.stdout)


if __name__ == "__main__":
    main()
