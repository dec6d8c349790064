"""The pure math of the group algorithms' advantages: each completion against the others of its prompt.

  grpo_advantages          GRPO (DeepSeekMath, arXiv:2402.03300) as TRL 1.16: (r - group mean) / std
  rloo_advantages          RLOO (arXiv:2402.14740) as TRL 1.16's RLOOTrainer: r minus the mean of its siblings
  reinforce_pp_advantages  REINFORCE++ and REINFORCE++-baseline (arXiv:2501.03262) as verl 0.9.1
NaN marks a completion no reward source scored; the nan-aware statistics leave it out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from rlhf_core.rl_math import discounted_returns, masked_whiten

STD_EPS = 1e-4  # TRL's: group-relative advantages are divided by std + 1e-4


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


def rloo_advantages(
    per_source: torch.Tensor,
    weights: torch.Tensor,
    num_generations: int,
    *,
    kl: torch.Tensor | None = None,
    beta: float = 0.0,
    reward_clip_range: Sequence[float] | None = None,
    normalize: bool = False,
    penalty: torch.Tensor | None = None,
) -> GroupAdvantages:
    """RLOO's advantages of a whole generation batch, as TRL 1.16's RLOOTrainer computes them.

    r = sum_k w_k r_k (minus `penalty`), clipped into reward_clip_range, minus beta x kl (B,), the KL summed
    over each completion's tokens. A_i = r_i - mean of the other scorable r_j of its group
    (= (sum_j r_j - r_i) / (n_scorable - 1)); NaN, hence 0, for unscorable rows and for a group's only
    scorable row. With `normalize`, A = (A - mean) / (std + 1e-4) over the batch's scorable rows.
    `rewards` reports the plain weighted sum (as TRL logs it), `std` each group's std of r.
    """
    unscorable = torch.isnan(per_source).all(dim=1)
    logged = torch.nansum(per_source * weights.to(per_source).view(1, -1), dim=1).masked_fill(unscorable, float("nan"))
    rewards = logged if penalty is None else logged - penalty.to(logged)
    if reward_clip_range is not None:
        rewards = rewards.clamp(min=reward_clip_range[0], max=reward_clip_range[1])
    if beta and kl is not None:
        rewards = rewards - beta * kl.to(rewards)
    grouped = rewards.view(-1, num_generations)
    std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    scorable = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    baselines = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (scorable - 1)
    advantages = rewards - baselines.view(-1)
    if normalize:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + STD_EPS)
    return GroupAdvantages(torch.nan_to_num(advantages, nan=0.0), logged, std, unscorable)


def group_baseline(scores: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Each score minus its group's mean over the scorable (non-NaN) rows; a group with one scorable row keeps
    its score (verl: a prompt with one response has baseline 0). NaN rows stay NaN. (B,)"""
    grouped = scores.view(-1, num_generations)
    scorable = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    mean = torch.where(scorable > 1, torch.nanmean(grouped, dim=1, keepdim=True), torch.zeros_like(grouped[:, :1]))
    return (grouped - mean).view(-1)


def reinforce_pp_advantages(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    num_generations: int | None = None,
    scorable: torch.Tensor | None = None,
    all_reduce=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ over per-token rewards (the score on the last token, -beta x KL on each), as verl 0.9.1.

    Without `num_generations` (reinforce_plus_plus): returns G = discounted_returns(rewards, gamma),
    advantages = G whitened over every real token of the batch (every process's, through `all_reduce`).
    With it (reinforce_plus_plus_baseline): s = the summed token rewards of each response minus its group's
    mean over the `scorable` rows (`group_baseline`; all rows when None), spread over the response's
    tokens, then whitened; the returns are s. Rows to leave out have mask 0. -> (A, G), (B, T) each
    """
    if num_generations is None:
        returns = discounted_returns(token_rewards, mask, gamma)
    else:
        scores = token_rewards.sum(-1)
        if scorable is not None:
            scores = scores.masked_fill(~scorable, float("nan"))
        returns = torch.nan_to_num(group_baseline(scores, num_generations)).unsqueeze(-1) * mask
    advantages = masked_whiten(returns, mask, all_reduce=all_reduce) * mask
    return advantages, returns
