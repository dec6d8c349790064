"""Anchor libraries live in bench/.anchors/<name>-<version>, installed with --no-deps --target so that
they never change the project's own pins; `use_anchor` puts one on sys.path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ANCHORS = Path(__file__).resolve().parent / ".anchors"


def use_anchor(package: str, version: str) -> Path:
    target = ANCHORS / f"{package}-{version}"
    if not (target / package).is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                        f"{package}=={version}"], check=True)
    sys.path.insert(0, str(target))
    return target
