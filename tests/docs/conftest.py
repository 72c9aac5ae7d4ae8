"""Fixtures of the docs tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def hooks() -> ModuleType:
    """docs/hooks.py, the MkDocs hook that generates the Reference pages and draws the charts
    (a file of the docs, not a module of the package, so it is loaded by path)."""
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_hooks"] = module
    spec.loader.exec_module(module)
    return module
