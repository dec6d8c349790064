import math

import pytest
import torch

from rlhf_core.ppo import (
    AdaptiveKLController,
    FixedKLController,
    compute_gae,
    kl_penalized_rewards,
    policy_loss,
    value_loss,
)
from rlhf_core.rl_math import (
    entropy_from_logits,
    first_true_indices,
    kl_per_token,
    masked_mean,
    masked_whiten,
    response_mask,
    selective_log_softmax,
)


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


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert kl_per_token(logp, ref, "k1").item() == pytest.approx(math.log(2))
    # r = ref/pi = 0.5: k3 = (0.5 - 1) - log 0.5
    assert kl_per_token(logp, ref, "k3").item() == pytest.approx(-0.5 + math.log(2))
    assert kl_per_token(ref, logp, "k3").item() >= 0


def test_kl_penalized_rewards_put_the_score_on_the_last_real_token():
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    rewards, non_score = kl_penalized_rewards(torch.tensor([2.0, -1.0]), kl, mask, torch.tensor([2, 0]), kl_coef=0.1)
    torch.testing.assert_close(non_score, torch.tensor([[-0.01, -0.02, -0.03], [-0.05, 0.0, 0.0]]))
    torch.testing.assert_close(rewards, torch.tensor([[-0.01, -0.02, 1.97], [-1.05, 0.0, 0.0]]))


def test_policy_loss_by_hand():
    old = torch.zeros(1, 2)
    new = torch.log(torch.tensor([[1.5, 0.5]]))  # ratios 1.5 and 0.5
    adv = torch.tensor([[1.0, -1.0]])
    loss, stats = policy_loss(new, old, adv, torch.ones(1, 2), cliprange=0.2)
    # token 1: max(-1.5, -1.2) = -1.2 (clipped); token 2: max(0.5, 0.8) = 0.8 (clipped)
    assert loss.item() == pytest.approx((-1.2 + 0.8) / 2)
    assert stats["clipfrac"].item() == 1.0
    assert stats["approxkl"].item() == pytest.approx(0.5 * (math.log(1.5) ** 2 + math.log(0.5) ** 2) / 2)
    # a masked token does not count
    loss_masked, _ = policy_loss(new, old, adv, torch.tensor([[1, 0]]), cliprange=0.2)
    assert loss_masked.item() == pytest.approx(-1.2)


def test_value_loss_by_hand():
    vpred, old, ret = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 0.0]]), torch.tensor([[2.0, 0.5]])
    loss, stats = value_loss(vpred, old, ret, torch.ones(1, 2), cliprange_value=0.2)
    # token 1: max((1-2)^2, (0.2-2)^2) = 3.24; token 2: max(0.25, 0.25) = 0.25
    assert loss.item() == pytest.approx(0.5 * (3.24 + 0.25) / 2)
    assert stats["clipfrac"].item() == 0.5


def test_adaptive_kl_controller_update():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=9.0, n_steps=100)  # error clipped to 0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 100 / 10000))
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=5.4, n_steps=1000)  # error -0.1
    assert ctl.value == pytest.approx(0.1 * (1 - 0.1 * 0.1))
    fixed = FixedKLController(0.05)
    fixed.update(100.0, 64)
    assert fixed.value == 0.05


def test_response_masks_end_at_the_first_stop_token_which_they_keep():
    cut = torch.tensor([[5, 9, 0, 0], [5, 6, 7, 8], [9, 0, 0, 0]])  # pad 0 after the stop token 9
    mask, last, has_stop = response_mask(cut, [9])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert last.tolist() == [1, 3, 0] and has_stop.tolist() == [True, False, True]
    # pad == eos (Qwen2.5 base, GPT-2): the stop token is still the response's last token
    same = torch.tensor([[5, 0, 0, 0], [5, 6, 7, 8]])
    mask, last, has_stop = response_mask(same, [0])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]] and has_stop.tolist() == [True, False]
    # two stop ids (instruct models): whichever comes first ends the response; a generated pad (3) is a real token
    two = torch.tensor([[3, 7, 8, 8], [8, 2, 2, 2], [3, 3, 3, 3]])
    mask, last, has_stop = response_mask(two, [7, 8])
    assert last.tolist() == [1, 0, 3] and has_stop.tolist() == [True, True, False]
    # no stop token at all: every response is full length
    mask, last, has_stop = response_mask(two, [])
    assert mask.all() and not has_stop.any()
    assert first_true_indices(torch.tensor([[False, False], [False, True]])).tolist() == [2, 1]


def test_masked_statistics_ignore_padding():
    x = torch.tensor([[1.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 0]])
    assert masked_mean(x, mask).item() == 2.0
    w = masked_whiten(x, mask)
    assert masked_mean(w, mask).item() == pytest.approx(0.0, abs=1e-6)
    assert w[0, 1].item() == pytest.approx(-w[0, 0].item(), rel=1e-5)


def test_log_softmax_and_entropy_helpers():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5)
    index = torch.randint(0, 5, (2, 3))
    expected = torch.log_softmax(logits, -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(selective_log_softmax(logits, index), expected)
    uniform = torch.zeros(1, 1, 4)
    assert entropy_from_logits(uniform).item() == pytest.approx(math.log(4))
    # the lse form equals -sum p log p, with or without a precomputed logsumexp, also for peaked rows
    peaked = logits * 30
    direct = -(torch.softmax(peaked, -1) * torch.log_softmax(peaked, -1)).sum(-1)
    torch.testing.assert_close(entropy_from_logits(peaked), direct, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(entropy_from_logits(peaked, torch.logsumexp(peaked, -1)), direct, atol=1e-5, rtol=1e-4)
