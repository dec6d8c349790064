"""GRPO: seconds per optimizer step against TRL 1.16's GRPOTrainer, reward curves, and the demo's gold gain.

Part A: the same SFT-initialized tiny Llama, 4 prompts x 8 generations per step, exactly 16 new
tokens (eos suppressed before that on both sides, min_new_tokens = 16: with eos stopping, the tokens generated per step follow what
each policy happens to learn, e.g. 14.7 vs 3.3 mean tokens in one run, and the timing compares
different work), temperature 1.0, beta 0.04 with the bias-corrected KL (TRL 1.16's default and ours), loss dapo, scale_rewards group, the VADER compound score of the
completion as the only reward, the same learning rate and steps, one checkpoint (weights and optimizer
state) saved at the end on both sides. Each side in its own process (peak RSS beside the time); order
TRL, ours, ours, TRL, TRL, ours; best of three; the reward curve is the mean reward over the steps and runs.
Part B: our GRPO with the demo world's reward function (VADER) at demo sizes; gold (VADER) and KL of
near-greedy held-out completions before and after.
"""

from __future__ import annotations

import time
from pathlib import Path

from bench.helpers.anchors import interleaved, phase_means, phase_table, side_process_main
from bench.helpers.trl_sides import group_args, run_group_trainer, vader_reward
from rlhf_core.demo.world import DemoWorld, world_rows
from rlhf_core.rl.inputs import rl_inputs

REPO = Path(__file__).resolve().parents[2]
STEPS, PROMPTS, G, TOKENS, SEED, LR = 30, 4, 8, 16, 42, 2e-3
LEARNING_BETA, LEARNING_STEPS = 0.04, 120


def prepare(root: Path) -> None:
    from rlhf_core.config import DemoModelConfig, DemoWorldConfig, RunConfig, SFTConfig
    from rlhf_core.demo.world import build_demo_world, world_rows
    from rlhf_core.models.loading import load_causal_lm, load_tokenizer
    from rlhf_core.training.loop import Hooks
    from rlhf_core.training.sft import train_sft

    world = build_demo_world(root / "world", SEED, DemoWorldConfig(), DemoModelConfig())
    model, tok = load_causal_lm(str(world.base_model)), load_tokenizer(str(world.tokenizer))
    train_sft(
        model,
        tok,
        [r["text"] for r in world_rows(world, "text")],
        SFTConfig(max_steps=300, learning_rate=3e-3),
        RunConfig(device="cpu", seed=SEED),
        max_length=48,
        output_dir=root / "sft",
        hooks=Hooks(show_progress=False),
    )


def side_ours(root: Path) -> dict:
    from rlhf_core.config import GRPOConfig, RLConfig, RunConfig
    from rlhf_core.models.loading import load_causal_lm, load_tokenizer
    from rlhf_core.rewards.sources import function_reward
    from rlhf_core.rl.grpo import train_grpo

    tok = load_tokenizer(str(root / "sft"))
    policy, ref = load_causal_lm(str(root / "sft")), load_causal_lm(str(root / "sft"))
    rows = world_rows(DemoWorld(root / "world"), "prompt", "train")
    rl = RLConfig(
        algorithm="grpo",
        total_steps=STEPS,
        batch_size=PROMPTS * G,
        learning_rate=LR,
        response_length=TOKENS,
        temperature=1.0,
        save_steps=STEPS,
        log_steps=1,
        min_response_length=TOKENS,
    )
    rewards, lengths, logged = [], [], []

    def on_log(metrics, step):
        rewards.append(metrics["reward"])
        lengths.append(metrics["completions/mean_length"])
        logged.append(metrics)

    start = time.perf_counter()
    train_grpo(
        rl_inputs(
            policy,
            tok,
            rows,
            root / f"ours-{time.time_ns()}",
            reference=ref,
            rewards=[function_reward("vader", 1.0, vader_reward)],
            rl=rl,
            grpo=GRPOConfig(num_generations=G, beta=0.04, use_bias_correction_kl=True),
            run=RunConfig(device="cpu", seed=SEED),
            max_prompt_length=16,
            on_log=on_log,
            show_progress=False,
        )
    )
    seconds = (time.perf_counter() - start) / STEPS
    return {"seconds_per_step": seconds, "rewards": rewards, "lengths": lengths, "phases": phase_means(logged)}


def side_trl(root: Path) -> dict:
    args = group_args(root, batch=PROMPTS * G, generations=G, tokens=TOKENS, steps=STEPS, lr=LR, beta=0.04, seed=SEED)
    # one checkpoint (weights, optimizer state) at the end, as ours writes (save_steps=STEPS)
    args.update(save_strategy="steps", save_steps=STEPS, loss_type="dapo", scale_rewards="group")
    args.update(use_bias_correction_kl=True)  # TRL 1.16's default, ours too
    run = run_group_trainer("GRPOTrainer", root, root / "sft", args)
    return {"seconds_per_step": run["train_s"] / STEPS, "rewards": run["rewards"], "lengths": run["lengths"]}


def learning(root: Path) -> dict:
    """Part B: GRPO on the demo world with VADER as the reward function; gold and KL before and after."""
    from rlhf_core.config import GRPOConfig, RLConfig, load_config
    from rlhf_core.evaluation.generations import (
        EvalModels,
        EvalPrompts,
        EvalSampling,
        evaluate_generations,
        summarize_rows,
    )
    from rlhf_core.models.loading import load_causal_lm, load_tokenizer
    from rlhf_core.rewards.functions import vader_compound
    from rlhf_core.rewards.sources import function_reward
    from rlhf_core.rl.grpo import train_grpo
    from rlhf_core.rollout.sampling import SamplingSettings

    cfg = load_config(REPO / "configs" / "demo.yaml")
    tok = load_tokenizer(str(root / "sft"))
    policy, ref = load_causal_lm(str(root / "sft")), load_causal_lm(str(root / "sft"))
    rows = world_rows(DemoWorld(root / "world"), "prompt", "train")
    eval_prompts = [r["prompt"] for r in world_rows(DemoWorld(root / "world"), "prompt", "test")][
        : cfg.eval.num_prompts
    ]

    def evaluate(model):
        out = evaluate_generations(
            EvalModels(model, tok, ref_model=ref),
            EvalPrompts(eval_prompts),
            EvalSampling(
                SamplingSettings(response_length=12),
                max_prompt_length=16,
                batch_size=64,
                stop_token_ids=(tok.eos_token_id,),
            ),
            {"vader": vader_compound},
        )
        return summarize_rows(out)

    rl = RLConfig(
        algorithm="grpo",
        total_steps=LEARNING_STEPS,
        batch_size=64,
        learning_rate=2e-3,
        response_length=12,
        temperature=1.0,
        save_steps=LEARNING_STEPS,
    )
    before = evaluate(policy)
    start = time.perf_counter()
    # TRL's beta 0.04 with its bias-corrected KL (the default, ours too). With that correction the KL term
    # binds: beta 0.2 kept the policy at the reference for 60 steps (gold 0.00, KL 0.3). At 0.04 the gold
    # gain is reward hacking (a repeated "<neutral word> but friends" at a KL near 100): read it beside the KL
    train_grpo(
        rl_inputs(
            policy,
            tok,
            rows,
            root / "learning",
            reference=ref,
            rewards=[function_reward("vader", 1.0, vader_reward)],
            rl=rl,
            grpo=GRPOConfig(num_generations=8, beta=LEARNING_BETA),
            run=cfg.run,
            max_prompt_length=16,
            show_progress=False,
        )
    )
    seconds = time.perf_counter() - start
    after = evaluate(policy)
    return {
        "gold_before": before["eval/vader_mean"],
        "gold_after": after["eval/vader_mean"],
        "kl_after": after["eval/kl_mean"],
        "steps": rl.total_steps,
        "wall_s": seconds,
        "beta": LEARNING_BETA,
    }


def measure(run_side) -> dict:
    anchor, ours = interleaved(run_side)
    learned = run_side("learning")
    best_ours = min(ours, key=lambda r: r["seconds_per_step"])
    best_anchor = min(anchor, key=lambda r: r["seconds_per_step"])
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    # the reward curve of one run is noisy: compare the mean reward over all steps of all runs of each side
    ours_curve = mean([mean(r["rewards"]) for r in ours])
    anchor_curve = mean([mean(r["rewards"]) for r in anchor])
    ours_len = mean([mean(r["lengths"]) for r in ours])
    anchor_len = mean([mean(r["lengths"]) for r in anchor])
    result = {
        "metric": "seconds per GRPO optimizer step",
        "unit": "s/step",
        "ours": best_ours["seconds_per_step"],
        "anchor": best_anchor["seconds_per_step"],
        "anchor_name": "trl 1.16.0 GRPOTrainer",
        "ratio": best_ours["seconds_per_step"] / best_anchor["seconds_per_step"],
        "ours_mean_reward": ours_curve,
        "anchor_mean_reward": anchor_curve,
        "ours_rewards": ours[0]["rewards"],
        "anchor_rewards": anchor[0]["rewards"],
        "learning": learned,
        "ours_mean_length": ours_len,
        "anchor_mean_length": anchor_len,
        "ours_peak_rss_mb": max(r["peak_rss_mb"] for r in ours),
        "anchor_peak_rss_mb": max(r["peak_rss_mb"] for r in anchor),
        "all_ours": [r["seconds_per_step"] for r in ours],
        "all_anchor": [r["seconds_per_step"] for r in anchor],
        "phase_s": best_ours["phases"],
        "table_md": phase_table("GRPO", best_ours["phases"])
        + f"\n\nOur fastest timing run ({PROMPTS}x{G} completions x {TOKENS} tokens).",
        "notes": (
            f"peak RSS ours {max(r['peak_rss_mb'] for r in ours):.0f} MB vs TRL {max(r['peak_rss_mb'] for r in anchor):.0f} MB; "
            f"mean reward over {STEPS} steps x {len(ours)} runs ours {ours_curve:.3f} vs TRL {anchor_curve:.3f}; "
            f"completion length ours {ours_len:.1f} vs TRL {anchor_len:.1f} tokens; "
            f"demo gold (VADER) {learned['gold_before']:.2f} -> {learned['gold_after']:.2f}, KL {learned['kl_after']:.2f}, "
            f"{learned['steps']} steps at beta {learned['beta']} in {learned['wall_s']:.0f} s; timing: {PROMPTS}x{G} completions x {TOKENS} tokens, beta 0.04, bias-corrected KL on both sides, CPU"
        ),
    }
    return result


if __name__ == "__main__":
    side_process_main(
        __file__,
        {"prepare": prepare, "ours": side_ours, "trl": side_trl, "learning": learning},
        ("trl", "1.16.0"),
        measure,
    )
