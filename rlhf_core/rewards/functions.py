"""Reward and metric functions named `module:function` in configs.

A reward function is called as ``fn(prompts=..., completions=..., **dataset_columns)`` and returns
one float (or None for "not applicable") per completion, as TRL's GRPO reward functions do.
"""

from __future__ import annotations

import inspect
from functools import lru_cache

from rlhf_core.config.errors import UserError


@lru_cache(maxsize=1)
def vader_analyzer():
    """The VADER analyzer, built once (it reads its lexicon from the package)."""
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    return SentimentIntensityAnalyzer()


def vader_compound(prompts: list | None = None, completions: list | None = None, **_: object) -> list[float]:
    """VADER's compound sentiment of each completion (a string or, for conversational prompts, a message
    list), in [-1, 1]: the demo's gold metric."""
    from rlhf_core.data.chat import completion_text

    if completions is None:
        raise ValueError("vader_compound needs completions=")
    analyzer = vader_analyzer()
    return [float(analyzer.polarity_scores(completion_text(c))["compound"]) for c in completions]


class RewardFunctionError(UserError):
    """A reward or metric function that cannot be used; the message is one sentence."""


def load_function(spec: str, *, field: str = "eval.metrics"):
    """Import 'package.module:function' and return the callable, or raise naming the spec and the field."""
    from rlhf_core.config.loading import import_object

    return import_object(spec, field=field, error=RewardFunctionError)


def accepts(fn, name: str) -> bool:
    """Whether fn takes a keyword argument `name` (by name or through **kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def completion_ids(responses, resp_mask) -> list[list[int]]:
    """Each completion's token ids up to and with its stop token (TRL's `completion_ids`), from (B, R) tensors."""
    return [row[: int(n)].tolist() for row, n in zip(responses, resp_mask.sum(1))]


def bind_arguments(fn, arguments: dict, *, field: str):
    """fn with `arguments` bound as keywords (a grpo.rewards entry's `arguments`); each must be one fn takes."""
    import functools

    for name in arguments:
        if not accepts(fn, name):
            raise RewardFunctionError(f"{field}.arguments: the function takes no argument '{name}'")
    return functools.partial(fn, **arguments) if arguments else fn


def load_reward_function(spec: str, arguments: dict, *, field: str):
    """A grpo.rewards entry's function (`field`, e.g. 'grpo.rewards[0]'), imported, its arguments bound."""
    return bind_arguments(load_function(spec, field=f"{field}.function"), arguments, field=field)


def call_scoring_function(
    name: str, fn, *, prompts: list[str], completions: list[str], **columns
) -> list[float | None]:
    """Call fn(prompts=, completions=, **columns) and check it returned one number (or None) per completion.

    When fn raises, the error is a RewardFunctionError naming the function, the first sample it fails
    on (found by calling it again one sample at a time) and the exception; a UserError passes as it is.
    """
    try:
        out = fn(prompts=prompts, completions=completions, **columns)
    except UserError:  # its sentence is said already (a served scorer whose failure policy is fail)
        raise
    except Exception as err:
        raise RewardFunctionError(_raised_sentence(name, fn, err, prompts, completions, columns)) from err
    if not isinstance(out, (list, tuple)) or len(out) != len(completions):
        got = f"{len(out)} values" if isinstance(out, (list, tuple)) else f"a {type(out).__name__}"
        raise RewardFunctionError(f"reward function {name} returned {got} for {len(completions)} completions")
    for i, value in enumerate(out):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise RewardFunctionError(
                f"reward function {name} returned {value!r} (a {type(value).__name__}) for completion {i}, not a number or None"
            )
    values = [None if v is None else float(v) for v in out]
    check_finite(f"reward function {name}", values)
    return values


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def _raised_sentence(name: str, fn, err: Exception, prompts, completions, columns) -> str:
    """'reward function x raised ValueError: ... on completion 3' (the batch, when no single sample fails)."""

    def row(values, i):
        return values[i : i + 1] if isinstance(values, (list, tuple)) and len(values) == len(completions) else values

    for i in range(len(completions)):
        try:
            fn(
                prompts=row(prompts, i),
                completions=completions[i : i + 1],
                **{k: row(v, i) for k, v in columns.items()},
            )
        except Exception as single:
            return f"reward function {name} raised {_one_line(single)} on completion {i} (of {len(completions)})"
    return f"reward function {name} raised {_one_line(err)} on a batch of {len(completions)} completions, though each one alone scores"


def check_finite(what: str, values) -> None:
    """Raise RewardFunctionError naming `what`, the sample's index and the value for the first NaN or inf.

    A non-finite reward would otherwise turn into 0 (nansum) or poison every advantage of the batch.
    `values`: floats or None (not applicable), or a tensor.
    """
    import math

    listed = values.tolist() if hasattr(values, "tolist") else list(values)
    for i, value in enumerate(listed):
        if value is not None and not math.isfinite(value):
            raise RewardFunctionError(
                f"{what} returned {value} for completion {i}; rewards must be finite numbers "
                "(or None for not applicable)"
            )


def exact_match(
    prompts: list | None = None, completions: list | None = None, answer: list | None = None, **_: object
) -> list[float]:
    """1.0 where a completion (a string or, for conversational prompts, a message list) is exactly its row's
    `answer` column, both stripped of surrounding whitespace; else 0.0 (of a tool episode's transcript, its last
    assistant message). The verifiable reward of RLVR (the arithmetic and calculator worlds). Completions arrive decoded up to their stop token, without it, so one that ran
    on past the answer ("57" then more digits) is wrong."""
    from rlhf_core.data.chat import final_answer

    if completions is None:
        raise ValueError("exact_match needs completions=")
    if answer is None:
        raise ValueError("exact_match needs an 'answer' column in the prompt rows (the expected answer of each prompt)")
    if len(answer) != len(completions):
        raise ValueError(f"exact_match got {len(answer)} answers for {len(completions)} completions")
    return [1.0 if final_answer(c).strip() == str(a).strip() else 0.0 for c, a in zip(completions, answer, strict=True)]


def soft_overlong_punishment(
    completion_ids: list | None = None, max_completion_len: int = 16, soft_punish_cache: int = 4, **_: object
) -> list[float]:
    """DAPO's soft overlong punishment (arXiv:2503.14476, Eq. 13), as TRL's `get_soft_overlong_punishment`:
    0 for a completion of at most L_max - L_cache tokens, (L_max - L_cache - length) / L_cache up to L_max
    tokens, -1 beyond. Lengths count the completion's tokens with its stop token. Configure it with
    `arguments: {max_completion_len: ..., soft_punish_cache: ...}` in its grpo.rewards entry."""
    if completion_ids is None:
        raise ValueError("soft_overlong_punishment needs completion_ids= (the completions' token ids)")
    start = max_completion_len - soft_punish_cache
    return [
        0.0 if len(ids) <= start else (start - len(ids)) / soft_punish_cache if len(ids) <= max_completion_len else -1.0
        for ids in completion_ids
    ]
