"""The peak memory per device against run.memory_budget_gib, checked before any training: the estimate of
`rlhf_core.models.memory` (the models' shapes read offline, no weights built), which `rlhf validate` prints and
`rlhf run` checks before it imports the pipeline. Light: torch is imported only to read a model's shape from a
directory or the local Hugging Face cache, never for the demo."""

from __future__ import annotations

from rlhf_core.config import GROUP_ALGORITHMS, PREFERENCE_ALGORITHMS, PipelineConfig
from rlhf_core.config.errors import UserError
from rlhf_core.models.memory import GIB, MemoryEstimate, StageEstimate, estimate_memory, strategy_of


class MemoryBudgetError(UserError):
    """A config whose estimated peak memory per device exceeds run.memory_budget_gib; one sentence."""


def check_memory(cfg: PipelineConfig) -> MemoryEstimate:
    """The estimate; raises MemoryBudgetError when its peak exceeds run.memory_budget_gib."""
    estimate = estimate_memory(cfg)
    problem = budget_problem(cfg, estimate)
    if problem is not None:
        raise MemoryBudgetError(problem)
    return estimate


def budget_problem(cfg: PipelineConfig, estimate: MemoryEstimate) -> str | None:
    """The sentence refusing `estimate` under run.memory_budget_gib: the estimate, its largest parts and what to
    change; None within the budget, without one, or when the policy's shape is unknown."""
    budget, peak = cfg.run.memory_budget_gib, estimate.peak
    if budget is None or peak is None or peak.total <= budget * GIB:
        return None
    largest = ", ".join(f"{p.name} {p.bytes / GIB:.1f}" for p in peak.parts[:3])
    return (
        f"run.memory_budget_gib {budget:g} is below the estimated peak of {peak.total / GIB:.1f} GiB per device "
        f"(the {peak.stage} stage's {largest} GiB); lower it with {remedies(cfg, peak)}, or raise the budget"
    )


def remedies(cfg: PipelineConfig, peak: StageEstimate) -> str:
    """What lowers `peak`, as config fields: fewer sequences per micro-batch, then the memory options not yet on."""
    algorithm = cfg.rl.algorithm
    if peak.stage in ("sft", "reward"):
        options = [f"a smaller {peak.stage}.batch_size (more {peak.stage}.gradient_accumulation_steps)"]
    elif algorithm in GROUP_ALGORITHMS:
        options = ["smaller micro-batches (more grpo.steps_per_generation or rl.gradient_accumulation_steps)"]
    elif algorithm == "ppo":
        options = ["smaller micro-batches (more rl.gradient_accumulation_steps or ppo.num_mini_batches)"]
    else:
        options = ["smaller micro-batches (more rl.gradient_accumulation_steps)"]
    budgeted = algorithm not in PREFERENCE_ALGORITHMS and not (strategy_of(cfg) or "").startswith("zero")
    if peak.stage not in ("sft", "reward") and budgeted:  # the token budget: refused for DPO and under DeepSpeed
        options.append("rl.max_tokens_per_micro_batch")
    if not cfg.model.checkpointing:
        options.append("model.gradient_checkpointing true")
    if peak.stage != "sft" and not (cfg.reward.lora if peak.stage == "reward" else cfg.model.lora.enabled):
        options.append("reward.lora true" if peak.stage == "reward" else "model.lora.enabled true")
    if cfg.model.torch_dtype == "float32":
        options.append("bf16 (model.torch_dtype bfloat16, or run.mixed_precision bf16 for the activations)")
    return ", ".join(options[:-1]) + f" or {options[-1]}" if len(options) > 1 else options[0]
