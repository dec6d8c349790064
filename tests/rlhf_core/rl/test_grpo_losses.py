"""RLOO's sequence-level loss by hand, per-token advantages through the token-level loss (REINFORCE++), and the
family's loss as `policy_loss_for` picks it; the GRPO loss types are pinned in test_grpo.py and against TRL in
tests/parity."""

import math

import pytest
import torch

from rlhf_core.config import GRPOConfig, RLConfig
from rlhf_core.rl.grpo_losses import (
    CispoClipRatio,
    ClipRatios,
    LossInputs,
    RLOOPolicyLoss,
    TokenPolicyLoss,
    grpo_token_loss,
    policy_loss_for,
    reduce_loss,
    rloo_sequence_loss,
)
from rlhf_core.rl_math import masked_mean


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


# --- the family's loss, chosen once per run ---------------------------------------------------------------------


def inputs(logp, advantages, mask, *, old=None, ref=None, total_tokens=0.0):
    return LossInputs(
        logp=logp,
        old_logp=torch.zeros_like(logp) if old is None else old,
        entropy=torch.zeros_like(logp),
        advantages=advantages,
        mask=mask,
        ref_logp=ref,
        total_tokens=total_tokens,
    )


def test_policy_loss_for_picks_rloos_sequence_loss_or_the_token_loss_by_loss_type():
    rloo = policy_loss_for(RLConfig(algorithm="rloo"), GRPOConfig(), mini_batch=4)
    assert isinstance(rloo, RLOOPolicyLoss) and rloo.clip_metrics == ClipRatios.METRICS
    for algorithm in ("grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        token = policy_loss_for(RLConfig(algorithm=algorithm, response_length=7), GRPOConfig(), mini_batch=4)
        assert isinstance(token, TokenPolicyLoss) and token.kl_in_loss == (algorithm == "grpo")
        assert token.max_completion_length == 7 and token.clip_metrics == ClipRatios.METRICS
    cispo = policy_loss_for(RLConfig(algorithm="grpo"), GRPOConfig(loss_type="cispo"), mini_batch=4)
    assert cispo.clip_metrics == ("cispo_clip_ratio",)
    assert ClipRatios.METRICS == ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def test_token_policy_loss_is_the_micro_batchs_share_with_typed_statistics():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    logp = torch.log(torch.tensor([[1.5, 1.0, 1.0], [0.5, 1.0, 1.0]]))
    adv, ref = torch.tensor([1.0, -1.0]), torch.full((2, 3), -0.5)
    grpo = GRPOConfig(loss_type="grpo", epsilon=0.2, epsilon_high=0.28, beta=0.1)
    loss, stats = TokenPolicyLoss(grpo, kl_in_loss=True, max_completion_length=3, mini_batch=8)(
        inputs(logp, adv, mask, ref=ref)
    )
    per_token, raw = grpo_token_loss(logp, torch.zeros(2, 3), adv, mask, grpo, ref_logp=ref)
    expected = reduce_loss(per_token, mask, "grpo", max_completion_length=3, total_tokens=0.0) * (2 / 8)
    torch.testing.assert_close(loss, expected)  # grpo's loss: the mean over micro-batches, 2 of 8 rows
    torch.testing.assert_close(stats.kl, masked_mean(raw["kl"], mask))
    # token 1 of row 1 is cut above (r 1.5, A > 0), token 1 of row 2 below (r 0.5, A < 0): 1 of 5 tokens each
    assert isinstance(stats.clip, ClipRatios)
    assert stats.clip.named() == pytest.approx(
        {"clip_ratio/low_mean": 0.2, "clip_ratio/high_mean": 0.2, "clip_ratio/region_mean": 0.4}
    )
    # reinforce_plus_plus*: the KL is in the reward, never in the loss, even with the reference's log-probs at hand
    no_kl, stats = TokenPolicyLoss(grpo, kl_in_loss=False, max_completion_length=3, mini_batch=8)(
        inputs(logp, adv, mask, ref=ref)
    )
    assert stats.kl is None and no_kl.item() < loss.item()  # k3 > 0: the KL term only adds
    # dapo and cispo divide by the optimizer batch's tokens already: no micro-batch share on top
    dapo = GRPOConfig(loss_type="dapo")
    loss, _ = TokenPolicyLoss(dapo, kl_in_loss=True, max_completion_length=3, mini_batch=8)(
        inputs(logp, adv, mask, total_tokens=10.0)
    )
    per_token, _ = grpo_token_loss(logp, torch.zeros(2, 3), adv, mask, dapo)
    torch.testing.assert_close(loss, (per_token * mask).sum() / 10.0)


def test_token_policy_loss_counts_cispo_caps_and_pools_entropies_through_gather():
    mask = torch.ones(2, 1)
    logp = torch.log(torch.tensor([[1.5], [0.5]]))
    cispo = GRPOConfig(loss_type="cispo", epsilon_high=1.2)
    _, stats = TokenPolicyLoss(cispo, kl_in_loss=True, max_completion_length=1, mini_batch=2)(
        inputs(logp, torch.tensor([1.0, -1.0]), mask, total_tokens=2.0)
    )
    assert isinstance(stats.clip, CispoClipRatio) and stats.clip.named() == {"cispo_clip_ratio": pytest.approx(0.5)}
    assert stats.kl is None  # beta 0
    pooled = []
    masked = GRPOConfig(top_entropy_quantile=0.5)
    TokenPolicyLoss(
        masked, kl_in_loss=True, max_completion_length=1, mini_batch=2, gather=lambda x: pooled.append(x) or x
    )(inputs(logp, torch.tensor([1.0, -1.0]), mask))
    assert len(pooled) == 1 and pooled[0].shape == (2,)  # the micro-batch's real tokens, once


def test_rloo_policy_loss_is_the_mean_over_micro_batches_with_per_sequence_clip_ratios():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    new = torch.tensor([[0.3, 0.2, 5.0], [-0.2, -0.2, -0.2]])
    adv = torch.tensor([1.0, -2.0])
    grpo = GRPOConfig(epsilon=0.2, epsilon_high=0.28)
    loss, stats = RLOOPolicyLoss(grpo, mini_batch=4)(inputs(new, adv, mask, ref=torch.zeros(2, 3)))
    alone, _ = rloo_sequence_loss(new, torch.zeros(2, 3), adv, mask, epsilon=0.2, epsilon_high=0.28)
    torch.testing.assert_close(loss, alone * (2 / 4))
    assert stats.kl is None  # RLOO's KL is in the reward
    # per sequence: the first cut above, the second below
    assert [stats.clip.low.item(), stats.clip.high.item(), stats.clip.region.item()] == [0.5, 0.5, 1.0]


def test_the_engine_correction_weighs_each_sequences_rloo_term():
    # ratio 1 (on-policy): each sequence's term is -A; weights 0.5 and 2 -> mean(-1 x 0.5, +1 x 2) = 0.75
    logp = torch.zeros(2, 3)
    mask = torch.ones(2, 3)
    loss, _ = rloo_sequence_loss(
        logp, logp, torch.tensor([1.0, -1.0]), mask, 0.2, is_weights=torch.tensor([[0.5], [2.0]])
    )
    assert loss.item() == pytest.approx(0.75)


def test_the_engine_correction_weighs_the_policy_term_and_not_the_kl():
    # grpo with beta: per token -A r w + beta k3; r = 1 and k3 = 0 where logp == ref: the weights alone show
    grpo = GRPOConfig(beta=0.1)
    logp, mask = torch.zeros(1, 2), torch.ones(1, 2)
    per_token, _ = grpo_token_loss(
        logp, logp, torch.tensor([1.0]), mask, grpo, ref_logp=logp - 1.0, is_weights=torch.tensor([[2.0, 0.0]])
    )
    k3 = math.exp(-1.0) - (-1.0) - 1.0  # exp(ref - logp) - (ref - logp) - 1
    assert per_token.tolist()[0] == pytest.approx([-2.0 + 0.1 * k3, 0.0 + 0.1 * k3])
