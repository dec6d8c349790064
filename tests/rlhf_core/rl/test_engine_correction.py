"""The engine correction's weights and statistics, by hand (TRL 1.16's own code on the same tensors:
tests/parity/test_trl_engine_correction.py)."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_core.config import RolloutConfig
from rlhf_core.rl.engine_correction import engine_correction

LN2 = math.log(2.0)
# row 0: two response tokens, old - behaviour = ln 2 and ln 4 (ratios 2 and 4), then padding;
# row 1: three tokens, ln(1/8), 0, and a token the engine could not score (NaN)
OLD = torch.tensor([[LN2, 2 * LN2, 5.0], [-3 * LN2, 0.0, -1.0]])
BEHAVIOUR = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, float("nan")]])
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])


@pytest.mark.parametrize(
    ("mode", "cap_min", "cap_max", "weights"),
    [
        ("token_truncate", None, 3.0, [[2.0, 3.0, 1.0], [0.125, 1.0, 1.0]]),
        ("token_truncate", 0.5, 3.0, [[2.0, 3.0, 1.0], [0.5, 1.0, 1.0]]),
        ("token_mask", None, 3.0, [[2.0, 0.0, 1.0], [0.125, 1.0, 1.0]]),
        ("token_mask", 0.5, None, [[2.0, 4.0, 1.0], [0.0, 1.0, 1.0]]),
        ("sequence_truncate", None, 3.0, [[3.0], [0.125]]),  # 2 x 4 = 8, capped; 1/8 x 1 x 1
        ("sequence_mask", None, 3.0, [[0.0], [0.125]]),
        ("sequence_mask", 0.2, 10.0, [[8.0], [0.0]]),
        ("sequence_truncate", None, None, [[8.0], [0.125]]),
    ],
)
def test_weights_by_mode_and_caps(mode, cap_min, cap_max, weights):
    got = engine_correction(OLD, BEHAVIOUR, MASK, mode, cap_max=cap_max, cap_min=cap_min)
    torch.testing.assert_close(got.weights, torch.tensor(weights))


def test_statistics_are_over_response_tokens_or_sequences():
    token = engine_correction(OLD, BEHAVIOUR, MASK, "token_truncate", cap_max=3.0).metrics
    # the gap over the 4 response tokens with a known behaviour log-prob: ln2, 2 ln2, 3 ln2, 0
    assert token["sampling/sampling_logp_difference/mean"].item() == pytest.approx(1.5 * LN2)
    assert token["sampling/sampling_logp_difference/max"].item() == pytest.approx(3 * LN2)
    # the ratio over the 5 response tokens (the NaN one counts, as 1): 2, 3, 0.125, 1, 1
    assert token["sampling/importance_sampling_ratio/mean"].item() == pytest.approx(7.125 / 5)
    assert (
        token["sampling/importance_sampling_ratio/min"].item(),
        token["sampling/importance_sampling_ratio/max"].item(),
    ) == (0.125, 3.0)
    sequence = engine_correction(OLD, BEHAVIOUR, MASK, "sequence_mask", cap_max=3.0).metrics
    assert sequence["sampling/importance_sampling_ratio/mean"].item() == pytest.approx(0.0625)  # (0 + 0.125) / 2


def test_the_same_policy_on_both_sides_weighs_every_token_one():
    logp = torch.randn(4, 6)
    mask = (torch.arange(6) < torch.tensor([[6], [3], [1], [4]])).long()
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        got = engine_correction(logp, logp.clone(), mask, mode)
        assert torch.equal(got.weights, torch.ones_like(got.weights))
        assert got.metrics["sampling/sampling_logp_difference/max"].item() == 0.0


def test_an_unknown_mode_is_named():
    with pytest.raises(ValueError, match="unknown engine correction mode 'token_clip'"):
        engine_correction(OLD, BEHAVIOUR, MASK, "token_clip")


def test_a_rollout_is_corrected_only_when_an_engine_gave_its_own_logprobs():
    from rlhf_core.config import RolloutConfig
    from rlhf_core.rl.engine_correction import CorrectionSettings, correct_rollout, correction_settings
    from rlhf_core.rollout.collect import Rollout

    ones = torch.ones(1, 2, dtype=torch.long)
    old = torch.tensor([[-1.0, -2.0]])
    rollout = Rollout(ones, ones, ones, ones, torch.tensor([1]), old, None, torch.tensor([True]), old - 0.1)
    assert correction_settings(RolloutConfig()) is None  # hf: the policy samples itself
    vllm = RolloutConfig(engine="vllm")
    assert correction_settings(vllm) == CorrectionSettings("sequence_mask", 3.0, None)
    corrected = correct_rollout(rollout, ones, correction_settings(vllm))
    assert corrected.weights.tolist() == [[pytest.approx(math.exp(0.2))]]
    measured = correct_rollout(rollout, ones, CorrectionSettings(None))  # correction none: logged, not applied
    assert measured.weights is None
    assert measured.metrics["sampling/sampling_logp_difference/mean"].item() == pytest.approx(0.1)
    assert (
        correct_rollout(
            Rollout(ones, ones, ones, ones, torch.tensor([1]), old, None, torch.tensor([True])),
            ones,
            CorrectionSettings(None),
        )
        is None
    )


def test_loss_weights_from_the_updates_own_pass_equal_the_whole_batchs_part_by_part():
    """With no trainer log-probs at sampling (one optimizer step per batch), each micro-batch's weights come from
    the update's own pass; they are the weights of the whole batch, and the statistics merge to the whole batch's."""
    from rlhf_core.rl.engine_correction import CorrectionSettings, LossWeights, correct_rollout
    from rlhf_core.rollout.collect import Rollout

    torch.manual_seed(0)
    old = -torch.rand(4, 3) * 2
    behaviour = old + 0.4 * torch.randn(4, 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    ones = torch.ones(4, 3, dtype=torch.long)
    stop = torch.ones(4, dtype=torch.bool)
    for settings in (CorrectionSettings("token_truncate", 1.2), CorrectionSettings("sequence_mask", 1.5, 0.5)):
        whole = correct_rollout(Rollout(ones, ones, ones, ones, stop, old, None, stop, behaviour), mask, settings)
        weights = LossWeights(Rollout(ones, ones, ones, ones, stop, None, None, stop, behaviour), mask, settings)
        parts = [weights.of(rows, old[rows].clone().requires_grad_()) for rows in (slice(0, 2), slice(2, 4))]
        torch.testing.assert_close(torch.cat(parts), whole.weights)
        merged, by_hand = weights.metrics(), whole.metrics
        for key in ("sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/max"):
            assert merged[key].item() == pytest.approx(by_hand[key].item())
        # the mean of the parts' means (equal-sized parts of equal token counts would make it the batch's mean)
        halves = [
            correct_rollout(
                Rollout(ones[r], ones[r], ones[r], ones[r], stop[r], old[r], None, stop[r], behaviour[r]),
                mask[r],
                settings,
            )
            for r in (slice(0, 2), slice(2, 4))
        ]
        mean = "sampling/importance_sampling_ratio/mean"
        assert merged[mean].item() == pytest.approx((halves[0].metrics[mean] + halves[1].metrics[mean]).item() / 2)
    in_step = LossWeights(
        Rollout(ones, ones, ones, ones, stop, None, None, stop), mask, CorrectionSettings("sequence_mask")
    )
    assert in_step.of(slice(0, 2), old[:2]) is None and in_step.metrics() == {}  # no behaviour policy: nothing


@pytest.mark.parametrize(
    ("algorithm", "beta", "updates", "engine", "staleness", "dropout_off", "at_sampling"),
    [
        ("ppo", 0.0, 1, "hf", 0, True, True),  # PPO: its KL penalty and entropy read them when the batch is scored
        ("grpo", 0.0, 1, "hf", 0, True, False),  # one update, in step: the update's own pass is the same numbers
        ("grpo", 0.04, 1, "hf", 0, True, False),  # grpo's KL is in the loss, not the reward
        ("grpo", 0.0, 2, "hf", 0, True, True),  # the policy moves between the batch's optimizer steps
        ("rloo", 0.04, 1, "hf", 0, True, True),  # rloo puts the KL into the reward, before any update
        ("rloo", 0.0, 1, "hf", 0, True, False),
        ("grpo", 0.0, 1, "vllm", 0, True, False),  # an engine apart, dropout off: the update's pass is the policy's
        ("grpo", 0.0, 1, "vllm", 0, False, True),  # with dropout on it is not: a pass of their own
        ("grpo", 0.0, 1, "hf", 1, False, True),  # generation ahead is off-policy too
        ("grpo", 0.0, 1, "hf", 0, False, False),  # in step, dropout or not, old is the update's own pass
    ],
)
def test_which_logprobs_are_old_is_decided_once_from_the_algorithm_updates_kl_and_engine(
    algorithm, beta, updates, engine, staleness, dropout_off, at_sampling
):
    from rlhf_core.config import RLConfig
    from rlhf_core.rl.engine_correction import old_logprobs_at_sampling

    rl = RLConfig(algorithm=algorithm, disable_dropout=dropout_off)
    rollout = RolloutConfig(engine=engine, max_staleness=staleness)
    assert old_logprobs_at_sampling(rl, beta, updates, rollout) is at_sampling


def test_the_old_logprobs_of_a_micro_batch_are_the_sampling_pass_or_the_updates_own_detached():
    from rlhf_core.rl.engine_correction import old_logprobs
    from rlhf_core.rollout.collect import Rollout

    ones, stop = torch.ones(3, 2), torch.ones(3, dtype=torch.bool)
    logp = torch.full((2, 2), -0.5, requires_grad=True)
    sampled = Rollout(
        ones, ones, ones, ones, stop, torch.tensor([[-1.0, -2.0], [-3.0, -4.0], [-5.0, -6.0]]), None, stop
    )
    assert old_logprobs(sampled, slice(1, 3), logp).tolist() == [[-3.0, -4.0], [-5.0, -6.0]]
    own = old_logprobs(Rollout(ones, ones, ones, ones, stop, None, None, stop), slice(0, 2), logp)
    assert own.tolist() == [[-0.5, -0.5]] * 2 and not own.requires_grad
