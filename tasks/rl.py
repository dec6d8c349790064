"""Policy and value initialization, and the RL stage (PPO) as Prefect tasks.

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
from prefect.logging import get_run_logger

from rlhf_core.config import PipelineConfig
from rlhf_core.data import read_column
from rlhf_core.evaluation import evaluate_generations, summarize_rows
from rlhf_core.models import ModelSourceError, load_causal_lm, load_tokenizer, prepare_for_training
from rlhf_core.ppo import train_ppo
from rlhf_core.reward import load_reward_model
from rlhf_core.rewards import load_function
from tasks import tracking
from tasks.data import PreparedData
from tasks.plots import close, curve_figure
from tasks.progress import StageProgress, publish_table
from tasks.stage_io import Checkpoint, register_saved_checkpoints, stage_key


@dataclass(frozen=True)
class InitPlan:
    """Where each model of the RL stage comes from (paths), and what identifies them in lineage."""

    policy_path: str
    policy_identity: str
    value_path: str
    reward_path: str
    reward_identity: str
    reference: str  # "copy" or "adapter_disabled"


def _tokenizer_mismatch(a, b) -> str | None:
    if a.get_vocab() != b.get_vocab():
        return "their vocabularies differ"
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        if getattr(a, name) != getattr(b, name):
            return f"their {name} differ ({getattr(a, name)} vs {getattr(b, name)})"
    return None


@task(name="initialize-models", cache_policy=NO_CACHE)
def initialize_models(cfg: PipelineConfig, data: PreparedData, sft: Checkpoint | None, reward: Checkpoint) -> InitPlan:
    """Pick the policy, value, reference and reward sources, and check they fit together."""
    logger = get_run_logger()
    if cfg.init.policy == "sft" and sft is not None:
        policy_path, policy_identity = sft.path, sft.model_uri or f"sft:{sft.key}"
    else:
        policy_path, policy_identity = data.base_model, cfg.model.base
    value_path = reward.path if cfg.init.value_from == "reward" else policy_path
    reference = cfg.init.reference
    if reference == "auto":
        reference = "adapter_disabled" if cfg.model.lora.enabled else "copy"

    prompts = read_column(data.tables["prompts"], "prompt")
    if not prompts:
        raise ValueError(f"data.prompts: the prompt set {data.source('prompts')} is empty")
    policy_tok = load_tokenizer(policy_path, revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code)
    reward_tok = load_tokenizer(reward.path)
    mismatch = _tokenizer_mismatch(policy_tok, reward_tok)
    if mismatch:
        raise ModelSourceError(
            f"the reward model's tokenizer ({reward.path}) does not match the policy's ({policy_path}): {mismatch}; "
            "train the reward model from the policy's tokenizer"
        )
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
                    reward_path=reward.path, reward_identity=reward.model_uri or f"reward:{reward.key}", reference=reference)
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


@task(name="train-policy", cache_policy=NO_CACHE)
def train_policy(cfg: PipelineConfig, data: PreparedData, plan: InitPlan, parent_run_id: str) -> Checkpoint:
    """PPO on the prompt set against the reward model; resume, evaluate, register every checkpoint."""
    from transformers import AutoModelForSequenceClassification

    logger = get_run_logger()
    algorithm = cfg.rl.algorithm
    key = stage_key({
        "rl": cfg.rl.model_dump(mode="json"), "ppo": cfg.ppo.model_dump(mode="json"), "init": cfg.init.model_dump(),
        "lora": cfg.model.lora.model_dump(), "policy": plan.policy_identity, "value": plan.value_path,
        "reward": plan.reward_identity, "prompts": data.fingerprints["prompts"], "seed": cfg.run.seed,
        "max_prompt_length": cfg.data.max_prompt_length,
    })
    out_dir = cfg.run.output_dir / algorithm / key
    name = cfg.registry.policy_model_name
    with tracking.stage_run(parent_run_id, algorithm) as run_id:
        tokenizer = load_tokenizer(plan.policy_path, revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code)
        load = dict(revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code, torch_dtype=cfg.model.torch_dtype)
        policy = load_causal_lm(plan.policy_path, **load)
        prepare_for_training(policy, gradient_checkpointing=cfg.model.gradient_checkpointing)
        ref_model = None
        if plan.reference == "adapter_disabled":
            from peft import get_peft_model

            policy = get_peft_model(policy, _lora(cfg))
        else:
            ref_model = load_causal_lm(plan.policy_path, **load)
            if cfg.model.lora.enabled:
                from peft import get_peft_model

                policy = get_peft_model(policy, _lora(cfg))
        value_model = load_reward_model(plan.value_path, tokenizer, seed=cfg.run.seed, torch_dtype=cfg.model.torch_dtype)
        reward_model = AutoModelForSequenceClassification.from_pretrained(plan.reward_path)
        prompts = read_column(data.tables["prompts"], "prompt")
        eval_prompts = read_column(data.tables["eval_prompts"], "prompt")[: cfg.eval.num_prompts]
        metrics_fns = metric_functions(cfg.eval.metrics)
        stop_id = tokenizer.eos_token_id if cfg.rl.stop_token == "eos" else None

        def evaluate(model, step: int) -> list[dict]:
            return evaluate_generations(model, ref_model, reward_model, tokenizer, eval_prompts,
                                        response_length=cfg.rl.response_length, max_prompt_length=cfg.data.max_prompt_length,
                                        metrics=metrics_fns, batch_size=cfg.eval.batch_size, greedy=cfg.eval.greedy,
                                        stop_token_id=stop_id, device=next(model.parameters()).device)

        registered: dict[int, str] = {}

        def register(policy_dir: Path, step: int) -> None:
            if not cfg.tracking.register_models:
                return
            saved = json.loads((policy_dir.parent / "metrics.json").read_text())
            tags = tracking.lineage_tags(
                stage=algorithm, step=step, config_hash=cfg.config_hash(), data_fingerprint=data.fingerprint,
                stage_key=key, algorithm=algorithm, reward_model_version=plan.reward_identity,
                base_model=plan.policy_identity, kl=f"{saved.get('objective/kl', float('nan')):.4f}",
            )
            registered[step] = tracking.register_once(policy_dir, name, task="text-generation", tags=tags, run_id=run_id)
            logger.info("%s checkpoint %d is %s", algorithm, step, registered[step])

        register_saved_checkpoints(out_dir, "policy", register)
        progress = StageProgress(f"{algorithm}-progress", f"{algorithm.upper()}: {cfg.rl.total_steps} steps")
        history: dict[str, list[tuple[int, float]]] = {"objective/scores": [], "objective/kl": [], "eval/gold": []}
        gold = next(iter(metrics_fns), None)

        def on_log(metrics: dict[str, float], step: int) -> None:
            tracking.log_metrics(run_id, metrics, step)
            history["objective/scores"].append((step, metrics["objective/scores"]))
            history["objective/kl"].append((step, metrics["objective/kl"]))
            progress.update(step, cfg.rl.total_steps)

        def on_eval(rows: list[dict], step: int) -> None:
            summary = summarize_rows(rows)
            tracking.log_metrics(run_id, summary, step)
            tracking.log_table(run_id, rows, f"eval/completions_step_{step:06d}.json")
            if gold:
                history["eval/gold"].append((step, summary[f"eval/{gold}_mean"]))
            publish_table(f"{algorithm}-eval-step-{step}", rows[:20], f"Held-out completions at step {step}")
            logger.info("eval at step %d: %s", step, ", ".join(f"{k}={v:.3f}" for k, v in summary.items()))

        if not (out_dir.exists() and any(out_dir.glob("checkpoint-*"))):
            on_eval(evaluate(policy, 0), 0)  # the starting point, for the before/after comparison
        result = train_ppo(policy, value_model, ref_model, reward_model, tokenizer, prompts, cfg.rl, cfg.ppo, cfg.run,
                           max_prompt_length=cfg.data.max_prompt_length, output_dir=out_dir, on_log=on_log,
                           on_checkpoint=register, on_eval=on_eval, evaluate=evaluate, eval_every=cfg.eval.every_steps)
        progress.update(cfg.rl.total_steps, cfg.rl.total_steps)
        if result.skipped_steps:
            logger.warning("%d optimizer steps were skipped because a loss was not finite", result.skipped_steps)
        if history["objective/scores"]:
            fig = curve_figure({k: v for k, v in history.items() if v}, algorithm.upper())
            tracking.log_figure(run_id, fig, f"{algorithm}_curves.png")
            close(fig)
        return Checkpoint(path=str((result.checkpoint / "policy").resolve()), model_uri=registered.get(result.step),
                          step=result.step, metrics=result.metrics, key=key,
                          extra={"resumed_from": result.resumed_from, "skipped_steps": result.skipped_steps})
