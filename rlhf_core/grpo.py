"""GRPO: group-relative advantages, no value model, rewards from reward models and Python functions.

Pure helpers first (reward combination, group advantages, the per-token loss and its four
normalizations), then the training loop on the shared `RLLoop`. Loss types follow their papers as
TRL implements them: grpo (mean over each sequence's tokens, then over sequences), bnpo (mean over
the batch's tokens), dr_grpo (sum over tokens / (sequences x max completion length)) and dapo (sum
over tokens / tokens in the whole optimizer batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import torch

from rlhf_core.config import GRPOConfig, RLConfig, RunConfig
from rlhf_core.parallel import reduce_metrics
from rlhf_core.ppo_math import kl_per_token, masked_mean
from rlhf_core.rewards import call_scoring_function
from rlhf_core.rl_loop import Evaluate, OnEval, RLLoop, RLResult
from rlhf_core.rollout import Rollout, collect_rollout, response_logprobs, sequence_scores
from rlhf_core.training import OnCheckpoint, OnLog, OnStep

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]


def combine_rewards(per_source: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum over reward sources, (B, F) -> (B,); NaN ("not applicable") entries are left out."""
    return torch.nansum(per_source * weights.view(1, -1), dim=1)


def group_advantages(rewards: torch.Tensor, num_generations: int, scale: Literal["group", "batch", "none"]) -> tuple[torch.Tensor, torch.Tensor]:
    """A_i = r_i - mean(group of i), divided by the group's std, the batch's std, or nothing.

    rewards (B,) ordered group by group. Returns (advantages (B,), per-group std (B/G,)).
    """
    grouped = rewards.view(-1, num_generations)  # (B/G, G)
    mean = grouped.mean(1).repeat_interleave(num_generations)
    group_std = grouped.std(1)
    advantages = rewards - mean
    if scale == "group":
        advantages = advantages / (group_std.repeat_interleave(num_generations) + 1e-4)
    elif scale == "batch":
        advantages = advantages / (rewards.std() + 1e-4)
    return advantages, group_std


def grpo_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, *, epsilon_low: float,
                    epsilon_high: float, beta: float = 0.0, ref_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Per-token clipped surrogate -min(r A, clip(r, 1-eps_low, 1+eps_high) A) (+ beta * k3 KL). (B, T)"""
    ratio = torch.exp(logp - old_logp)
    adv = advantages.unsqueeze(1)  # (B, 1)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    loss = -torch.min(ratio * adv, clipped * adv)
    stats = {
        "low_clipped": ((ratio < 1 - epsilon_low) & (adv < 0)).float(),
        "high_clipped": ((ratio > 1 + epsilon_high) & (adv > 0)).float(),
    }
    if beta and ref_logp is not None:
        kl = kl_per_token(logp, ref_logp, "k3")
        loss = loss + beta * kl
        stats["kl"] = kl
    return loss, stats


def reduce_loss(per_token: torch.Tensor, mask: torch.Tensor, loss_type: LossType, *, max_completion_length: int,
                total_tokens: float) -> torch.Tensor:
    """Normalize a micro-batch's per-token loss the way `loss_type` says (see the module docstring).

    `total_tokens` is the number of completion tokens in the whole optimizer batch (used by dapo).
    """
    mask = mask.to(per_token.dtype)
    if loss_type == "grpo":
        return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.shape[0] * max_completion_length)
    return (per_token * mask).sum() / (total_tokens if total_tokens > 0 else 1.0)


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
            values = sequence_scores(reward_model, rollout.query_ids, rollout.query_mask, rollout.responses,
                                     rollout.resp_mask, rollout.last_index)
        return values.tolist()

    return RewardSourceFn(name, weight, score)


def function_reward(name: str, weight: float, fn) -> RewardSourceFn:
    """A Python function called as fn(prompts=, completions=, **dataset_columns), checked for shape and type."""
    def score(prompts, completions, rollout, rows):
        columns = {k: [row[k] for row in rows] for k in (rows[0] if rows else {}) if k != "prompt"}
        return call_scoring_function(name, fn, prompts=prompts, completions=completions, **columns)

    return RewardSourceFn(name, weight, score)


def train_grpo(policy, ref_model, rewards: list[RewardSourceFn], tokenizer, prompt_rows: list[dict], rl: RLConfig,
               grpo: GRPOConfig, run: RunConfig, *, max_prompt_length: int, output_dir: str | Path,
               on_log: OnLog | None = None, on_checkpoint: OnCheckpoint | None = None, on_eval: OnEval | None = None,
              on_step: OnStep | None = None,
               evaluate: Evaluate | None = None, eval_every: int | None = None,
               on_completions: Callable[[list[dict], int], None] | None = None, show_progress: bool = True) -> RLResult:
    """Train `policy` with GRPO for rl.total_steps generation batches; resume from output_dir.

    ref_model None with beta > 0 means a PEFT policy whose disabled adapters are the reference; with
    beta 0 no reference is used at all. `on_completions(rows, step)` receives every
    grpo.log_completions_steps the prompts, completions, each reward and the advantages.
    """
    G = grpo.num_generations
    micro = max(1, rl.batch_size // rl.gradient_accumulation_steps)
    loop = RLLoop(policy, {"policy": policy}, tokenizer, [r["prompt"] for r in prompt_rows], rl, run,
                  output_dir=output_dir, max_prompt_length=max_prompt_length, prompts_per_step=rl.batch_size // G,
                  name="grpo", micro_batches=-(-rl.batch_size // micro), micro_batch_size=micro)
    if ref_model is not None:
        ref_model.to(loop.device).eval().requires_grad_(False)
    pad_id, stop_id, settings = loop.pad_id, loop.stop_id, loop.sampling
    weights = torch.tensor([s.weight for s in rewards], dtype=torch.float32)
    eps_low, eps_high = grpo.epsilon, grpo.epsilon_high or grpo.epsilon
    world = loop.accelerator.num_processes

    def iteration(query_ids: torch.Tensor, query_mask: torch.Tensor, indices: list[int]) -> dict[str, float]:
        # 1. sample G completions per prompt
        model = loop.unwrapped()
        with loop.full_parameters():
            rollout = collect_rollout(model, ref_model, query_ids, query_mask, settings, pad_token_id=pad_id,
                                      stop_token_id=stop_id, need_reference=grpo.beta > 0,
                                      need_logprobs=grpo.num_iterations > 1, prompt_repeats=G)
        rows = [prompt_rows[i] for i in indices]
        prompts = [r["prompt"] for r in rows]
        completions = tokenizer.batch_decode(rollout.responses, skip_special_tokens=True)

        # 2. rewards from every source, NaN where a source returned None
        per_source = torch.tensor([[float("nan") if v is None else v for v in s.score(prompts, completions, rollout, rows)]
                                   for s in rewards], dtype=torch.float32).T  # (B, F)
        total = combine_rewards(per_source, weights)
        advantages, group_std = group_advantages(total, G, grpo.scale_rewards)
        advantages = advantages.to(loop.device)

        # 3. num_iterations optimizer steps on this batch, each accumulated over micro-batches
        mask = rollout.resp_mask
        if grpo.mask_truncated_completions:
            mask = mask * rollout.has_stop.unsqueeze(1).long()
        # dapo normalizes by the active tokens of the global batch: every process's count, and the
        # processes' gradients are averaged, hence the factor world
        total_tokens = reduce_metrics(loop.accelerator, {"tokens": mask.sum()}, sums=("tokens",))["tokens"] / world
        stats: dict[str, list[torch.Tensor]] = {k: [] for k in ("loss", "low", "high", "region", "kl", "entropy")}
        policy.train()
        for _ in range(grpo.num_iterations):
            for start in range(0, rl.batch_size, micro):
                idx = slice(start, start + micro)
                m = mask[idx]
                with loop.micro_batch():
                    logp, entropy = response_logprobs(loop.trainable, rollout.query_ids[idx], rollout.query_mask[idx],
                                                      rollout.responses[idx], rollout.resp_mask[idx], rl.temperature,
                                                      with_entropy=True)
                    old_logp = rollout.logprobs[idx] if rollout.logprobs is not None else logp.detach()
                    per_token, tstats = grpo_token_loss(
                        logp, old_logp, advantages[idx], epsilon_low=eps_low, epsilon_high=eps_high,
                        beta=grpo.beta, ref_logp=rollout.ref_logprobs[idx] if rollout.ref_logprobs is not None else None)
                    loss = reduce_loss(per_token, m, grpo.loss_type, max_completion_length=rl.response_length,
                                       total_tokens=total_tokens)
                    if grpo.loss_type != "dapo":
                        loss = loss * (m.shape[0] / rl.batch_size)  # mean over micro-batches
                    loop.backward(loss)
                stats["loss"].append(loss.detach())
                stats["low"].append(masked_mean(tstats["low_clipped"], m))
                stats["high"].append(masked_mean(tstats["high_clipped"], m))
                stats["region"].append(masked_mean(tstats["low_clipped"] + tstats["high_clipped"], m))
                stats["entropy"].append(masked_mean(entropy.detach(), m))
                if "kl" in tstats:
                    stats["kl"].append(masked_mean(tstats["kl"].detach(), m))
            loop.optimizer_step()

        step = loop.step + 1
        if on_completions is not None and loop.accelerator.is_main_process and (
                step % grpo.log_completions_steps == 0 or step == rl.total_steps):
            table = [{"step": step, "prompt": p, "completion": c, "advantage": float(a), "reward": float(t),
                      **{s.name: (None if torch.isnan(v) else float(v)) for s, v in zip(rewards, per_source[i])}}
                     for i, (p, c, a, t) in enumerate(zip(prompts, completions, advantages.tolist(), total.tolist()))]
            on_completions(table, step)

        def avg(key: str) -> torch.Tensor | float:
            return torch.stack(stats[key]).float().mean() if stats[key] else float("nan")

        lengths = rollout.resp_mask.sum(1).float()
        metrics = {
            "reward": total.mean(),
            "reward_std": total.std(),
            "frac_reward_zero_std": (group_std < 1e-6).float().mean(),
            "completions/mean_length": lengths.mean(),
            "completions/min_length": lengths.min(),
            "completions/max_length": lengths.max(),
            "completions/clipped_ratio": (~rollout.has_stop).float().mean(),
            "entropy": avg("entropy"),
            "clip_ratio/low_mean": avg("low"),
            "clip_ratio/high_mean": avg("high"),
            "clip_ratio/region_mean": avg("region"),
            "loss": avg("loss"),
            "_tokens": rollout.resp_mask.sum(),
        }
        if stats["kl"]:
            metrics["kl"] = avg("kl")
        for i, source in enumerate(rewards):
            column = per_source[:, i]
            present = column[~torch.isnan(column)]
            metrics[f"rewards/{source.name}/mean"] = present.mean().item() if len(present) else float("nan")
            metrics[f"rewards/{source.name}/std"] = present.std().item() if len(present) > 1 else float("nan")
        return metrics

    return loop.run(iteration, on_log=on_log, on_checkpoint=on_checkpoint, on_eval=on_eval, evaluate=evaluate,
                    on_step=on_step, eval_every=eval_every, repeat=G, show_progress=show_progress)
