"""What a stage's reporting is told once: which stage run it reports on, and which registered model its
checkpoints become versions of."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhf_core.config import PipelineConfig


@dataclass(frozen=True)
class StageIdentity:
    """One stage run: its config, name (MLflow run, lineage tag `stage`, artifact keys `<stage>-progress`), MLflow
    run id, stage key (lineage tag `stage_key`; None: no such tag) and the fingerprint of the data it read."""

    cfg: PipelineConfig
    stage: str
    run_id: str
    key: str | None = None
    data_fingerprint: str = ""


@dataclass(frozen=True)
class RegisteredModel:
    """Where a stage's checkpoints are registered: the model's name, its transformers task, and the lineage tags
    every version carries besides stage, step, stage key, config hash and data fingerprint."""

    name: str
    task: str = "text-generation"
    lineage: dict[str, str] = field(default_factory=dict)
