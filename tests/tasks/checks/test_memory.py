"""tasks/checks/memory.py: the estimated peak memory per device against run.memory_budget_gib, refused in one
sentence that names the field, the estimate, its largest parts and what to change."""

from __future__ import annotations

import pytest

from rlhf_core.config import load_config
from rlhf_core.models.memory import GIB, MemoryEstimate, estimate_memory
from rlhf_core.models.shapes import llama_shape
from tasks.checks.memory import MemoryBudgetError, budget_problem, check_memory

QWEN_05B = llama_shape(151936, 896, 24, 14, 2, 4864, attention_bias=True)


def qwen_estimate(cfg) -> MemoryEstimate:
    return estimate_memory(cfg, shapes=lambda source, field: QWEN_05B)


# the batches whole, as before micro-batches of 8 became the default outside the demo: the hand-computed figures
WHOLE = ["sft.batch_size=32", "reward.batch_size=32", "rl.gradient_accumulation_steps=1"]


def config(*overrides: str):
    return load_config(None, ["model.base=/models/qwen", "run.device=cuda", *WHOLE, "rl.algorithm=grpo", *overrides])


def test_over_the_budget_is_one_sentence_with_the_estimate_its_parts_and_what_to_change():
    cfg = config("run.memory_budget_gib=10")
    estimate = qwen_estimate(cfg)
    peak = estimate.peak
    problem = budget_problem(cfg, estimate)
    assert problem.startswith(f"run.memory_budget_gib 10 is below the estimated peak of {peak.total / GIB:.1f} GiB")
    assert f"the {peak.stage} stage's {peak.parts[0].name} {peak.parts[0].bytes / GIB:.1f}, " in problem
    assert peak.stage == "reward"  # this run's reward model, 64 sequences of 1024 tokens
    for remedy in ("reward.batch_size", "reward.lora true", "model.torch_dtype bfloat16", "or raise the budget"):
        assert remedy in problem
    assert "model.gradient_checkpointing" not in problem  # on already (not the demo)
    assert problem.count(". ") == 0 and "\n" not in problem


def test_the_rl_stage_s_remedies_name_its_micro_batch_fields():
    cfg = config(
        "run.memory_budget_gib=1", "grpo.rewards=[{name: f, function: 'm:f'}]", "model.gradient_checkpointing=false"
    )
    problem = budget_problem(cfg, qwen_estimate(cfg))
    assert "the rl (grpo) stage's" in problem
    assert "grpo.steps_per_generation or rl.gradient_accumulation_steps" in problem
    assert "rl.max_tokens_per_micro_batch" in problem and "model.gradient_checkpointing true" in problem


def test_within_the_budget_without_one_or_unknown_nothing_is_refused():
    assert budget_problem(config("run.memory_budget_gib=1000"), qwen_estimate(config())) is None
    assert budget_problem(config(), qwen_estimate(config())) is None
    assert budget_problem(config("run.memory_budget_gib=0"), MemoryEstimate("cuda", (), ("x",))) is None


def test_check_memory_raises_a_user_error_for_the_demo_over_its_budget():
    with pytest.raises(MemoryBudgetError, match=r"^run.memory_budget_gib 0.01 is below the estimated peak of "):
        check_memory(load_config(None, ["run.memory_budget_gib=0.01", "run.device=cpu"]))
    assert check_memory(load_config(None, ["run.device=cpu"])).peak is not None
