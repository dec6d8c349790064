"""A registered policy version evaluated on the held-out prompts, for promotion (flows/promote.py).

`evaluate_version` evaluates as the RL stage does (`rlhf_core.evaluation.policy.evaluate_policy`: sampled as
in training or greedy, the prompts' dataset columns for the metric functions, the verifier's pass@k and maj@n),
seeded as the RL stage's step-0 evaluation, so the candidate and the champion are scored on the same draws,
with what `VersionScoring` names (the evaluator's reward model or metric functions, the reference). With rollout.vllm.evaluate the samples come
from a vLLM server holding the version (`version_engine`), seeded as every evaluation of the RL stage: the
stage's numbers for that checkpoint again.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlhf_core.config import PipelineConfig
from rlhf_core.data.tables import read_rows
from rlhf_core.evaluation.generations import summarize_rows
from rlhf_core.evaluation.policy import LoadedModels, evaluate_policy, metric_functions
from rlhf_core.rollout.engines import RolloutEngine, VllmEngine, model_name_at, vllm_server
from rlhf_core.rollout.vllm_server import VllmClient
from rlhf_core.training.determinism import seed_everything
from tasks.runtime.retry import IO_RETRIES
from tasks.stages.data import PreparedData, resolve_model_source


def _model_dir(source: str, cfg: PipelineConfig, data: PreparedData, field: str) -> str:
    if source == cfg.model.base and data.demo_world is not None:
        return data.base_model
    return resolve_model_source(source, field=field, cfg=cfg, world=None)


@contextmanager
def version_engine(cfg: PipelineConfig, policy, policy_dir: str) -> Iterator[RolloutEngine | None]:
    """With rollout.vllm.evaluate, a vLLM engine holding the version's weights (a server started from it, or the
    one rollout.vllm.url names, the weights pushed), so promotion samples as the RL stage's evaluation did."""
    if cfg.rollout.engine != "vllm" or not cfg.rollout.vllm.evaluate:
        yield None
        return
    length = cfg.data.max_prompt_length + cfg.rl.response_length
    with (
        vllm_server(cfg.rollout, Path(policy_dir), max_model_len=length, seed=cfg.run.seed) as url,
        tempfile.TemporaryDirectory(prefix="rlhf-version-weights-") as weights,
    ):
        engine = VllmEngine(VllmClient(url, model_name_at(url)), Path(weights))
        engine.refresh(policy, 0)
        yield engine


@dataclass(frozen=True)
class VersionScoring:
    """What a version's completions are scored with: the KL to `reference`, `reward_model`'s score (None: no
    score column) and the `metrics` functions ('module:function'), on `prompt_rows` (the held-out rows)."""

    reference: str | None
    reward_model: str | None
    metrics: tuple[str, ...]
    prompt_rows: list[dict]


def held_out_rows(cfg: PipelineConfig, data: PreparedData) -> list[dict]:
    """The held-out prompt rows promotion compares on: the first promote.num_prompts (else eval.num_prompts)."""
    return read_rows(data.tables["eval_prompts"])[: cfg.promote.num_prompts or cfg.eval.num_prompts]


@task(name="evaluate-version", cache_policy=NO_CACHE, **IO_RETRIES)
def evaluate_version(
    cfg: PipelineConfig, data: PreparedData, model_uri: str, scoring: VersionScoring
) -> tuple[dict[str, float], list[dict]]:
    """Completions sampled as in training of the held-out prompts by `model_uri`, scored; (summary, rows)."""
    from transformers import AutoModelForSequenceClassification

    from rlhf_core.models.loading import load_causal_lm, load_pretrained, load_tokenizer, run_stop_ids

    policy_dir = _model_dir(model_uri, cfg, data, "registry")
    tokenizer = load_tokenizer(policy_dir)
    policy = load_causal_lm(policy_dir).eval()
    reference, reward_model = scoring.reference, scoring.reward_model
    ref = load_causal_lm(_model_dir(reference, cfg, data, "base_model tag")).eval() if reference else None
    reward = (
        load_pretrained(AutoModelForSequenceClassification, _model_dir(reward_model, cfg, data, "reward model")).eval()
        if reward_model
        else None
    )
    models = LoadedModels(
        tokenizer=tokenizer,
        policy=policy,
        ref_model=ref,
        reward_model=reward,
        stop_ids=run_stop_ids(tokenizer, policy.generation_config, cfg.rl),
        eval_ref=ref,
    )
    seed_everything(cfg.run.seed)  # sampled as in training, seeded: the same draws for candidate and champion
    # the RL stage's evaluation: dataset columns for the metric functions, the verifier's pass@k and maj@n
    with version_engine(cfg, policy, policy_dir) as engine:
        rows = evaluate_policy(
            policy,
            0,
            cfg=cfg,
            models=models,
            prompt_rows=scoring.prompt_rows,
            metrics=metric_functions(list(scoring.metrics)),
            engine=engine,
        )
    return summarize_rows(rows), rows
