"""A training loop's checkpoints: resume from the newest, and save checkpoint-N/ whole or not at all.

A checkpoint is `checkpoint-N/`: one Hugging Face directory per saved model (`models`, "" for the
checkpoint directory itself), `metrics.json` and `training_state/` (no pickle). A save gathers the
weights, refuses non-finite ones, writes everything atomically, hands the checkpoint to `on_checkpoint`,
and prunes old checkpoints only once `on_checkpoint` is done with it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from rlhf_core.storage.checkpoints import (
    latest_checkpoint,
    load_training_state,
    prune_checkpoints,
    rng_state,
    save_training_state,
)
from rlhf_core.storage.ownership import remove_orphan_temps
from rlhf_core.storage.saving import assert_finite, atomic_dir, restore_weights, save_hf_dir
from rlhf_core.training.engine import TrainEngine
from rlhf_core.training.parallel import all_gather_objects, gathered_state_dicts, shards_optimizer

METRICS_FILE = "metrics.json"


class OnCheckpoint(Protocol):
    """Called with each saved checkpoint. It returns None when it is done with the checkpoint's files, or a
    Future that completes when it is (a registration running in the background): the loop prunes old
    checkpoints (run.keep_last_checkpoints) only then, and not at all when the Future fails, so a
    checkpoint is never deleted before it was registered."""

    def __call__(self, path: Path, step: int) -> Future | None: ...


@dataclass
class Progress:
    """Where a run stands, saved in training_state/ beside the optimizer, the schedule and the RNG."""

    step: int = 0
    epoch: int = 0
    position: int = 0  # the batch position within the epoch
    skipped_steps: int = 0  # optimizer steps skipped for a non-finite gradient norm
    state: dict[str, float] = field(default_factory=dict)  # the stage's scalars (PPO's KL coefficient)

    @classmethod
    def from_saved(cls, saved: dict[str, Any]) -> Progress:
        """The progress `load_training_state` returns (checkpoints before skipped_steps and state lack them)."""
        return cls(
            saved["step"], saved["epoch"], saved["position"], saved.get("skipped_steps", 0), saved.get("state", {})
        )


@dataclass
class Restored:
    """What a resume brings back besides the weights, the optimizer, the schedule and the RNG."""

    path: Path
    progress: Progress
    metrics: dict[str, float]  # what the checkpoint recorded


def checkpoint_path(output_dir: Path, step: int) -> Path:
    return output_dir / f"checkpoint-{step}"


def restore_latest(
    output_dir: Path, models: dict[str, torch.nn.Module], optimizer, scheduler, *, is_main: bool
) -> Restored | None:
    """Load the newest complete checkpoint of `output_dir` into `models`, `optimizer`, `scheduler` and the RNG;
    None when there is none. The main process first removes a killed run's half-written saves."""
    if is_main:
        remove_orphan_temps(output_dir)
    path = latest_checkpoint(output_dir)
    if path is None:
        return None
    for sub, model in models.items():
        restore_weights(model, path / sub)
    progress = load_training_state(path, optimizer=optimizer, scheduler=scheduler)
    return Restored(path, Progress.from_saved(progress), json.loads((path / METRICS_FILE).read_text()))


@dataclass
class Checkpointer:
    """Saves a loop's checkpoint-N/: gather, check finite, write atomically with the training state, hand
    to on_checkpoint, prune once on_checkpoint is done. Every process calls `save` (the gathers are
    collectives); the main process writes."""

    output_dir: Path
    engine: TrainEngine  # prepared: its module's weights (gathered under parameter sharding), optimizer, schedule
    models: dict[str, torch.nn.Module]  # name -> model saved in checkpoint-N/<name>/ ("" : checkpoint-N/ itself)
    tokenizer: Any
    label: str = "trained"  # the models' name in errors: "the <label> model"
    keep_last: int | None = None  # checkpoints kept: the newest N and the best by `best_metric`
    best_metric: tuple[str, ...] = ()
    registered: str = ""  # which saved model `on_checkpoint` receives ("" : the checkpoint directory)

    def save(
        self,
        progress: Progress,
        metrics: dict[str, float],
        on_checkpoint: OnCheckpoint | None = None,
        extra_files: Callable[[Path, dict], None] | None = None,
    ) -> Path:
        """checkpoint-<progress.step>/ recording `metrics`; `extra_files(directory, metrics)` adds files to it."""
        engine = self.engine
        gathered = gathered_state_dicts(engine.accelerator, engine.trainable, self.models)  # collective; None unsharded
        process_rngs = all_gather_objects(rng_state()) if engine.world > 1 else None  # collective
        path = checkpoint_path(self.output_dir, progress.step)
        if engine.is_main:
            weights = {sub: gathered[sub] if gathered else None for sub in self.models}
            for sub, model in self.models.items():  # before anything is written
                assert_finite(model, f"the {sub or self.label} model", weights[sub])
            self._write(path, weights, progress, metrics, process_rngs, extra_files)
            self._hand_on(path, progress.step, on_checkpoint)
        engine.accelerator.wait_for_everyone()
        return path

    def _write(self, path: Path, weights, progress: Progress, metrics, process_rngs, extra_files) -> None:
        with atomic_dir(path) as tmp:
            for sub, model in self.models.items():
                save_hf_dir(model, self.tokenizer, tmp / sub, weights[sub])
            if extra_files is not None:
                extra_files(tmp, metrics)
            (tmp / METRICS_FILE).write_text(json.dumps(metrics, indent=2))
            optimizer = None if shards_optimizer(self.engine.accelerator) else self.engine.optimizer
            save_training_state(
                tmp,
                optimizer=optimizer,
                scheduler=self.engine.scheduler,
                progress=asdict(progress),
                process_rngs=process_rngs,
            )

    def _hand_on(self, path: Path, step: int, on_checkpoint: OnCheckpoint | None) -> None:
        """on_checkpoint, then the pruning: at once when it returned None, when its Future succeeds otherwise
        (never when it fails: the next run registers what is left). The newest, which resume reads, always stays."""
        pending = on_checkpoint(path / self.registered, step) if on_checkpoint is not None else None  # / "": itself
        if pending is None:
            self.prune()
        else:
            pending.add_done_callback(lambda done: None if done.cancelled() or done.exception() else self.prune())

    def prune(self) -> None:
        """Delete the checkpoints beyond the newest keep_last and the best by best_metric."""
        prune_checkpoints(self.output_dir, self.keep_last, self.best_metric or None)
