"""Rewards served elsewhere (grpo.rewards entries with a `kind` and a url, docs/served-rewards.md), checked before
any work: each url answers one request of its kind, with its timeout and retries, and its credential variables are
set. The reward models the RL stage serves itself have no url yet: they are checked when it starts them."""

from __future__ import annotations

from rlhf_core.config import PipelineConfig, RewardSource
from rlhf_core.config.errors import UserError
from rlhf_core.rewards.remote import Unscored
from rlhf_core.rewards.remote_scorers import entry_scorer, judge_body, judge_question, remote_entries


def preflight_problems(cfg: PipelineConfig) -> list[str]:
    """One sentence per served source with a url that does not answer one request (its timeout and retries);
    a missing credential variable too. The reward models the stage serves itself are checked when it starts."""
    problems = []
    for i, source in remote_entries(cfg):
        if source.url is None:
            continue
        try:
            scorer = entry_scorer(i, source)
        except UserError as err:
            problems.append(str(err))
            continue
        answer = scorer.caller.call(probe_body(source))
        if isinstance(answer, Unscored):
            problems.append(
                f"grpo.rewards[{i}] ({source.name}) at {source.url} did not answer a first request: {answer.reason}"
            )
    return problems


def probe_body(source: RewardSource) -> dict:
    """A first request of the source's kind, its texts placeholders."""
    prompt, completion = "(preflight prompt)", "(preflight completion)"
    if source.kind == "reward_model":
        return {"dataframe_records": [{"prompt": prompt, "completion": completion}]}
    if source.kind == "judge":
        from rlhf_core.config.rewards import template_fields

        row = {name: f"({name})" for name in template_fields(source.template)}
        return judge_body(source, judge_question(source.template, prompt, completion, row))
    return {"prompt": prompt, "completion": completion}
