"""Users' feedback on traced answers -> preference pairs and prompts: the rules of rlhf_core/data/feedback.py, by hand."""

from __future__ import annotations

import random

import pytest

from rlhf_core.data.feedback import (
    PREFERENCE,
    SCORE,
    THUMBS,
    AnsweredPrompt,
    Assessment,
    Window,
    feedback_prompts,
    feedback_table,
    split_of,
)

ALL = Window(since_ms=None, until_ms=10_000)


def answer(trace: str, completions=("bad", "good"), prompt="p", time_ms=1, model="pol/1", *assessments):
    return AnsweredPrompt(trace, prompt, tuple(completions), model, time_ms, tuple(assessments))


def said(name: str, value, time_ms: int, id: str | None = None, valid: bool = True, **metadata) -> Assessment:
    return Assessment(
        id or f"a-{name}-{time_ms}", name, value, time_ms, {k: str(v) for k, v in metadata.items()}, valid
    )


def test_a_choice_between_two_completions_is_one_pair_with_its_provenance():
    table = feedback_table([answer("tr-1", ("bad", "good"), "p", 5, "pol/3", said(PREFERENCE, 1, 7, "a-1"))], ALL)
    assert table.pairs == [
        {
            "prompt": "p",
            "chosen": "good",
            "rejected": "bad",
            "feedback": PREFERENCE,
            "trace_ids": ["tr-1"],
            "models": ["pol/3"],
            "assessment_ids": ["a-1"],
            "time_ms": 7,
        }
    ]
    assert table.superseded == 0 and not table.skipped and table.sentences() == []


@pytest.mark.parametrize(
    ("value", "metadata", "expected"),
    [
        (1.0, {}, ("b", "a")),  # MLflow returns a JSON number as a float
        ("0", {}, ("a", "b")),
        (2, {"rejected": 0}, ("c", "a")),  # three completions: `rejected` names the worse
        (True, {}, None),  # a boolean is not an index
        (2, {}, None),  # no rejected named among three
        (5, {"rejected": 0}, None),  # no such completion
        (1, {"rejected": 1}, None),  # a completion against itself
        (0.5, {}, None),
        ("first", {}, None),
    ],
)
def test_a_choice_names_completions_by_index_and_anything_else_is_malformed(value, metadata, expected):
    completions = ("a", "b") if value in (1.0, "0", True, 0.5, "first") else ("a", "b", "c")
    table = feedback_table([answer("tr", completions, "p", 1, "", said(PREFERENCE, value, 2, **metadata))], ALL)
    if expected is None:
        assert table.pairs == [] and table.skipped == {"malformed": 1}
        assert "1 assessments had a value not of their name's form" in table.sentences()[0]
    else:
        assert [(r["chosen"], r["rejected"]) for r in table.pairs] == [expected] and not table.skipped


def test_the_latest_assessment_of_a_pair_decides_and_no_pair_is_made_twice():
    judged = answer(
        "tr",
        ("a", "b"),
        "p",
        1,
        "",
        said(PREFERENCE, 0, 3, "a-old"),
        said(PREFERENCE, 1, 9, "a-new"),  # another user, later: this one decides
        said(PREFERENCE, 1, 5, "a-same"),  # agrees with the latest: still one pair
    )
    table = feedback_table([judged], ALL)
    assert [(r["chosen"], r["assessment_ids"]) for r in table.pairs] == [("b", ["a-new"])]
    assert table.superseded == 2
    assert table.sentences()[0].startswith("2 assessments were superseded")


def test_an_overridden_assessment_and_other_names_are_not_read():
    judged = answer("tr", ("a", "b"), "p", 1, "", said(PREFERENCE, 0, 3, valid=False), said("relevance", 1, 4))
    table = feedback_table([judged], ALL)
    assert table.pairs == [] and table.superseded == 0 and not table.skipped


def test_the_window_takes_feedback_created_after_since_and_up_to_until():
    judged = [answer(f"tr-{t}", ("a", "b"), f"p{t}", 1, "", said(PREFERENCE, 1, t)) for t in (10, 11, 20, 21)]
    table = feedback_table(judged, Window(since_ms=10, until_ms=20))
    assert [r["prompt"] for r in table.pairs] == ["p11", "p20"]


def test_thumbs_pair_an_up_with_a_down_on_the_same_prompt_across_traces():
    answers = [
        answer("tr-1", ("nice",), "p", 1, "pol/1", said(THUMBS, True, 2, "up-1")),
        answer("tr-2", ("awful",), "p", 3, "pol/2", said(THUMBS, False, 4, "down")),
        answer("tr-3", ("fine",), "p", 5, "pol/2", said(THUMBS, True, 6, "up-2")),  # no second down: unpaired
        answer("tr-4", ("x",), "other", 5, "pol/2", said(THUMBS, False, 6, "down-other")),  # alone on its prompt
    ]
    table = feedback_table(answers, ALL)
    assert [(r["chosen"], r["rejected"], r["trace_ids"], r["models"]) for r in table.pairs] == [
        ("fine", "awful", ["tr-2", "tr-3"], ["pol/2"])  # the latest up, then by id: deterministic
    ]
    assert table.pairs[0]["assessment_ids"] == ["up-2", "down"]
    assert table.skipped == {"unpaired": 2}


def test_thumbs_name_a_completion_of_the_trace_and_must_be_booleans():
    answers = [
        answer("tr-1", ("a", "b"), "p", 1, "", said(THUMBS, True, 2, completion=1), said(THUMBS, False, 3)),
        answer("tr-2", ("c",), "p", 1, "", said(THUMBS, 1, 2), said(THUMBS, True, 3, completion=4)),
    ]
    table = feedback_table(answers, ALL)
    assert [(r["chosen"], r["rejected"]) for r in table.pairs] == [("b", "a")]
    assert table.skipped == {"malformed": 2}


def test_scores_pair_the_best_with_the_worst_inward_and_equal_ones_do_not_pair():
    answers = [
        answer(f"tr-{i}", (text,), "p", i, "", said(SCORE, s, i))
        for i, (text, s) in enumerate([("mid", 0.5), ("top", 0.9), ("low", 0.1), ("mid2", 0.5)])
    ]
    table = feedback_table(answers, ALL)
    assert [(r["chosen"], r["rejected"]) for r in table.pairs] == [("top", "low")]
    assert table.skipped == {"unpaired": 2}
    nan = feedback_table([answer("tr", ("a",), "p", 1, "", said(SCORE, float("nan"), 2))], ALL)
    assert nan.skipped == {"malformed": 1}


def test_a_later_rating_of_the_same_completion_replaces_the_earlier_one():
    answers = [
        answer("tr-1", ("a",), "p", 1, "", said(THUMBS, False, 2, "first"), said(THUMBS, True, 8, "second")),
        answer("tr-2", ("b",), "p", 1, "", said(THUMBS, False, 3, "b-down")),
    ]
    table = feedback_table(answers, ALL)
    assert [(r["chosen"], r["rejected"]) for r in table.pairs] == [("a", "b")] and table.superseded == 1


def test_identical_texts_and_traces_without_completions_are_skipped_and_counted():
    answers = [
        answer("tr-1", ("same", "same"), "p", 1, "", said(PREFERENCE, 0, 2)),
        answer("tr-2", (), "p", 1, "", said(PREFERENCE, 0, 2)),
    ]
    table = feedback_table(answers, ALL)
    assert table.pairs == [] and table.skipped == {"identical": 1, "no_completions": 1}
    assert len(table.sentences()) == 2


def test_reading_the_same_feedback_in_any_order_gives_the_same_rows():
    answers = [
        answer(f"tr-{i}", ("a", "b"), f"p{i % 3}", i, "", said(PREFERENCE, i % 2, 100 + i, f"a-{i}")) for i in range(20)
    ] + [answer(f"th-{i}", (f"t{i}",), "q", i, "", said(THUMBS, i % 2 == 0, 200 + i, f"t-{i}")) for i in range(6)]
    first = feedback_table(answers, ALL)
    shuffled = answers[:]
    random.Random(0).shuffle(shuffled)
    assert feedback_table(shuffled, ALL).pairs == first.pairs
    used = [a for row in first.pairs for a in row["assessment_ids"]]
    assert len(used) == len(set(used)) == 20 + 6  # every assessment in exactly one pair


def test_prompts_from_traffic_are_each_taken_once_in_the_window():
    answers = [answer("tr-1", ("a",), "p", 5), answer("tr-2", ("b",), "p", 6), answer("tr-3", ("c",), "q", 30)]
    assert feedback_prompts(answers, Window(since_ms=None, until_ms=10)) == [
        {"prompt": "p", "trace_ids": ["tr-1", "tr-2"], "time_ms": 5}
    ]


def test_a_completion_a_stop_token_ended_gets_the_end_token_back_and_one_cut_by_length_does_not():
    stopped = AnsweredPrompt("tr", "p", ("fine .", "ok but the"), "", 1, (said(PREFERENCE, 0, 2),), ("<|im_end|>", ""))
    (row,) = feedback_table([stopped], ALL, "<|endoftext|>").pairs
    assert (row["chosen"], row["rejected"]) == ("fine .<|im_end|>", "ok but the")  # the token the trace names
    unnamed = AnsweredPrompt("tr", "p", ("fine .", "bad ."), "", 1, (said(PREFERENCE, 0, 2),), (None, None))
    (row,) = feedback_table([unnamed], ALL, "<|endoftext|>").pairs
    assert (row["chosen"], row["rejected"]) == ("fine .<|endoftext|>", "bad .<|endoftext|>")  # the eos, unnamed


def test_a_fixed_fifth_of_the_prompts_is_held_out_whole_for_evaluation():
    answers = [
        answer(f"tr-{i}", ("a", "b"), f"prompt {i}", i, "", said(PREFERENCE, 1, 100 + i, f"a-{i}")) for i in range(300)
    ]
    train, test = (feedback_table(answers, ALL, split=split).pairs for split in ("train", "test"))
    assert len(train) + len(test) == 300 and 40 <= len(test) <= 80  # about a fifth
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert {r["prompt"] for r in test} == {a.prompt for a in answers if split_of(a.prompt) == "test"}
    held = [p["prompt"] for p in feedback_prompts(answers, ALL, split="test")]
    assert held == sorted({r["prompt"] for r in test}, key=lambda p: int(p.split()[1]))
