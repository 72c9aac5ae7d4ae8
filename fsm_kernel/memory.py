"""File memory: the `*.md` files of a memory folder, read and appended to the system prompt.
Imports only errors from fsm_kernel.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fsm_kernel.errors import MemoryStoreError

__all__ = ["MemoryFile", "MemoryStoreError", "build_system_prompt", "load_memory"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class MemoryFile:
    """One memory file."""

    name: str
    """The file name, such as `identity.md`; it heads the file's section of the prompt."""
    path: Path
    content: str
    """The text, surrounding whitespace removed."""


def load_memory(directory: Path | str | None) -> list[MemoryFile]:
    """The non-empty `*.md` files directly in `directory`, sorted by name; [] for None.

    Raises:
        MemoryStoreError: the folder does not exist, or a file cannot be read or is not UTF-8.
    """
    if directory is None:
        return []
    folder = Path(directory)
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise MemoryStoreError(f"memory folder {str(folder)!r} {what}")
    files = sorted((p for p in folder.glob("*.md") if p.is_file()), key=lambda p: p.name)
    loaded = [_read(path) for path in files]
    memory = [m for m in loaded if m.content]
    logger.debug("loaded %d memory file(s) from %s", len(memory), folder)
    return memory


def _read(path: Path) -> MemoryFile:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise MemoryStoreError(
            f"memory file {str(path)!r} is not valid UTF-8 (byte {exc.start})"
        ) from exc
    except OSError as exc:
        raise MemoryStoreError(
            f"cannot read memory file {str(path)!r}: {exc.strerror or exc}"
        ) from exc
    return MemoryFile(name=path.name, path=path, content=text.strip())


def build_system_prompt(base: str, memory: Sequence[MemoryFile]) -> str:
    """`base`, then each memory file under a `## <name>` heading, separated by blank lines."""
    parts = [base.strip()] if base.strip() else []
    parts.extend(f"## {m.name}\n\n{m.content}" for m in memory)
    return "\n\n".join(parts)
