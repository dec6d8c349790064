"""The RL stage (PPO or GRPO) as a Prefect task, from the `InitPlan` of tasks/initialization.py.

`train_policy` trains with resume under the guard (`guarded_training`: stop, or roll back to the last
checkpoint that passed every rule), evaluates generations periodically, and registers every policy
checkpoint as a version of registry.policy_model_name; `export.select` picks the one it hands on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlhf_core.chat import extra_columns, prompt_columns
from rlhf_core.checkpoint import checkpoint_step, has_training_state
from rlhf_core.config import PipelineConfig
from rlhf_core.data import read_rows
from rlhf_core.evaluation import evaluate_generations, summarize_rows
from rlhf_core.grpo import train_grpo
from rlhf_core.guard import (
    GuardBreach,
    GuardLedger,
    GuardRollback,
    GuardStop,
    GuardStopError,
    Trigger,
    set_aside,
    strongest,
)
from rlhf_core.loop import LoopResult
from rlhf_core.models import (
    MODEL_BUILDING,
    load_causal_lm,
    load_pretrained,
    prepare_for_training,
    run_stop_ids,
)
from rlhf_core.parallel import from_main
from rlhf_core.ppo import train_ppo
from rlhf_core.reward_functions import load_function
from rlhf_core.reward_model import load_reward_model
from tasks import launcher, tracking
from tasks.data import PreparedData, resolve_model_source, stage_tokenizer
from tasks.initialization import InitPlan
from tasks.plots import close, curve_figure
from tasks.progress import print_rows, publish_markdown
from tasks.reporting import StageReporter
from tasks.retry import IO_RETRIES
from tasks.stage_io import Checkpoint, stage_key

GUARD_FILE = "guard.json"  # the guard's ledger, next to the RL stage's checkpoints


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


def eval_functions(cfg: PipelineConfig) -> dict:
    """What evaluation scores besides the reward model: eval.metrics, and GRPO's reward functions (the proxy
    reward's other parts) as columns `reward_<name>`."""
    functions = metric_functions(cfg.eval.metrics)
    if cfg.rl.algorithm == "grpo":
        for i, source in enumerate(cfg.grpo.rewards):
            if source.function is not None:
                functions[f"reward_{source.name}"] = load_function(source.function, field=f"grpo.rewards[{i}].function")
    return functions


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
            model = load_pretrained(AutoModelForSequenceClassification, path)
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
    eval_ref: Any = None  # the reference evaluation measures the KL to (a frozen copy also for GRPO with beta 0)


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

        with MODEL_BUILDING:
            policy = get_peft_model(policy, _lora(cfg))
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


def evaluate_policy(
    model, step: int, *, cfg: PipelineConfig, models: RLModels, prompt_rows: list[dict], metrics: dict
) -> list[dict]:
    """Completions of the held-out prompts sampled from `model` as in training, scored (the loops' `evaluate`)."""
    prompts, messages = prompt_columns(prompt_rows)
    return evaluate_generations(
        model,
        models.eval_ref,
        models.reward_model,
        models.tokenizer,
        prompts,
        prompt_messages=messages,
        columns=extra_columns(prompt_rows),
        response_length=cfg.rl.response_length,
        max_prompt_length=cfg.data.max_prompt_length,
        metrics=metrics,
        batch_size=cfg.eval.batch_size,
        greedy=cfg.eval.greedy,
        temperature=cfg.eval_temperature(),
        top_k=cfg.rl.top_k,
        top_p=cfg.rl.top_p,
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
        self.ledger = GuardLedger.load(out_dir / GUARD_FILE)
        for step, summary in sorted(self.ledger.evals.items()):  # a resumed attempt's checkpoints carry them too
            self.step_metrics[step] = summary

    def checkpoint_tags(self, path: Path, step: int) -> dict[str, str]:
        saved = json.loads((path.parent / "metrics.json").read_text())
        kl = saved.get("objective/kl", saved.get("kl"))
        tags = {"kl": f"{kl:.4f}"} if kl is not None else {}
        if step in self.ledger.evals:  # the guard's verdict on this step's evaluation
            broken = self.ledger.broken(step)
            tags.update({"guard.passed": str(not broken).lower(), "guard.broken": ",".join(broken)})
        return tags

    def on_eval(self, rows: list[dict], step: int) -> None:
        triggers = self.ledger.observe(step, summarize_rows(rows), self.cfg.guard, self.cfg.gold_metric())
        summary = self.ledger.evals[step]  # with the ratios to the initial policy
        self.ledger.save(self.out_dir / GUARD_FILE)
        tracking.log_metrics(self.run_id, summary, step)
        # one MLflow table and one Parquet file per evaluation step: nothing is overwritten
        tracking.log_table(self.run_id, [{"step": step, **r} for r in rows], f"eval/completions_step_{step:06d}.json")
        self.artifact(save_eval_rows(self.out_dir, rows, step), "eval")
        self.record(summary, step)
        self.publish_table(f"{self.stage}-eval-step-{step}", rows[:20], f"Held-out completions at step {step}")
        print_rows(rows[:5], f"{self.stage.upper()} held-out completions at step {step} (first 5 of {len(rows)})")
        self.logger.info("eval at step %d: %s", step, ", ".join(f"{k}={v:.3f}" for k, v in summary.items()))
        self.report_triggers(triggers, step)
        trigger = strongest(triggers)
        if trigger is not None and trigger.action == "stop":
            raise GuardStop(trigger)
        if trigger is not None and trigger.action == "rollback":
            raise GuardRollback(trigger)

    def report_triggers(self, triggers: list[Trigger], step: int) -> None:
        """Each breach as a metric, a run tag, a console line and one Prefect artifact per evaluation."""
        if not triggers:
            return
        tracking.log_metrics(self.run_id, {f"guard/{t.rule}": t.value for t in triggers}, step)
        tracking.log_metrics(self.run_id, {"guard/triggers": float(len(self.ledger.all_triggers))}, step)
        self.tag({f"guard.{t.rule}": t.message[:250] for t in triggers})
        for t in triggers:
            self.logger.warning("%s", t.message)
        lines = [f"- **{t.rule}** ({t.action}): {t.message}" for t in triggers]
        self.publish_markdown(f"{self.stage}-guard-step-{step}", "\n".join(lines), f"Guard rules broken at step {step}")

    def on_completions(self, rows: list[dict], step: int) -> None:
        """GRPO's sampled completions of one step as <out_dir>/completions/completions_step_NNNNNN.parquet."""
        import pandas as pd

        path = self.out_dir / "completions" / f"completions_step_{step:06d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(rows).to_parquet(path)
        self.artifact(path, "completions")

    def finish(self, result: LoopResult | None) -> Checkpoint:
        """The progress completed, curves and the evaluation report published; the stage's Checkpoint: the
        one export.select picks (result None: the guard stopped RL)."""
        self.done()
        if result is not None and result.skipped_steps:
            self.logger.warning("%d optimizer steps were skipped because a loss was not finite", result.skipped_steps)
        if next(iter(self.history.values())):
            self.plot(f"{self.stage}_curves.png", self.stage.upper(), {k: v for k, v in self.history.items() if v})
        evals = {s: r for s, r in load_eval_history(self.out_dir).items() if s in self.ledger.evals}
        if launcher.is_main():
            report_evaluations(self.run_id, self.stage, evals, self.gold)
        step = self.select_step(result)
        metrics = {
            **(result.metrics if result is not None and result.step == step else {}),
            **self.ledger.evals.get(step, {}),
        }
        triggers = self.ledger.all_triggers
        return Checkpoint(
            path=str((self.out_dir / f"checkpoint-{step}" / "policy").resolve()),
            model_uri=self.version_of(step),
            step=step,
            metrics={**metrics, "guard/triggers": float(len(triggers))},
            key=self.key,
            extra={
                "resumed_from": result.resumed_from if result is not None else None,
                "skipped_steps": result.skipped_steps if result is not None else 0,
                "gold": self.gold,
                "eval_history": dict(sorted(self.ledger.evals.items())),
                "final_eval": self.ledger.evals.get(step, {}),
                "final_rows": evals.get(step, [])[:5],
                "initial_rows": evals.get(0, [])[:5],
                "selected": self.cfg.export.select,
                "guard_broken": self.ledger.broken(step),
                "guard_triggers": [t.message for t in triggers],
                "guard_stopped_at": self.ledger.stopped_at,
                "rollbacks": self.ledger.rollbacks,
            },
        )

    def select_step(self, result: LoopResult | None) -> int:
        """The checkpoint step export.select picks: 'last', or 'best' (the highest promotion metric among
        checkpoints whose evaluation passed every guard rule; the last passed, then the last, when none is
        scored). Raises a sentence when the guard stopped RL before any checkpoint was saved."""
        steps = checkpoint_steps(self.out_dir)
        if not steps:
            raise GuardStopError(
                f"the guard stopped {self.stage} at step {self.ledger.stopped_at} before any checkpoint was saved, "
                f"so there is no policy to export; see the guard triggers of the {self.stage} run "
                "(lower rl.save_steps, or loosen guard.*)"
            )
        last = max(steps)
        if self.cfg.export.select == "last" or not launcher.is_main():  # the others' ledgers hold no evaluations
            return last
        metric_key = f"eval/{self.cfg.promotion_metric()}_mean"
        chosen = self.ledger.best(steps, metric_key) or self.ledger.last_passed(steps)
        if not any(s in self.ledger.evals for s in steps):
            self.logger.warning(
                "no %s checkpoint step had an evaluation: exporting the last one (step %d)", self.stage, last
            )
            return last
        if chosen is None or chosen == 0:
            self.logger.warning(
                "no %s checkpoint passed every guard rule: exporting the last one (step %d)", self.stage, last
            )
            return last
        if chosen != last:
            self.logger.info(
                "export.select best: step %d (%s %.3f), not the last step %d",
                chosen,
                metric_key,
                self.ledger.evals[chosen].get(metric_key, float("nan")),
                last,
            )
        return chosen


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
            kl_scale=kl_scale,
            **common,
        )
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
        **common,
    )


@task(name="train-policy", cache_policy=NO_CACHE, **IO_RETRIES)
def train_policy(cfg: PipelineConfig, data: PreparedData, plan: InitPlan, parent_run_id: str) -> Checkpoint:
    """PPO or GRPO on the prompt set; resume, evaluate, register every checkpoint as a policy version."""
    if cfg.run.num_processes > 1 and not launcher.launched():
        return launcher.launch("rl", cfg, data=data, plan=plan, parent_run_id=parent_run_id)
    key = rl_key(cfg, data, plan)
    out_dir = cfg.run.output_dir / cfg.rl.algorithm / key
    with (
        tracking.stage_run(parent_run_id, cfg.rl.algorithm) as run_id,
        PolicyReporter(cfg, run_id, data, plan, key, out_dir, gold=cfg.gold_metric()) as reporter,
    ):
        reporter.register_saved(out_dir, "policy")
        reporter.start(cfg.rl.total_steps, f"{cfg.rl.algorithm.upper()}: {cfg.rl.total_steps} steps")
        return reporter.finish(guarded_training(cfg, data, plan, reporter))


def guarded_training(cfg: PipelineConfig, data: PreparedData, plan: InitPlan, reporter: PolicyReporter):
    """Train under the guard: the initial policy evaluated first (step 0), then PPO or GRPO until the end or a
    breach whose action is 'stop' (None is returned) or 'rollback': the checkpoints after the last one that
    passed every rule are set aside, the KL coefficient multiplied by guard.kl_coef_factor, and training
    resumes from that checkpoint (or from the start) with freshly loaded models; a breach beyond
    guard.max_rollbacks stops. The ledger (<out_dir>/guard.json) carries all of it across attempts.

    With N processes the evaluating one (rank 0) decides: the loop raises its breach on every process, rank 0
    alone sets checkpoints aside and updates the ledger, and every process then goes on with rank 0's ledger."""
    out_dir = reporter.out_dir
    functions = eval_functions(cfg)
    eval_rows = read_rows(data.tables["eval_prompts"])[: cfg.eval.num_prompts]
    while reporter.ledger.stopped_at is None:
        models = load_models(cfg, plan)
        evaluate = partial(evaluate_policy, cfg=cfg, models=models, metrics=functions, prompt_rows=eval_rows)
        if launcher.is_main() and 0 not in reporter.ledger.evals and not checkpoint_steps(out_dir):
            reporter.on_eval(evaluate(models.policy, 0), 0)  # the starting point, for the before/after comparison
        try:
            return _train(
                cfg, data, plan, models, reporter, evaluate, cfg.guard.kl_coef_factor**reporter.ledger.rollbacks
            )
        except GuardBreach as breach:
            if launcher.is_main():
                act_on_breach(breach, cfg, reporter)
        reporter.ledger = from_main(reporter.ledger)
        del models
    return None


def act_on_breach(breach: GuardBreach, cfg: PipelineConfig, reporter: PolicyReporter) -> None:
    """Rank 0's part of a breach: stop, or set the checkpoints after the last passed one aside (a rollback
    beyond guard.max_rollbacks stops); the ledger records it and is saved."""
    ledger, out_dir, guard = reporter.ledger, reporter.out_dir, cfg.guard
    if isinstance(breach, GuardStop):
        ledger.stopped_at = breach.trigger.step
    elif ledger.rollbacks >= guard.max_rollbacks:
        reporter.logger.warning("guard: %d rollbacks done (guard.max_rollbacks): stopping", ledger.rollbacks)
        ledger.stopped_at = breach.trigger.step
    else:
        reporter.wait_registrations()  # the checkpoints set aside keep their versions
        to_step = ledger.last_passed([0, *checkpoint_steps(out_dir)]) or 0
        moved = set_aside(out_dir, to_step, ledger.rollbacks + 1)
        ledger.rolled_back(to_step)
        reporter.logger.warning(
            "guard: rolled back to step %d (%d checkpoints set aside under %s); the KL coefficient is "
            "now %gx the configured one",
            to_step,
            len(moved),
            out_dir / "rolled_back",
            guard.kl_coef_factor**ledger.rollbacks,
        )
    ledger.save(out_dir / GUARD_FILE)


def checkpoint_steps(out_dir: Path) -> list[int]:
    """Steps of the complete checkpoints under out_dir."""
    found = [checkpoint_step(p) for p in Path(out_dir).glob("checkpoint-*") if p.is_dir() and has_training_state(p)]
    return sorted(s for s in found if s is not None)


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
