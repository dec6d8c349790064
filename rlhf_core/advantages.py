"""Advantage estimators: the second phase of an RL step (rollout -> advantages -> update -> metrics).

`estimator_for(rl.algorithm)` picks one from `ESTIMATORS`. Each is a function of the scored rollout
(`RolloutBatch`) and an `EstimatorContext` that returns an `Estimate`; a new estimator is one such
function registered under its algorithm's name, and a test that pins its math. The pure math each
estimator wraps is here too:
  ppo   GAE over KL-penalized per-token rewards, with a value model (arXiv:1506.02438; the KL penalty
        of Ziegler et al., arXiv:1909.08593)
  grpo  group-relative rewards: each completion against the other completions of its prompt
        (DeepSeekMath, arXiv:2402.03300), as TRL 1.16 computes them
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from rlhf_core.config import GRPOConfig, PPOConfig
from rlhf_core.rl_math import kl_per_token, masked_whiten
from rlhf_core.rollout import RolloutBatch

STD_EPS = 1e-4  # TRL's: group-relative advantages are divided by std + 1e-4


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


def kl_penalized_rewards(
    scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, last_index: torch.Tensor, kl_coef: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards: -kl_coef * kl on every real token, plus the sequence score on its last token.

    Returns (rewards, non_score_reward), each (B, T), zero on padding.
    """
    non_score = -kl_coef * kl * mask
    rewards = non_score.clone()
    rewards[torch.arange(rewards.shape[0], device=rewards.device), last_index] += scores
    return rewards, non_score


def compute_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (arXiv:1506.02438) over response tokens, vectorized. -> (advantages,
    returns), (B, T)

    delta_t = r_t + gamma * V_{t+1} - V_t (V past the end is 0), A_t = sum_l (gamma*lam)^l delta_{t+l},
    returns = A + V. Padding positions have zero reward and value, so they add nothing.
    """
    values = values * mask
    rewards = rewards * mask
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)
    deltas = rewards + gamma * next_values - values  # (B, T)
    t = torch.arange(rewards.shape[1], device=rewards.device, dtype=rewards.dtype)
    lag = t.view(1, -1) - t.view(-1, 1)  # (T, T): s - t
    discount = torch.where(lag >= 0, (gamma * lam) ** lag.clamp(min=0), torch.zeros_like(lag))
    advantages = (deltas @ discount.T) * mask  # A_t = sum_s discount[t, s] * delta_s
    return advantages, advantages + values


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


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Unbiased std over the non-NaN entries; NaN where fewer than two entries are present (as TRL's nanstd)."""
    dims = dim if dim is not None else tuple(range(x.dim()))
    mean = torch.nanmean(x, dim=dims, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dims, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dims, keepdim=True)
    var = var * torch.where(count > 1, count / (count - 1), torch.full_like(var, float("nan")))
    std = var.sqrt()
    return std if keepdim else std.squeeze(dims) if dim is not None else std.reshape(())


@dataclass
class GroupAdvantages:
    advantages: torch.Tensor  # (B,) 0 for unscorable rows
    rewards: torch.Tensor  # (B,) the weighted sum of the sources (minus any penalty); NaN for unscorable rows
    std: torch.Tensor  # (B,) the std each row was (or, with scale none, would be) divided by
    unscorable: torch.Tensor  # (B,) bool: every source returned None


def grpo_advantages(
    per_source: torch.Tensor,
    weights: torch.Tensor,
    num_generations: int,
    *,
    scale_rewards: Literal["group", "batch", "none"] = "group",
    aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize",
    penalty: torch.Tensor | None = None,
) -> GroupAdvantages:
    """Group-relative advantages of a whole generation batch (every process's rows, group by group), as TRL 1.16.

    per_source (B, F): each source's reward, NaN where it returned None. A row with no reward at all
    is unscorable: NaN, left out of every (nan-aware) mean and std, advantage 0.
    sum_then_normalize: r = sum_k w_k r_k (minus `penalty` (B,), e.g. the missing-stop penalty);
    A = (r - group mean) / (group std, batch std, or 1 with scale none (Dr. GRPO, arXiv:2503.20783); + 1e-4).
    normalize_then_sum: each source normalized in its group first, r = sum_k w_k z_k, then
    A = (r - batch mean) / (batch std + 1e-4); scale_rewards plays no part.
    """
    group = num_generations
    unscorable = torch.isnan(per_source).all(dim=1)
    w = weights.to(per_source).view(1, -1)
    if aggregation == "sum_then_normalize":
        rewards = torch.nansum(per_source * w, dim=1)
        if penalty is not None:
            rewards = rewards - penalty.to(rewards)
        rewards = rewards.masked_fill(unscorable, float("nan"))
        mean = torch.nanmean(rewards.view(-1, group), dim=1).repeat_interleave(group)
        if scale_rewards == "batch":
            std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        else:
            std = nanstd(rewards.view(-1, group), dim=1).repeat_interleave(group)
        advantages = rewards - mean
        if scale_rewards != "none":
            advantages = advantages / (std + STD_EPS)
    else:
        if penalty is not None:
            raise ValueError("a missing-stop penalty needs aggregation 'sum_then_normalize'")
        grouped = per_source.view(-1, group, per_source.shape[1])
        z = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (nanstd(grouped, dim=1, keepdim=True) + STD_EPS)
        summed = torch.nansum(z.view(-1, per_source.shape[1]) * w, dim=1).masked_fill(unscorable, float("nan"))
        std = nanstd(summed).expand_as(summed) if summed.numel() > 1 else torch.zeros_like(summed)
        advantages = (summed - torch.nanmean(summed)) / (std + STD_EPS)
        # what is logged (and tabled) as the reward is the plain weighted sum, as TRL logs it
        rewards = torch.nansum(per_source * w, dim=1).masked_fill(unscorable, float("nan"))
    return GroupAdvantages(torch.nan_to_num(advantages, nan=0.0), rewards, std, unscorable)


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
    mine = slice(collectives.rank * len(batch), (collectives.rank + 1) * len(batch))
    stats = {
        "rewards": everyone.rewards,
        "std": everyone.std,
        "unscorable": everyone.unscorable,
        "per_source": everyone_sources,
        "my_rewards": everyone.rewards[mine],
    }
    return Estimate(everyone.advantages[mine], stats=stats)
