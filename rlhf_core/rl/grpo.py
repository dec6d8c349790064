"""The GRPO family: rl.algorithm grpo, rloo, reinforce_plus_plus and reinforce_plus_plus_baseline. Each samples
grpo.num_generations completions per prompt, scores them with every reward source (`rewards/sources.py`: in this
process or served elsewhere), and trains without a value model; they differ in the advantage estimator
(`advantages/estimators.py`) and the loss (`grpo_losses.py`, picked once by `policy_loss_for`). `GroupScorer`
scores a step's groups and refills those without spread (DAPO's dynamic sampling, `dynamic_sampling.py`);
`GRPOSteps` holds the phases of one step (`rl_step`), the update with TR-DPO's reference sync (arXiv:2404.09656).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import closing
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from rlhf_core.config import GRPOConfig, RLConfig, RolloutConfig
from rlhf_core.models.forward import response_logprobs
from rlhf_core.rewards.sources import environment_rewards, score_sources, source_metrics
from rlhf_core.rl.advantages.estimators import Estimate, EstimatorContext, estimator_for
from rlhf_core.rl.advantages.group_baselines import nanstd
from rlhf_core.rl.completions import completions_due, completions_table
from rlhf_core.rl.dynamic_sampling import GroupFiller
from rlhf_core.rl.engine_correction import (
    CorrectionSettings,
    LossWeights,
    correction_settings,
    old_logprobs,
    old_logprobs_at_sampling,
)
from rlhf_core.rl.grpo_losses import LossInputs, PolicyLoss, policy_loss_for
from rlhf_core.rl.inputs import RLInputs, RLModels
from rlhf_core.rl.samplers import StepSampler, sampler_for
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
    RolloutBatch,
    Sampled,
    ToolRollout,
    completion_metrics,
    context_length,
    missing_stop_penalty,
    score_sampled,
    tool_metrics,
)
from rlhf_core.rollout.engines import make_engine
from rlhf_core.rollout.generation import decode_responses
from rlhf_core.rollout.tools import load_tool_use, require_tool_template
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
        max_tokens=rl.max_tokens_per_micro_batch,
    )


def gather_tokens(loop: TrainingLoop, local: torch.Tensor) -> torch.Tensor:
    """Every process's 1-D values (of different lengths), for the entropy quantile; a collective."""
    if loop.world == 1:
        return local
    padded = loop.accelerator.pad_across_processes(local, dim=0, pad_index=-1e9)
    pooled = loop.accelerator.gather(padded)
    return pooled[pooled != -1e9]


def tool_rollout(grpo: GRPOConfig, tokenizer, policy, max_prompt_length: int, template_kwargs: dict | None = None):
    """The tool episodes grpo.tools and grpo.environment ask for (None without them), the tokenizer's template
    checked first: one that cannot carry them is refused in one sentence."""
    tool_use = load_tool_use(grpo)
    if tool_use is None:
        return None
    require_tool_template(tokenizer, template_kwargs)
    return ToolRollout(tool_use, tokenizer, [], max_prompt_length, context_length(policy), template_kwargs)


class GroupScorer:
    """The family's scoring of a step's groups: the log-probs `passes` asks for, then every reward source's score
    (models.rewards); with grpo.dynamic_sampling (DAPO), the groups whose reward has no spread replaced by fresh
    groups, for at most max_rounds extra rounds. `rows`: the prompt rows by index."""

    def __init__(self, loop: TrainingLoop, models: RLModels, rows: list[dict], rl: RLConfig, grpo: GRPOConfig, passes):
        self.loop, self.ref_model, self.rewards, self.rows = loop, models.reference, models.rewards, rows
        self.rl, self.grpo, self.passes, self.sizes = rl, grpo, passes, grpo_batch_sizes(rl, grpo)
        self.weights = torch.tensor([s.weight for s in self.rewards], dtype=torch.float32)
        self.timer = PhaseTimer(loop.device)  # generate, policy_logprobs, reference and reward
        self.dynamic: dict[str, float] = {}  # dynamic sampling's counts of the latest step

    def score(self, prompts: PromptBatch, sampled: Sampled) -> RolloutBatch:
        """The groups' rollout with the log-probs `passes` asks for, decoded and scored by every source."""
        loop = self.loop
        rows = [self.rows[i] for i in prompts.indices]
        with loop.full_parameters():
            policy, temperature = loop.unwrapped(), self.rl.temperature
            plan = micro_plan(loop, self.sizes, sampled.query_mask, sampled.resp_mask)
            rollout = score_sampled(policy, self.ref_model, sampled, temperature, self.passes, self.timer, plan)
        if rollout.episodes is not None:
            completions = rollout.episodes.texts()
        else:
            completions = decode_responses(loop.tokenizer, rollout.responses, rollout.resp_mask)
        with self.timer("reward"):
            prompts_text = [r["prompt"] for r in rows]
            group = self.sizes.generations_per_prompt
            scores = score_sources(self.rewards, prompts_text, completions, rollout, rows, group)
        penalty = missing_stop_penalty(rollout, self.rl.missing_eos_penalty)
        return RolloutBatch(rollout, scores.to(loop.device), penalty, rows=rows, completions=completions)

    def refill(self, batch: RolloutBatch, sampler: Sampler, more_prompts: Callable[[], PromptBatch]) -> RolloutBatch:
        """With dynamic sampling, the step's groups without spread replaced by groups of `more_prompts()` that
        `sampler` samples, every process sampling while any is short (generation may be collective); else `batch`
        as it is."""
        dynamic = self.grpo.dynamic_sampling
        if not dynamic.enabled:
            return batch
        loop, sizes = self.loop, self.sizes
        filler = GroupFiller(sizes.prompts_per_step, sizes.generations_per_prompt)
        filler.add(batch, self.rewards_of(batch))
        rounds = 0
        while rounds < dynamic.max_rounds and loop.global_sum(
            torch.tensor(float(filler.missing > 0), device=loop.device)
        ):
            rounds += 1
            prompts = more_prompts()
            more = self.score(prompts, sampler.sample(prompts, call=rounds))
            filler.add(more, self.rewards_of(more))
        pad_token_id = loop.tokenizer.pad_token_id
        batch, filled = filler.batch(pad_token_id)
        self.dynamic = {
            "dynamic_sampling/zero_spread_groups": float(filler.dropped_groups),
            "dynamic_sampling/rounds": float(rounds),
            "dynamic_sampling/filled_groups": float(filled),
        }
        return batch

    def rewards_of(self, batch: RolloutBatch) -> torch.Tensor:
        """Each completion's weighted reward minus the missing-stop penalty; NaN where no source scored it. (B,)"""
        unscorable = torch.isnan(batch.scores).all(dim=1)
        rewards = torch.nansum(batch.scores * self.weights.to(batch.scores).view(1, -1), dim=1)
        if batch.penalty is not None:
            rewards = rewards - batch.penalty.to(rewards)
        return rewards.masked_fill(unscorable, float("nan"))


class GRPOSteps:
    """The family's phases of one RL step (`rl_step`): `sampler`'s completions, `scorer`'s scores and refill, the
    estimator's advantages, then the update (the loss `loss`) and metrics. Each generation batch feeds
    grpo.num_iterations passes of sizes.mini_batches optimizer steps. `more_prompts()`: dynamic sampling's fresh
    prompts; `on_completions(rows, step)` receives the completions table."""

    def __init__(
        self,
        loop: TrainingLoop,
        sampler: Sampler,
        scorer: GroupScorer,
        loss: PolicyLoss,
        rollout: RolloutConfig,
        more_prompts: Callable[[], PromptBatch],
        on_completions: Callable[[list[dict], int], None] | None = None,
    ):
        self.loop, self.sampler, self.scorer, self.loss = loop, sampler, scorer, loss
        self.rl, self.grpo, self.sizes = scorer.rl, scorer.grpo, scorer.sizes
        self.estimator = estimator_for(self.rl.algorithm, with_values=False)
        self.correction: CorrectionSettings | None = correction_settings(rollout)
        self.versioned = rollout.max_staleness > 0  # checkpoints say which policy version they hold
        self.more_prompts, self.on_completions = more_prompts, on_completions
        self.optimizer_steps = self.grpo.num_iterations * self.sizes.mini_batches  # per generation batch
        self.timer = PhaseTimer(loop.device)  # optimize
        self.correction_metrics: dict[str, torch.Tensor] = {}  # the engine correction's, of the latest update

    def score(self, prompts: PromptBatch, sampled: Sampled) -> RolloutBatch:
        return self.scorer.score(prompts, sampled)

    def refill(self, batch: RolloutBatch) -> RolloutBatch:
        return self.scorer.refill(batch, self.sampler, self.more_prompts)

    def estimator_context(self) -> EstimatorContext:
        return EstimatorContext(self.grpo, self.loop, self.sizes.generations_per_prompt, self.scorer.weights)

    def update(self, batch: RolloutBatch, estimate: Estimate) -> StepStats:
        """num_iterations x mini_batches optimizer steps over the generation batch, each accumulated over
        micro-batches; the reference mixed into after every ref_model_sync_steps optimizer steps."""
        loop, grpo, sizes, ref_model = self.loop, self.grpo, self.sizes, self.scorer.ref_model
        mask = batch.rollout.trained_mask(grpo.mask_truncated_completions)
        # dapo/cispo divide by the active tokens of the global optimizer batch (TRL: the generation batch's
        # tokens / steps per generation); the processes' gradients are averaged, hence / world
        total_tokens = float(loop.global_sum(mask.sum().float())) / loop.world / sizes.mini_batches
        weights = LossWeights(batch.rollout, mask, self.correction)
        stats = StepStats()
        loop.trainable.train()
        with self.timer("optimize"):
            for j in range(self.optimizer_steps):
                start = (j % sizes.mini_batches) * sizes.mini_batch
                rollout = batch.rollout
                plan = micro_plan(
                    loop, sizes, rollout.query_mask, rollout.resp_mask, range(start, start + sizes.mini_batch)
                )
                loop.accumulate_over(len(plan))
                step_loss = torch.zeros((), device=loop.device)
                for rows in plan:
                    step_loss = step_loss + self._micro_batch(batch, estimate, mask, rows, total_tokens, stats, weights)
                loop.optimizer_step()
                stats.add(loss=step_loss)  # the optimizer step's whole loss, not a micro-batch's share
                done = loop.step * self.optimizer_steps + j + 1  # optimizer steps so far (TRL's global_step)
                if grpo.sync_ref_model and ref_model is not None and done % grpo.ref_model_sync_steps == 0:
                    mix_into_reference(ref_model, loop.unwrapped(), grpo.ref_model_mixup_alpha)
        self.correction_metrics = weights.metrics()
        if self.versioned:
            loop.state["policy_version"] = float(loop.step + 1)  # what a checkpoint after this step holds
        return stats

    def _micro_batch(
        self, batch, estimate, mask, rows: list[int], total_tokens: float, stats: StepStats, weights: LossWeights
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch; its share of the optimizer step's loss, detached. `weights`:
        the engine correction's."""
        rollout, m = batch.rollout, mask[rows]
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
            loss, loss_stats = self.loss(
                LossInputs(
                    logp=logp,
                    old_logp=old_logprobs(rollout, rows, logp),
                    entropy=entropy,
                    advantages=estimate.advantages[rows],
                    mask=m,
                    ref_logp=rollout.ref_logprobs[rows] if rollout.ref_logprobs is not None else None,
                    total_tokens=total_tokens,
                    is_weights=weights.of(rows, logp),
                )
            )
            self.loop.backward(loss)
        stats.add(**loss_stats.clip.named(), entropy=masked_mean(entropy.detach(), m))
        if loss_stats.kl is not None:
            stats.add(kl=loss_stats.kl)
        return loss.detach()

    def metrics(self, batch: RolloutBatch, estimate: Estimate, stats: StepStats) -> dict[str, torch.Tensor | float]:
        """TRL's GRPO metrics; reward statistics over every process's rows (the loop's averaging keeps them)."""
        self._report_completions(batch, estimate)
        everyone = estimate.stats
        metrics = {
            **self.scorer.timer.pop(),
            **self.timer.pop(),
            "reward": torch.nanmean(everyone["rewards"]),
            "reward_std": nanstd(everyone["rewards"]),
            "frac_reward_zero_std": torch.isclose(everyone["std"], torch.zeros_like(everyone["std"])).float().mean(),
            "rewards/num_unscorable": everyone["unscorable"].float().sum(),
            **completion_metrics(batch.rollout),
            **tool_metrics(batch.rollout),
            "entropy": stats.mean("entropy"),
            "loss": stats.mean("loss"),
            "_tokens": batch.rollout.resp_mask.sum(),
            **self.scorer.dynamic,
            **source_metrics(self.scorer.rewards),
            **self.correction_metrics,
            **self.sampler.metrics,
            **{name: stats.mean(name) for name in self.loss.clip_metrics},
        }
        if "kl" in stats or "kl" in everyone:  # grpo's loss term, or the KL the others put into the reward
            metrics["kl"] = stats.mean("kl") if "kl" in stats else everyone["kl"]
        for i, source in enumerate(self.scorer.rewards):
            column = everyone["per_source"][:, i]
            metrics[f"rewards/{source.name}/mean"] = torch.nanmean(column)
            metrics[f"rewards/{source.name}/std"] = nanstd(column)
        return metrics

    def _report_completions(self, batch: RolloutBatch, estimate: Estimate) -> None:
        """The completions table to on_completions, from the main process, when grpo.log_completions_steps says."""
        step = self.loop.step + 1
        due = completions_due(step, self.grpo.log_completions_steps, self.rl.total_steps)
        if self.on_completions is None or not self.loop.is_main or not due:
            return
        names = [source.name for source in self.scorer.rewards]
        self.on_completions(completions_table(step, batch, estimate, names), step)


def train_grpo(inputs: RLInputs) -> LoopResult:
    """Train inputs.models.policy with the GRPO family's rl.algorithm for rl.total_steps generation batches, scored
    by inputs.models.rewards; resume from inputs.output_dir.

    models.reference None with beta > 0 means a PEFT policy whose disabled adapters are the reference; with beta 0
    no reference is used at all. The rollout engine is settings.rollout's (our loop by default); with grpo.tools or
    grpo.environment every completion is a tool episode (`tool_rollout`). hooks.on_completions receives every
    grpo.log_completions_steps the prompts, completions, each reward and the advantages.
    """
    models, settings, hooks, out = inputs.models, inputs.settings, inputs.hooks, Path(inputs.output_dir)
    rl, run, rollout, tokenizer, policy = settings.rl, settings.run, settings.rollout, models.tokenizer, models.policy
    grpo = settings.grpo.model_copy(update={"beta": settings.grpo.beta * settings.kl_scale})
    saved = {"policy": policy}
    if grpo.sync_ref_model and models.reference is not None:
        saved["ref"] = models.reference  # it changes during training: saved and restored with the policy
    sizes = grpo_batch_sizes(rl, grpo)
    loop_settings = rl_loop_settings(rl, run, sizes, eval_every=hooks.eval_cadence)
    loop = TrainingLoop(policy, saved, tokenizer, loop_settings, run, output_dir=out)
    rows, max_prompt_length = inputs.prompts.rows, inputs.prompts.max_prompt_length
    prompts = [r["prompt"] for r in rows]
    batches = PromptBatches(tokenizer, prompts, sizes, max_prompt_length=max_prompt_length, seed=run.seed, loop=loop)
    if models.reference is not None:
        models.reference.to(loop.device).eval().requires_grad_(False)
    tools = tool_rollout(grpo, tokenizer, policy, max_prompt_length, settings.template_kwargs)
    if tools is not None:
        models = replace(models, rewards=models.rewards + environment_rewards(tools.tool_use))
    spec = sampling_spec(tokenizer, policy, settings, sizes.generations_per_prompt, tools)
    engine = make_engine(rollout, out / "engine-weights", loop)
    at_sampling = old_logprobs_at_sampling(rl, grpo.beta, grpo.num_iterations * sizes.mini_batches, rollout)
    scorer = GroupScorer(loop, models, rows, rl, grpo, Passes(policy=at_sampling, reference=grpo.beta > 0))
    sampler, loop_batches = sampler_for(
        rollout, StepSampler(loop, engine, spec, rows, loop.unwrapped, scorer.timer), batches
    )
    loss = policy_loss_for(rl, grpo, mini_batch=sizes.mini_batch, gather=partial(gather_tokens, loop))
    steps = GRPOSteps(loop, sampler, scorer, loss, rollout, batches.next, hooks.on_completions)
    callbacks = loop_callbacks(hooks, loop, policy, eval_engine_of(engine, rollout))
    with closing(sampler):  # generation ahead: its queue goes first, however the loop ends
        return loop.run(partial(rl_step, steps), loop_batches, callbacks, show_progress=hooks.show_progress)
