"""A registered policy version evaluated on the held-out prompts, for promotion (flows/promote.py).

`evaluate_version` samples completions as in training, seeded, so the candidate and the champion are
scored on the same draws: with the candidate's reward model and reference, and `eval.metrics`.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlhf_core.chat import prompt_columns
from rlhf_core.config import PipelineConfig
from rlhf_core.data import read_rows
from rlhf_core.determinism import seed_everything
from rlhf_core.evaluation import evaluate_generations, summarize_rows
from tasks.data import PreparedData, resolve_model_source
from tasks.retry import IO_RETRIES
from tasks.rl import metric_functions


def _model_dir(source: str, cfg: PipelineConfig, data: PreparedData, field: str) -> str:
    if source == cfg.model.base and data.demo_world is not None:
        return data.base_model
    return resolve_model_source(source, field=field, cfg=cfg, world=None)


@task(name="evaluate-version", cache_policy=NO_CACHE, **IO_RETRIES)
def evaluate_version(
    cfg: PipelineConfig, data: PreparedData, model_uri: str, reference: str | None, reward_model: str | None
) -> tuple[dict[str, float], list[dict]]:
    """Completions sampled as in training of the held-out prompts by `model_uri`, scored; (summary, rows)."""
    from transformers import AutoModelForSequenceClassification

    from rlhf_core.models import load_causal_lm, load_pretrained, load_tokenizer, run_stop_ids

    policy_dir = _model_dir(model_uri, cfg, data, "registry")
    tokenizer = load_tokenizer(policy_dir)
    policy = load_causal_lm(policy_dir).eval()
    ref = load_causal_lm(_model_dir(reference, cfg, data, "base_model tag")).eval() if reference else None
    reward = (
        load_pretrained(
            AutoModelForSequenceClassification, _model_dir(reward_model, cfg, data, "reward_model_version tag")
        ).eval()
        if reward_model
        else None
    )
    prompts, messages = prompt_columns(
        read_rows(data.tables["eval_prompts"])[: cfg.promote.num_prompts or cfg.eval.num_prompts]
    )
    seed_everything(cfg.run.seed)  # sampled as in training, seeded: the same draws for candidate and champion
    rows = evaluate_generations(
        policy,
        ref,
        reward,
        tokenizer,
        prompts,
        response_length=cfg.rl.response_length,
        max_prompt_length=cfg.data.max_prompt_length,
        metrics=metric_functions(cfg.eval.metrics),
        batch_size=cfg.eval.batch_size,
        greedy=cfg.eval.greedy,
        temperature=cfg.eval_temperature(),
        top_k=cfg.rl.top_k,
        top_p=cfg.rl.top_p,
        stop_token_ids=run_stop_ids(tokenizer, policy.generation_config, cfg.rl),
        prompt_messages=messages,
    )
    return summarize_rows(rows), rows
