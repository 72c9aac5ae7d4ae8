"""`fsm-kernel diagram`: draw a workflow, optionally with one recorded run on top, as DOT, SVG,
PNG or Mermaid; `--all` renders a folder of workflows (how diagrams/ is kept in sync).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsm_kernel.errors import ConfigError
from fsm_kernel.redact import redact

if TYPE_CHECKING:
    from fsm_kernel.diagram import RunOverlay
    from fsm_kernel.workflow.spec import WorkflowSpec

__all__ = ["FORMATS", "cmd_diagram", "format_for", "register"]

EXIT_OK = 0

FORMATS: tuple[str, ...] = ("dot", "svg", "png", "mermaid")

_SUFFIXES = {
    ".dot": "dot",
    ".gv": "dot",
    ".svg": "svg",
    ".png": "png",
    ".mmd": "mermaid",
    ".mermaid": "mermaid",
}


def register(sub: Any) -> None:
    """Add the `diagram` subcommand."""
    p = sub.add_parser(
        "diagram",
        description="Draw WORKFLOW (a file or a stock name): states with their actions, guards "
        "and termination reasons on the edges. --run draws a recorded run on top: visit counts, "
        "the path taken and where it ended. dot and mermaid text need nothing; svg and png need "
        "the 'dot' program (Graphviz).",
    )
    p.add_argument(
        "workflow",
        nargs="?",
        metavar="WORKFLOW",
        help="workflow file or stock name (default with --run: the run's workflow)",
    )
    p.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        help="write here (with --all: the output folder); default: stdout",
    )
    p.add_argument(
        "--format",
        choices=FORMATS,
        help="default: from the -o suffix (.dot .svg .png .mmd), else dot",
    )
    p.add_argument("--run", metavar="RUN_ID", help="overlay a recorded run (an id or a prefix)")
    p.add_argument(
        "--expand",
        action="store_true",
        help="draw each workflow a workflow.call or workflow.map state runs inside it, as a "
        "cluster (dot, svg and png)",
    )
    p.add_argument(
        "--store",
        metavar="LOCATION",
        help="event store for --run (default FSM_KERNEL_STORE or .fsm-kernel/runs.db)",
    )
    p.add_argument(
        "--all",
        metavar="DIR",
        dest="all_dir",
        help="render every DIR/*.yaml to OUTDIR/<name>.dot and .svg (-o OUTDIR)",
    )
    p.set_defaults(handler=cmd_diagram)


def format_for(fmt: str | None, output: str | None) -> str:
    """The output format: --format, else the -o suffix, else dot."""
    if fmt is not None:
        return fmt
    if output is None:
        return "dot"
    suffix = Path(output).suffix.lower()
    if suffix not in _SUFFIXES:
        known = " ".join(sorted(_SUFFIXES))
        raise ConfigError(
            f"cannot tell the format of {output!r} (suffixes: {known}); give --format"
        )
    return _SUFFIXES[suffix]


def cmd_diagram(args: argparse.Namespace) -> int:
    if args.all_dir is not None:
        return _render_folder(args)
    fmt = format_for(args.format, args.output)
    overlay = _load_overlay(args.run, args.store) if args.run else None
    spec = _load_spec(args.workflow, overlay)
    if overlay is not None:
        _warn_mismatch(spec, overlay)
    if args.expand and fmt == "mermaid":
        raise ConfigError("--expand draws dot, svg or png, not mermaid")
    return _emit(spec, overlay, fmt, args.output, expand=args.expand)


def _emit(
    spec: WorkflowSpec,
    overlay: RunOverlay | None,
    fmt: str,
    output: str | None,
    *,
    expand: bool = False,
) -> int:
    from fsm_kernel.diagram import RENDER_FORMATS, render, to_dot, to_mermaid

    if fmt == "mermaid":
        text = to_mermaid(spec, overlay=overlay)
    else:
        text = to_dot(spec, overlay=overlay, expand=expand)
    text = redact(text)  # a run's error text is drawn on the diagram
    if output is None:
        if fmt in RENDER_FORMATS:
            raise ConfigError(f"{fmt} is a binary format: give -o FILE.{fmt}")
        sys.stdout.write(text)
        return EXIT_OK
    out = Path(output)
    if fmt in RENDER_FORMATS:
        render(text, fmt, out)
    else:
        _write_text(out, text)
    print(out)
    return EXIT_OK


def _load_spec(workflow: str | None, overlay: RunOverlay | None) -> WorkflowSpec:
    from fsm_kernel.bootstrap import load_spec

    if workflow is None:
        workflow = _workflow_of_run(overlay)
    return load_spec(workflow)  # its own modules import as under `run`


def _workflow_of_run(overlay: RunOverlay | None) -> str:
    """The workflow file (or stock name) a run recorded, for `diagram --run ID` alone."""
    if overlay is None:
        raise ConfigError("give a WORKFLOW (or --run RUN_ID, or --all DIR -o OUTDIR)")
    if overlay.workflow_path and Path(overlay.workflow_path).is_file():
        return overlay.workflow_path
    if overlay.workflow:
        return overlay.workflow
    raise ConfigError(f"run {overlay.run_id} recorded no workflow: give WORKFLOW")


def _load_overlay(run_id: str, location: str | None) -> RunOverlay:
    from fsm_kernel.config import default_store_location
    from fsm_kernel.diagram import RunOverlay
    from fsm_kernel.store import open_store

    store = open_store(location or default_store_location())
    try:
        events = store.read(store.find_run(run_id))
    finally:
        store.close()
    return RunOverlay.from_events(events)


def _warn_mismatch(spec: WorkflowSpec, overlay: RunOverlay) -> None:
    from fsm_kernel.diagram import overlay_problems

    for problem in overlay_problems(spec, overlay):
        print(f"warning: {problem}", file=sys.stderr)


def _render_folder(args: argparse.Namespace) -> int:
    """`--all DIR -o OUTDIR`: OUTDIR/<name>.dot for every DIR/<name>.yaml, and .svg if possible."""
    import shutil

    from fsm_kernel.diagram import DOT_MISSING, render, to_dot

    _check_folder_args(args)
    specs = _load_folder(Path(args.all_dir))  # all of them first: a broken file writes nothing
    outdir = Path(args.output)
    has_dot = shutil.which("dot") is not None
    if not has_dot:
        print(f"warning: writing .dot only; {DOT_MISSING}", file=sys.stderr)
    for name, spec in specs:
        source = to_dot(spec)
        _write_text(outdir / f"{name}.dot", source)
        print(outdir / f"{name}.dot")
        if has_dot:
            print(render(source, "svg", outdir / f"{name}.svg"))
    return EXIT_OK


def _check_folder_args(args: argparse.Namespace) -> None:
    if args.output is None:
        raise ConfigError("--all DIR needs -o OUTDIR")
    if args.workflow is not None or args.run is not None:
        raise ConfigError("--all DIR draws every workflow in DIR: drop WORKFLOW and --run")
    if args.format is not None:
        raise ConfigError("--all writes .dot and .svg files: drop --format")


def _load_folder(folder: Path) -> list[tuple[str, WorkflowSpec]]:
    from fsm_kernel.bootstrap import load_spec

    if not folder.is_dir():
        raise ConfigError(f"{folder}: not a folder")
    paths = sorted(folder.glob("*.yaml"))
    if not paths:
        raise ConfigError(f"{folder}: no *.yaml workflow files")
    return [(path.stem, load_spec(str(path))) for path in paths]


def _write_text(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror or exc}") from exc
