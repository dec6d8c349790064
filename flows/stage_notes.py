"""What each stage run of a pipeline run says on its page in MLflow's UI: its description (`mlflow.note.content`),
a sentence or two of what the stage did with its key numbers, written once the pipeline has run.

`stage_notes` makes the texts from what the stages returned; `describe_stages` puts each on the newest finished
stage run of its name under the pipeline's run (a stage reused whole has no run left to describe).
"""

from __future__ import annotations

from rlhf_core.config import PipelineConfig
from rlhf_core.data.tool_calls import TRANSCRIPT_LEGEND
from rlhf_core.evaluation.promotion import eval_kl
from tasks import tracking
from tasks.stage_io import Checkpoint
from tasks.stages.data import PreparedData
from tasks.stages.export import promotion_blocked, trained_tools


def data_note(cfg: PipelineConfig, data: PreparedData) -> str:
    """The tables prepared, their rows and the data fingerprint."""
    rows = ", ".join(f"{r['table']} {r['kept']}" for r in data.reports)
    over = sum(int(r.get("overlong") or 0) for r in data.reports)
    text = f"Prepared {len(data.reports)} tables (rows: {rows}); data fingerprint `{data.fingerprint}`."
    if over:
        text += f" {over} row(s) were over a length limit (data.overlong: {cfg.data.overlong})."
    return text


def _registered(checkpoint: Checkpoint) -> str:
    return f" Registered as `{checkpoint.model_uri}`." if checkpoint.model_uri else ""


def sft_note(cfg: PipelineConfig, policy: Checkpoint) -> str:
    """The SFT warm start: its steps and loss."""
    m = policy.metrics
    loss = (
        f": loss {m['sft/first_loss']:.3f} -> {m['sft/loss']:.3f}" if {"sft/first_loss", "sft/loss"} <= set(m) else ""
    )
    return f"Fine-tuned `{cfg.model.base}` on the SFT texts for {policy.step} steps{loss}.{_registered(policy)}"


def reward_note(reward: Checkpoint) -> str:
    """The reward model: its steps and held-out accuracy and loss."""
    m = reward.metrics
    held_out = [
        f"{name} {m[key]:.3f}" for name, key in (("accuracy", "eval_accuracy"), ("loss", "eval_loss")) if key in m
    ]
    numbers = f": held-out {', '.join(held_out)}" if held_out else ""
    return (
        f"Trained the reward model (Bradley-Terry, on the preference pairs) for {reward.step} steps{numbers}."
        f"{_registered(reward)}"
    )


def _change(name: str, key: str, before: dict, after: dict) -> str | None:
    return f"{name} {before[key]:.3f} -> {after[key]:.3f}" if key in before and key in after else None


def rl_note(cfg: PipelineConfig, policy: Checkpoint | None, reward: Checkpoint | None, trained: Checkpoint) -> str:
    """The RL stage: where it started, the held-out gold metric, proxy score and KL from step 0 to the step
    export.select picked, the guard's triggers and rollbacks, and with tools the legend of its tables' transcripts."""
    history = {int(k): v for k, v in trained.extra.get("eval_history", {}).items()}
    before, after = history.get(0, {}), history.get(trained.step, trained.metrics)
    gold = cfg.gold_metric()
    changes = [
        _change(gold, f"eval/{gold}_mean", before, after) if gold else None,
        _change("reward-model score", "eval/score_mean", before, after),
    ]
    kl = eval_kl(after)
    changes.append(f"KL to the initial policy {kl:.3f} nats" if kl is not None else None)
    start = policy.model_uri if policy is not None and policy.model_uri else cfg.model.base
    scored = f", scored by `{reward.model_uri}`" if reward is not None and reward.model_uri else ""
    stopped = trained.extra.get("guard_stopped_at")
    text = f"{cfg.rl.algorithm.upper()} from `{start}`{scored}, rl.total_steps {cfg.rl.total_steps}"
    text += f" (the guard stopped it at step {stopped})." if stopped is not None else "."
    shown = [c for c in changes if c]
    if shown:
        text += f" Held-out evaluation, step 0 -> step {trained.step}: {', '.join(shown)}."
    triggers, rollbacks = len(trained.extra.get("guard_triggers", [])), trained.extra.get("rollbacks", 0)
    selected = trained.extra.get("selected", cfg.export.select)
    text += f" Guard: {triggers} trigger(s), {rollbacks} rollback(s); export.select `{selected}` picked step {trained.step}."
    return f"{text} {TRANSCRIPT_LEGEND}" if trained_tools(cfg) else text  # what its eval tables' transcripts say


def export_note(cfg: PipelineConfig, trained: Checkpoint, exported: Checkpoint) -> str:
    """The export: which step went where, its version and alias, the guard's verdict on it (and that the candidate
    cannot be promoted when it broke a rule)."""
    where = (
        f"registered it as `{exported.model_uri}` (alias `candidate`)"
        if exported.model_uri
        else "registered nothing (tracking.register_models is false)"
    )
    broken = trained.extra.get("guard_broken", [])
    verdict = f"broke {', '.join(broken)}" if broken else "passed"
    blocked = promotion_blocked(trained) if exported.model_uri else None
    return (
        f"Exported step {exported.step} of the {cfg.rl.algorithm.upper()} policy to `{exported.path}` and {where}. "
        f"Guard: {verdict}.{f' {blocked}' if blocked else ''}"
    )


def stage_notes(
    cfg: PipelineConfig,
    data: PreparedData,
    policy: Checkpoint | None,
    reward: Checkpoint | None,
    trained: Checkpoint,
    exported: Checkpoint,
) -> dict[str, str]:
    """Stage name -> its run's description."""
    notes = {"data": data_note(cfg, data), cfg.rl.algorithm: rl_note(cfg, policy, reward, trained)}
    if policy is not None:
        notes["sft"] = sft_note(cfg, policy)
    if reward is not None:
        notes["reward"] = reward_note(reward)
    notes["export"] = export_note(cfg, trained, exported)
    return notes


def describe_stages(run_id: str, notes: dict[str, str]) -> None:
    """Each stage run under the pipeline's run `run_id` gets its note at the top of its description (what the
    stage wrote there itself, a guard rollback's sentence, stays below it)."""
    for stage, stage_run_id in tracking.logs.stage_runs(run_id).items():
        if stage in notes:
            tracking.logs.describe_run(stage_run_id, notes[stage], keep=True)
