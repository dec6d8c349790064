"""PPO (arXiv:1707.06347) with a learned reward model and a value model, resumable from any checkpoint.

PPO's losses and KL controllers first, then `PPOSteps`, the rollout, update and metrics phases of one
step (`rl_step`) in the CleanRL/TRL recipe: generate and score, then (the estimator,
`advantages.gae_estimate`) KL-penalized per-token rewards and GAE, then PPO epochs over shuffled
mini-batches. A checkpoint holds the policy (`policy/`, Hugging Face format), the value model
(`value/`) and the training state (`training_state/`, no pickle).
"""

from __future__ import annotations

from contextlib import closing
from functools import partial
from pathlib import Path

import torch

from rlhf_core.config import PPOConfig, RLConfig
from rlhf_core.models.forward import over_micro_batches, response_logprobs, sequence_scores, token_values
from rlhf_core.rewards.functions import check_finite
from rlhf_core.rl.advantages.estimators import Estimate, EstimatorContext, estimator_for
from rlhf_core.rl.engine_correction import correct_rollout, correction_settings, old_logprobs_at_sampling
from rlhf_core.rl.inputs import RLInputs, RLSettings
from rlhf_core.rl.samplers import StepSampler
from rlhf_core.rl.step import (
    BatchSizes,
    PromptBatch,
    PromptBatches,
    Sampler,
    StepStats,
    eval_engine_of,
    loop_callbacks,
    micro_plan,
    rl_loop_settings,
    rl_step,
    sampling_spec,
)
from rlhf_core.rl_math import masked_mean
from rlhf_core.rollout.collect import (
    Passes,
    Rollout,
    RolloutBatch,
    Sampled,
    completion_metrics,
    missing_stop_penalty,
    score_sampled,
)
from rlhf_core.rollout.engines import make_engine
from rlhf_core.training.loop import LoopResult, TrainingLoop
from rlhf_core.training.parallel import reduce_metrics
from rlhf_core.training.timing import PhaseTimer


def policy_loss(
    new_logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate (arXiv:1707.06347): mean over real tokens of max(-A r, -A clip(r, 1-eps, 1+eps)),
    each token's term times `is_weights` ((B, T) or (B, 1)) when a rollout engine's correction gives them (the
    truncated importance sampling of OpenRLHF's and verl's PPO)."""
    log_ratio = new_logp - old_logp
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    per_token = torch.max(unclipped, clipped)
    loss = masked_mean(per_token if is_weights is None else per_token * is_weights, mask)
    stats = {
        "clipfrac": masked_mean((clipped > unclipped).float(), mask),
        "approxkl": 0.5 * masked_mean(log_ratio**2, mask),
        "ratio": masked_mean(ratio, mask),
    }
    return loss, stats


def value_loss(
    vpred: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, cliprange_value: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: 0.5 * mean over real tokens of max((v - R)^2, (clip(v, old +- eps) - R)^2)."""
    vclipped = old_values + torch.clamp(vpred - old_values, -cliprange_value, cliprange_value)
    unclipped, clipped = (vpred - returns) ** 2, (vclipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(unclipped, clipped), mask)
    return loss, {"clipfrac": masked_mean((clipped > unclipped).float(), mask)}


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Ziegler et al. (2019, arXiv:1909.08593): move the coefficient so the observed KL approaches `target`.

    error = clip(kl / target - 1, -0.2, 0.2); value *= 1 + error * n_steps / horizon.
    """

    def __init__(self, kl_coef: float, target: float, horizon: int):
        self.value, self.target, self.horizon = kl_coef, target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


class PolicyAndValue(torch.nn.Module):
    """Both trained models under one module, so one optimizer and one `accelerator.prepare` cover them."""

    def __init__(self, policy, value_model):
        super().__init__()
        self.policy = policy
        self.value_model = value_model

    @property
    def _no_split_modules(self) -> list[str]:
        """The decoder-layer classes of both models: FSDP's transformer auto-wrap shards by them."""
        return sorted(
            {
                name
                for model in (self.policy, self.value_model)
                for name in (getattr(model, "_no_split_modules", None) or [])
            }
        )

    def forward(self, query_ids, query_mask, responses, resp_mask, temperature: float):
        """(log-probabilities, entropies, values) of the response tokens, each (B, R)."""
        args = (query_ids, query_mask, responses, resp_mask)
        logp, entropy = response_logprobs(self.policy, *args, temperature=temperature, with_entropy=True)
        return logp, entropy, token_values(self.value_model, *args)


def make_kl_controller(ppo: PPOConfig):
    if ppo.adaptive_kl:
        return AdaptiveKLController(ppo.kl_coef, ppo.target_kl, ppo.horizon)
    return FixedKLController(ppo.kl_coef)


@torch.no_grad()
def score_rollout(
    rollout: Rollout,
    value_model,
    reward_model,
    *,
    missing_eos_penalty: float | None,
    timer: PhaseTimer | None = None,
    plan: list[list[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores (B,), values (B, R)) of a rollout, micro-batch by micro-batch of `plan` (rows; None: one);
    responses without the stop token lose the penalty. `timer` times the phases reward and value."""
    timer = timer or PhaseTimer(enabled=False)
    args = (rollout.query_ids, rollout.query_mask, rollout.responses, rollout.resp_mask)
    with timer("reward"):
        scores = over_micro_batches(partial(sequence_scores, reward_model), plan, *args, rollout.last_index)
    check_finite("the reward model", scores)
    penalty = missing_stop_penalty(rollout, missing_eos_penalty)
    if penalty is not None:
        scores = scores - penalty
    with timer("value"):
        values = over_micro_batches(partial(token_values, value_model), plan, *args)
    return scores, values


def ppo_batch_sizes(rl: RLConfig, ppo: PPOConfig) -> BatchSizes:
    """rl.batch_size prompts, one completion each, cut into ppo.num_mini_batches optimizer steps per PPO epoch,
    each accumulated over rl.gradient_accumulation_steps micro-batches."""
    mini_batch = rl.batch_size // ppo.num_mini_batches
    return BatchSizes(
        prompts_per_step=rl.batch_size,
        generations_per_prompt=1,
        mini_batch=mini_batch,
        micro_batch=max(1, mini_batch // rl.gradient_accumulation_steps),
        max_tokens=rl.max_tokens_per_micro_batch,
    )


class PPOSteps:
    """PPO's phases of one RL step (`rl_step`): `sampler`'s completions, scored by the reward model and valued,
    then the estimator's advantages, the update and metrics; the update weighs the loss by the engine correction
    (rollout.correction) when an engine apart sampled."""

    def __init__(
        self, loop: TrainingLoop, sampler: Sampler, ref_model, reward_model, settings: RLSettings, kl_ctl, timer
    ):
        self.loop, self.sampler, self.ref_model, self.reward_model = loop, sampler, ref_model, reward_model
        self.rl, self.ppo, self.kl_ctl = settings.rl, settings.ppo, kl_ctl
        self.estimator = estimator_for(self.rl.algorithm, with_values=True)
        self.correction = correction_settings(settings.rollout)
        self.correction_metrics: dict[str, torch.Tensor] = {}  # the engine correction's, of the latest update
        self.sizes = ppo_batch_sizes(self.rl, self.ppo)
        updates = self.ppo.num_ppo_epochs * self.sizes.mini_batches
        at_sampling = old_logprobs_at_sampling(self.rl, self.ppo.kl_coef, updates, settings.rollout)  # always, PPO
        self.passes = Passes(policy=at_sampling, reference=True)
        self.timer = timer  # generate (the sampler's), policy_logprobs, reference, reward, value, optimize
        self.observed_kl = float("nan")  # the last step's mean KL over the global batch (the controller's input)

    def score(self, prompts: PromptBatch, sampled: Sampled) -> RolloutBatch:
        """The one response per prompt with its log-probs under the policy (the old ones) and the reference,
        scored by the reward model, and valued."""
        models = self.loop.unwrapped()
        plan = micro_plan(self.loop, self.sizes, sampled.query_mask, sampled.resp_mask)
        with self.loop.full_parameters():
            rollout = score_sampled(
                models.policy, self.ref_model, sampled, self.rl.temperature, self.passes, self.timer, plan
            )
            scores, values = score_rollout(
                rollout,
                models.value_model,
                self.reward_model,
                missing_eos_penalty=self.rl.missing_eos_penalty,
                timer=self.timer,
                plan=plan,
            )
        # the penalty is already taken off the score: one source, the reward model
        return RolloutBatch(rollout, scores.unsqueeze(1), values=values)

    def refill(self, batch: RolloutBatch) -> RolloutBatch:
        return batch  # PPO has no groups to refill

    def estimator_context(self) -> EstimatorContext:
        return EstimatorContext(self.ppo, self.loop, kl_coef=self.kl_ctl.value)

    def update(self, batch: RolloutBatch, estimate: Estimate) -> StepStats:
        """ppo.num_ppo_epochs passes over shuffled mini-batches, each accumulated over micro-batches; then the KL
        controller sees the step's KL. Each loss is the mean over the real tokens of the whole mini-batch, every
        process's: the update does not depend on how the mini-batch is split into micro-batches or processes
        (the gradients are averaged, hence / world). The statistics stay on the device."""
        loop, sizes, mask = self.loop, self.sizes, batch.rollout.resp_mask
        correction = correct_rollout(batch.rollout, mask, self.correction)
        self.correction_metrics = correction.metrics if correction is not None else {}
        weights = correction.weights if correction is not None else None
        loop.trainable.train()
        stats = StepStats()
        with self.timer("optimize"):
            for epoch in range(self.ppo.num_ppo_epochs):
                order = torch.randperm(sizes.rollout, device=loop.device)
                for start in range(0, sizes.rollout, sizes.mini_batch):
                    mini = order[start : start + sizes.mini_batch]
                    mini_tokens = loop.global_sum(mask[mini].sum().float()) / loop.world
                    rollout = batch.rollout
                    plan = micro_plan(loop, sizes, rollout.query_mask, rollout.resp_mask, mini.tolist())
                    loop.accumulate_over(len(plan))
                    for rows in plan:
                        self._micro_batch(batch, estimate, rows, mini_tokens, stats, weights)
                    loop.optimizer_step()
                stats.add(epochs=torch.tensor(float(epoch + 1)))
                if self._stop_epochs(stats):
                    break
        # the adaptive controller needs the KL of the whole global batch now, not at logging time
        kl = estimate.stats["kl"]
        self.observed_kl = reduce_metrics(loop.accelerator, {"kl": kl.sum(1).mean()})["kl"]
        self.kl_ctl.update(self.observed_kl, sizes.rollout * loop.world)
        loop.state["kl_coef"] = self.kl_ctl.value
        return stats

    def _stop_epochs(self, stats: StepStats) -> bool:
        """Whether the step's approximate KL to the rollout policy (the mean over every process's micro-batches
        so far) passed ppo.early_stop_approx_kl: then the remaining PPO epochs are skipped, on every process."""
        limit = self.ppo.early_stop_approx_kl
        if limit is None:
            return False
        return bool(self.loop.global_sum(stats.mean("approxkl")) / self.loop.world > limit)

    def _micro_batch(self, batch, estimate, rows: list[int], mini_tokens, stats: StepStats, weights) -> None:
        """Forward and backward of the policy and value losses on one micro-batch (`weights`: the engine
        correction's of the whole batch, or None)."""
        rollout, ppo, m = batch.rollout, self.ppo, batch.rollout.resp_mask[rows]
        w = weights[rows] if weights is not None else None
        with self.loop.micro_batch():
            new_logp, entropy, vpred = self.loop.trainable(
                rollout.query_ids[rows], rollout.query_mask[rows], rollout.responses[rows], m, self.rl.temperature
            )
            pg, pg_stats = policy_loss(new_logp, rollout.logprobs[rows], estimate.advantages[rows], m, ppo.cliprange, w)
            vf, vf_stats = value_loss(vpred, batch.values[rows], estimate.returns[rows], m, ppo.cliprange_value)
            self.loop.backward((pg + ppo.vf_coef * vf) * m.sum() / mini_tokens)
        stats.add(
            pg_loss=pg,
            vf_loss=vf,
            pg_clipfrac=pg_stats["clipfrac"],
            vf_clipfrac=vf_stats["clipfrac"],
            approxkl=pg_stats["approxkl"],
            ratio=pg_stats["ratio"],
            entropy=masked_mean(entropy, m),
        )

    def metrics(self, batch: RolloutBatch, estimate: Estimate, stats: StepStats) -> dict[str, torch.Tensor | float]:
        """TRL's PPO metrics, under TRL's names."""
        rollout, mask = batch.rollout, batch.rollout.resp_mask
        scores, non_score = estimate.stats["scores"], estimate.stats["non_score_reward"].sum(1).mean()
        return {
            **self.timer.pop(),
            "objective/kl": self.observed_kl,
            "objective/entropy": (-rollout.logprobs * mask).sum(1).mean(),
            "objective/non_score_reward": non_score,
            "objective/rlhf_reward": scores.mean() + non_score,
            "objective/scores": scores.mean(),
            "objective/kl_coef": self.kl_ctl.value,
            "policy/approxkl_avg": stats.mean("approxkl"),
            "policy/ppo_epochs": stats.last("epochs"),
            "policy/clipfrac_avg": stats.mean("pg_clipfrac"),
            "policy/entropy_avg": stats.mean("entropy"),
            "loss/policy_avg": stats.mean("pg_loss"),
            "loss/value_avg": stats.mean("vf_loss"),
            "val/clipfrac_avg": stats.mean("vf_clipfrac"),
            "val/ratio": stats.mean("ratio"),
            "val/num_eos_tokens": rollout.has_stop.sum(),
            "val/mean_response_length": mask.sum(1).float().mean(),
            **completion_metrics(rollout),
            "episode": float((self.loop.step + 1) * self.sizes.rollout * self.loop.world),
            "_tokens": mask.sum(),
            **self.correction_metrics,
        }


def train_ppo(inputs: RLInputs) -> LoopResult:
    """Train inputs.models.policy and .value with PPO for rl.total_steps iterations, scored by .reward_model;
    resume from inputs.output_dir.

    models.reference None means the policy is a PEFT model whose disabled adapters are the reference.
    settings.kl_scale multiplies the KL coefficient (the guard's rollbacks): the saved one on resume, once.
    """
    models, settings, hooks, out = inputs.models, inputs.settings, inputs.hooks, Path(inputs.output_dir)
    rl, ppo, run, rollout, policy = settings.rl, settings.ppo, settings.run, settings.rollout, models.policy
    kl_ctl = make_kl_controller(ppo)
    sizes = ppo_batch_sizes(rl, ppo)
    loop = TrainingLoop(
        PolicyAndValue(policy, models.value),
        {"policy": policy, "value": models.value},
        models.tokenizer,
        rl_loop_settings(rl, run, sizes, eval_every=hooks.eval_cadence),
        run,
        output_dir=out,
        state={"kl_coef": ppo.kl_coef, "kl_scale": 1.0},
    )
    # the coefficient a checkpoint saved, rescaled to this run's kl_scale (idempotent across resumes)
    kl_ctl.value = loop.state["kl_coef"] * settings.kl_scale / loop.state.get("kl_scale", 1.0)
    loop.state.update(kl_coef=kl_ctl.value, kl_scale=settings.kl_scale)
    rows, max_prompt_length = inputs.prompts.rows, inputs.prompts.max_prompt_length
    prompts = [r["prompt"] for r in rows]
    batches = PromptBatches(
        models.tokenizer, prompts, sizes, max_prompt_length=max_prompt_length, seed=run.seed, loop=loop
    )
    for frozen in (models.reference, models.reward_model):
        if frozen is not None:
            frozen.to(loop.device).eval().requires_grad_(False)
    engine = make_engine(rollout, out / "engine-weights", loop)
    spec = sampling_spec(models.tokenizer, policy, settings)
    timer = PhaseTimer(loop.device)
    sampler = StepSampler(loop, engine, spec, rows, lambda: loop.unwrapped().policy, timer)
    steps = PPOSteps(loop, sampler, models.reference, models.reward_model, settings, kl_ctl, timer)
    callbacks = loop_callbacks(hooks, loop, policy, eval_engine_of(engine, rollout))
    with closing(sampler):
        return loop.run(partial(rl_step, steps), batches, callbacks, show_progress=hooks.show_progress)
