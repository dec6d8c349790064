"""The GRPO family: rl.algorithm grpo, rloo, reinforce_plus_plus and reinforce_plus_plus_baseline. Each samples
grpo.num_generations completions per prompt, scores them with every reward source (`rewards/sources.py`: in this
process or served elsewhere), and trains without a value model; they differ in the advantage estimator
(`advantages/estimators.py`) and the loss (`grpo_losses.py`, picked once by `policy_loss_for`). `GroupSampler` is
the rollout phase (with DAPO's dynamic sampling, `dynamic_sampling.py`); `GRPOSteps` runs it, then the update and
metrics phases of one step (`rl_step`) and TR-DPO's reference sync (arXiv:2404.09656); `train_grpo` wires them to
the loop. The completions table is `completions.py`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import closing, nullcontext
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Unpack

import torch

from rlhf_core.config import GRPOConfig, RLConfig, RolloutConfig, RunConfig
from rlhf_core.models.forward import response_logprobs
from rlhf_core.rewards.sources import RewardSourceFn, environment_rewards, score_sources, source_metrics
from rlhf_core.rl.advantages.estimators import Estimate, EstimatorContext, estimator_for
from rlhf_core.rl.advantages.group_baselines import nanstd
from rlhf_core.rl.completions import completions_due, completions_table
from rlhf_core.rl.dynamic_sampling import GroupFiller
from rlhf_core.rl.engine_correction import CorrectionSettings, LossWeights, correction_settings
from rlhf_core.rl.grpo_losses import LossInputs, PolicyLoss, policy_loss_for
from rlhf_core.rl.off_policy import AheadBatches, ahead_batches
from rlhf_core.rl.step import (
    BatchSizes,
    PromptBatch,
    PromptBatches,
    RLHooks,
    RolloutSettings,
    StepStats,
    eval_cadence,
    eval_engine_of,
    rl_loop_settings,
    rollout_settings,
    run_rl,
)
from rlhf_core.rl_math import masked_mean
from rlhf_core.rollout.collect import (
    RolloutBatch,
    ToolRollout,
    collect_rollout,
    completion_metrics,
    context_length,
    missing_stop_penalty,
    tool_metrics,
)
from rlhf_core.rollout.engines import LoopEngine, RolloutEngine, make_engine, rollout_seed
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


class GroupSampler:
    """The family's rollout phase: sizes.generations_per_prompt completions per prompt, decoded and scored by
    every reward source; with rl.dynamic_sampling (DAPO), the groups whose reward has no spread replaced by
    groups of `more_prompts()`, for at most max_rounds extra rounds. `engine` samples (our loop when None);
    with `correction` the trainer's log-probs are computed for it; with `tools` each completion is a tool episode."""

    def __init__(
        self,
        loop: TrainingLoop,
        settings: RolloutSettings,
        ref_model,
        rewards: list[RewardSourceFn],
        prompt_rows: list[dict],
        rl: RLConfig,
        grpo: GRPOConfig,
        *,
        more_prompts: Callable[[], PromptBatch],
        engine: RolloutEngine | None = None,
        correction: CorrectionSettings | None = None,
        tools: ToolRollout | None = None,
    ):
        self.loop, self.settings, self.ref_model, self.rewards = loop, settings, ref_model, rewards
        self.tools, self.prompt_rows, self.rl = tools, prompt_rows, rl  # tools: each batch's rows filled in
        self.more_prompts, self.group = more_prompts, grpo_batch_sizes(rl, grpo).generations_per_prompt
        self.engine, self.correction = engine or LoopEngine(), correction
        self.sizes = grpo_batch_sizes(rl, grpo)
        self.weights = torch.tensor([s.weight for s in rewards], dtype=torch.float32)
        self.need_reference = grpo.beta > 0
        # else the update's first pass uses its own, detached (as TRL); a KL in the reward needs them at sampling
        reused = grpo.num_iterations * self.sizes.mini_batches > 1  # optimizer steps per generation batch
        # the correction's "old" log-probs: the update's own first pass when that equals one (engine_correction.py)
        own_pass = correction is not None and not rl.disable_dropout
        self.need_logprobs = reused or (grpo.beta > 0 and rl.algorithm != "grpo") or own_pass
        self.timer = PhaseTimer(loop.device)  # generate, reference and reward
        self.dynamic: dict[str, float] = {}  # dynamic sampling's counts of the latest step

    def sample(self, prompts: PromptBatch) -> RolloutBatch:
        """The step's groups, every process sampling while any is short (generation may be collective)."""
        batch = self._generate_and_score(prompts)
        if not self.rl.dynamic_sampling.enabled:
            return batch
        filler = GroupFiller(self.sizes.prompts_per_step, self.sizes.generations_per_prompt)
        filler.add(batch, self._rewards(batch))
        rounds = 0
        while rounds < self.rl.dynamic_sampling.max_rounds and self.loop.global_sum(
            torch.tensor(float(filler.missing > 0), device=self.loop.device)
        ):
            rounds += 1
            more = self._generate_and_score(self.more_prompts(), call=rounds)
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

    def _generate_and_score(self, prompts: PromptBatch, call: int = 0) -> RolloutBatch:
        """Sample generations_per_prompt completions per prompt, decode them, score them with every source.
        `call`: the generation round within the step (the engine's requests are seeded by it)."""
        loop, settings = self.loop, self.settings
        seed = rollout_seed(loop.run_cfg.seed, rank=loop.rank, step=loop.step, call=call)
        rows = [self.prompt_rows[i] for i in prompts.indices]
        with loop.full_parameters():
            if prompts.sampled is None:  # sampled ahead: the weights went to the generator already
                self.engine.sync(loop.unwrapped(), loop.step)  # once per step: a later round finds it done
            rollout = collect_rollout(
                loop.unwrapped(),
                self.ref_model,
                prompts.query_ids,
                prompts.query_mask,
                settings.sampling,
                pad_token_id=settings.pad_token_id,
                stop_token_ids=settings.stop_token_ids,
                need_reference=self.need_reference,
                need_logprobs=self.need_logprobs,
                prompt_repeats=self.sizes.generations_per_prompt,
                timer=self.timer,
                engine=self.engine,
                seed=seed,
                tools=replace(self.tools, rows=rows) if self.tools is not None else None,
                sampled=prompts.sampled,
            )
        if rollout.episodes is not None:
            completions = rollout.episodes.texts()
        else:
            completions = decode_responses(self.loop.tokenizer, rollout.responses, rollout.resp_mask)
        with self.timer("reward"):
            scores = score_sources(self.rewards, [r["prompt"] for r in rows], completions, rollout, rows, self.group)
        penalty = missing_stop_penalty(rollout, self.rl.missing_eos_penalty)
        return RolloutBatch(rollout, scores.to(loop.device), penalty, rows=rows, completions=completions)


class GRPOSteps:
    """The family's phases of one RL step (`rl_step`): the sampler's rollout, then update and metrics; the
    advantages are the estimator's, the loss `loss`'s. Each generation batch feeds grpo.num_iterations passes of
    sizes.mini_batches optimizer steps; `on_completions(rows, step)` receives the completions table; `ahead`, the
    batches sampled ahead (off_policy.py)."""

    def __init__(
        self,
        loop: TrainingLoop,
        sampler: GroupSampler,
        loss: PolicyLoss,
        rl: RLConfig,
        grpo: GRPOConfig,
        *,
        on_completions: Callable[[list[dict], int], None] | None = None,
        ahead: AheadBatches | None = None,
    ):
        self.loop, self.sampler, self.loss, self.rl, self.grpo = loop, sampler, loss, rl, grpo
        self.ahead = ahead
        self.on_completions, self.sizes = on_completions, sampler.sizes
        self.optimizer_steps = grpo.num_iterations * self.sizes.mini_batches  # per generation batch
        self.timer = PhaseTimer(loop.device)  # optimize
        self.correction_metrics: dict[str, torch.Tensor] = {}  # the engine correction's, of the latest update

    def rollout(self, prompts: PromptBatch) -> RolloutBatch:
        return self.sampler.sample(prompts)

    def estimator_context(self) -> EstimatorContext:
        return EstimatorContext(self.grpo, self.loop, self.sizes.generations_per_prompt, self.sampler.weights)

    def update(self, batch: RolloutBatch, estimate: Estimate) -> StepStats:
        """num_iterations x mini_batches optimizer steps over the generation batch, each accumulated over
        micro-batches; the reference mixed into after every ref_model_sync_steps optimizer steps."""
        loop, grpo, sizes, ref_model = self.loop, self.grpo, self.sizes, self.sampler.ref_model
        mask = batch.rollout.trained_mask(grpo.mask_truncated_completions)
        # dapo/cispo divide by the active tokens of the global optimizer batch (TRL: the generation batch's
        # tokens / steps per generation); the processes' gradients are averaged, hence / world
        total_tokens = float(loop.global_sum(mask.sum().float())) / loop.world / sizes.mini_batches
        weights = LossWeights(batch.rollout, mask, self.sampler.correction)
        stats = StepStats()
        loop.trainable.train()
        with self.timer("optimize"):
            for j in range(self.optimizer_steps):
                start = (j % sizes.mini_batches) * sizes.mini_batch
                step_loss = torch.zeros((), device=loop.device)
                for micro in range(start, start + sizes.mini_batch, sizes.micro_batch):
                    rows = slice(micro, min(micro + sizes.micro_batch, start + sizes.mini_batch))
                    step_loss = step_loss + self._micro_batch(batch, estimate, mask, rows, total_tokens, stats, weights)
                loop.optimizer_step()
                stats.add(loss=step_loss)  # the optimizer step's whole loss, not a micro-batch's share
                done = loop.step * self.optimizer_steps + j + 1  # optimizer steps so far (TRL's global_step)
                if grpo.sync_ref_model and ref_model is not None and done % grpo.ref_model_sync_steps == 0:
                    mix_into_reference(ref_model, loop.unwrapped(), grpo.ref_model_mixup_alpha)
        self.correction_metrics = weights.metrics()
        if self.ahead is not None:
            loop.state["policy_version"] = float(loop.step + 1)  # what a checkpoint after this step holds
        return stats

    def _micro_batch(
        self, batch, estimate, mask, rows: slice, total_tokens: float, stats: StepStats, weights: LossWeights
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
                    old_logp=rollout.logprobs[rows] if rollout.logprobs is not None else logp.detach(),
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
            **self.sampler.timer.pop(),
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
            **self.sampler.dynamic,
            **source_metrics(self.sampler.rewards),
            **self.correction_metrics,
            **(self.ahead.metrics if self.ahead is not None else {}),
            **{name: stats.mean(name) for name in self.loss.clip_metrics},
        }
        if "kl" in stats or "kl" in everyone:  # grpo's loss term, or the KL the others put into the reward
            metrics["kl"] = stats.mean("kl") if "kl" in stats else everyone["kl"]
        for i, source in enumerate(self.sampler.rewards):
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
        names = [source.name for source in self.sampler.rewards]
        self.on_completions(completions_table(step, batch, estimate, names), step)


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
    rollout: RolloutConfig | None = None,
    engine_url: str | None = None,
    template_kwargs: dict | None = None,
    **hooks: Unpack[RLHooks],
) -> LoopResult:
    """Train `policy` with the GRPO family's rl.algorithm for rl.total_steps generation batches; resume from
    output_dir.

    ref_model None with beta > 0 means a PEFT policy whose disabled adapters are the reference; with
    beta 0 no reference is used at all. `stop_token_ids`: what ends a response, when the caller computed it
    (else `run_stop_ids` of the policy). `rollout`: the engine that samples (rollout.engine; our loop when None),
    at `engine_url` for vllm (else rollout.vllm.url). With grpo.tools or grpo.environment every completion is a
    tool episode (`tool_rollout`), its template rendered with `template_kwargs` (data.chat_template_kwargs).
    `hooks` (`RLHooks`): on_log, on_checkpoint, on_eval with evaluate and eval_every, on_step, show_progress, and
    on_completions(rows, step), which receives every grpo.log_completions_steps the prompts, completions, each
    reward and the advantages.
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
    sampling = rollout_settings(tokenizer, policy, rl, stop_token_ids)
    rollout = rollout or RolloutConfig()
    tools = tool_rollout(grpo, tokenizer, policy, max_prompt_length, template_kwargs)
    if tools is not None:
        rewards = rewards + environment_rewards(tools.tool_use)
    engine = make_engine(rollout, engine_url, Path(output_dir) / "engine-weights", loop)
    sampler = GroupSampler(
        loop,
        sampling,
        ref_model,
        rewards,
        prompt_rows,
        rl,
        grpo,
        more_prompts=batches.next,
        engine=engine,
        correction=correction_settings(rollout),
        tools=tools,
    )
    ahead = ahead_batches(rollout, engine, batches, loop, prompt_rows, sampling, tools)
    loss = policy_loss_for(rl, grpo, mini_batch=sizes.mini_batch, gather=partial(gather_tokens, loop))
    steps = GRPOSteps(loop, sampler, loss, rl, grpo, on_completions=hooks.get("on_completions"), ahead=ahead)
    with closing(ahead) if ahead is not None else nullcontext():  # the queue goes first, however the loop ends
        return run_rl(loop, steps, estimator, ahead or batches, policy, hooks, eval_engine_of(engine, rollout))
