"""rlhf_core/demo/text.py: the demo's reviews, labelled by VADER, with held-out prompts and neutral descriptors."""

from __future__ import annotations

import json

import pytest

from rlhf_core.demo.text import NEUTRAL_WORDS, load_vader_lexicon
from rlhf_core.rewards.functions import vader_compound


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_contents(smoke_world):
    pairs = read_jsonl(smoke_world.preferences("train"))
    for row in pairs:
        (user,), (chosen,), (rejected,) = row["prompt"], row["chosen"], row["rejected"]
        assert (user["role"], chosen["role"], rejected["role"]) == ("user", "assistant", "assistant")
        good, bad = vader_compound(
            completions=[user["content"] + " " + chosen["content"], user["content"] + " " + rejected["content"]]
        )
        assert good > bad and chosen["content"] != rejected["content"]
    train = {r["prompt"][0]["content"] for r in read_jsonl(smoke_world.prompts("train"))}
    test = {r["prompt"][0]["content"] for r in read_jsonl(smoke_world.prompts("test"))}
    assert train and test and not train & test
    assert not test & {r["prompt"][0]["content"] for r in pairs}  # held-out prompts never appear in training pairs
    corpus = [r["messages"] for r in read_jsonl(smoke_world.corpus)]
    assert all([m["role"] for m in messages] == ["user", "assistant"] for messages in corpus)
    assert any(word in messages[1]["content"] for messages in corpus for word in NEUTRAL_WORDS)


def test_neutral_words_are_not_in_the_lexicon():
    lexicon = load_vader_lexicon()
    assert len(lexicon) > 7000 and lexicon["great"] > 0 > lexicon["awful"]
    assert not set(NEUTRAL_WORDS) & set(lexicon)


def _writer(seed: int = 0):
    import random

    from rlhf_core.demo.text import ReviewWriter

    return ReviewWriter(random.Random(seed), load_vader_lexicon())


def test_preference_pairs_are_length_matched_and_labelled_by_vader():
    from rlhf_core.demo.text import preference_pairs, sample_prefixes

    for r in preference_pairs(_writer(), sample_prefixes(_writer(), False, 200), 0.3):
        # one template per pair: the answers differ only in their descriptions (one word each)
        prompt, chosen, rejected = (r[k][0]["content"] for k in ("prompt", "chosen", "rejected"))
        assert len(chosen.split()) == len(rejected.split())
        good, bad = vader_compound(completions=[f"{prompt} {chosen}", f"{prompt} {rejected}"])
        assert good - bad >= 0.3 - 1e-9


def test_equal_gold_length_pairs_score_the_same_for_vader_and_differ_in_length():
    from rlhf_core.demo.text import equal_gold_length_pairs, sample_prefixes

    writer = _writer(3)
    pairs = equal_gold_length_pairs(writer, sample_prefixes(writer, True, 100))
    assert len(pairs) > 90  # only a pair VADER happens to score apart is dropped
    a_longer = 0
    for pair in pairs:
        prompt, a, b = pair["prompt"][0]["content"], pair["a"][0]["content"], pair["b"][0]["content"]
        gold_a, gold_b = vader_compound(completions=[f"{prompt} {a}", f"{prompt} {b}"])
        assert gold_a == gold_b == pytest.approx(pair["gold"]) and len(a.split()) != len(b.split())
        a_longer += len(a.split()) > len(b.split())
    assert 0.3 < a_longer / len(pairs) < 0.7  # in random order
