"""The sections of what is measured while the policy trains: the held-out evaluation (sampled or greedy,
with a verifier's pass@k and maj@n) and the guard's rules against over-optimization and collapse."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlhf_core.config.base import Section


class EvalConfig(Section):
    every_steps: int = Field(20, ge=1, description="Generate and score held-out completions every this many RL steps.")
    num_prompts: int = Field(64, ge=1, description="Held-out prompts evaluated each time.")
    batch_size: int = Field(64, ge=1, description="Prompts per generation batch.")
    greedy: bool = Field(
        False,
        description="Greedy decoding instead of sampling as in training; the KL and diversity are then of greedy completions, not estimates.",
    )
    temperature: float | None = Field(
        None,
        gt=0.0,
        description="Sampling temperature of evaluation (top_k and top_p are rl's); null: rl.temperature, so that the KL is measured on the policy's own samples.",
    )
    metrics: list[str] | None = Field(
        None,
        description="Metric functions 'module:function' scored on each held-out completion; the first is the gold metric the guard's divergence rule watches. null: in the demo (model.base 'demo') its VADER sentiment, elsewhere none (the divergence rule is then off).",
    )
    samples_per_prompt: int = Field(
        1,
        ge=1,
        description="Also sample this many completions per held-out prompt (at the eval temperature) and score them with eval.verifier for pass@k and maj@n (columns pass_at_<k>, maj_at_<n>); 1 turns this off.",
    )
    pass_at_k: list[int] = Field(
        default_factory=lambda: [1],
        description="The k of the unbiased pass@k estimate 1 - C(n-c, k) / C(n, k) (Chen et al., arXiv:2107.03374), each at most samples_per_prompt.",
    )
    verifier: str | None = Field(
        None,
        description="The eval metric that says a completion is correct (1) or not (0), e.g. exact_match; null: the first of eval.metrics.",
    )

    @model_validator(mode="after")
    def _sampled_metrics(self) -> EvalConfig:
        for k in self.pass_at_k:
            if not 1 <= k <= self.samples_per_prompt and self.samples_per_prompt > 1:
                raise ValueError(
                    f"eval.pass_at_k {k} must be between 1 and eval.samples_per_prompt {self.samples_per_prompt}"
                )
        return self

    def sampled_columns(self) -> list[str]:
        """The per-prompt columns of the sampled evaluation: pass_at_<k> for each k, maj_at_<n>; none with n 1."""
        if self.samples_per_prompt == 1:
            return []
        return [f"pass_at_{k}" for k in self.pass_at_k] + [f"maj_at_{self.samples_per_prompt}"]


GuardAction = Literal["warn", "stop", "rollback"]


class GuardRule(Section):
    limit: float | None = Field(
        None,
        ge=0.0,
        description="The rule's threshold; null: the rule is off. kl_budget: the most mean eval KL to the initial policy, in nats per completion (exact over the vocabulary); min_distinct_ratio: the least distinct-2 of the eval completions as a fraction of the initial policy's; max_length_change: the most |mean completion length / the initial policy's - 1|.",
    )
    action: GuardAction = Field(
        "warn",
        description="On a breach: 'warn' (log it; the checkpoint is marked), 'stop' (end RL), 'rollback' (restore the last checkpoint that passed every rule, strengthen the KL coefficient and go on).",
    )


class DivergenceRule(Section):
    evals: int | None = Field(
        3,
        ge=1,
        description="Fires when the proxy reward rose and the gold metric fell at each of this many evaluations in a row; null: off.",
    )
    gold: str | None = Field(None, description="The gold eval column; null: the first of eval.metrics.")
    proxy: str = Field("score", description="The proxy eval column: 'score' (the reward model) or a reward function's.")
    action: GuardAction = Field("warn", description="On a breach: warn, stop or rollback (as the other rules).")


class GuardConfig(Section):
    kl_budget: GuardRule = Field(
        default_factory=GuardRule,
        description="Mean eval KL to the initial policy above `limit` (nats per completion; exact over the vocabulary at each position of the sampled completions, not a sampling estimate).",
    )
    min_distinct_ratio: GuardRule = Field(
        default_factory=lambda: GuardRule(limit=0.5),
        description="distinct-2 of the eval completions over the initial policy's below `limit` (collapse).",
    )
    max_length_change: GuardRule = Field(
        default_factory=lambda: GuardRule(limit=0.5),
        description="|mean completion length / the initial policy's - 1| above `limit`.",
    )
    divergence: DivergenceRule = Field(
        default_factory=DivergenceRule, description="Over-optimization: the proxy reward keeps rising while gold falls."
    )
    kl_coef_factor: float = Field(
        2.0, gt=1.0, description="A rollback multiplies ppo.kl_coef (or grpo.beta, when above 0) by this."
    )
    max_rollbacks: int = Field(
        2, ge=0, description="Rollbacks allowed in a run; one more breach that asks for one stops RL."
    )
