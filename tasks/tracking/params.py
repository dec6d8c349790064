"""What a run logs as its params: the config fields the run reads, flattened as `flatten_config` does (secrets
left out, credentials in URIs hidden). The pipeline's run logs them all (`run_params`), each stage run its sections
(tasks/tracking/runs.py `stage_params`), so that runs compare on what they did and on nothing else.

Left out: the section of the algorithm not run (a PPO run logs no grpo.*, a GRPO-family run no ppo.*, nor the grpo.*
fields only other group algorithms read: `GROUP_FIELDS_FOR`); the tables
the pipeline does not read (`PipelineConfig.data_tables`), and in those it reads the column mappings of other kinds
of table (a prompt table maps only `prompt`) and `since` but in a traces: source; data.demo.* and model.demo.* when nothing comes from the demo world; sft.* but
sft.enabled when SFT is off; reward.* when the reward stage does not run.
"""

from __future__ import annotations

from rlhf_core.config import GRPOConfig, PipelineConfig, reads_grpo_rewards, section_of
from rlhf_core.config.redaction import flatten_config
from rlhf_core.config.rewards import GROUP_FIELDS_FOR

TABLES = ("data.preference", "data.preference_eval", "data.prompts", "data.eval_prompts", "sft.dataset")
KIND_COLUMNS = {  # the column mappings a kind of table reads (rlhf_core/data/rows.py `layout`)
    "preference": ("prompt", "chosen", "rejected", "margin"),
    "prompt": ("prompt",),
    "text": ("text", "messages", "prompt", "completion"),
}


def run_params(cfg: PipelineConfig) -> dict[str, str]:
    """Dotted key -> value of every config field the run reads (the module docstring says what is left out)."""
    tables = {field: (spec, kind) for _, field, spec, kind in cfg.data_tables()}
    algorithm = cfg.rl.algorithm
    read = section_of(algorithm)
    unread = [s for s in ("ppo", "grpo", "dpo") if s != read and not (s == "grpo" and reads_grpo_rewards(algorithm))]
    unread += [t for t in TABLES if t not in tables]
    if read == "grpo":
        unread += [f"grpo.{name}" for name, readers in GROUP_FIELDS_FOR.items() if algorithm not in readers]
    elif reads_grpo_rewards(algorithm):  # online DPO: grpo.rewards alone
        unread += [f"grpo.{name}" for name in GRPOConfig.model_fields if name != "rewards"]
    unread += [
        f"{field}.columns.{column}"
        for field, (spec, kind) in tables.items()
        for column in type(spec.columns).model_fields
        if column not in KIND_COLUMNS[kind]
    ]
    unread += [f"{field}.since" for field, (spec, _) in tables.items() if spec.feedback_experiment is None]
    if not cfg.uses_demo_world():
        unread += ["data.demo", "model.demo"]
    if not cfg.sft.enabled:
        unread += [f"sft.{name}" for name in type(cfg.sft).model_fields if name != "enabled"]
    if not cfg.trains_reward_model():
        unread.append("reward")
    under = tuple(f"{name}." for name in unread)
    return {k: v for k, v in flatten_config(cfg).items() if k not in unread and not k.startswith(under)}
