"""PPO: seconds per batch and peak memory against TRL 1.12's PPOTrainer, and the demo's gold-metric gain.

Part A (timing): the same SFT-initialized tiny Llama, the same reward model (value model initialized
from it on both sides), 32 prompts per batch, 16-token responses, temperature 0.7, eos as stop
token, 4 PPO epochs, 1 mini-batch, kl_coef 0.05, gradient checkpointing off, no evaluation. Each
side runs in its own process (so peak RSS is its own); order TRL, ours, ours, TRL, TRL, ours; best of three.
Part B (learning): our PPO with configs/demo.yaml's RL settings; VADER (gold) score and KL of
near-greedy held-out completions before and after.
"""

from __future__ import annotations

import time
from pathlib import Path

from bench.helpers.anchors import interleaved, phase_means, phase_table, side_process_main
from bench.helpers.trl_sides import ppo_args, run_ppo_trainer
from rlhf_core.demo.world import DemoWorld, world_rows
from rlhf_core.rl.inputs import rl_inputs

REPO = Path(__file__).resolve().parents[2]
BATCHES, BATCH, RESPONSE, SEED = 8, 32, 16, 42


def prepare(root: Path) -> None:
    """World, SFT policy and reward model, shared by every side."""
    from rlhf_core.config import DemoModelConfig, DemoWorldConfig, RewardConfig, RunConfig, SFTConfig
    from rlhf_core.demo.world import build_demo_world, world_rows
    from rlhf_core.models.loading import load_causal_lm, load_tokenizer
    from rlhf_core.rewards.reward_model import PreferencePairs, load_reward_model, train_reward_model
    from rlhf_core.training.loop import Hooks
    from rlhf_core.training.sft import train_sft

    world = build_demo_world(root / "world", SEED, DemoWorldConfig(), DemoModelConfig())
    run = RunConfig(device="cpu", seed=SEED)
    model, tok = load_causal_lm(str(world.base_model)), load_tokenizer(str(world.tokenizer))
    train_sft(
        model,
        tok,
        [r["text"] for r in world_rows(world, "text")],
        SFTConfig(max_steps=300, learning_rate=3e-3),
        run,
        max_length=48,
        output_dir=root / "sft",
        hooks=Hooks(show_progress=False),
    )
    reward = load_reward_model(str(root / "sft"), tok, seed=SEED)
    result = train_reward_model(
        reward,
        tok,
        PreferencePairs(world_rows(world, "preference", "train"), world_rows(world, "preference", "test"), 48),
        RewardConfig(max_steps=200, save_steps=200, eval_steps=200, learning_rate=1e-3),
        run,
        output_dir=root / "reward",
        card={"title": "bench", "metadata": {}, "body": ""},
        hooks=Hooks(show_progress=False),
    )
    (root / "reward_dir").write_text(str(result.checkpoint))


def load_models(root: Path):
    """(tokenizer, policy, reference, value model, reward model): SFT policy twice, reward model twice."""
    from transformers import AutoModelForSequenceClassification

    from rlhf_core.models.loading import load_causal_lm, load_tokenizer

    reward_dir = (root / "reward_dir").read_text()
    tok = load_tokenizer(str(root / "sft"))
    policy, ref = load_causal_lm(str(root / "sft")), load_causal_lm(str(root / "sft"))
    value = AutoModelForSequenceClassification.from_pretrained(reward_dir)
    reward = AutoModelForSequenceClassification.from_pretrained(reward_dir)
    return tok, policy, ref, value, reward


def side_ours(root: Path) -> dict:
    from rlhf_core.config import PPOConfig, RLConfig, RunConfig
    from rlhf_core.rl.ppo import train_ppo

    tok, policy, ref, value, reward = load_models(root)
    prompts = [r["prompt"] for r in world_rows(DemoWorld(root / "world"), "prompt", "train")]
    rl = RLConfig(
        total_steps=BATCHES,
        batch_size=BATCH,
        learning_rate=1e-4,
        response_length=RESPONSE,
        temperature=0.7,
        save_steps=BATCHES,
        log_steps=BATCHES,
    )
    logged = []
    start = time.perf_counter()
    train_ppo(
        rl_inputs(
            policy,
            tok,
            prompts,
            root / f"ours-{time.time_ns()}",
            value=value,
            reference=ref,
            reward_model=reward,
            rl=rl,
            ppo=PPOConfig(),
            run=RunConfig(device="cpu", seed=SEED),
            max_prompt_length=16,
            on_log=lambda metrics, step: logged.append(metrics),
            show_progress=False,
        )
    )
    return {"seconds_per_batch": (time.perf_counter() - start) / BATCHES, "phases": phase_means(logged)}


def side_trl(root: Path) -> dict:
    args = ppo_args(
        root, batch=BATCH, steps=BATCHES, length=RESPONSE, epochs=4, stop_token="eos", logging_steps=BATCHES, seed=SEED
    )
    run = run_ppo_trainer(root, root / "sft", Path((root / "reward_dir").read_text()), 16, args)
    return {"seconds_per_batch": run["train_s"] / BATCHES}


def learning(root: Path) -> dict:
    """Part B: demo-config PPO, gold (VADER) and KL of near-greedy held-out completions before and after."""
    from rlhf_core.config import load_config
    from rlhf_core.evaluation.generations import (
        EvalModels,
        EvalPrompts,
        EvalSampling,
        evaluate_generations,
        summarize_rows,
    )
    from rlhf_core.rewards.functions import vader_compound
    from rlhf_core.rl.ppo import train_ppo
    from rlhf_core.rollout.sampling import SamplingSettings

    cfg = load_config(REPO / "configs" / "demo.yaml")
    tok, policy, ref, value, reward = load_models(root)
    prompts = [r["prompt"] for r in world_rows(DemoWorld(root / "world"), "prompt", "train")]
    eval_prompts = [r["prompt"] for r in world_rows(DemoWorld(root / "world"), "prompt", "test")][
        : cfg.eval.num_prompts
    ]

    def evaluate(model):
        rows = evaluate_generations(
            EvalModels(model, tok, ref_model=ref, reward_model=reward),
            EvalPrompts(eval_prompts),
            EvalSampling(
                SamplingSettings(response_length=cfg.rl.response_length),
                max_prompt_length=cfg.data.max_prompt_length,
                batch_size=cfg.eval.batch_size,
                stop_token_ids=(tok.eos_token_id,),
            ),
            {"vader": vader_compound},
        )
        return summarize_rows(rows), rows[:5]

    before, _ = evaluate(policy)
    start = time.perf_counter()
    train_ppo(
        rl_inputs(
            policy,
            tok,
            prompts,
            root / "learning",
            value=value,
            reference=ref,
            reward_model=reward,
            rl=cfg.rl,
            ppo=cfg.ppo,
            run=cfg.run,
            max_prompt_length=cfg.data.max_prompt_length,
            show_progress=False,
        )
    )
    seconds = time.perf_counter() - start
    after, samples = evaluate(policy)
    return {
        "gold_before": before["eval/vader_mean"],
        "gold_after": after["eval/vader_mean"],
        "kl_after": after["eval/kl_mean"],
        "score_before": before["eval/score_mean"],
        "score_after": after["eval/score_mean"],
        "steps": cfg.rl.total_steps,
        "wall_s": seconds,
        "samples": samples,
    }


def measure(run_side) -> dict:
    anchor, ours = interleaved(run_side)
    learned = run_side("learning")
    best_ours = min(ours, key=lambda r: r["seconds_per_batch"])
    best_anchor = min(anchor, key=lambda r: r["seconds_per_batch"])
    result = {
        "metric": "seconds per PPO batch",
        "unit": "s/batch",
        "ours": best_ours["seconds_per_batch"],
        "anchor": best_anchor["seconds_per_batch"],
        "anchor_name": "trl 1.12.0 experimental PPOTrainer",
        "ratio": best_ours["seconds_per_batch"] / best_anchor["seconds_per_batch"],
        "ours_peak_rss_mb": max(r["peak_rss_mb"] for r in ours),
        "anchor_peak_rss_mb": max(r["peak_rss_mb"] for r in anchor),
        "learning": learned,
        "phase_s": best_ours["phases"],
        "table_md": phase_table("PPO", best_ours["phases"])
        + f"\n\nOur fastest timing run ({BATCH} prompts x {RESPONSE} tokens, 4 PPO epochs; the step's time is the mean over the {BATCHES} batches).",
        "notes": (
            f"peak RSS ours {max(r['peak_rss_mb'] for r in ours):.0f} MB vs TRL {max(r['peak_rss_mb'] for r in anchor):.0f} MB; "
            f"demo gold (VADER) {learned['gold_before']:.2f} -> {learned['gold_after']:.2f}, KL {learned['kl_after']:.2f}, "
            f"{learned['steps']} steps in {learned['wall_s']:.0f} s; {BATCH} prompts x {RESPONSE} tokens, 4 epochs, CPU"
        ),
    }
    return result


if __name__ == "__main__":
    side_process_main(
        __file__,
        {"prepare": prepare, "ours": side_ours, "trl": side_trl, "learning": learning},
        ("trl", "1.12.0"),
        measure,
    )
