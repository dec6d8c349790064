"""The RL stage's reward sources served elsewhere (grpo.rewards entries with a `kind`, docs/served-rewards.md):
the reward models the stage serves itself for its length (`reward_servers`), their scorers for training and for
the evaluation tables (`remote_sources`, `eval_scorers`), what they leave out of the stage key (where and how a
scorer is reached, never what it scores), and the check before the first step (`check_template_columns`: a judge
template names only columns the prompt rows have). That each url answers a first request is checked before any
work (tasks/checks/reward_urls.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from rlhf_core.config import PipelineConfig, RewardSource
from rlhf_core.config.errors import UserError
from rlhf_core.rewards.remote import Unscored
from rlhf_core.rewards.remote_scorers import RemoteScorer, entry_scorer, missing_template_columns, remote_entries

# how a served source is reached, not what it scores: left out of the stage key (a scorer that moved to another
# port, or got a longer timeout, resumes the same stage)
TRANSPORT_FIELDS = frozenset(
    {"url", "timeout_s", "max_concurrency", "max_retries", "backoff_s", "api_key_env", "headers_env", "batch_size"}
)


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
    from tasks.registry.version_server import check_servable, version_server

    sources = remote_entries(cfg)
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
                url = stack.enter_context(version_server(uri, out_dir / f"reward-server-{source.name}.log"))
                rewards[i] = source.model_copy(update={"url": url})
        yield cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={"rewards": rewards})})


def remote_sources(cfg: PipelineConfig) -> dict:
    """Each served source's training reward source (a RewardSourceFn), by its index in grpo.rewards."""
    from rlhf_core.rewards.sources import remote_reward

    return {i: remote_reward(s.name, s.weight, entry_scorer(i, s)) for i, s in remote_entries(cfg)}


def eval_scorers(cfg: PipelineConfig) -> dict:
    """The evaluation tables' columns `reward_<name>` of the served sources: the texts scored, a completion that
    could not be scored left empty (None) under drop_group."""

    def column(scorer: RemoteScorer):
        def score(prompts, completions, **columns):
            return [None if isinstance(v, Unscored) else v for v in scorer(prompts, completions, **columns)]

        return score

    return {f"reward_{s.name}": column(entry_scorer(i, s)) for i, s in remote_entries(cfg)}


def check_template_columns(cfg: PipelineConfig, columns: set[str]) -> None:
    """Refuse, in one sentence, a judge template that names a column the prompt rows lack."""
    for i, source in remote_entries(cfg):
        missing = missing_template_columns(source, columns)
        if missing:
            raise UserError(
                f"grpo.rewards[{i}].template names {{{missing[0]}}}, which the prompt rows lack "
                f"(they have {', '.join(sorted(columns)) or 'no columns'} besides prompt and completion)"
            )
