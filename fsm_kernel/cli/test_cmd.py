"""`fsm-kernel test`: run workflow test files (`*.test.yaml`) with no model server and no
network; `--coverage` says what they covered; `--generate WORKFLOW` writes a test file whose
cases reach every declared edge."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from fsm_kernel.cli.explore_cmd import add_explore_args, run_explore
from fsm_kernel.errors import ConfigError, WorkflowError

__all__ = ["cmd_test", "register"]

EXIT_OK, EXIT_FAIL, EXIT_BROKEN = 0, 1, 2


def register(sub: Any) -> None:
    """Add the `test` subcommand."""
    p = sub.add_parser(
        "test",
        description="Run every case of the given test files (folders: every *.test.yaml "
        "under them) through the real kernel with the model replies, tool results, answers, "
        "events and child outcomes each case scripts: no model server, no network. Exit 0 "
        "when every case passes, 1 when one fails (its first difference is named), 2 for a "
        "file that is not a valid test file (file:line:col). --generate WORKFLOW writes a "
        "test file reaching every declared edge instead; --explore WORKFLOW checks it on "
        "random runs.",
    )
    p.add_argument("paths", nargs="*", metavar="PATH", help="test files or folders")
    p.add_argument("-k", dest="only", metavar="NAME", action="append",
                   help="run only the case of this name (repeatable)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON document of the results")
    p.add_argument("--junit-xml", metavar="FILE", help="also write the results as JUnit XML")
    p.add_argument(
        "--coverage",
        action="store_true",
        help="report per workflow: states, declared edges, guarded edges seen both true and "
        "false, termination reasons reached",
    )
    p.add_argument(
        "--coverage-min",
        type=float,
        metavar="PERCENT",
        help="exit 1 when a workflow's declared edges are covered below PERCENT (implies "
        "--coverage)",
    )
    p.add_argument(
        "--generate",
        metavar="WORKFLOW",
        help="write a test file whose cases reach every declared edge of WORKFLOW (a path or "
        "a stock name) with the shortest scripts found by running it; edges none reaches are "
        "listed (exit 1)",
    )
    p.add_argument(
        "-o", "--output", metavar="FILE", help="with --generate: the file to write (else stdout)"
    )
    add_explore_args(p)
    p.set_defaults(handler=cmd_test)


def cmd_test(args: argparse.Namespace) -> int:
    if args.generate and args.explore:
        raise ConfigError("give --generate or --explore, not both")
    if args.generate:
        return _generate(args)
    if args.explore:
        return run_explore(args)
    if not args.paths:
        raise ConfigError(
            "give test files or folders to run, or --generate WORKFLOW, or --explore WORKFLOW"
        )
    files = list(_test_files(args.paths))
    return _run(args, files)


def _test_files(paths: Sequence[str]) -> Iterable[Path]:
    for given in paths:
        path = Path(given)
        if path.is_dir():
            found = sorted(path.rglob("*.test.yaml"))
            if not found:
                raise ConfigError(f"{path}: no *.test.yaml files under it")
            yield from found
        elif path.is_file():
            yield path
        else:
            raise ConfigError(f"{path}: no such file or folder")


def _run(args: argparse.Namespace, files: list[Path]) -> int:
    from fsm_kernel.testing._casecov import CaseCoverage
    from fsm_kernel.testing._casefile import load_test_file
    from fsm_kernel.testing._cases import CaseResult, run_test_file
    from fsm_kernel.testing._harness import WorkflowHarness

    started = time.perf_counter()
    results: list[CaseResult] = []
    broken: list[str] = []
    coverage: dict[str, CaseCoverage] = {}
    for path in files:
        try:
            loaded = load_test_file(path)
            harness = WorkflowHarness(loaded.workflow)
        except WorkflowError as exc:
            broken.extend(str(e) for e in exc.errors)
            continue
        ran = run_test_file(loaded, harness, only=args.only)
        results.extend(ran)
        cov = coverage.setdefault(harness.spec.path, CaseCoverage(harness.spec))
        for r in ran:
            if r.run is not None:
                cov.add(r.run)
    seconds = time.perf_counter() - started
    below = _below(coverage, args.coverage_min)
    _report(args, results, broken, coverage, below, seconds)
    if args.junit_xml:
        _write_junit(Path(args.junit_xml), results, broken)
    if broken or any(r.broken for r in results):
        return EXIT_BROKEN
    return EXIT_FAIL if below or not all(r.passed for r in results) else EXIT_OK


def _below(coverage: dict[str, Any], minimum: float | None) -> list[str]:
    if minimum is None:
        return []
    return [path for path, cov in coverage.items() if cov.edge_percent < minimum]


def _report(
    args: argparse.Namespace,
    results: list[Any],
    broken: list[str],
    coverage: dict[str, Any],
    below: list[str],
    seconds: float,
) -> None:
    wants_coverage = args.coverage or args.coverage_min is not None
    if args.json:
        doc: dict[str, Any] = {
            "ok": not broken and not below and all(r.passed for r in results),
            "passed": sum(r.passed for r in results),
            "failed": sum(not r.passed and not r.broken for r in results),
            "broken": len(broken) + sum(r.broken for r in results),
            "errors": broken,
            "cases": [r.to_dict() for r in results],
        }
        if wants_coverage:
            doc["coverage"] = [cov.to_dict() for cov in coverage.values()]
            doc["coverage_below_min"] = below
        print(json.dumps(doc, ensure_ascii=False))
        return
    for line in broken:
        print(f"error: {line}", file=sys.stderr)
    for r in results:
        if r.passed:
            print(f"PASS {r.file}::{r.name}")
        else:
            word = "BROKEN" if r.broken else "FAIL"
            print(f"{word} {r.location}: {r.name}: {r.difference}")
    if wants_coverage:
        for cov in coverage.values():
            for line in cov.lines():
                print(line)
    for path in below:
        print(f"coverage of {path}: edges below --coverage-min {args.coverage_min:g}%")
    passed = sum(r.passed for r in results)
    failed = len(results) - passed
    plural = "s" if len(broken) != 1 else ""
    errors = f", {len(broken)} error{plural} in test files" if broken else ""
    print(f"{passed} passed, {failed} failed{errors} in {seconds:.2f} s")


def _write_junit(path: Path, results: list[Any], broken: list[str]) -> None:
    """JUnit XML: one testsuite per test file, one testcase per case."""
    from xml.etree import ElementTree

    root = ElementTree.Element("testsuites", name="fsm-kernel test")
    suites: dict[str, ElementTree.Element] = {}
    for r in results:
        suite = suites.get(r.file)
        if suite is None:
            suite = suites[r.file] = ElementTree.SubElement(root, "testsuite", name=r.file)
        case = ElementTree.SubElement(
            suite, "testcase", classname=r.file, name=r.name, time=f"{r.seconds:.4f}"
        )
        if not r.passed:
            kind = "error" if r.broken else "failure"
            ElementTree.SubElement(case, kind, message=r.difference or "").text = r.location
    for line in broken:
        suite = ElementTree.SubElement(root, "testsuite", name="broken test files")
        case = ElementTree.SubElement(suite, "testcase", name=line.split(": ", 1)[0])
        ElementTree.SubElement(case, "error", message=line)
    for suite in root:
        cases = list(suite)
        suite.set("tests", str(len(cases)))
        suite.set("failures", str(sum(1 for c in cases if c.find("failure") is not None)))
        suite.set("errors", str(sum(1 for c in cases if c.find("error") is not None)))
    path.parent.mkdir(parents=True, exist_ok=True)
    ElementTree.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def _generate(args: argparse.Namespace) -> int:
    from fsm_kernel.bootstrap import resolve_workflow
    from fsm_kernel.testing._generate import generate_cases
    from fsm_kernel.testing._harness import WorkflowHarness

    harness = WorkflowHarness(args.generate)
    ref = args.generate
    if args.output and Path(args.generate).is_file():  # a path, as the test file will see it
        target = Path(resolve_workflow(args.generate)).resolve()
        out_dir = Path(args.output).resolve().parent
        ref = _relative(target, out_dir)
    suite = generate_cases(harness, workflow_ref=ref)
    text = suite.to_yaml()
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text, encoding="utf-8")
        print(f"wrote {args.output}: {len(suite.cases)} cases", file=sys.stderr)
    else:
        sys.stdout.write(text)
    for edge in suite.unreached:
        print(f"not reached: {edge}", file=sys.stderr)
    return EXIT_FAIL if suite.unreached else EXIT_OK


def _relative(target: Path, folder: Path) -> str:
    try:
        return str(target.relative_to(folder))
    except ValueError:
        import os

        return os.path.relpath(target, folder)
