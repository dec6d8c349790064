"""The tensor math PPO, the GRPO family and evaluation share: masked statistics, response masks,
log-probabilities, KL estimators, KL-penalized token rewards, GAE and discounted returns.

Everything here is pure (no models, no optimizers) and pinned by tests against hand-computed values
and plain loops. Shapes: B sequences, T response tokens; `mask` is 1 on real response tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

INVALID_LOGPROB = 1.0  # written into padded positions so that nothing downstream mistakes them for real


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    n = mask.sum()
    if unbiased and n > 1:
        var = var * n / (n - 1)
    return var


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """(x - mean) / std over the masked entries; with shift_mean=False the mean is added back.

    `all_reduce` (a sum over data-parallel processes) makes mean and std those of every process's
    entries together, so that N processes with B rows each whiten as one process with N x B rows.
    """
    if all_reduce is None:
        mean, var = masked_mean(x, mask), masked_var(x, mask)
    else:
        m = mask.to(x.dtype)
        total, total_sq, n = all_reduce(torch.stack([(x * m).sum(), (x * x * m).sum(), m.sum()]))
        mean = total / n.clamp(min=1)
        var = (total_sq / n.clamp(min=1) - mean**2).clamp(min=0)
        if n > 1:
            var = var * n / (n - 1)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def first_true_indices(bools: torch.Tensor, dtype=torch.long) -> torch.Tensor:
    """Index of the first True in each row of (B, T); T where a row has none."""
    row_len = bools.size(-1)
    zero_or_index = row_len * (~bools).type(dtype) + torch.arange(row_len, dtype=dtype, device=bools.device)
    return torch.min(zero_or_index, dim=-1).values


def response_mask(responses: torch.Tensor, stop_token_ids) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mask (B, T), index of the last real token (B,), has_stop (B,)) from the stop positions.

    A response ends at its first stop token, which belongs to it (in the mask, last_index on it). A
    row without a stop token ran to the full length. The pad id is never looked at: it may equal a
    stop id (Qwen2.5 base, GPT-2) or be a token the policy really generated.
    """
    rows, width = responses.shape
    positions = torch.arange(width, device=responses.device)
    if len(stop_token_ids):
        stops = torch.as_tensor(list(stop_token_ids), dtype=responses.dtype, device=responses.device)
        first = first_true_indices(torch.isin(responses, stops))  # (B,), width where none
    else:
        first = torch.full((rows,), width, dtype=torch.long, device=responses.device)
    has_stop = first < width
    last = torch.where(has_stop, first, torch.full_like(first, width - 1))
    return (positions.view(1, -1) <= last.unsqueeze(-1)).long(), last, has_stop


def selective_log_softmax(
    logits: torch.Tensor, index: torch.Tensor, logsumexp: torch.Tensor | None = None
) -> torch.Tensor:
    """log_softmax(logits)[..., index] without materializing the full log-softmax. (B, T, V) -> (B, T)"""
    picked = torch.gather(logits, -1, index.unsqueeze(-1)).squeeze(-1)
    return picked - (torch.logsumexp(logits, dim=-1) if logsumexp is None else logsumexp)


def entropy_from_logits(logits: torch.Tensor, logsumexp: torch.Tensor | None = None) -> torch.Tensor:
    """Entropy of the categorical distribution at each position. (B, T, V) -> (B, T)

    H = lse - sum(p * logits) with p = exp(logits - lse): one exp over the vocabulary and no
    log-softmax copy; pass `logsumexp` when it is already computed.
    """
    lse = torch.logsumexp(logits, dim=-1) if logsumexp is None else logsumexp
    probs = torch.exp(logits - lse.unsqueeze(-1))
    return lse - (probs * logits).sum(-1)


def kl_per_token(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: Literal["k1", "k3"]) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy (Schulman's k1, k3).

    k1 = log pi - log ref (unbiased, can be negative); k3 = (r - 1) - log r with r = ref / pi
    (unbiased and never negative).
    """
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    return torch.expm1(-log_ratio) + log_ratio


def exact_kl_per_token(logits: torch.Tensor, ref_logits: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """KL(policy || reference) of the next-token distributions at each position, summed over the whole
    vocabulary: sum_v p(v) (log p(v) - log q(v)). Exact, never negative, and blind to which token was
    then sampled (no estimator's variance). (B, T, V) x 2 -> (B, T); `chunk` positions at a time bound the
    temporaries."""
    out = torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    flat, ref_flat, out_flat = logits.flatten(0, -2), ref_logits.flatten(0, -2), out.view(-1)
    for start in range(0, flat.shape[0], chunk):
        logp = torch.log_softmax(flat[start : start + chunk].float(), dim=-1)
        ref_logp = torch.log_softmax(ref_flat[start : start + chunk].float(), dim=-1)
        out_flat[start : start + chunk] = (logp.exp() * (logp - ref_logp)).sum(-1).clamp(min=0.0)
    return out


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


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = sum_{s >= t} gamma^(s - t) r_s over each response's real tokens, 0 on padding. (B, T)"""
    return compute_gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)[0]
