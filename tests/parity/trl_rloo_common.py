"""Parity of our RLOO with TRL 1.16's `RLOOTrainer`: the helpers of tests/parity/test_trl_rloo.py.

Nothing here re-implements TRL: every expected value comes out of a real `trl.RLOOTrainer` built offline (the
`make_rloo_trainer` fixture, tests/parity/conftest.py) around the tiny seeded Llama and the word-level
tokenizer of trl_grpo_common.py. Only generation (`_generate`: fixed completions) and reward calling
(`_calculate_rewards`: a fixed rewards-per-function tensor, NaN for None) are replaced (`drive_trl_rloo_scoring`).

With beta > 0 TRL builds its reference model itself, with `from_pretrained` on the policy's `_name_or_path`:
`trained_policy` saves the seeded initial policy to a directory (the reference TRL loads) and returns a copy
loaded from there whose weights were moved by seeded noise, a policy some steps into training, so that the KL
to the reference is far from 0 (a sequence's summed k1 KL is O(1)).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.parity.trl_grpo_common import build_policy, fake_completions

WEIGHT_NOISE = 0.05  # the trained policy's distance from the reference: summed per-sequence KL of O(1)


def save_reference(directory: Path, seed: int = 0) -> Path:
    """The initial policy (build_policy(seed)), saved where TRL's reference model will be loaded from."""
    build_policy(seed).save_pretrained(directory)
    return directory


def trained_policy(reference_dir: Path, seed: int = 11):
    """The reference loaded from `reference_dir` (so its `_name_or_path` points there), weights moved by noise."""
    from transformers import LlamaForCausalLM

    policy = LlamaForCausalLM.from_pretrained(str(reference_dir))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * WEIGHT_NOISE)
    assert policy.config._name_or_path == str(reference_dir)
    return policy


def drive_trl_rloo_scoring(trainer, per_source: torch.Tensor, completions: list[list[int]] | None = None) -> dict:
    """Run TRL's real `RLOOTrainer._generate_and_score_completions` on fixed completions and rewards (B, F).

    Prompts are all 3 tokens long (no left padding: TRL's default positions equal our mask-derived ones)."""
    batch = per_source.shape[0]
    G = trainer.num_generations
    prompt_ids = [[3 + g % 20, 4 + g % 20, 5 + g % 20] for g in range(batch // G) for _ in range(G)]
    completion_ids = completions if completions is not None else fake_completions(batch)
    texts = trainer.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
    trainer._generate = lambda prompts: (prompt_ids, completion_ids, texts)
    trainer._calculate_rewards = lambda inputs, prompts, completions, ids: per_source.clone()
    trainer._metrics["train"].clear()
    inputs = [{"prompt": f"w{3 + i // G} w{4 + i // G}"} for i in range(batch)]
    return trainer._generate_and_score_completions(inputs)
