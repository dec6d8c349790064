"""The GRPO family's completions table: every grpo.log_completions_steps steps (and at the last), each completion
of the step beside its prompt, its reward, each reward source's score and its advantage, for the
`on_completions` hook (TRL's log_completions; the RL stage writes it as a table beside the run).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlhf_core.rl.advantages.estimators import Estimate
from rlhf_core.rl_math import masked_mean
from rlhf_core.rollout.collect import RolloutBatch


def completions_due(step: int, every: int, total_steps: int) -> bool:
    """Whether step `step` (1-based) writes the table: every `every` steps and at the last."""
    return step % every == 0 or step == total_steps


def completions_table(
    step: int, batch: RolloutBatch, estimate: Estimate, source_names: Sequence[str]
) -> list[dict[str, object]]:
    """One row per completion of this process: step, prompt, completion (a tool episode's transcript on one line,
    `EpisodeRecord.lines`), advantage, reward and each source's score (None where NaN: the source abstained, or no
    source scored the completion)."""
    advantages = estimate.advantages
    episodes = batch.rollout.episodes
    completions = episodes.lines() if episodes is not None else batch.completions
    if advantages.dim() == 2:  # one per token (REINFORCE++): the mean over each completion's tokens
        advantages = masked_mean(advantages, batch.rollout.model_mask(), dim=1)
    return [
        {
            "step": step,
            "prompt": row["prompt"],
            "completion": completion,
            "advantage": float(advantage),
            "reward": float_or_none(reward),
            **{name: float_or_none(v) for name, v in zip(source_names, batch.scores[i])},
        }
        for i, (row, completion, advantage, reward) in enumerate(
            zip(batch.rows, completions, advantages.tolist(), estimate.stats["my_rewards"])
        )
    ]


def float_or_none(value: torch.Tensor) -> float | None:
    """A 0-d tensor as a float for the table; None where it is NaN."""
    return None if torch.isnan(value) else float(value)
