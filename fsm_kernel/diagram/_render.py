"""Rendering: DOT text to an SVG or PNG file with the `dot` program, the only part of the diagrams
that runs a binary (and only when it is on PATH).
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path

from fsm_kernel.errors import ConfigError

__all__ = ["DOT_MISSING", "RENDER_FORMATS", "render", "render_svg"]

logger = logging.getLogger(__name__)

RENDER_FORMATS: tuple[str, ...] = ("svg", "png")

DOT_MISSING = (
    "the 'dot' program is needed for svg/png: apt-get install graphviz "
    "(or brew install graphviz); dot and mermaid output need nothing"
)


def render(dot_source: str, fmt: str, out_path: Path) -> Path:
    """Write `dot_source` rendered as `fmt` (svg or png) to `out_path` with the `dot` program.

    Raises:
        ConfigError: an unknown format, no `dot` on PATH, or `dot` failed.
    """
    if fmt not in RENDER_FORMATS:
        raise ConfigError(f"cannot render {fmt!r}: choose one of {', '.join(RENDER_FORMATS)}")
    exe = shutil.which("dot")
    if exe is None:
        raise ConfigError(DOT_MISSING)
    out_path = Path(out_path)
    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(  # a fixed program; the DOT text goes to stdin
            [exe, f"-T{fmt}", "-o", str(out_path)],
            input=dot_source.encode("utf-8"),
            capture_output=True,
            check=False,
        )
    except OSError as exc:
        raise ConfigError(f"cannot run dot: {exc}") from exc
    if proc.returncode != 0:
        raise ConfigError(f"dot failed: {_first_line(proc.stderr)}")
    logger.debug("rendered %s", out_path)
    return out_path


def render_svg(dot_source: str) -> str:
    """`dot_source` rendered as SVG text by the `dot` program (for a page that embeds it).

    Raises:
        ConfigError: no `dot` on PATH, or `dot` failed.
    """
    exe = shutil.which("dot")
    if exe is None:
        raise ConfigError(DOT_MISSING)
    try:
        proc = subprocess.run(  # a fixed program; the DOT text goes to stdin
            [exe, "-Tsvg"], input=dot_source.encode("utf-8"), capture_output=True, check=False
        )
    except OSError as exc:
        raise ConfigError(f"cannot run dot: {exc}") from exc
    if proc.returncode != 0:
        raise ConfigError(f"dot failed: {_first_line(proc.stderr)}")
    return proc.stdout.decode("utf-8", "replace")


def _first_line(stderr: bytes) -> str:
    lines = [line.strip() for line in stderr.decode("utf-8", "replace").splitlines()]
    return next((line for line in lines if line), "no error message")
