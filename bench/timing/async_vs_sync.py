"""Generation ahead of training: seconds per GRPO step with rollout.max_staleness 1 (ours) against 0 (the anchor: our
synchronous step), and 2, in one run on identical work.

The tool world of configs/tools.yaml (the calculator's tokenizer and its 0.5M-parameter Llama, 16 prompts x 8
episodes of up to 32 tokens with the `multiply` tool, one torch thread, exact match as the reward), from its base
model: untrained, so its episodes are mostly one turn to the length limit. STEPS steps per run, the runs one after
the other from the same weights; the mean seconds per step from step 2 on (the first waits for the generator
process to start, its seconds are reported apart). Learning at equal steps is `make async-rollouts`' question
(bench/studies/async_rollouts.py): this row is speed only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from rlhf_core.config import RolloutConfig, load_config
from rlhf_core.demo.world import build_demo_world, world_rows
from rlhf_core.models.loading import load_causal_lm, load_tokenizer
from rlhf_core.rewards.functions import exact_match
from rlhf_core.rewards.sources import function_reward
from rlhf_core.rl.grpo import train_grpo
from rlhf_core.rl.inputs import rl_inputs

REPO = Path(__file__).resolve().parents[2]
STEPS = 30


def step_seconds(cfg, world, out: Path, staleness: int) -> list[float]:
    tokenizer, policy = load_tokenizer(str(world.tokenizer)), load_causal_lm(str(world.base_model))
    seconds = []
    train_grpo(
        rl_inputs(
            policy,
            tokenizer,
            world_rows(world, "prompt", "train"),
            out,
            reference=None,
            rewards=[function_reward("exact_match", 1.0, exact_match)],
            rl=cfg.rl.model_copy(update={"total_steps": STEPS, "save_steps": STEPS, "log_steps": 1}),
            grpo=cfg.grpo,
            run=cfg.run,
            max_prompt_length=cfg.data.max_prompt_length,
            rollout=RolloutConfig(max_staleness=staleness),
            on_log=lambda metrics, step: seconds.append(metrics["perf/step_seconds"]),
            show_progress=False,
        )
    )
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(str(REPO / "configs" / "tools.yaml"))
    runs = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        world = build_demo_world(tmp / "world", cfg.run.seed, cfg.data.demo, cfg.model.demo)
        for k in (0, 1, 2):
            runs[k] = step_seconds(cfg, world, tmp / f"k{k}", k)
    steady = {k: statistics.fmean(s[1:]) for k, s in runs.items()}
    result = {
        "metric": "seconds per GRPO step, tool episodes, rollout.max_staleness 1 against 0",
        "unit": "s/step",
        "ours": steady[1],
        "anchor": steady[0],
        "anchor_name": "rollout.max_staleness 0, our synchronous step",
        "ratio": steady[1] / steady[0],
        "notes": (
            f"speed-up {steady[0] / steady[1]:.2f}x at k=1, {steady[0] / steady[2]:.2f}x at k=2 (mean of steps 2-{STEPS}); "
            f"the first step, which waits for the generator process: {runs[1][0]:.1f} s at k=1 against "
            f"{runs[0][0]:.2f} s at k=0; one torch thread each side"
        ),
        "steps": {str(k): s for k, s in runs.items()},
    }
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "steps"}, indent=2))


if __name__ == "__main__":
    main()
