"""What stages hand each other (paths and model URIs, never modules) and how a stage's key is made."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf_core.checkpoint import checkpoint_step, has_training_state


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


def register_saved_checkpoints(out_dir: Path, subdir: str, register: Callable[[Path, int], None]) -> None:
    """Call register(checkpoint-N/<subdir>, N) for every complete checkpoint already on disk, oldest first.

    A crashed attempt may have saved checkpoints it did not get to register; `register` is expected to
    be idempotent (see registry.register_once), so registered ones are found, not registered again.
    """
    found = [(checkpoint_step(p), p) for p in Path(out_dir).glob("checkpoint-*") if p.is_dir()]
    for step, path in sorted((s, p) for s, p in found if s is not None and has_training_state(p)):
        register(path / subdir if subdir else path, step)
