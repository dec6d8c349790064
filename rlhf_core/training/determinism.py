"""What makes a stage's steps repeatable: every random-number generator seeded, and dropout off where
an update's log-probabilities must equal the rollout's."""

from __future__ import annotations

import random

import torch


def seed_everything(seed: int) -> None:
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def disable_dropout(*models) -> None:
    """Dropout off in every given model (LoRA's branch dropout and attention dropout included), as TRL's
    `disable_dropout`: in RL the log-probabilities of one update must match the rollout's, so that the
    importance ratio is exactly 1 on-policy. The modules' `training` flags are left as they are."""
    for model in models:
        if model is None:
            continue
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
            for attr in ("attention_dropout", "dropout", "attn_dropout", "resid_dropout"):
                if isinstance(getattr(module, attr, None), float):
                    setattr(module, attr, 0.0)
