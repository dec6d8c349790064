"""The GRPO family: rl.algorithm grpo, rloo, reinforce_plus_plus and reinforce_plus_plus_baseline. Each samples
grpo.num_generations completions per prompt, scores them with reward models and Python functions
(`reward_sources.py`), and trains without a value model; they differ in the advantage estimator
(`advantages.py`) and the loss (`policy_losses.py`).

`GRPOSteps` holds the rollout (with DAPO's dynamic sampling, `dynamic_sampling.py`), update and metrics
phases of one step (`rl_step`), then TR-DPO's reference sync (arXiv:2404.09656) and `train_grpo`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Unpack

import torch

from rlhf_core.config import GRPOConfig, RLConfig, RunConfig
from rlhf_core.models.forward import response_logprobs
from rlhf_core.rewards.sources import RewardSourceFn, score_sources
from rlhf_core.rl.advantages.estimators import Estimate, EstimatorContext, estimator_for
from rlhf_core.rl.advantages.group_baselines import nanstd
from rlhf_core.rl.dynamic_sampling import GroupFiller
from rlhf_core.rl.grpo_losses import (
    TOKEN_NORMALIZED,
    grpo_token_loss,
    high_entropy_mask,
    reduce_loss,
    rloo_sequence_loss,
    stat_mean,
)
from rlhf_core.rl.step import (
    BatchSizes,
    PromptBatch,
    PromptBatches,
    RLHooks,
    RolloutSettings,
    StepStats,
    eval_cadence,
    rl_loop_settings,
    rollout_settings,
    run_rl,
)
from rlhf_core.rl_math import masked_mean
from rlhf_core.rollout.collect import RolloutBatch, collect_rollout, completion_metrics, missing_stop_penalty
from rlhf_core.rollout.generation import decode_responses
from rlhf_core.training.loop import LoopResult, TrainingLoop
from rlhf_core.training.timing import PhaseTimer


@torch.no_grad()
def mix_into_reference(ref_model: torch.nn.Module, policy: torch.nn.Module, alpha: float) -> None:
    """ref = alpha * policy + (1 - alpha) * ref, parameter by parameter (TR-DPO's soft update, TRL's sync_ref_model)."""
    current = dict(policy.named_parameters())
    for name, ref_param in ref_model.named_parameters():
        ref_param.mul_(1.0 - alpha).add_(current[name].detach().to(ref_param.dtype), alpha=alpha)


def grpo_batch_sizes(rl: RLConfig, grpo: GRPOConfig) -> BatchSizes:
    """grpo.generation_batch_size (or rl.batch_size) completions per generation batch, cut into
    steps_per_generation micro-batches (TRL's name), rl.gradient_accumulation_steps of them per optimizer step."""
    batch = grpo.generation_batch(rl.batch_size)
    micro_per_generation = grpo.steps_per_generation or rl.gradient_accumulation_steps
    optimizer_steps = max(1, micro_per_generation // rl.gradient_accumulation_steps)
    return BatchSizes(
        prompts_per_step=batch // grpo.num_generations,
        generations_per_prompt=grpo.num_generations,
        mini_batch=batch // optimizer_steps,
        micro_batch=max(1, batch // micro_per_generation),
    )


class GRPOSteps:
    """GRPO's phases of one RL step (`rl_step`): rollout, update and metrics; the advantages are the estimator's.

    Each generation batch feeds grpo.num_iterations passes of sizes.mini_batches optimizer steps.
    """

    def __init__(
        self,
        loop: TrainingLoop,
        settings: RolloutSettings,
        ref_model,
        rewards: list[RewardSourceFn],
        prompt_rows: list[dict],
        rl: RLConfig,
        grpo: GRPOConfig,
    ):
        self.loop, self.settings, self.ref_model, self.rewards = loop, settings, ref_model, rewards
        self.prompt_rows, self.rl, self.grpo, self.tokenizer = prompt_rows, rl, grpo, loop.tokenizer
        self.sizes = grpo_batch_sizes(rl, grpo)
        self.weights = torch.tensor([s.weight for s in rewards], dtype=torch.float32)
        self.optimizer_steps = grpo.num_iterations * self.sizes.mini_batches  # per generation batch
        self.timer = PhaseTimer(loop.device)
        self.on_completions: Callable[[list[dict], int], None] | None = None
        self.more_prompts: Callable[[], PromptBatch] | None = None  # the next prompts (dynamic sampling)
        self.dynamic: dict[str, float] = {}  # dynamic sampling's counts of this step

    def rollout(self, prompts: PromptBatch) -> RolloutBatch:
        """Sample and score the step's groups; with rl.dynamic_sampling, replace the groups whose reward has no
        spread by groups of more prompts (`dynamic_sampling.py`), for at most max_rounds extra rounds."""
        batch = self._sample(prompts)
        if not self.rl.dynamic_sampling.enabled:
            return batch
        filler = GroupFiller(self.sizes.prompts_per_step, self.sizes.generations_per_prompt)
        filler.add(batch, self._rewards(batch))
        rounds = 0
        # every process samples while any is short (generation may be collective: sharded parameters)
        while rounds < self.rl.dynamic_sampling.max_rounds and self.loop.global_sum(
            torch.tensor(float(filler.missing > 0), device=self.loop.device)
        ):
            rounds += 1
            more = self._sample(self.more_prompts())
            filler.add(more, self._rewards(more))
        batch, filled = filler.batch(self.settings.pad_token_id)
        self.dynamic = {
            "dynamic_sampling/zero_spread_groups": float(filler.dropped_groups),
            "dynamic_sampling/rounds": float(rounds),
            "dynamic_sampling/filled_groups": float(filled),
        }
        return batch

    def _rewards(self, batch: RolloutBatch) -> torch.Tensor:
        """Each completion's weighted reward minus the missing-stop penalty; NaN where no source scored it. (B,)"""
        unscorable = torch.isnan(batch.scores).all(dim=1)
        rewards = torch.nansum(batch.scores * self.weights.to(batch.scores).view(1, -1), dim=1)
        if batch.penalty is not None:
            rewards = rewards - batch.penalty.to(rewards)
        return rewards.masked_fill(unscorable, float("nan"))

    def _sample(self, prompts: PromptBatch) -> RolloutBatch:
        """Sample generations_per_prompt completions per prompt, decode them, score them with every source."""
        loop, settings = self.loop, self.settings
        with loop.full_parameters():
            rollout = collect_rollout(
                loop.unwrapped(),
                self.ref_model,
                prompts.query_ids,
                prompts.query_mask,
                settings.sampling,
                pad_token_id=settings.pad_token_id,
                stop_token_ids=settings.stop_token_ids,
                need_reference=self.grpo.beta > 0,
                # else the first update's own, detached (as TRL); a KL in the reward needs them at sampling
                need_logprobs=self.optimizer_steps > 1 or (self.grpo.beta > 0 and self.rl.algorithm != "grpo"),
                prompt_repeats=self.sizes.generations_per_prompt,
                timer=self.timer,
            )
        rows = [self.prompt_rows[i] for i in prompts.indices]
        completions = decode_responses(self.tokenizer, rollout.responses, rollout.resp_mask)
        with self.timer("reward"):
            scores = score_sources(self.rewards, [r["prompt"] for r in rows], completions, rollout, rows)
        penalty = missing_stop_penalty(rollout, self.rl.missing_eos_penalty)
        return RolloutBatch(rollout, scores.to(loop.device), penalty, rows=rows, completions=completions)

    def estimator_context(self) -> EstimatorContext:
        return EstimatorContext(self.grpo, self.loop, self.sizes.generations_per_prompt, self.weights)

    def update(self, batch: RolloutBatch, estimate: Estimate) -> StepStats:
        """num_iterations x mini_batches optimizer steps over the generation batch, each accumulated over
        micro-batches; the reference mixed into after every ref_model_sync_steps optimizer steps."""
        loop, grpo, sizes = self.loop, self.grpo, self.sizes
        mask = batch.rollout.trained_mask(grpo.mask_truncated_completions)
        # dapo/cispo divide by the active tokens of the global optimizer batch (TRL: the generation batch's
        # tokens / steps per generation); the processes' gradients are averaged, hence / world
        total_tokens = float(loop.global_sum(mask.sum().float())) / loop.world / sizes.mini_batches
        stats = StepStats()
        loop.trainable.train()
        with self.timer("optimize"):
            for j in range(self.optimizer_steps):
                start = (j % sizes.mini_batches) * sizes.mini_batch
                step_loss = torch.zeros((), device=loop.device)
                for micro in range(start, start + sizes.mini_batch, sizes.micro_batch):
                    rows = slice(micro, min(micro + sizes.micro_batch, start + sizes.mini_batch))
                    step_loss = step_loss + self._micro_batch(batch, estimate, mask, rows, total_tokens, stats)
                loop.optimizer_step()
                stats.add(loss=step_loss)  # the optimizer step's whole loss, not a micro-batch's share
                done = loop.step * self.optimizer_steps + j + 1  # optimizer steps so far (TRL's global_step)
                if grpo.sync_ref_model and self.ref_model is not None and done % grpo.ref_model_sync_steps == 0:
                    mix_into_reference(self.ref_model, loop.unwrapped(), grpo.ref_model_mixup_alpha)
        return stats

    def _micro_batch(self, batch, estimate, mask, rows: slice, total_tokens: float, stats: StepStats) -> torch.Tensor:
        """Forward and backward of one micro-batch; its share of the optimizer step's loss, detached."""
        rollout, grpo, m = batch.rollout, self.grpo, mask[rows]
        with self.loop.micro_batch():
            logp, entropy = response_logprobs(
                self.loop.trainable,
                rollout.query_ids[rows],
                rollout.query_mask[rows],
                rollout.responses[rows],
                rollout.resp_mask[rows],
                self.rl.temperature,
                with_entropy=True,
            )
            old_logp = rollout.logprobs[rows] if rollout.logprobs is not None else logp.detach()
            if self.rl.algorithm == "rloo":
                loss, token_stats = rloo_sequence_loss(
                    logp, old_logp, estimate.advantages[rows], m, grpo.epsilon, grpo.epsilon_high
                )
            else:
                advantages = estimate.advantages[rows]
                loss, token_stats = self._token_loss(
                    rollout, rows, logp, old_logp, entropy, advantages, m, total_tokens
                )
            if self.rl.algorithm == "rloo" or grpo.loss_type not in TOKEN_NORMALIZED:
                loss = loss * (m.shape[0] / self.sizes.mini_batch)  # mean over micro-batches
            self.loop.backward(loss)
        if "cispo_clipped" in token_stats:
            stats.add(cispo=stat_mean(token_stats["cispo_clipped"], m))
        else:
            low, high = token_stats["low_clipped"], token_stats["high_clipped"]
            stats.add(low=stat_mean(low, m), high=stat_mean(high, m), region=stat_mean(torch.maximum(low, high), m))
        stats.add(entropy=masked_mean(entropy.detach(), m))
        if "kl" in token_stats:
            stats.add(kl=masked_mean(token_stats["kl"].detach(), m))
        return loss.detach()

    def _token_loss(self, rollout, rows: slice, logp, old_logp, entropy, advantages, m, total_tokens: float):
        """grpo.loss_type's loss of a micro-batch, with the entropy mask; the k3 KL term for rl.algorithm grpo
        (the others put their KL into the reward)."""
        grpo = self.grpo
        entropy_mask = None
        if grpo.top_entropy_quantile < 1.0:
            entropy_mask = high_entropy_mask(entropy, m, grpo.top_entropy_quantile, self._gather_tokens)
        in_loss = self.rl.algorithm == "grpo" and rollout.ref_logprobs is not None
        per_token, token_stats = grpo_token_loss(
            logp,
            old_logp,
            advantages,
            m,
            grpo,
            entropy_mask=entropy_mask,
            ref_logp=rollout.ref_logprobs[rows] if in_loss else None,
        )
        loss = reduce_loss(
            per_token, m, grpo.loss_type, max_completion_length=self.rl.response_length, total_tokens=total_tokens
        )
        return loss, token_stats

    def _gather_tokens(self, local: torch.Tensor) -> torch.Tensor:
        """Every process's 1-D values (of different lengths), for the entropy quantile."""
        if self.loop.world == 1:
            return local
        padded = self.loop.accelerator.pad_across_processes(local, dim=0, pad_index=-1e9)
        pooled = self.loop.accelerator.gather(padded)
        return pooled[pooled != -1e9]

    def metrics(self, batch: RolloutBatch, estimate: Estimate, stats: StepStats) -> dict[str, torch.Tensor | float]:
        """TRL's GRPO metrics; reward statistics over every process's rows (the loop's averaging keeps them)."""
        self._table(batch, estimate)
        everyone = estimate.stats
        metrics = {
            **self.timer.pop(),
            "reward": torch.nanmean(everyone["rewards"]),
            "reward_std": nanstd(everyone["rewards"]),
            "frac_reward_zero_std": torch.isclose(everyone["std"], torch.zeros_like(everyone["std"])).float().mean(),
            "rewards/num_unscorable": everyone["unscorable"].float().sum(),
            **completion_metrics(batch.rollout),
            "entropy": stats.mean("entropy"),
            "loss": stats.mean("loss"),
            "_tokens": batch.rollout.resp_mask.sum(),
            **self.dynamic,
        }
        if self.grpo.loss_type == "cispo":
            metrics["cispo_clip_ratio"] = stats.mean("cispo")
        else:
            for name, key in (("low_mean", "low"), ("high_mean", "high"), ("region_mean", "region")):
                metrics[f"clip_ratio/{name}"] = stats.mean(key)
        if "kl" in stats or "kl" in everyone:  # grpo's loss term, or the KL the others put into the reward
            metrics["kl"] = stats.mean("kl") if "kl" in stats else everyone["kl"]
        for i, source in enumerate(self.rewards):
            column = everyone["per_source"][:, i]
            metrics[f"rewards/{source.name}/mean"] = torch.nanmean(column)
            metrics[f"rewards/{source.name}/std"] = nanstd(column)
        return metrics

    def _table(self, batch: RolloutBatch, estimate: Estimate) -> None:
        """Every grpo.log_completions_steps (and at the end): prompts, completions, rewards and advantages."""
        step = self.loop.step + 1
        due = step % self.grpo.log_completions_steps == 0 or step == self.rl.total_steps
        if self.on_completions is None or not self.loop.is_main or not due:
            return
        advantages = estimate.advantages
        if advantages.dim() == 2:  # one per token (REINFORCE++): the mean over each completion's tokens
            advantages = masked_mean(advantages, batch.rollout.resp_mask, dim=1)
        table = [
            {
                "step": step,
                "prompt": row["prompt"],
                "completion": completion,
                "advantage": float(advantage),
                "reward": _float_or_none(reward),
                **{s.name: _float_or_none(v) for s, v in zip(self.rewards, batch.scores[i])},
            }
            for i, (row, completion, advantage, reward) in enumerate(
                zip(batch.rows, batch.completions, advantages.tolist(), estimate.stats["my_rewards"])
            )
        ]
        self.on_completions(table, step)


def _float_or_none(value: torch.Tensor) -> float | None:
    """A 0-d tensor as a float for the completions table; None where it is NaN (the source abstained)."""
    return None if torch.isnan(value) else float(value)


def train_grpo(
    policy,
    ref_model,
    rewards: list[RewardSourceFn],
    tokenizer,
    prompt_rows: list[dict],
    rl: RLConfig,
    grpo: GRPOConfig,
    run: RunConfig,
    *,
    max_prompt_length: int,
    output_dir: str | Path,
    stop_token_ids: Sequence[int] | None = None,
    **hooks: Unpack[RLHooks],
) -> LoopResult:
    """Train `policy` with the GRPO family's rl.algorithm for rl.total_steps generation batches; resume from
    output_dir.

    ref_model None with beta > 0 means a PEFT policy whose disabled adapters are the reference; with
    beta 0 no reference is used at all. `stop_token_ids`: what ends a response, when the caller computed it
    (else `run_stop_ids` of the policy). `hooks` (`RLHooks`): on_log, on_checkpoint, on_eval with
    evaluate and eval_every, on_step, show_progress, and on_completions(rows, step), which receives every
    grpo.log_completions_steps the prompts, completions, each reward and the advantages.
    """
    estimator = estimator_for(rl.algorithm, with_values=False)
    models = {"policy": policy}
    if grpo.sync_ref_model and ref_model is not None:
        models["ref"] = ref_model  # it changes during training: saved and restored with the policy
    sizes = grpo_batch_sizes(rl, grpo)
    settings = rl_loop_settings(rl, run, sizes, eval_every=eval_cadence(hooks))
    loop = TrainingLoop(policy, models, tokenizer, settings, run, output_dir=output_dir)
    prompts = [r["prompt"] for r in prompt_rows]
    batches = PromptBatches(tokenizer, prompts, sizes, max_prompt_length=max_prompt_length, seed=run.seed, loop=loop)
    if ref_model is not None:
        ref_model.to(loop.device).eval().requires_grad_(False)
    steps = GRPOSteps(
        loop, rollout_settings(tokenizer, policy, rl, stop_token_ids), ref_model, rewards, prompt_rows, rl, grpo
    )
    steps.on_completions = hooks.get("on_completions")
    steps.more_prompts = batches.next
    return run_rl(loop, steps, estimator, batches, policy, hooks)
