"""Sampling settings and the one-token sampler of rollouts: temperature, top-k, top-p, greedy, min tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf_core.config import RLConfig


@dataclass(frozen=True)
class SamplingSettings:
    response_length: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    min_tokens: int = 1  # the stop token is not sampled before this many tokens


def rl_sampling(rl: RLConfig) -> SamplingSettings:
    """The sampling of the RL stage's rollouts, from its config section."""
    return SamplingSettings(
        response_length=rl.response_length,
        temperature=rl.temperature,
        top_k=rl.top_k,
        top_p=rl.top_p,
        min_tokens=rl.min_response_length,
    )


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then nucleus (top-p) filtering: logits outside are set to -inf. (B, V)"""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative - sorted_logits.softmax(-1) > top_p  # keep the token that crosses top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """One token per row: argmax when greedy, else a draw from softmax(logits / T). (B,)

    Inverse-CDF sampling: one uniform number per row searched in the cumulative probabilities.
    It samples the softmax exactly and needs B random numbers instead of the B x V of Gumbel-max,
    which on the CPU costs more than the forward pass of a small model.
    """
    if settings.greedy:
        return logits.argmax(-1)
    logits = logits.float() if settings.temperature == 1.0 else logits.float() / settings.temperature
    probs = filter_logits(logits, settings.top_k, settings.top_p).softmax(-1)
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    # u strictly below the total mass, and right=True (the first token whose cumulative mass exceeds u):
    # a filtered (zero-probability) token never wins, even when rounding would put u on the total
    u = torch.minimum(torch.rand_like(total) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).squeeze(1)
