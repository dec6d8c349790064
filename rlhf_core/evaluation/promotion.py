"""The promotion decision: does the candidate policy replace the champion? Pure, so it is tested by value.

Its input is a `Comparison`: the candidate against an opponent (the champion, or with none yet the policy the
candidate started from) on the same held-out prompts, prompt by prompt (`rlhf_core.evaluation.pairwise`), with the
candidate's KL to its reference and, for a pointwise evaluator, both means.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rlhf_core.config.evaluation import Gates
from rlhf_core.evaluation.pairwise import PairwiseResult


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str


@dataclass(frozen=True)
class Comparison:
    """The candidate against `opponent` (a label: 'champion v3', 'its start ...'); `champion`: the opponent is the
    champion. `column` and the means: a pointwise evaluator's (None for a pairwise judge)."""

    opponent: str
    champion: bool
    result: PairwiseResult
    kl: float | None
    column: str | None = None
    candidate_mean: float | None = None
    opponent_mean: float | None = None

    @property
    def by_win_rate(self) -> bool:
        """Whether the win rate gates: against a champion always; with none, for a judge (which has no mean)."""
        return self.champion or self.column is None


# the eval columns of the KL to the reference (rlhf_core/evaluation/generations.py), the one to trust first: exact, else
# the sampling estimators k3, k1
EVAL_KL_COLUMNS = ("kl_exact", "kl_k3", "kl")


def eval_kl(summary: dict[str, float]) -> float | None:
    """An evaluation summary's KL to the reference: the exact one's mean when measured, else k3's, else k1's."""
    return next((summary[k] for c in EVAL_KL_COLUMNS if summary.get(k := f"eval/{c}_mean") is not None), None)


def decide(comparison: Comparison, gates: Gates, broken: Sequence[str] = ()) -> Decision:
    """Promote when the candidate broke no guard rule during training (`broken`: the rules its checkpoint's
    evaluation broke), its KL to the reference stays at or under max_kl, a pointwise evaluator's mean reaches
    min_value (when set) and, against a champion (or, with none, for a judge against its start), the lower bound
    of its win rate's 95% interval is above min_win_rate: better than the opponent with 95% confidence."""
    rules = [rule for rule in broken if rule]
    if rules:
        return Decision(
            False,
            f"the candidate broke guard rule{'s' if len(rules) > 1 else ''} {', '.join(rules)} at its evaluation "
            "during training (its version's guard.broken tag); export a checkpoint that passed, or loosen guard.*",
        )
    kl = comparison.kl
    if gates.max_kl is not None and kl is not None and kl > gates.max_kl:
        return Decision(False, f"KL to the reference {kl:.3f} exceeds promote.max_kl {gates.max_kl}")
    mean = comparison.candidate_mean
    if comparison.column is not None:
        if mean is None or not math.isfinite(mean):
            return Decision(False, f"the candidate's mean {comparison.column} is {mean} (not finite)")
        if gates.min_value is not None and mean < gates.min_value:
            return Decision(False, f"mean {comparison.column} {mean:.4f} is below promote.min_value {gates.min_value}")
    result = comparison.result
    against = f"against {comparison.opponent}: {result.summary()}"
    if not comparison.by_win_rate:
        return Decision(True, f"no champion yet; mean {comparison.column} {mean:.4f} passes the gates ({against})")
    if result.ci_low > gates.min_win_rate:
        return Decision(True, f"{against}; its lower bound is above promote.min_win_rate {gates.min_win_rate}")
    return Decision(
        False,
        f"{against}; its lower bound {result.ci_low:.3f} is not above promote.min_win_rate {gates.min_win_rate}, "
        "so it is not better with 95% confidence",
    )


# the before/after table of a run: (label, summary column, format); "{gold}" is the gold metric's name
ALIGNMENT_ROWS = [
    ("gold ({gold})", "eval/{gold}_mean", "{:.3f}"),
    ("proxy (reward model score)", "eval/score_mean", "{:.3f}"),
    ("eval KL to the initial policy (exact, nats: mean)", "eval/kl_exact_mean", "{:.3f}"),
    ("eval KL: median of the completions", "eval/kl_exact_median", "{:.3f}"),
    ("eval KL: p90 of the completions", "eval/kl_exact_p90", "{:.3f}"),
    ("eval KL estimate k3 (diagnostic)", "eval/kl_k3_mean", "{:.3f}"),
    ("mean length (tokens, stop token not counted)", "eval/length_mean", "{:.2f}"),
    ("distinct-2", "eval/distinct_2", "{:.3f}"),
    ("repeated bigram rate", "eval/repeated_ngram_rate", "{:.3f}"),
    ("completions that stop", "eval/stop_rate", "{:.2f}"),
]
# the guard's ratios to the initial policy, which the RL stage's evaluations already carry
RATIOS = {"eval/length_mean": "eval/length_ratio", "eval/distinct_2": "eval/distinct_2_ratio"}


def alignment_rows(before: dict[str, float], after: dict[str, float], gold: str | None) -> list[tuple[str, ...]]:
    """(label, before, after, after/before) as text for each ALIGNMENT_ROWS column both evaluations hold."""
    rows = []
    for label, key, fmt in ALIGNMENT_ROWS:
        key = key.format(gold=gold)
        if key in before and key in after:
            ratio = f"{after[RATIOS[key]]:.2f}" if RATIOS.get(key) in after else ""
            rows.append((label.format(gold=gold), fmt.format(before[key]), fmt.format(after[key]), ratio))
    return rows


def alignment_markdown(
    history: dict[int, dict[str, float]], step: int, gold: str | None, guard_triggers: list[str]
) -> str:
    """The before (step 0) / after (`step`) table and the guard's verdict as Markdown: what a model version's
    description and the flow's summary artifact say. Empty when the history has no step 0 or no `step`."""
    from rlhf_core.data.markdown import markdown_table

    if 0 not in history or step not in history:
        return ""
    header = ("", "before (step 0)", f"after (step {step})", "after / before")
    lines = [
        *markdown_table(header, alignment_rows(history[0], history[step], gold)),
        "",
        f"Guard: {len(guard_triggers)} trigger(s)" + "".join(f"\n- {t}" for t in guard_triggers[:10]),
    ]
    return "\n".join(lines)
