"""A policy evaluated on the held-out prompts as the config says, the same way wherever it runs: at the RL stage's
every evaluation (step 0 included) and for a registered version that promotion evaluates.

`evaluate_policy` samples completions as in training (or greedy), scores them with the reward model and the
metric functions (the prompts' other dataset columns as keywords), and adds the verifier's pass@k and maj@n.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from rlhf_core.config import GROUP_ALGORITHMS, PipelineConfig
from rlhf_core.data.chat import extra_columns, prompt_columns
from rlhf_core.evaluation.generations import EvalModels, EvalPrompts, EvalSampling, evaluate_generations
from rlhf_core.evaluation.verifiable import sampled_columns
from rlhf_core.rewards.functions import load_function
from rlhf_core.rollout.engines import RolloutEngine, rollout_seed
from rlhf_core.rollout.sampling import SamplingSettings
from rlhf_core.rollout.tools import load_tool_use

EVAL_STEP = -1  # the step evaluations seed an engine's requests with: the same at every evaluation and in promotion


def metric_functions(specs: list[str]) -> dict:
    """name -> callable for eval.metrics entries ('package.module:function' is named 'function')."""
    return {spec.rsplit(":", 1)[1]: load_function(spec, field="eval.metrics") for spec in specs}


@dataclass(frozen=True)
class LoadedModels:
    """The models an evaluation of a policy reads, loaded by the RL stage (which loads its value model and GRPO's
    other reward sources apart) or for a registered version that promotion evaluates."""

    tokenizer: Any
    policy: Any
    ref_model: Any  # None when the reference is the policy with its adapters disabled, or there is none
    reward_model: Any  # this run's reward model, or None
    stop_ids: list[int]
    eval_ref: Any = None  # the reference evaluation measures the KL to (a frozen copy also for GRPO with beta 0)


def evaluate_policy(
    model,
    step: int,
    *,
    cfg: PipelineConfig,
    models: LoadedModels,
    prompt_rows: list[dict],
    metrics: dict,
    engine: RolloutEngine | None = None,
) -> list[dict]:
    """Completions of the held-out prompts sampled from `model` as in training (or greedy), scored (the loops'
    `evaluate`); with eval.samples_per_prompt n > 1 each row also gets its prompt's pass_at_<k> and maj_at_<n>
    from n more samples that eval.verifier checks. `engine`: what samples (rollout.vllm.evaluate; our loop when
    None), its requests seeded the same at every evaluation and in promotion's. With grpo.tools or grpo.environment
    each prompt is a tool episode, as in training."""
    prompts, messages = prompt_columns(prompt_rows)
    held_out = EvalPrompts(prompts, messages, extra_columns(prompt_rows))
    settings = SamplingSettings(
        response_length=cfg.rl.response_length,
        temperature=cfg.eval_temperature(),
        top_k=cfg.rl.top_k,
        top_p=cfg.rl.top_p,
        greedy=cfg.eval.greedy,
    )
    sampling = EvalSampling(
        settings,
        max_prompt_length=cfg.data.max_prompt_length,
        batch_size=cfg.eval.batch_size,
        stop_token_ids=models.stop_ids,
        tool_use=load_tool_use(cfg.grpo) if cfg.rl.algorithm in GROUP_ALGORITHMS else None,
        template_kwargs=cfg.data.chat_template_kwargs,
    )
    generate = partial(evaluate_generations, device=next(model.parameters()).device, engine=engine)
    scored_by = EvalModels(model, models.tokenizer, models.eval_ref, models.reward_model)
    rows = generate(scored_by, held_out, sampling, metrics, seed=rollout_seed(cfg.run.seed, rank=0, step=EVAL_STEP))
    n = cfg.eval.samples_per_prompt
    if n > 1:
        verifier = cfg.verifier()
        sampled = generate(
            EvalModels(model, models.tokenizer),
            held_out.repeated(n),
            replace(sampling, settings=replace(settings, greedy=False)),
            {verifier: metrics[verifier]},
            seed=rollout_seed(cfg.run.seed, rank=0, step=EVAL_STEP, call=1),
        )
        for row, extra in zip(rows, sampled_columns(sampled, n, verifier, cfg.eval.pass_at_k)):
            row.update(extra)
    return rows
