"""A demo policy against its SFT start as a user would check it, apart from the pipeline's own evaluation.

On every held-out prompt of the demo world (the 15% of prompts no seed trains on), each model answers once
greedily and `samples` times sampled at temperature 1 with up to `max_new_tokens` tokens, through
transformers' own `generate` and the exported files only. What a reader of the answers counts:

- gold: VADER's compound of the greedy answer (the demo's gold metric);
- words: the sampled answers' mean length in whitespace words, the stop tokens not counted ("standard ." is
  two words), so that a shorter answer reads as one;
- distinct-2: distinct word bigrams over all sampled answers.

`python -m bench.helpers.heldout_check RUN_DIR` checks a demo run directory's export against its sft/.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NUM_HELDOUT = 324  # the held-out prompts the demo's templates can write: every one of them


def heldout_prompts() -> list[list[dict]]:
    """Every held-out prompt of the demo world as user messages, in a fixed order (any seed's set)."""
    from rlhf_core.demo.text import ReviewWriter, distinct_prompts, load_vader_lexicon

    writer = ReviewWriter(random.Random(0), load_vader_lexicon())
    return [row["prompt"] for row in distinct_prompts(writer, True, NUM_HELDOUT)]


def load(model_dir: Path):
    """(model, left-padding tokenizer, stop ids) from a saved model directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    return model, tokenizer, GenerationConfig.from_pretrained(model_dir).eos_token_id


def answers(loaded, prompts: list[list[dict]], sample: bool, max_new_tokens: int, seed: int) -> list[str]:
    """One answer per prompt from a `load`ed model, decoded without special tokens."""
    import torch

    model, tokenizer, stops = loaded
    texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            **batch,
            max_new_tokens=max_new_tokens,
            do_sample=sample,
            temperature=1.0 if sample else None,
            top_k=0 if sample else None,
            top_p=1.0 if sample else None,
            eos_token_id=stops,
            pad_token_id=tokenizer.pad_token_id,
        )
    return tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)


def measure(model_dir: Path, prompts: list[list[dict]], samples: int, max_new_tokens: int, seed: int) -> dict:
    from rlhf_core.evaluation.generations import distinct_n
    from rlhf_core.rewards.functions import vader_compound

    loaded = load(model_dir)
    greedy = answers(loaded, prompts, False, max_new_tokens, seed)
    sampled = [a for k in range(samples) for a in answers(loaded, prompts, True, max_new_tokens, seed + k)]
    return {
        "gold": sum(vader_compound(completions=greedy)) / len(greedy),
        "words": sum(len(a.split()) for a in sampled) / len(sampled),
        "distinct_2": distinct_n(sampled, 2),
        "examples": sampled[:8],
    }


def compare(sft_dir: Path, policy_dir: Path, samples: int = 4, max_new_tokens: int = 16, seed: int = 0) -> dict:
    """The policy's gold gain over its SFT start, and its length (words) and distinct-2 as ratios to the start's."""
    prompts = heldout_prompts()
    start = measure(sft_dir, prompts, samples, max_new_tokens, seed)
    end = measure(policy_dir, prompts, samples, max_new_tokens, seed)
    return {
        "check_gain": end["gold"] - start["gold"],
        "check_words": [start["words"], end["words"]],
        "check_length_ratio": end["words"] / start["words"],
        "check_distinct_2_ratio": end["distinct_2"] / start["distinct_2"],
        "check_examples": {"sft": start["examples"], "policy": end["examples"]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a demo run directory (holding sft/ and export/)")
    parser.add_argument("--policy", type=Path, help="the policy to check; default: RUN_DIR/export")
    args = parser.parse_args()
    result = compare(args.run_dir / "sft", args.policy or args.run_dir / "export")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
