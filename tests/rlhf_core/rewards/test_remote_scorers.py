"""rlhf_core/rewards/remote_scorers.py: the judge's question and its parser (a number in a range, a label), the JSON
path of a plain scorer, a served reward model's answer, the failure policies, and each kind end to end against
a loopback scorer (tests/fixtures/scorers.py); and score_sources dropping a group a served source left unscored."""

import pytest
import torch

from rlhf_core.config import RewardSource
from rlhf_core.rewards.remote import RemoteRewardError, SourceStats, Unscored
from rlhf_core.rewards.remote_scorers import (
    RemoteScorer,
    apply_failure_policy,
    endpoint,
    json_at,
    judge_body,
    judge_question,
    missing_template_columns,
    model_scores,
    parse_judge,
)
from rlhf_core.rewards.sources import RewardSourceFn, remote_reward, score_sources, source_metrics
from tests.fixtures.scorers import scorer_in_thread

TEMPLATE = "Rate the reply to '{prompt}' (topic {topic}) from 0 to 10.\nCompletion: {completion}"


def judge(url="http://127.0.0.1:1/v1", **extra) -> RewardSource:
    fields = dict(name="judge", kind="judge", url=url, judge_model="j", template=TEMPLATE, score_range=[0, 10])
    return RewardSource(**(fields | {"max_retries": 0, "backoff_s": 0.0} | extra))


@pytest.mark.parametrize(
    ("text", "score"),
    [("Score: 7", 7.0), ("7/10, because", 7.0), ("I'd say 3.5.", 3.5), ("-1", None), ("11", None), ("great!", None)],
)
def test_a_judges_number_must_be_in_its_range(text, score):
    if score is None:
        with pytest.raises(ValueError):
            parse_judge(text, [0, 10], None)
    else:
        assert parse_judge(text, [0, 10], None) == score


def test_a_judges_label_is_its_first_word_and_anything_else_is_a_parse_failure():
    labels = {"Yes": 1.0, "no": 0.0}
    assert parse_judge("YES.", None, labels) == 1.0 and parse_judge(" no, it is rude", None, labels) == 0.0
    with pytest.raises(ValueError, match="none of the labels"):
        parse_judge("Maybe yes", None, labels)


def test_the_question_and_the_request():
    source = judge(api="completions")
    question = judge_question(TEMPLATE, "Hi", "Hello!", {"topic": "food", "prompt": "ignored"})
    assert question == "Rate the reply to 'Hi' (topic food) from 0 to 10.\nCompletion: Hello!"
    assert judge_body(source, question) == {"model": "j", "max_tokens": 16, "temperature": 0.0, "prompt": question}
    assert judge_body(judge(), "q")["messages"] == [{"role": "user", "content": "q"}]
    forced = judge_body(judge(request_params={"structured_outputs": {"choice": ["good", "bad"]}, "seed": 3}), "q")
    assert forced["structured_outputs"] == {"choice": ["good", "bad"]} and forced["seed"] == 3
    assert endpoint(judge(), "http://h:1/v1/") == "http://h:1/v1/chat/completions"
    assert endpoint(source, "http://h:1/v1/completions") == "http://h:1/v1/completions"
    assert (
        missing_template_columns(judge(), {"answer"}) == ["topic"]
        and missing_template_columns(judge(), {"topic"}) == []
    )


def test_json_paths_and_model_answers():
    assert json_at({"result": {"scores": [0.5, 2]}}, "result.scores.1") == 2.0
    for answer, path in [({"a": 1}, "b"), ({"a": "x"}, "a"), ({"a": True}, "a"), ([1], "0.x")]:
        with pytest.raises(ValueError):
            json_at(answer, path)
    assert model_scores({"predictions": [{"score": 1.5}, {"score": -2}]}, 2) == [1.5, -2.0]
    assert model_scores([0.1], 1) == [0.1]
    with pytest.raises(ValueError, match="expected 2 predictions"):
        model_scores({"predictions": [{"score": 1}]}, 2)


def test_the_failure_policies():
    values = [1.0, Unscored("HTTP 503 (after 4 attempts)"), Unscored("no number", parse_failure=True)]
    stats = SourceStats("j")
    with pytest.raises(
        RemoteRewardError, match=r"reward judge could not score completion 1 of 3 \(2 failed\): HTTP 503"
    ):
        apply_failure_policy(judge(), values, field="grpo.rewards[0]", stats=stats)
    assert apply_failure_policy(judge(on_failure="score", failure_score=-1.0), values, field="f", stats=stats) == [
        1.0,
        -1.0,
        -1.0,
    ]
    assert apply_failure_policy(judge(on_failure="drop_group"), values, field="f", stats=stats) == values
    counts = stats.pop()
    assert (counts["rewards/j/failures"], counts["rewards/j/parse_failures"]) == (6.0, 3.0)


def test_a_judge_scores_over_chat_and_completions_and_its_parse_failures_follow_the_policy():
    prompts, completions = ["Hi", "Hi"], ["what a wonderful day", "this is awful"]
    with scorer_in_thread() as (url, behaviour):
        for api in ("chat", "completions"):
            scorer = RemoteScorer(judge(url + "/v1", api=api), url + "/v1", field="grpo.rewards[0]")
            assert scorer(prompts, completions, topic=["a", "b"]) == [8.0, 3.0]  # VADER 0.57 and -0.48 on 0..10
        assert behaviour.seen[0]["path"] == "/v1/chat/completions" and behaviour.seen[2]["path"] == "/v1/completions"
        behaviour.mode = "words"
        scorer = RemoteScorer(judge(url + "/v1", on_failure="drop_group"), url + "/v1", field="f")
        out = scorer(prompts, completions, topic=["a", "b"])
    assert all(isinstance(v, Unscored) and v.parse_failure for v in out)
    assert scorer.stats.pop()["rewards/judge/parse_failures"] == 2.0


def test_a_plain_scorer_gets_the_rows_columns_and_its_score_path():
    source = RewardSource(name="h", kind="http", url="http://x", score_path="result.score")
    with scorer_in_thread() as (url, behaviour):
        scorer = RemoteScorer(source, url + "/score", field="f")
        assert scorer(["p"], ["good"], answer=["42"]) == [pytest.approx(0.4404, abs=1e-4)]
    assert behaviour.seen[0]["body"] == {"answer": "42", "prompt": "p", "completion": "good"}


def test_a_judge_of_conversational_rows_reads_the_messages_not_the_rendered_template():
    seen = []

    def post(url, body, headers, timeout_s):
        seen.append(body["messages"][0]["content"])
        return {"choices": [{"message": {"content": "7"}}]}

    scorer = RemoteScorer(judge("http://x/v1"), "http://x/v1", field="f", post=post)
    rows = [
        {
            "prompt": "<|im_start|>user\nHi<|im_end|>",
            "prompt_messages": [{"role": "user", "content": "Hi"}],
            "topic": "t",
        }
    ]
    assert remote_reward("judge", 1.0, scorer).score([rows[0]["prompt"]], ["Hello"], None, rows) == [7.0]
    assert seen == ["Rate the reply to 'Hi' (topic t) from 0 to 10.\nCompletion: Hello"]


def test_a_dropped_completion_drops_its_whole_group_for_every_source():
    rows = [{"prompt": "a"}] * 4
    other = RewardSourceFn("other", 1.0, lambda p, c, r, rows: [1.0, 2.0, 3.0, 4.0])
    stats = SourceStats("served")
    flaky = RewardSourceFn("served", 1.0, lambda p, c, r, rows: [0.5, Unscored("x"), 0.5, 0.5], stats=stats)
    scores = score_sources([other, flaky], ["a"] * 4, ["x"] * 4, None, rows, group=2)
    assert torch.isnan(scores[:2]).all() and scores[2:].tolist() == [[3.0, 0.5], [4.0, 0.5]]
    assert source_metrics([other, flaky])["rewards/served/dropped_groups"] == 1.0


def test_a_served_reward_model_gets_each_completions_token_ids(monkeypatch):
    from tests.fixtures.small_models import rollout_of

    sent = []

    def post(url, body, headers, timeout_s):
        sent.append(body)
        return {"predictions": [{"score": float(len(r["completion_ids"]))} for r in body["dataframe_records"]]}

    source = RewardSource(name="rm", kind="reward_model", url="http://x/invocations", batch_size=2)
    scorer = RemoteScorer(source, source.url, field="f", post=post)
    rollout = rollout_of(torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]]))
    rollout.query_ids, rollout.query_mask = (
        torch.tensor([[0, 5], [6, 7], [8, 9]]),
        torch.tensor([[0, 1], [1, 1], [1, 1]]),
    )
    rollout.responses = torch.tensor([[11, 12, 0], [13, 0, 0], [14, 15, 16]])
    scores = remote_reward("rm", 1.0, scorer).score(["p"] * 3, ["a", "b", "c"], rollout, [{"prompt": "p"}] * 3)
    assert scores == [2.0, 1.0, 3.0] and len(sent) == 2  # batch_size 2: two requests
    first = sent[0]["dataframe_records"][0]
    assert (first["prompt_ids"], first["completion_ids"]) == ([5], [11, 12])  # no padding, up to the last real token
    assert sent[0]["dataframe_records"][1]["prompt_ids"] == [6, 7]
    assert sent[0]["params"] == {"prompt_width": 2, "completion_width": 3}  # the rollout's widths
    whole = RemoteScorer(source.model_copy(update={"batch_size": None}), source.url, field="f", post=post)
    sent.clear()
    remote_reward("rm", 1.0, whole).score(["p"] * 3, ["a", "b", "c"], rollout, [{"prompt": "p"}] * 3)
    assert len(sent) == 1 and len(sent[0]["dataframe_records"]) == 3  # null: the step's completions in one request
