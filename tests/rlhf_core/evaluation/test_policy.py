"""A policy evaluated as the config says: held-out rows scored by the reward model with the KL to the reference,
and with eval.samples_per_prompt n > 1 each prompt's pass@k and maj@n from n more samples its verifier checks."""

from __future__ import annotations

import torch

from rlhf_core.config import load_config
from rlhf_core.demo.world import world_rows
from rlhf_core.evaluation.policy import LoadedModels, evaluate_policy, metric_functions
from rlhf_core.models.loading import load_causal_lm, load_tokenizer, run_stop_ids
from tests.conftest import SMOKE


def every_other_right(prompts, completions, **_):
    return [1.0 if i % 2 == 0 else 0.0 for i in range(len(completions))]


def test_rows_carry_the_kl_and_each_prompts_pass_at_k_from_the_verifiers_samples(smoke_world):
    cfg = load_config(
        SMOKE,
        [
            "eval.samples_per_prompt=2",
            "eval.pass_at_k=[1, 2]",
            f"eval.metrics=['{__name__}:every_other_right']",
        ],
    )
    tok, policy = load_tokenizer(str(smoke_world.tokenizer)), load_causal_lm(str(smoke_world.base_model))
    ref = load_causal_lm(str(smoke_world.base_model))
    models = LoadedModels(tok, policy, None, None, run_stop_ids(tok, policy.generation_config, cfg.rl), eval_ref=ref)
    prompt_rows = world_rows(smoke_world, "prompt", "test")[:3]
    metrics = metric_functions(cfg.eval.metrics)
    torch.manual_seed(0)
    rows = evaluate_policy(policy, 0, cfg=cfg, models=models, prompt_rows=prompt_rows, metrics=metrics)
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in prompt_rows]
    assert all(r["kl_exact"] == 0.0 for r in rows)  # the reference is the same weights
    # the verifier's samples alternate right, wrong: one of two right per prompt
    assert [(r["pass_at_1"], r["pass_at_2"]) for r in rows] == [(0.5, 1.0)] * 3
    assert all("maj_at_2" in r for r in rows)
