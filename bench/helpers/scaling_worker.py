"""timing/scaling_vs_trl.py's data-parallel worker: our PPO for a few steps, alone or under
`torchrun --standalone --nproc_per_node N` (CPU, gloo; the way tests/distributed/dp_worker.py runs).

usage: scaling_worker.py ROOT SIZE LENGTH BATCH_PER_PROCESS STEPS WARMUP OUT
Threads per process: $SCALING_THREADS. Each process writes OUT/rank<R>.json: its mean step time after
the warm-up (wall time between consecutive step ends), its peak RSS and the world size.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import warnings
from pathlib import Path


def main(root: str, size: str, length: str, batch: str, steps: str, warmup: str, out: str) -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("SCALING_THREADS", "1")))
    warnings.filterwarnings("ignore")
    from transformers import AutoModelForSequenceClassification

    from rlhf_core.config import PPOConfig, RLConfig, RunConfig
    from rlhf_core.demo.world import DemoWorld, world_rows
    from rlhf_core.models.loading import load_causal_lm, load_tokenizer
    from rlhf_core.rl.inputs import rl_inputs
    from rlhf_core.rl.ppo import train_ppo

    root_dir, n, steps_n, warm = Path(root), int(length), int(steps), int(warmup)
    policy_dir, reward_dir = str(root_dir / f"policy-{size}"), str(root_dir / f"reward-{size}")
    tok = load_tokenizer(policy_dir)
    policy, ref = load_causal_lm(policy_dir), load_causal_lm(policy_dir)
    value = AutoModelForSequenceClassification.from_pretrained(reward_dir)
    reward = AutoModelForSequenceClassification.from_pretrained(reward_dir)
    prompts = [r["prompt"] for r in world_rows(DemoWorld(root_dir / "world"), "prompt", "train")]
    rl = RLConfig(
        total_steps=steps_n,
        batch_size=int(batch),
        learning_rate=1e-4,
        response_length=n,
        min_response_length=n,
        temperature=0.7,
        save_steps=steps_n,
        log_steps=1,
    )
    stamps: list[float] = []
    rank = int(os.environ.get("RANK", "0"))
    train_ppo(
        rl_inputs(
            policy,
            tok,
            prompts,
            Path(out) / "ppo",
            value=value,
            reference=ref,
            reward_model=reward,
            rl=rl,
            ppo=PPOConfig(num_ppo_epochs=1, num_mini_batches=1, kl_coef=0.05),
            run=RunConfig(device="cpu", seed=42),
            max_prompt_length=16,
            on_step=lambda step: stamps.append(time.perf_counter()),
            show_progress=False,
        )
    )
    timed = stamps[warm - 1 :]
    Path(out, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "seconds_per_step": (timed[-1] - timed[0]) / (len(timed) - 1),
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "threads": torch.get_num_threads(),
                "world": int(os.environ.get("WORLD_SIZE", "1")),
            }
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
