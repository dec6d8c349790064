"""Users' feedback on a served policy's answers, as preference pairs and prompts (docs/feedback.md).

A served policy version records each prompt it answers as a trace (tasks/loaders/policy.py): the prompt, its
completions by index, the version that wrote them. People's feedback is an assessment on that trace, written with
MLflow's feedback API under one of three names:

- `preference`: the index of the better completion of the trace; with more than two completions, the metadata
  key `rejected` names the worse one. One assessment is one pair.
- `thumbs`: true (up) or false (down) on the completion the metadata key `completion` names (0 when absent).
- `score`: a number on the completion `completion` names.

`feedback_table` turns answered prompts into rows (pure: tasks/tracking/feedback.py reads them from MLflow), by
these rules:

- only valid assessments (an overridden one is not) created inside the window (since, until] count;
- the same thing judged more than once (one pair of completions of a trace; one completion's thumbs or score)
  is decided by the latest assessment; the earlier ones are counted as superseded, so no pair is made twice;
- thumbs and scores become pairs among the answers to the same prompt text, across traces: the best-rated
  completion against the worst, then the next two, while the better is rated higher (thumbs: up against down),
  so every assessment is in at most one pair;
- a value that is not of its name's form, an index no completion has, or a trace without completions is
  skipped and counted, and the count is said in a sentence of the data report.

A source's `split` holds out a fixed fifth of the prompt texts ('test', the rest 'train': `split_of`), so a
reward model is evaluated on feedback to prompts it never trained on. Every pair keeps its provenance: the trace ids, the model versions that wrote its completions and the
assessment ids. Reading the same feedback again gives the same rows in the same order.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

PREFERENCE, THUMBS, SCORE = "preference", "thumbs", "score"
FEEDBACK_NAMES = (PREFERENCE, THUMBS, SCORE)
SKIP_REASONS = {  # reason -> the sentence's end, after "N assessments"
    "malformed": "had a value not of their name's form (preference: a completion's index; thumbs: true or false; "
    "score: a number) or named a completion the trace does not have",
    "no_completions": "were on traces without completions to compare",
    "identical": "compared two completions with the same text",
    "unpaired": "found no answer to the same prompt rated differently to pair with",
}


@dataclass(frozen=True)
class Assessment:
    """One piece of feedback on a trace: MLflow's assessment id, name, value, metadata, creation time."""

    id: str
    name: str
    value: Any
    time_ms: int
    metadata: dict[str, str] = field(default_factory=dict)
    valid: bool = True


@dataclass(frozen=True)
class AnsweredPrompt:
    """A traced answer: the prompt, its completions by index, the version that wrote them, its assessments."""

    trace_id: str
    prompt: str
    completions: tuple[str, ...]
    model: str  # "<name>/<version>", or "" when the trace does not say
    time_ms: int
    assessments: tuple[Assessment, ...] = ()
    # per completion: the stop token that ended it, "" when the length limit did, None when it stopped on a token
    # the trace does not name
    ends: tuple[str | None, ...] = ()

    def text(self, index: int, stop_text: str) -> str:
        """Completion `index` as the model wrote it: the served text, then the stop token that ended it (`stop_text`
        when the trace does not name it): the server leaves it out, and the reward model reads sequences that end
        on it, as in RL."""
        end = self.ends[index] if index < len(self.ends) else ""
        return self.completions[index] + (stop_text if end is None else end)


@dataclass(frozen=True)
class Window:
    """Feedback created after `since_ms` (None: from the start) and at or before `until_ms`."""

    since_ms: int | None
    until_ms: int

    def holds(self, time_ms: int) -> bool:
        return (self.since_ms is None or time_ms > self.since_ms) and time_ms <= self.until_ms


@dataclass
class FeedbackTable:
    """Preference pairs with their provenance, what was superseded, and what was skipped and why."""

    pairs: list[dict] = field(default_factory=list)
    superseded: int = 0
    stop_text: str = ""
    skipped: Counter = field(default_factory=Counter)

    def sentences(self) -> list[str]:
        """The data report's sentences: what was superseded and what was skipped, one sentence each."""
        said = [f"{n} assessments {SKIP_REASONS[reason]}: skipped" for reason, n in sorted(self.skipped.items())]
        if self.superseded:
            said.insert(
                0, f"{self.superseded} assessments were superseded by a later one of the same pair or completion"
            )
        return said


@dataclass(frozen=True)
class _Judged:
    """One completion as an assessment rates it (thumbs: 1 or 0; score: the number)."""

    answer: AnsweredPrompt
    index: int
    rating: float
    assessment: Assessment


def _index(value: Any, count: int) -> int | None:
    """A completion index from a feedback value or metadata string (JSON numbers come back as floats)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        value = value.strip()
        if not value.lstrip("-").isdigit():
            return None
        value = int(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if isinstance(value, int) and 0 <= value < count else None


def _rating(assessment: Assessment) -> float | None:
    value = assessment.value
    if assessment.name == THUMBS:
        return float(value) if isinstance(value, bool) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _pair(chosen, rejected, by: list[Assessment], name: str, stop_text: str) -> dict:
    (a, i), (b, j) = chosen, rejected
    return {
        "prompt": a.prompt,
        "chosen": a.text(i, stop_text),
        "rejected": b.text(j, stop_text),
        "feedback": name,
        "trace_ids": sorted({a.trace_id, b.trace_id}),
        "models": sorted({m for m in (a.model, b.model) if m}),
        "assessment_ids": [x.id for x in by],
        "time_ms": max(x.time_ms for x in by),
    }


def _latest(judged: dict, key, item, assessment: Assessment, table: FeedbackTable) -> None:
    """Keep the latest assessment of `key` (ties: the larger id), counting the one it replaces as superseded."""
    old = judged.get(key)
    if old is not None:
        table.superseded += 1
        if (old[-1].time_ms, old[-1].id) > (assessment.time_ms, assessment.id):
            return
    judged[key] = (*item, assessment)


TEST_SHARE = 0.2  # of the prompt texts: the held-out split of a traces: source


def split_of(prompt: str) -> str:
    """'test' for a fixed TEST_SHARE of prompt texts (by their sha256), else 'train': a prompt's feedback is held
    out whole, whenever and however often it is read."""
    bucket = int.from_bytes(hashlib.sha256(prompt.encode("utf-8")).digest()[:8], "big") / 2**64
    return "test" if bucket < TEST_SHARE else "train"


def feedback_table(
    answers: list[AnsweredPrompt], window: Window, stop_text: str = "", split: str | None = None
) -> FeedbackTable:
    """The preference pairs the valid feedback inside `window` makes, by the module's rules; a completion a stop
    token ended gets it back at its end (`stop_text` when its trace does not say which: `AnsweredPrompt.text`).
    `split` ('train' or 'test') keeps the pairs of that split's prompts (`split_of`); None keeps all."""
    if split is not None:
        answers = [a for a in answers if split_of(a.prompt) == split]
    table = FeedbackTable(stop_text=stop_text)
    choices: dict = {}  # (trace, {i, j}) -> (answer, chosen, rejected, assessment)
    ratings: dict = {}  # (trace, index, name) -> (answer, index, rating, assessment)
    for answer in sorted(answers, key=lambda a: (a.time_ms, a.trace_id)):
        for assessment in answer.assessments:
            if assessment.name not in FEEDBACK_NAMES or not assessment.valid or not window.holds(assessment.time_ms):
                continue
            if not answer.completions:
                table.skipped["no_completions"] += 1
                continue
            count = len(answer.completions)
            if assessment.name == PREFERENCE:
                chosen = _index(assessment.value, count)
                default = 1 - chosen if chosen is not None and count == 2 else None
                rejected = _index(assessment.metadata.get("rejected", default), count)
                if chosen is None or rejected is None or chosen == rejected:
                    table.skipped["malformed"] += 1
                    continue
                key = (answer.trace_id, frozenset((chosen, rejected)))
                _latest(choices, key, (answer, chosen, rejected), assessment, table)
                continue
            index, rating = _index(assessment.metadata.get("completion", 0), count), _rating(assessment)
            if index is None or rating is None:
                table.skipped["malformed"] += 1
                continue
            _latest(ratings, (answer.trace_id, index, assessment.name), (answer, index, rating), assessment, table)
    for answer, chosen, rejected, assessment in choices.values():
        _add(table, (answer, chosen), (answer, rejected), [assessment], PREFERENCE)
    _pair_ratings(table, [_Judged(*item) for item in ratings.values()])
    table.pairs.sort(key=lambda row: (row["time_ms"], row["assessment_ids"]))
    return table


def _add(table: FeedbackTable, chosen, rejected, by: list[Assessment], name: str) -> None:
    if chosen[0].completions[chosen[1]] == rejected[0].completions[rejected[1]]:
        table.skipped["identical"] += len(by)
        return
    table.pairs.append(_pair(chosen, rejected, by, name, table.stop_text))


def _pair_ratings(table: FeedbackTable, judged: list[_Judged]) -> None:
    """Thumbs and scores paired among the answers to one prompt: the best against the worst, inward."""
    groups: dict[tuple[str, str], list[_Judged]] = {}
    for item in judged:
        groups.setdefault((item.answer.prompt, item.assessment.name), []).append(item)
    for (_, name), group in sorted(groups.items()):
        group.sort(key=lambda j: (j.rating, j.assessment.time_ms, j.assessment.id))
        low, high = 0, len(group) - 1
        while low < high and group[high].rating > group[low].rating:
            best, worst = group[high], group[low]
            _add(
                table, (best.answer, best.index), (worst.answer, worst.index), [best.assessment, worst.assessment], name
            )
            low, high = low + 1, high - 1
        if high >= low:
            table.skipped["unpaired"] += high - low + 1


def feedback_prompts(answers: list[AnsweredPrompt], window: Window, split: str | None = None) -> list[dict]:
    """The prompts the served policy was asked inside `window` (by the trace's time), each once (its first
    trace), in time order: RL prompts from the traffic; `split` as in `feedback_table`."""
    if split is not None:
        answers = [a for a in answers if split_of(a.prompt) == split]
    seen: dict[str, dict] = {}
    for answer in sorted(answers, key=lambda a: (a.time_ms, a.trace_id)):
        if window.holds(answer.time_ms) and answer.prompt and answer.prompt not in seen:
            seen[answer.prompt] = {"prompt": answer.prompt, "trace_ids": [answer.trace_id], "time_ms": answer.time_ms}
        elif answer.prompt in seen and window.holds(answer.time_ms):
            seen[answer.prompt]["trace_ids"].append(answer.trace_id)
    return list(seen.values())
