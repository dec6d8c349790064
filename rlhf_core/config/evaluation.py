"""The sections of what is measured: the held-out evaluation while the policy trains (sampled or greedy, with a
verifier's pass@k and maj@n), the guard's rules against over-optimization and collapse, and promotion (promote.*):
what judges a candidate against the champion (an evaluator the candidate was not trained against), the gates on that
comparison, and a person's approval. `promotion_plan` turns promote.* into the evaluator and gates, or one sentence
saying what is missing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, model_validator

from rlhf_core.config.base import ConfigError, Section
from rlhf_core.config.rewards import RewardSource, check_kind_fields, check_remote


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
        description="The rule's threshold; null: the rule is off. kl_budget: the most mean eval KL to the initial policy, in nats per completion (exact over the vocabulary); min_distinct_ratio: the least distinct-2 of the eval completions as a fraction of the initial policy's; max_length_change: the most |mean answer length (tokens, the stop token not counted) / the initial policy's - 1|.",
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
        description="|mean answer length / the initial policy's - 1| above `limit` (tokens, the stop token not counted: docs/guard.md).",
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


# promotion ----------------------------------------------------------------------------------------------------

PAIRWISE_FIELDS = ("completion_a", "completion_b")  # a pairwise judge's template shows both completions
EVALUATOR_OPTIONS = (
    "a pairwise judge (promote.evaluator.judge), a reward model registered apart "
    "(promote.evaluator.reward_model: models:/<name>@<alias>) or metric functions "
    "(promote.evaluator.metrics: ['module:function'])"
)


class PairwiseJudge(RewardSource):
    """A grpo.rewards judge entry asked about two completions at once: which is better."""

    name: str = Field("judge", min_length=1, description="Name of the judge in the promotion's report.")
    kind: Literal["judge"] = Field("judge", description="Always judge: an OpenAI-compatible endpoint.")
    template: str | None = Field(
        None,
        description="The question, with {prompt}, {completion_a} and {completion_b} (each pair is asked twice, the candidate's completion first, then the champion's) and any column of the prompt rows in braces; both completions' fields are required.",
    )
    score_range: list[float] | None = Field(
        None,
        min_length=2,
        max_length=2,
        description="The answer's first number, in [low, high]: the upper half prefers completion_a, the lower half completion_b, the middle is a tie.",
    )
    labels: dict[str, float] | None = Field(
        None,
        description="The answer's first word mapped to a number, placed between the smallest and largest of them as score_range's are, e.g. {A: 1.0, B: 0.0, tie: 0.5}.",
    )

    @model_validator(mode="after")
    def _one_kind(self) -> PairwiseJudge:  # RewardSource's, with the pairwise template's fields
        where = "promote.evaluator.judge"
        check_kind_fields(self, where)
        check_remote(self, where, shows=PAIRWISE_FIELDS)
        return self

    def bounds(self) -> tuple[float, float]:
        """(low, high) of the answer's scale: score_range, or the smallest and largest label."""
        if self.score_range is not None:
            return self.score_range[0], self.score_range[1]
        return min(self.labels.values()), max(self.labels.values())


class EvaluatorConfig(Section):
    judge: PairwiseJudge | None = Field(
        None,
        description="A judge that sees the prompt and both completions and names the better, asked in both orders (a verdict that flips with the order is a tie). Its fields are a grpo.rewards judge entry's (url, judge_model, api, template with {prompt}, {completion_a} and {completion_b}, labels or score_range, max_tokens, request_params, timeout_s, max_retries, backoff_s, max_concurrency, on_failure, failure_score, api_key_env, headers_env: docs/served-rewards.md).",
    )
    reward_model: str | None = Field(
        None,
        description="A reward model registered apart for evaluation, as models:/<name>@<alias> or models:/<name>/<version>; refused when it is the candidate's own (its reward_model_version tag).",
    )
    metrics: list[str] | None = Field(
        None,
        min_length=1,
        description="Metric functions 'module:function' (as eval.metrics; e.g. rlhf_core.rewards.functions:exact_match); the first decides, prompt by prompt.",
    )

    @model_validator(mode="after")
    def _at_most_one(self) -> EvaluatorConfig:
        chosen = [name for name in ("judge", "reward_model", "metrics") if getattr(self, name) is not None]
        if len(chosen) > 1:
            raise ValueError(f"set one evaluator, not {' and '.join(chosen)}")
        if self.reward_model is not None and not self.reward_model.startswith("models:/"):
            raise ValueError(f"reward_model {self.reward_model!r} must be a models:/<name>@<alias> or version URI")
        for spec in self.metrics or []:
            if ":" not in spec:
                raise ValueError(f"metric {spec!r} must be written 'package.module:function'")
        return self


class PromoteConfig(Section):
    evaluator: EvaluatorConfig = Field(
        default_factory=EvaluatorConfig,
        description=f"What judges promotion: {EVALUATOR_OPTIONS}. None set: in the demo its gold metric (the first of eval.metrics); elsewhere promotion is refused unless allow_training_reward.",
    )
    allow_training_reward: bool = Field(
        False,
        description="With no evaluator, judge by the candidate's own reward model (in the demo too, over its gold metric), which its RL stage was trained to maximise; the report says so on its first line.",
    )
    min_win_rate: float = Field(
        0.5,
        gt=0.0,
        lt=1.0,
        description="Promote over a champion only when the lower bound of the 95% bootstrap interval of the candidate's win rate (ties count half) is above this.",
    )
    max_kl: float | None = Field(
        20.0,
        gt=0.0,
        description="Refuse a candidate whose mean KL to its reference (nats per completion) exceeds this; null: no KL gate.",
    )
    min_value: float | None = Field(
        None,
        description="The candidate's mean of the evaluator's score or metric must reach this, with or without a champion; null: no such floor. Outside the demo the first promotion (no champion yet) with a reward model or metric evaluator needs it.",
    )
    num_prompts: int | None = Field(None, ge=1, description="Held-out prompts compared; null: eval.num_prompts.")
    resamples: int = Field(10000, ge=100, description="Bootstrap resamples of the win rate's interval.")
    approval: Literal["none", "required"] = Field(
        "none",
        description="required: after an evaluation that passes, the flow waits for a person to approve or reject in Prefect's UI (a form on the paused flow run); the alias moves only on approve. Needs a Prefect server.",
    )
    approval_timeout_h: float = Field(
        24.0, gt=0.0, description="Hours the approval form waits; then the champion stays and the tags say so."
    )


@dataclass(frozen=True)
class Evaluator:
    """What judges promotion, as resolved from promote.evaluator and the demo's defaults."""

    kind: Literal["judge", "reward_model", "metrics", "training_reward"]
    column: str | None  # the eval column compared prompt by prompt ('score' or a metric's); None for a judge
    metrics: tuple[str, ...] = ()  # the metric functions scored ('module:function')
    reward_model: str | None = None  # the evaluator's reward model URI (training_reward: the candidate's, found later)
    judge: PairwiseJudge | None = None

    def label(self) -> str:
        """How the promotion.evaluator tag and the report name it."""
        if self.kind == "judge":
            return f"judge {self.judge.judge_model} (pairwise, both orders)"
        if self.kind == "reward_model":
            return f"reward model {self.reward_model}"
        if self.kind == "metrics":
            return f"metric {self.metrics[0]}"
        return "the candidate's own reward model (promote.allow_training_reward)"


@dataclass(frozen=True)
class Gates:
    """The promote.* gates as promotion (rlhf_core/evaluation/promotion.py) reads them."""

    min_win_rate: float
    max_kl: float | None
    min_value: float | None  # a floor on the evaluator's mean, with or without a champion


@dataclass(frozen=True)
class PromotionPlan:
    evaluator: Evaluator
    gates: Gates


def promotion_plan(promote: PromoteConfig, *, demo_gold: str | None, first: bool) -> PromotionPlan:
    """The evaluator and gates of promote.*: `demo_gold` is the demo's gold metric function (None outside the demo);
    `first`: there is no champion yet. A ConfigError of one sentence when outside the demo no evaluator is named, or a
    first champion judged by a mean has no promote.min_value."""
    chosen = promote.evaluator
    if chosen.judge is not None:
        evaluator = Evaluator("judge", None, judge=chosen.judge)
    elif chosen.reward_model is not None:
        evaluator = Evaluator("reward_model", "score", reward_model=chosen.reward_model)
    elif chosen.metrics is not None:
        evaluator = Evaluator("metrics", metric_name(chosen.metrics[0]), metrics=tuple(chosen.metrics))
    elif promote.allow_training_reward:
        evaluator = Evaluator("training_reward", "score")
    elif demo_gold is not None:
        evaluator = Evaluator("metrics", metric_name(demo_gold), metrics=(demo_gold,))
    else:
        raise ConfigError(
            f"promote.evaluator must name what judges promotion outside the demo: {EVALUATOR_OPTIONS}; "
            "promote.allow_training_reward: true judges by the candidate's own reward model instead"
        )
    if evaluator.kind == "judge" and promote.min_value is not None:
        raise ConfigError(
            "promote.min_value floors an evaluator's mean, and a pairwise judge has none: remove it (the judge's "
            "gate is promote.min_win_rate)"
        )
    if first and demo_gold is None and evaluator.kind != "judge" and promote.min_value is None:
        raise ConfigError(
            f"promote.min_value must be set to promote a first champion on {evaluator.column!r} outside the demo: "
            "with no champion yet, the evaluator's mean is all there is to judge"
        )
    return PromotionPlan(evaluator, Gates(promote.min_win_rate, promote.max_kl, promote.min_value))


def metric_name(spec: str) -> str:
    """The eval column of a metric function 'package.module:function': its function's name."""
    return spec.rsplit(":", 1)[-1]
