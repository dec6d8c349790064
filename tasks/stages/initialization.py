"""Policy, value and reference initialization: the `init` stage between the reward model and RL.

`init_stage` decides and checks every model source before any RL work: the policy (the
champion, the SFT output or the base), the value model (the reward model's weights or the policy's),
the reference (a frozen copy or, with LoRA, the policy with its adapters disabled), tokenizer
agreement and the stop ids. Its `InitPlan` (paths and lineage identities) is what tasks/stages/rl/stage.py trains from.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlhf_core.config import GROUP_ALGORITHMS, PREFERENCE_ALGORITHMS, ConfigError, PipelineConfig, reads_grpo_rewards
from rlhf_core.data.rows import DataValidationError
from rlhf_core.data.tables import read_column
from rlhf_core.models.loading import ModelSourceError, generation_config_of, load_tokenizer, run_stop_ids
from rlhf_core.rewards.functions import load_reward_function
from tasks import registry
from tasks.launch import launcher
from tasks.runtime.retry import IO_RETRIES
from tasks.stage_io import Checkpoint
from tasks.stages.data import PreparedData, resolve_model_source


@dataclass(frozen=True)
class InitPlan:
    """Where each model of the RL stage comes from (paths), and what identifies them in lineage."""

    policy_path: str
    policy_identity: str
    value_path: str | None  # PPO only
    reward_path: str | None  # this run's reward model, when it trained one
    reward_identity: str  # NO_REWARD_MODEL without one (part of the RL stage's key, so it stays a string)
    reference: str  # "copy", "adapter_disabled" or "none" (GRPO with beta 0)

    @property
    def lineage(self) -> dict[str, str]:
        """An RL policy's version tags about where it came from: `base_model` (the policy RL started from, and the
        reference promotion measures the KL to) and, only when a reward model scored it, `reward_model_version`."""
        reward = {"reward_model_version": self.reward_identity} if self.reward_identity != NO_REWARD_MODEL else {}
        return {"base_model": self.policy_identity, **reward}


NO_REWARD_MODEL = "none"


def _tokenizer_mismatch(a, b) -> str | None:
    if a.get_vocab() != b.get_vocab():
        return "their vocabularies differ"
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        if getattr(a, name) != getattr(b, name):
            return f"their {name} differ ({getattr(a, name)} vs {getattr(b, name)})"
    return None


def _policy_source(cfg: PipelineConfig, data: PreparedData, sft: Checkpoint | None, logger) -> tuple[str, str]:
    """(path, identity) of the policy's start: the champion, the SFT warm start or the base model."""
    champion = (
        registry.version_by_alias(cfg.registry.policy_model_name, "champion") if cfg.init.policy == "champion" else None
    )
    if champion is not None:  # retraining from what serves today
        policy_identity = f"models:/{cfg.registry.policy_model_name}/{champion.version}"
        return resolve_model_source(policy_identity, field="init.policy", cfg=cfg, world=None), policy_identity
    if cfg.init.policy in ("sft", "champion") and sft is not None:
        if cfg.init.policy == "champion":
            logger.info(
                "no version of %s is champion yet: starting from the SFT warm start", cfg.registry.policy_model_name
            )
        return sft.path, sft.model_uri or f"sft:{sft.key}"
    return data.base_model, cfg.model.base


def _reference(cfg: PipelineConfig) -> str:
    if cfg.rl.algorithm in GROUP_ALGORITHMS and cfg.grpo.beta == 0:
        return "none"
    if cfg.rl.algorithm in PREFERENCE_ALGORITHMS and cfg.dpo.reference_free:
        return "none"
    if cfg.init.reference == "auto":
        return "adapter_disabled" if cfg.model.lora.enabled else "copy"
    return cfg.init.reference


def _check_sources(cfg: PipelineConfig, data: PreparedData, policy_path: str, reward: Checkpoint | None) -> None:
    """Refuse, before any RL work, an empty prompt set, reward sources whose tokenizer is not the policy's,
    stop tokens the policy's tokenizer lacks, and prompt plus response beyond the policy's context."""
    from transformers import AutoConfig

    trained_on, field = ("preference", "data.preference") if cfg.rl.algorithm == "dpo" else ("prompts", "data.prompts")
    if not read_column(data.tables[trained_on], "prompt"):
        raise DataValidationError(f"{field}: the table {data.source(trained_on)} is empty")
    policy_tok = load_tokenizer(policy_path, revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code)
    reward_dirs = [reward.path] if reward is not None else []
    if reads_grpo_rewards(cfg.rl.algorithm):
        reward_dirs += [
            resolve_model_source(r.model, field=f"grpo.rewards[{i}].model", cfg=cfg, world=None)
            for i, r in enumerate(cfg.grpo.rewards)
            if r.model not in (None, "reward_stage")
        ]
        for i, r in enumerate(cfg.grpo.rewards):
            if r.function is not None:
                # fail now, not after generating
                load_reward_function(r.function, r.arguments, field=f"grpo.rewards[{i}]")
    for directory in reward_dirs:
        mismatch = _tokenizer_mismatch(policy_tok, load_tokenizer(directory))
        if mismatch:
            raise ModelSourceError(
                f"the reward model's tokenizer ({directory}) does not match the policy's ({policy_path}): {mismatch}; "
                "train the reward model from the policy's tokenizer"
            )
    run_stop_ids(policy_tok, generation_config_of(policy_path, trust_remote_code=cfg.model.trust_remote_code), cfg.rl)
    context = getattr(
        AutoConfig.from_pretrained(policy_path, trust_remote_code=cfg.model.trust_remote_code),
        "max_position_embeddings",
        None,
    )
    needed = cfg.data.max_prompt_length + cfg.rl.response_length
    if context is not None and needed > context:
        raise ConfigError(
            f"data.max_prompt_length {cfg.data.max_prompt_length} + rl.response_length {cfg.rl.response_length} = "
            f"{needed} tokens exceeds the policy's context of {context}"
        )


@task(name="init", cache_policy=NO_CACHE, **IO_RETRIES)
def init_stage(cfg: PipelineConfig, data: PreparedData, sft: Checkpoint | None, reward: Checkpoint | None) -> InitPlan:
    """Pick the policy, value, reference and reward sources, and check they fit together."""
    logger = launcher.stage_logger()
    policy_path, policy_identity = _policy_source(cfg, data, sft, logger)
    value_path = None
    if cfg.rl.algorithm == "ppo":
        value_path = reward.path if cfg.init.value_from == "reward" else policy_path
    _check_sources(cfg, data, policy_path, reward)
    plan = InitPlan(
        policy_path=policy_path,
        policy_identity=policy_identity,
        value_path=value_path,
        reward_path=reward.path if reward is not None else None,
        reward_identity=(reward.model_uri or f"reward:{reward.key}") if reward is not None else NO_REWARD_MODEL,
        reference=_reference(cfg),
    )
    logger.info("policy from %s, value from %s, reference: %s", policy_identity, value_path, plan.reference)
    return plan
