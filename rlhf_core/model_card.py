"""Model cards: README.md with YAML front matter, as the Hugging Face hub reads them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def render_model_card(*, title: str, metadata: dict[str, Any], body: str) -> str:
    """'---\\n<yaml>---\\n\\n# title\\n\\nbody'."""
    front = yaml.safe_dump(metadata, sort_keys=False, allow_unicode=True)
    return f"---\n{front}---\n\n# {title}\n\n{body.strip()}\n"


def write_model_card(directory: str | Path, *, title: str, metadata: dict[str, Any], body: str) -> Path:
    path = Path(directory) / "README.md"
    path.write_text(render_model_card(title=title, metadata=metadata, body=body), encoding="utf-8")
    return path


def read_front_matter(path: str | Path) -> dict[str, Any]:
    """The YAML front matter of a model card, as a dict."""
    text = Path(path).read_text(encoding="utf-8")
    if not text.startswith("---\n"):
        raise ValueError(f"{path} has no YAML front matter")
    return yaml.safe_load(text.split("---\n", 2)[1]) or {}
