"""Model cards: README.md with YAML front matter, as the Hugging Face hub reads them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from rlhf_core.models.loading import ModelSourceError


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
        raise ModelSourceError(f"{path} has no YAML front matter")
    return yaml.safe_load(text.split("---\n", 2)[1]) or {}


def card_field(directory: str | Path, key: str) -> str | None:
    """A string field of the model card in `directory` (README.md front matter); None when there is none."""
    path = Path(directory) / "README.md"
    if not path.is_file():
        return None
    try:
        value = read_front_matter(path).get(key)
    except (ValueError, yaml.YAMLError):
        return None
    return value.strip() if isinstance(value, str) and value.strip() else None


def card_license(directory: str | Path) -> str | None:
    """The `license:` of the model card in `directory`, or None when it names none."""
    return card_field(directory, "license")


def source_name(source: str) -> str:
    """How a model card's metadata names a model or data source: hub ids as given, 'demo' as 'demo', a local
    path (file, directory or glob) by its last part only, so no card carries an absolute or machine-local path."""
    if source == "demo":
        return source
    path = Path(source).expanduser()
    local = (
        path.is_absolute()
        or path.exists()
        or source.startswith((".", "~"))
        or any(c in source for c in "*?[")
        or path.suffix in (".json", ".jsonl", ".parquet", ".csv")
    )
    if not local:
        return source
    if any(c in path.name for c in "*?["):  # data/prefs/*.jsonl -> prefs
        path = path.parent
    return path.resolve().name if path.exists() else path.name
