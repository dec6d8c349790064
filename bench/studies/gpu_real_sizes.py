"""GRPO at the real-size defaults on one CUDA GPU (docs/distributed.md#what-has-run-where).

The RL stage's training function `train_grpo` on prompts of 40 to 200 tokens (data.max_prompt_length 512) with
completions of up to rl.response_length 256, for a Qwen2.5-0.5B-shaped body (24 layers, hidden 896, 14 heads, 2 KV
heads) with random weights and the offline fixture tokenizer's small vocabulary; one run per process (accelerate
keeps one mixed-precision setting per process):

    PRECISION=no python -m bench.studies.gpu_real_sizes; PRECISION=bf16 python -m bench.studies.gpu_real_sizes

prints seconds per step, the peak GPU memory and the last step's metrics, and writes gpu_<precision>.json to $OUT.
SMALL=1 runs a two-step CPU dry run of a tiny body.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

SMALL = bool(os.environ.get("SMALL"))
STEPS, PROMPTS, GENERATIONS = (2, 2, 8) if SMALL else (6, 8, 8)


def prompt_rows(tokenizer, n: int) -> list[dict]:
    from tests.fixtures.team_data import user_text

    rng = random.Random(0)
    rows = []
    for _ in range(n):
        messages = [{"role": "user", "content": user_text(rng, tokenizer, rng.randint(40, 200) - 8)}]
        rows.append({"prompt": tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)})
    return rows


def policy(ids):
    """The Qwen2.5-0.5B-shaped body (bench/helpers/memory_sides.py) at the fixture tokenizer's 512 rows: 24 layers,
    or 2 narrow ones with SMALL."""
    from bench.helpers.memory_sides import qwen_body

    width, layers, heads = (64, 2, 2) if SMALL else (896, 24, 14)
    return qwen_body(ids, layers, vocab=512, width=width, heads=heads, seed=0)


def short_mentions(prompts, completions, **kwargs):
    """A reward: mention the cat, in few words."""
    return [float("cat" in c) - 0.01 * len(c.split()) for c in completions]


def main() -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from rlhf_core.config import GRPOConfig, RLConfig, RunConfig
    from rlhf_core.rewards.sources import function_reward
    from rlhf_core.rl.grpo import train_grpo
    from rlhf_core.rl.inputs import rl_inputs
    from tests.fixtures.real_shapes import build_tokenizer, family

    precision = os.environ.get("PRECISION", "no")
    cuda = torch.cuda.is_available() and not SMALL
    tokenizer = build_tokenizer(family("qwen2.5-instruct"))
    tokenizer.model_max_length = 32768
    ids = tokenizer.convert_tokens_to_ids
    rows = prompt_rows(tokenizer, 64)
    model = policy(ids)
    logged: list[tuple[float, dict]] = []
    started = time.perf_counter()
    train_grpo(
        rl_inputs(
            model,
            tokenizer,
            rows,
            tempfile.mkdtemp(),
            reference=None,
            rewards=[function_reward("short_mentions", 1.0, short_mentions)],
            rl=RLConfig(
                algorithm="grpo",
                total_steps=STEPS,
                batch_size=PROMPTS * GENERATIONS,
                learning_rate=1e-6,
                save_steps=STEPS,
                temperature=1.0,
            ),
            grpo=GRPOConfig(num_generations=GENERATIONS),
            run=RunConfig(device="cuda" if cuda else "cpu", mixed_precision=precision, seed=0),
            max_prompt_length=512,
            stop_token_ids=[ids("<|im_end|>"), ids("<|endoftext|>")],
            on_log=lambda metrics, step: logged.append((time.perf_counter(), metrics)),
        )
    )
    gaps = [b[0] - a[0] for a, b in zip(logged, logged[1:])]
    keep = ("reward", "completions/mean_length", "loss")
    result = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "precision": precision,
        "parameters_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
        "total_s": round(time.perf_counter() - started, 1),
        "s_per_step_after_first": round(sum(gaps) / max(len(gaps), 1), 2),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None,
        "last_step": {k: round(float(v), 3) for k, v in logged[-1][1].items() if k in keep} if logged else None,
    }
    print(json.dumps(result))
    out = Path(os.environ.get("OUT", tempfile.gettempdir()))
    (out / f"gpu_{precision}.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
