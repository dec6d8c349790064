"""Pieces every training loop shares: seeding, the Accelerator, optimizer and schedule, atomic saves."""

from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Protocol

from rlhf_core.config import OptimSettings, RunConfig


class OnLog(Protocol):
    def __call__(self, metrics: dict[str, float], step: int) -> None: ...


class OnCheckpoint(Protocol):
    def __call__(self, path: Path, step: int) -> None: ...


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_accelerator(run: RunConfig, gradient_accumulation_steps: int = 1):
    """An Accelerator honouring run.device and run.mixed_precision (launch-time settings win)."""
    from accelerate import Accelerator

    return Accelerator(
        cpu=run.device == "cpu",
        mixed_precision=run.mixed_precision,
        gradient_accumulation_steps=gradient_accumulation_steps,
    )


def build_optimizer(model, settings: OptimSettings, max_steps: int):
    """AdamW over the trainable parameters and the configured warm-up + schedule."""
    import torch
    from transformers import get_scheduler

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.learning_rate, weight_decay=settings.weight_decay)
    scheduler = get_scheduler(
        settings.lr_scheduler, optimizer, num_warmup_steps=settings.warmup_steps, num_training_steps=max_steps
    )
    return optimizer, scheduler


def save_pretrained_atomic(model, tokenizer, output_dir: str | Path, extra: Callable[[Path], None] | None = None) -> Path:
    """Save model (safetensors) and tokenizer into a temporary sibling, then rename into place.

    A crash mid-save leaves the previous directory, never a half-written one. `extra(tmp_dir)` may
    add files (model card, trainer state) before the rename.
    """
    output_dir = Path(output_dir)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}-", dir=output_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if extra is not None:
            extra(tmp)
        tmp.chmod(0o755)
        if output_dir.exists():
            shutil.rmtree(output_dir)
        tmp.rename(output_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return output_dir
