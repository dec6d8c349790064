"""What stages hand each other (paths and model URIs, never modules) and how a stage's key is made."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Checkpoint:
    """A stage's output: a Hugging Face directory and, when registered, its model version URI."""

    path: str
    model_uri: str | None
    step: int
    metrics: dict[str, float]
    key: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def stage_key(parts: dict[str, Any]) -> str:
    """A short stable hash of everything a stage's result depends on."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]
