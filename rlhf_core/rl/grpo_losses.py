"""The policy losses of the GRPO family, one function per shape of loss, and what they share.

  grpo_token_loss      the per-token losses of rl.algorithm grpo and reinforce_plus_plus*, by grpo.loss_type:
    grpo     DeepSeekMath, arXiv:2402.03300: mean over each sequence's tokens, then over sequences
    bnpo     TRL's token-level mean over the micro-batch (no paper of its own)
    dr_grpo  Dr. GRPO, arXiv:2503.20783: sum over tokens / (sequences x max completion length)
    dapo     DAPO, arXiv:2503.14476: sum over tokens / tokens of the whole optimizer batch, every process's
             (verl's token-mean)
    cispo    MiniMax-M1, arXiv:2506.13585: a clipped, detached importance weight times A log pi; dapo's norm
    sapo     SAPO, arXiv:2511.20347: a sigmoid gate instead of the hard clip; grpo's norm
  rloo_sequence_loss   rl.algorithm rloo, as TRL 1.16's RLOOTrainer: one importance ratio per sequence from
                       its summed log-probabilities, clipped, the mean over sequences
with GSPO's sequence-level ratio (arXiv:2507.18071), INTELLECT-2's two-sided clip delta
(arXiv:2505.07291), the high-entropy token mask of arXiv:2506.01939 and the bias-corrected k3 KL of
DeepSeek-V3.2 (arXiv:2512.02556).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from rlhf_core.config import GRPOConfig
from rlhf_core.rl_math import kl_per_token, masked_mean

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"]
TOKEN_NORMALIZED = ("dapo", "cispo")  # loss types normalized by the optimizer batch's tokens, not per micro-batch


def grpo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    grpo: GRPOConfig,
    *,
    ref_logp: torch.Tensor | None = None,
    entropy_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss (B, T) (or (B, 1) at sequence level with nothing per-token added) and statistics.
    `advantages`: (B,) one per completion, or (B, T) one per token (REINFORCE++).

    ratio r = exp(logp - old_logp) per token, or per sequence exp(mean over its tokens) with
    importance_sampling_level 'sequence' (GSPO, arXiv:2507.18071). By loss type:
      clipped (grpo arXiv:2402.03300, bnpo, dr_grpo arXiv:2503.20783, dapo arXiv:2503.14476):
        -min(r' A, clip(r, 1-eps, 1+eps_high) A), r' = min(r, delta) when set (arXiv:2505.07291);
      cispo (arXiv:2506.13585): -sg(min(r, eps_high)) A logp;
      sapo (arXiv:2511.20347): -(4 / tau) sigmoid(tau (r - 1)) A, tau by the sign of A.
    `entropy_mask` (top_entropy_quantile, arXiv:2506.01939) multiplies the policy term; then + beta * k3 KL
    to the reference, times r when use_bias_correction_kl (arXiv:2512.02556; TRL 1.16's default).
    """
    eps_low, eps_high = grpo.epsilon, grpo.epsilon_high or grpo.epsilon
    log_ratio = logp - old_logp
    if grpo.importance_sampling_level == "sequence":
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # (B, 1)
    else:
        log_weights = log_ratio  # (B, T)
    ratio = torch.exp(log_weights)
    adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(1)  # (B, T) per token or (B, 1)
    if grpo.loss_type == "cispo":
        per_token = -torch.clamp(ratio, max=eps_high).detach() * adv * logp
    elif grpo.loss_type == "sapo":
        tau = torch.where(adv > 0, grpo.sapo_temperature_pos, grpo.sapo_temperature_neg)
        per_token = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv
    else:
        clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
        if grpo.delta is not None:
            ratio = torch.clamp(ratio, max=grpo.delta)
        per_token = -torch.min(ratio * adv, clipped * adv)
    if grpo.loss_type == "cispo":
        stats = {"cispo_clipped": ((ratio > eps_high) & (adv > 0)).float()}
    else:
        stats = {
            "low_clipped": ((ratio < 1 - eps_low) & (adv < 0)).float(),
            "high_clipped": ((ratio > 1 + eps_high) & (adv > 0)).float(),
        }
    if entropy_mask is not None:
        per_token = per_token * entropy_mask
    if grpo.beta and ref_logp is not None:
        kl = kl_per_token(logp, ref_logp, "k3")
        if grpo.use_bias_correction_kl:
            kl = kl * torch.exp(log_weights)
        per_token = per_token + grpo.beta * kl
        stats["kl"] = kl
    return per_token, stats


def reduce_loss(
    per_token: torch.Tensor, mask: torch.Tensor, loss_type: LossType, *, max_completion_length: int, total_tokens: float
) -> torch.Tensor:
    """Normalize a micro-batch's per-token loss the way `loss_type` says: grpo and sapo per sequence, then the
    mean (arXiv:2402.03300); bnpo over the micro-batch's tokens; dr_grpo over sequences x max completion length
    (arXiv:2503.20783); dapo and cispo over `total_tokens`, the completion tokens of the whole optimizer batch
    (arXiv:2503.14476).
    """
    mask = mask.to(per_token.dtype)
    if loss_type in ("grpo", "sapo"):
        return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.shape[0] * max_completion_length)
    return (per_token * mask).sum() / (total_tokens if total_tokens > 0 else 1.0)


def high_entropy_mask(
    entropies: torch.Tensor,
    mask: torch.Tensor,
    top_quantile: float,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """True on the real tokens whose entropy is at or above the (1 - top_quantile) quantile of all real
    tokens' entropies (every process's, through `gather`, which takes and returns a 1-D tensor). (B, T) bool"""
    local = entropies[mask.bool()].float()
    pooled = gather(local) if gather is not None else local
    if pooled.numel() == 0:
        return torch.zeros_like(mask, dtype=torch.bool)
    threshold = torch.quantile(pooled, 1 - top_quantile)
    return ((entropies * mask) >= threshold) & mask.bool()


def stat_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of a per-token statistic over real tokens; a per-sequence one (B, 1) over sequences (as TRL)."""
    return x.mean() if x.shape[1] == 1 else masked_mean(x, mask)


def rloo_sequence_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon: float,
    epsilon_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """RLOO's loss of a micro-batch (TRL 1.16 RLOOTrainer): r = exp(sum_t logp - sum_t old_logp) over each
    sequence's tokens of `mask`; -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A), the mean over sequences.

    Statistics (B, 1), per sequence: low_clipped (r < 1 - eps, A < 0) and high_clipped (r > 1 + eps_high, A > 0).
    """
    eps_high = epsilon if epsilon_high is None else epsilon_high
    mask = mask.to(logp.dtype)
    ratio = torch.exp((logp * mask).sum(-1) - (old_logp * mask).sum(-1))
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + eps_high)
    loss = -torch.min(ratio * advantages, clipped * advantages).mean()
    stats = {
        "low_clipped": ((ratio < 1 - epsilon) & (advantages < 0)).float().unsqueeze(1),
        "high_clipped": ((ratio > 1 + eps_high) & (advantages > 0)).float().unsqueeze(1),
    }
    return loss, stats
