"""timing/scaling_vs_trl.py's sides: the prepared models, and each measured run (our PPO and GRPO, TRL's, at one
model size and response length; our PPO data parallel) as a function of the root the models sit in.
timing/scaling_vs_trl.py runs each in a fresh process and turns the results into the grid and its report."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from bench.helpers.anchors import use_anchor
from bench.helpers.trl_sides import (
    group_args,
    ppo_args,
    run_group_trainer,
    run_ppo_trainer,
    train_prompts,
    vader_reward,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SEED, PROMPTS, G, WARMUP, TIMED, LR = 42, 4, 2, 1, 2, 1e-4
REPEATS = 2  # runs per point and side; the best (shortest step time) counts
STEPS = WARMUP + TIMED
MAX_PROMPT = 16
CENTRE_SIZE, CENTRE_LENGTH = "10M", 64
LENGTHS = (16, 64, 256)
# Llama shapes (tied embeddings, as the demo model) of about 1M, 10M and 50M parameters on the demo vocabulary
SIZES = {
    "1M": {"hidden_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "intermediate_size": 512},
    "10M": {"hidden_size": 256, "num_hidden_layers": 9, "num_attention_heads": 4, "intermediate_size": 1024},
    "50M": {"hidden_size": 512, "num_hidden_layers": 12, "num_attention_heads": 8, "intermediate_size": 2048},
}
MAX_POSITIONS = 512  # room for a prompt and 256 new tokens
DP_SIZE, DP_LENGTH, DP_BATCH, DP_STEPS = "10M", 64, 16, 4  # 1 warm-up + 3 timed; 16 prompts: halving them shows
DP_SHAPES = ((1, 2), (2, 1), (1, 1))  # (processes, torch threads each): 1 x 2 against 2 x 1 is the comparison
# torch threads of every grid run. On a shared 2-core machine 2 OpenMP threads stall whenever another job takes a
# core (10M/64 PPO: 12.7 s/step with 2 threads, 1.2 s/step with 1, the same minute); 1 thread is slower but stable
GRID_THREADS = 1


def grid_points(grid: str) -> list[tuple[str, int]]:
    if grid == "full":
        return [(s, n) for s in SIZES for n in LENGTHS]
    points = [(s, CENTRE_LENGTH) for s in SIZES]
    return points + [(CENTRE_SIZE, n) for n in LENGTHS if n != CENTRE_LENGTH]


# -- the prepared models (shared by every side) --------------------------------------------------


def prepare(root: Path) -> None:
    """The demo world (tokenizer and prompts) and, per size, a random policy and a reward model (value model init)."""
    from rlhf_core.config import DemoModelConfig, DemoWorldConfig
    from rlhf_core.demo.models import build_demo_model
    from rlhf_core.demo.world import build_demo_world
    from rlhf_core.models.loading import load_tokenizer
    from rlhf_core.rewards.reward_model import load_reward_model

    world = build_demo_world(
        root / "world", SEED, DemoWorldConfig(), DemoModelConfig(**SIZES["1M"], max_position_embeddings=MAX_POSITIONS)
    )
    tok = load_tokenizer(str(world.tokenizer))
    for name, shape in SIZES.items():
        model = build_demo_model(tok, DemoModelConfig(**shape, max_position_embeddings=MAX_POSITIONS), SEED)
        model.save_pretrained(root / f"policy-{name}")
        tok.save_pretrained(root / f"policy-{name}")
        reward = load_reward_model(str(root / f"policy-{name}"), tok, seed=SEED)
        reward.save_pretrained(root / f"reward-{name}")
        tok.save_pretrained(root / f"reward-{name}")
        (root / f"params-{name}").write_text(str(sum(p.numel() for p in model.parameters())))


def step_seconds(stamps: list[float]) -> float:
    """Mean wall time between consecutive step ends after the warm-up step(s)."""
    timed = stamps[WARMUP - 1 :]
    return (timed[-1] - timed[0]) / (len(timed) - 1)


# -- the sides: one (algorithm, size, length) each, in its own process ---------------------------


def ours_ppo(root: Path, size: str, length: int) -> dict:
    import torch
    from transformers import AutoModelForSequenceClassification

    from rlhf_core.config import PPOConfig, RLConfig, RunConfig
    from rlhf_core.models.loading import load_causal_lm, load_tokenizer
    from rlhf_core.rl.inputs import rl_inputs
    from rlhf_core.rl.ppo import train_ppo

    policy_dir, reward_dir = str(root / f"policy-{size}"), str(root / f"reward-{size}")
    tok = load_tokenizer(policy_dir)
    policy, ref = load_causal_lm(policy_dir), load_causal_lm(policy_dir)
    value = AutoModelForSequenceClassification.from_pretrained(reward_dir)
    reward = AutoModelForSequenceClassification.from_pretrained(reward_dir)
    rl = RLConfig(
        total_steps=STEPS,
        batch_size=PROMPTS,
        learning_rate=LR,
        response_length=length,
        min_response_length=length,
        temperature=0.7,
        save_steps=STEPS,
        log_steps=1,
    )
    stamps, lengths = [], []
    train_ppo(
        rl_inputs(
            policy,
            tok,
            train_prompts(root),
            root / f"ours-{time.time_ns()}",
            value=value,
            reference=ref,
            reward_model=reward,
            rl=rl,
            ppo=PPOConfig(num_ppo_epochs=1, num_mini_batches=1, kl_coef=0.05),
            run=RunConfig(device="cpu", seed=SEED),
            max_prompt_length=MAX_PROMPT,
            on_step=lambda step: stamps.append(time.perf_counter()),
            on_log=lambda metrics, step: lengths.append(metrics["val/mean_response_length"]),
            show_progress=False,
        )
    )
    return {"seconds_per_step": step_seconds(stamps), "new_tokens": lengths, "threads": torch.get_num_threads()}


def trl_ppo(root: Path, size: str, length: int) -> dict:
    use_anchor("trl", "1.12.0")
    import torch

    # no stop token: every response runs to `length` new tokens, as ours (min = max)
    args = ppo_args(
        root, batch=PROMPTS, steps=STEPS, length=length, epochs=1, stop_token=None, logging_steps=1, seed=SEED
    )
    run = run_ppo_trainer(root, root / f"policy-{size}", root / f"reward-{size}", MAX_PROMPT, args)
    return {
        "seconds_per_step": step_seconds(run["stamps"]),
        "new_tokens": run["new_tokens"],
        "threads": torch.get_num_threads(),
    }


def ours_grpo(root: Path, size: str, length: int) -> dict:
    import torch

    from rlhf_core.config import GRPOConfig, RLConfig, RunConfig
    from rlhf_core.demo.world import DemoWorld, world_rows
    from rlhf_core.models.loading import load_causal_lm, load_tokenizer
    from rlhf_core.rewards.sources import function_reward
    from rlhf_core.rl.grpo import train_grpo
    from rlhf_core.rl.inputs import rl_inputs

    policy_dir = str(root / f"policy-{size}")
    tok = load_tokenizer(policy_dir)
    policy, ref = load_causal_lm(policy_dir), load_causal_lm(policy_dir)
    rl = RLConfig(
        algorithm="grpo",
        total_steps=STEPS,
        batch_size=PROMPTS * G,
        learning_rate=LR,
        response_length=length,
        min_response_length=length,
        temperature=1.0,
        save_steps=STEPS,
        log_steps=1,
    )
    stamps, lengths = [], []
    train_grpo(
        rl_inputs(
            policy,
            tok,
            world_rows(DemoWorld(root / "world"), "prompt", "train"),
            root / f"ours-{time.time_ns()}",
            reference=ref,
            rewards=[function_reward("vader", 1.0, vader_reward)],
            rl=rl,
            grpo=GRPOConfig(
                num_generations=G, beta=0.04, use_bias_correction_kl=True, loss_type="dapo", scale_rewards="group"
            ),
            run=RunConfig(device="cpu", seed=SEED),
            max_prompt_length=MAX_PROMPT,
            on_step=lambda step: stamps.append(time.perf_counter()),
            on_log=lambda metrics, step: lengths.append(metrics["completions/mean_length"]),
            show_progress=False,
        )
    )
    return {"seconds_per_step": step_seconds(stamps), "new_tokens": lengths, "threads": torch.get_num_threads()}


def trl_grpo(root: Path, size: str, length: int) -> dict:
    use_anchor("trl", "1.16.0")
    import torch

    args = group_args(root, batch=PROMPTS * G, generations=G, tokens=length, steps=STEPS, lr=LR, beta=0.04, seed=SEED)
    args.update(save_strategy="no", loss_type="dapo", scale_rewards="group", use_bias_correction_kl=True)
    run = run_group_trainer("GRPOTrainer", root, root / f"policy-{size}", args)
    return {
        "seconds_per_step": step_seconds(run["stamps"]),
        "new_tokens": run["lengths"],
        "threads": torch.get_num_threads(),
    }


RUNNERS = {("ours", "ppo"): ours_ppo, ("trl", "ppo"): trl_ppo, ("ours", "grpo"): ours_grpo, ("trl", "grpo"): trl_grpo}


def data_parallel(root: Path, processes: int, threads: int) -> dict:
    """Our PPO on DP_BATCH prompts per step: one process, or 2 gloo processes with half the batch each."""
    out = root / f"dp{processes}x{threads}-{time.time_ns()}"
    out.mkdir()
    worker = [str(HERE / "scaling_worker.py"), str(root), DP_SIZE, str(DP_LENGTH)]
    worker += [str(DP_BATCH // processes), str(DP_STEPS), str(WARMUP), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "SCALING_THREADS": str(threads)}
    if processes == 1:
        command = [sys.executable, *worker]
    else:
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        command = [torchrun, "--standalone", "--nproc_per_node", str(processes), *worker]
    subprocess.run(command, check=True, env=env, cwd=REPO)
    import json

    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(processes)]
    return {
        "seconds_per_step": ranks[0]["seconds_per_step"],
        "rank_rss_mb": [r["peak_rss_mb"] for r in ranks],
        "threads": ranks[0]["threads"],
        "world": ranks[0]["world"],
    }


def read_params(root: Path) -> dict:
    return {size: int((root / f"params-{size}").read_text()) for size in SIZES}


def sides() -> dict:
    table = {
        "prepare": prepare,
        "params": read_params,
    }
    for processes, threads in DP_SHAPES:
        table[f"dp{processes}x{threads}"] = lambda root, p=processes, t=threads: data_parallel(root, p, t)
    for (side, algo), fn in RUNNERS.items():
        for size in SIZES:
            for length in LENGTHS:
                table[f"{side}:{algo}:{size}:{length}"] = lambda root, fn=fn, s=size, n=length: fn(root, s, n)
    return table
