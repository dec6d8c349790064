"""GRPO: group-relative advantages, no value model, rewards from reward models and Python functions.

Pure helpers first (advantages with TRL 1.16's handling of unscorable completions and both
multi-objective aggregations, the per-token loss of every loss type, the normalizations, the
high-entropy token mask, the reference sync), then the step on the shared `TrainingLoop`. Loss
types follow their papers as TRL 1.16 implements them: grpo and sapo (mean over each sequence's
tokens, then over sequences), bnpo (mean over the micro-batch's tokens), dr_grpo (sum over tokens /
(sequences x max completion length)), dapo and cispo (sum over tokens / tokens of the whole
optimizer batch, every process's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from rlhf_core.chat import PROMPT_MESSAGES, assistant_messages, extra_columns
from rlhf_core.config import GRPOConfig, RLConfig, RunConfig
from rlhf_core.loop import LoopResult, OnCheckpoint, OnLog, OnStep, TrainingLoop
from rlhf_core.models import run_stop_ids
from rlhf_core.reward_functions import call_scoring_function, check_finite
from rlhf_core.rl_math import masked_mean
from rlhf_core.rollout import (
    PromptBatches,
    Rollout,
    collect_rollout,
    completion_metrics,
    decode_responses,
    response_logprobs,
    rl_loop_settings,
    rl_sampling,
    sequence_scores,
)
from rlhf_core.timing import PhaseTimer

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"]
STD_EPS = 1e-4  # TRL's: advantages are divided by std + 1e-4


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Unbiased std over the non-NaN entries; NaN where fewer than two entries are present (as TRL's nanstd)."""
    dims = dim if dim is not None else tuple(range(x.dim()))
    mean = torch.nanmean(x, dim=dims, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dims, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dims, keepdim=True)
    var = var * torch.where(count > 1, count / (count - 1), torch.full_like(var, float("nan")))
    std = var.sqrt()
    return std if keepdim else std.squeeze(dims) if dim is not None else std.reshape(())


@dataclass
class Advantages:
    advantages: torch.Tensor  # (B,) 0 for unscorable rows
    rewards: torch.Tensor  # (B,) the weighted sum of the sources (minus any penalty); NaN for unscorable rows
    std: torch.Tensor  # (B,) the std each row was (or, with scale none, would be) divided by
    unscorable: torch.Tensor  # (B,) bool: every source returned None


def grpo_advantages(
    per_source: torch.Tensor,
    weights: torch.Tensor,
    num_generations: int,
    *,
    scale_rewards: Literal["group", "batch", "none"] = "group",
    aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize",
    penalty: torch.Tensor | None = None,
) -> Advantages:
    """Group-relative advantages of a whole generation batch (every process's rows, group by group), as TRL 1.16.

    per_source (B, F): each source's reward, NaN where it returned None. A row with no reward at all
    is unscorable: NaN, left out of every (nan-aware) mean and std, advantage 0.
    sum_then_normalize: r = sum_k w_k r_k (minus `penalty` (B,), e.g. the missing-stop penalty);
    A = (r - group mean) / (group std, batch std, or 1 with scale none; + 1e-4).
    normalize_then_sum: each source normalized in its group first, r = sum_k w_k z_k, then
    A = (r - batch mean) / (batch std + 1e-4); scale_rewards plays no part.
    """
    G = num_generations
    unscorable = torch.isnan(per_source).all(dim=1)
    w = weights.to(per_source).view(1, -1)
    if aggregation == "sum_then_normalize":
        rewards = torch.nansum(per_source * w, dim=1)
        if penalty is not None:
            rewards = rewards - penalty.to(rewards)
        rewards = rewards.masked_fill(unscorable, float("nan"))
        mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G)
        if scale_rewards == "batch":
            std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        else:
            std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G)
        advantages = rewards - mean
        if scale_rewards != "none":
            advantages = advantages / (std + STD_EPS)
    else:
        if penalty is not None:
            raise ValueError("a missing-stop penalty needs aggregation 'sum_then_normalize'")
        grouped = per_source.view(-1, G, per_source.shape[1])
        z = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (nanstd(grouped, dim=1, keepdim=True) + STD_EPS)
        summed = torch.nansum(z.view(-1, per_source.shape[1]) * w, dim=1).masked_fill(unscorable, float("nan"))
        std = nanstd(summed).expand_as(summed) if summed.numel() > 1 else torch.zeros_like(summed)
        advantages = (summed - torch.nanmean(summed)) / (std + STD_EPS)
        # what is logged (and tabled) as the reward is the plain weighted sum, as TRL logs it
        rewards = torch.nansum(per_source * w, dim=1).masked_fill(unscorable, float("nan"))
    return Advantages(torch.nan_to_num(advantages, nan=0.0), rewards, std, unscorable)


def grpo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    grpo: GRPOConfig,
    *,
    ref_logp: torch.Tensor | None = None,
    entropy_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss (B, T) (or (B, 1) at sequence level with nothing per-token added) and statistics.

    ratio r = exp(logp - old_logp) per token, or per sequence exp(mean over its tokens) with
    importance_sampling_level 'sequence' (GSPO). By loss type:
      clipped (grpo, bnpo, dr_grpo, dapo): -min(r' A, clip(r, 1-eps, 1+eps_high) A), r' = min(r, delta) when set;
      cispo: -sg(min(r, eps_high)) A logp;   sapo: -(4 / tau) sigmoid(tau (r - 1)) A, tau by the sign of A.
    `entropy_mask` (top_entropy_quantile) multiplies the policy term; then + beta * k3 KL to the
    reference, times r when use_bias_correction_kl (TRL 1.16's default).
    """
    eps_low, eps_high = grpo.epsilon, grpo.epsilon_high or grpo.epsilon
    log_ratio = logp - old_logp
    if grpo.importance_sampling_level == "sequence":
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # (B, 1)
    else:
        log_weights = log_ratio  # (B, T)
    ratio = torch.exp(log_weights)
    adv = advantages.unsqueeze(1)  # (B, 1)
    if grpo.loss_type == "cispo":
        per_token = -torch.clamp(ratio, max=eps_high).detach() * adv * logp
    elif grpo.loss_type == "sapo":
        tau = torch.where(adv > 0, grpo.sapo_temperature_pos, grpo.sapo_temperature_neg)
        per_token = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv
    else:
        clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
        if grpo.delta is not None:
            ratio = torch.clamp(ratio, max=grpo.delta)
        per_token = -torch.min(ratio * adv, clipped * adv)
    if grpo.loss_type == "cispo":
        stats = {"cispo_clipped": ((ratio > eps_high) & (adv > 0)).float()}
    else:
        stats = {
            "low_clipped": ((ratio < 1 - eps_low) & (adv < 0)).float(),
            "high_clipped": ((ratio > 1 + eps_high) & (adv > 0)).float(),
        }
    if entropy_mask is not None:
        per_token = per_token * entropy_mask
    if grpo.beta and ref_logp is not None:
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1  # k3
        if grpo.use_bias_correction_kl:
            kl = kl * torch.exp(log_weights)
        per_token = per_token + grpo.beta * kl
        stats["kl"] = kl
    return per_token, stats


def reduce_loss(
    per_token: torch.Tensor, mask: torch.Tensor, loss_type: LossType, *, max_completion_length: int, total_tokens: float
) -> torch.Tensor:
    """Normalize a micro-batch's per-token loss the way `loss_type` says (see the module docstring).

    `total_tokens` is the number of completion tokens in the whole optimizer batch (dapo, cispo).
    """
    mask = mask.to(per_token.dtype)
    if loss_type in ("grpo", "sapo"):
        return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.shape[0] * max_completion_length)
    return (per_token * mask).sum() / (total_tokens if total_tokens > 0 else 1.0)


def high_entropy_mask(
    entropies: torch.Tensor,
    mask: torch.Tensor,
    top_quantile: float,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """True on the real tokens whose entropy is at or above the (1 - top_quantile) quantile of all real
    tokens' entropies (every process's, through `gather`, which takes and returns a 1-D tensor). (B, T) bool"""
    local = entropies[mask.bool()].float()
    pooled = gather(local) if gather is not None else local
    if pooled.numel() == 0:
        return torch.zeros_like(mask, dtype=torch.bool)
    threshold = torch.quantile(pooled, 1 - top_quantile)
    return ((entropies * mask) >= threshold) & mask.bool()


def stat_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of a per-token statistic over real tokens; a per-sequence one (B, 1) over sequences (as TRL)."""
    return x.mean() if x.shape[1] == 1 else masked_mean(x, mask)


@torch.no_grad()
def mix_into_reference(ref_model: torch.nn.Module, policy: torch.nn.Module, alpha: float) -> None:
    """ref = alpha * policy + (1 - alpha) * ref, parameter by parameter (TR-DPO's soft update, TRL's sync_ref_model)."""
    current = dict(policy.named_parameters())
    for name, ref_param in ref_model.named_parameters():
        ref_param.mul_(1.0 - alpha).add_(current[name].detach().to(ref_param.dtype), alpha=alpha)


@dataclass
class RewardSourceFn:
    """One reward source: `score(prompts, completions, rollout, rows)` -> one float or None per completion."""

    name: str
    weight: float
    score: Callable[[list[str], list[str], Rollout, list[dict]], list[float | None]]


def model_reward(name: str, weight: float, reward_model) -> RewardSourceFn:
    """A reward model read at the last real token of each prompt+completion."""

    def score(prompts, completions, rollout: Rollout, rows):
        reward_model.to(rollout.query_ids.device)  # a no-op once it is there
        with torch.no_grad():
            values = sequence_scores(
                reward_model,
                rollout.query_ids,
                rollout.query_mask,
                rollout.responses,
                rollout.resp_mask,
                rollout.last_index,
            )
        return values.tolist()

    return RewardSourceFn(name, weight, score)


def function_reward(name: str, weight: float, fn) -> RewardSourceFn:
    """A Python function called as fn(prompts=, completions=, **dataset_columns), checked for shape and type.

    For conversational prompts (rows with `prompt_messages`) it receives, as TRL hands them, the prompts as
    message lists and each completion as [{"role": "assistant", "content": text}]."""

    def score(prompts, completions, rollout, rows):
        columns = extra_columns(rows)
        if rows and PROMPT_MESSAGES in rows[0]:
            prompts, completions = [row[PROMPT_MESSAGES] for row in rows], assistant_messages(completions)
        return call_scoring_function(name, fn, prompts=prompts, completions=completions, **columns)

    return RewardSourceFn(name, weight, score)


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
    on_log: OnLog | None = None,
    on_checkpoint: OnCheckpoint | None = None,
    on_eval: Callable[[list[dict], int], None] | None = None,
    on_step: OnStep | None = None,
    evaluate: Callable[[torch.nn.Module, int], list[dict]] | None = None,
    eval_every: int | None = None,
    on_completions: Callable[[list[dict], int], None] | None = None,
    show_progress: bool = True,
) -> LoopResult:
    """Train `policy` with GRPO for rl.total_steps generation batches; resume from output_dir.

    ref_model None with beta > 0 means a PEFT policy whose disabled adapters are the reference; with
    beta 0 no reference is used at all. Each generation batch of rl.batch_size completions feeds
    grpo.num_iterations x (steps_per_generation / gradient_accumulation_steps) optimizer steps.
    `on_completions(rows, step)` receives every grpo.log_completions_steps the prompts, completions,
    each reward and the advantages.
    """
    G = grpo.num_generations
    ga = rl.gradient_accumulation_steps
    # rl.batch_size completions per generation batch, split into steps_per_generation micro-batches (TRL's
    # name), ga of them per optimizer step
    micro_per_generation = grpo.steps_per_generation or ga
    steps_per_gen = max(1, micro_per_generation // ga)  # optimizer steps per generation batch
    step_batch = rl.batch_size // steps_per_gen  # completions per optimizer step
    micro = max(1, rl.batch_size // micro_per_generation)
    models = {"policy": policy}
    if grpo.sync_ref_model and ref_model is not None:
        models["ref"] = ref_model  # it changes during training: saved and restored with the policy
    settings = rl_loop_settings(
        rl,
        run,
        name="grpo",
        micro_batches=-(-step_batch // micro),
        micro_batch_size=micro,
        eval_every=eval_every if on_eval is not None else None,
    )
    loop = TrainingLoop(policy, models, tokenizer, settings, run, output_dir=output_dir)
    batches = PromptBatches(
        tokenizer,
        [r["prompt"] for r in prompt_rows],
        max_prompt_length=max_prompt_length,
        per_step=rl.batch_size // G,
        seed=run.seed,
        loop=loop,
        repeat=G,
    )
    if ref_model is not None:
        ref_model.to(loop.device).eval().requires_grad_(False)
    pad_id = tokenizer.pad_token_id
    stop_ids = run_stop_ids(tokenizer, getattr(policy, "generation_config", None), rl)
    sampling = rl_sampling(rl)
    weights = torch.tensor([s.weight for s in rewards], dtype=torch.float32)
    world, rank = loop.world, loop.rank
    per_iteration = grpo.num_iterations * steps_per_gen

    def gather_tokens(local: torch.Tensor) -> torch.Tensor:
        if world == 1:
            return local
        padded = loop.accelerator.pad_across_processes(local, dim=0, pad_index=-1e9)
        pooled = loop.accelerator.gather(padded)
        return pooled[pooled != -1e9]

    timer = PhaseTimer(loop.device)

    def step(batch: tuple[torch.Tensor, torch.Tensor, list[int]]) -> dict[str, torch.Tensor]:
        query_ids, query_mask, indices = batch
        # 1. sample G completions per prompt
        model = loop.unwrapped()
        with loop.full_parameters():
            rollout = collect_rollout(
                model,
                ref_model,
                query_ids,
                query_mask,
                sampling,
                pad_token_id=pad_id,
                stop_token_ids=stop_ids,
                need_reference=grpo.beta > 0,
                need_logprobs=per_iteration > 1,
                prompt_repeats=G,
                timer=timer,
            )
        rows = [prompt_rows[i] for i in indices]
        prompts = [r["prompt"] for r in rows]
        completions = decode_responses(tokenizer, rollout.responses, rollout.resp_mask)

        # 2. rewards from every source, NaN where a source returned None; a NaN or inf stops the step
        scored = []
        with timer("reward"):
            for source in rewards:
                values = source.score(prompts, completions, rollout, rows)
                check_finite(f"reward {source.name}", values)
                scored.append([float("nan") if v is None else v for v in values])
        per_source = torch.tensor(scored, dtype=torch.float32).T.to(loop.device)  # (B, F)
        penalty = None
        if rl.missing_eos_penalty is not None:
            penalty = rl.missing_eos_penalty * (~rollout.has_stop).float()
        # 3. advantages over every process's groups (batch statistics are global), this process's slice kept
        everyone = grpo_advantages(
            loop.gather(per_source),
            weights,
            G,
            scale_rewards=grpo.scale_rewards,
            aggregation=grpo.multi_objective_aggregation,
            penalty=loop.gather(penalty) if penalty is not None else None,
        )
        n = per_source.shape[0]
        advantages = everyone.advantages[rank * n : (rank + 1) * n]

        # 4. num_iterations x steps_per_gen optimizer steps, each accumulated over micro-batches
        mask = rollout.resp_mask
        if grpo.mask_truncated_completions:
            mask = mask * rollout.has_stop.unsqueeze(1).long()
        # dapo/cispo divide by the active tokens of the global optimizer batch (TRL: the generation batch's
        # tokens / steps per generation); the processes' gradients are averaged, hence / world
        total_tokens = float(loop.global_sum(mask.sum().float())) / world / steps_per_gen
        stats: dict[str, list[torch.Tensor]] = {
            k: [] for k in ("loss", "low", "high", "region", "cispo", "kl", "entropy")
        }
        policy.train()
        with timer("optimize"):
            for j in range(per_iteration):
                base = (j % steps_per_gen) * step_batch
                step_loss = torch.zeros((), device=loop.device)
                for start in range(base, base + step_batch, micro):
                    idx = slice(start, min(start + micro, base + step_batch))
                    m = mask[idx]
                    with loop.micro_batch():
                        logp, entropy = response_logprobs(
                            loop.trainable,
                            rollout.query_ids[idx],
                            rollout.query_mask[idx],
                            rollout.responses[idx],
                            rollout.resp_mask[idx],
                            rl.temperature,
                            with_entropy=True,
                        )
                        old_logp = rollout.logprobs[idx] if rollout.logprobs is not None else logp.detach()
                        entropy_mask = None
                        if grpo.top_entropy_quantile < 1.0:
                            entropy_mask = high_entropy_mask(entropy, m, grpo.top_entropy_quantile, gather_tokens)
                        per_token, tstats = grpo_token_loss(
                            logp,
                            old_logp,
                            advantages[idx],
                            m,
                            grpo,
                            entropy_mask=entropy_mask,
                            ref_logp=rollout.ref_logprobs[idx] if rollout.ref_logprobs is not None else None,
                        )
                        loss = reduce_loss(
                            per_token,
                            m,
                            grpo.loss_type,
                            max_completion_length=rl.response_length,
                            total_tokens=total_tokens,
                        )
                        if grpo.loss_type not in ("dapo", "cispo"):
                            loss = loss * (m.shape[0] / step_batch)  # mean over micro-batches
                        loop.backward(loss)
                    step_loss = step_loss + loss.detach()
                    if "cispo_clipped" in tstats:
                        stats["cispo"].append(stat_mean(tstats["cispo_clipped"], m))
                    else:
                        stats["low"].append(stat_mean(tstats["low_clipped"], m))
                        stats["high"].append(stat_mean(tstats["high_clipped"], m))
                        stats["region"].append(
                            stat_mean(torch.maximum(tstats["low_clipped"], tstats["high_clipped"]), m)
                        )
                    stats["entropy"].append(masked_mean(entropy.detach(), m))
                    if "kl" in tstats:
                        stats["kl"].append(masked_mean(tstats["kl"].detach(), m))
                loop.optimizer_step()
                stats["loss"].append(step_loss)  # the optimizer step's whole loss, not a micro-batch's share
                done = loop.step * per_iteration + j + 1  # optimizer steps so far (TRL's global_step)
                if grpo.sync_ref_model and ref_model is not None and done % grpo.ref_model_sync_steps == 0:
                    mix_into_reference(ref_model, loop.unwrapped(), grpo.ref_model_mixup_alpha)

        step = loop.step + 1
        if (
            on_completions is not None
            and loop.accelerator.is_main_process
            and (step % grpo.log_completions_steps == 0 or step == rl.total_steps)
        ):
            mine = everyone.rewards[rank * n : (rank + 1) * n]
            table = [
                {
                    "step": step,
                    "prompt": p,
                    "completion": c,
                    "advantage": float(a),
                    "reward": None if torch.isnan(t) else float(t),
                    **{s.name: (None if torch.isnan(v) else float(v)) for s, v in zip(rewards, per_source[i])},
                }
                for i, (p, c, a, t) in enumerate(zip(prompts, completions, advantages.tolist(), mine))
            ]
            on_completions(table, step)

        def avg(key: str) -> torch.Tensor | float:
            return torch.stack(stats[key]).float().mean() if stats[key] else float("nan")

        # reward statistics come from every process's rows already: the loop's averaging leaves them as they are
        everyone_sources = loop.gather(per_source)
        metrics = {
            **timer.pop(),
            "reward": torch.nanmean(everyone.rewards),
            "reward_std": nanstd(everyone.rewards),
            "frac_reward_zero_std": torch.isclose(everyone.std, torch.zeros_like(everyone.std)).float().mean(),
            "rewards/num_unscorable": everyone.unscorable.float().sum(),
            **completion_metrics(rollout),
            "entropy": avg("entropy"),
            "loss": avg("loss"),
            "_tokens": rollout.resp_mask.sum(),
        }
        if grpo.loss_type == "cispo":
            metrics["cispo_clip_ratio"] = avg("cispo")
        else:
            metrics.update(
                {
                    "clip_ratio/low_mean": avg("low"),
                    "clip_ratio/high_mean": avg("high"),
                    "clip_ratio/region_mean": avg("region"),
                }
            )
        if stats["kl"]:
            metrics["kl"] = avg("kl")
        for i, source in enumerate(rewards):
            column = everyone_sources[:, i]
            metrics[f"rewards/{source.name}/mean"] = torch.nanmean(column)
            metrics[f"rewards/{source.name}/std"] = nanstd(column)
        return metrics

    return loop.run(
        step,
        batches,
        on_log=on_log,
        evaluate=(lambda at: evaluate(policy, at)) if evaluate else None,
        on_eval=on_eval,
        on_checkpoint=on_checkpoint,
        on_step=on_step,
        show_progress=show_progress,
    )
