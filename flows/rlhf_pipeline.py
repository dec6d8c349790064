"""The RLHF pipeline as a Prefect flow: data -> sft -> reward -> init -> rl.algorithm -> export.

Each stage has one name: its `stage(...)` marker here (named in a failed state's message), its Prefect
task, its MLflow stage run (tag `rlhf.stage`) and its versions' `stage` tag. The RL stage is named for
its algorithm (`ppo`, `grpo`, `rloo`, ...); its task is `rl_stage`, which runs under that name. The reward
stage runs only when something reads its model (PPO, or a grpo.rewards entry `reward_stage`).

The flow's parameters are the config: a YAML path plus `section.field=value` overrides, so the same
call works from the CLI, from `prefect deployment run --param`, and from a schedule. The config is
validated before any task runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prefect import flow
from prefect.logging import get_run_logger
from prefect.runtime import flow_run as prefect_flow_run
from prefect.states import Failed

from flows.console import SAMPLE_PROMPTS, SAMPLES_TITLE
from flows.stage_notes import data_note, describe_stages, stage_notes
from rlhf_core.config import load_config
from rlhf_core.config.redaction import redact, refuse_secret_overrides
from rlhf_core.data.chat import shown_prompt
from rlhf_core.data.markdown import markdown_table
from rlhf_core.data.tool_calls import TRANSCRIPT_LEGEND, holds_transcripts
from rlhf_core.evaluation.guard import divergence_off
from rlhf_core.evaluation.promotion import alignment_markdown, eval_kl
from rlhf_core.storage.ownership import check_pipeline_outputs
from rlhf_core.training.parallel import use_cpu_threads
from tasks import registry, tracking
from tasks.checks.memory import check_memory
from tasks.checks.preflight import check_preflight
from tasks.reporting.progress import publish_markdown
from tasks.runtime.run_lock import run_lock, terminate_on_sigterm
from tasks.stage_io import Checkpoint
from tasks.stages.data import PreparedData, data_stage
from tasks.stages.export import CANDIDATE, export_stage, promotion_blocked
from tasks.stages.initialization import init_stage
from tasks.stages.reward_model import reward_stage
from tasks.stages.rl.eval_rows import load_eval_history
from tasks.stages.rl.stage import rl_stage
from tasks.stages.sft import sft_stage


class StageMarker:
    """`with stage("reward"): ...` records which stage is running, for the failed state's message."""

    def __init__(self):
        self.current = "setup"

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.current = name
        yield


def _no_new_data(cfg, data: PreparedData, run_id: str, logger) -> dict | None:
    """The flow's result when the current `candidate` was trained on data with this fingerprint, else None."""
    latest = registry.version_by_alias(cfg.registry.policy_model_name, CANDIDATE)
    if latest is None or latest.tags.get("data_fingerprint") != data.fingerprint:
        return None
    logger.info(
        "no new data: version %s was trained on data fingerprint %s; nothing to retrain",
        latest.version,
        data.fingerprint,
    )
    tracking.logs.set_run_tags(run_id, {"rlhf.skipped": "no new data"})
    describe_stages(run_id, {"data": data_note(cfg, data)})
    return {
        "mlflow_run_id": run_id,
        "skipped": "no new data",
        "data_fingerprint": data.fingerprint,
        "candidate_uri": f"models:/{cfg.registry.policy_model_name}/{latest.version}",
    }


def _final_metrics(trained: Checkpoint) -> dict[str, float]:
    """The RL stage's final evaluation: its Checkpoint's metrics over the summary of the last evaluation."""
    return {**trained.extra.get("final_eval", {}), **trained.metrics}


def before_and_after(before: list[dict], after: list[dict], before_step: int, after_step: int) -> list[dict]:
    """One row per completion of `after`, beside the completion of `before` for the same prompt (the k-th of a
    prompt beside its k-th): `prompt`, then each field as `<field>_before` and `<field>_after` (`completion_before`,
    `completion_after`, `score_before`, ...), `step_before`, `step_after`, and the templated `rendered_prompt`.
    A prompt `before` lacks has None there."""
    earlier: dict[str, list[dict]] = {}
    for row in before:
        earlier.setdefault(row["prompt"], []).append(row)
    rows = []
    for row in after:
        queue = earlier.get(row["prompt"], [])
        first = queue.pop(0) if queue else {}
        sides = {
            f"{k}_{side}": r.get(k) for k in row if k != "prompt" for side, r in (("before", first), ("after", row))
        }
        steps = {"step_before": before_step if first else None, "step_after": after_step}
        rows.append({"prompt": shown_prompt(row["prompt"]), **sides, **steps, "rendered_prompt": row["prompt"]})
    return rows


def _final_samples(cfg, trained: Checkpoint) -> list[dict]:
    """Every held-out prompt's completion by the initial policy (step 0) and by the exported checkpoint, side by
    side (`before_and_after`), from the Parquet files the stage saves; else the first rows its Checkpoint carries."""
    history = load_eval_history(cfg.run.output_dir / cfg.rl.algorithm / trained.key) if trained.key else {}
    step = trained.step if trained.step in history else max(history, default=None)
    if step is not None:
        return before_and_after(history.get(0, []), history[step], 0, step)
    extra = trained.extra
    return before_and_after(extra.get("initial_rows", []), extra.get("final_rows", []), 0, trained.step)


def summary_metrics(cfg, reward: Checkpoint | None, trained: Checkpoint) -> dict[str, float]:
    """What a reviewer reads first on the pipeline's run: `summary/gold` (cfg.gold_metric()),
    `summary/proxy` (the reward model's score), `summary/kl` (the eval KL: exact when measured, else k3 or k1),
    `summary/reward_accuracy` (the reward model's eval accuracy) and `summary/guard_triggers` (0 when the
    stage reports none). Those the stages did not measure are left out."""
    final = _final_metrics(trained)
    gold, proxy = cfg.gold_metric(), cfg.guard.divergence.proxy
    found = {
        "summary/gold": final.get(f"eval/{gold}_mean") if gold else None,
        "summary/proxy": final.get("eval/score_mean", final.get(f"eval/{proxy}_mean")),
        "summary/kl": eval_kl(final),
        "summary/reward_accuracy": reward.metrics.get("eval_accuracy") if reward is not None else None,
        "summary/guard_triggers": final.get("guard/triggers", 0.0),
    }
    return {k: float(v) for k, v in found.items() if v is not None}


def record_summary(
    cfg,
    run_id: str,
    data: PreparedData,
    policy: Checkpoint | None,
    reward: Checkpoint | None,
    trained: Checkpoint,
    exported: Checkpoint,
) -> None:
    """The summary metrics (at the RL stage's final step) and the held-out samples before and after
    (`final_samples.csv`, a table MLflow's UI shows) on the pipeline's run; the summary (`summary_markdown`) as the
    flow's artifact and the MLflow run's description; each stage run's description (flows/stage_notes.py)."""
    tracking.logs.log_metrics(run_id, summary_metrics(cfg, reward, trained), trained.step)
    tracking.logs.log_table(run_id, _final_samples(cfg, trained), "final_samples.csv")
    text = summary_markdown(cfg, run_id, trained, exported)
    publish_markdown(SUMMARY_ARTIFACT, text, "What this run produced")
    tracking.logs.describe_run(run_id, text)
    describe_stages(run_id, stage_notes(cfg, data, policy, reward, trained, exported))


SUMMARY_ARTIFACT = "rlhf-summary"


def summary_markdown(cfg, run_id: str, trained: Checkpoint, exported: Checkpoint) -> str:
    """The flow run's summary artifact: where the MLflow run and the candidate are (and that it cannot be promoted,
    when it broke a guard rule), the before/after table and the guard's verdict, and SAMPLE_PROMPTS held-out prompts
    before and after (as the console shows them; a legend under them for tool episodes' transcripts)."""
    history = {int(k): v for k, v in trained.extra.get("eval_history", {}).items()}
    candidate = tracking.logs.version_link(exported.model_uri) if exported.model_uri else "not registered"
    blocked = promotion_blocked(trained) if exported.model_uri else None
    lines = [
        f"# {cfg.rl.algorithm.upper()} run `{cfg.run.name}`, seed {cfg.run.seed}",
        "",
        f"- MLflow: {tracking.logs.run_link(run_id)}",
        f"- candidate: {candidate} (alias `candidate`), exported to `{exported.path}`",
        *([f"- {blocked}"] if blocked else []),
        f"- exported step {trained.step} of {cfg.rl.total_steps}",
        "",
        alignment_markdown(history, trained.step, cfg.gold_metric(), trained.extra.get("guard_triggers", [])),
    ]
    rollbacks = trained.extra.get("guard_rollbacks", [])
    if rollbacks:  # what each rollback did, as the guard's artifacts say it
        lines += ["", "What the guard did:", "", *(f"- {sentence}" for sentence in rollbacks)]
    if off := divergence_off(cfg.guard, cfg.gold_metric()):
        lines += ["", off[0].upper() + off[1:] + "."]
    pairs = list(zip(trained.extra.get("initial_rows", []), trained.extra.get("final_rows", [])))[:SAMPLE_PROMPTS]
    if pairs:
        rows = [(shown_prompt(a["prompt"]), a["completion"], b["completion"]) for a, b in pairs]
        lines += ["", f"{SAMPLES_TITLE}:", "", *markdown_table(("prompt", "before", "after"), rows)]
        if holds_transcripts([row for pair in pairs for row in pair]):
            lines += ["", TRANSCRIPT_LEGEND]
    return "\n".join(lines)


def _summary(
    cfg,
    run_id: str,
    data: PreparedData,
    policy: Checkpoint | None,
    reward: Checkpoint | None,
    trained: Checkpoint,
    exported: Checkpoint,
) -> dict:
    return {
        "mlflow_run_id": run_id,
        "skipped": None,
        "tracking_uri": cfg.tracking_uri(),
        "output_dir": str(cfg.run.output_dir.resolve()),
        "demo_world": data.demo_world,
        "data_fingerprint": data.fingerprint,
        "checkpoints": [c.path for c in (policy, reward, trained) if c is not None],
        "algorithm": cfg.rl.algorithm,
        "policy_path": trained.path,
        "policy_model_uri": trained.model_uri,
        "export_dir": exported.path,
        "candidate_uri": exported.model_uri,
        "candidate_alias": f"models:/{cfg.registry.policy_model_name}@candidate" if exported.model_uri else None,
        "candidate_blocked": promotion_blocked(trained) if exported.model_uri else None,
        "gold_metric": trained.extra.get("gold"),
        "guard_off": divergence_off(cfg.guard, cfg.gold_metric()),
        "eval_history": trained.extra.get("eval_history", {}),
        "selected_step": trained.step,
        "initial_eval_rows": trained.extra.get("initial_rows", []),
        "final_eval_rows": trained.extra.get("final_rows", []),
        "guard_triggers": trained.extra.get("guard_triggers", []),
        "guard_rollbacks": trained.extra.get("guard_rollbacks", []),
        "reward_model_path": reward.path if reward else None,
        "reward_model_uri": reward.model_uri if reward else None,
        "metrics": {
            **(policy.metrics if policy else {}),
            **({f"reward/{k}": v for k, v in reward.metrics.items()} if reward else {}),
            **{k: v for k, v in trained.metrics.items() if k.startswith(("objective/", "reward", "kl"))},
        },
    }


def flow_run_name() -> str:
    """The flow run's name in Prefect's UI, one per run: the config's run_label and the start time
    (demo-ppo-seed42-20261126-095012, `tracking.runs.pipeline_run_name`), which the pipeline's MLflow run takes
    too (`mlflow_run_name`); the config file's name when the config does not load (the flow then stops on it,
    in one sentence)."""
    parameters = prefect_flow_run.parameters
    config_path = parameters.get("config_path")
    try:
        return tracking.runs.pipeline_run_name(load_config(config_path, parameters.get("overrides") or []))
    except Exception:  # noqa: BLE001 - a name must never fail the run; the flow reports the config's error
        return Path(config_path).stem if config_path else "rlhf-pipeline"


def mlflow_run_name(cfg) -> str | None:
    """The pipeline's MLflow run is named as its Prefect flow run, when that name is this config's (`flow_run_name`);
    None (tracking.runs names it) outside a flow run."""
    name = prefect_flow_run.name
    return name if name and name.startswith(f"{cfg.run_label()}-") else None


def _say_no_reward_stage(cfg, logger) -> None:
    logger.info(
        "no reward-model stage: %s scores with grpo.rewards %s, none of which is 'reward_stage'",
        cfg.rl.algorithm,
        ", ".join(r.name for r in cfg.grpo.rewards),
    )


@flow(name="rlhf-pipeline", log_prints=True, flow_run_name=flow_run_name)
def rlhf_pipeline(
    config_path: str | None = "configs/demo.yaml", overrides: list[str] | None = None, only_if_new_data: bool = False
) -> dict:
    """Run the pipeline on the config at `config_path` with `overrides` applied; return a summary.

    only_if_new_data: stop after the data stage when the current `candidate` policy was trained on
    data with the same fingerprint (scheduled retraining with no new preference files).
    """
    refuse_secret_overrides(overrides)  # Prefect stores parameters: credentials come from MLflow's env variables
    cfg = load_config(config_path, overrides or [])
    check_preflight(cfg)  # everything that can be checked without training, before any run, file or stage
    check_memory(cfg)  # the estimated peak memory per device within run.memory_budget_gib
    use_cpu_threads(cfg.run.cpu_threads)
    logger = get_run_logger()
    logger.info("config %s (hash %s), output in %s", config_path, cfg.config_hash(), cfg.run.output_dir)

    stage = StageMarker()
    try:
        check_pipeline_outputs(cfg, config_path=config_path)  # before any work: owned writes only
        # one run at a time in a run directory: a second one stops here, naming the holder. SIGTERM ends the
        # MLflow runs KILLED and releases the lock (in a Prefect flow run, Prefect's own SIGTERM bridge does).
        with (
            run_lock(cfg.run.output_dir),
            terminate_on_sigterm(),
            tracking.runs.pipeline_run(cfg, run_name=mlflow_run_name(cfg)) as run_id,
        ):
            with stage("data"):
                data = data_stage(cfg, run_id)
            skipped = _no_new_data(cfg, data, run_id, logger) if only_if_new_data else None
            if skipped is not None:
                return skipped
            with stage("sft"):
                policy = sft_stage(cfg, data, run_id) if cfg.sft.enabled else None
            with stage("reward"):
                reward = reward_stage(cfg, data, policy, run_id) if cfg.trains_reward_model() else None
                if reward is None:
                    _say_no_reward_stage(cfg, logger)
            with stage("init"):
                plan = init_stage(cfg, data, policy, reward)
            with stage(cfg.rl.algorithm):
                trained = rl_stage.with_options(name=cfg.rl.algorithm)(cfg, data, plan, run_id)
            with stage("export"):
                exported = export_stage(cfg, data, plan, trained, run_id)
            record_summary(cfg, run_id, data, policy, reward, trained, exported)
    except Exception as err:  # the MLflow run is FAILED by now; say which stage failed and why
        logger.error("stage %s failed: %s", stage.current, redact(str(err)))
        return Failed(message=redact(f"stage '{stage.current}' failed: {type(err).__name__}: {err}"), data=err)
    return _summary(cfg, run_id, data, policy, reward, trained, exported)
