"""The prompt-by-prompt comparison: outcomes, the win rate with ties as half, the bootstrap interval's coverage."""

import numpy as np
import pytest

from rlhf_core.evaluation.pairwise import LOSS, TIE, WIN, compare, judged_outcome, pointwise_outcome


def test_pointwise_outcomes_and_nan_refused():
    assert [pointwise_outcome(0.7, 0.2), pointwise_outcome(0.2, 0.7), pointwise_outcome(0.5, 0.5)] == [WIN, LOSS, TIE]
    with pytest.raises(ValueError, match="not finite"):
        pointwise_outcome(float("nan"), 0.0)


def test_a_judge_must_agree_with_itself_in_both_orders():
    # preferences for the completion shown first: candidate first, then opponent first
    assert judged_outcome(0.9, 0.1) == WIN  # both orders pick the candidate
    assert judged_outcome(0.1, 0.9) == LOSS  # both pick the opponent
    assert judged_outcome(1.0, 1.0) == TIE  # always the first shown: a flip with the order
    assert judged_outcome(0.0, 0.0) == TIE  # always the second shown
    assert judged_outcome(0.5, 0.0) == TIE  # a tie in one order, the candidate in the other
    assert judged_outcome(0.5, 0.5) == TIE


def test_counts_and_win_rate_count_ties_half_by_hand():
    result = compare([WIN, WIN, TIE, LOSS], seed=0, resamples=1000)
    assert (result.wins, result.ties, result.losses, result.n) == (2, 1, 1, 4)
    assert result.win_rate == pytest.approx((2 + 0.5) / 4)
    assert 0.0 <= result.ci_low <= result.win_rate <= result.ci_high <= 1.0
    assert result.summary() == (
        f"win rate 0.625 [{result.ci_low:.3f}, {result.ci_high:.3f}] over 4 prompts (2 wins, 1 ties, 1 losses)"
    )


def test_the_interval_is_seeded():
    outcomes = list(np.random.default_rng(0).choice([WIN, TIE, LOSS], size=51))
    assert compare(outcomes, seed=3, resamples=150) == compare(outcomes, seed=3, resamples=150)
    assert {compare(outcomes, seed=s, resamples=150).ci_low for s in range(5)} != {compare(outcomes, seed=3).ci_low}
    assert compare([WIN] * 10, seed=0).ci_low == 1.0  # no spread, no width


def test_the_interval_covers_a_known_win_rate_in_at_least_93_of_100_repetitions():
    covered = 0
    for repetition in range(100):
        rng = np.random.default_rng(1000 + repetition)
        outcomes = rng.choice([WIN, TIE, LOSS], size=100, p=[0.5, 0.2, 0.3])  # win rate 0.5 + 0.2 / 2 = 0.6
        result = compare(outcomes, seed=repetition, resamples=2000)
        covered += result.ci_low <= 0.6 <= result.ci_high
    assert covered >= 93


def test_bad_outcomes_are_refused():
    with pytest.raises(ValueError, match="no prompt was compared"):
        compare([], seed=0)
    with pytest.raises(ValueError, match="not a win"):
        compare([0.3], seed=0)
