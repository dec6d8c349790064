"""RLOO's sequence-level loss by hand, and per-token advantages through the token-level loss (REINFORCE++);
the GRPO loss types are pinned in test_grpo.py and against TRL in tests/parity."""

import math

import pytest
import torch

from rlhf_core.config import GRPOConfig
from rlhf_core.rl.grpo_losses import grpo_token_loss, rloo_sequence_loss


def test_rloo_ratio_is_of_the_summed_log_probabilities_and_clipped():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    old = torch.zeros(2, 3)
    # sequence 1: log ratio 0.3 + 0.2 (the padded 5.0 is not counted) -> r = e^0.5; sequence 2: r = e^-0.6
    new = torch.tensor([[0.3, 0.2, 5.0], [-0.2, -0.2, -0.2]], requires_grad=True)
    adv = torch.tensor([1.0, -2.0])
    loss, stats = rloo_sequence_loss(new, old, adv, mask, epsilon=0.2, epsilon_high=0.28)
    r1, r2 = math.exp(0.5), math.exp(-0.6)
    expected = (-min(r1 * 1.0, 1.28 * 1.0) + -min(r2 * -2.0, 0.8 * -2.0)) / 2
    assert loss.item() == pytest.approx(expected)
    assert stats["high_clipped"].tolist() == [[1.0], [0.0]] and stats["low_clipped"].tolist() == [[0.0], [1.0]]
    loss.backward()  # both sequences are clipped: no gradient; the padded token never has one
    assert new.grad.abs().sum().item() == 0.0


def test_rloo_unclipped_gradient_is_the_advantage_times_the_ratio():
    mask = torch.ones(1, 2)
    new = torch.tensor([[0.05, 0.0]], requires_grad=True)
    loss, _ = rloo_sequence_loss(new, torch.zeros(1, 2), torch.tensor([2.0]), mask, epsilon=0.2)
    loss.backward()
    torch.testing.assert_close(new.grad, torch.full((1, 2), -2.0 * math.exp(0.05)))


def test_token_loss_takes_one_advantage_per_token():
    logp = torch.zeros(2, 3)
    per_token_adv = torch.tensor([[1.0, 0.5, 0.0], [-1.0, -1.0, 2.0]])
    loss, _ = grpo_token_loss(logp, logp, per_token_adv, torch.ones(2, 3), GRPOConfig())
    torch.testing.assert_close(loss, -per_token_adv)  # ratio 1: the loss is -A token by token
    same, _ = grpo_token_loss(logp, logp, torch.tensor([1.0, -1.0]), torch.ones(2, 3), GRPOConfig())
    torch.testing.assert_close(same, torch.tensor([[-1.0], [1.0]]).expand(2, 3))
