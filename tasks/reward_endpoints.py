"""The RL stage's reward sources served elsewhere (grpo.rewards entries with a `kind`, docs/served-rewards.md):
the reward models the stage serves itself for its length (`reward_servers`), their scorers for training and for
the evaluation tables (`served_sources`, `eval_scorers`), what they leave out of the stage key (where and how a
scorer is reached, never what it scores), and the checks before any work (`preflight_problems`: each endpoint
answers one request; `check_template_columns`: a judge template names only columns the prompt rows have).
Light to import (no torch or mlflow at the top): tasks/preflight.py, which `rlhf validate` runs, imports it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from rlhf_core.config import PipelineConfig, RewardSource
from rlhf_core.config.errors import UserError
from rlhf_core.rewards.remote import RemoteRewardError, Unscored
from rlhf_core.rewards.served import ServedScorer, judge_body, judge_question, missing_template_columns

# how a served source is reached, not what it scores: left out of the stage key (a scorer that moved to another
# port, or got a longer timeout, resumes the same stage)
TRANSPORT_FIELDS = frozenset(
    {"url", "timeout_s", "max_concurrency", "max_retries", "backoff_s", "api_key_env", "headers_env", "batch_size"}
)


def served(cfg: PipelineConfig) -> list[tuple[int, RewardSource]]:
    """The GRPO family's served sources with their index in grpo.rewards (PPO reads its reward model in-process)."""
    if cfg.rl.algorithm == "ppo":
        return []
    return [(i, r) for i, r in enumerate(cfg.grpo.rewards) if r.remote]


def keyed_rewards(cfg: PipelineConfig) -> list[dict]:
    """grpo.rewards as the stage key sees them: an in-process source by the fields it had before served sources
    existed (older stages keep their keys), a served one without TRANSPORT_FIELDS."""
    return [
        r.model_dump(mode="json", exclude=set(TRANSPORT_FIELDS))
        if r.remote
        else r.model_dump(mode="json", include={"name", "model", "function", "weight", "arguments"})
        for r in cfg.grpo.rewards
    ]


def version_uri(cfg: PipelineConfig, source: RewardSource, reward_identity: str, *, field: str) -> str:
    """The models:/ URI a stage-served reward model names: its own, or this run's reward version ('reward_stage')."""
    if source.model != "reward_stage":
        return source.model
    if not reward_identity.startswith("models:/"):
        raise UserError(
            f"{field}.model: this run's reward model is not registered ({reward_identity}), so it cannot be served"
        )
    return reward_identity


@contextmanager
def reward_servers(cfg: PipelineConfig, reward_identity: str, out_dir: Path) -> Iterator[PipelineConfig]:
    """`cfg` with the url of each reward model the stage serves itself (kind reward_model without a url):
    `mlflow models serve` of its version, started here and stopped when the block ends, however it ends."""
    from tasks.registry.serving import check_servable, served_model

    sources = served(cfg)
    if not any(r.served_by_stage for _, r in sources):
        yield cfg
        return
    rewards = list(cfg.grpo.rewards)
    with ExitStack() as stack:
        for i, source in sources:
            if source.served_by_stage:
                field = f"grpo.rewards[{i}]"
                uri = version_uri(cfg, source, reward_identity, field=field)
                check_servable(uri, field=f"{field}.model")
                url = stack.enter_context(served_model(uri, out_dir / f"reward-server-{source.name}.log"))
                rewards[i] = source.model_copy(update={"url": url})
        yield cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={"rewards": rewards})})


def _scorer(i: int, source: RewardSource) -> ServedScorer:
    if source.url is None:
        raise RemoteRewardError(f"grpo.rewards[{i}] ({source.name}) has no url: its server was not started")
    return ServedScorer(source, source.url, field=f"grpo.rewards[{i}]")


def served_sources(cfg: PipelineConfig) -> dict:
    """Each served source's training reward source (a RewardSourceFn), by its index in grpo.rewards."""
    from rlhf_core.rewards.sources import served_reward

    return {i: served_reward(s.name, s.weight, _scorer(i, s)) for i, s in served(cfg)}


def eval_scorers(cfg: PipelineConfig) -> dict:
    """The evaluation tables' columns `reward_<name>` of the served sources: the texts scored, a completion that
    could not be scored left empty (None) under drop_group."""

    def column(scorer: ServedScorer):
        def score(prompts, completions, **columns):
            return [None if isinstance(v, Unscored) else v for v in scorer(prompts, completions, **columns)]

        return score

    return {f"reward_{s.name}": column(_scorer(i, s)) for i, s in served(cfg)}


def check_template_columns(cfg: PipelineConfig, columns: set[str]) -> None:
    """Refuse, in one sentence, a judge template that names a column the prompt rows lack."""
    for i, source in served(cfg):
        missing = missing_template_columns(source, columns)
        if missing:
            raise UserError(
                f"grpo.rewards[{i}].template names {{{missing[0]}}}, which the prompt rows lack "
                f"(they have {', '.join(sorted(columns)) or 'no columns'} besides prompt and completion)"
            )


def preflight_problems(cfg: PipelineConfig) -> list[str]:
    """One sentence per served source with a url that does not answer one request (its timeout and retries);
    a missing credential variable too. The reward models the stage serves itself are checked when it starts."""
    problems = []
    for i, source in served(cfg):
        if source.url is None:
            continue
        try:
            scorer = _scorer(i, source)
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
