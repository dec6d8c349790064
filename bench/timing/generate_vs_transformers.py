"""Rollout generation: seconds per batch of rlhf_core.rollout.generation.generate against transformers' own
`model.generate` on the same batch, the floor an RL step's generate phase cannot beat without another
engine (the target is within 10%).

Same tiny Llama (the demo world's base), the same 32 templated prompts, left-padded, sampling at
temperature 0.7, and exactly RESPONSE new tokens on both sides (no stop token, min_new_tokens =
max_new_tokens), so both do identical work; interleaved, best of REPEATS each.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from rlhf_core.config import DemoModelConfig, DemoWorldConfig
from rlhf_core.demo.world import build_demo_world, world_rows
from rlhf_core.models.loading import load_causal_lm, load_tokenizer
from rlhf_core.rollout.generation import generate, left_pad, tokenize_prompts
from rlhf_core.rollout.sampling import SamplingSettings

BATCH, RESPONSE, REPEATS, SEED = 32, 64, 5, 42


def run_ours(model, ids, mask, pad: int) -> float:
    settings = SamplingSettings(response_length=RESPONSE, temperature=0.7)
    start = time.perf_counter()
    with torch.no_grad():
        out = generate(model, ids, mask, settings, pad_token_id=pad)
    assert out.shape == (BATCH, RESPONSE)
    return time.perf_counter() - start


def run_hf(model, ids, mask, pad: int) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=0.7,
            top_k=0,
            top_p=1.0,
            max_new_tokens=RESPONSE,
            min_new_tokens=RESPONSE,
            pad_token_id=pad,
        )
    assert out.shape == (BATCH, ids.shape[1] + RESPONSE)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(SEED)
    with tempfile.TemporaryDirectory() as tmp:
        world = build_demo_world(Path(tmp) / "world", SEED, DemoWorldConfig(), DemoModelConfig())
        model, tok = load_causal_lm(str(world.base_model)).eval(), load_tokenizer(str(world.tokenizer))
        prompts = [r["prompt"] for r in world_rows(world, "prompt", "train")][:BATCH]
        ids, mask = left_pad(tokenize_prompts(tok, prompts, 20), tok.pad_token_id)
        ours, anchor = [], []
        run_hf(model, ids, mask, tok.pad_token_id)  # warm-up, not timed
        for side in "HOOHHOOHHO":  # interleaved: drifting load hits both alike
            if side == "H":
                anchor.append(run_hf(model, ids, mask, tok.pad_token_id))
            else:
                ours.append(run_ours(model, ids, mask, tok.pad_token_id))
    result = {
        "metric": "seconds per generated batch",
        "unit": "s/batch",
        "ours": min(ours),
        "anchor": min(anchor),
        "anchor_name": "transformers model.generate",
        "ratio": min(ours) / min(anchor),
        "notes": (
            f"{BATCH} prompts x {RESPONSE} new tokens, sampling at temperature 0.7, KV cache on both sides, "
            f"demo tiny Llama, best of {len(ours)}, CPU; target <= 1.10"
        ),
    }
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
