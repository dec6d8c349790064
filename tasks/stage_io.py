"""What stages hand each other (paths and model URIs, never modules), how a stage's key is made, and the complete
checkpoints a stage finds on disk."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf_core.storage.checkpoints import has_training_state, list_checkpoints


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
    for step, path in list_checkpoints(out_dir):
        if has_training_state(path):
            register(path / subdir if subdir else path, step)


def checkpoint_steps(out_dir: Path) -> list[int]:
    """Steps of the complete checkpoints under out_dir (those with their training state), oldest first."""
    return [step for step, path in list_checkpoints(out_dir) if has_training_state(path)]
