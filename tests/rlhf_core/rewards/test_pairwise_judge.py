"""promote.evaluator.judge: both completions in one question, the answer placed on [0, 1], failures by policy."""

import pytest

from rlhf_core.config.evaluation import PairwiseJudge
from rlhf_core.evaluation.pairwise import LOSS, TIE, WIN, judged_outcome
from rlhf_core.rewards.pairwise_judge import PairwiseJudgeCaller
from rlhf_core.rewards.remote import RemoteRewardError, Unscored

TEMPLATE = "Q: {prompt} ({topic})\nA: {completion_a}\nB: {completion_b}\nBetter?"


def judge(**extra) -> PairwiseJudge:
    fields = {
        "url": "http://j/v1",
        "judge_model": "j",
        "template": TEMPLATE,
        "labels": {"A": 1.0, "B": 0.0, "tie": 0.5},
    }
    return PairwiseJudge(**(fields | extra))


def biased_to_longer(url, body, headers, timeout_s):
    """Names the longer completion (A on a tie of lengths), as a judge with a length bias would."""
    text = body["messages"][0]["content"]
    a = text.split("\nA: ")[1].split("\nB: ")[0]
    b = text.split("\nB: ")[1].split("\nBetter?")[0]
    return {"choices": [{"message": {"content": "A" if len(a) >= len(b) else "B."}}]}


def test_the_question_shows_both_completions_and_the_rows_columns():
    seen = []

    def post(url, body, headers, timeout_s):
        seen.append((url, body["messages"][0]["content"], body["temperature"]))
        return {"choices": [{"message": {"content": "tie"}}]}

    caller = PairwiseJudgeCaller(judge(), post=post)
    assert caller.prefer(["p"], ["one"], ["two"], [{"topic": "t"}]) == [0.5]
    assert seen == [("http://j/v1/chat/completions", "Q: p (t)\nA: one\nB: two\nBetter?", 0.0)]


def test_asked_in_both_orders_a_position_or_length_bias_becomes_a_tie_or_its_verdict():
    caller = PairwiseJudgeCaller(judge(), post=biased_to_longer)
    mine, theirs = ["a much longer answer", "same"], ["short", "same"]
    first = caller.prefer(["p", "q"], mine, theirs, [{"topic": "t"}] * 2)
    second = caller.prefer(["p", "q"], theirs, mine, [{"topic": "t"}] * 2)
    # the longer one wins in both orders; equal lengths: always A, a flip with the order, so a tie
    assert [judged_outcome(a, b) for a, b in zip(first, second)] == [WIN, TIE]
    assert (
        judged_outcome(
            *PairwiseJudgeCaller(judge(), post=biased_to_longer).prefer(["p"], ["s"], ["longer"], [{"topic": "t"}]), 1.0
        )
        == LOSS
    )


def test_a_score_range_is_placed_between_its_ends():
    ranged = judge(labels=None, score_range=[1.0, 9.0])
    caller = PairwiseJudgeCaller(ranged, post=lambda *a: {"choices": [{"message": {"content": "7 of 9"}}]})
    assert caller.prefer(["p"], ["a"], ["b"], [{"topic": "t"}]) == [pytest.approx(0.75)]


def test_unparseable_answers_follow_the_failure_policy():
    babble = lambda *a: {"choices": [{"message": {"content": "hmm"}}]}  # noqa: E731
    with pytest.raises(RemoteRewardError, match=r"promote.evaluator.judge.on_failure is fail"):
        PairwiseJudgeCaller(judge(), post=babble).prefer(["p"], ["a"], ["b"], [{"topic": "t"}])
    dropped = PairwiseJudgeCaller(judge(on_failure="drop_group"), post=babble)
    assert isinstance(dropped.prefer(["p"], ["a"], ["b"], [{"topic": "t"}])[0], Unscored)
    scored = PairwiseJudgeCaller(judge(on_failure="score", failure_score=0.5), post=babble)
    assert scored.prefer(["p"], ["a"], ["b"], [{"topic": "t"}]) == [0.5]  # on the judge's scale: a tie


def test_credentials_come_from_the_environment_and_a_missing_one_is_named(monkeypatch):
    monkeypatch.delenv("JUDGE_KEY", raising=False)
    with pytest.raises(RemoteRewardError, match="environment variable JUDGE_KEY"):
        PairwiseJudgeCaller(judge(api_key_env="JUDGE_KEY"))
    monkeypatch.setenv("JUDGE_KEY", "s3cret")
    seen = []
    caller = PairwiseJudgeCaller(
        judge(api_key_env="JUDGE_KEY"),
        post=lambda u, b, h, t: seen.append(h) or {"choices": [{"message": {"content": "A"}}]},
    )
    assert caller.prefer(["p"], ["a"], ["b"], [{"topic": "t"}]) == [1.0]
    assert seen == [{"Authorization": "Bearer s3cret"}]
