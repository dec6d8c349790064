"""Online DPO (rl.algorithm online_dpo), TRL's `OnlineDPOTrainer` (trl.experimental.online_dpo, TRL 1.16): each
step samples two completions per prompt from the current policy on the rollout engine (our loop or vLLM), scores
both with every grpo.rewards source (reward models, functions, served judges and scorers: the GRPO family's
`GroupScorer`), minus rl.missing_eos_penalty for a completion that never stopped, and trains the DPO loss of
`dpo_losses.py` on the pair: the higher reward chosen, the first on a tie (TRL's `first_half >= second_half`);
an unscored completion counts 0 before the penalty (TRL's nansum). `objective/kl` sums the log-ratio over each
completion's tokens (TRL's online trainer sums the padding after eos too). TRL's online trainer offers the sigmoid loss and an IPO without
the per-token normalisation; here every dpo.loss_type of the offline family applies, IPO normalised as TRL's
DPOTrainer does. Log-probabilities are taken at temperature 1, as TRL's. The reference is the copy (or the policy
with its adapters disabled), unless dpo.reference_free; TR-DPO's sync applies as offline.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from rlhf_core.rl.dpo import PairBatch, PairUpdate, frozen_reference, saved_models, scaled_dpo
from rlhf_core.rl.grpo import GroupScorer, grpo_batch_sizes
from rlhf_core.rl.inputs import RLInputs
from rlhf_core.rl.samplers import StepSampler, sampler_for
from rlhf_core.rl.step import (
    PromptBatch,
    PromptBatches,
    eval_engine_of,
    loop_callbacks,
    rl_loop_settings,
    sampling_spec,
)
from rlhf_core.rollout.collect import Passes, RolloutBatch
from rlhf_core.rollout.engines import make_engine
from rlhf_core.training.loop import LoopResult, TrainingLoop


def pair_order(rewards: torch.Tensor) -> torch.Tensor:
    """The rows [chosen of each pair, then rejected of each pair] of completions sampled in pairs (rows 2k and
    2k + 1 answer the same prompt): the higher reward chosen, the first on a tie; NaN counts 0. (2P,)"""
    first, second = torch.nan_to_num(rewards, nan=0.0).view(-1, 2).unbind(1)
    pairs = torch.arange(first.shape[0], device=rewards.device) * 2
    first_wins = first >= second
    chosen = torch.where(first_wins, pairs, pairs + 1)
    return torch.cat([chosen, torch.where(first_wins, pairs + 1, pairs)])


def online_rewards(scorer: GroupScorer, batch: RolloutBatch) -> torch.Tensor:
    """Each completion's weighted reward, an unscored one 0 (TRL's nansum), minus rl.missing_eos_penalty where it
    never stopped: TRL's order, so an unscored completion that never stopped counts -penalty. (B,)"""
    rewards = torch.nan_to_num(scorer.rewards_of(replace(batch, penalty=None)), nan=0.0)
    return rewards if batch.penalty is None else rewards - batch.penalty.to(rewards)


class OnlineDPOStep:
    """The loop's step: sample the prompts' pairs, score and order them, then `PairUpdate`'s DPO loss over
    rl.gradient_accumulation_steps micro-batches of pairs and its finish; returns TRL's metrics."""

    def __init__(self, update: PairUpdate, sampler, scorer: GroupScorer, micro_batches: int):
        self.update, self.sampler, self.scorer, self.micro_batches = update, sampler, scorer, micro_batches

    def __call__(self, prompts: PromptBatch) -> dict[str, torch.Tensor | float]:
        batch = self.scorer.score(prompts, self.sampler.sample(prompts))
        rewards = online_rewards(self.scorer, batch)
        order = pair_order(rewards)
        metrics = self.update.finish(self.micro_steps(batch, order))
        pairs = order.shape[0] // 2
        chosen, rejected = rewards[order[:pairs]], rewards[order[pairs:]]
        return {
            **metrics,
            "objective/scores": rewards.mean(),
            "objective/scores_margin": (chosen - rejected).mean(),
            "val/contain_eos_token": batch.rollout.has_stop.float().mean(),
            **self.scorer.timer.pop(),
        }

    def micro_steps(self, batch: RolloutBatch, order: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """Each micro-batch of pairs (rows of `batch` in `order`) through `PairUpdate.micro_batch`, with
        `objective/kl` beside its statistics: the mean summed log-ratio to the reference over both rows (none under
        reference_free)."""
        rollout, stats, spec = batch.rollout, [], self.update.spec
        pairs = order.shape[0] // 2
        for part in torch.arange(pairs).chunk(self.micro_batches):
            rows = torch.cat([order[part], order[part + pairs]])
            pair_batch = PairBatch(
                *(t[rows] for t in (rollout.query_ids, rollout.query_mask, rollout.responses)), rollout.resp_mask[rows]
            )
            stats.append(self.update.micro_batch(pair_batch, part.tolist(), self.micro_batches))
            if not spec.reference_free:
                stats[-1]["objective/kl"] = (stats[-1]["rewards/chosen"] + stats[-1]["rewards/rejected"]) / (
                    2 * spec.beta
                )
        return stats


def train_online_dpo(inputs: RLInputs) -> LoopResult:
    """Train inputs.models.policy with online DPO for rl.total_steps steps of rl.batch_size / 2 prompts (two
    completions each) from inputs.prompts, ranked by inputs.models.rewards; resume from inputs.output_dir."""
    models, settings, hooks, out = inputs.models, inputs.settings, inputs.hooks, Path(inputs.output_dir)
    rl, run, rollout, tokenizer, policy = settings.rl, settings.run, settings.rollout, models.tokenizer, models.policy
    dpo = scaled_dpo(settings)
    # the GRPO family's batches and scoring with groups of two: one generation batch, one optimizer step
    two = {"num_generations": 2, "generation_batch_size": None, "steps_per_generation": None, "num_iterations": 1}
    pairs = settings.grpo.model_copy(update=two)
    sizes = grpo_batch_sizes(rl, pairs)
    saved = saved_models(policy, models.reference, dpo)
    loop_settings = rl_loop_settings(rl, run, sizes, eval_every=hooks.eval_cadence)
    loop = TrainingLoop(policy, saved, tokenizer, loop_settings, run, output_dir=out)
    rows = inputs.prompts.rows
    prompts, length = [r["prompt"] for r in rows], inputs.prompts.max_prompt_length
    batches = PromptBatches(tokenizer, prompts, sizes, max_prompt_length=length, seed=run.seed, loop=loop)
    scorer = GroupScorer(loop, models, rows, rl, pairs, Passes(policy=False, reference=False))
    spec = sampling_spec(tokenizer, policy, settings, 2)
    engine = make_engine(rollout, out / "engine-weights", loop)
    step_sampler = StepSampler(loop, engine, spec, rows, loop.unwrapped, scorer.timer)
    sampler, loop_batches = sampler_for(rollout, step_sampler, batches)
    update = PairUpdate(loop, frozen_reference(models, dpo, loop), dpo)
    step = OnlineDPOStep(update, sampler, scorer, rl.gradient_accumulation_steps)
    callbacks = loop_callbacks(hooks, loop, policy, eval_engine_of(engine, rollout))
    return loop.run(step, loop_batches, callbacks, show_progress=hooks.show_progress)
