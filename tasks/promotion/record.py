"""What a promotion leaves: the alias moved (only when promoted); the decision and the comparison as a few tags of
the candidate version (what a person filters versions on) and of the run; the report as the run's description and a
Prefect markdown artifact; the per-prompt table in the run (CSV, which MLflow's UI shows as a table) and as a Prefect
table artifact; the comparison's numbers as the run's metrics; and a line in the candidate's description with the
reason and the links."""

from __future__ import annotations

import re
from dataclasses import dataclass

from rlhf_core.data.markdown import markdown_table
from rlhf_core.data.tool_calls import TRANSCRIPT_LEGEND
from rlhf_core.evaluation.promotion import Decision
from tasks import registry, tracking
from tasks.promotion.approval import Approval
from tasks.promotion.contest import Contest
from tasks.reporting.progress import publish_markdown, publish_table

CHAMPION = "champion"
TAG = "promotion."
TABLE = "promotion/pairwise.csv"
TRAINING_REWARD_WARNING = (
    "**Judged by the candidate's own reward model** (promote.allow_training_reward: true): the model its RL stage "
    "was trained to maximise, so a candidate that games it passes this comparison."
)
# the eval means the report sets side by side, when both evaluations have them ({column}: the evaluator's)
REPORTED_MEANS = ("{column}", "score", "kl_exact", "length")
OVER_COMPLETIONS = ("eval/distinct_2", "eval/repeated_ngram_rate", "eval/stop_rate")


@dataclass(frozen=True)
class Outcome:
    """A promotion's end: the gates' decision, the approval when one was asked (None: not asked, or not yet), and
    the words for both. `pending`: the gates passed and the approval form is waiting."""

    decision: Decision
    approval: Approval | None = None
    approval_timeout_h: float = 0.0
    pending: bool = False

    @property
    def promoted(self) -> bool:
        return (
            self.decision.promote and not self.pending and (self.approval is None or self.approval.status == "approved")
        )

    @property
    def label(self) -> str:
        """promoted, refused (by the gates), rejected (by a person), timed_out (no one answered), or while the form
        waits, awaiting_approval."""
        if not self.decision.promote:
            return "refused"
        if self.pending:
            return "awaiting_approval"
        return "promoted" if self.approval is None or self.approval.status == "approved" else self.approval.status

    def reason(self) -> str:
        if self.approval is None or not self.decision.promote:
            return self.decision.reason
        return f"{self.decision.reason}; approval: {self.approval.sentence(self.approval_timeout_h)}"


def comparison_tags(contest: Contest, evaluator: str) -> dict[str, str]:
    """promotion.evaluator, win_rate, ci_low, ci_high and n (unprefixed)."""
    result = contest.comparison.result
    return {
        "evaluator": evaluator,
        "win_rate": f"{result.win_rate:.4f}",
        "ci_low": f"{result.ci_low:.4f}",
        "ci_high": f"{result.ci_high:.4f}",
        "n": str(result.n),
    }


def report(name: str, candidate, contest: Contest, outcome: Outcome, evaluator: str, training_reward: bool) -> str:
    """The promotion as Markdown: (the training-reward warning first,) the decision, the comparison, the means."""
    comparison, result = contest.comparison, contest.comparison.result
    lines = [TRAINING_REWARD_WARNING, ""] if training_reward else []
    lines += [
        f"# Promotion of {name} version {candidate.version}",
        "",
        f"**{outcome.label.replace('_', ' ').capitalize()}**: {outcome.reason()}.",
        "",
        f"Judged by {evaluator}, against {comparison.opponent}, on the same held-out prompts sampled with the "
        "same seeds. Ties count half; the interval is a seeded bootstrap's 95%.",
        "",
        *markdown_table(
            ("wins", "ties", "losses", "n", "win rate", "95% interval"),
            [
                (
                    result.wins,
                    result.ties,
                    result.losses,
                    result.n,
                    f"{result.win_rate:.3f}",
                    f"[{result.ci_low:.3f}, {result.ci_high:.3f}]",
                )
            ],
        ),
    ]
    mine, theirs = contest.summaries["candidate"], contest.summaries["opponent"]
    wanted = [f"eval/{c.format(column=comparison.column)}_mean" for c in REPORTED_MEANS] + list(OVER_COMPLETIONS)
    rows = [
        (key.removeprefix("eval/").removesuffix("_mean"), f"{mine[key]:.3f}", f"{theirs[key]:.3f}")
        for key in dict.fromkeys(wanted)
        if key in mine and key in theirs
    ]
    if rows:
        lines += ["", *markdown_table(("held-out mean", "candidate", "opponent"), rows)]
    if contest.transcripts:
        lines += ["", TRANSCRIPT_LEGEND]
    return "\n".join(lines)


def publish_comparison(run_id: str, name: str, contest: Contest) -> str:
    """The per-prompt table and the comparison's numbers into the run, the table into Prefect; the table's link."""
    tracking.logs.log_table(run_id, contest.rows, TABLE)
    result = contest.comparison.result
    numbers = {
        "promotion/win_rate": result.win_rate,
        "promotion/ci_low": result.ci_low,
        "promotion/ci_high": result.ci_high,
        **{f"promotion/{k}": float(getattr(result, k)) for k in ("wins", "ties", "losses", "n")},
    }
    for side in ("candidate", "opponent"):
        numbers.update({f"{side}/{k.removeprefix('eval/')}": v for k, v in contest.summaries[side].items()})
    tracking.logs.log_metrics(run_id, numbers, 0)
    publish_table(f"{_key(name)}-prompts", contest.rows, f"{name}: the candidate against {contest.comparison.opponent}")
    return tracking.logs.artifact_link(run_id, TABLE) if tracking.store.writes() else TABLE


def publish_report(run_id: str, name: str, markdown: str, link: str) -> str:
    """The report, ending on the table's link, as the run's description and a Prefect markdown artifact."""
    text = f"{markdown}\n\nPrompt by prompt: {link}"
    tracking.logs.describe_run(run_id, text)
    publish_markdown(_key(name), text, f"Promotion of {name}")
    return text


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", f"promotion-{name.lower()}")


def record(run_id: str, name: str, who: tuple, outcome: Outcome, tags: dict[str, str]) -> dict[str, str]:
    """Move `champion` when promoted (the alias first: if tagging fails after it, a rerun finds it champion), then
    the decision as tags of the candidate version and the run. `who`: (candidate, champion or None)."""
    candidate, champion = who
    if outcome.promoted:
        registry.set_alias(name, CHAMPION, str(candidate.version))
        if champion is not None:
            registry.set_version_tags(name, champion.version, {TAG + "replaced_by": str(candidate.version)})
    approval = outcome.approval.tags() if outcome.approval is not None else {}
    tags = {"decision": outcome.label, **tags, **approval}
    registry.set_version_tags(name, candidate.version, {TAG + k: v for k, v in tags.items()})
    tracking.logs.set_run_tags(run_id, {TAG + k: v for k, v in {**tags, "reason": outcome.reason()}.items()})
    return {**tags, "reason": outcome.reason()}


def link_from_description(name: str, candidate, contest: Contest, outcome: Outcome, links: tuple[str, str]) -> None:
    """A paragraph at the end of the candidate's description: whom it was judged against, the decision and why,
    the run and the per-prompt table (`links`)."""
    run, table = links
    line = (
        f"Promotion against {contest.comparison.opponent}: {outcome.label.replace('_', ' ')}: {outcome.reason()}. "
        f"The {run}; prompt by prompt: {table}"
    )
    existing = candidate.description or ""
    registry.describe_version(f"models:/{name}/{candidate.version}", f"{existing}\n\n{line}".strip())
