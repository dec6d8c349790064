"""PPO with a learned reward model and a value model, resumable from any checkpoint.

Each iteration, in the numbered steps of the CleanRL/TRL recipe: 1. generate, 2. score,
3. KL-penalized per-token rewards, 4. GAE, 5. PPO epochs over mini-batches. The loop takes
callbacks (`on_log`, `on_checkpoint`, `on_eval`) and imports no tracking code. A checkpoint holds the
policy alone (`policy/`, Hugging Face format), the value model (`value/`) and the training state
(`training_state/`, no pickle).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from rlhf_core.checkpoint import latest_checkpoint, load_training_state, save_training_state
from rlhf_core.config import PPOConfig, RLConfig, RunConfig
from rlhf_core.ppo_math import (
    AdaptiveKLController, FixedKLController, compute_gae, kl_penalized_rewards, kl_per_token, masked_mean, masked_whiten,
    policy_loss, value_loss,
)
from rlhf_core.rollout import (
    Rollout, SamplingSettings, collect_rollout, left_pad, response_logprobs, sequence_scores, token_values,
    tokenize_prompts,
)
from rlhf_core.training import (
    OnCheckpoint, OnLog, assert_finite, atomic_dir, build_optimizer, epoch_batches, make_accelerator, restore_weights,
    save_hf_dir, seed_everything,
)

OnEval = Callable[[list[dict], int], None]


class PolicyAndValue(torch.nn.Module):
    """Both trained models under one module, so one optimizer and one `accelerator.prepare` cover them."""

    def __init__(self, policy, value_model):
        super().__init__()
        self.policy = policy
        self.value_model = value_model

    def forward(self, query_ids, query_mask, responses, resp_mask, temperature: float):
        """(log-probabilities, entropies, values) of the response tokens, each (B, R)."""
        args = (query_ids, query_mask, responses, resp_mask)
        logp, entropy = response_logprobs(self.policy, *args, temperature=temperature, with_entropy=True)
        return logp, entropy, token_values(self.value_model, *args)


@dataclass
class PPOResult:
    checkpoint: Path
    step: int
    metrics: dict[str, float]
    resumed_from: int
    skipped_steps: int


def save_ppo_checkpoint(models: PolicyAndValue, tokenizer, path: Path, *, optimizer, scheduler, progress: dict,
                        metrics: dict[str, float]) -> Path:
    """checkpoint-N/{policy,value,training_state,metrics.json}, written atomically; refuses NaN weights."""
    assert_finite(models.policy, "the policy")
    assert_finite(models.value_model, "the value model")
    with atomic_dir(path) as tmp:
        save_hf_dir(models.policy, tokenizer, tmp / "policy")
        save_hf_dir(models.value_model, tokenizer, tmp / "value")
        (tmp / "metrics.json").write_text(json.dumps(metrics, indent=2))
        save_training_state(tmp, optimizer=optimizer, scheduler=scheduler, progress=progress)
    return path


def make_kl_controller(ppo: PPOConfig):
    if ppo.adaptive_kl:
        return AdaptiveKLController(ppo.kl_coef, ppo.target_kl, ppo.horizon)
    return FixedKLController(ppo.kl_coef)


@torch.no_grad()
def score_rollout(rollout: Rollout, value_model, reward_model, *, missing_eos_penalty: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores (B,), values (B, R)) of a rollout; responses without the stop token lose the penalty."""
    args = (rollout.query_ids, rollout.query_mask, rollout.responses, rollout.resp_mask)
    scores = sequence_scores(reward_model, *args, rollout.last_index)
    if missing_eos_penalty is not None:
        scores = scores - missing_eos_penalty * (~rollout.has_stop).float()
    return scores, token_values(value_model, *args)


def train_ppo(policy, value_model, ref_model, reward_model, tokenizer, prompts: list[str], rl: RLConfig, ppo: PPOConfig,
              run: RunConfig, *, max_prompt_length: int, output_dir: str | Path,
              on_log: OnLog | None = None, on_checkpoint: OnCheckpoint | None = None, on_eval: OnEval | None = None,
              evaluate: Callable[[object, object], list[dict]] | None = None, eval_every: int | None = None,
              show_progress: bool = True) -> PPOResult:
    """Train `policy` and `value_model` with PPO for rl.total_steps iterations; resume from output_dir.

    ref_model None means the policy is a PEFT model whose disabled adapters are the reference.
    `evaluate(policy, step)` returns eval rows; it runs every `eval_every` steps and at the end.
    """
    from tqdm.auto import tqdm

    if not prompts:
        raise ValueError("the prompt set is empty; PPO needs at least one prompt")
    output_dir = Path(output_dir)
    seed_everything(run.seed)
    accelerator = make_accelerator(run)
    device = accelerator.device
    models = PolicyAndValue(policy, value_model)
    optimizer, scheduler = build_optimizer(models, rl, rl.total_steps)
    kl_ctl = make_kl_controller(ppo)
    step, epoch, position, metrics, skipped = 0, 0, 0, {}, 0
    resume = latest_checkpoint(output_dir)
    if resume is not None:
        restore_weights(policy, resume / "policy")
        restore_weights(value_model, resume / "value")
        progress = load_training_state(resume, optimizer=optimizer, scheduler=scheduler)
        step, epoch, position = progress["step"], progress["epoch"], progress["position"]
        kl_ctl.value, skipped = progress["kl_coef"], progress.get("skipped_steps", 0)
        metrics = json.loads((resume / "metrics.json").read_text())
    resumed_from = step
    models, optimizer, scheduler = accelerator.prepare(models, optimizer, scheduler)
    for frozen in (ref_model, reward_model):
        if frozen is not None:
            frozen.to(device).eval().requires_grad_(False)

    pad_id = tokenizer.pad_token_id
    stop_id = tokenizer.eos_token_id if rl.stop_token == "eos" else None
    settings = SamplingSettings(response_length=rl.response_length, temperature=rl.temperature, top_k=rl.top_k, top_p=rl.top_p)
    prompt_ids = tokenize_prompts(tokenizer, prompts, max_prompt_length)
    mini_size = rl.batch_size // ppo.num_mini_batches
    micro_size = max(1, mini_size // rl.gradient_accumulation_steps)

    def unwrapped() -> PolicyAndValue:
        return accelerator.unwrap_model(models)

    def save(at_step: int) -> None:
        if accelerator.is_main_process:
            path = save_ppo_checkpoint(unwrapped(), tokenizer, output_dir / f"checkpoint-{at_step}", optimizer=optimizer,
                                       scheduler=scheduler, metrics=metrics,
                                       progress={"step": at_step, "epoch": epoch, "position": position,
                                                 "kl_coef": kl_ctl.value, "skipped_steps": skipped})
            if on_checkpoint is not None:
                on_checkpoint(path / "policy", at_step)
        accelerator.wait_for_everyone()

    def run_eval(at_step: int) -> None:
        if evaluate is not None and on_eval is not None:
            on_eval(evaluate(unwrapped().policy, at_step), at_step)

    batches = epoch_batches(len(prompt_ids), rl.batch_size, run.seed, epoch)
    bar = tqdm(total=rl.total_steps, initial=step, desc="ppo", disable=not show_progress or not accelerator.is_main_process)
    while step < rl.total_steps:
        started = time.perf_counter()
        indices = batches[position]
        position += 1
        if position == len(batches):
            epoch, position = epoch + 1, 0
            batches = epoch_batches(len(prompt_ids), rl.batch_size, run.seed, epoch)
        query_ids, query_mask = left_pad([prompt_ids[i] for i in indices], pad_id)
        query_ids, query_mask = query_ids.to(device), query_mask.to(device)

        # 1. generate  2. score
        model = unwrapped()
        rollout = collect_rollout(model.policy, ref_model, query_ids, query_mask, settings, pad_token_id=pad_id,
                                  stop_token_id=stop_id)
        scores, values = score_rollout(rollout, model.value_model, reward_model, missing_eos_penalty=rl.missing_eos_penalty)
        mask = rollout.resp_mask

        # 3. KL-penalized per-token rewards
        kl = kl_per_token(rollout.logprobs, rollout.ref_logprobs, ppo.kl_estimator) * mask  # (B, R)
        rewards, non_score = kl_penalized_rewards(scores, kl, mask, rollout.last_index, kl_ctl.value)
        if ppo.whiten_rewards:
            rewards = masked_whiten(rewards, mask, shift_mean=False) * mask

        # 4. GAE
        advantages, returns = compute_gae(rewards, values, mask, ppo.gamma, ppo.lam)
        if ppo.whiten_advantages:
            advantages = masked_whiten(advantages, mask) * mask

        # 5. PPO epochs over mini-batches, with gradient accumulation over micro-batches
        models.train()
        stats: dict[str, list[float]] = {k: [] for k in ("pg_loss", "vf_loss", "pg_clipfrac", "vf_clipfrac", "approxkl", "ratio", "entropy")}
        for _ in range(ppo.num_ppo_epochs):
            order = torch.randperm(rl.batch_size, device=device)
            for mini_start in range(0, rl.batch_size, mini_size):
                mini = order[mini_start : mini_start + mini_size]
                finite = True
                for micro_start in range(0, mini_size, micro_size):
                    idx = mini[micro_start : micro_start + micro_size]
                    m = mask[idx]
                    new_logp, entropy, vpred = models(rollout.query_ids[idx], rollout.query_mask[idx], rollout.responses[idx],
                                                      m, rl.temperature)
                    pg, pg_stats = policy_loss(new_logp, rollout.logprobs[idx], advantages[idx], m, ppo.cliprange)
                    vf, vf_stats = value_loss(vpred, values[idx], returns[idx], m, ppo.cliprange_value)
                    loss = pg + ppo.vf_coef * vf
                    if not torch.isfinite(loss):
                        finite = False  # skip this optimizer step; its gradients are poisoned
                        break
                    accelerator.backward(loss * len(idx) / mini_size)
                    stats["pg_loss"].append(pg.item())
                    stats["vf_loss"].append(vf.item())
                    stats["pg_clipfrac"].append(pg_stats["clipfrac"].item())
                    stats["vf_clipfrac"].append(vf_stats["clipfrac"].item())
                    stats["approxkl"].append(pg_stats["approxkl"].item())
                    stats["ratio"].append(pg_stats["ratio"].item())
                    stats["entropy"].append(masked_mean(entropy, m).item())
                if finite:
                    accelerator.clip_grad_norm_(models.parameters(), rl.max_grad_norm)
                    optimizer.step()
                else:
                    skipped += 1
                optimizer.zero_grad(set_to_none=True)
        scheduler.step()

        mean_kl = kl.sum(1).mean().item()
        kl_ctl.update(mean_kl, rl.batch_size)
        step += 1
        elapsed = time.perf_counter() - started
        n_tokens = int(mask.sum().item())

        def avg(key: str) -> float:
            return sum(stats[key]) / len(stats[key]) if stats[key] else float("nan")

        metrics = {
            "objective/kl": mean_kl,
            "objective/entropy": (-rollout.logprobs * mask).sum(1).mean().item(),
            "objective/non_score_reward": non_score.sum(1).mean().item(),
            "objective/rlhf_reward": scores.mean().item() + non_score.sum(1).mean().item(),
            "objective/scores": scores.mean().item(),
            "objective/kl_coef": kl_ctl.value,
            "policy/approxkl_avg": avg("approxkl"),
            "policy/clipfrac_avg": avg("pg_clipfrac"),
            "policy/entropy_avg": avg("entropy"),
            "loss/policy_avg": avg("pg_loss"),
            "loss/value_avg": avg("vf_loss"),
            "val/clipfrac_avg": avg("vf_clipfrac"),
            "val/ratio": avg("ratio"),
            "val/num_eos_tokens": float(rollout.has_stop.sum().item()),
            "val/mean_response_length": float(mask.sum(1).float().mean().item()),
            "lr": scheduler.get_last_lr()[0],
            "episode": float(step * rl.batch_size),
            "perf/step_seconds": elapsed,
            "perf/tokens_per_second": n_tokens / elapsed,
            "perf/skipped_steps": float(skipped),
        }
        bar.update(1)
        bar.set_postfix(score=f"{metrics['objective/scores']:.3f}", kl=f"{mean_kl:.3f}")
        if on_log is not None and (step % rl.log_steps == 0 or step == rl.total_steps):
            on_log({k: v for k, v in metrics.items() if math.isfinite(v)}, step)
        if eval_every and (step % eval_every == 0 or step == rl.total_steps):
            run_eval(step)
        if step % rl.save_steps == 0 or step == rl.total_steps:
            save(step)
    bar.close()
    final = output_dir / f"checkpoint-{max(step, resumed_from)}"
    return PPOResult(checkpoint=final, step=step, metrics=metrics, resumed_from=resumed_from, skipped_steps=skipped)
