"""Reward and metric functions named `module:function` in configs.

A reward function is called as ``fn(prompts=..., completions=..., **dataset_columns)`` and returns
one float (or None for "not applicable") per completion, as TRL's GRPO reward functions do.
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def vader_analyzer():
    """The VADER analyzer, built once (it reads its lexicon from the package)."""
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    return SentimentIntensityAnalyzer()


def vader_compound(prompts: list[str] | None = None, completions: list[str] | None = None, **_: object) -> list[float]:
    """VADER's compound sentiment of each completion, in [-1, 1]: the demo's gold metric."""
    if completions is None:
        raise ValueError("vader_compound needs completions=")
    analyzer = vader_analyzer()
    return [float(analyzer.polarity_scores(text)["compound"]) for text in completions]
