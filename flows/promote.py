"""Promotion: judge the `candidate` policy version against the `champion` and move `champion` when it wins.

The evaluator is one the candidate was not trained against (promote.evaluator: a pairwise judge, a reward model
registered apart, metric functions; the demo's gold metric), resolved and checked before any generation
(tasks/promotion/evaluator.py). Both policies sample the same held-out prompts with the same seeds and are compared
prompt by prompt (tasks/promotion/contest.py); with no champion yet, the candidate is compared with the policy it
started from (its `base_model`). `rlhf_core.evaluation.promotion.decide` applies promote.*: the guard's verdict,
the KL, promote.min_value, and the win rate's 95% interval against promote.min_win_rate. With
promote.approval: required a passing candidate waits for a person (tasks/promotion/approval.py). The decision and
its numbers become tags of the candidate version, the per-prompt table and the report go to the run and Prefect
(tasks/promotion/record.py). A candidate already judged against the current champion (or already champion) is left
alone, so a second run changes nothing.
"""

from __future__ import annotations

from prefect import flow
from prefect.logging import get_run_logger

from rlhf_core.config import PipelineConfig, load_config
from rlhf_core.config.errors import UserError
from rlhf_core.config.redaction import refuse_secret_overrides
from rlhf_core.evaluation.promotion import decide
from rlhf_core.training.parallel import use_cpu_threads
from tasks import registry, tracking
from tasks.promotion import evaluator as evaluators
from tasks.promotion.approval import ask_approval
from tasks.promotion.contest import Contestants, run_contest
from tasks.promotion.record import (
    CHAMPION,
    TAG,
    Outcome,
    comparison_tags,
    link_from_description,
    publish_comparison,
    publish_report,
    record,
    report,
)
from tasks.reporting.progress import print_rows
from tasks.stages.data import data_stage
from tasks.stages.export import CANDIDATE

PROMOTION_TAGS = {"rlhf.flow": "promote", "rlhf.run_kind": "promotion"}
FINAL = ("promoted", "refused", "rejected")  # decisions a rerun keeps; a timed-out approval is asked again


def promotion_run_name(name: str, candidate) -> str:
    """The promotion's MLflow run name: `promote-<model name>-v<candidate version>`."""
    return f"promote-{name}-v{candidate.version}"


def check_promotion(cfg: PipelineConfig, champion_exists: bool | None = None) -> None:
    """What can be refused before any registry call or generation: an evaluator outside the demo, a first
    champion's gate, an approval with no Prefect server. `champion_exists` None: not known yet."""
    cfg.promotion(first=champion_exists is False)
    evaluators.check_approval_server(cfg)


def contestants(name: str, candidate, champion) -> Contestants:
    """The candidate against the champion, or with none against the policy it started from (its base_model)."""
    reference = candidate.tags.get("base_model")
    uri = f"models:/{name}/{candidate.version}"
    if champion is not None:
        return Contestants(uri, f"models:/{name}/{champion.version}", f"champion v{champion.version}", True, reference)
    if not reference:
        raise UserError(
            f"version {candidate.version} of {name} has no base_model tag, so with no champion yet there is "
            "nothing to compare it with; register it through the pipeline's export"
        )
    return Contestants(uri, reference, f"its start ({reference})", False, reference)


def _already_judged(name: str, candidate, champion, against: str, logger) -> dict | None:
    """The flow's result when there is nothing to judge (the candidate is champion, or was judged against it)."""
    base = {"model": name, "candidate": str(candidate.version), "champion": against, "changed": False}
    if champion is not None and str(champion.version) == str(candidate.version):
        logger.info("version %s is already the champion; nothing to do", candidate.version)
        return {**base, "decision": "unchanged", "reason": f"version {candidate.version} is already the champion"}
    if candidate.tags.get(TAG + "evaluated_against") == against and candidate.tags.get(TAG + "decision") in FINAL:
        logger.info(
            "version %s was already judged against %s: %s",
            candidate.version,
            against,
            candidate.tags.get(TAG + "decision"),
        )
        decision = candidate.tags.get(TAG + "decision", "unchanged")
        return {**base, "decision": decision, "reason": f"already judged against {against}: {decision}"}
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


def _judge(cfg: PipelineConfig, run_id: str, versions: tuple, who: Contestants, judging, plan) -> tuple:
    """The contest, the gates, the approval when required, then the record; (contest, the tags written)."""
    candidate, champion = versions
    name, label = cfg.registry.policy_model_name, judging.evaluator.label()
    contest = run_contest(cfg, data_stage(cfg, run_id), judging, who)
    print_rows(contest.rows[:5], f"Candidate v{candidate.version} against {who.label} (first 5 prompts)")
    broken = candidate.tags.get("guard.broken", "").split(",")  # the rules its checkpoint broke in training
    outcome = Outcome(decide(contest.comparison, plan.gates, broken=broken))
    training_reward = plan.evaluator.kind == "training_reward"
    link = publish_comparison(run_id, name, contest)
    if outcome.decision.promote and cfg.promote.approval == "required":
        waiting = Outcome(outcome.decision, pending=True)
        draft = publish_report(run_id, name, report(name, candidate, contest, waiting, label, training_reward), link)
        print(
            f"Waiting up to {cfg.promote.approval_timeout_h:g} h for a person: open this flow run in Prefect's UI "
            "and press Resume to approve or reject (promote.approval: required)"
        )
        approval = ask_approval(draft, cfg.promote.approval_timeout_h)
        outcome = Outcome(outcome.decision, approval, cfg.promote.approval_timeout_h)
    publish_report(run_id, name, report(name, candidate, contest, outcome, label, training_reward), link)
    against = str(champion.version) if champion is not None else "none"
    tags = record(run_id, name, versions, outcome, {"evaluated_against": against, **comparison_tags(contest, label)})
    link_from_description(name, candidate, contest, outcome, (tracking.logs.run_link(run_id), link))
    return contest, tags


@flow(name="rlhf-promote", log_prints=True)
def rlhf_promote(config_path: str | None = "configs/demo.yaml", overrides: list[str] | None = None) -> dict:
    """Promote `models:/<policy>@candidate` to `@champion` when it beats the champion by promote.* (and, with
    promote.approval: required, a person approves)."""
    refuse_secret_overrides(overrides)  # Prefect stores parameters: credentials come from MLflow's env variables
    cfg = load_config(config_path, overrides or [])
    use_cpu_threads(cfg.run.cpu_threads)
    check_promotion(cfg)  # before any registry call
    logger = get_run_logger()
    name = cfg.registry.policy_model_name
    tracking.store.configure(cfg.tracking_uri())
    candidate = _candidate(name)
    champion = registry.version_by_alias(name, CHAMPION)
    plan = cfg.promotion(first=champion is None)
    against = str(champion.version) if champion is not None else "none"
    judged = _already_judged(name, candidate, champion, against, logger)
    if judged is not None:
        return judged
    judging = evaluators.resolve(plan.evaluator, candidate)  # a bad evaluator: one sentence, before generation
    who = contestants(name, candidate, champion)
    with tracking.runs.pipeline_run(cfg, tags=PROMOTION_TAGS, run_name=promotion_run_name(name, candidate)) as run_id:
        contest, tags = _judge(cfg, run_id, (candidate, champion), who, judging, plan)
    logger.info("version %s %s: %s", candidate.version, tags["decision"], tags["reason"])
    return {
        "model": name,
        "candidate": str(candidate.version),
        "champion": against,
        "changed": True,
        "decision": tags["decision"],
        "reason": tags["reason"],
        "win_rate": contest.comparison.result.win_rate,
        "ci": [contest.comparison.result.ci_low, contest.comparison.result.ci_high],
        "n": contest.comparison.result.n,
        "candidate_summary": contest.summaries["candidate"],
        "opponent_summary": contest.summaries["opponent"],
    }
