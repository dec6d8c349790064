"""The DPO loss family as small pure functions: TRL 1.16 `DPOTrainer._compute_loss`, one per-pair loss per type.

Only TRL's reverse-KL form (f_divergence_type "reverse_kl"), without WPO weighting (use_weighting) and without
LD-DPO's length weighting (ld_alpha). A batch is B preference pairs: the rows [chosen_1..chosen_B,
rejected_1..rejected_B] of per-token log-probabilities (2B, R) and their completion mask; a sequence's log-prob
is the sum over its completion tokens. With beta the KL coefficient, r = beta * (logp - ref_logp) per side:

  sigmoid       DPO, arXiv:2305.18290: -log sigmoid(beta * delta), delta = chosen - rejected log-ratio
  hinge         RSO/SLiC, arXiv:2309.06657: relu(1 - beta * delta)
  ipo           IPO, arXiv:2310.12036 (Eq. 17): (delta/token - 1/(2 beta))^2, each side over its own token count
  exo_pair      EXO, arXiv:2402.00856 (Eq. 16): KL to [1 - eps, eps], eps = label_smoothing
  nca_pair      NCA, arXiv:2402.05369: -log sig(r_c) - (log sig(-r_c) + log sig(-r_r)) / 2
  robust        rDPO, arXiv:2403.00409: label-noise-corrected sigmoid, divided by 1 - 2 label_smoothing
  bco_pair      BCO, arXiv:2404.04656: -log sig(r_c) - log sig(-r_r)
  sppo_hard     SPPO, arXiv:2405.00675: (logratio_c - 1/(2 beta))^2 + (logratio_r + 1/(2 beta))^2
  aot           AOT, arXiv:2406.05882: sigmoid on sorted policy minus sorted reference log-ratios (over the batch)
  aot_unpaired  AOT unpaired: sigmoid on sorted chosen minus sorted rejected log-ratios (over the batch)
  apo_zero      APO, arXiv:2408.06266 (Eq. 7): 1 - sig(r_c) + sig(r_r)
  apo_down      APO (Eq. 8): sig(r_c) + 1 - sig(beta * delta)
  discopop      DiscoPOP, arXiv:2406.08414 (Eq. 5): logistic and exponential blended by sig(beta delta / tau)
  sft           the negative mean log-prob of every chosen token of the batch (the same value for each pair)
  sigmoid_norm  sigmoid on each side's log-ratio divided by its own token count

`dpo_loss` returns `DPOLoss`: the weighted sum over loss types of each one's mean over pairs, and the metrics
TRL logs under its names. `check_spec` says in one sentence what is wrong with a `DPOLossSpec`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlhf_core.config.training import DPO_LOSS_TYPES, dpo_loss_problem

LOSS_TYPES = DPO_LOSS_TYPES  # TRL 1.16's, in its order


@dataclass(frozen=True)
class DPOLossSpec:
    """Which losses and their settings (TRL's DPOConfig names)."""

    loss_types: tuple[str, ...] = ("sigmoid",)
    loss_weights: tuple[float, ...] | None = None  # None: 1.0 each, as TRL
    beta: float = 0.1
    label_smoothing: float = 0.0  # exo_pair's epsilon, robust's and aot's noise rate
    discopop_tau: float = 0.05
    reference_free: bool = False  # older TRL's reference_free: reference log-probs taken as 0


@dataclass
class DPOLoss:
    """What `dpo_loss` returns."""

    loss: torch.Tensor  # 0-d, differentiable: sum over loss types of weight * mean over pairs
    metrics: dict[str, torch.Tensor]  # 0-d detached tensors under TRL's names


@dataclass(frozen=True)
class Pairs:
    """What the losses read, per pair (B,); `chosen_token_logps` are all chosen tokens of the batch (sft)."""

    chosen: torch.Tensor  # summed log-probs of the policy
    rejected: torch.Tensor
    ref_chosen: torch.Tensor  # summed log-probs of the reference
    ref_rejected: torch.Tensor
    chosen_tokens: torch.Tensor  # completion token counts, clamp(min=1)
    rejected_tokens: torch.Tensor
    chosen_token_logps: torch.Tensor  # (number of chosen tokens,)
    spec: DPOLossSpec

    @property
    def chosen_logratios(self) -> torch.Tensor:
        return self.chosen - self.ref_chosen

    @property
    def rejected_logratios(self) -> torch.Tensor:
        return self.rejected - self.ref_rejected

    @property
    def delta(self) -> torch.Tensor:
        return self.chosen_logratios - self.rejected_logratios


def check_spec(spec: DPOLossSpec) -> None:
    """Raise ValueError with one sentence naming the field when `spec` cannot be trained with (the dpo section's
    rules: `dpo_loss_problem`)."""
    problem = dpo_loss_problem(spec.loss_types, spec.loss_weights, spec.beta, spec.label_smoothing)
    if problem:
        raise ValueError(problem)


def sequence_logps(logp: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(2B, R) per-token log-probs of the rows [chosen_1..chosen_B, rejected_1..rejected_B] (any value where mask
    is 0, e.g. INVALID_LOGPROB = 1.0: masked out with torch.where, never multiplied, so nothing leaks, not even a
    NaN) -> (chosen (B,), rejected (B,)) summed over the masked tokens."""
    summed = torch.where(mask.bool(), logp, torch.zeros_like(logp)).sum(dim=1)  # (2B,)
    chosen, rejected = summed.chunk(2, dim=0)
    return chosen, rejected


def _logsigmoid_smoothed(x: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """-log sig(x) (1 - ls) - log sig(-x) ls: the sigmoid loss with labels flipped at rate ls (aot, aot_unpaired)."""
    return -F.logsigmoid(x) * (1 - label_smoothing) - F.logsigmoid(-x) * label_smoothing


def _ipo(p: Pairs) -> torch.Tensor:
    # token-summed log-ratios make the square grow with length: TRL (with the IPO authors) averages per token
    delta = p.chosen_logratios / p.chosen_tokens - p.rejected_logratios / p.rejected_tokens
    return (delta - 1 / (2 * p.spec.beta)) ** 2


def _exo_pair(p: Pairs) -> torch.Tensor:
    x = p.spec.beta * p.delta
    epsilon = torch.tensor(p.spec.label_smoothing, device=x.device)
    chosen_term = torch.sigmoid(x) * (F.logsigmoid(x) - torch.log1p(-epsilon))
    return chosen_term + torch.sigmoid(-x) * (F.logsigmoid(-x) - torch.log(epsilon))


def _robust(p: Pairs) -> torch.Tensor:
    x, ls = p.spec.beta * p.delta, p.spec.label_smoothing
    return (-(1 - ls) * F.logsigmoid(x) + ls * F.logsigmoid(-x)) / (1 - 2 * ls)


def _nca_pair(p: Pairs) -> torch.Tensor:
    rc, rr = p.spec.beta * p.chosen_logratios, p.spec.beta * p.rejected_logratios
    return -F.logsigmoid(rc) - 0.5 * F.logsigmoid(-rc) - 0.5 * F.logsigmoid(-rr)


def _sppo_hard(p: Pairs) -> torch.Tensor:
    half = 0.5 / p.spec.beta
    return (p.chosen_logratios - half) ** 2 + (p.rejected_logratios + half) ** 2


def _aot(p: Pairs) -> torch.Tensor:
    logratios = torch.sort(p.chosen - p.rejected, dim=0).values
    ref_logratios = torch.sort(p.ref_chosen - p.ref_rejected, dim=0).values
    return _logsigmoid_smoothed(p.spec.beta * (logratios - ref_logratios), p.spec.label_smoothing)


def _aot_unpaired(p: Pairs) -> torch.Tensor:
    chosen = torch.sort(p.chosen_logratios, dim=0).values
    rejected = torch.sort(p.rejected_logratios, dim=0).values
    return _logsigmoid_smoothed(p.spec.beta * (chosen - rejected), p.spec.label_smoothing)


def _discopop(p: Pairs) -> torch.Tensor:
    x = p.spec.beta * p.delta
    modulation = torch.sigmoid(x / p.spec.discopop_tau)
    return -F.logsigmoid(x) * (1 - modulation) + torch.exp(-x) * modulation


def _sft(p: Pairs) -> torch.Tensor:
    return (-p.chosen_token_logps.mean()).expand(p.chosen.shape[0])  # one batch value, repeated per pair


def _sigmoid_norm(p: Pairs) -> torch.Tensor:
    delta = p.chosen_logratios / p.chosen_tokens - p.rejected_logratios / p.rejected_tokens
    return -F.logsigmoid(p.spec.beta * delta)


PER_PAIR_LOSSES: dict[str, Callable[[Pairs], torch.Tensor]] = {
    "sigmoid": lambda p: -F.logsigmoid(p.spec.beta * p.delta),
    "hinge": lambda p: torch.relu(1 - p.spec.beta * p.delta),
    "ipo": _ipo,
    "exo_pair": _exo_pair,
    "nca_pair": _nca_pair,
    "robust": _robust,
    "bco_pair": lambda p: (
        -F.logsigmoid(p.spec.beta * p.chosen_logratios) - F.logsigmoid(-p.spec.beta * p.rejected_logratios)
    ),
    "sppo_hard": _sppo_hard,
    "aot": _aot,
    "aot_unpaired": _aot_unpaired,
    "apo_zero": lambda p: (
        1 - torch.sigmoid(p.spec.beta * p.chosen_logratios) + torch.sigmoid(p.spec.beta * p.rejected_logratios)
    ),
    "apo_down": lambda p: torch.sigmoid(p.spec.beta * p.chosen_logratios) + (1 - torch.sigmoid(p.spec.beta * p.delta)),
    "discopop": _discopop,
    "sft": _sft,
    "sigmoid_norm": _sigmoid_norm,
}  # (B,) each, from the pairs' quantities


def dpo_metrics(p: Pairs) -> dict[str, torch.Tensor]:
    """TRL's logged rewards/* and logps/* (the mean over pairs; TRL gathers over processes first)."""
    chosen_rewards = p.spec.beta * p.chosen_logratios.detach()
    rejected_rewards = p.spec.beta * p.rejected_logratios.detach()
    return {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": p.chosen.detach().mean(),
        "logps/rejected": p.rejected.detach().mean(),
    }


def dpo_loss(
    logp: torch.Tensor,
    mask: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    spec: DPOLossSpec,
) -> DPOLoss:
    """The loss of B pairs: `logp`, `mask` (2B, R) the completion tokens of the chosen rows then the rejected rows
    (mask 1 on completion tokens); `ref_chosen`, `ref_rejected` (B,) the reference's summed log-probs (zeros
    when spec.reference_free). sum_k weight_k * mean over pairs of loss_k, as TRL 1.16's `_compute_loss`."""
    check_spec(spec)
    chosen, rejected = sequence_logps(logp, mask)
    if spec.reference_free:
        ref_chosen, ref_rejected = torch.zeros_like(chosen), torch.zeros_like(rejected)
    chosen_mask, rejected_mask = mask.bool().chunk(2, dim=0)
    pairs = Pairs(
        chosen=chosen,
        rejected=rejected,
        ref_chosen=ref_chosen,
        ref_rejected=ref_rejected,
        chosen_tokens=chosen_mask.sum(dim=1).clamp(min=1),
        rejected_tokens=rejected_mask.sum(dim=1).clamp(min=1),
        chosen_token_logps=logp.chunk(2, dim=0)[0][chosen_mask],
        spec=spec,
    )
    weights = spec.loss_weights if spec.loss_weights is not None else (1.0,) * len(spec.loss_types)
    loss = 0.0
    for loss_type, weight in zip(spec.loss_types, weights, strict=True):
        loss = loss + PER_PAIR_LOSSES[loss_type](pairs).mean() * weight
    return DPOLoss(loss=loss, metrics=dpo_metrics(pairs))
