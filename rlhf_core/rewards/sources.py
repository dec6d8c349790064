"""The reward sources of the GRPO family: reward models and Python reward functions (`reward_functions.py`),
each scoring a rollout's completions, one float or None ("not applicable") per completion, weighted."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlhf_core.data.chat import PROMPT_MESSAGES, assistant_messages, extra_columns
from rlhf_core.models.forward import sequence_scores
from rlhf_core.rewards.functions import accepts, call_scoring_function, check_finite, completion_ids
from rlhf_core.rollout.collect import Rollout
from rlhf_core.rollout.tools import ToolUse


@dataclass
class RewardSourceFn:
    """One reward source: `score(prompts, completions, rollout, rows)` -> one float or None per completion."""

    name: str
    weight: float
    score: Callable[[list[str], list[str], Rollout, list[dict]], list[float | None]]


def model_reward(name: str, weight: float, reward_model) -> RewardSourceFn:
    """A reward model read at the last real token of each prompt+completion."""

    def score(prompts, completions, rollout: Rollout, rows):
        reward_model.to(rollout.query_ids.device)  # a no-op once it is there
        with torch.no_grad():
            values = sequence_scores(
                reward_model,
                rollout.query_ids,
                rollout.query_mask,
                rollout.responses,
                rollout.resp_mask,
                rollout.last_index,
            )
        return values.tolist()

    return RewardSourceFn(name, weight, score)


def function_reward(name: str, weight: float, fn) -> RewardSourceFn:
    """A Python function called as fn(prompts=, completions=, **dataset_columns), checked for shape and type;
    also with completion_ids= (`completion_ids`) when it takes that argument or **kwargs, as TRL's are.

    For conversational prompts (rows with `prompt_messages`) it receives, as TRL hands them, the prompts as
    message lists and each completion as [{"role": "assistant", "content": text}]; for tool episodes the transcript
    (the model's and the tools' messages) and, to a function that takes it, `environments=` (each episode's)."""
    wants_ids, wants_environments = accepts(fn, "completion_ids"), accepts(fn, "environments")

    def score(prompts, completions, rollout, rows):
        columns = extra_columns(rows)
        if wants_ids and rollout is not None and "completion_ids" not in columns:
            columns["completion_ids"] = completion_ids(rollout.responses, rollout.resp_mask)  # an episode's: all of it
        episodes = rollout.episodes if rollout is not None else None
        if episodes is not None:  # a tool episode: its transcript (assistant and tool messages), as TRL's
            completions = episodes.transcripts
            if wants_environments and "environments" not in columns:
                columns["environments"] = episodes.environments
        if rows and PROMPT_MESSAGES in rows[0]:
            prompts = [row[PROMPT_MESSAGES] for row in rows]
            completions = completions if episodes is not None else assistant_messages(completions)
        return call_scoring_function(name, fn, prompts=prompts, completions=completions, **columns)

    return RewardSourceFn(name, weight, score)


def environment_rewards(tool_use: ToolUse) -> list[RewardSourceFn]:
    """Each environment class with get_reward() as a reward source of weight 1 named after the class (TRL's): an
    episode is scored by its own environment when it is of that class, else the source abstains (None)."""

    def source(cls: type) -> RewardSourceFn:
        def score(prompts, completions, rollout, rows):
            boxes = rollout.episodes.toolboxes
            return [b.environment.get_reward() if type(b.environment) is cls else None for b in boxes]

        return RewardSourceFn(cls.__name__, 1.0, score)

    return [source(cls) for cls in tool_use.reward_classes()]


def score_sources(
    sources: list[RewardSourceFn], prompts: list[str], completions: list[str], rollout: Rollout, rows: list[dict]
) -> torch.Tensor:
    """Every source's scores of the completions, (B, F) float32, NaN where a source returned None; a NaN or inf
    a source returns stops the step (`check_finite` names the source)."""
    scored = []
    for source in sources:
        values = source.score(prompts, completions, rollout, rows)
        check_finite(f"reward {source.name}", values)
        scored.append([float("nan") if v is None else v for v in values])
    return torch.tensor(scored, dtype=torch.float32).T
