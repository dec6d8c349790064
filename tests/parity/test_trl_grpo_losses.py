"""GRPO parity with TRL 1.16: losses (helpers in tests/parity/trl_grpo_common.py).

`trainer._compute_loss(model, inputs)` (TRL's fused, temperature-scaled log-probability head included)
against `reduce_loss(grpo_token_loss(response_logprobs(...)))`: the loss value, the gradient of every model
parameter and TRL's logged statistics (entropy, kl, clip ratios), for every loss type and option, also
accumulated over micro-batches; and `response_logprobs` / `high_entropy_mask` against TRL's. Tolerance:
atol 1e-6, rtol 1e-5 on the loss and the statistics, atol 1e-6 on each gradient entry (gradients are O(0.1)).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from rlhf_core.config import GRPOConfig as OurGRPOConfig
from rlhf_core.models.forward import response_logprobs
from rlhf_core.rl.grpo_losses import grpo_token_loss, high_entropy_mask, reduce_loss, stat_mean
from rlhf_core.rl_math import masked_mean
from tests.parity.trl_grpo_common import MAX_COMPLETION, PAD, TOL, VOCAB, build_policy

# ------------------------------------------------------------------------------------------
# losses: TRL's _compute_loss against grpo_token_loss + reduce_loss, value and gradient
# ------------------------------------------------------------------------------------------

B = 8
LENGTHS = [6, 2, 5, 1, 6, 3, 4, 2]


@dataclass(frozen=True)
class LossCase:
    loss_type: str
    level: str = "token"
    beta: float = 0.0
    bias_kl: bool = True
    delta: float | None = None
    top_entropy_quantile: float = 1.0
    temperature: float = 0.7
    on_policy: bool = False  # no old log-probabilities: both sides use the current ones, detached
    epsilon: float = 0.2
    epsilon_high: float = 0.28

    @property
    def id(self) -> str:
        parts = [self.loss_type, self.level]
        if self.beta:
            parts.append(f"beta-biaskl{int(self.bias_kl)}")
        if self.delta:
            parts.append(f"delta{self.delta}")
        if self.top_entropy_quantile < 1:
            parts.append(f"topH{self.top_entropy_quantile}")
        if self.temperature != 0.7:
            parts.append(f"T{self.temperature}")
        if self.on_policy:
            parts.append("onpolicy")
        return "-".join(parts)

    def ours(self) -> OurGRPOConfig:
        return OurGRPOConfig(
            loss_type=self.loss_type,
            importance_sampling_level=self.level,
            beta=self.beta,
            use_bias_correction_kl=self.bias_kl,
            delta=self.delta,
            epsilon=self.epsilon,
            epsilon_high=self.eps_high,
            top_entropy_quantile=self.top_entropy_quantile,
            sapo_temperature_pos=0.9,
            sapo_temperature_neg=1.3,
        )

    @property
    def eps_high(self) -> float:
        return 1.3 if self.loss_type == "cispo" else self.epsilon_high  # cispo: the cap of the ratio


LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"]
CLIPPED = ["grpo", "bnpo", "dr_grpo", "dapo"]
CASES = (
    [
        LossCase(lt, level, beta, bias)
        for lt in LOSS_TYPES
        for level in ("token", "sequence")
        for beta, bias in ((0.0, True), (0.04, True), (0.04, False))
    ]
    + [LossCase(lt, level, beta=0.04, delta=1.5) for lt in CLIPPED for level in ("token", "sequence")]
    + [LossCase(lt, top_entropy_quantile=0.4, beta=0.04) for lt in LOSS_TYPES]
    + [LossCase(lt, "sequence", top_entropy_quantile=0.4) for lt in ("grpo", "dapo")]
    + [LossCase(lt, temperature=1.0, beta=0.04) for lt in LOSS_TYPES]
    + [LossCase(lt, on_policy=True, beta=0.04) for lt in ("grpo", "dapo", "cispo")]
)


@pytest.fixture(scope="module")
def trainers(make_trainer):
    """One TRL trainer per sampling temperature (TRL bakes the temperature into its fused LM head)."""
    return {t: make_trainer(temperature=t, model=build_policy(seed=0)) for t in (0.7, 1.0)}


@pytest.fixture(scope="module")
def batch():
    """Prompts without padding (all length 3, so TRL's default positions equal our mask-derived ones),
    right-padded completions of several lengths, advantages of both signs (one 0)."""
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(3, VOCAB, (B, 3), generator=g)
    mask = (torch.arange(MAX_COMPLETION)[None] < torch.tensor(LENGTHS)[:, None]).long()
    completion_ids = torch.randint(3, VOCAB, (B, MAX_COMPLETION), generator=g).masked_fill(mask == 0, PAD)
    advantages = torch.randn(B, generator=g)
    advantages[3] = 0.0
    return dict(
        prompt_ids=prompt_ids,
        prompt_mask=torch.ones_like(prompt_ids),
        completion_ids=completion_ids,
        completion_mask=mask,
        advantages=advantages,
        noise=torch.randn(2, B, MAX_COMPLETION, generator=g),
    )


def perturbed(logp: torch.Tensor, noise: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Old / reference log-probabilities: the current ones moved by noise, so ratios are far from 1 (0 on padding, as TRL)."""
    return (logp.detach() + 0.35 * noise) * mask


def configure(trainer, case: LossCase, *, accumulation: int = 1, steps_per_generation: int = 1) -> None:
    """Every attribute TRL's `_compute_loss` reads, set from the case."""
    trainer.loss_type = case.loss_type
    trainer.importance_sampling_level = case.level
    trainer.beta = case.beta
    trainer.epsilon_low, trainer.epsilon_high = case.epsilon, case.eps_high
    trainer.top_entropy_quantile = case.top_entropy_quantile
    trainer.args.use_bias_correction_kl = case.bias_kl
    trainer.args.delta = case.delta
    trainer.args.sapo_temperature_pos, trainer.args.sapo_temperature_neg = 0.9, 1.3
    trainer.args.steps_per_generation = steps_per_generation
    trainer.current_gradient_accumulation_steps = accumulation
    assert trainer.off_policy_mask_threshold is None and not trainer.use_vllm and not trainer._entropy_bonus_enabled


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def trl_loss(trainer, inputs: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float]]:
    model = trainer.model
    model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    loss = trainer._compute_loss(model, dict(inputs))
    loss.backward()
    return loss.detach(), grads(model), {k: v[-1] for k, v in trainer._metrics["train"].items()}


def old_and_ref(trainer, batch, temperature):
    with torch.no_grad():
        logp, _ = response_logprobs(
            trainer.model,
            batch["prompt_ids"],
            batch["prompt_mask"],
            batch["completion_ids"],
            batch["completion_mask"],
            temperature,
        )
    mask = batch["completion_mask"]
    return perturbed(logp, batch["noise"][0], mask), perturbed(logp, batch["noise"][1], mask)


def trl_inputs(batch, rows, case: LossCase, old, ref, num_items) -> dict:
    inputs = {
        k: batch[k][rows] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")
    }
    inputs["num_items_in_batch"] = torch.tensor(num_items)
    if not case.on_policy:
        inputs["old_per_token_logps"] = old[rows]
    if case.beta:
        inputs["ref_per_token_logps"] = ref[rows]
    return inputs


def our_loss(model, batch, rows, case: LossCase, old, ref, *, total_tokens: float):
    """Our loss for the rows, as `train_grpo` computes it for one micro-batch (before its micro-batch scaling)."""
    mask = batch["completion_mask"][rows]
    logp, entropy = response_logprobs(
        model,
        batch["prompt_ids"][rows],
        batch["prompt_mask"][rows],
        batch["completion_ids"][rows],
        mask,
        case.temperature,
        with_entropy=True,
    )
    old_logp = logp.detach() if case.on_policy else old[rows]
    entropy_mask = (
        high_entropy_mask(entropy, mask, case.top_entropy_quantile) if case.top_entropy_quantile < 1 else None
    )
    per_token, stats = grpo_token_loss(
        logp,
        old_logp,
        batch["advantages"][rows],
        mask,
        case.ours(),
        ref_logp=ref[rows] if case.beta else None,
        entropy_mask=entropy_mask,
    )
    loss = reduce_loss(per_token, mask, case.loss_type, max_completion_length=MAX_COMPLETION, total_tokens=total_tokens)
    return loss, stats, entropy, logp, entropy_mask


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_loss_and_gradient_match_trl_compute_loss(trainers, batch, case):
    """Loss value and every parameter's gradient of TRL's `_compute_loss` == ours on the same inputs
    (one process, no accumulation: dapo/cispo normalize by num_items_in_batch = our total_tokens),
    plus TRL's logged entropy / kl / clip-ratio statistics == the loop's `stat_mean` / `masked_mean`
    of our stats. Every loss type, token and sequence level, beta with and without bias-corrected
    KL, delta, top_entropy_quantile < 1, temperature 0.7 and 1, on-policy (no old log-probs).
    Tolerance atol 1e-6 (rtol 1e-5 on the loss and statistics)."""
    trainer = trainers[case.temperature]
    model = trainer.model
    configure(trainer, case)
    old, ref = old_and_ref(trainer, batch, case.temperature)
    rows = slice(None)
    mask = batch["completion_mask"]
    num_items = int(mask.sum())

    loss_trl, grads_trl, metrics = trl_loss(trainer, trl_inputs(batch, rows, case, old, ref, num_items))
    model.zero_grad(set_to_none=True)
    loss_ours, stats, entropy, logp, entropy_mask = our_loss(
        model, batch, rows, case, old, ref, total_tokens=float(num_items)
    )
    loss_ours.backward()
    grads_ours = grads(model)

    torch.testing.assert_close(loss_ours.detach(), loss_trl, **TOL)
    assert grads_ours.keys() == grads_trl.keys() and len(grads_ours) == len(list(model.parameters()))
    for name in grads_trl:
        torch.testing.assert_close(
            grads_ours[name], grads_trl[name], atol=1e-6, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )
    assert max(g.abs().max() for g in grads_trl.values()) > 1e-2  # gradients are not trivially zero

    # the data exercises what the case is about
    log_ratio = (logp.detach() - (logp.detach() if case.on_policy else old)) * mask
    if case.level == "sequence":
        log_ratio = (log_ratio.sum(1) / mask.sum(1)).unsqueeze(1).expand_as(mask) * mask
    ratio = torch.exp(log_ratio)[mask.bool()]
    if not case.on_policy:
        if case.loss_type in CLIPPED:
            assert (ratio < 1 - case.epsilon).any() and (ratio > 1 + case.eps_high).any()
        if case.loss_type == "cispo":
            assert (ratio > case.eps_high).any() and (ratio < case.eps_high).any()
        if case.delta:
            assert (ratio > case.delta).any()
    if entropy_mask is not None:
        assert 0 < entropy_mask.sum() < mask.sum()

    # TRL's logged statistics against the loop's reductions of ours
    torch.testing.assert_close(masked_mean(entropy, mask).item(), metrics["entropy"], **TOL)
    if case.beta:
        torch.testing.assert_close(masked_mean(stats["kl"].detach(), mask).item(), metrics["kl"], **TOL)
    if case.loss_type == "cispo":
        torch.testing.assert_close(stat_mean(stats["cispo_clipped"], mask).item(), metrics["cispo_clip_ratio"], **TOL)
    elif case.loss_type in CLIPPED:
        low, high = stats["low_clipped"], stats["high_clipped"]
        torch.testing.assert_close(stat_mean(low, mask).item(), metrics["clip_ratio/low_mean"], **TOL)
        torch.testing.assert_close(stat_mean(high, mask).item(), metrics["clip_ratio/high_mean"], **TOL)
        torch.testing.assert_close(
            stat_mean(torch.maximum(low, high), mask).item(), metrics["clip_ratio/region_mean"], **TOL
        )


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_logprobs_entropies_and_entropy_mask_match_trl(trainers, batch, temperature):
    """`response_logprobs` (log-probs and entropies of temperature-scaled logits) == TRL's
    `_get_per_token_logps_and_entropies` on the real completion tokens (atol 1e-5), and
    `high_entropy_mask` == TRL's `get_high_entropy_mask` (exact) for several quantiles."""
    trainer = trainers[temperature]
    b = batch
    mask = b["completion_mask"]
    with torch.no_grad():
        trl_logp, trl_entropy, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([b["prompt_ids"], b["completion_ids"]], 1),
            torch.cat([b["prompt_mask"], mask], 1),
            MAX_COMPLETION,
            compute_entropy=True,
        )
        logp, entropy = response_logprobs(
            trainer.model, b["prompt_ids"], b["prompt_mask"], b["completion_ids"], mask, temperature, with_entropy=True
        )
    real = mask.bool()
    torch.testing.assert_close(logp[real], trl_logp[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy[real], trl_entropy[real], atol=1e-5, rtol=1e-5)
    for quantile in (0.2, 0.4, 0.5, 0.8, 1.0):
        ours = high_entropy_mask(entropy, mask, quantile)
        theirs = trainer.get_high_entropy_mask(trl_entropy, mask, 1 - quantile)
        assert torch.equal(ours, theirs), quantile
        assert ours.sum() >= 1 and (ours <= real).all()


@pytest.mark.parametrize("accumulation,steps_per_generation", [(2, 2), (2, 4)])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_accumulated_micro_batches_match_trl(trainers, batch, loss_type, accumulation, steps_per_generation):
    """One optimizer step accumulated over micro-batches: TRL with current_gradient_accumulation_steps and
    steps_per_generation (num_items_in_batch = tokens of the whole generation batch) == our loop's
    normalization (dapo/cispo: total_tokens = generation tokens / (steps_per_generation //
    accumulation); the others: each micro-batch's loss x micro rows / optimizer-batch rows).
    Summed loss and gradients, atol 1e-6."""
    case = LossCase(loss_type, beta=0.04)
    trainer = trainers[case.temperature]
    model = trainer.model
    configure(trainer, case, accumulation=accumulation, steps_per_generation=steps_per_generation)
    old, ref = old_and_ref(trainer, batch, case.temperature)
    micro = B // steps_per_generation  # TRL: per_device_train_batch_size rows of the generation batch per step
    optimizer_batch = micro * accumulation  # rl.batch_size
    num_items = int(batch["completion_mask"].sum())  # the whole generation batch, as TRL passes it
    windows = [slice(s, s + micro) for s in range(0, optimizer_batch, micro)]  # the first optimizer step

    model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    loss_trl = sum(trainer._compute_loss(model, trl_inputs(batch, rows, case, old, ref, num_items)) for rows in windows)
    loss_trl.backward()
    grads_trl = grads(model)

    model.zero_grad(set_to_none=True)
    total_tokens = num_items / (steps_per_generation // accumulation)  # as train_grpo, one process
    loss_ours = 0.0
    for rows in windows:
        loss, *_ = our_loss(model, batch, rows, case, old, ref, total_tokens=total_tokens)
        if loss_type not in ("dapo", "cispo"):
            loss = loss * (micro / optimizer_batch)
        loss_ours = loss_ours + loss
    loss_ours.backward()
    grads_ours = grads(model)

    torch.testing.assert_close(loss_ours.detach(), loss_trl.detach(), **TOL)
    for name in grads_trl:
        torch.testing.assert_close(
            grads_ours[name], grads_trl[name], atol=1e-6, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )


# ------------------------------------------------------------------------------------------
# the rollout engine's correction in the loss: TRL's use_vllm path against our is_weights
# ------------------------------------------------------------------------------------------

CORRECTED = [
    (LossCase(lt, level, beta=0.04), mode)
    for lt in ("grpo", "dapo", "cispo", "sapo")
    for level in ("token", "sequence")
    for mode in ("token_truncate", "sequence_mask")
]


@pytest.mark.parametrize(("case", "mode"), CORRECTED, ids=[f"{c.id}-{m}" for c, m in CORRECTED])
def test_engine_corrected_loss_and_gradient_match_trl(trainers, batch, case, mode):
    """TRL 1.16's `_compute_loss` with use_vllm and vllm_importance_sampling_correction (the per-token loss times
    inputs['importance_sampling_ratio'], after the entropy mask and before the KL term) == ours with the same
    weights as `LossInputs.is_weights`, computed by `engine_correction` from the old log-probs and an engine's
    (old + noise): loss value and every gradient, atol 1e-6."""
    from rlhf_core.rl.engine_correction import engine_correction

    trainer = trainers[case.temperature]
    model = trainer.model
    configure(trainer, case)
    old, ref = old_and_ref(trainer, batch, case.temperature)
    mask = batch["completion_mask"]
    behaviour = (old + 0.05 * batch["noise"][1].flip(0)) * mask
    weights = engine_correction(old, behaviour, mask, mode, cap_max=1.02, cap_min=0.98).weights
    assert (weights != 1).any() and ((weights == 0).any() if mode.endswith("mask") else (weights > 1).any())
    num_items = int(mask.sum())
    inputs = trl_inputs(batch, slice(None), case, old, ref, num_items)
    inputs["importance_sampling_ratio"] = weights
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    try:
        loss_trl, grads_trl, _ = trl_loss(trainer, inputs)
    finally:
        trainer.use_vllm = False
    model.zero_grad(set_to_none=True)
    logp, _ = response_logprobs(
        model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], mask, case.temperature
    )
    per_token, _ = grpo_token_loss(logp, old, batch["advantages"], mask, case.ours(), ref_logp=ref, is_weights=weights)
    loss = reduce_loss(per_token, mask, case.loss_type, max_completion_length=MAX_COMPLETION, total_tokens=num_items)
    loss.backward()
    torch.testing.assert_close(loss.detach(), loss_trl, **TOL)
    for name, grad in grads(model).items():
        torch.testing.assert_close(grad, grads_trl[name], atol=1e-6, rtol=1e-5)
