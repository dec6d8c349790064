"""The RL stage (PPO, the GRPO family or DPO) as a Prefect task, from the `InitPlan` of tasks/stages/initialization.py.

`rl_stage` loads the policy, its reference and the reward sources into one `RLInputs` per attempt, trains with
resume under the guard (tasks/stages/rl/guard.py: each evaluation judged; stop, or roll back to the last checkpoint
that passed every rule), and registers every policy checkpoint as a version of registry.policy_model_name
(tasks/stages/rl/reporting.py); `export.select` picks the one it hands on (tasks/stages/rl/checkpoint_selection.py). The stage is named for its algorithm: its MLflow run, its directory under
run.output_dir, its versions' `stage` tag and, in the flow, its Prefect task are `ppo` or `grpo`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlhf_core.config import GROUP_ALGORITHMS, PipelineConfig, RewardSource
from rlhf_core.config.training import keyed_sections, reads_grpo_rewards
from rlhf_core.data.tables import read_rows
from rlhf_core.evaluation.policy import LoadedModels, evaluate_policy, metric_functions
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
from rlhf_core.rl.dpo import train_dpo
from rlhf_core.rl.grpo import grpo_batch_sizes, train_grpo
from rlhf_core.rl.inputs import PromptSet, RLHooks, RLInputs, RLModels, RLSettings
from rlhf_core.rl.online_dpo import train_online_dpo
from rlhf_core.rl.ppo import train_ppo
from rlhf_core.rollout.engines import vllm_server
from tasks import tracking
from tasks.launch import launcher
from tasks.runtime.retry import IO_RETRIES
from tasks.stage_io import Checkpoint, stage_key
from tasks.stages.data import PreparedData, resolve_model_source
from tasks.stages.initialization import InitPlan
from tasks.stages.rl import remote_rewards
from tasks.stages.rl.guard import Guard, guarded_training
from tasks.stages.rl.reporting import PolicyReporter


def eval_functions(cfg: PipelineConfig) -> dict:
    """What evaluation scores besides the reward model: eval.metrics, and GRPO's reward functions (the proxy
    reward's other parts) as columns `reward_<name>`, each function once (`scored_as_metric`)."""
    functions = metric_functions(cfg.eval.metrics)
    if reads_grpo_rewards(cfg.rl.algorithm):  # the GRPO family and online DPO read grpo.rewards
        for i, source in enumerate(cfg.grpo.rewards):
            if source.function is not None and not scored_as_metric(cfg, source):
                functions[f"reward_{source.name}"] = load_reward_function(
                    source.function, source.arguments, field=f"grpo.rewards[{i}]"
                )
    return functions | remote_rewards.eval_scorers(cfg)


def scored_as_metric(cfg: PipelineConfig, source: RewardSource) -> bool:
    """Whether the grpo.rewards function `source` is an eval.metrics entry too (the same function, no arguments
    bound): its column `reward_<name>` would repeat the metric's value for value, so evaluation keeps the
    metric's column, which the guard's gold metric and promotion read (unless guard.divergence names the
    `reward_<name>` column)."""
    read = {cfg.guard.divergence.proxy, cfg.guard.divergence.gold}
    return source.function in (cfg.eval.metrics or []) and not source.arguments and f"reward_{source.name}" not in read


def reward_sources(cfg: PipelineConfig, plan: InitPlan, stage_reward_model) -> list:
    """GRPO's reward sources, loaded: reward models (this run's, a directory, hub name or URI), functions and
    scorers served elsewhere (tasks/stages/rl/remote_rewards.py), in grpo.rewards' order.

    `stage_reward_model` is this run's reward model, already loaded for evaluation: reused, not loaded twice.
    """
    from transformers import AutoModelForSequenceClassification

    from rlhf_core.rewards.sources import function_reward, model_reward

    sources, remote = [], remote_rewards.remote_sources(cfg)
    for i, r in enumerate(cfg.grpo.rewards):
        if i in remote:
            sources.append(remote[i])
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
        sizes = grpo_batch_sizes(cfg.rl, cfg.grpo)  # scored micro-batch by micro-batch, as the policy's passes
        model = model.eval().requires_grad_(False)
        sources.append(
            model_reward(r.name, r.weight, model, micro_batch=sizes.micro_batch, max_tokens=sizes.max_tokens)
        )
    return sources


def rl_key(cfg: PipelineConfig, data: PreparedData, plan: InitPlan) -> str:
    rl, section = keyed_sections(cfg.rl, cfg.ppo, cfg.grpo, cfg.dpo)  # laid out as before settings moved: keys kept
    trained_on = "preference" if cfg.rl.algorithm == "dpo" else "prompts"  # offline DPO: the pairs
    return stage_key(
        {
            "rl": rl,
            cfg.rl.algorithm: section
            | ({"rewards": remote_rewards.keyed_rewards(cfg)} if reads_grpo_rewards(cfg.rl.algorithm) else {}),
            "init": cfg.init.model_dump(),
            "lora": cfg.model.lora.model_dump(),
            # identities, never paths: a run directory that is moved keeps its keys (the value model's
            # source is init.value_from over these two)
            "policy": plan.policy_identity,
            "reward": plan.reward_identity,
            trained_on: data.fingerprints[trained_on],
            "seed": cfg.run.seed,
            "max_prompt_length": cfg.data.max_prompt_length,
            **({"rollout": engine} if (engine := cfg.rollout.result_fields()) else {}),
        }
    )


def load_models(cfg: PipelineConfig, plan: InitPlan) -> LoadedModels:
    from transformers import AutoModelForSequenceClassification

    tokenizer = model_tokenizer(cfg.model, plan.policy_path)
    load = dict(
        revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code, torch_dtype=cfg.model.torch_dtype
    )
    policy = load_causal_lm(plan.policy_path, **load)
    prepare_for_training(policy, gradient_checkpointing=cfg.model.checkpointing)
    ref_model = load_causal_lm(plan.policy_path, **load) if plan.reference == "copy" else None
    if cfg.model.lora.enabled:
        from peft import get_peft_model

        with MODEL_BUILDING:
            policy = get_peft_model(policy, lora_config(cfg.model.lora, "CAUSAL_LM"))
    reward_model = load_pretrained(AutoModelForSequenceClassification, plan.reward_path) if plan.reward_path else None
    stop_ids = run_stop_ids(tokenizer, policy.generation_config, cfg.rl)
    # GRPO with beta 0 trains without a reference, but the eval KL to the initial policy is measured all the same
    eval_ref = load_causal_lm(plan.policy_path, **load).eval() if plan.reference == "none" else ref_model
    return LoadedModels(
        tokenizer=tokenizer,
        policy=policy,
        ref_model=ref_model,
        reward_model=reward_model,
        stop_ids=stop_ids,
        eval_ref=eval_ref,
    )


def fresh_models(
    cfg: PipelineConfig, plan: InitPlan, functions: dict, eval_rows: list[dict]
) -> tuple[LoadedModels, Callable[[Any, int], list[dict]]]:
    """One training attempt's freshly loaded models, and `evaluate(model, step)`: the held-out prompts
    `eval_rows` completed and scored with them (the loops' `evaluate`)."""
    models = load_models(cfg, plan)
    return models, partial(evaluate_policy, cfg=cfg, models=models, metrics=functions, prompt_rows=eval_rows)


def stage_hooks(cfg: PipelineConfig, reporter: PolicyReporter, guard: Guard) -> RLHooks:
    """What the stage hears from its trainer: logs, checkpoints and completions go to the reporter, evaluations
    (every eval.every_steps steps) to the guard, which judges them and tells the reporter."""
    return RLHooks(
        on_log=reporter.log,
        on_checkpoint=reporter.on_checkpoint,
        on_eval=guard.evaluated,
        eval_every=cfg.eval.every_steps,
        on_completions=reporter.on_completions if cfg.rl.algorithm in GROUP_ALGORITHMS else None,
    )


def trainer_inputs(
    cfg: PipelineConfig,
    data: PreparedData,
    plan: InitPlan,
    out_dir: Path,
    hooks: RLHooks,
    models: LoadedModels,
    evaluate: Callable,
    kl_scale: float,
) -> RLInputs:
    """One attempt's input to its trainer: the loaded models (PPO's value model loaded here, the GRPO family's and
    online DPO's reward sources), the prompts (offline DPO: the preference pairs), the config's sections with the
    guard's `kl_scale`, the stage's `hooks` with the attempt's `evaluate(model, step)`."""
    prompt_rows = read_rows(data.tables["preference" if cfg.rl.algorithm == "dpo" else "prompts"])
    trained = RLModels(models.policy, models.tokenizer, reference=models.ref_model)
    if cfg.rl.algorithm == "ppo":
        value = load_reward_model(
            plan.value_path, models.tokenizer, seed=cfg.run.seed, torch_dtype=cfg.model.torch_dtype
        )
        prepare_for_training(value, gradient_checkpointing=cfg.model.checkpointing)
        trained = replace(trained, value=value, reward_model=models.reward_model)
    elif reads_grpo_rewards(cfg.rl.algorithm):  # offline DPO: the pairs alone, no reward source
        remote_rewards.check_template_columns(cfg, set(prompt_rows[0]))  # before the first step
        trained = replace(trained, rewards=reward_sources(cfg, plan, models.reward_model))
    settings = RLSettings(
        cfg.rl,
        cfg.run,
        ppo=cfg.ppo,
        grpo=cfg.grpo,
        dpo=cfg.dpo,
        rollout=cfg.rollout,
        kl_scale=kl_scale,
        stop_token_ids=tuple(models.stop_ids),  # the ones evaluation stops on
        template_kwargs=cfg.data.chat_template_kwargs,
    )
    prompts = PromptSet(prompt_rows, cfg.data.max_prompt_length, cfg.data.max_length)
    return RLInputs(trained, prompts, settings, out_dir, replace(hooks, evaluate=evaluate))


@contextmanager
def rollout_server(cfg: PipelineConfig, plan: InitPlan, out_dir: Path) -> Iterator[PipelineConfig]:
    """`cfg` naming the vLLM server of the stage in rollout.vllm.url (started here from the stage's start policy
    and stopped when the block ends, unless the config names one), or `cfg` as it is for rollout.engine hf."""
    with vllm_server(
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


TRAINERS = {"ppo": train_ppo, "dpo": train_dpo, "online_dpo": train_online_dpo}  # the rest: the GRPO family


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
        remote_rewards.reward_servers(cfg, plan.reward_identity, out_dir) as cfg,
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
        PolicyReporter(cfg, run_id, data, plan, key, guard := Guard(cfg, out_dir), gold=cfg.gold_metric()) as reporter,
    ):
        guard.listener = reporter.listener()
        # the tables it reads, on the stage run (an attempt's run after a rollback is nested in it)
        tracking.logs.log_datasets(run_id, data.inputs_for("prompts", "eval_prompts"))
        reporter.register_saved(out_dir, "policy")
        reporter.start(cfg.rl.total_steps, f"{cfg.rl.algorithm.upper()}: {cfg.rl.total_steps} steps")
        functions = eval_functions(cfg)
        eval_rows = read_rows(data.tables["eval_prompts"])[: cfg.eval.num_prompts]
        load = partial(fresh_models, cfg, plan, functions, eval_rows)
        inputs_for = partial(trainer_inputs, cfg, data, plan, out_dir, stage_hooks(cfg, reporter, guard))
        trainer = TRAINERS.get(cfg.rl.algorithm, train_grpo)
        return reporter.finish(guarded_training(guard, load, inputs_for, trainer))


def worker_body(cfg: PipelineConfig, inputs: dict) -> Checkpoint:
    """`rl_stage`'s body in one of the processes `launcher.launch` started (`inputs` as JSON)."""
    return rl_stage.fn(cfg, PreparedData(**inputs["data"]), InitPlan(**inputs["plan"]), inputs["parent_run_id"])
