"""The group algorithms' advantage math pinned by hand and against plain loops: GRPO's lives in
test_advantages.py; here RLOO's leave-one-out baseline and REINFORCE++ (and its baseline variant)."""

import math

import pytest
import torch

from rlhf_core.rl.advantages.group_baselines import group_baseline, reinforce_pp_advantages, rloo_advantages
from rlhf_core.rl_math import masked_whiten

NAN = float("nan")
ONE = torch.tensor([1.0])


def test_leave_one_out_baseline_by_hand():
    # group 1: 1, 2, 3, 6 -> each minus the mean of the other three; group 2: one None, group 3: one scorable row
    per_source = torch.tensor([[1.0], [2.0], [3.0], [6.0], [1.0], [NAN], [3.0], [5.0], [NAN], [2.0], [NAN], [NAN]])
    out = rloo_advantages(per_source, ONE, 4)
    expected = [1 - 11 / 3, 2 - 10 / 3, 0.0, 4.0, -3.0, 0.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(out.advantages, torch.tensor(expected))
    assert out.unscorable.tolist() == [False] * 5 + [True] + [False] * 2 + [True, False, True, True]
    # the leave-one-out advantage is n/(n-1) times the group-mean one
    torch.testing.assert_close(out.advantages[:4], 4 / 3 * (per_source[:4, 0] - 3.0))
    assert out.std[0].item() == pytest.approx(torch.tensor([1.0, 2.0, 3.0, 6.0]).std().item())


def test_kl_penalty_clip_and_normalization_in_trl_order():
    per_source = torch.tensor([[0.5, 1.0], [2.0, 0.0], [4.0, NAN], [1.0, 1.0]])
    weights = torch.tensor([1.0, 2.0])
    kl = torch.tensor([0.2, -0.4, 1.0, 0.0])
    out = rloo_advantages(per_source, weights, 2, kl=kl, beta=0.5, reward_clip_range=(0.0, 3.0), normalize=True)
    summed = torch.tensor([2.5, 2.0, 4.0, 3.0])  # weighted sums; None adds nothing
    assert out.rewards.tolist() == summed.tolist()  # what is logged: the plain weighted sum
    r = summed.clamp(0.0, 3.0) - 0.5 * kl  # clipped, then the KL subtracted: 2.4, 2.2, 2.5, 3.0
    loo = torch.stack([r[0] - r[1], r[1] - r[0], r[2] - r[3], r[3] - r[2]])
    torch.testing.assert_close(out.advantages, (loo - loo.mean()) / (loo.std() + 1e-4))


def test_the_missing_stop_penalty_comes_off_the_reward_before_the_baseline():
    out = rloo_advantages(torch.tensor([[1.0], [1.0]]), ONE, 2, penalty=torch.tensor([0.0, 0.5]))
    torch.testing.assert_close(out.advantages, torch.tensor([0.5, -0.5]))


def discounted_loop(rewards, mask, gamma):
    out = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        running = 0.0
        for t in reversed(range(rewards.shape[1])):
            if mask[b, t]:
                running = rewards[b, t].item() + gamma * running
                out[b, t] = running
    return out


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_reinforce_pp_whitens_the_discounted_returns(gamma):
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    rewards = torch.randn(3, 5) * mask
    advantages, returns = reinforce_pp_advantages(rewards, mask, gamma=gamma)
    torch.testing.assert_close(returns, discounted_loop(rewards, mask, gamma))
    real = returns[mask.bool()]
    torch.testing.assert_close(advantages[mask.bool()], (real - real.mean()) / real.std())
    assert advantages[~mask.bool()].eq(0).all()


def test_reinforce_pp_baseline_subtracts_the_group_mean_score_then_whitens():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]])
    rewards = torch.tensor([[-0.1, 1.0, 0.0], [3.0, 0.0, 0.0], [0.0, 0.0, 2.0], [0.0, -0.2, 4.2]])
    advantages, returns = reinforce_pp_advantages(rewards, mask, gamma=0.5, num_generations=2)  # gamma unused
    centered = torch.tensor([0.9 - 1.95, 3.0 - 1.95, 2.0 - 3.0, 4.0 - 3.0])
    torch.testing.assert_close(returns, centered.unsqueeze(1) * mask)
    torch.testing.assert_close(advantages, masked_whiten(centered.unsqueeze(1).expand(4, 3), mask) * mask)


def test_a_group_with_one_scorable_row_keeps_its_score_as_verl_does():
    scores = torch.tensor([2.0, NAN, 1.0, 3.0])
    torch.testing.assert_close(group_baseline(scores, 2), torch.tensor([2.0, NAN, -1.0, 1.0]), equal_nan=True)
    mask = torch.ones(4, 2)
    scorable = ~torch.isnan(scores)
    advantages, returns = reinforce_pp_advantages(
        torch.nan_to_num(scores).unsqueeze(1) * torch.tensor([0.0, 1.0]),
        mask * scorable.unsqueeze(1),
        num_generations=2,
        scorable=scorable,
    )
    assert returns[1].eq(0).all() and advantages[1].eq(0).all()
    assert not any(math.isnan(v) for v in advantages.flatten().tolist())
