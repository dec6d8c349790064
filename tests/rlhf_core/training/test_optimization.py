"""The learning-rate schedules are transformers' own."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("name", ["linear", "cosine", "constant", "constant_with_warmup"])
@pytest.mark.parametrize("warmup", [0, 3])
def test_the_loops_schedules_are_transformers_schedules(name, warmup):
    # every stage's loop builds its schedule without importing transformers.optimization: the same values and state
    from transformers import get_scheduler

    from rlhf_core.training.optimization import lr_schedule

    params = [torch.nn.Parameter(torch.zeros(2))]
    theirs_opt, ours_opt = torch.optim.AdamW(params, lr=1e-3), torch.optim.AdamW(params, lr=1e-3)
    theirs = get_scheduler(name, theirs_opt, num_warmup_steps=warmup, num_training_steps=11)
    ours = lr_schedule(ours_opt, name, num_warmup_steps=warmup, num_training_steps=11)
    for _ in range(14):
        assert ours.get_last_lr() == theirs.get_last_lr()
        theirs_opt.step(), ours_opt.step(), theirs.step(), ours.step()
    assert ours.state_dict() == theirs.state_dict()
