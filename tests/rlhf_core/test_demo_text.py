"""rlhf_core/demo_text.py: the demo's reviews, labelled by VADER, with held-out prompts and neutral descriptors."""

from __future__ import annotations

import json

from rlhf_core.demo_text import NEUTRAL_WORDS, load_vader_lexicon
from rlhf_core.reward_functions import vader_compound


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
