"""ARCHITECTURE.md describes the code as it is: every path it names exists and every package is named; the
folders say the rest, so every package's __init__.py and every module opens with a docstring."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "ARCHITECTURE.md"
ROOTS = ("rlhf_core", "tasks", "flows")


def backticked_paths(text: str) -> set[str]:
    spans = re.findall(r"`([^`\s]+)`", text)
    return {s for s in spans if s.endswith((".py", "/")) and "<" not in s}


def packages() -> list[Path]:
    return sorted(
        p.parent for root in ROOTS for p in (REPO / root).rglob("__init__.py") if "__pycache__" not in p.parts
    )


def test_every_path_named_exists():
    missing = sorted(p for p in backticked_paths(DOC.read_text()) if not (REPO / p).exists())
    assert not missing, f"ARCHITECTURE.md names paths that do not exist: {missing}"


def test_every_package_is_named():
    named = backticked_paths(DOC.read_text())
    unnamed = [f"{p.relative_to(REPO)}/" for p in packages() if f"{p.relative_to(REPO)}/" not in named]
    assert not unnamed, f"ARCHITECTURE.md does not name the packages {unnamed}"


def test_every_package_and_module_says_what_it_holds():
    silent = [
        str(p.relative_to(REPO))
        for root in ROOTS
        for p in (REPO / root).rglob("*.py")
        if "__pycache__" not in p.parts and not ast.get_docstring(ast.parse(p.read_text()))
    ]
    assert not silent, f"modules and packages without a docstring: {silent}"


def test_it_stays_short():
    assert len(DOC.read_text().splitlines()) < 150
