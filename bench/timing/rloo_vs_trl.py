"""RLOO: seconds per optimizer step against TRL 1.16's RLOOTrainer, reward curves and peak RSS.

What part A of grpo_vs_trl.py does for GRPO, for rl.algorithm rloo (`train_grpo`, the GRPO family's trainer):
the same SFT-initialized tiny Llama (grpo_vs_trl's `prepare`), 4 prompts x 8 generations per step, exactly
16 new tokens (eos suppressed before that on both sides: min_new_tokens = 16), temperature 1.0, beta 0.05
(TRL RLOO's default) with the k1 KL subtracted from each completion's reward on both sides (TRL's
RLOO; our kl_estimator k1), the leave-one-out baseline and TRL's sequence-level clipped loss, no advantage
normalization (TRL's default, ours), the VADER compound score of the completion as the only reward, the same
learning rate and steps, one checkpoint (weights and optimizer state) saved at the end on both sides. Each
side in its own process (peak RSS beside the time); order TRL, ours, ours, TRL, TRL, ours; best of three;
the reward curve is the mean reward over the steps and runs.
"""

from __future__ import annotations

import time
from pathlib import Path

from bench.helpers.anchors import interleaved, phase_means, phase_table, side_process_main
from bench.helpers.trl_sides import group_args, run_group_trainer, vader_reward
from bench.timing.grpo_vs_trl import LR, PROMPTS, SEED, STEPS, TOKENS, G, prepare
from rlhf_core.demo.world import DemoWorld, world_rows
from rlhf_core.rl.inputs import rl_inputs

BETA = 0.05  # TRL RLOOConfig's default


def side_ours(root: Path) -> dict:
    from rlhf_core.config import GRPOConfig, RLConfig, RunConfig
    from rlhf_core.models.loading import load_causal_lm, load_tokenizer
    from rlhf_core.rewards.sources import function_reward
    from rlhf_core.rl.grpo import train_grpo

    tok = load_tokenizer(str(root / "sft"))
    policy, ref = load_causal_lm(str(root / "sft")), load_causal_lm(str(root / "sft"))
    rows = world_rows(DemoWorld(root / "world"), "prompt", "train")
    rl = RLConfig(
        algorithm="rloo",
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
            grpo=GRPOConfig(num_generations=G, beta=BETA, kl_estimator="k1"),
            run=RunConfig(device="cpu", seed=SEED),
            max_prompt_length=16,
            on_log=on_log,
            show_progress=False,
        )
    )
    seconds = (time.perf_counter() - start) / STEPS
    return {"seconds_per_step": seconds, "rewards": rewards, "lengths": lengths, "phases": phase_means(logged)}


def side_trl(root: Path) -> dict:
    args = group_args(root, batch=PROMPTS * G, generations=G, tokens=TOKENS, steps=STEPS, lr=LR, beta=BETA, seed=SEED)
    # beta: the k1 KL subtracted from the reward (TRL's RLOO); one checkpoint (weights, optimizer state) at the end,
    # as ours writes (save_steps=STEPS); ours turns dropout off by default (rl.disable_dropout), the Llama has none
    args.update(save_strategy="steps", save_steps=STEPS, disable_dropout=True)
    run = run_group_trainer("RLOOTrainer", root, root / "sft", args)
    return {"seconds_per_step": run["train_s"] / STEPS, "rewards": run["rewards"], "lengths": run["lengths"]}


def measure(run_side) -> dict:
    anchor, ours = interleaved(run_side)
    best_ours = min(ours, key=lambda r: r["seconds_per_step"])
    best_anchor = min(anchor, key=lambda r: r["seconds_per_step"])
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    # the reward curve of one run is noisy: compare the mean reward over all steps of all runs of each side,
    # and its first and last third (does it rise?)
    third = max(1, STEPS // 3)
    curve = lambda runs, part: mean([mean(r["rewards"][part]) for r in runs])  # noqa: E731
    ours_curve, anchor_curve = curve(ours, slice(None)), curve(anchor, slice(None))
    ours_first, ours_last = curve(ours, slice(None, third)), curve(ours, slice(-third, None))
    anchor_first, anchor_last = curve(anchor, slice(None, third)), curve(anchor, slice(-third, None))
    ours_len = mean([mean(r["lengths"]) for r in ours])
    anchor_len = mean([mean(r["lengths"]) for r in anchor])
    ours_rss = max(r["peak_rss_mb"] for r in ours)
    anchor_rss = max(r["peak_rss_mb"] for r in anchor)
    return {
        "metric": "seconds per RLOO optimizer step",
        "unit": "s/step",
        "ours": best_ours["seconds_per_step"],
        "anchor": best_anchor["seconds_per_step"],
        "anchor_name": "trl 1.16.0 RLOOTrainer",
        "ratio": best_ours["seconds_per_step"] / best_anchor["seconds_per_step"],
        "ours_mean_reward": ours_curve,
        "anchor_mean_reward": anchor_curve,
        "ours_reward_first_last_third": [ours_first, ours_last],
        "anchor_reward_first_last_third": [anchor_first, anchor_last],
        "ours_rewards": ours[0]["rewards"],
        "anchor_rewards": anchor[0]["rewards"],
        "ours_mean_length": ours_len,
        "anchor_mean_length": anchor_len,
        "ours_peak_rss_mb": ours_rss,
        "anchor_peak_rss_mb": anchor_rss,
        "all_ours": [r["seconds_per_step"] for r in ours],
        "all_anchor": [r["seconds_per_step"] for r in anchor],
        "phase_s": best_ours["phases"],
        "table_md": phase_table("RLOO", best_ours["phases"])
        + f"\n\nOur fastest timing run ({PROMPTS}x{G} completions x {TOKENS} tokens).",
        "notes": (
            f"peak RSS ours {ours_rss:.0f} MB vs TRL {anchor_rss:.0f} MB; "
            f"mean reward over {STEPS} steps x {len(ours)} runs ours {ours_curve:.3f} vs TRL {anchor_curve:.3f} "
            f"(first -> last third: ours {ours_first:.3f} -> {ours_last:.3f}, TRL {anchor_first:.3f} -> {anchor_last:.3f}); "
            f"completion length ours {ours_len:.1f} vs TRL {anchor_len:.1f} tokens; "
            f"timing: {PROMPTS}x{G} completions x {TOKENS} tokens, beta {BETA}, k1 KL in the reward on both sides, CPU"
        ),
    }


if __name__ == "__main__":
    side_process_main(__file__, {"prepare": prepare, "ours": side_ours, "trl": side_trl}, ("trl", "1.16.0"), measure)
