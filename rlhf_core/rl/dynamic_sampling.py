"""DAPO's dynamic sampling (arXiv:2503.14476) for the GRPO family (grpo.dynamic_sampling): a group whose
completions all earn the same reward has zero advantage under every group estimator, so it teaches nothing
and only dilutes the batch. Such groups are dropped and more prompts are sampled until the generation
batch is full again, for at most max_rounds extra rounds; a batch still short then is filled with dropped
groups (they carry no advantage) so that every step trains on the same number of completions.

The pure parts are here: which groups have zero spread, and cutting and joining rollouts group by group.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from rlhf_core.rl.advantages.group_baselines import nanstd
from rlhf_core.rl_math import INVALID_LOGPROB
from rlhf_core.rollout.collect import Rollout, RolloutBatch
from rlhf_core.rollout.episodes import EpisodeRecord


def zero_spread_groups(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """True for each group (of num_generations consecutive rows) whose scorable rewards are all equal, or
    that has fewer than two scorable rows (NaN: no reward source scored the row). (B,) -> (B / G,) bool"""
    std = nanstd(rewards.view(-1, num_generations), dim=1)
    return torch.isnan(std) | torch.isclose(std, torch.zeros_like(std))


def group_rows(groups: torch.Tensor, num_generations: int) -> torch.Tensor:
    """The row indices of the given group indices, in order. (K,) -> (K x G,)"""
    return (groups.view(-1, 1) * num_generations + torch.arange(num_generations, device=groups.device)).view(-1)


def _pad_to(x: torch.Tensor, width: int, value: float, *, left: bool) -> torch.Tensor:
    missing = width - x.shape[1]
    if missing <= 0:
        return x
    fill = torch.full((x.shape[0], missing), value, dtype=x.dtype, device=x.device)
    return torch.cat([fill, x] if left else [x, fill], dim=1)


def join_batches(batches: list[RolloutBatch], pad_token_id: int) -> RolloutBatch:
    """Rollout batches stacked row-wise: queries left-padded, responses right-padded to the widest (positions
    come from the masks, so padding changes no log-probability)."""
    if len(batches) == 1:
        return batches[0]
    rollouts = [b.rollout for b in batches]
    q = max(r.query_ids.shape[1] for r in rollouts)
    t = max(r.responses.shape[1] for r in rollouts)

    def cat(name: str, width: int, value: float, left: bool) -> torch.Tensor | None:
        parts = [getattr(r, name) for r in rollouts]
        return None if parts[0] is None else torch.cat([_pad_to(p, width, value, left=left) for p in parts])

    rollout = Rollout(
        query_ids=cat("query_ids", q, pad_token_id, True),
        query_mask=cat("query_mask", q, 0, True),
        responses=cat("responses", t, pad_token_id, False),
        resp_mask=cat("resp_mask", t, 0, False),
        last_index=torch.cat([r.last_index for r in rollouts]),
        logprobs=cat("logprobs", t, INVALID_LOGPROB, False),
        ref_logprobs=cat("ref_logprobs", t, INVALID_LOGPROB, False),
        behaviour_logprobs=cat("behaviour_logprobs", t, INVALID_LOGPROB, False),
        has_stop=torch.cat([r.has_stop for r in rollouts]),
        model_tokens=cat("model_tokens", t, 0, False),
        episodes=None if rollouts[0].episodes is None else EpisodeRecord.join([r.episodes for r in rollouts]),
    )
    penalties = [b.penalty for b in batches]
    return RolloutBatch(
        rollout,
        torch.cat([b.scores for b in batches]),
        None if penalties[0] is None else torch.cat(penalties),
        rows=[row for b in batches for row in b.rows],
        completions=[c for b in batches for c in b.completions],
    )


def select_rows(batch: RolloutBatch, rows: torch.Tensor) -> RolloutBatch:
    """The given rows of a rollout batch (values, PPO's, are not carried: the GRPO family has none)."""
    r = batch.rollout
    pick = rows.tolist()
    rollout = replace(
        r,
        **{
            name: getattr(r, name)[rows]
            for name in ("query_ids", "query_mask", "responses", "resp_mask", "last_index", "has_stop")
        },
        logprobs=r.logprobs[rows] if r.logprobs is not None else None,
        ref_logprobs=r.ref_logprobs[rows] if r.ref_logprobs is not None else None,
        behaviour_logprobs=r.behaviour_logprobs[rows] if r.behaviour_logprobs is not None else None,
        model_tokens=r.model_tokens[rows] if r.model_tokens is not None else None,
        episodes=r.episodes.select(pick) if r.episodes is not None else None,
    )
    return RolloutBatch(
        rollout,
        batch.scores[rows],
        batch.penalty[rows] if batch.penalty is not None else None,
        rows=[batch.rows[i] for i in pick] if batch.rows else [],
        completions=[batch.completions[i] for i in pick] if batch.completions else [],
    )


@dataclass
class GroupFiller:
    """Collects groups with spread until `wanted` of them are in; keeps the dropped ones for a short batch."""

    wanted: int
    num_generations: int
    kept: list[RolloutBatch] = field(default_factory=list)
    dropped: list[RolloutBatch] = field(default_factory=list)
    kept_groups: int = 0
    dropped_groups: int = 0

    @property
    def missing(self) -> int:
        return self.wanted - self.kept_groups

    def add(self, batch: RolloutBatch, rewards: torch.Tensor) -> None:
        """Keep the groups of `batch` with spread (up to `missing`); set the others aside. rewards (B,)"""
        flat = zero_spread_groups(rewards, self.num_generations)
        spread = torch.nonzero(~flat).view(-1)[: max(self.missing, 0)]
        flat_groups = torch.nonzero(flat).view(-1)
        if len(spread):
            self.kept.append(select_rows(batch, group_rows(spread, self.num_generations)))
            self.kept_groups += len(spread)
        if len(flat_groups):
            self.dropped.append(select_rows(batch, group_rows(flat_groups, self.num_generations)))
            self.dropped_groups += len(flat_groups)

    def batch(self, pad_token_id: int) -> tuple[RolloutBatch, int]:
        """The full batch, and how many dropped groups filled it up (when the rounds ran out)."""
        parts, filled = list(self.kept), 0
        if self.missing > 0:
            pool = join_batches(self.dropped, pad_token_id)
            filled = self.missing
            parts.append(select_rows(pool, torch.arange(filled * self.num_generations)))
        return join_batches(parts, pad_token_id), filled
