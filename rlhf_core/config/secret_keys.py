"""Which config keys are secrets, and the config flattened for MLflow params with secrets left out."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlhf_core.config.pipeline import PipelineConfig


SECRET_SUFFIXES = ("token", "password", "passwd", "secret", "api_key", "apikey", "credentials")


def is_secret_key(key: str) -> bool:
    """True for keys such as `hub_token` or `tracking.password` (not `model.tokenizer`)."""
    name = key.rsplit(".", 1)[-1].lower()
    return any(name == s or name.endswith("_" + s) for s in SECRET_SUFFIXES)


def redact_uri(text: str) -> str:
    """Hide every credential of every URI in `text` (see rlhf_core.redaction.redact)."""
    from rlhf_core.redaction import redact

    return redact(text)


def flatten_config(cfg: PipelineConfig) -> dict[str, str]:
    """Dotted key -> string value, for MLflow params; secret keys left out, URI passwords hidden."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        elif is_secret_key(prefix):
            return
        else:
            out[prefix] = redact_uri(json.dumps(value) if isinstance(value, list) else str(value))

    walk("", cfg.model_dump(mode="json"))
    return out

