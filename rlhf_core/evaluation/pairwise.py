"""Two policies compared prompt by prompt: each prompt's outcome for the candidate (win 1, tie 0.5, loss 0), the
win rate (ties count half) and its seeded bootstrap 95% interval. Pure, so it is tested by value.

Outcomes come from a pointwise evaluator (a score or metric of each policy's completion of the same prompt:
`pointwise_outcome`) or a pairwise judge asked in both orders (`judged_outcome`: a verdict that flips with the
order is a tie)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

WIN, TIE, LOSS = 1.0, 0.5, 0.0
VERDICTS = {WIN: "win", TIE: "tie", LOSS: "loss"}
LEVEL = 0.95
CHUNK = 1000  # resamples drawn at once


def pointwise_outcome(candidate: float, opponent: float) -> float:
    """Win when the candidate's value of a prompt is higher, loss when lower, tie when equal; ValueError for a
    value that is not finite (nothing is compared against NaN)."""
    if not (math.isfinite(candidate) and math.isfinite(opponent)):
        raise ValueError(f"a value is not finite (candidate {candidate}, opponent {opponent})")
    return WIN if candidate > opponent else LOSS if candidate < opponent else TIE


def _side(first_preferred: float) -> int:
    return 1 if first_preferred > 0.5 else -1 if first_preferred < 0.5 else 0


def judged_outcome(candidate_shown_first: float, opponent_shown_first: float) -> float:
    """The candidate's outcome from a judge's two preferences for the first completion shown: with the candidate's
    completion first, then with the opponent's first. A win when both orders pick the candidate, a loss when both
    pick the opponent; a tie otherwise (a tie in either order, or a verdict that flips with the order)."""
    first, second = _side(candidate_shown_first), -_side(opponent_shown_first)
    if first == second == 1:
        return WIN
    if first == second == -1:
        return LOSS
    return TIE


@dataclass(frozen=True)
class PairwiseResult:
    wins: int
    ties: int
    losses: int
    win_rate: float  # ties count half
    ci_low: float
    ci_high: float

    @property
    def n(self) -> int:
        return self.wins + self.ties + self.losses

    def summary(self) -> str:
        """'win rate 0.62 [0.51, 0.73] over 64 prompts (30 wins, 20 ties, 14 losses)'."""
        return (
            f"win rate {self.win_rate:.3f} [{self.ci_low:.3f}, {self.ci_high:.3f}] over {self.n} prompts "
            f"({self.wins} wins, {self.ties} ties, {self.losses} losses)"
        )


def compare(outcomes: Sequence[float], *, seed: int, resamples: int = 10_000) -> PairwiseResult:
    """Wins, ties, losses, the win rate and its percentile bootstrap 95% interval: `resamples` draws of n outcomes
    with replacement from a generator seeded with `seed` (the same outcomes and seed, the same interval)."""
    values = np.asarray(outcomes, dtype=np.float64)
    if values.size == 0:
        raise ValueError("no prompt was compared")
    if not np.isin(values, (WIN, TIE, LOSS)).all():
        raise ValueError("an outcome is not a win (1), tie (0.5) or loss (0)")
    rng = np.random.default_rng(seed)
    means = np.concatenate(  # in chunks, so that many prompts never hold resamples x n indices at once
        [
            values[rng.integers(0, values.size, size=(min(CHUNK, resamples - i), values.size))].mean(axis=1)
            for i in range(0, resamples, CHUNK)
        ]
    )
    tail = (1 - LEVEL) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return PairwiseResult(
        wins=int((values == WIN).sum()),
        ties=int((values == TIE).sum()),
        losses=int((values == LOSS).sum()),
        win_rate=float(values.mean()),
        ci_low=float(low),
        ci_high=float(high),
    )
