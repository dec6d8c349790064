"""The reward sources of the GRPO family: reward models and Python reward functions (`functions.py`) in this
process, and scorers served elsewhere (`remote_scorers.py`), each scoring a rollout's completions, one float or None
("not applicable") per completion, weighted; a served source's `Unscored` drops the completion's group."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from rlhf_core.data.batching import micro_batch_plan
from rlhf_core.data.chat import PROMPT_MESSAGES, assistant_messages, extra_columns
from rlhf_core.models.forward import over_micro_batches, sequence_scores
from rlhf_core.rewards.functions import accepts, call_scoring_function, check_finite, completion_ids
from rlhf_core.rewards.remote import SourceStats, Unscored
from rlhf_core.rewards.remote_scorers import RemoteScorer
from rlhf_core.rollout.collect import Rollout
from rlhf_core.rollout.tools import ToolUse


@dataclass
class RewardSourceFn:
    """One reward source: `score(prompts, completions, rollout, rows)` -> one float or None per completion."""

    name: str
    weight: float
    score: Callable[[list[str], list[str], Rollout, list[dict]], list[float | None]]
    stats: SourceStats | None = None  # a served source's request counts and latencies (`source_metrics`)


def model_reward(
    name: str, weight: float, reward_model, *, micro_batch: int | None = None, max_tokens: int | None = None
) -> RewardSourceFn:
    """A reward model read at the last real token of each prompt+completion, `micro_batch` completions at a time
    (all when None) or by the token budget `max_tokens` (`micro_batch_plan`)."""

    def score(prompts, completions, rollout: Rollout, rows):
        reward_model.to(rollout.query_ids.device)  # a no-op once it is there
        args = (rollout.query_ids, rollout.query_mask, rollout.responses, rollout.resp_mask, rollout.last_index)
        lengths = (rollout.query_mask.sum(1) + rollout.resp_mask.sum(1)).tolist()
        plan = micro_batch_plan(lengths, micro_batch or len(lengths), max_tokens)
        with torch.no_grad():
            values = over_micro_batches(partial(sequence_scores, reward_model), plan, *args)
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


def remote_reward(name: str, weight: float, scorer: RemoteScorer) -> RewardSourceFn:
    """A scorer served elsewhere, given the texts, the rows' columns and, when it sends them, each completion's
    prompt and completion token ids (the prompt's without padding; the completion's up to its last real token)
    and the rollout's widths. A judge or HTTP scorer gets a conversational prompt as its messages' contents
    (as evaluation hands them), a reward model the rendered prompt it was trained on."""

    def score(prompts, completions, rollout, rows):
        columns, widths = extra_columns(rows), None
        if scorer.source.kind != "reward_model" and rows and PROMPT_MESSAGES in rows[0]:
            prompts = [row[PROMPT_MESSAGES] for row in rows]  # a judge reads the messages, not the template's text
        if scorer.wants_ids and rollout is not None:
            columns["prompt_ids"] = [q[m.bool()].tolist() for q, m in zip(rollout.query_ids, rollout.query_mask)]
            columns["completion_ids"] = completion_ids(rollout.responses, rollout.resp_mask)
            widths = (rollout.query_ids.shape[1], rollout.responses.shape[1])
        return scorer(prompts=prompts, completions=completions, widths=widths, **columns)

    return RewardSourceFn(name, weight, score, stats=scorer.stats)


def source_metrics(sources: list[RewardSourceFn]) -> dict[str, float]:
    """The served sources' counts and latencies since the last call (`SourceStats.pop`)."""
    return {k: v for source in sources if source.stats is not None for k, v in source.stats.pop().items()}


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
    sources: list[RewardSourceFn],
    prompts: list[str],
    completions: list[str],
    rollout: Rollout,
    rows: list[dict],
    group: int = 1,
) -> torch.Tensor:
    """Every source's scores of the completions, (B, F) float32, NaN where a source returned None; a NaN or inf
    a source returns stops the step (`check_finite` names the source). A completion a served source left
    `Unscored` (on_failure drop_group) drops its group: each of the `group` consecutive rows it belongs to is
    NaN for every source (unscorable: advantage 0), counted in that source's dropped_groups."""
    scored, dropped = [], torch.zeros(len(completions), dtype=torch.bool)
    for source in sources:
        values = source.score(prompts, completions, rollout, rows)
        unscored = torch.tensor([isinstance(v, Unscored) for v in values], dtype=torch.bool)
        values = [None if isinstance(v, Unscored) else v for v in values]
        check_finite(f"reward {source.name}", values)
        scored.append([float("nan") if v is None else v for v in values])
        if unscored.any():
            groups = unscored.view(-1, group).any(dim=1)
            source.stats.add(dropped_groups=int((groups & ~dropped.view(-1, group).any(dim=1)).sum()))
            dropped |= groups.repeat_interleave(group)
    scores = torch.tensor(scored, dtype=torch.float32).T
    return scores.masked_fill(dropped.unsqueeze(1), float("nan"))
