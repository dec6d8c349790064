"""PPO with a learned reward model and a value model, resumable from any checkpoint.

PPO's math first (KL-penalized rewards, GAE, the clipped losses, KL controllers), then its step on
the shared `TrainingLoop`, in the numbered steps of the CleanRL/TRL recipe: 1. generate, 2. score,
3. KL-penalized per-token rewards, 4. GAE, 5. PPO epochs over mini-batches. A checkpoint holds the
policy (`policy/`, Hugging Face format), the value model (`value/`) and the training state
(`training_state/`, no pickle).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from rlhf_core.config import PPOConfig, RLConfig, RunConfig
from rlhf_core.loop import LoopResult, OnCheckpoint, OnLog, OnStep, TrainingLoop
from rlhf_core.models import run_stop_ids
from rlhf_core.parallel import reduce_metrics
from rlhf_core.reward_functions import check_finite
from rlhf_core.rl_math import kl_per_token, masked_mean, masked_whiten
from rlhf_core.rollout import (
    PromptBatches,
    Rollout,
    collect_rollout,
    completion_metrics,
    response_logprobs,
    rl_loop_settings,
    rl_sampling,
    sequence_scores,
    token_values,
)
from rlhf_core.timing import PhaseTimer

# -- PPO's math: KL-penalized rewards, GAE, the clipped losses, KL controllers --------------------------


def kl_penalized_rewards(
    scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, last_index: torch.Tensor, kl_coef: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards: -kl_coef * kl on every real token, plus the sequence score on its last token.

    Returns (rewards, non_score_reward), each (B, T), zero on padding.
    """
    non_score = -kl_coef * kl * mask
    rewards = non_score.clone()
    rewards[torch.arange(rewards.shape[0], device=rewards.device), last_index] += scores
    return rewards, non_score


def compute_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over response tokens, vectorized. -> (advantages, returns), (B, T)

    delta_t = r_t + gamma * V_{t+1} - V_t (V past the end is 0), A_t = sum_l (gamma*lam)^l delta_{t+l},
    returns = A + V. Padding positions have zero reward and value, so they add nothing.
    """
    values = values * mask
    rewards = rewards * mask
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)
    deltas = rewards + gamma * next_values - values  # (B, T)
    t = torch.arange(rewards.shape[1], device=rewards.device, dtype=rewards.dtype)
    lag = t.view(1, -1) - t.view(-1, 1)  # (T, T): s - t
    discount = torch.where(lag >= 0, (gamma * lam) ** lag.clamp(min=0), torch.zeros_like(lag))
    advantages = (deltas @ discount.T) * mask  # A_t = sum_s discount[t, s] * delta_s
    return advantages, advantages + values


def policy_loss(
    new_logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, cliprange: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate: mean over real tokens of max(-A r, -A clip(r, 1-eps, 1+eps))."""
    log_ratio = new_logp - old_logp
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = masked_mean(torch.max(unclipped, clipped), mask)
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
    """Ziegler et al. (2019): move the coefficient so the observed KL approaches `target`.

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
    rollout: Rollout, value_model, reward_model, *, missing_eos_penalty: float | None, timer: PhaseTimer | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores (B,), values (B, R)) of a rollout; responses without the stop token lose the penalty.
    `timer` times the phases reward and value."""
    timer = timer or PhaseTimer(enabled=False)
    args = (rollout.query_ids, rollout.query_mask, rollout.responses, rollout.resp_mask)
    with timer("reward"):
        scores = sequence_scores(reward_model, *args, rollout.last_index)
    check_finite("the reward model", scores)
    if missing_eos_penalty is not None:
        scores = scores - missing_eos_penalty * (~rollout.has_stop).float()
    with timer("value"):
        values = token_values(value_model, *args)
    return scores, values


def train_ppo(
    policy,
    value_model,
    ref_model,
    reward_model,
    tokenizer,
    prompts: list[str],
    rl: RLConfig,
    ppo: PPOConfig,
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
    show_progress: bool = True,
    kl_scale: float = 1.0,
) -> LoopResult:
    """Train `policy` and `value_model` with PPO for rl.total_steps iterations; resume from output_dir.

    ref_model None means the policy is a PEFT model whose disabled adapters are the reference.
    `kl_scale` multiplies the KL coefficient (the guard's rollbacks): the saved one on resume, once.
    `evaluate(policy, step)` returns eval rows; it runs every `eval_every` steps and at the end.
    """
    kl_ctl = make_kl_controller(ppo)
    mini_size = rl.batch_size // ppo.num_mini_batches
    micro_size = max(1, mini_size // rl.gradient_accumulation_steps)
    settings = rl_loop_settings(
        rl,
        run,
        name="ppo",
        micro_batches=mini_size // micro_size,
        micro_batch_size=micro_size,
        eval_every=eval_every if on_eval is not None else None,
    )
    loop = TrainingLoop(
        PolicyAndValue(policy, value_model),
        {"policy": policy, "value": value_model},
        tokenizer,
        settings,
        run,
        output_dir=output_dir,
        state={"kl_coef": ppo.kl_coef, "kl_scale": 1.0},
    )
    # the coefficient a checkpoint saved, rescaled to this run's kl_scale (idempotent across resumes)
    kl_ctl.value = loop.state["kl_coef"] * kl_scale / loop.state.get("kl_scale", 1.0)
    loop.state.update(kl_coef=kl_ctl.value, kl_scale=kl_scale)
    batches = PromptBatches(
        tokenizer, prompts, max_prompt_length=max_prompt_length, per_step=rl.batch_size, seed=run.seed, loop=loop
    )
    for frozen in (ref_model, reward_model):
        if frozen is not None:
            frozen.to(loop.device).eval().requires_grad_(False)
    pad_id = tokenizer.pad_token_id
    stop_ids = run_stop_ids(tokenizer, getattr(policy, "generation_config", None), rl)
    sampling = rl_sampling(rl)
    world = loop.world
    all_reduce = loop.global_sum if world > 1 else None  # whitening over every process's rows

    timer = PhaseTimer(loop.device)

    def step(batch: tuple[torch.Tensor, torch.Tensor, list[int]]) -> dict[str, torch.Tensor | float]:
        query_ids, query_mask, _ = batch
        # 1. generate  2. score
        models = loop.unwrapped()
        with loop.full_parameters():
            rollout = collect_rollout(
                models.policy,
                ref_model,
                query_ids,
                query_mask,
                sampling,
                pad_token_id=pad_id,
                stop_token_ids=stop_ids,
                timer=timer,
            )
            scores, values = score_rollout(
                rollout, models.value_model, reward_model, missing_eos_penalty=rl.missing_eos_penalty, timer=timer
            )
        mask = rollout.resp_mask

        # 3. KL-penalized per-token rewards
        kl = kl_per_token(rollout.logprobs, rollout.ref_logprobs, ppo.kl_estimator) * mask  # (B, R)
        rewards, non_score = kl_penalized_rewards(scores, kl, mask, rollout.last_index, kl_ctl.value)
        if ppo.whiten_rewards:
            rewards = masked_whiten(rewards, mask, shift_mean=False, all_reduce=all_reduce) * mask

        # 4. GAE
        advantages, returns = compute_gae(rewards, values, mask, ppo.gamma, ppo.lam)
        if ppo.whiten_advantages:
            advantages = masked_whiten(advantages, mask, all_reduce=all_reduce) * mask

        # 5. PPO epochs over mini-batches, with gradient accumulation over micro-batches; the statistics
        # stay on the device (one transfer per step, in the loop's reduce_metrics). Each loss is the mean
        # over the real tokens of the whole mini-batch, every process's: the update does not depend on how
        # the mini-batch is split into micro-batches or processes (the gradients are averaged, hence / world)
        loop.trainable.train()
        stats: dict[str, list[torch.Tensor]] = {
            k: [] for k in ("pg_loss", "vf_loss", "pg_clipfrac", "vf_clipfrac", "approxkl", "ratio", "entropy")
        }
        with timer("optimize"):
            for _ in range(ppo.num_ppo_epochs):
                order = torch.randperm(rl.batch_size, device=loop.device)
                for mini_start in range(0, rl.batch_size, mini_size):
                    mini = order[mini_start : mini_start + mini_size]
                    mini_tokens = loop.global_sum(mask[mini].sum().float()) / world
                    for micro_start in range(0, mini_size, micro_size):
                        idx = mini[micro_start : micro_start + micro_size]
                        m = mask[idx]
                        with loop.micro_batch():
                            new_logp, entropy, vpred = loop.trainable(
                                rollout.query_ids[idx],
                                rollout.query_mask[idx],
                                rollout.responses[idx],
                                m,
                                rl.temperature,
                            )
                            pg, pg_stats = policy_loss(
                                new_logp, rollout.logprobs[idx], advantages[idx], m, ppo.cliprange
                            )
                            vf, vf_stats = value_loss(vpred, values[idx], returns[idx], m, ppo.cliprange_value)
                            loop.backward((pg + ppo.vf_coef * vf) * m.sum() / mini_tokens)
                        for key, value in (
                            ("pg_loss", pg),
                            ("vf_loss", vf),
                            ("pg_clipfrac", pg_stats["clipfrac"]),
                            ("vf_clipfrac", vf_stats["clipfrac"]),
                            ("approxkl", pg_stats["approxkl"]),
                            ("ratio", pg_stats["ratio"]),
                            ("entropy", masked_mean(entropy, m)),
                        ):
                            stats[key].append(value.detach())
                    loop.optimizer_step()

        # the adaptive controller needs the KL of the whole global batch now, not at logging time
        mean_kl = reduce_metrics(loop.accelerator, {"kl": kl.sum(1).mean()})["kl"]
        kl_ctl.update(mean_kl, rl.batch_size * world)
        loop.state["kl_coef"] = kl_ctl.value

        def avg(key: str) -> torch.Tensor | float:
            return torch.stack(stats[key]).float().mean() if stats[key] else float("nan")

        return {
            **timer.pop(),
            "objective/kl": mean_kl,
            "objective/entropy": (-rollout.logprobs * mask).sum(1).mean(),
            "objective/non_score_reward": non_score.sum(1).mean(),
            "objective/rlhf_reward": scores.mean() + non_score.sum(1).mean(),
            "objective/scores": scores.mean(),
            "objective/kl_coef": kl_ctl.value,
            "policy/approxkl_avg": avg("approxkl"),
            "policy/clipfrac_avg": avg("pg_clipfrac"),
            "policy/entropy_avg": avg("entropy"),
            "loss/policy_avg": avg("pg_loss"),
            "loss/value_avg": avg("vf_loss"),
            "val/clipfrac_avg": avg("vf_clipfrac"),
            "val/ratio": avg("ratio"),
            "val/num_eos_tokens": rollout.has_stop.sum(),
            "val/mean_response_length": mask.sum(1).float().mean(),
            **completion_metrics(rollout),
            "episode": float((loop.step + 1) * rl.batch_size * world),
            "_tokens": mask.sum(),
        }

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
