"""Advantage estimators: the second phase of an RL step (rollout -> advantages -> update -> metrics).

`estimator_for(rl.algorithm)` picks one from `ESTIMATORS`. Each is a function of the scored rollout
(`RolloutBatch`) and an `EstimatorContext` that returns an `Estimate`; a new estimator is one such
function registered under its algorithm's name, and a test that pins its math. The pure math each
estimator wraps lives in `rl_math.py` (GAE, discounted returns) and `group_baselines.py`:
  ppo   GAE over KL-penalized per-token rewards, with a value model (arXiv:1506.02438; the KL penalty
        of Ziegler et al., arXiv:1909.08593)
  grpo  group-relative rewards: each completion against the other completions of its prompt
        (DeepSeekMath, arXiv:2402.03300), as TRL 1.16 computes them
  rloo  REINFORCE leave-one-out: each completion against the mean of its siblings (Ahmadian et al.,
        arXiv:2402.14740), with TRL 1.16 RLOOTrainer's KL-in-reward, clipping and normalization
  reinforce_plus_plus           REINFORCE++ (arXiv:2501.03262) as verl 0.9.1 computes it: discounted
        returns of the KL-penalized token rewards, whitened over the batch's tokens
  reinforce_plus_plus_baseline  the same with the group's mean score subtracted first (no discount)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from rlhf_core.config import GRPOConfig, PPOConfig
from rlhf_core.rl.advantages.group_baselines import (
    GroupAdvantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from rlhf_core.rl_math import compute_gae, kl_penalized_rewards, kl_per_token, masked_whiten
from rlhf_core.rollout.collect import RolloutBatch


class Collectives(Protocol):
    """What an estimator needs of data parallelism (a `TrainingLoop` is one): statistics over every process's rows."""

    rank: int
    world: int

    def gather(self, value: torch.Tensor) -> torch.Tensor: ...

    def global_sum(self, value: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class EstimatorContext:
    """What an estimator reads besides the rollout: its config section, the group size, the reward sources'
    weights, the KL coefficient folded into rewards (PPO's controller), and the processes."""

    config: PPOConfig | GRPOConfig
    collectives: Collectives
    generations_per_prompt: int = 1
    weights: torch.Tensor | None = None  # (F,) one per reward source
    kl_coef: float = 0.0


@dataclass
class Estimate:
    """An estimator's result for this process's rows."""

    advantages: torch.Tensor  # (B,) one per completion, or (B, R) one per response token
    returns: torch.Tensor | None = None  # (B, R) the value model's targets (estimators with a critic)
    stats: dict[str, torch.Tensor] = field(default_factory=dict)  # what the metrics phase reports


Estimator = Callable[[RolloutBatch, EstimatorContext], Estimate]


@dataclass(frozen=True)
class RegisteredEstimator:
    estimate: Estimator
    needs_values: bool  # True: the rollout must carry a value model's values (PPO's trainer)


ESTIMATORS: dict[str, RegisteredEstimator] = {}


def register_estimator(algorithm: str, *, needs_values: bool = False) -> Callable[[Estimator], Estimator]:
    """Register `fn` as the advantage estimator of `rl.algorithm == algorithm`."""

    def add(fn: Estimator) -> Estimator:
        ESTIMATORS[algorithm] = RegisteredEstimator(fn, needs_values)
        return fn

    return add


def estimator_for(algorithm: str, *, with_values: bool) -> Estimator:
    """The estimator of rl.algorithm `algorithm`; `with_values` says whether the trainer asking has a value model."""
    if algorithm not in ESTIMATORS:
        raise ValueError(f"rl.algorithm {algorithm!r} has no advantage estimator; known: {sorted(ESTIMATORS)}")
    registered = ESTIMATORS[algorithm]
    if registered.needs_values != with_values:
        needs = "needs a value model" if registered.needs_values else "trains without a value model"
        raise ValueError(f"rl.algorithm {algorithm!r} {needs}; this trainer {'has' if with_values else 'has none'}")
    return registered.estimate


# -- PPO: GAE over KL-penalized rewards ------------------------------------------------------------------


@register_estimator("ppo", needs_values=True)
def gae_estimate(batch: RolloutBatch, ctx: EstimatorContext) -> Estimate:
    """PPO's advantages: the reward model's score on the last token, -kl_coef x KL on every token, optionally
    whitened over every process's tokens; then GAE against the value model, optionally whitened."""
    ppo, rollout = ctx.config, batch.rollout
    mask = rollout.resp_mask
    all_reduce = ctx.collectives.global_sum if ctx.collectives.world > 1 else None
    scores = batch.sequence_scores()
    kl = kl_per_token(rollout.logprobs, rollout.ref_logprobs, ppo.kl_estimator) * mask  # (B, R)
    rewards, non_score = kl_penalized_rewards(scores, kl, mask, rollout.last_index, ctx.kl_coef)
    if ppo.whiten_rewards:
        rewards = masked_whiten(rewards, mask, shift_mean=False, all_reduce=all_reduce) * mask
    advantages, returns = compute_gae(rewards, batch.values, mask, ppo.gamma, ppo.lam)
    if ppo.whiten_advantages:
        advantages = masked_whiten(advantages, mask, all_reduce=all_reduce) * mask
    return Estimate(advantages, returns, {"scores": scores, "kl": kl, "non_score_reward": non_score})


# -- GRPO: group-relative rewards ---------------------------------------------------------------------


@register_estimator("grpo")
def group_relative_estimate(batch: RolloutBatch, ctx: EstimatorContext) -> Estimate:
    """GRPO's advantages over every process's groups (batch statistics are global); this process's rows kept.

    stats: the global rewards, stds, unscorable flags and per-source scores, for the metrics phase."""
    grpo, collectives = ctx.config, ctx.collectives
    everyone_sources = collectives.gather(batch.scores)
    everyone = grpo_advantages(
        everyone_sources,
        ctx.weights,
        ctx.generations_per_prompt,
        scale_rewards=grpo.scale_rewards,
        aggregation=grpo.multi_objective_aggregation,
        penalty=collectives.gather(batch.penalty) if batch.penalty is not None else None,
    )
    return _group_estimate(batch, ctx, everyone, everyone_sources)


def _group_estimate(
    batch: RolloutBatch, ctx: EstimatorContext, everyone: GroupAdvantages, sources, kl: torch.Tensor | None = None
) -> Estimate:
    """This process's rows of advantages computed over every process's groups, with the metrics phase's stats;
    `kl` (B, R), the per-token KL put into the reward, is reported as its mean over every process's tokens."""
    rank = ctx.collectives.rank
    mine = slice(rank * len(batch), (rank + 1) * len(batch))
    stats = {
        "rewards": everyone.rewards,
        "std": everyone.std,
        "unscorable": everyone.unscorable,
        "per_source": sources,
        "my_rewards": everyone.rewards[mine],
    }
    if kl is not None:
        mask = batch.rollout.trained_mask(ctx.config.mask_truncated_completions)
        total, count = ctx.collectives.global_sum(torch.stack([(kl * mask).sum(), mask.sum().float()]))
        stats["kl"] = total / count.clamp(min=1.0)
    return Estimate(everyone.advantages[mine], stats=stats)


# -- RLOO: leave-one-out baselines ----------------------------------------------------------------------


@register_estimator("rloo")
def leave_one_out_estimate(batch: RolloutBatch, ctx: EstimatorContext) -> Estimate:
    """RLOO's advantages over every process's groups (TRL gathers rewards and the KL); this process's rows kept."""
    grpo, collectives, rollout = ctx.config, ctx.collectives, batch.rollout
    kl = kl_tokens = None
    if grpo.beta:
        kl_tokens = kl_per_token(rollout.logprobs, rollout.ref_logprobs, grpo.kl_estimator)
        kl = collectives.gather((kl_tokens * rollout.trained_mask(grpo.mask_truncated_completions)).sum(-1))
    sources = collectives.gather(batch.scores)
    everyone = rloo_advantages(
        sources,
        ctx.weights,
        ctx.generations_per_prompt,
        kl=kl,
        beta=grpo.beta,
        reward_clip_range=grpo.reward_clip_range,
        normalize=grpo.normalize_advantages,
        penalty=collectives.gather(batch.penalty) if batch.penalty is not None else None,
    )
    return _group_estimate(batch, ctx, everyone, sources, kl_tokens)


# -- REINFORCE++: whitened discounted returns -----------------------------------------------------------


def _reinforce_pp(batch: RolloutBatch, ctx: EstimatorContext, *, baseline: bool) -> Estimate:
    """REINFORCE++'s per-token advantages of this process's rows; unscorable rows (every source None) are left
    out of the statistics with advantage 0; the whitening is over every process's tokens."""
    grpo, collectives, rollout = ctx.config, ctx.collectives, batch.rollout
    sources = collectives.gather(batch.scores)
    everyone = rloo_advantages(sources, ctx.weights, ctx.generations_per_prompt)  # the logged rewards and stds
    scorable = ~torch.isnan(batch.scores).all(dim=1)
    scores = torch.nansum(batch.scores * ctx.weights.to(batch.scores).view(1, -1), dim=1)
    if batch.penalty is not None:
        scores = scores - batch.penalty.to(scores)
    mask = rollout.trained_mask(grpo.mask_truncated_completions) * scorable.unsqueeze(1)
    kl = kl_per_token(rollout.logprobs, rollout.ref_logprobs, grpo.kl_estimator) if grpo.beta else None
    kl_masked = kl * mask if kl is not None else torch.zeros_like(mask, dtype=scores.dtype)
    token_rewards, _ = kl_penalized_rewards(scores * scorable, kl_masked, mask, rollout.last_index, grpo.beta)
    advantages, returns = reinforce_pp_advantages(
        token_rewards * mask,
        mask,
        gamma=grpo.gamma,
        num_generations=ctx.generations_per_prompt if baseline else None,
        scorable=scorable,
        all_reduce=collectives.global_sum if collectives.world > 1 else None,
    )
    return Estimate(advantages, returns, _group_estimate(batch, ctx, everyone, sources, kl).stats)


@register_estimator("reinforce_plus_plus")
def reinforce_pp_estimate(batch: RolloutBatch, ctx: EstimatorContext) -> Estimate:
    """REINFORCE++: whitened discounted returns of the KL-penalized token rewards (verl 0.9.1)."""
    return _reinforce_pp(batch, ctx, baseline=False)


@register_estimator("reinforce_plus_plus_baseline")
def reinforce_pp_baseline_estimate(batch: RolloutBatch, ctx: EstimatorContext) -> Estimate:
    """REINFORCE++-baseline: the group mean of the summed token rewards subtracted, then whitened (verl 0.9.1)."""
    return _reinforce_pp(batch, ctx, baseline=True)
