"""A served judge asked which of two completions of a prompt is better (promote.evaluator.judge): the template filled
with {prompt}, {completion_a} and {completion_b}, sent as a grpo.rewards judge's request is (`remote_scorers`), its
answer parsed on the judge's scale and placed in [0, 1] as its preference for completion_a."""

from __future__ import annotations

from collections.abc import Sequence

from rlhf_core.config.evaluation import PairwiseJudge
from rlhf_core.rewards.remote import Unscored
from rlhf_core.rewards.remote_scorers import RemoteScorer, apply_failure_policy, judge_answer, judge_body, parse_judge

FIELD = "promote.evaluator.judge"


def preference(value: float, low: float, high: float) -> float:
    """A judge's answer on its [low, high] scale as its preference for the first completion shown, in [0, 1]:
    above 0.5 it prefers the first, below it the second, 0.5 is a tie."""
    return (value - low) / (high - low)


def pairwise_question(template: str, prompt: str, first: str, second: str, row: dict) -> str:
    """The template filled with the prompt, the two completions (first as completion_a) and the row's columns."""
    return template.format_map({**row, "prompt": prompt, "completion_a": first, "completion_b": second})


class PairwiseJudgeCaller(RemoteScorer):
    """`prefer(prompts, firsts, seconds, rows)`: per prompt the judge's preference for the first completion in
    [0, 1], or Unscored (kept with on_failure drop_group: that prompt is left out), after the failure policy."""

    def __init__(self, judge: PairwiseJudge, post=None):
        super().__init__(judge, judge.url, field=FIELD, post=post)

    def prefer(
        self, prompts: Sequence[str], firsts: Sequence[str], seconds: Sequence[str], rows: Sequence[dict]
    ) -> list:
        judge = self.source
        low, high = judge.bounds()
        questions = [pairwise_question(judge.template, *fields) for fields in zip(prompts, firsts, seconds, rows)]
        values = self.caller.call_all(
            [judge_body(judge, q) for q in questions],
            lambda answer: parse_judge(judge_answer(answer, judge.api), judge.score_range, judge.labels),
        )
        values = apply_failure_policy(judge, values, field=FIELD, stats=self.stats)  # failure_score: on its scale
        return [v if isinstance(v, Unscored) else preference(v, low, high) for v in values]
