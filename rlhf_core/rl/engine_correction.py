"""The gap between the rollout engine and the trainer, corrected by truncated importance sampling.

A rollout engine apart from the trainer (vLLM) samples with its own kernels, and returns the log-probability of
each sampled token under the distribution it sampled from (the behaviour policy). The trainer recomputes the
log-probabilities of the same tokens (the "old" policy of PPO's ratio). Where they differ, the batch is off-policy
by that much; the anchors weight the loss by the importance ratio old / behaviour, capped: TRL 1.16's
`vllm_importance_sampling_correction` (modes below, its default `sequence_mask` with C_max 3), verl's
`rollout_is`, OpenRLHF's `--algo.advantage.is_correction_type tis` (arXiv:2506.13585's truncated IS).

Modes, as TRL names them (`GRPOTrainer._generate_and_score_completions`):
- `token_truncate`: per token, r_t = exp(old_t - behaviour_t), clamped to [C_min, C_max];
- `token_mask`: per token, r_t where it lies in [C_min, C_max], else 0 (the token leaves the loss);
- `sequence_truncate`: per sequence, r = exp(sum_t (old_t - behaviour_t)) over its tokens, clamped;
- `sequence_mask`: per sequence, r inside [C_min, C_max], else 0 (the sequence leaves the loss).
A token whose behaviour log-prob is unknown (NaN: the engine could not score it) gets ratio 1. C_min None: no
lower bound; C_max None: no upper bound. The weights multiply the per-token loss.

Also reported, as TRL logs them: the ratio's min, mean and max (over the response tokens, or the sequences), and
the mean and max of |old - behaviour| over the response tokens with a known behaviour log-prob.

Which log-probs are which is decided in one place, `old_logprobs_at_sampling`: the behaviour policy's are the
engine's (or the generator's ahead) whenever one apart sampled, else the policy's own; the "old" ones are a pass of
their own at sampling time, or, when that gives the same numbers, the update's own first pass, detached, micro-batch
by micro-batch (`old_logprobs`, `LossWeights`): one forward pass fewer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from rlhf_core.config import RLConfig, RolloutConfig
from rlhf_core.rollout.collect import Rollout

CorrectionMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
MODES: tuple[str, ...] = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass(frozen=True)
class EngineCorrection:
    weights: torch.Tensor | None  # (B, T) token modes, (B, 1) sequence modes: multiplies the per-token loss
    metrics: dict[str, torch.Tensor]  # 0-d tensors, TRL's names


def engine_correction(
    old_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    mask: torch.Tensor,
    mode: CorrectionMode = "sequence_mask",
    cap_max: float | None = 3.0,
    cap_min: float | None = None,
) -> EngineCorrection:
    """The importance weights old / behaviour of a batch (B, T), capped as `mode` says, and their statistics.
    `old_logp`: the trainer's log-probs of the sampled tokens, detached; `behaviour_logp`: the engine's (NaN where
    unknown); `mask`: 1 on response tokens."""
    if mode not in MODES:
        raise ValueError(f"unknown engine correction mode {mode!r}; one of {', '.join(MODES)}")
    old_logp, behaviour_logp = old_logp.detach(), behaviour_logp.detach()
    real = mask.bool()
    log_ratio = torch.nan_to_num((old_logp - behaviour_logp) * mask, nan=0.0)
    per_sequence = mode.startswith("sequence")
    if per_sequence:
        log_ratio = log_ratio.sum(-1, keepdim=True)
    ratio = torch.exp(log_ratio)
    low = -torch.inf if cap_min is None else cap_min
    high = torch.inf if cap_max is None else cap_max
    if mode.endswith("truncate"):
        weights = ratio if cap_min is None and cap_max is None else ratio.clamp(min=cap_min, max=cap_max)
    else:
        weights = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    gap = (old_logp - behaviour_logp).abs()[real & ~torch.isnan(behaviour_logp)]
    reported = weights.flatten() if per_sequence else weights[real]
    zero = torch.zeros((), dtype=old_logp.dtype, device=old_logp.device)

    def stat(reduce, values: torch.Tensor) -> torch.Tensor:
        return reduce(values) if values.numel() else zero

    metrics = {
        "sampling/sampling_logp_difference/mean": stat(torch.mean, gap),
        "sampling/sampling_logp_difference/max": stat(torch.max, gap),
        "sampling/importance_sampling_ratio/min": stat(torch.min, reported),
        "sampling/importance_sampling_ratio/mean": stat(torch.mean, reported),
        "sampling/importance_sampling_ratio/max": stat(torch.max, reported),
    }
    return EngineCorrection(weights, metrics)


@dataclass(frozen=True)
class CorrectionSettings:
    """rollout.correction, mode and bounds; mode None: the gap is measured and logged, the loss left as it is."""

    mode: CorrectionMode | None
    cap_max: float | None = 3.0
    cap_min: float | None = None


def correction_settings(rollout: RolloutConfig) -> CorrectionSettings | None:
    """The correction of rollout.engine vllm or of generation ahead (rollout.max_staleness > 0); None for hf in step
    (the policy samples: there is no gap)."""
    if not rollout.off_policy:
        return None
    v = rollout.correction
    return CorrectionSettings(None if v.mode == "none" else v.mode, v.cap, v.min)


def old_logprobs_at_sampling(rl: RLConfig, beta: float, updates_per_batch: int, rollout: RolloutConfig) -> bool:
    """Whether a batch's "old" log-probs (PPO's ratio's denominator, the correction's numerator) are a pass of the
    trainer's own at sampling time (True) or the update's first pass, detached (False: the same numbers, one pass
    fewer). The behaviour policy, whose log-probs the correction divides by, is the engine's when rollout.off_policy
    (they ride with the batch: `Rollout.behaviour_logprobs`), else the policy itself, and then old is behaviour.
    `beta`: the KL coefficient of the GRPO family; `updates_per_batch`: optimizer steps per generation batch."""
    if rl.algorithm == "ppo":
        return True  # its KL penalty in the reward and its entropy read them when the batch is scored
    if updates_per_batch > 1:
        return True  # the policy moves between the batch's optimizer steps
    if beta > 0 and rl.algorithm != "grpo":
        return True  # the estimator puts the KL into the reward, before any update
    # an engine apart sampled: with dropout on, the update's pass is not the policy the correction compares with
    return rollout.off_policy and not rl.disable_dropout


def old_logprobs(rollout: Rollout, rows, logp: torch.Tensor) -> torch.Tensor:
    """The old log-probs of the micro-batch `rows`: the pass at sampling when the rollout carries one
    (`old_logprobs_at_sampling`), else `logp`, the update's own, detached."""
    return rollout.logprobs[rows] if rollout.logprobs is not None else logp.detach()


def correct_rollout(
    rollout: Rollout, mask: torch.Tensor, settings: CorrectionSettings | None
) -> EngineCorrection | None:
    """The weights (None with mode None) and statistics of a rollout sampled by an engine with log-probs of its own,
    against the trainer's `rollout.logprobs`, over the trained tokens `mask`; None when there is nothing to correct
    (or the trainer's log-probs come later, from the update's own pass: `correct`)."""
    if settings is None or rollout.behaviour_logprobs is None or rollout.logprobs is None:
        return None
    return correct(rollout.logprobs, rollout.behaviour_logprobs, mask, settings)


def correct(
    old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, settings: CorrectionSettings
) -> EngineCorrection:
    """`engine_correction` as `settings` say; with mode None the gap measured and the weights None."""
    if settings.mode is None:
        measured = engine_correction(old_logp, behaviour_logp, mask, "token_truncate", None, None)
        return EngineCorrection(None, measured.metrics)
    return engine_correction(old_logp, behaviour_logp, mask, settings.mode, settings.cap_max, settings.cap_min)


def merge_metrics(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The statistics of a batch corrected in parts (micro-batches): the minimum of the minima, the maximum of the
    maxima, the mean of the means."""
    if not parts:
        return {}
    reduce = {"min": torch.min, "max": torch.max, "mean": torch.mean}
    return {key: reduce[key.rsplit("/", 1)[1]](torch.stack([p[key] for p in parts])) for key in parts[0]}


class LossWeights:
    """The correction's weights of one batch's loss: whole, against the trainer's log-probs taken at sampling
    (`correct_rollout`), or micro-batch by micro-batch against the update's own first pass when the rollout carries
    none (one optimizer step per batch); `metrics()` gives the statistics of the whole batch either way."""

    def __init__(self, rollout: Rollout, mask: torch.Tensor, settings: CorrectionSettings | None):
        self.rollout, self.mask, self.settings = rollout, mask, settings
        self.whole = correct_rollout(rollout, mask, settings)
        self.later = self.whole is None and settings is not None and rollout.behaviour_logprobs is not None
        self.parts: list[dict[str, torch.Tensor]] = []

    def of(self, rows, logp: torch.Tensor) -> torch.Tensor | None:
        """The weights of the micro-batch `rows`, whose log-probs under the policy being trained are `logp`."""
        if self.whole is not None:
            return self.whole.weights[rows] if self.whole.weights is not None else None
        if not self.later:
            return None
        part = correct(logp.detach(), self.rollout.behaviour_logprobs[rows], self.mask[rows], self.settings)
        self.parts.append(part.metrics)
        return part.weights

    def metrics(self) -> dict[str, torch.Tensor]:
        return self.whole.metrics if self.whole is not None else merge_metrics(self.parts)
