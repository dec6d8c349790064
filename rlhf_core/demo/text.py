"""The demo world's text: short reviews written from the VADER lexicon, as conversations.

The user gives the start of a review (an opener, a template and a noun, cut right before the first
description slot), the assistant finishes it with neutral, positive or negative descriptors. VADER's
compound score labels the preference pairs and is the demo's gold metric (see
:mod:`rlhf_core.rewards.functions`). Everything is drawn from one `random.Random`, so a seed gives the
same text; a fixed 15% of all possible prompts is held out for evaluation, whatever the seed.
"""

from __future__ import annotations

import hashlib
import random
import re
from importlib import resources

from rlhf_core.rewards.functions import vader_analyzer

NOUNS = [
    "food",
    "service",
    "staff",
    "room",
    "movie",
    "plot",
    "book",
    "hotel",
    "price",
    "music",
    "coffee",
    "pizza",
    "menu",
    "waiter",
    "view",
    "bed",
    "screen",
    "battery",
    "camera",
    "phone",
    "show",
    "ending",
    "story",
    "soup",
    "beer",
    "wine",
    "dessert",
    "app",
    "game",
    "seller",
    "delivery",
    "pool",
    "lobby",
    "acting",
    "soundtrack",
    "keyboard",
    "charger",
    "burger",
    "salad",
    "trip",
]
# `{a}` is the first description slot: the prompt ends right before it.
TEMPLATES = [
    "the {n} was {a} .",
    "the {n} is {a} .",
    "overall the {n} felt {a} .",
    "i found the {n} {a} .",
    "honestly the {n} was {a} .",
    "our {n} was {a} .",
    "the {n} seemed {a} .",
    "this {n} is {a} .",
    "the {n} was {a} and the {m} was {b} .",
    "i thought the {n} was {a} but the {m} was {b} .",
    "the {n} looked {a} and tasted {b} .",
    "my {n} arrived {a} .",
]
OPENERS = ["", "we went on friday .", "second visit .", "bought it last month .", "came here with friends ."]
# Plain descriptors that VADER scores 0; the corpus uses each of them often, so an SFT model's most
# likely continuation is neutral and RL has room to move it.
NEUTRAL_WORDS = ["ordinary", "average", "typical", "standard", "regular", "plain", "usual", "normal", "simple", "basic"]
NEUTRAL_SHARE = 0.4
POLAR_MIN = 2.0  # |mean valence| of lexicon words used as positive / negative descriptors


def load_vader_lexicon() -> dict[str, float]:
    """word -> mean valence, from the lexicon file inside the vaderSentiment package."""
    text = resources.files("vaderSentiment").joinpath("vader_lexicon.txt").read_text(encoding="utf-8")
    lexicon = {}
    for line in text.splitlines():
        parts = line.split("\t")
        if len(parts) >= 2:
            lexicon[parts[0]] = float(parts[1])
    return lexicon


def polar_words(lexicon: dict[str, float]) -> tuple[list[str], list[str]]:
    """Alphabetic lexicon words with |valence| >= POLAR_MIN: (positive, negative), sorted."""
    words = sorted(w for w in lexicon if re.fullmatch(r"[a-z]{3,}", w))
    return [w for w in words if lexicon[w] >= POLAR_MIN], [w for w in words if lexicon[w] <= -POLAR_MIN]


class ReviewWriter:
    """Fills template slots with neutral, positive or negative descriptors."""

    def __init__(self, rng: random.Random, lexicon: dict[str, float]):
        self.rng = rng
        self.positive, self.negative = polar_words(lexicon)
        self.neutral = [w for w in NEUTRAL_WORDS if w not in lexicon]

    def descriptor(self) -> str:
        u = self.rng.random()
        if u < NEUTRAL_SHARE:
            return self.rng.choice(self.neutral)
        pool = self.positive if u < NEUTRAL_SHARE + (1 - NEUTRAL_SHARE) / 2 else self.negative
        return self.rng.choice(pool)

    def prefix(self) -> tuple[str, str]:
        """(prompt, template) for a random opener, template and noun."""
        opener = self.rng.choice(OPENERS)
        template = self.rng.choice(TEMPLATES)
        noun = self.rng.choice(NOUNS)
        head = template.split("{a}")[0].format(n=noun)
        return (f"{opener} {head}".strip(), template)

    def completion(self, template: str) -> str:
        """The text after the prompt: first slot, the rest of the template, and the period."""
        tail = "{a}" + template.split("{a}", 1)[1]
        other = self.rng.choice(NOUNS)
        return " " + tail.format(a=self.descriptor(), b=self.descriptor(), m=other)

    def vocabulary(self) -> list[str]:
        """Every word it can write (descriptors, nouns, openers, the templates' words), sampled or not."""
        template_words = [re.sub(r"\{\w\}", " ", t) for t in TEMPLATES]
        return self.positive + self.negative + self.neutral + NOUNS + OPENERS + template_words


def user_turn(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def assistant_turn(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text.strip()}]


def _prompt_key(prompt: str) -> int:
    return int(hashlib.sha256(prompt.encode()).hexdigest()[:8], 16)


def _is_eval_prompt(prompt: str) -> bool:
    """A fixed 15% of all possible prompts is held out, whatever the seed."""
    return _prompt_key(prompt) % 100 < 15


def sample_prefixes(writer: ReviewWriter, want_eval: bool, n: int) -> list[tuple[str, str]]:
    out = []
    while len(out) < n:
        prompt, template = writer.prefix()
        if _is_eval_prompt(prompt) == want_eval:
            out.append((prompt, template))
    return out


def preference_pairs(writer: ReviewWriter, prefixes: list[tuple[str, str]], min_gap: float) -> list[dict]:
    vader = vader_analyzer()
    rows = []
    for prompt, template in prefixes:
        while True:
            a, b = writer.completion(template), writer.completion(template)
            sa = vader.polarity_scores(prompt + a)["compound"]
            sb = vader.polarity_scores(prompt + b)["compound"]
            if abs(sa - sb) >= min_gap:
                break
        chosen, rejected = (a, b) if sa > sb else (b, a)
        rows.append(
            {"prompt": user_turn(prompt), "chosen": assistant_turn(chosen), "rejected": assistant_turn(rejected)}
        )
    return rows


def equal_gold_length_pairs(writer: ReviewWriter, prefixes: list[tuple[str, str]]) -> list[dict]:
    """Pairs of answers that VADER scores the same ("gold") but differ in length: a description alone, and
    the same with a neutral clause ("and the soup was plain"), in random order as "a" and "b". A reward
    model without a length bias scores them alike (`rlhf_core.rewards.reward_model.length_bias`)."""
    vader = vader_analyzer()
    rows = []
    for prompt, _ in prefixes:
        short = f" {writer.descriptor()} ."
        long = f"{short[:-2]} and the {writer.rng.choice(NOUNS)} was {writer.rng.choice(writer.neutral)} ."
        a, b = (short, long) if writer.rng.random() < 0.5 else (long, short)
        gold_a, gold_b = (vader.polarity_scores(prompt + text)["compound"] for text in (a, b))
        if gold_a == gold_b:
            rows.append({"prompt": user_turn(prompt), "a": assistant_turn(a), "b": assistant_turn(b), "gold": gold_a})
    return rows


def distinct_prompts(writer: ReviewWriter, want_eval: bool, n: int) -> list[dict]:
    seen: dict[str, None] = {}
    attempts = 0
    while len(seen) < n and attempts < 200 * n:
        prompt, _ = writer.prefix()
        attempts += 1
        if _is_eval_prompt(prompt) == want_eval:
            seen.setdefault(prompt)
    return [{"prompt": user_turn(p)} for p in seen]


def corpus_rows(writer: ReviewWriter, n: int) -> list[dict]:
    """`n` whole conversations (a prompt and its completion) for the SFT warm start."""
    corpus = []
    for _ in range(n):
        prompt, template = writer.prefix()
        corpus.append({"messages": user_turn(prompt) + assistant_turn(writer.completion(template))})
    return corpus
