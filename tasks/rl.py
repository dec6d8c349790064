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
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlhf_core.config import PipelineConfig
from rlhf_core.data import read_column, read_rows
from rlhf_core.evaluation import evaluate_generations, summarize_rows
from rlhf_core.models import (
    ModelSourceError, generation_config_of, load_causal_lm, load_tokenizer, prepare_for_training, stop_token_ids,
)
from rlhf_core.grpo import train_grpo
from rlhf_core.ppo import train_ppo
from rlhf_core.reward_model import load_reward_model
from rlhf_core.reward_functions import load_function
from tasks import distributed, tracking
from tasks.data import PreparedData, resolve_model_source
from tasks.plots import close, curve_figure
from tasks.progress import StageProgress, print_rows, publish_markdown, publish_table
from tasks.retry import IO_RETRIES
from tasks.stage_io import Checkpoint, register_saved_checkpoints, stage_key


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


@task(name="initialize-models", cache_policy=NO_CACHE, **IO_RETRIES)
def initialize_models(cfg: PipelineConfig, data: PreparedData, sft: Checkpoint | None, reward: Checkpoint | None) -> InitPlan:
    """Pick the policy, value, reference and reward sources, and check they fit together."""
    logger = distributed.stage_logger()
    champion = tracking.version_by_alias(cfg.registry.policy_model_name, "champion") if cfg.init.policy == "champion" else None
    if champion is not None:  # retraining from what serves today
        policy_identity = f"models:/{cfg.registry.policy_model_name}/{champion.version}"
        policy_path = resolve_model_source(policy_identity, field="init.policy", cfg=cfg, world=None)
    elif cfg.init.policy in ("sft", "champion") and sft is not None:
        if cfg.init.policy == "champion":
            logger.info("no version of %s is champion yet: starting from the SFT warm start", cfg.registry.policy_model_name)
        policy_path, policy_identity = sft.path, sft.model_uri or f"sft:{sft.key}"
    else:
        policy_path, policy_identity = data.base_model, cfg.model.base
    ppo = cfg.rl.algorithm == "ppo"
    value_path = (reward.path if cfg.init.value_from == "reward" else policy_path) if ppo else None
    reference = cfg.init.reference
    if not ppo and cfg.grpo.beta == 0:
        reference = "none"
    elif reference == "auto":
        reference = "adapter_disabled" if cfg.model.lora.enabled else "copy"

    prompts = read_column(data.tables["prompts"], "prompt")
    if not prompts:
        raise ValueError(f"data.prompts: the prompt set {data.source('prompts')} is empty")
    policy_tok = load_tokenizer(policy_path, revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code)
    reward_dirs = [reward.path] if reward is not None else []
    if not ppo:
        reward_dirs += [resolve_model_source(r.model, field=f"grpo.rewards[{i}].model", cfg=cfg, world=None)
                        for i, r in enumerate(cfg.grpo.rewards) if r.model not in (None, "reward_stage")]
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
    # the stop tokens are checked against the policy's tokenizer now, not after the reward stage
    stop_token_ids(policy_tok, generation_config_of(policy_path, trust_remote_code=cfg.model.trust_remote_code),
                   stop_token=cfg.rl.stop_token, stop_tokens=cfg.rl.stop_tokens)
    from transformers import AutoConfig

    context = getattr(AutoConfig.from_pretrained(policy_path, trust_remote_code=cfg.model.trust_remote_code),
                      "max_position_embeddings", None)
    needed = cfg.data.max_prompt_length + cfg.rl.response_length
    if context is not None and needed > context:
        raise ValueError(
            f"data.max_prompt_length {cfg.data.max_prompt_length} + rl.response_length {cfg.rl.response_length} = "
            f"{needed} tokens exceeds the policy's context of {context}"
        )
    plan = InitPlan(policy_path=policy_path, policy_identity=policy_identity, value_path=value_path,
                    reward_path=reward.path if reward is not None else None,
                    reward_identity=(reward.model_uri or f"reward:{reward.key}") if reward is not None else "none",
                    reference=reference)
    logger.info("policy from %s, value from %s, reference: %s", policy_identity, value_path, reference)
    return plan


def _lora(cfg: PipelineConfig):
    from peft import LoraConfig, TaskType

    lora = cfg.model.lora
    return LoraConfig(task_type=TaskType.CAUSAL_LM, r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=list(lora.target_modules))


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
            sources.append(function_reward(r.name, r.weight, load_function(r.function, field=f"grpo.rewards[{i}].function")))
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
    return stage_key({
        "rl": cfg.rl.model_dump(mode="json"), cfg.rl.algorithm: algorithm_cfg.model_dump(mode="json"),
        "init": cfg.init.model_dump(), "lora": cfg.model.lora.model_dump(), "policy": plan.policy_identity,
        "value": plan.value_path, "reward": plan.reward_identity, "prompts": data.fingerprints["prompts"],
        "seed": cfg.run.seed, "max_prompt_length": cfg.data.max_prompt_length,
    })


@task(name="train-policy", cache_policy=NO_CACHE, **IO_RETRIES)
def train_policy(cfg: PipelineConfig, data: PreparedData, plan: InitPlan, parent_run_id: str) -> Checkpoint:
    """PPO or GRPO on the prompt set; resume, evaluate, register every checkpoint as a policy version."""
    from transformers import AutoModelForSequenceClassification

    if cfg.run.num_processes > 1 and not distributed.launched():
        return distributed.launch("rl", cfg, data=data, plan=plan, parent_run_id=parent_run_id)
    logger = distributed.stage_logger()
    algorithm = cfg.rl.algorithm
    key = rl_key(cfg, data, plan)
    out_dir = cfg.run.output_dir / algorithm / key
    name = cfg.registry.policy_model_name
    with tracking.stage_run(parent_run_id, algorithm) as run_id:
        tokenizer = load_tokenizer(plan.policy_path, revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code)
        load = dict(revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code, torch_dtype=cfg.model.torch_dtype)
        policy = load_causal_lm(plan.policy_path, **load)
        prepare_for_training(policy, gradient_checkpointing=cfg.model.gradient_checkpointing)
        ref_model = load_causal_lm(plan.policy_path, **load) if plan.reference == "copy" else None
        if cfg.model.lora.enabled:
            from peft import get_peft_model

            policy = get_peft_model(policy, _lora(cfg))
        reward_model = AutoModelForSequenceClassification.from_pretrained(plan.reward_path) if plan.reward_path else None
        prompt_rows = read_rows(data.tables["prompts"])
        eval_prompts = read_column(data.tables["eval_prompts"], "prompt")[: cfg.eval.num_prompts]
        metrics_fns = metric_functions(cfg.eval.metrics)
        stop_ids = stop_token_ids(tokenizer, policy.generation_config, stop_token=cfg.rl.stop_token,
                                  stop_tokens=cfg.rl.stop_tokens)

        def evaluate(model, step: int) -> list[dict]:
            return evaluate_generations(model, ref_model, reward_model, tokenizer, eval_prompts,
                                        response_length=cfg.rl.response_length, max_prompt_length=cfg.data.max_prompt_length,
                                        metrics=metrics_fns, batch_size=cfg.eval.batch_size, greedy=cfg.eval.greedy,
                                        stop_token_ids=stop_ids, device=next(model.parameters()).device)

        registered: dict[int, str] = {}

        def register(policy_dir: Path, step: int) -> None:
            if not cfg.tracking.register_models:
                return
            saved = json.loads((policy_dir.parent / "metrics.json").read_text())
            kl = saved.get("objective/kl", saved.get("kl"))
            tags = tracking.lineage_tags(
                stage=algorithm, step=step, config_hash=cfg.config_hash(), data_fingerprint=data.fingerprint,
                stage_key=key, algorithm=algorithm, reward_model_version=plan.reward_identity,
                base_model=plan.policy_identity, **({"kl": f"{kl:.4f}"} if kl is not None else {}),
            )
            registered[step] = tracking.register_once(policy_dir, name, task="text-generation", tags=tags, run_id=run_id,
                                                    keep_last=cfg.registry.keep_last_versions)
            logger.info("%s checkpoint %d is %s", algorithm, step, registered[step])

        register_saved_checkpoints(out_dir, "policy", register)
        progress = StageProgress(f"{algorithm}-progress", f"{algorithm.upper()}: {cfg.rl.total_steps} steps")
        reward_key_name = "objective/scores" if algorithm == "ppo" else "reward"
        history: dict[str, list[tuple[int, float]]] = {reward_key_name: [], "kl": [], "eval/gold": []}
        gold = next(iter(metrics_fns), None)

        def on_log(metrics: dict[str, float], step: int) -> None:
            tracking.log_metrics(run_id, metrics, step)
            history[reward_key_name].append((step, metrics[reward_key_name]))
            if "objective/kl" in metrics or "kl" in metrics:
                history["kl"].append((step, metrics.get("objective/kl", metrics.get("kl"))))
            progress.update(step, cfg.rl.total_steps)

        def on_eval(rows: list[dict], step: int) -> None:
            summary = summarize_rows(rows)
            tracking.log_metrics(run_id, summary, step)
            # one MLflow table and one Parquet file per evaluation step: nothing is overwritten
            tracking.log_table(run_id, [{"step": step, **r} for r in rows], f"eval/completions_step_{step:06d}.json")
            tracking.log_artifact(run_id, save_eval_rows(out_dir, rows, step), "eval")
            if gold:
                history["eval/gold"].append((step, summary[f"eval/{gold}_mean"]))
            publish_table(f"{algorithm}-eval-step-{step}", rows[:20], f"Held-out completions at step {step}")
            print_rows(rows[:5], f"{algorithm.upper()} held-out completions at step {step} (first 5 of {len(rows)})")
            logger.info("eval at step %d: %s", step, ", ".join(f"{k}={v:.3f}" for k, v in summary.items()))

        def on_completions(rows: list[dict], step: int) -> None:
            import pandas as pd

            path = out_dir / "completions" / f"completions_step_{step:06d}.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            pd.DataFrame(rows).to_parquet(path)
            tracking.log_artifact(run_id, path, "completions")

        if distributed.is_main() and not (out_dir.exists() and any(out_dir.glob("checkpoint-*"))):
            on_eval(evaluate(policy, 0), 0)  # the starting point, for the before/after comparison
        common = dict(max_prompt_length=cfg.data.max_prompt_length, output_dir=out_dir, on_log=on_log,
                      on_checkpoint=register, on_eval=on_eval, evaluate=evaluate, eval_every=cfg.eval.every_steps)
        if algorithm == "ppo":
            value_model = load_reward_model(plan.value_path, tokenizer, seed=cfg.run.seed, torch_dtype=cfg.model.torch_dtype)
            result = train_ppo(policy, value_model, ref_model, reward_model, tokenizer, [r["prompt"] for r in prompt_rows],
                               cfg.rl, cfg.ppo, cfg.run, **common)
        else:
            result = train_grpo(policy, ref_model, reward_sources(cfg, plan, reward_model), tokenizer, prompt_rows, cfg.rl, cfg.grpo,
                                cfg.run, on_completions=on_completions, **common)
        progress.update(cfg.rl.total_steps, cfg.rl.total_steps)
        if result.skipped_steps:
            logger.warning("%d optimizer steps were skipped because a loss was not finite", result.skipped_steps)
        if history[reward_key_name]:
            fig = curve_figure({k: v for k, v in history.items() if v}, algorithm.upper())
            tracking.log_figure(run_id, fig, f"{algorithm}_curves.png")
            close(fig)
        evals = load_eval_history(out_dir)  # every evaluation of this stage key, resumed attempts included
        if distributed.is_main():
            report_evaluations(run_id, algorithm, evals, gold)
        final_step = max(evals) if evals else None
        return Checkpoint(path=str((result.checkpoint / "policy").resolve()), model_uri=registered.get(result.step),
                          step=result.step, metrics=result.metrics, key=key,
                          extra={"resumed_from": result.resumed_from, "skipped_steps": result.skipped_steps,
                                 "gold": gold, "eval_history": {s: summarize_rows(r) for s, r in evals.items()},
                                 "final_eval": summarize_rows(evals[final_step]) if evals else {},
                                 "final_rows": evals[final_step][:5] if evals else []})


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
        rows = [{k: (None if isinstance(v, float) and v != v else v) for k, v in r.items() if k != "step"}
                for r in frame.to_dict(orient="records")]
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
    lines = [f"# {algorithm.upper()} evaluation on held-out prompts", "",
             f"Reward, gold metric and KL against step: [{artifact}]({link})", "",
             "| step | " + " | ".join(present) + " |", "|---" * (len(present) + 1) + "|"]
    for step, m in summaries.items():
        lines.append(f"| {step} | " + " | ".join(f"{m[f'eval/{c}_mean']:.4f}" if f"eval/{c}_mean" in m else "" for c in present) + " |")
    if gold and len(summaries) > 1:
        first, last = summaries[min(summaries)], summaries[max(summaries)]
        key = f"eval/{gold}_mean"
        if key in first and key in last:
            lines += ["", f"Gold metric `{gold}`: {first[key]:.4f} -> {last[key]:.4f} ({last[key] - first[key]:+.4f})"]
    publish_markdown(f"{algorithm}-evaluation", "\n".join(lines), f"{algorithm.upper()} held-out evaluation")
