"""Run under `torchrun --nproc_per_node 2`: GRPO on one vLLM server from two processes (data parallel).

argv: the policy directory, the server's URL, the output directory. Each process records to <out>/rank<R>.json
how many weight pushes it sent, what it logged and a fingerprint of its final weights;
tests/rlhf_core/rollout/test_vllm_server.py compares them.
"""

import hashlib
import json
import os
import sys
from pathlib import Path

from rlhf_core.config import GRPOConfig, RLConfig, RolloutConfig, RunConfig
from rlhf_core.models.loading import load_causal_lm, load_tokenizer
from rlhf_core.rewards.sources import function_reward
from rlhf_core.rl.grpo import train_grpo
from rlhf_core.rl.inputs import rl_inputs
from rlhf_core.rollout import vllm_server


def short(prompts, completions, **_):
    return [-len(c) / 10 for c in completions]


def main(policy_dir: str, url: str, out: str) -> None:
    rank = int(os.environ["RANK"])
    pushes = []
    load_weights = vllm_server.VllmClient.load_weights

    def counted(self, directory):
        pushes.append(str(directory))
        load_weights(self, directory)

    vllm_server.VllmClient.load_weights = counted
    logged = []
    policy = load_causal_lm(policy_dir)
    train_grpo(
        rl_inputs(
            policy,
            load_tokenizer(policy_dir),
            [{"prompt": f"what is {i} plus two"} for i in range(8)],
            Path(out) / "grpo",
            reference=None,
            rewards=[function_reward("short", 1.0, short)],
            rl=RLConfig(
                algorithm="grpo", total_steps=2, batch_size=8, response_length=6, temperature=1.0, save_steps=2
            ),
            grpo=GRPOConfig(num_generations=4, beta=0.0),
            run=RunConfig(device="cpu", seed=3, num_processes=2),
            max_prompt_length=32,
            rollout=RolloutConfig(engine="vllm", vllm={"url": url}),
            on_log=lambda metrics, step: logged.append({k: float(v) for k, v in metrics.items()}),
            show_progress=False,
        )
    )
    digest = hashlib.sha256()
    for name, param in sorted(policy.state_dict().items()):
        digest.update(name.encode() + param.detach().contiguous().numpy().tobytes())
    record = {"pushes": pushes, "logged": logged, "weights": digest.hexdigest()}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(*sys.argv[1:4])
