"""The advantage estimators: GAE and its KL-penalized rewards, group-relative advantages, the registry keyed by rl.algorithm."""

import math

import pytest
import torch

from rlhf_core.config import GRPOConfig, PPOConfig
from rlhf_core.rl.advantages.estimators import (
    ESTIMATORS,
    Estimate,
    EstimatorContext,
    estimator_for,
    gae_estimate,
    group_relative_estimate,
    register_estimator,
)
from rlhf_core.rl.advantages.group_baselines import grpo_advantages
from rlhf_core.rl_math import compute_gae, kl_penalized_rewards
from rlhf_core.rollout.collect import RolloutBatch
from tests.fixtures.small_models import rollout_of


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.99, 0.0)])
def test_gae_matches_the_plain_loop(gamma, lam):
    torch.manual_seed(0)
    rewards, values = torch.randn(4, 7), torch.randn(4, 7)
    mask = torch.tensor([[1] * 7, [1] * 3 + [0] * 4, [1] * 1 + [0] * 6, [1] * 5 + [0] * 2])
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = gae_loop(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, ref_adv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, ref_ret, atol=1e-5, rtol=1e-5)


def test_gae_by_hand():
    # two tokens, r = [0, 1], V = [0.5, 0.25], gamma 1, lam 0.5
    # delta_1 = 1 - 0.25 = 0.75; delta_0 = 0 + 0.25 - 0.5 = -0.25; A_0 = -0.25 + 0.5 * 0.75 = 0.125
    adv, ret = compute_gae(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.25]]), torch.ones(1, 2), 1.0, 0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.125, 0.75]]))
    torch.testing.assert_close(ret, torch.tensor([[0.625, 1.0]]))


def test_kl_penalized_rewards_put_the_score_on_the_last_real_token():
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    rewards, non_score = kl_penalized_rewards(torch.tensor([2.0, -1.0]), kl, mask, torch.tensor([2, 0]), kl_coef=0.1)
    torch.testing.assert_close(non_score, torch.tensor([[-0.01, -0.02, -0.03], [-0.05, 0.0, 0.0]]))
    torch.testing.assert_close(rewards, torch.tensor([[-0.01, -0.02, 1.97], [-1.05, 0.0, 0.0]]))


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 3.0, 2.0, 2.0])  # two groups of two
    out = group_advantages(rewards, "none")
    assert out.advantages.tolist() == [-1.0, 1.0, 0.0, 0.0]
    assert out.std[0].item() == pytest.approx(math.sqrt(2)) and out.std[2].item() == 0.0
    adv = group_advantages(rewards, "group").advantages
    assert adv[0].item() == pytest.approx(-1 / (math.sqrt(2) + 1e-4)) and adv[2].item() == 0.0
    adv = group_advantages(rewards, "batch").advantages
    assert adv[1].item() == pytest.approx(1 / (rewards.std().item() + 1e-4))


def test_reward_weighting_leaves_out_none():
    per_source = torch.tensor([[1.0, float("nan")], [2.0, 4.0]])
    assert grpo_advantages(per_source, torch.tensor([0.5, 2.0]), 2).rewards.tolist() == [0.5, 9.0]


def test_unscorable_rows_are_nan_left_out_of_the_group_statistics_and_get_advantage_zero():
    nan = float("nan")
    # one group of three: the middle completion got None from every source
    per_source = torch.tensor([[1.0, nan], [nan, nan], [3.0, nan]])
    out = grpo_advantages(per_source, torch.tensor([1.0, 2.0]), 3)
    expected = 1 / (math.sqrt(2) + 1e-4)  # mean 2 and std sqrt(2) of {1, 3}: the None row is not a 0
    torch.testing.assert_close(out.advantages, torch.tensor([-expected, 0.0, expected]))
    assert out.unscorable.tolist() == [False, True, False] and math.isnan(out.rewards[1])
    # nothing to compare with in a group: advantage 0, never NaN
    alone = grpo_advantages(torch.tensor([[2.0], [nan]]), torch.ones(1), 2)
    assert alone.advantages.tolist() == [0.0, 0.0]


def test_batch_scale_and_the_missing_stop_penalty_come_before_group_statistics():
    nan = float("nan")
    per_source = torch.tensor([[1.0], [3.0], [nan], [4.0]])
    out = grpo_advantages(per_source, torch.ones(1), 2, scale_rewards="batch")
    batch_std = torch.tensor([1.0, 3.0, 4.0]).std().item()  # the scorable rows only
    torch.testing.assert_close(out.advantages, torch.tensor([-1.0, 1.0, 0.0, 0.0]) / (batch_std + 1e-4))
    penalized = grpo_advantages(
        torch.tensor([[1.0], [1.0]]), torch.ones(1), 2, scale_rewards="none", penalty=torch.tensor([0.0, 2.0])
    )  # the second never stopped
    assert penalized.rewards.tolist() == [1.0, -1.0] and penalized.advantages.tolist() == [1.0, -1.0]


def test_normalize_then_sum_matches_a_loop():
    torch.manual_seed(0)
    per_source, weights, G = torch.randn(6, 2) * torch.tensor([1.0, 10.0]), torch.tensor([1.0, 0.5]), 3
    out = grpo_advantages(per_source, weights, G, aggregation="normalize_then_sum")
    summed = []
    for row in range(6):
        group = per_source[row // G * G : row // G * G + G]
        z = (per_source[row] - group.mean(0)) / (group.std(0) + 1e-4)
        summed.append(float((z * weights).sum()))
    summed = torch.tensor(summed)
    torch.testing.assert_close(out.advantages, (summed - summed.mean()) / (summed.std() + 1e-4), rtol=1e-5, atol=1e-6)


def gae_loop(rewards, values, mask, gamma, lam):
    """GAE from its definition, one sequence and one token at a time."""
    B, T = rewards.shape
    adv = torch.zeros(B, T)
    for b in range(B):
        n = int(mask[b].sum())
        last = 0.0
        for t in reversed(range(n)):
            next_v = values[b, t + 1].item() if t + 1 < n else 0.0
            delta = rewards[b, t].item() + gamma * next_v - values[b, t].item()
            last = delta + gamma * lam * last
            adv[b, t] = last
    return adv, (adv + values) * mask


def group_advantages(rewards, scale):
    return grpo_advantages(rewards.view(-1, 1), torch.ones(1), 2, scale_rewards=scale)


class OneProcess:
    rank, world = 0, 1

    def gather(self, value):
        return value

    def global_sum(self, value):
        return value


class SecondOfTwo(OneProcess):
    """Process 1 of 2: `gather` puts the other process's rows (`theirs`) first, as rank order does."""

    rank, world = 1, 2

    def __init__(self, theirs):
        self.theirs = theirs

    def gather(self, value):
        return torch.cat([self.theirs[value.dim()], value])


def rollout_batch(scores, penalty=None, values=None, logprobs=None, ref_logprobs=None, resp_mask=None):
    resp_mask = torch.ones(scores.shape[0], 3, dtype=torch.long) if resp_mask is None else resp_mask
    return RolloutBatch(rollout_of(resp_mask, logprobs=logprobs, ref_logprobs=ref_logprobs), scores, penalty, values)


def test_the_estimator_is_chosen_by_rl_algorithm_and_must_fit_the_trainer():
    assert estimator_for("ppo", with_values=True) is gae_estimate
    assert estimator_for("grpo", with_values=False) is group_relative_estimate
    with pytest.raises(ValueError, match="rl.algorithm 'ppo' needs a value model"):
        estimator_for("ppo", with_values=False)
    with pytest.raises(ValueError, match="rl.algorithm 'grpo' trains without a value model"):
        estimator_for("grpo", with_values=True)
    with pytest.raises(
        ValueError,
        match=r"rl.algorithm 'nope' has no advantage estimator; known: \['grpo', 'ppo', 'reinforce_plus_plus', 'reinforce_plus_plus_baseline', 'rloo'\]",
    ):
        estimator_for("nope", with_values=False)


def test_a_new_estimator_is_a_registered_function():
    @register_estimator("constant_test")
    def constant(batch, ctx):
        return Estimate(torch.ones(len(batch)))

    try:
        estimate = estimator_for("constant_test", with_values=False)(rollout_batch(torch.zeros(2, 1)), None)
        assert estimate.advantages.tolist() == [1.0, 1.0]
    finally:
        del ESTIMATORS["constant_test"]


def test_gae_estimate_is_kl_penalized_rewards_then_gae():
    torch.manual_seed(0)
    logp, ref = torch.randn(2, 3), torch.randn(2, 3)
    values = torch.randn(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    batch = rollout_batch(torch.tensor([[1.0], [2.0]]), torch.tensor([0.0, 0.5]), values, logp, ref, mask)
    ppo = PPOConfig(gamma=0.9, lam=0.8, whiten_advantages=False, kl_estimator="k1")
    estimate = gae_estimate(batch, EstimatorContext(ppo, OneProcess(), kl_coef=0.1))
    kl = (logp - ref) * mask
    rewards, non_score = kl_penalized_rewards(torch.tensor([1.0, 1.5]), kl, mask, torch.tensor([1, 2]), 0.1)
    advantages, returns = compute_gae(rewards, values, mask, 0.9, 0.8)
    torch.testing.assert_close(estimate.advantages, advantages)
    torch.testing.assert_close(estimate.returns, returns)
    torch.testing.assert_close(estimate.stats["scores"], torch.tensor([1.0, 1.5]))  # the penalty came off
    torch.testing.assert_close(estimate.stats["non_score_reward"], non_score)


def test_group_relative_estimate_uses_every_process_s_groups_and_keeps_its_own_rows():
    mine, theirs = torch.tensor([[1.0], [3.0]]), torch.tensor([[0.0], [4.0]])
    grpo = GRPOConfig(num_generations=2, scale_rewards="batch")
    context = EstimatorContext(grpo, SecondOfTwo({2: theirs}), 2, torch.ones(1))
    estimate = group_relative_estimate(rollout_batch(mine), context)
    everyone = grpo_advantages(torch.cat([theirs, mine]), torch.ones(1), 2, scale_rewards="batch")
    torch.testing.assert_close(estimate.advantages, everyone.advantages[2:])
    torch.testing.assert_close(estimate.stats["rewards"], everyone.rewards)  # global, for the metrics
    torch.testing.assert_close(estimate.stats["my_rewards"], torch.tensor([1.0, 3.0]))
    alone = group_relative_estimate(rollout_batch(mine), EstimatorContext(grpo, OneProcess(), 2, torch.ones(1)))
    assert not torch.allclose(alone.advantages, estimate.advantages)  # the batch std differs with the other rows
