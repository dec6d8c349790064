"""What a promotion leaves: the alias moved (only when promoted), the decision as tags of the candidate version and
the run, the per-prompt table in the run (CSV, which MLflow's UI shows as a table) and as a Prefect table artifact,
the report as Markdown (the run's description and a Prefect artifact), and a line in the candidate's description
that links to it."""

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


@dataclass(frozen=True)
class Outcome:
    """A promotion's end: the gates' decision, the approval when one was asked, and the words for both."""

    decision: Decision
    approval: Approval | None = None
    approval_timeout_h: float = 0.0

    @property
    def promoted(self) -> bool:
        return self.decision.promote and (self.approval is None or self.approval.status == "approved")

    @property
    def label(self) -> str:
        """promoted, refused (by the gates), rejected (by a person) or timed_out (no one answered)."""
        if not self.decision.promote:
            return "refused"
        return "promoted" if self.approval is None or self.approval.status == "approved" else self.approval.status

    def reason(self) -> str:
        if self.approval is None or not self.decision.promote:
            return self.decision.reason
        return f"{self.decision.reason}; approval: {self.approval.sentence(self.approval_timeout_h)}"


def comparison_tags(contest: Contest, evaluator: str) -> dict[str, str]:
    """promotion.evaluator, win_rate, ci_low, ci_high, n and kl (unprefixed)."""
    result = contest.comparison.result
    tags = {
        "evaluator": evaluator,
        "win_rate": f"{result.win_rate:.4f}",
        "ci_low": f"{result.ci_low:.4f}",
        "ci_high": f"{result.ci_high:.4f}",
        "n": str(result.n),
    }
    if contest.comparison.kl is not None:
        tags["kl"] = f"{contest.comparison.kl:.4f}"
    return tags


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
        "same seeds.",
        "",
        *markdown_table(
            ("wins", "ties", "losses", "n", "win rate (ties count half)", "95% interval (bootstrap)"),
            [
                (
                    result.wins,
                    result.ties,
                    result.losses,
                    result.n,
                    f"{result.win_rate:.3f}",
                    f"[{result.ci_low:.3f}, {result.ci_high:.3f}]",
                ),
            ],
        ),
    ]
    mine, theirs = contest.summaries["candidate"], contest.summaries["opponent"]
    columns = sorted(set(mine) & set(theirs))
    if columns:
        rows = [(c.removeprefix("eval/"), f"{mine[c]:.4f}", f"{theirs[c]:.4f}") for c in columns]
        lines += ["", *markdown_table(("eval mean", "candidate", "opponent"), rows)]
    if contest.transcripts:
        lines += ["", TRANSCRIPT_LEGEND]
    return "\n".join(lines)


def publish(run_id: str, name: str, contest: Contest, markdown: str) -> str:
    """The per-prompt table and the report into the run and Prefect; the table's link, as Markdown."""
    tracking.logs.log_table(run_id, contest.rows, TABLE)
    link = tracking.logs.artifact_link(run_id, TABLE) if tracking.store.writes() else TABLE
    text = f"{markdown}\n\nPrompt by prompt: {link}"
    tracking.logs.describe_run(run_id, text)
    key = re.sub(r"[^a-z0-9-]+", "-", f"promotion-{name.lower()}")
    publish_markdown(key, text, f"Promotion of {name}")
    publish_table(f"{key}-prompts", contest.rows, f"{name}: the candidate against {contest.comparison.opponent}")
    return link


def record(run_id: str, name: str, who: tuple, outcome: Outcome, tags: dict[str, str]) -> dict[str, str]:
    """Move `champion` when promoted (the alias first: if tagging fails after it, a rerun finds it champion), then
    the decision as tags of the candidate version and the run. `who`: (candidate, champion or None)."""
    candidate, champion = who
    if outcome.promoted:
        registry.set_alias(name, CHAMPION, str(candidate.version))
        if champion is not None:
            registry.set_version_tags(name, champion.version, {TAG + "replaced_by": str(candidate.version)})
    tags = {
        "decision": outcome.label,
        "reason": outcome.reason(),
        **tags,
        **(outcome.approval.tags() if outcome.approval is not None else {}),
        "mlflow_run_id": run_id,
    }
    registry.set_version_tags(name, candidate.version, {TAG + k: v for k, v in tags.items()})
    tracking.logs.set_run_tags(run_id, {TAG + k: v for k, v in tags.items()})
    return tags


def link_from_description(name: str, candidate, outcome: Outcome, summary: str, link: str) -> None:
    """A line at the end of the candidate's description: the decision, the comparison and where its table is."""
    line = f"Promotion: {outcome.label.replace('_', ' ')}; {summary}; prompt by prompt: {link}"
    existing = candidate.description or ""
    registry.describe_version(f"models:/{name}/{candidate.version}", f"{existing}\n\n{line}".strip())
