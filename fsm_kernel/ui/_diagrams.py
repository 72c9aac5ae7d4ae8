"""Workflows as the viewer shows them: found by path or stock name, read as data (never
imported: the viewer runs no code from workflow files), drawn with the real `dot` and made
clickable (each state and edge of the SVG tagged with what it is).
"""

from __future__ import annotations

import hashlib
import html
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fsm_kernel.config import package_data_dir
from fsm_kernel.diagram import RunOverlay, overlay_problems, render_svg, to_dot
from fsm_kernel.errors import ConfigError, WorkflowError
from fsm_kernel.redact import redact
from fsm_kernel.workflow.loader import load_workflow, load_workflow_text
from fsm_kernel.workflow.spec import WorkflowSpec

__all__ = ["Diagram", "DiagramRenderer", "LoadedWorkflow", "load_recorded", "load_stock"]

_WORKFLOW_SUFFIXES = (".yaml", ".yml")
_MAX_SOURCE_BYTES = 1024 * 1024


@dataclass(frozen=True)
class LoadedWorkflow:
    """A workflow file read for display: its spec (None when it does not load), its text."""

    path: str
    source: str
    spec: WorkflowSpec | None
    error: str | None = None


@dataclass(frozen=True)
class Diagram:
    """An SVG ready to embed, or why there is none; and what does not fit the run."""

    svg: str | None
    error: str | None = None
    problems: tuple[str, ...] = ()
    workflow_path: str | None = None


def load_stock(name: str) -> LoadedWorkflow | None:
    """A stock workflow by name; None when there is no such stock workflow."""
    folder = package_data_dir("workflows")
    if folder is None or not (folder / f"{name}.yaml").is_file() or "/" in name:
        return None
    return _read(folder / f"{name}.yaml")


def load_recorded(
    path: str | None,
    name: str | None,
    content_hash: str | None,
    roots: Sequence[Path] = (),
) -> LoadedWorkflow | None:
    """The workflow a run recorded, only as the run used it: the file its `workflow_path`
    names, when that file lies under one of `roots` (the folders the viewer serves) and its
    text still has the sha256 the run recorded (`workflow_hash`); else the stock workflow of
    its name, under the same condition. None when neither is there as the run used it: a
    store is data, and a path in it must not make the viewer show any file it names."""
    if not content_hash:
        return None
    if path:
        recorded = _recorded_file(Path(path), content_hash, roots)
        if recorded is not None:
            return recorded
    stock = load_stock(name) if name else None
    if stock is not None and stock.spec is not None and stock.spec.content_hash == content_hash:
        return stock
    return None


def load_recorded_text(text: str, path: str | None) -> LoadedWorkflow:
    """The workflow text a run recorded (the definition it is pinned to, from the store), read
    for display as if at its recorded path: no code imported, no called workflow opened."""
    where = path or "<recorded>"
    source = redact(text[:_MAX_SOURCE_BYTES])
    try:
        spec = load_workflow_text(text, path=where, import_code=False, calls=False)
    except WorkflowError as exc:
        return LoadedWorkflow(where, source, None, redact(str(exc)))
    return LoadedWorkflow(where, source, spec)


def under_roots(path: Path, roots: Sequence[Path]) -> bool:
    """Whether `path` is a file under one of the folders the viewer serves."""
    try:
        real = path.resolve(strict=True)
        return real.is_file() and any(real.is_relative_to(r.resolve()) for r in roots)
    except (OSError, RuntimeError):  # missing, unreadable, a symlink loop
        return False


def _recorded_file(path: Path, content_hash: str, roots: Sequence[Path]) -> LoadedWorkflow | None:
    """The workflow file at `path` if it is under a root and has the recorded hash."""
    if path.suffix.lower() not in _WORKFLOW_SUFFIXES:
        return None
    try:
        real = path.resolve(strict=True)
        if not real.is_file() or not any(real.is_relative_to(r.resolve()) for r in roots):
            return None
        with real.open("rb") as f:
            raw = f.read(_MAX_SOURCE_BYTES + 1)
    except (OSError, RuntimeError):  # missing, unreadable, a symlink loop
        return None
    if hashlib.sha256(raw).hexdigest() != content_hash:
        return None  # changed since the run, or not the file the run used
    loaded = _read(real)  # read again: shown only if it is still that text
    spec = loaded.spec
    return loaded if spec is not None and spec.content_hash == content_hash else None


def _read(path: Path) -> LoadedWorkflow:
    try:
        with path.open("rb") as f:
            raw = f.read(_MAX_SOURCE_BYTES + 1)
    except OSError as exc:
        return LoadedWorkflow(str(path), "", None, f"cannot read {path}: {exc.strerror or exc}")
    source = redact(raw[:_MAX_SOURCE_BYTES].decode("utf-8", "replace"))
    try:
        spec = load_workflow(path, import_code=False)
    except WorkflowError as exc:
        return LoadedWorkflow(str(path), source, None, redact(str(exc)))
    return LoadedWorkflow(str(path), source, spec)


_NODE = re.compile(r'<g id="(node\d+)" class="node">\s*<title>([^<]*)</title>')
_EDGE = re.compile(r'<g id="(edge\d+)" class="edge">\s*<title>([^<]*)</title>')
_UNSAFE = re.compile(
    r"<(?:script|foreignObject|iframe|use)\b|<[^>]*\s(?:on[a-z]+|(?:xlink:)?href|style)\s*=",
    re.IGNORECASE,
)
"""What dot never writes for our DOT: an active element, or an event handler, link or style
attribute in a tag (text between tags has its `<` escaped, so it cannot match)."""


@dataclass
class DiagramRenderer:
    """Draws specs (with run overlays) as SVG through `dot`, remembering the last drawings:
    a live run's page asks again every time its log grows, and most of the time its diagram
    has not changed."""

    size: int = 128
    _cache: OrderedDict[str, str] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def draw(
        self,
        spec: WorkflowSpec,
        overlay: RunOverlay | None = None,
        *,
        current: str | None = None,
    ) -> Diagram:
        """The diagram, `current` (a live run's state) highlighted."""
        problems = tuple(overlay_problems(spec, overlay)) if overlay is not None else ()
        try:
            svg = self._svg(redact(to_dot(spec, overlay=overlay, legend=False)))
        except ConfigError as exc:
            return Diagram(None, str(exc), problems, spec.path)
        ended = None
        if overlay is not None and overlay.reason is not None:
            ended = overlay.last_state
        return Diagram(tag_svg(svg, spec, current=current, ended=ended), None, problems, spec.path)

    def _svg(self, dot: str) -> str:
        key = hashlib.sha256(dot.encode()).hexdigest()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        svg = render_svg(dot)
        with self._lock:
            self._cache[key] = svg
            while len(self._cache) > self.size:
                self._cache.popitem(last=False)
        return svg


def tag_svg(svg: str, spec: WorkflowSpec, *, current: str | None, ended: str | None) -> str:
    """dot's SVG made ready to embed: the XML prolog and comments dropped, each state's group
    tagged `data-state`, each edge's `data-edge="source->target"`, the current and the final
    state classed; refused (ConfigError's text instead) if it holds anything active."""
    body = svg[svg.find("<svg") :] if "<svg" in svg else ""
    body = re.sub(r"<!--.*?-->", "", body, flags=re.DOTALL)
    if not body or _UNSAFE.search(body):
        return '<p class="error">the diagram could not be shown safely</p>'

    def node(match: re.Match[str]) -> str:
        state = html.unescape(match.group(2))
        if state not in spec.states:
            return match.group(0)
        classes = "node state"
        classes += " current" if state == current else ""
        classes += " ended" if state == ended else ""
        attr = html.escape(state, quote=True)
        return (
            f'<g id="{match.group(1)}" class="{classes}" data-state="{attr}">'
            + (match.group(0)[match.group(0).find("<title>") :])
        )

    def edge(match: re.Match[str]) -> str:
        source, _, target = html.unescape(match.group(2)).partition("->")
        if source not in spec.states or target not in spec.states:
            return match.group(0)
        attr = html.escape(f"{source}->{target}", quote=True)
        return (
            f'<g id="{match.group(1)}" class="edge" data-edge="{attr}">'
            + (match.group(0)[match.group(0).find("<title>") :])
        )

    body = _NODE.sub(node, body)
    return _EDGE.sub(edge, body)
