"""Dropout off where an update's log-probabilities must equal the rollout's."""

import torch

from rlhf_core.training.determinism import seed_everything
from tests.fixtures.small_models import dropout_policy


def test_disable_dropout_turns_off_lora_and_attention_dropout(smoke_world):
    from rlhf_core.training.determinism import disable_dropout

    policy = dropout_policy(smoke_world).train()
    ids = torch.randint(5, 50, (2, 8))
    with torch.no_grad():
        assert not torch.equal(policy(input_ids=ids).logits, policy(input_ids=ids).logits)
        disable_dropout(policy)
        assert torch.equal(policy(input_ids=ids).logits, policy(input_ids=ids).logits)
    assert policy.training  # only the dropout rates change


def test_one_seed_fixes_python_numpy_and_torch():
    import random

    import numpy as np

    def draws():
        return random.random(), float(np.random.rand()), float(torch.rand(()))

    seed_everything(7)
    first = draws()
    seed_everything(7)
    assert draws() == first
    seed_everything(8)
    assert draws() != first
