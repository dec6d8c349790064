"""The contest's prompt-by-prompt rows: a pairwise judge asked in both orders, prompts shown as their messages."""

import pytest

from rlhf_core.config.evaluation import Evaluator, PairwiseJudge
from rlhf_core.evaluation.pairwise import LOSS, TIE, WIN
from rlhf_core.rewards.pairwise_judge import PairwiseJudgeCaller
from tasks.promotion.contest import _judged, _pointwise, shown_prompts
from tasks.promotion.evaluator import Judging

TEMPLATE = "{prompt}\nA: {completion_a}\nB: {completion_b}"


def judging(post, **extra) -> Judging:
    judge = PairwiseJudge(url="http://j/v1", judge_model="j", template=TEMPLATE, labels={"A": 1.0, "B": 0.0}, **extra)
    return Judging(Evaluator("judge", None, judge=judge), judge=PairwiseJudgeCaller(judge, post=post))


def prefers_the_word_good(url, body, headers, timeout_s):
    """Names the completion with 'good' in it; answers off its labels when neither or both have it."""
    text = body["messages"][0]["content"]
    a, b = text.split("\nA: ")[1].split("\nB: ")
    if ("good" in a) == ("good" in b):
        return {"choices": [{"message": {"content": "both"}}]}
    return {"choices": [{"message": {"content": "A" if "good" in a else "B"}}]}


def test_the_judge_decides_each_prompt_in_both_orders_and_drops_what_it_cannot_answer():
    prompts = ["p1", "p2", "p3"]
    candidate = [{"completion": "good"}, {"completion": "bad"}, {"completion": "same"}]
    opponent = [{"completion": "bad"}, {"completion": "good"}, {"completion": "same"}]
    rows, outcomes = _judged(
        judging(prefers_the_word_good, on_failure="drop_group"), prompts, [{}, {}, {}], (candidate, opponent)
    )
    assert outcomes == [WIN, LOSS]  # p3: the judge answered neither A nor B, so it is left out
    assert [r["verdict"] for r in rows[:2]] == ["win", "loss"]
    assert rows[0]["candidate first"] == "candidate" and rows[0]["opponent first"] == "candidate"
    assert rows[2]["verdict"].startswith("left out: the answer holds no score")


def test_pointwise_rows_and_prompts_shown_as_their_messages():
    rows = [{"prompt": "<|im_start|>user\nhi<|im_end|>", "prompt_messages": [{"role": "user", "content": "hi"}]}]
    assert shown_prompts(rows) == ["hi"]
    assert shown_prompts([{"prompt": "plain text"}]) == ["plain text"]
    table, outcomes = _pointwise("gold", ["hi"], [{"completion": "a", "gold": 0.5}], [{"completion": "b", "gold": 0.5}])
    assert outcomes == [TIE] and table == [
        {
            "prompt": "hi",
            "opponent": "b",
            "candidate": "a",
            "opponent gold": 0.5,
            "candidate gold": 0.5,
            "verdict": "tie",
        }
    ]


@pytest.mark.parametrize("name", ["qwen2.5", "qwen2.5-instruct", "llama-3-instruct", "gpt2"])
def test_prompts_read_as_their_text_under_each_real_family_template(name, tmp_path):
    """Rendered by a real family's chat template (ChatML, Llama 3's headers; base models without one), a prompt
    row shows the user's words: from its messages, or its turns' text stripped of the template when it has none."""
    from rlhf_core.data.chat import PROMPT_MESSAGES, has_chat_template, render_prompt
    from rlhf_core.models.loading import load_tokenizer
    from tests.fixtures.real_shapes import build_family

    tokenizer = load_tokenizer(str(build_family(name, tmp_path)))
    messages = [{"role": "user", "content": "the soup was"}]
    rendered = render_prompt(tokenizer, messages) if has_chat_template(tokenizer) else "the soup was"
    assert shown_prompts([{"prompt": rendered, PROMPT_MESSAGES: messages}]) == ["the soup was"]
    (stripped,) = shown_prompts([{"prompt": rendered}])  # its turns' text: Qwen's default system turn too
    assert stripped.endswith("the soup was") and "<|" not in stripped and "user" not in stripped.split()
