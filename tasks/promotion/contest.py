"""The candidate against its opponent (the champion, or with none its start) on the same held-out prompts, sampled
with the same seeds (`evaluate_version`), then prompt by prompt: a pointwise evaluator's values compared, or the
pairwise judge asked in both orders. The outcomes become a `Comparison` (win rate and its bootstrap interval) and
one row per prompt for the report."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_core.config import PipelineConfig
from rlhf_core.config.errors import UserError
from rlhf_core.data.chat import extra_columns, prompt_columns, shown_prompt
from rlhf_core.data.tool_calls import holds_transcripts
from rlhf_core.evaluation.pairwise import VERDICTS, compare, judged_outcome, pointwise_outcome
from rlhf_core.evaluation.promotion import Comparison, eval_kl
from rlhf_core.rewards.remote import Unscored
from rlhf_core.rewards.remote_scorers import plain_text
from tasks.promotion.evaluator import Judging, check_judge_columns
from tasks.stages.data import PreparedData
from tasks.stages.version_evaluation import VersionScoring, evaluate_version, held_out_rows


@dataclass(frozen=True)
class Contestants:
    """The candidate's and the opponent's models:/ URIs (or a base model's path), the opponent's label
    ('champion v3', 'its start ...'), whether it is the champion, and the reference the KL is measured to."""

    candidate: str
    opponent: str
    label: str
    champion: bool
    reference: str | None


@dataclass(frozen=True)
class Contest:
    comparison: Comparison
    rows: list[dict]  # per prompt: prompt, both completions, their values or the judge's answers, the verdict
    summaries: dict[str, dict[str, float]]  # 'candidate' and 'opponent' -> eval summary
    transcripts: bool = False  # the completions are tool episodes (their table needs the legend)


def run_contest(cfg: PipelineConfig, data: PreparedData, judging: Judging, who: Contestants) -> Contest:
    """Both sampled and scored, then compared prompt by prompt; a judge's faults end it in one sentence."""
    evaluator = judging.evaluator
    prompt_rows = held_out_rows(cfg, data)
    check_judge_columns(judging, set(extra_columns(prompt_rows)))
    metrics = tuple(dict.fromkeys([*evaluator.metrics, *cfg.eval.metrics]))  # eval.metrics: gold, the verifier
    scoring = VersionScoring(who.reference, judging.reward_model, metrics, prompt_rows)
    candidate_summary, candidate = evaluate_version(cfg, data, who.candidate, scoring)
    opponent_summary, opponent = evaluate_version(cfg, data, who.opponent, scoring)
    prompts = shown_prompts(prompt_rows)
    if evaluator.column is None:
        rows, outcomes = _judged(judging, prompts, prompt_rows, (candidate, opponent))
        means = {}
    else:
        rows, outcomes = _pointwise(evaluator.column, prompts, candidate, opponent)
        means = {
            "candidate_mean": candidate_summary.get(f"eval/{evaluator.column}_mean"),
            "opponent_mean": opponent_summary.get(f"eval/{evaluator.column}_mean"),
        }
    if not outcomes:
        raise UserError(f"promote.evaluator: no prompt of {len(prompt_rows)} could be compared (every one unscored)")
    comparison = Comparison(
        opponent=who.label,
        champion=who.champion,
        result=compare(outcomes, seed=cfg.run.seed, resamples=cfg.promote.resamples),
        kl=eval_kl(candidate_summary),
        column=evaluator.column,
        **means,
    )
    summaries = {"candidate": candidate_summary, "opponent": opponent_summary}
    return Contest(comparison, rows, summaries, transcripts=holds_transcripts(candidate))


def shown_prompts(prompt_rows: list[dict]) -> list[str]:
    """Each held-out prompt as a person (and a judge) reads it: a conversation's messages, not the chat template's
    rendering of them; a templated prompt without its messages as `shown_prompt` strips it (plain text passes)."""
    prompts, messages = prompt_columns(prompt_rows)
    return [plain_text(m) for m in messages] if messages is not None else [shown_prompt(p) for p in prompts]


def _pointwise(
    column: str, prompts: list[str], candidate: list[dict], opponent: list[dict]
) -> tuple[list[dict], list[float]]:
    rows, outcomes = [], []
    for prompt, mine, theirs in zip(prompts, candidate, opponent):
        if mine.get(column) is None or theirs.get(column) is None:
            raise UserError(f"promote.evaluator: the evaluation has no {column!r} for prompt {len(rows)}")
        outcome = pointwise_outcome(float(mine[column]), float(theirs[column]))
        rows.append(
            {
                "prompt": prompt,
                "opponent": plain_text(theirs["completion"]),
                "candidate": plain_text(mine["completion"]),
                f"opponent {column}": float(theirs[column]),
                f"candidate {column}": float(mine[column]),
                "verdict": VERDICTS[outcome],
            }
        )
        outcomes.append(outcome)
    return rows, outcomes


def _judged(judging: Judging, prompts: list[str], prompt_rows: list[dict], both: tuple) -> tuple[list[dict], list]:
    """Each pair asked twice (the candidate's completion as completion_a, then the opponent's); a prompt the judge
    could not answer in either order (on_failure drop_group) is left out, and says so in its row."""
    mine, theirs = ([plain_text(row["completion"]) for row in rows] for rows in both)
    columns = extra_columns(prompt_rows)
    extra = [{k: v[i] for k, v in columns.items()} for i in range(len(prompts))]
    first = judging.judge.prefer(prompts, mine, theirs, extra)
    second = judging.judge.prefer(prompts, theirs, mine, extra)
    rows, outcomes = [], []
    for prompt, a, b, one, two in zip(prompts, mine, theirs, first, second):
        row = {"prompt": prompt, "opponent": b, "candidate": a}
        if isinstance(one, Unscored) or isinstance(two, Unscored):
            reason = (one if isinstance(one, Unscored) else two).reason
            rows.append({**row, "candidate first": "", "opponent first": "", "verdict": f"left out: {reason}"})
            continue
        outcome = judged_outcome(one, two)
        rows.append(
            {**row, "candidate first": _side(one), "opponent first": _side(1 - two), "verdict": VERDICTS[outcome]}
        )
        outcomes.append(outcome)
    return rows, outcomes


def _side(candidate_preference: float) -> str:
    """Whom one order's answer prefers, said from the candidate's side."""
    return "candidate" if candidate_preference > 0.5 else "opponent" if candidate_preference < 0.5 else "tie"
