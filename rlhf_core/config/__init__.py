"""The pipeline configuration: strict pydantic models, one section per stage.

Every field carries a one-line description; defaults follow TRL where TRL has one. A config is read
from YAML, patched with ``--set a.b=value`` overrides, and validated before any work starts; a bad
one raises :class:`ConfigError` with one sentence that names the field and what it accepts.

Split by concern, everything importable from here:

- ``base``: ``Section`` (the strict base model), ``ConfigError`` (a ``UserError``), ``DEMO``;
- ``run_model_data``: the run, model and data sections (and what an accelerate launch file asks for); ``training``: the optimizer settings, SFT,
  reward, init, RL, PPO and GRPO sections; ``pipeline``: eval, export, promote, tracking, registry and
  ``PipelineConfig`` with its derived values; ``cross_checks``: the checks across sections, in the order they fire;
- ``rollout``: the rollout engine (our decode loop or a vLLM server) and the correction of either;
- ``rewards``: the reward sources of the GRPO family (in-process or served); ``redaction``: secrets out of logs and parameters;
- ``loading``: YAML, ``--set`` overrides, validation, the old names of settings that moved; ``errors``: ``UserError`` (what a user causes: the CLI
  prints its sentence and exits 2), one-sentence messages and hints;
- ``reference``: docs/configuration.md, the configuration reference, rendered from the field descriptions.
"""

from rlhf_core.config.base import DEMO, ConfigError, Section
from rlhf_core.config.errors import (
    REPLACED_FIELDS,
    TRL_NAMES,
    UserError,
    describe_error,
    field_paths,
    nested_section,
    section_at,
    unknown_key_hint,
)
from rlhf_core.config.evaluation import DivergenceRule, EvalConfig, GuardConfig, GuardRule
from rlhf_core.config.loading import apply_overrides, load_config, parse_override, validate_config
from rlhf_core.config.pipeline import (
    ExportConfig,
    PipelineConfig,
    PromoteConfig,
    RegistryConfig,
    RetrainConfig,
    TrackingConfig,
)
from rlhf_core.config.rewards import DynamicSampling, GRPOConfig, RewardSource
from rlhf_core.config.rollout import CorrectionConfig, RolloutConfig, VllmSettings
from rlhf_core.config.run_model_data import (
    ColumnMap,
    DataConfig,
    DatasetSpec,
    DemoModelConfig,
    DemoWorldConfig,
    LoraSettings,
    ModelConfig,
    RunConfig,
    accelerate_strategy,
)
from rlhf_core.config.training import (
    DPO_LOSS_TYPES,
    GROUP_ALGORITHMS,
    PREFERENCE_ALGORITHMS,
    DPOConfig,
    InitConfig,
    OptimSettings,
    PPOConfig,
    RewardConfig,
    RLConfig,
    SFTConfig,
    reads_grpo_rewards,
    section_of,
)

__all__ = [
    "DEMO",
    "ConfigError",
    "Section",
    "REPLACED_FIELDS",
    "TRL_NAMES",
    "describe_error",
    "field_paths",
    "nested_section",
    "section_at",
    "unknown_key_hint",
    "apply_overrides",
    "load_config",
    "parse_override",
    "validate_config",
    "DivergenceRule",
    "EvalConfig",
    "ExportConfig",
    "GuardConfig",
    "GuardRule",
    "PipelineConfig",
    "PromoteConfig",
    "RegistryConfig",
    "RetrainConfig",
    "TrackingConfig",
    "accelerate_strategy",
    "UserError",
    "describe_fields",
    "render_reference",
    "ColumnMap",
    "DataConfig",
    "DatasetSpec",
    "DemoModelConfig",
    "DemoWorldConfig",
    "LoraSettings",
    "ModelConfig",
    "RunConfig",
    "CorrectionConfig",
    "RolloutConfig",
    "VllmSettings",
    "GROUP_ALGORITHMS",
    "PREFERENCE_ALGORITHMS",
    "DPO_LOSS_TYPES",
    "DPOConfig",
    "reads_grpo_rewards",
    "section_of",
    "DynamicSampling",
    "GRPOConfig",
    "InitConfig",
    "OptimSettings",
    "PPOConfig",
    "RewardConfig",
    "RewardSource",
    "RLConfig",
    "SFTConfig",
]


def __getattr__(name: str):
    # the reference module is loaded on first use, so `python -m rlhf_core.config.reference` runs it fresh
    if name in ("describe_fields", "render_reference"):
        import importlib

        return getattr(importlib.import_module("rlhf_core.config.reference"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
