"""Run under `torchrun --nproc_per_node 2`: a few steps of reward, PPO and GRPO training, data parallel.

Each process appends a fingerprint of its weights after every optimizer step (and every on_log call
it receives) to <out>/rank<R>.jsonl; tests/rlhf_core/test_data_parallel.py compares them.
"""

import hashlib
import json
import os
import sys
from pathlib import Path

import torch

from rlhf_core.config import GRPOConfig, PPOConfig, RewardConfig, RLConfig, RunConfig, load_config
from rlhf_core.demo.world import build_demo_world, world_rows
from rlhf_core.models.loading import load_causal_lm, load_tokenizer
from rlhf_core.rewards.functions import vader_compound
from rlhf_core.rewards.reward_model import PreferencePairs, load_reward_model, train_reward_model
from rlhf_core.rewards.sources import function_reward
from rlhf_core.rl.grpo import train_grpo
from rlhf_core.rl.inputs import rl_inputs
from rlhf_core.rl.ppo import train_ppo
from rlhf_core.training.loop import Hooks


def fingerprint(*models) -> str:
    digest = hashlib.sha256()
    for model in models:
        for name, param in sorted(model.state_dict().items()):
            digest.update(name.encode())
            digest.update(param.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def main(world_root: str, out: str) -> None:
    rank = int(os.environ["RANK"])
    out_dir = Path(out)
    trace = out_dir / f"rank{rank}.jsonl"

    def record(**entry):
        with open(trace, "a") as fh:
            fh.write(json.dumps(entry) + "\n")

    from accelerate import Accelerator

    from rlhf_core.training.parallel import reduce_metrics

    # metrics: the mean over processes, the total for the summed keys, one all-reduce
    reduced = reduce_metrics(
        Accelerator(cpu=True), {"loss": torch.tensor(float(rank)), "tokens": 3.0 + rank}, sums=("tokens",)
    )
    record(stage="reduce", metrics=reduced)
    extremes = reduce_metrics(
        Accelerator(cpu=True),
        {"low": 2.0 + rank, "high": 5.0 * (1 + rank), "mean": float(rank), "n": 1.0},
        sums=("n",),
        mins=("low",),
        maxes=("high",),
    )
    record(stage="reduce", metrics=extremes)

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml")
    world = build_demo_world(Path(world_root), cfg.run.seed, cfg.data.demo, cfg.model.demo)
    run = RunConfig(device="cpu", seed=3)
    tok = load_tokenizer(str(world.tokenizer))

    reward = load_reward_model(str(world.base_model), tok, seed=3)
    train_reward_model(
        reward,
        tok,
        PreferencePairs(world_rows(world, "preference", "train"), world_rows(world, "preference", "test"), 40),
        RewardConfig(max_steps=3, batch_size=4, eval_steps=3, save_steps=3, log_steps=1, learning_rate=1e-3),
        run,
        output_dir=out_dir / "reward",
        card={"title": "r", "metadata": {}, "body": ""},
        hooks=Hooks(
            on_step=lambda step: record(stage="reward", step=step, weights=fingerprint(reward)),
            on_log=lambda metrics, step: record(stage="reward", log=step),
            show_progress=False,
        ),
    )

    prompts = [r["prompt"] for r in world_rows(world, "prompt", "train")]
    policy, ref = load_causal_lm(str(world.base_model)), load_causal_lm(str(world.base_model))
    value = load_reward_model(str(world.base_model), tok, seed=3)
    scorer = load_reward_model(str(world.base_model), tok, seed=4).eval()
    rl = RLConfig(total_steps=2, batch_size=4, response_length=4, save_steps=2, learning_rate=1e-3, temperature=1.0)
    train_ppo(
        rl_inputs(
            policy,
            tok,
            prompts,
            out_dir / "ppo",
            value=value,
            reference=ref,
            reward_model=scorer,
            rl=rl,
            ppo=PPOConfig(num_ppo_epochs=1),
            run=run,
            max_prompt_length=16,
            on_step=lambda step: record(stage="ppo", step=step, weights=fingerprint(policy, value)),
            on_log=lambda metrics, step: record(stage="ppo", log=step, episode=metrics["episode"]),
            show_progress=False,
        )
    )

    policy = load_causal_lm(str(world.base_model))
    rl = RLConfig(
        algorithm="grpo",
        total_steps=2,
        batch_size=4,
        response_length=4,
        save_steps=2,
        learning_rate=1e-3,
        temperature=1.0,
    )
    train_grpo(
        rl_inputs(
            policy,
            tok,
            world_rows(world, "prompt", "train"),
            out_dir / "grpo",
            reference=None,
            rewards=[
                function_reward("vader", 1.0, lambda prompts, completions, **_: vader_compound(completions=completions))
            ],
            rl=rl,
            grpo=GRPOConfig(num_generations=2, beta=0.0),
            run=run,
            max_prompt_length=16,
            on_step=lambda step: record(
                stage="grpo", step=step, weights=fingerprint(policy), sampling_seed=torch.initial_seed()
            ),
            on_log=lambda metrics, step: record(stage="grpo", log=step),
            show_progress=False,
        )
    )
    torch.distributed.barrier() if torch.distributed.is_initialized() else None


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
