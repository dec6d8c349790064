"""The RL stage (PPO or GRPO) as a Prefect task, from the `InitPlan` of tasks/stages/initialization.py.

`rl_stage` loads the policy, its reference and the reward sources, trains with resume under the guard
(tasks/stages/guard.py: stop, or roll back to the last checkpoint that passed every rule), evaluates generations
of the held-out prompts periodically, and registers every policy checkpoint as a version of
registry.policy_model_name (tasks/stages/rl_reporting.py); `export.select` picks the one it hands on
(tasks/stages/checkpoint_selection.py). The stage is named for its algorithm: its MLflow run, its directory under
run.output_dir, its versions' `stage` tag and, in the flow, its Prefect task are `ppo` or `grpo`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlhf_core.config import PipelineConfig
from rlhf_core.data.tables import read_rows
from rlhf_core.models.loading import (
    MODEL_BUILDING,
    load_causal_lm,
    load_pretrained,
    lora_config,
    model_tokenizer,
    prepare_for_training,
    run_stop_ids,
)
from rlhf_core.rewards.functions import load_reward_function
from rlhf_core.rewards.reward_model import load_reward_model
from rlhf_core.rl.grpo import train_grpo
from rlhf_core.rl.ppo import train_ppo
from rlhf_core.rollout.engines import serving
from tasks import reward_endpoints, tracking
from tasks.launch import launcher
from tasks.retry import IO_RETRIES
from tasks.stage_io import Checkpoint, stage_key
from tasks.stages.data import PreparedData, resolve_model_source
from tasks.stages.guard import guarded_training
from tasks.stages.initialization import InitPlan
from tasks.stages.policy_evaluation import RLModels, evaluate_policy, metric_functions
from tasks.stages.rl_reporting import PolicyReporter


def eval_functions(cfg: PipelineConfig) -> dict:
    """What evaluation scores besides the reward model: eval.metrics, and GRPO's reward functions (the proxy
    reward's other parts) as columns `reward_<name>`."""
    functions = metric_functions(cfg.eval.metrics)
    if cfg.rl.algorithm != "ppo":  # the GRPO family reads grpo.rewards
        for i, source in enumerate(cfg.grpo.rewards):
            if source.function is not None:
                functions[f"reward_{source.name}"] = load_reward_function(
                    source.function, source.arguments, field=f"grpo.rewards[{i}]"
                )
    return functions | reward_endpoints.eval_scorers(cfg)


def reward_sources(cfg: PipelineConfig, plan: InitPlan, stage_reward_model) -> list:
    """GRPO's reward sources, loaded: reward models (this run's, a directory, hub name or URI), functions and
    scorers served elsewhere (tasks/reward_endpoints.py), in grpo.rewards' order.

    `stage_reward_model` is this run's reward model, already loaded for evaluation: reused, not loaded twice.
    """
    from transformers import AutoModelForSequenceClassification

    from rlhf_core.rewards.sources import function_reward, model_reward

    sources, served = [], reward_endpoints.served_sources(cfg)
    for i, r in enumerate(cfg.grpo.rewards):
        if i in served:
            sources.append(served[i])
            continue
        if r.function is not None:
            sources.append(
                function_reward(
                    r.name, r.weight, load_reward_function(r.function, r.arguments, field=f"grpo.rewards[{i}]")
                )
            )
            continue
        if r.model == "reward_stage":
            model = stage_reward_model
        else:
            path = resolve_model_source(r.model, field=f"grpo.rewards[{i}].model", cfg=cfg, world=None)
            model = load_pretrained(AutoModelForSequenceClassification, path)
        sources.append(model_reward(r.name, r.weight, model.eval().requires_grad_(False)))
    return sources


def rl_key(cfg: PipelineConfig, data: PreparedData, plan: InitPlan) -> str:
    algorithm_cfg = cfg.ppo if cfg.rl.algorithm == "ppo" else cfg.grpo
    return stage_key(
        {
            "rl": cfg.rl.model_dump(mode="json"),
            cfg.rl.algorithm: algorithm_cfg.model_dump(mode="json")
            | ({"rewards": reward_endpoints.keyed_rewards(cfg)} if cfg.rl.algorithm != "ppo" else {}),
            "init": cfg.init.model_dump(),
            "lora": cfg.model.lora.model_dump(),
            # identities, never paths: a run directory that is moved keeps its keys (the value model's
            # source is init.value_from over these two)
            "policy": plan.policy_identity,
            "reward": plan.reward_identity,
            "prompts": data.fingerprints["prompts"],
            "seed": cfg.run.seed,
            "max_prompt_length": cfg.data.max_prompt_length,
            **({"rollout": engine} if (engine := cfg.rollout.result_fields()) else {}),
        }
    )


def load_models(cfg: PipelineConfig, plan: InitPlan) -> RLModels:
    from transformers import AutoModelForSequenceClassification

    tokenizer = model_tokenizer(cfg.model, plan.policy_path)
    load = dict(
        revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code, torch_dtype=cfg.model.torch_dtype
    )
    policy = load_causal_lm(plan.policy_path, **load)
    prepare_for_training(policy, gradient_checkpointing=cfg.model.gradient_checkpointing)
    ref_model = load_causal_lm(plan.policy_path, **load) if plan.reference == "copy" else None
    if cfg.model.lora.enabled:
        from peft import get_peft_model

        with MODEL_BUILDING:
            policy = get_peft_model(policy, lora_config(cfg.model.lora, "CAUSAL_LM"))
    reward_model = load_pretrained(AutoModelForSequenceClassification, plan.reward_path) if plan.reward_path else None
    stop_ids = run_stop_ids(tokenizer, policy.generation_config, cfg.rl)
    # GRPO with beta 0 trains without a reference, but the eval KL to the initial policy is measured all the same
    eval_ref = load_causal_lm(plan.policy_path, **load).eval() if plan.reference == "none" else ref_model
    return RLModels(
        tokenizer=tokenizer,
        policy=policy,
        ref_model=ref_model,
        reward_model=reward_model,
        stop_ids=stop_ids,
        eval_ref=eval_ref,
    )


def fresh_models(
    cfg: PipelineConfig, plan: InitPlan, functions: dict, eval_rows: list[dict]
) -> tuple[RLModels, Callable[[Any, int], list[dict]]]:
    """One training attempt's freshly loaded models, and `evaluate(model, step)`: the held-out prompts
    `eval_rows` completed and scored with them (the loops' `evaluate`)."""
    models = load_models(cfg, plan)
    return models, partial(evaluate_policy, cfg=cfg, models=models, metrics=functions, prompt_rows=eval_rows)


def _train(
    cfg: PipelineConfig,
    data: PreparedData,
    plan: InitPlan,
    models: RLModels,
    reporter: PolicyReporter,
    evaluate,
    kl_scale: float = 1.0,
):
    """PPO or GRPO with the reporter's callbacks, the KL coefficient (or GRPO's beta) times `kl_scale` (the
    guard's rollbacks); the loop's result."""
    prompt_rows = read_rows(data.tables["prompts"])
    common = dict(
        max_prompt_length=cfg.data.max_prompt_length,
        output_dir=reporter.out_dir,
        stop_token_ids=models.stop_ids,  # the ones evaluation stops on
        on_log=reporter.log,
        on_checkpoint=reporter.on_checkpoint,
        on_eval=reporter.on_eval,
        evaluate=evaluate,
        eval_every=cfg.eval.every_steps,
        rollout=cfg.rollout,
    )
    if cfg.rl.algorithm == "ppo":
        value_model = load_reward_model(
            plan.value_path, models.tokenizer, seed=cfg.run.seed, torch_dtype=cfg.model.torch_dtype
        )
        return train_ppo(
            models.policy,
            value_model,
            models.ref_model,
            models.reward_model,
            models.tokenizer,
            [r["prompt"] for r in prompt_rows],
            cfg.rl,
            cfg.ppo,
            cfg.run,
            kl_scale=kl_scale,
            **common,
        )
    reward_endpoints.check_template_columns(cfg, set(prompt_rows[0]))  # before the first step
    return train_grpo(
        models.policy,
        models.ref_model,
        reward_sources(cfg, plan, models.reward_model),
        models.tokenizer,
        prompt_rows,
        cfg.rl,
        cfg.grpo.model_copy(update={"beta": cfg.grpo.beta * kl_scale}),
        cfg.run,
        on_completions=reporter.on_completions,
        template_kwargs=cfg.data.chat_template_kwargs,
        **common,
    )


@contextmanager
def rollout_server(cfg: PipelineConfig, plan: InitPlan, out_dir: Path) -> Iterator[PipelineConfig]:
    """`cfg` naming the vLLM server of the stage in rollout.vllm.url (started here from the stage's start policy
    and stopped when the block ends, unless the config names one), or `cfg` as it is for rollout.engine hf."""
    with serving(
        cfg.rollout,
        Path(plan.policy_path),
        max_model_len=cfg.data.max_prompt_length + cfg.rl.response_length,
        seed=cfg.run.seed,
        trust_remote_code=cfg.model.trust_remote_code,
        log_path=out_dir / "vllm-server.log",
    ) as url:
        if url is None or url == cfg.rollout.vllm.url:
            yield cfg
            return
        vllm = cfg.rollout.vllm.model_copy(update={"url": url})
        yield cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"vllm": vllm})})


@task(name="rl", cache_policy=NO_CACHE, **IO_RETRIES)
def rl_stage(cfg: PipelineConfig, data: PreparedData, plan: InitPlan, parent_run_id: str) -> Checkpoint:
    """PPO or GRPO on the prompt set; resume, evaluate, register every checkpoint as a policy version. With
    rollout.engine vllm, one server for the stage (and all its processes)."""
    key = rl_key(cfg, data, plan)
    out_dir = cfg.run.output_dir / cfg.rl.algorithm / key
    if launcher.launched():
        return _stage(cfg, data, plan, parent_run_id, key, out_dir)
    with (
        rollout_server(cfg, plan, out_dir) as cfg,
        reward_endpoints.reward_servers(cfg, plan.reward_identity, out_dir) as cfg,
    ):
        if cfg.run.num_processes > 1:
            return launcher.launch("rl", worker_body, cfg, out_dir, data=data, plan=plan, parent_run_id=parent_run_id)
        return _stage(cfg, data, plan, parent_run_id, key, out_dir)


def _stage(cfg: PipelineConfig, data: PreparedData, plan: InitPlan, parent_run_id: str, key: str, out_dir: Path):
    """The stage in this process: its MLflow run, its reporter, training under the guard."""
    with (
        tracking.runs.stage_run(
            parent_run_id, cfg.rl.algorithm, tracking.runs.stage_params(cfg, cfg.rl.algorithm)
        ) as run_id,
        PolicyReporter(cfg, run_id, data, plan, key, out_dir, gold=cfg.gold_metric()) as reporter,
    ):
        reporter.register_saved(out_dir, "policy")
        reporter.start(cfg.rl.total_steps, f"{cfg.rl.algorithm.upper()}: {cfg.rl.total_steps} steps")
        functions = eval_functions(cfg)
        eval_rows = read_rows(data.tables["eval_prompts"])[: cfg.eval.num_prompts]
        load = partial(fresh_models, cfg, plan, functions, eval_rows)
        train = partial(_train, cfg, data, plan, reporter=reporter)
        return reporter.finish(guarded_training(cfg, reporter, load, train))


def worker_body(cfg: PipelineConfig, inputs: dict) -> Checkpoint:
    """`rl_stage`'s body in one of the processes `launcher.launch` started (`inputs` as JSON)."""
    return rl_stage.fn(cfg, PreparedData(**inputs["data"]), InitPlan(**inputs["plan"]), inputs["parent_run_id"])
