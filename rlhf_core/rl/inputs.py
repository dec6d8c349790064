"""What an RL trainer takes, one object of the same shape for PPO and the GRPO family: the models to train and
train against, the prompts, the settings and the hooks. Each setting reaches a trainer this one way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf_core.config import DPOConfig, GRPOConfig, PPOConfig, RLConfig, RolloutConfig, RunConfig
from rlhf_core.rewards.sources import RewardSourceFn
from rlhf_core.training.loop import Hooks


@dataclass
class RLModels:
    """The models of an RL stage. `reference` None: a LoRA policy's disabled adapters are the reference (or, for
    the GRPO family with grpo.beta 0, none is needed). PPO trains `value` beside the policy and scores with
    `reward_model`; the GRPO family scores with every source of `rewards`."""

    policy: Any
    tokenizer: Any
    reference: Any = None
    value: Any = None
    reward_model: Any = None
    rewards: list[RewardSourceFn] = field(default_factory=list)


@dataclass(frozen=True)
class PromptSet:
    """The prompts an RL stage samples from: rows with a `prompt` (the columns beside it go to reward functions
    and tool episodes), tokenized up to `max_prompt_length` tokens. For offline DPO the rows are preference pairs
    (prompt, chosen, rejected), each at most `max_length` tokens (None: max_prompt_length + rl.response_length)."""

    rows: list[dict]
    max_prompt_length: int
    max_length: int | None = None


@dataclass(frozen=True)
class RLSettings:
    """The config sections a trainer reads (ppo for PPO, grpo for the GRPO family, dpo for DPO) and what the run decided about
    them: `kl_scale` multiplies the KL coefficient (ppo.kl_coef, the saved one on resume; or grpo.beta) after the
    guard's rollbacks; `stop_token_ids` when the caller computed them (else the policy's own, `run_stop_ids`);
    `template_kwargs` renders tool episodes' chat templates (data.chat_template_kwargs)."""

    rl: RLConfig
    run: RunConfig
    ppo: PPOConfig = field(default_factory=PPOConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    kl_scale: float = 1.0
    stop_token_ids: tuple[int, ...] | None = None
    template_kwargs: dict | None = None


@dataclass(frozen=True)
class RLHooks(Hooks):
    """What the caller of an RL trainer receives along the way (see `TrainingLoop.run`). `evaluate(policy, step)`
    gives eval rows, to `on_eval(rows, step)` every `eval_every` steps and at the end (with `engine=` when the
    rollout engine samples evaluations too); `on_completions(rows, step)` the GRPO family's completions table."""

    evaluate: Callable[..., list[dict]] | None = None
    eval_every: int | None = None
    on_completions: Callable[[list[dict], int], None] | None = None

    @property
    def eval_cadence(self) -> int | None:
        """The loop's evaluation cadence: eval_every when someone receives the evaluations."""
        return self.eval_every if self.on_eval is not None else None


@dataclass
class RLInputs:
    """One RL trainer's input: what to train, on which prompts, how, and who hears about it; checkpoints go to
    (and a run resumes from) `output_dir`."""

    models: RLModels
    prompts: PromptSet
    settings: RLSettings
    output_dir: Path
    hooks: RLHooks = field(default_factory=RLHooks)


MODEL_FIELDS = ("reference", "value", "reward_model", "rewards")
SETTING_FIELDS = ("ppo", "grpo", "dpo", "rollout", "kl_scale", "stop_token_ids", "template_kwargs")


def rl_inputs(
    policy,
    tokenizer,
    prompts: Sequence[str] | Sequence[dict],
    output_dir: str | Path,
    *,
    rl: RLConfig,
    run: RunConfig,
    max_prompt_length: int,
    **named,
) -> RLInputs:
    """`RLInputs` from keywords, for a script or a test: `prompts` as texts or rows; `named` holds the models beside
    the policy (reference, value, reward_model, rewards), the other settings (ppo, grpo, dpo, rollout, kl_scale,
    stop_token_ids, template_kwargs; None keeps the default), `max_length` (offline DPO's pairs: `PromptSet`) and the
    hooks (`RLHooks`' fields)."""
    models = RLModels(policy, tokenizer, **{k: named.pop(k) for k in MODEL_FIELDS if k in named})
    settings = {k: v for k in SETTING_FIELDS if (v := named.pop(k, None)) is not None}
    if "stop_token_ids" in settings:
        settings["stop_token_ids"] = tuple(settings["stop_token_ids"])
    rows = [p if isinstance(p, dict) else {"prompt": p} for p in prompts]
    max_length = named.pop("max_length", None)
    return RLInputs(
        models,
        PromptSet(rows, max_prompt_length, max_length),
        RLSettings(rl, run, **settings),
        Path(output_dir),
        RLHooks(**named),
    )
