"""Policy and value initialization, and the RL stage (PPO or GRPO) as Prefect tasks.

`initialize_models` decides and checks every model source before any RL work: the policy (SFT output
or base), the value model (reward model's weights or the policy's), the reference (a frozen copy or,
with LoRA, the policy with its adapters disabled), tokenizer agreement and context length.
`train_policy` then trains with resume, evaluates generations periodically, and registers every
policy checkpoint as a version of registry.policy_model_name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlhf_core.chat import prompt_columns
from rlhf_core.config import PipelineConfig
from rlhf_core.data import read_column, read_rows
from rlhf_core.evaluation import evaluate_generations, summarize_rows
from rlhf_core.grpo import train_grpo
from rlhf_core.models import (
    ModelSourceError,
    generation_config_of,
    load_causal_lm,
    load_tokenizer,
    prepare_for_training,
    run_stop_ids,
)
from rlhf_core.ppo import train_ppo
from rlhf_core.reward_functions import load_function
from rlhf_core.reward_model import load_reward_model
from tasks import launcher, registry, tracking
from tasks.data import PreparedData, resolve_model_source, stage_tokenizer
from tasks.plots import close, curve_figure
from tasks.progress import print_rows, publish_markdown
from tasks.reporting import StageReporter
from tasks.retry import IO_RETRIES
from tasks.stage_io import Checkpoint, stage_key


@dataclass(frozen=True)
class InitPlan:
    """Where each model of the RL stage comes from (paths), and what identifies them in lineage."""

    policy_path: str
    policy_identity: str
    value_path: str | None  # PPO only
    reward_path: str | None  # this run's reward model, when it trained one
    reward_identity: str
    reference: str  # "copy", "adapter_disabled" or "none" (GRPO with beta 0)


def _tokenizer_mismatch(a, b) -> str | None:
    if a.get_vocab() != b.get_vocab():
        return "their vocabularies differ"
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        if getattr(a, name) != getattr(b, name):
            return f"their {name} differ ({getattr(a, name)} vs {getattr(b, name)})"
    return None


def uses_reward_stage(cfg: PipelineConfig) -> bool:
    """PPO always needs this run's reward model; GRPO only when a reward source names 'reward_stage'."""
    return cfg.rl.algorithm == "ppo" or any(r.model == "reward_stage" for r in cfg.grpo.rewards)


def _policy_source(cfg: PipelineConfig, data: PreparedData, sft: Checkpoint | None, logger) -> tuple[str, str]:
    """(path, identity) of the policy's start: the champion, the SFT warm start or the base model."""
    champion = (
        registry.version_by_alias(cfg.registry.policy_model_name, "champion") if cfg.init.policy == "champion" else None
    )
    if champion is not None:  # retraining from what serves today
        policy_identity = f"models:/{cfg.registry.policy_model_name}/{champion.version}"
        return resolve_model_source(policy_identity, field="init.policy", cfg=cfg, world=None), policy_identity
    if cfg.init.policy in ("sft", "champion") and sft is not None:
        if cfg.init.policy == "champion":
            logger.info(
                "no version of %s is champion yet: starting from the SFT warm start", cfg.registry.policy_model_name
            )
        return sft.path, sft.model_uri or f"sft:{sft.key}"
    return data.base_model, cfg.model.base


def _reference(cfg: PipelineConfig) -> str:
    if cfg.rl.algorithm != "ppo" and cfg.grpo.beta == 0:
        return "none"
    if cfg.init.reference == "auto":
        return "adapter_disabled" if cfg.model.lora.enabled else "copy"
    return cfg.init.reference


def _check_sources(cfg: PipelineConfig, data: PreparedData, policy_path: str, reward: Checkpoint | None) -> None:
    """Refuse, before any RL work, an empty prompt set, reward sources whose tokenizer is not the policy's,
    stop tokens the policy's tokenizer lacks, and prompt plus response beyond the policy's context."""
    from transformers import AutoConfig

    if not read_column(data.tables["prompts"], "prompt"):
        raise ValueError(f"data.prompts: the prompt set {data.source('prompts')} is empty")
    policy_tok = load_tokenizer(policy_path, revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code)
    reward_dirs = [reward.path] if reward is not None else []
    if cfg.rl.algorithm != "ppo":
        reward_dirs += [
            resolve_model_source(r.model, field=f"grpo.rewards[{i}].model", cfg=cfg, world=None)
            for i, r in enumerate(cfg.grpo.rewards)
            if r.model not in (None, "reward_stage")
        ]
        for i, r in enumerate(cfg.grpo.rewards):
            if r.function is not None:
                load_function(r.function, field=f"grpo.rewards[{i}].function")  # fail now, not after generating
    for directory in reward_dirs:
        mismatch = _tokenizer_mismatch(policy_tok, load_tokenizer(directory))
        if mismatch:
            raise ModelSourceError(
                f"the reward model's tokenizer ({directory}) does not match the policy's ({policy_path}): {mismatch}; "
                "train the reward model from the policy's tokenizer"
            )
    run_stop_ids(policy_tok, generation_config_of(policy_path, trust_remote_code=cfg.model.trust_remote_code), cfg.rl)
    context = getattr(
        AutoConfig.from_pretrained(policy_path, trust_remote_code=cfg.model.trust_remote_code),
        "max_position_embeddings",
        None,
    )
    needed = cfg.data.max_prompt_length + cfg.rl.response_length
    if context is not None and needed > context:
        raise ValueError(
            f"data.max_prompt_length {cfg.data.max_prompt_length} + rl.response_length {cfg.rl.response_length} = "
            f"{needed} tokens exceeds the policy's context of {context}"
        )


@task(name="initialize-models", cache_policy=NO_CACHE, **IO_RETRIES)
def initialize_models(
    cfg: PipelineConfig, data: PreparedData, sft: Checkpoint | None, reward: Checkpoint | None
) -> InitPlan:
    """Pick the policy, value, reference and reward sources, and check they fit together."""
    logger = launcher.stage_logger()
    policy_path, policy_identity = _policy_source(cfg, data, sft, logger)
    value_path = None
    if cfg.rl.algorithm == "ppo":
        value_path = reward.path if cfg.init.value_from == "reward" else policy_path
    _check_sources(cfg, data, policy_path, reward)
    plan = InitPlan(
        policy_path=policy_path,
        policy_identity=policy_identity,
        value_path=value_path,
        reward_path=reward.path if reward is not None else None,
        reward_identity=(reward.model_uri or f"reward:{reward.key}") if reward is not None else "none",
        reference=_reference(cfg),
    )
    logger.info("policy from %s, value from %s, reference: %s", policy_identity, value_path, plan.reference)
    return plan


def _lora(cfg: PipelineConfig):
    from peft import LoraConfig, TaskType

    lora = cfg.model.lora
    return LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
    )


def metric_functions(specs: list[str]) -> dict:
    """name -> callable for eval.metrics entries ('package.module:function' is named 'function')."""
    return {spec.rsplit(":", 1)[1]: load_function(spec, field="eval.metrics") for spec in specs}


def reward_sources(cfg: PipelineConfig, plan: InitPlan, stage_reward_model) -> list:
    """GRPO's reward sources, loaded: reward models (this run's, a directory, hub name or URI) and functions.

    `stage_reward_model` is this run's reward model, already loaded for evaluation: reused, not loaded twice.
    """
    from transformers import AutoModelForSequenceClassification

    from rlhf_core.grpo import function_reward, model_reward

    sources = []
    for i, r in enumerate(cfg.grpo.rewards):
        if r.function is not None:
            sources.append(
                function_reward(r.name, r.weight, load_function(r.function, field=f"grpo.rewards[{i}].function"))
            )
            continue
        if r.model == "reward_stage":
            model = stage_reward_model
        else:
            path = resolve_model_source(r.model, field=f"grpo.rewards[{i}].model", cfg=cfg, world=None)
            model = AutoModelForSequenceClassification.from_pretrained(path)
        sources.append(model_reward(r.name, r.weight, model.eval().requires_grad_(False)))
    return sources


def rl_key(cfg: PipelineConfig, data: PreparedData, plan: InitPlan) -> str:
    algorithm_cfg = cfg.ppo if cfg.rl.algorithm == "ppo" else cfg.grpo
    return stage_key(
        {
            "rl": cfg.rl.model_dump(mode="json"),
            cfg.rl.algorithm: algorithm_cfg.model_dump(mode="json"),
            "init": cfg.init.model_dump(),
            "lora": cfg.model.lora.model_dump(),
            "policy": plan.policy_identity,
            "value": plan.value_path,
            "reward": plan.reward_identity,
            "prompts": data.fingerprints["prompts"],
            "seed": cfg.run.seed,
            "max_prompt_length": cfg.data.max_prompt_length,
        }
    )


@dataclass(frozen=True)
class RLModels:
    """The loaded models of the RL stage (value model and GRPO's other reward sources are loaded by `_train`)."""

    tokenizer: Any
    policy: Any
    ref_model: Any  # None when the reference is the policy with its adapters disabled, or there is none
    reward_model: Any  # this run's reward model, or None
    stop_ids: list[int]


def load_models(cfg: PipelineConfig, plan: InitPlan) -> RLModels:
    from transformers import AutoModelForSequenceClassification

    tokenizer = stage_tokenizer(cfg, plan.policy_path)
    load = dict(
        revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code, torch_dtype=cfg.model.torch_dtype
    )
    policy = load_causal_lm(plan.policy_path, **load)
    prepare_for_training(policy, gradient_checkpointing=cfg.model.gradient_checkpointing)
    ref_model = load_causal_lm(plan.policy_path, **load) if plan.reference == "copy" else None
    if cfg.model.lora.enabled:
        from peft import get_peft_model

        policy = get_peft_model(policy, _lora(cfg))
    reward_model = AutoModelForSequenceClassification.from_pretrained(plan.reward_path) if plan.reward_path else None
    stop_ids = run_stop_ids(tokenizer, policy.generation_config, cfg.rl)
    return RLModels(
        tokenizer=tokenizer, policy=policy, ref_model=ref_model, reward_model=reward_model, stop_ids=stop_ids
    )


def evaluate_policy(
    model, step: int, *, cfg: PipelineConfig, models: RLModels, prompt_rows: list[dict], metrics: dict
) -> list[dict]:
    """Near-greedy completions of the held-out prompts by `model`, scored (the loops' `evaluate`)."""
    prompts, messages = prompt_columns(prompt_rows)
    return evaluate_generations(
        model,
        models.ref_model,
        models.reward_model,
        models.tokenizer,
        prompts,
        prompt_messages=messages,
        response_length=cfg.rl.response_length,
        max_prompt_length=cfg.data.max_prompt_length,
        metrics=metrics,
        batch_size=cfg.eval.batch_size,
        greedy=cfg.eval.greedy,
        stop_token_ids=models.stop_ids,
        device=next(model.parameters()).device,
    )


class PolicyReporter(StageReporter):
    """The RL stage's reporting: checkpoints tagged with their KL, held-out evaluations, GRPO's completions."""

    def __init__(
        self,
        cfg: PipelineConfig,
        run_id: str,
        data: PreparedData,
        plan: InitPlan,
        key: str,
        out_dir: Path,
        gold: str | None,
    ):
        algorithm = cfg.rl.algorithm
        reward = "objective/scores" if algorithm == "ppo" else "reward"
        super().__init__(
            cfg,
            algorithm,
            run_id,
            data_fingerprint=data.fingerprint,
            model_name=cfg.registry.policy_model_name,
            lineage={
                "stage_key": key,
                "algorithm": algorithm,
                "reward_model_version": plan.reward_identity,
                "base_model": plan.policy_identity,
            },
            curves={
                reward: (reward,),
                "kl": ("objective/kl", "kl"),
                "eval/gold": (f"eval/{gold}_mean",) if gold else (),
            },
        )
        self.key, self.out_dir, self.gold = key, out_dir, gold

    def checkpoint_tags(self, path: Path, step: int) -> dict[str, str]:
        saved = json.loads((path.parent / "metrics.json").read_text())
        kl = saved.get("objective/kl", saved.get("kl"))
        return {"kl": f"{kl:.4f}"} if kl is not None else {}

    def on_eval(self, rows: list[dict], step: int) -> None:
        summary = summarize_rows(rows)
        tracking.log_metrics(self.run_id, summary, step)
        # one MLflow table and one Parquet file per evaluation step: nothing is overwritten
        tracking.log_table(self.run_id, [{"step": step, **r} for r in rows], f"eval/completions_step_{step:06d}.json")
        self.artifact(save_eval_rows(self.out_dir, rows, step), "eval")
        self.record(summary, step)
        self.publish_table(f"{self.stage}-eval-step-{step}", rows[:20], f"Held-out completions at step {step}")
        print_rows(rows[:5], f"{self.stage.upper()} held-out completions at step {step} (first 5 of {len(rows)})")
        self.logger.info("eval at step %d: %s", step, ", ".join(f"{k}={v:.3f}" for k, v in summary.items()))

    def on_completions(self, rows: list[dict], step: int) -> None:
        """GRPO's sampled completions of one step as <out_dir>/completions/completions_step_NNNNNN.parquet."""
        import pandas as pd

        path = self.out_dir / "completions" / f"completions_step_{step:06d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(rows).to_parquet(path)
        self.artifact(path, "completions")

    def finish(self, result) -> Checkpoint:
        """The progress completed, curves and the evaluation report published; the stage's Checkpoint."""
        self.done()
        if result.skipped_steps:
            self.logger.warning("%d optimizer steps were skipped because a loss was not finite", result.skipped_steps)
        if next(iter(self.history.values())):
            self.plot(f"{self.stage}_curves.png", self.stage.upper(), {k: v for k, v in self.history.items() if v})
        evals = load_eval_history(self.out_dir)  # every evaluation of this stage key, resumed attempts included
        if launcher.is_main():
            report_evaluations(self.run_id, self.stage, evals, self.gold)
        final_step = max(evals) if evals else None
        return Checkpoint(
            path=str((result.checkpoint / "policy").resolve()),
            model_uri=self.registered.get(result.step),
            step=result.step,
            metrics=result.metrics,
            key=self.key,
            extra={
                "resumed_from": result.resumed_from,
                "skipped_steps": result.skipped_steps,
                "gold": self.gold,
                "eval_history": {s: summarize_rows(r) for s, r in evals.items()},
                "final_eval": summarize_rows(evals[final_step]) if evals else {},
                "final_rows": evals[final_step][:5] if evals else [],
            },
        )


def _train(
    cfg: PipelineConfig, data: PreparedData, plan: InitPlan, models: RLModels, reporter: PolicyReporter, evaluate
):
    """PPO or GRPO with the reporter's callbacks; the loop's result."""
    prompt_rows = read_rows(data.tables["prompts"])
    common = dict(
        max_prompt_length=cfg.data.max_prompt_length,
        output_dir=reporter.out_dir,
        on_log=reporter.log,
        on_checkpoint=reporter.on_checkpoint,
        on_eval=reporter.on_eval,
        evaluate=evaluate,
        eval_every=cfg.eval.every_steps,
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
            **common,
        )
    return train_grpo(
        models.policy,
        models.ref_model,
        reward_sources(cfg, plan, models.reward_model),
        models.tokenizer,
        prompt_rows,
        cfg.rl,
        cfg.grpo,
        cfg.run,
        on_completions=reporter.on_completions,
        **common,
    )


@task(name="train-policy", cache_policy=NO_CACHE, **IO_RETRIES)
def train_policy(cfg: PipelineConfig, data: PreparedData, plan: InitPlan, parent_run_id: str) -> Checkpoint:
    """PPO or GRPO on the prompt set; resume, evaluate, register every checkpoint as a policy version."""
    if cfg.run.num_processes > 1 and not launcher.launched():
        return launcher.launch("rl", cfg, data=data, plan=plan, parent_run_id=parent_run_id)
    key = rl_key(cfg, data, plan)
    out_dir = cfg.run.output_dir / cfg.rl.algorithm / key
    with tracking.stage_run(parent_run_id, cfg.rl.algorithm) as run_id:
        models = load_models(cfg, plan)
        metrics = metric_functions(cfg.eval.metrics)
        evaluate = partial(
            evaluate_policy,
            cfg=cfg,
            models=models,
            metrics=metrics,
            prompt_rows=read_rows(data.tables["eval_prompts"])[: cfg.eval.num_prompts],
        )
        reporter = PolicyReporter(cfg, run_id, data, plan, key, out_dir, gold=next(iter(metrics), None))
        reporter.register_saved(out_dir, "policy")
        reporter.start(cfg.rl.total_steps, f"{cfg.rl.algorithm.upper()}: {cfg.rl.total_steps} steps")
        if launcher.is_main() and not (out_dir.exists() and any(out_dir.glob("checkpoint-*"))):
            reporter.on_eval(evaluate(models.policy, 0), 0)  # the starting point, for the before/after comparison
        return reporter.finish(_train(cfg, data, plan, models, reporter, evaluate))


def save_eval_rows(out_dir: Path, rows: list[dict], step: int) -> Path:
    """<out_dir>/eval/eval_step_NNNNNN.parquet: the rows of one evaluation, with their step."""
    import pandas as pd

    path = out_dir / "eval" / f"eval_step_{step:06d}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".parquet.tmp")
    pd.DataFrame([{"step": step, **r} for r in rows]).to_parquet(tmp)
    tmp.replace(path)
    return path


def load_eval_history(out_dir: Path) -> dict[int, list[dict]]:
    """step -> rows of every evaluation saved under <out_dir>/eval."""
    import pandas as pd

    history = {}
    for path in sorted((out_dir / "eval").glob("eval_step_*.parquet")):
        frame = pd.read_parquet(path)
        rows = [
            {k: (None if isinstance(v, float) and v != v else v) for k, v in r.items() if k != "step"}
            for r in frame.to_dict(orient="records")
        ]
        history[int(path.stem.rsplit("_", 1)[1])] = rows
    return history


def report_evaluations(run_id: str, algorithm: str, evals: dict[int, list[dict]], gold: str | None) -> None:
    """The reward, gold metric and KL of every evaluation against step: a PNG in MLflow, linked from a
    Prefect markdown artifact that also tabulates the numbers."""
    if not evals:
        return
    summaries = {step: summarize_rows(rows) for step, rows in sorted(evals.items())}
    columns = [c for c in ("score", gold, "kl", "length") if c]
    series = {c: [(s, m[f"eval/{c}_mean"]) for s, m in summaries.items() if f"eval/{c}_mean" in m] for c in columns}
    series = {f"eval {c}" + (" (gold)" if c == gold else ""): v for c, v in series.items() if v}
    artifact = "eval/eval_curves.png"
    fig = curve_figure(series, f"{algorithm.upper()}: held-out evaluation")
    tracking.log_figure(run_id, fig, artifact)
    close(fig)
    link = tracking.artifact_link(run_id, artifact)
    present = [c for c in columns if any(f"eval/{c}_mean" in m for m in summaries.values())]
    lines = [
        f"# {algorithm.upper()} evaluation on held-out prompts",
        "",
        f"Reward, gold metric and KL against step: [{artifact}]({link})",
        "",
        "| step | " + " | ".join(present) + " |",
        "|---" * (len(present) + 1) + "|",
    ]
    for step, m in summaries.items():
        lines.append(
            f"| {step} | "
            + " | ".join(f"{m[f'eval/{c}_mean']:.4f}" if f"eval/{c}_mean" in m else "" for c in present)
            + " |"
        )
    if gold and len(summaries) > 1:
        first, last = summaries[min(summaries)], summaries[max(summaries)]
        key = f"eval/{gold}_mean"
        if key in first and key in last:
            lines += ["", f"Gold metric `{gold}`: {first[key]:.4f} -> {last[key]:.4f} ({last[key] - first[key]:+.4f})"]
    publish_markdown(f"{algorithm}-evaluation", "\n".join(lines), f"{algorithm.upper()} held-out evaluation")
