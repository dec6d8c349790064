"""AdamW and the learning-rate schedules every stage's optimizer runs with."""

from __future__ import annotations

import math

import torch

from rlhf_core.config import OptimSettings

_FUSED_DEVICES = ("cpu", "cuda", "mps", "xpu")


# The learning-rate schedules of transformers.get_scheduler, the same functions (and so the same scheduler
# state_dict): importing transformers.optimization pulls in transformers.trainer_utils and PEFT, a second
# or more of start-up that every stage paid inside its run.
def _constant(_=None):
    return 1


def _constant_with_warmup(current_step: int, *, num_warmup_steps: int):
    if current_step < num_warmup_steps:
        return float(current_step) / float(max(1.0, num_warmup_steps))
    return 1.0


def _linear_with_warmup(current_step: int, *, num_warmup_steps: int, num_training_steps: int):
    if current_step < num_warmup_steps:
        return float(current_step) / float(max(1, num_warmup_steps))
    return max(0.0, float(num_training_steps - current_step) / float(max(1, num_training_steps - num_warmup_steps)))


def _cosine_with_warmup(current_step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: float):
    if current_step < num_warmup_steps:
        return float(current_step) / float(max(1, num_warmup_steps))
    progress = float(current_step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress)))


def lr_schedule(optimizer, name: str, *, num_warmup_steps: int, num_training_steps: int):
    """transformers.get_scheduler(name, ...) for the schedules the config offers: the same LambdaLR."""
    from functools import partial

    from torch.optim.lr_scheduler import LambdaLR

    if name == "constant":
        return LambdaLR(optimizer, _constant)
    if name == "constant_with_warmup":
        return LambdaLR(optimizer, partial(_constant_with_warmup, num_warmup_steps=num_warmup_steps))
    steps = {"num_warmup_steps": num_warmup_steps, "num_training_steps": num_training_steps}
    if name == "linear":
        return LambdaLR(optimizer, partial(_linear_with_warmup, **steps))
    if name == "cosine":
        return LambdaLR(optimizer, partial(_cosine_with_warmup, **steps, num_cycles=0.5))
    raise ValueError(f"unknown learning-rate schedule {name!r}")


def build_optimizer(model, settings: OptimSettings, max_steps: int):
    """AdamW over the trainable parameters and the configured warm-up + schedule."""
    params = [p for p in model.parameters() if p.requires_grad]
    # the fused kernel (one pass over each parameter's state instead of a dozen elementwise ops), as
    # transformers.Trainer's default "adamw_torch_fused"; the same update rule
    fused = bool(params) and all(p.is_floating_point() and p.device.type in _FUSED_DEVICES for p in params)
    optimizer = torch.optim.AdamW(
        params, lr=settings.learning_rate, weight_decay=settings.weight_decay, fused=fused or None
    )
    scheduler = lr_schedule(
        optimizer, settings.lr_scheduler, num_warmup_steps=settings.warmup_steps, num_training_steps=max_steps
    )
    return optimizer, scheduler
