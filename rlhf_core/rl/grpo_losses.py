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

`policy_loss_for` picks the family's loss once per run (`TokenPolicyLoss` or `RLOOPolicyLoss`): it takes a
micro-batch's `LossInputs` and returns the micro-batch's share of the optimizer step's loss and its `LossStats`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol

import torch

from rlhf_core.config import GRPOConfig, RLConfig
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
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss (B, T) (or (B, 1) at sequence level with nothing per-token added) and statistics.
    `advantages`: (B,) one per completion, or (B, T) one per token (REINFORCE++).

    ratio r = exp(logp - old_logp) per token, or per sequence exp(mean over its tokens) with
    importance_sampling_level 'sequence' (GSPO, arXiv:2507.18071). By loss type:
      clipped (grpo arXiv:2402.03300, bnpo, dr_grpo arXiv:2503.20783, dapo arXiv:2503.14476):
        -min(r' A, clip(r, 1-eps, 1+eps_high) A), r' = min(r, delta) when set (arXiv:2505.07291);
      cispo (arXiv:2506.13585): -sg(min(r, eps_high)) A logp;
      sapo (arXiv:2511.20347): -(4 / tau) sigmoid(tau (r - 1)) A, tau by the sign of A.
    `entropy_mask` (top_entropy_quantile, arXiv:2506.01939) multiplies the policy term, then `is_weights` (the
    rollout engine's correction, `engine_correction.py`; (B, T) or (B, 1)) as TRL 1.16 does; then + beta * k3 KL
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
    if is_weights is not None:
        per_token = per_token * is_weights
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
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """RLOO's loss of a micro-batch (TRL 1.16 RLOOTrainer): r = exp(sum_t logp - sum_t old_logp) over each
    sequence's tokens of `mask`; -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A), the mean over sequences.
    `is_weights` (B, 1): the rollout engine's per-sequence correction times each sequence's term (TRL's
    RLOOTrainer has none; the GRPO family's sequence modes, applied the same way).

    Statistics (B, 1), per sequence: low_clipped (r < 1 - eps, A < 0) and high_clipped (r > 1 + eps_high, A > 0).
    """
    eps_high = epsilon if epsilon_high is None else epsilon_high
    mask = mask.to(logp.dtype)
    ratio = torch.exp((logp * mask).sum(-1) - (old_logp * mask).sum(-1))
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + eps_high)
    per_sequence = -torch.min(ratio * advantages, clipped * advantages)
    if is_weights is not None:
        per_sequence = per_sequence * is_weights.reshape(-1)
    loss = per_sequence.mean()
    stats = {
        "low_clipped": ((ratio < 1 - epsilon) & (advantages < 0)).float().unsqueeze(1),
        "high_clipped": ((ratio > 1 + eps_high) & (advantages > 0)).float().unsqueeze(1),
    }
    return loss, stats


# --- the family's loss of one micro-batch, chosen once per run ---------------------------------------------------


@dataclass(frozen=True)
class LossInputs:
    """What the family's loss reads of one micro-batch of B completions with T response tokens."""

    logp: torch.Tensor  # (B, T) the policy's log-probabilities, with their gradient
    old_logp: torch.Tensor  # (B, T) at sampling; on-policy, logp detached (TRL)
    entropy: torch.Tensor  # (B, T) the policy's, for the high-entropy token mask
    advantages: torch.Tensor  # (B,) one per completion, or (B, T) one per token (REINFORCE++)
    mask: torch.Tensor  # (B, T) the trained tokens
    ref_logp: torch.Tensor | None  # (B, T) the reference's, where the rollout computed them (beta > 0)
    total_tokens: float  # the optimizer batch's trained tokens over every process / world (dapo, cispo)
    is_weights: torch.Tensor | None = None  # (B, T) or (B, 1) the rollout engine's correction; None: none


@dataclass(frozen=True)
class ClipRatios:
    """The shares of a micro-batch's tokens (its sequences, where the ratio is one per sequence) whose
    importance ratio the clip cut: below 1 - epsilon with A < 0, above 1 + epsilon_high with A > 0, either."""

    low: torch.Tensor
    high: torch.Tensor
    region: torch.Tensor

    METRICS: ClassVar[tuple[str, ...]] = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")

    @classmethod
    def of(cls, stats: dict[str, torch.Tensor], mask: torch.Tensor) -> ClipRatios:
        """From a clipped loss's low_clipped and high_clipped indicators."""
        low, high = stats["low_clipped"], stats["high_clipped"]
        return cls(stat_mean(low, mask), stat_mean(high, mask), stat_mean(torch.maximum(low, high), mask))

    def named(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.METRICS, (self.low, self.high, self.region)))


@dataclass(frozen=True)
class CispoClipRatio:
    """The share of a micro-batch's tokens whose importance weight CISPO capped at epsilon_high (A > 0)."""

    capped: torch.Tensor

    METRICS: ClassVar[tuple[str, ...]] = ("cispo_clip_ratio",)

    @classmethod
    def of(cls, stats: dict[str, torch.Tensor], mask: torch.Tensor) -> CispoClipRatio:
        return cls(stat_mean(stats["cispo_clipped"], mask))

    def named(self) -> dict[str, torch.Tensor]:
        return {self.METRICS[0]: self.capped}


@dataclass(frozen=True)
class LossStats:
    """A micro-batch's loss statistics, 0-d and detached, under TRL's metric names."""

    clip: ClipRatios | CispoClipRatio
    kl: torch.Tensor | None = None  # the mean k3 KL term of the loss; None where the KL is in the reward or beta is 0


class PolicyLoss(Protocol):
    """The family's loss of a micro-batch: its share of the optimizer step's loss, and its statistics."""

    clip_metrics: tuple[str, ...]  # the names of its LossStats.clip

    def __call__(self, inputs: LossInputs) -> tuple[torch.Tensor, LossStats]: ...


class TokenPolicyLoss:
    """grpo.loss_type's loss (rl.algorithm grpo and reinforce_plus_plus*): `grpo_token_loss` with the
    high-entropy mask, normalized by `reduce_loss`; with the k3 KL term only where `kl_in_loss` (rl.algorithm
    grpo: the others subtract their KL from the reward). `gather` pools every process's entropies."""

    def __init__(
        self,
        grpo: GRPOConfig,
        *,
        kl_in_loss: bool,
        max_completion_length: int,
        mini_batch: int,
        gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        self.grpo, self.kl_in_loss, self.max_completion_length = grpo, kl_in_loss, max_completion_length
        self.mini_batch, self.gather = mini_batch, gather
        self.clip_ratios = CispoClipRatio if grpo.loss_type == "cispo" else ClipRatios
        self.clip_metrics = self.clip_ratios.METRICS

    def __call__(self, inputs: LossInputs) -> tuple[torch.Tensor, LossStats]:
        grpo, mask = self.grpo, inputs.mask
        entropy_mask = None
        if grpo.top_entropy_quantile < 1.0:
            entropy_mask = high_entropy_mask(inputs.entropy, mask, grpo.top_entropy_quantile, self.gather)
        per_token, stats = grpo_token_loss(
            inputs.logp,
            inputs.old_logp,
            inputs.advantages,
            mask,
            grpo,
            entropy_mask=entropy_mask,
            ref_logp=inputs.ref_logp if self.kl_in_loss else None,
            is_weights=inputs.is_weights,
        )
        loss = reduce_loss(
            per_token,
            mask,
            grpo.loss_type,
            max_completion_length=self.max_completion_length,
            total_tokens=inputs.total_tokens,
        )
        if grpo.loss_type not in TOKEN_NORMALIZED:  # dapo and cispo are normalized over the optimizer batch already
            loss = loss * (mask.shape[0] / self.mini_batch)  # mean over micro-batches
        kl = stats.get("kl")
        return loss, LossStats(self.clip_ratios.of(stats, mask), None if kl is None else masked_mean(kl.detach(), mask))


class RLOOPolicyLoss:
    """rl.algorithm rloo's loss (TRL's RLOOTrainer): `rloo_sequence_loss`, the mean over micro-batches; its KL is
    in the reward."""

    clip_metrics = ClipRatios.METRICS

    def __init__(self, grpo: GRPOConfig, *, mini_batch: int):
        self.epsilon, self.epsilon_high, self.mini_batch = grpo.epsilon, grpo.epsilon_high, mini_batch

    def __call__(self, inputs: LossInputs) -> tuple[torch.Tensor, LossStats]:
        mask = inputs.mask
        loss, stats = rloo_sequence_loss(
            inputs.logp, inputs.old_logp, inputs.advantages, mask, self.epsilon, self.epsilon_high, inputs.is_weights
        )
        loss = loss * (mask.shape[0] / self.mini_batch)  # mean over micro-batches
        return loss, LossStats(ClipRatios.of(stats, mask))


def policy_loss_for(
    rl: RLConfig, grpo: GRPOConfig, *, mini_batch: int, gather: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> PolicyLoss:
    """rl.algorithm's loss: RLOO's sequence-level one, or grpo.loss_type's token-level one; `mini_batch`
    completions per optimizer step."""
    if rl.algorithm == "rloo":
        return RLOOPolicyLoss(grpo, mini_batch=mini_batch)
    return TokenPolicyLoss(
        grpo,
        kl_in_loss=rl.algorithm == "grpo",
        max_completion_length=rl.response_length,
        mini_batch=mini_batch,
        gather=gather,
    )
