"""Promotion: evaluate the `candidate` policy version against the `champion` and move `champion` when it wins.

Both are evaluated (tasks/stages/version_evaluation.py) on the same held-out prompts, with the same reward model (the candidate's
`reward_model_version`), metric functions (`eval.metrics`) and reference (the candidate's
`base_model`), sampled as in training and seeded. `rlhf_core.evaluation.promotion.decide` applies `promote.*`. The
decision and its numbers become tags of the candidate version and a Prefect markdown artifact.
A candidate already judged against the current champion (or already champion) is left alone, so a
second run changes nothing.
"""

from __future__ import annotations

import datetime as dt
import re

from prefect import flow
from prefect.logging import get_run_logger

from rlhf_core.config import PipelineConfig, load_config
from rlhf_core.config.errors import UserError
from rlhf_core.config.redaction import refuse_secret_overrides
from rlhf_core.evaluation.promotion import Decision, decide
from rlhf_core.training.parallel import use_cpu_threads
from tasks import registry, tracking
from tasks.reporting.progress import print_rows, publish_markdown
from tasks.stages.data import PreparedData, data_stage
from tasks.stages.export import CANDIDATE
from tasks.stages.version_evaluation import evaluate_version

CHAMPION = "champion"
TAG = "promotion."
PROMOTION_TAGS = {"rlhf.flow": "promote", "rlhf.run_kind": "promotion"}


def promotion_run_name(name: str, candidate) -> str:
    """The promotion's MLflow run name: `promote-<model name>-v<candidate version>`."""
    return f"promote-{name}-v{candidate.version}"


def _report(
    name: str, candidate, champion, decision: Decision, summaries: dict[str, dict[str, float]], metric: str
) -> str:
    columns = sorted({k for s in summaries.values() for k in s})
    lines = [
        f"# Promotion of `{name}` version {candidate.version}",
        "",
        f"**{'Promoted' if decision.promote else 'Refused'}**: {decision.reason}.",
        "",
        f"Compared on `{metric}`; champion: " + (f"version {champion.version}" if champion else "none"),
        "",
        "| version | " + " | ".join(columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for label, summary in summaries.items():
        lines.append(f"| {label} | " + " | ".join(f"{summary[c]:.4f}" if c in summary else "" for c in columns) + " |")
    return "\n".join(lines)


def _evaluate_both(
    cfg: PipelineConfig,
    data: PreparedData,
    run_id: str,
    name: str,
    candidate,
    champion,
    reference: str | None,
    reward_model: str | None,
) -> dict[str, dict[str, float]]:
    """Evaluate the candidate and (when there is one) the champion; label -> summary, logged to the run."""
    summaries: dict[str, dict[str, float]] = {}
    candidate_summary, rows = evaluate_version(
        cfg, data, f"models:/{name}/{candidate.version}", reference, reward_model
    )
    summaries[f"candidate v{candidate.version}"] = candidate_summary
    print_rows(rows[:5], f"Candidate v{candidate.version}: held-out completions (first 5)")
    tracking.logs.log_metrics(
        run_id, {f"candidate/{k.removeprefix('eval/')}": v for k, v in candidate_summary.items()}, 0
    )
    if champion is not None:
        champion_summary, champion_rows = evaluate_version(
            cfg, data, f"models:/{name}/{champion.version}", reference, reward_model
        )
        summaries[f"champion v{champion.version}"] = champion_summary
        tracking.logs.log_metrics(
            run_id, {f"champion/{k.removeprefix('eval/')}": v for k, v in champion_summary.items()}, 0
        )
        tracking.logs.log_table(run_id, champion_rows, "promotion/champion_completions.json")
    tracking.logs.log_table(run_id, rows, "promotion/candidate_completions.json")
    return summaries


def _record(
    run_id: str, name: str, candidate, champion, decision: Decision, against: str, metric: str
) -> dict[str, str]:
    """Move `champion` when the candidate won; the decision as tags of the candidate version and the run."""
    if decision.promote:  # the alias first: if tagging fails after it, a rerun finds it champion
        registry.set_alias(name, CHAMPION, str(candidate.version))
        if champion is not None:
            registry.set_version_tags(name, champion.version, {TAG + "replaced_by": str(candidate.version)})
    tags = {
        "decision": "promoted" if decision.promote else "refused",
        "reason": decision.reason,
        "evaluated_against": against,
        "metric": metric,
        "candidate_value": f"{decision.candidate_value:.6f}",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "mlflow_run_id": run_id,
    }
    if decision.champion_value is not None:
        tags["champion_value"] = f"{decision.champion_value:.6f}"
    if decision.candidate_kl is not None:
        tags["kl"] = f"{decision.candidate_kl:.6f}"
    registry.set_version_tags(name, candidate.version, {TAG + k: v for k, v in tags.items()})
    tracking.logs.set_run_tags(run_id, {TAG + k: v for k, v in tags.items()})
    return tags


def _already_judged(name: str, candidate, champion, against: str, logger) -> dict | None:
    """The flow's result when there is nothing to judge (the candidate is champion, or was judged against it)."""
    base = {"model": name, "candidate": str(candidate.version), "champion": against, "changed": False}
    if champion is not None and str(champion.version) == str(candidate.version):
        logger.info("version %s is already the champion; nothing to do", candidate.version)
        return {**base, "decision": "unchanged", "reason": f"version {candidate.version} is already the champion"}
    if candidate.tags.get(TAG + "evaluated_against") == against:
        logger.info(
            "version %s was already judged against %s: %s",
            candidate.version,
            against,
            candidate.tags.get(TAG + "decision"),
        )
        return {
            **base,
            "decision": candidate.tags.get(TAG + "decision", "unchanged"),
            "reason": candidate.tags.get(TAG + "reason", ""),
        }
    return None


def _candidate(name: str):
    """The version with the alias `candidate`, or a one-sentence error saying how to make one."""
    candidate = registry.version_by_alias(name, CANDIDATE)
    if candidate is None:
        raise UserError(
            f"registry.policy_model_name {name!r} has no version with the alias '{CANDIDATE}'; "
            "run the pipeline first (its export sets it)"
        )
    return candidate


@flow(name="rlhf-promote", log_prints=True)
def rlhf_promote(config_path: str | None = "configs/demo.yaml", overrides: list[str] | None = None) -> dict:
    """Promote `models:/<policy>@candidate` to `@champion` when it passes the promote.* gates."""
    refuse_secret_overrides(overrides)  # Prefect stores parameters: credentials come from MLflow's env variables
    cfg = load_config(config_path, overrides or [])
    use_cpu_threads(cfg.run.cpu_threads)
    cfg.promotion_gates()  # outside the demo an explicit gate is needed: checked before any registry call
    logger = get_run_logger()
    name = cfg.registry.policy_model_name
    tracking.store.configure(cfg.tracking_uri())
    candidate = _candidate(name)
    champion = registry.version_by_alias(name, CHAMPION)
    gates = cfg.promotion_gates(first=champion is None)  # a first champion outside the demo needs min_value
    against = str(champion.version) if champion is not None else "none"
    judged = _already_judged(name, candidate, champion, against, logger)
    if judged is not None:
        return judged

    metric = gates.metric
    reference = candidate.tags.get("base_model")
    reward_model = candidate.tags.get("reward_model_version")
    reward_model = reward_model if reward_model and reward_model != "none" else None
    with tracking.runs.pipeline_run(cfg, tags=PROMOTION_TAGS, run_name=promotion_run_name(name, candidate)) as run_id:
        data = data_stage(cfg, run_id)
        summaries = _evaluate_both(cfg, data, run_id, name, candidate, champion, reference, reward_model)
        candidate_summary = summaries[f"candidate v{candidate.version}"]
        champion_summary = summaries.get(f"champion v{champion.version}") if champion is not None else None
        broken = candidate.tags.get("guard.broken", "").split(",")  # the rules its checkpoint broke in training
        decision = decide(candidate_summary, champion_summary, gates, broken=broken)
        tags = _record(run_id, name, candidate, champion, decision, against, metric)
        report = _report(name, candidate, champion, decision, summaries, metric)
        publish_markdown(re.sub(r"[^a-z0-9-]+", "-", f"promotion-{name.lower()}"), report, f"Promotion of {name}")
    logger.info("version %s %s: %s", candidate.version, tags["decision"], decision.reason)
    return {
        "model": name,
        "candidate": str(candidate.version),
        "champion": against,
        "changed": True,
        "decision": tags["decision"],
        "reason": decision.reason,
        "candidate_summary": candidate_summary,
        "champion_summary": champion_summary,
    }
