"""The promotion decision: does the candidate policy replace the champion? Pure, so it is tested by value.

Inputs are eval summaries (`eval/<column>_mean`, as `evaluation.summarize_rows` makes them) of the
candidate and, when there is one, the champion, measured on the same held-out prompts with the same
reward model, metric functions and reference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rlhf_core.config.base import ConfigError
from rlhf_core.config.evaluation import Gates


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str
    candidate_value: float
    champion_value: float | None
    candidate_kl: float | None


# the eval columns of the KL to the reference (rlhf_core/evaluation/generations.py), the one to trust first: exact, else
# the sampling estimators k3, k1
EVAL_KL_COLUMNS = ("kl_exact", "kl_k3", "kl")


def eval_kl(summary: dict[str, float]) -> float | None:
    """An evaluation summary's KL to the reference: the exact one's mean when measured, else k3's, else k1's."""
    return next((summary[k] for c in EVAL_KL_COLUMNS if summary.get(k := f"eval/{c}_mean") is not None), None)


def _mean(summary: dict[str, float], column: str) -> float | None:
    return summary.get(f"eval/{column}_mean")


def decide(
    candidate: dict[str, float], champion: dict[str, float] | None, gates: Gates, broken: Sequence[str] = ()
) -> Decision:
    """Promote when the candidate broke no guard rule during training (`broken`: the rules its checkpoint's
    evaluation broke), its KL to the reference (`eval_kl`: exact when measured, else k3, else k1)
    stays at or under max_kl, its metric reaches min_value (when set) and, with a champion, beats the
    champion's by at least min_improvement (when set) or is strictly higher (when min_improvement is None)."""
    value = _mean(candidate, gates.metric)
    if value is None:
        raise ConfigError(
            f"promote.metric {gates.metric!r}: the evaluation has no column {gates.metric!r} "
            f"(it has {', '.join(sorted(candidate)) or 'nothing'})"
        )
    kl = eval_kl(candidate)
    champion_value = _mean(champion, gates.metric) if champion is not None else None

    def verdict(promote: bool, reason: str) -> Decision:
        return Decision(promote, reason, value, champion_value, kl)

    rules = [rule for rule in broken if rule]
    if rules:
        return verdict(
            False,
            f"the candidate broke guard rule{'s' if len(rules) > 1 else ''} {', '.join(rules)} at its evaluation "
            "during training (its version's guard.broken tag); export a checkpoint that passed, or loosen guard.*",
        )
    if gates.max_kl is not None and kl is not None and kl > gates.max_kl:
        return verdict(False, f"KL to the reference {kl:.3f} exceeds promote.max_kl {gates.max_kl}")
    if not math.isfinite(value):
        return verdict(False, f"{gates.metric} is {value} (not finite)")
    if gates.min_value is not None and value < gates.min_value:
        where = "no champion yet" if champion is None else "an absolute floor"
        return verdict(False, f"{gates.metric} {value:.4f} is below promote.min_value {gates.min_value} ({where})")
    if champion is None:
        return verdict(True, f"no champion yet; {gates.metric} {value:.4f} passes the absolute gates")
    if champion_value is None:
        raise ConfigError(f"the champion's evaluation has no column {gates.metric!r}")
    gain = value - champion_value
    if gates.min_improvement is None and not gain > 0:
        return verdict(
            False,
            f"{gates.metric} {value:.4f} vs champion {champion_value:.4f}: gain {gain:+.4f} is not above 0 "
            "(promote.min_improvement is null)",
        )
    if gates.min_improvement is not None and gain < gates.min_improvement:
        return verdict(
            False,
            f"{gates.metric} {value:.4f} vs champion {champion_value:.4f}: gain {gain:+.4f} is below "
            f"promote.min_improvement {gates.min_improvement}",
        )
    return verdict(True, f"{gates.metric} {value:.4f} vs champion {champion_value:.4f}: gain {gain:+.4f}")


# the before/after table of a run: (label, summary column, format); "{gold}" is the gold metric's name
ALIGNMENT_ROWS = [
    ("gold ({gold})", "eval/{gold}_mean", "{:.3f}"),
    ("proxy (reward model score)", "eval/score_mean", "{:.3f}"),
    ("eval KL to the initial policy (exact, nats: mean)", "eval/kl_exact_mean", "{:.3f}"),
    ("eval KL: median of the completions", "eval/kl_exact_median", "{:.3f}"),
    ("eval KL: p90 of the completions", "eval/kl_exact_p90", "{:.3f}"),
    ("eval KL estimate k3 (diagnostic)", "eval/kl_k3_mean", "{:.3f}"),
    ("mean completion length (tokens)", "eval/length_mean", "{:.2f}"),
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
    if 0 not in history or step not in history:
        return ""
    lines = [
        f"| | before (step 0) | after (step {step}) | after / before |",
        "|---|---|---|---|",
        *(f"| {' | '.join(row)} |" for row in alignment_rows(history[0], history[step], gold)),
        "",
        f"Guard: {len(guard_triggers)} trigger(s)" + "".join(f"\n- {t}" for t in guard_triggers[:10]),
    ]
    return "\n".join(lines)
