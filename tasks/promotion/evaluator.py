"""promote.evaluator resolved for one candidate, each fault a user can make refused in one sentence before any
generation: a reward model URI that does not resolve or is the candidate's own, a metric function that does not
import, a judge whose credentials are not set or whose template names a column the prompts lack, an approval with no
Prefect server to show its form."""

from __future__ import annotations

from dataclasses import dataclass, replace

from prefect.settings import PREFECT_API_URL

from rlhf_core.config import PipelineConfig
from rlhf_core.config.errors import UserError
from rlhf_core.config.evaluation import PAIRWISE_FIELDS, Evaluator
from rlhf_core.config.rewards import template_fields
from rlhf_core.rewards.functions import load_function
from rlhf_core.rewards.pairwise_judge import PairwiseJudgeCaller
from tasks import registry


@dataclass(frozen=True)
class Judging:
    """An evaluator ready to use: the reward model as the URI of the version it resolved to (the candidate's own
    for training_reward), the judge's caller with its credentials read."""

    evaluator: Evaluator
    reward_model: str | None = None
    judge: PairwiseJudgeCaller | None = None


def check_approval_server(cfg: PipelineConfig) -> None:
    """promote.approval required needs a Prefect server whose UI shows the form (not the in-process one)."""
    if cfg.promote.approval == "required" and not PREFECT_API_URL.value():
        raise UserError(
            "promote.approval is required, but no Prefect server is set (PREFECT_API_URL): the approval form "
            "needs one whose UI the approver opens (prefect server start, or Prefect Cloud)"
        )


def resolve(evaluator: Evaluator, candidate) -> Judging:
    """The evaluator for `candidate` (a registered version), or one sentence naming the field that is wrong."""
    own = candidate.tags.get("reward_model_version")
    own = own if own and own != "none" else None
    if evaluator.kind == "training_reward":
        if own is None:
            raise UserError(
                f"promote.allow_training_reward judges by the candidate's reward model, but version "
                f"{candidate.version} names none (no reward_model_version tag); set promote.evaluator"
            )
        return Judging(evaluator, reward_model=own)
    if evaluator.kind == "reward_model":
        try:
            version = registry.resolve_version(evaluator.reward_model)
        except registry.MissingVersion as err:
            raise UserError(f"promote.evaluator.reward_model does not resolve: {err}") from None
        uri = f"models:/{version.name}/{version.version}"
        if own is not None and own in (uri, evaluator.reward_model):
            raise UserError(
                f"promote.evaluator.reward_model {evaluator.reward_model} is {uri}, the reward model candidate "
                f"version {candidate.version} was trained against; name one registered apart for evaluation"
            )
        return Judging(replace(evaluator, reward_model=uri), reward_model=uri)
    if evaluator.kind == "metrics":
        for spec in evaluator.metrics:
            load_function(spec, field="promote.evaluator.metrics")
        return Judging(evaluator)
    return Judging(evaluator, judge=PairwiseJudgeCaller(evaluator.judge))


def check_judge_columns(judging: Judging, columns: set[str]) -> None:
    """A judge's template names only the prompt, the two completions and columns the held-out rows have."""
    if judging.judge is None:
        return
    known = {"prompt", *PAIRWISE_FIELDS, *columns}
    missing = [name for name in template_fields(judging.evaluator.judge.template) if name not in known]
    if missing:
        raise UserError(
            f"promote.evaluator.judge's template names {', '.join(missing)}, which the held-out prompt rows do not "
            f"have (they have {', '.join(sorted(columns)) or 'no other column'})"
        )
