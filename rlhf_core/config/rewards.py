"""The GRPO family's section (`GRPOConfig`, grpo.*, which online DPO reads for its rewards too) and its reward
sources (grpo.rewards entries): a reward model or a Python function in the stage's process, or a scorer served
elsewhere and reached over HTTP (`kind`: reward_model, judge or http), with the request settings every remote kind
shares (timeout, retries, concurrency, failure policy, credentials from the environment) and each kind's own beside
them."""

from __future__ import annotations

import re
import string
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from rlhf_core.config.base import PathText, Section

REMOTE_KINDS = ("reward_model", "judge", "http")
# the fields only some kinds take: set for another kind (or an in-process source, kind null), they are refused
KIND_FIELDS = {
    "model": (None, "reward_model"),
    "function": (None,),
    "arguments": (None,),
    "url": REMOTE_KINDS,
    "timeout_s": REMOTE_KINDS,
    "max_concurrency": REMOTE_KINDS,
    "max_retries": REMOTE_KINDS,
    "backoff_s": REMOTE_KINDS,
    "on_failure": REMOTE_KINDS,
    "failure_score": REMOTE_KINDS,
    "api_key_env": REMOTE_KINDS,
    "headers_env": REMOTE_KINDS,
    "batch_size": ("reward_model",),
    "token_ids": ("reward_model",),
    "judge_model": ("judge",),
    "api": ("judge",),
    "template": ("judge",),
    "score_range": ("judge",),
    "labels": ("judge",),
    "max_tokens": ("judge",),
    "request_params": ("judge",),
    "score_path": ("http",),
}
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# what a judge template may name besides the row's columns
TEMPLATE_FIELDS = ("prompt", "completion")


def template_fields(template: str) -> list[str]:
    """The names a judge template's {placeholders} use, in order, each once ('{{' and '}}' are literal braces)."""
    names = []
    for _, field, _, _ in string.Formatter().parse(template):
        if field is not None:
            name = re.split(r"[.\[!:]", field, maxsplit=1)[0]
            if name not in names:
                names.append(name)
    return names


class RewardSource(Section):
    name: str = Field(..., min_length=1, description="Name of this reward in metrics (rewards/<name>/mean).")
    kind: Literal["reward_model", "judge", "http"] | None = Field(
        None,
        description="null: a reward model or function run in the stage's process (model or function). Served elsewhere and reached over HTTP: reward_model (a reward model behind `mlflow models serve`: url, or model as a models:/ URI or 'reward_stage' that the stage serves itself), judge (an OpenAI-compatible chat or completions endpoint asked with template) or http (any scorer: a JSON POST per completion, the score at score_path). docs/served-rewards.md.",
    )
    model: PathText | None = Field(
        None,
        description="A reward model: 'reward_stage' (this run's), a directory, hub name or models:/ URI. With kind reward_model and no url: 'reward_stage' or a models:/ URI, which the stage serves with `mlflow models serve` for its length.",
    )
    function: str | None = Field(None, description="A Python reward function as 'package.module:function'.")
    weight: float = Field(1.0, description="Weight of this reward in the sum.")
    arguments: dict[str, float | int | str | bool] = Field(
        default_factory=dict,
        description="Keyword arguments bound to the function (e.g. soft_overlong_punishment's max_completion_len).",
    )
    url: str | None = Field(
        None,
        description="The scorer's endpoint: reward_model, `mlflow models serve`'s http://host:port/invocations; judge, an OpenAI-compatible http://host:port/v1 (the api's path is appended) or the full .../chat/completions or .../completions URL; http, the URL each completion is POSTed to. No credentials in it: api_key_env.",
    )
    timeout_s: float = Field(30.0, gt=0.0, description="Seconds one request may take before it counts as failed.")
    max_concurrency: int = Field(8, ge=1, description="Requests to this source in flight at once.")
    max_retries: int = Field(
        3,
        ge=0,
        description="Retries of a request that failed transiently (connection refused, reset or broken mid-answer, a timeout, HTTP 408, 429 or 5xx), waiting backoff_s, then twice as long each time (a 429's Retry-After, when longer); other failures are not retried.",
    )
    backoff_s: float = Field(1.0, ge=0.0, description="Seconds before the first retry; doubled for each next one.")
    on_failure: Literal["fail", "drop_group", "score"] = Field(
        "fail",
        description="When a completion cannot be scored (retries spent, a refused request, an answer without a score): fail stops the stage with one sentence; drop_group leaves that completion's whole group out of the step (every source unscored: advantage 0, counted in rewards/<name>/dropped_groups); score gives it failure_score (counted in rewards/<name>/failures). Never a silent 0.",
    )
    failure_score: float | None = Field(
        None, description="The score of a completion that could not be scored, with on_failure: score."
    )
    api_key_env: str | None = Field(
        None,
        description="Name of the environment variable holding the bearer token sent as `Authorization: Bearer ...` (OpenAI's API key). The name, never the key: the key is read when the stage starts and appears in no config, log, MLflow or Prefect record.",
    )
    headers_env: dict[str, str] = Field(
        default_factory=dict,
        description="Extra request headers, each header name -> the environment variable holding its value (e.g. {X-Api-Key: SCORER_KEY}).",
    )
    batch_size: int | None = Field(
        None,
        ge=1,
        description="reward_model: completions per request, each request one forward pass on the server; null: the step's completions in one request, as the in-process reward model scores them in one pass (only then, with token_ids, are the scores the in-process model's bit for bit on the same machine).",
    )
    token_ids: bool = Field(
        True,
        description="reward_model: send each completion's token ids with its text, so a reward model of the policy's tokenizer (this pipeline's registered versions) scores the very tokens sampled, as the in-process one does; false: texts only, tokenized by the server (a reward model with a tokenizer of its own).",
    )
    judge_model: str | None = Field(
        None, description="judge: the model name the endpoint serves (the requests' `model`)."
    )
    api: Literal["chat", "completions"] = Field(
        "chat",
        description="judge: /chat/completions (the template is the user message; the server applies the judge's chat template) or /completions (the template is the prompt).",
    )
    template: str | None = Field(
        None,
        description="judge: the question, with {prompt}, {completion} and any column of the prompt rows in braces ({{ and }} for literal braces); a column the data lacks is refused before training.",
    )
    score_range: list[float] | None = Field(
        None,
        min_length=2,
        max_length=2,
        description="judge: the answer's first number is the score and must lie in [low, high]; one outside, or none, is a parse failure.",
    )
    labels: dict[str, float] | None = Field(
        None,
        description="judge: the answer's first word (case and punctuation ignored) mapped to its score, e.g. {'yes': 1.0, 'no': 0.0} (quoted: YAML reads a bare yes as true); any other answer is a parse failure.",
    )
    max_tokens: int = Field(
        16, ge=1, description="judge: the most tokens of the judge's answer (greedy: temperature 0)."
    )
    request_params: dict[str, Any] = Field(
        default_factory=dict,
        description="judge: more fields of each request, over the defaults (e.g. vLLM's structured_outputs: {choice: [good, bad]}, which makes the judge answer one of the labels; a seed).",
    )
    score_path: str = Field(
        "score",
        min_length=1,
        description="http: where the score is in the JSON answer, keys and list indices joined by dots (e.g. result.scores.0).",
    )

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, name: str | None) -> str | None:
        if name is not None and not ENV_NAME.fullmatch(name):  # the value is never echoed: it may be the key
            raise ValueError("must name an environment variable (letters, digits, _), not hold the key itself")
        return name

    @field_validator("headers_env")
    @classmethod
    def _env_names(cls, headers: dict[str, str]) -> dict[str, str]:
        for header, name in headers.items():
            if not ENV_NAME.fullmatch(name):
                raise ValueError(f"header {header} must name an environment variable, not hold its value")
        return headers

    @field_validator("url")
    @classmethod
    def _plain_url(cls, url: str | None) -> str | None:
        if url is None:
            return url
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL with a host")
        if parts.username or parts.password:
            raise ValueError("must not carry credentials; name the environment variable in api_key_env")
        return url

    @model_validator(mode="after")
    def _one_kind(self) -> RewardSource:
        where = f"reward '{self.name}'"
        check_kind_fields(self, where)
        if self.kind is None:
            if (self.model is None) == (self.function is None):
                raise ValueError(f"{where} must set exactly one of model or function")
            if self.function is not None and ":" not in self.function:
                raise ValueError(f"function '{self.function}' must be written 'package.module:function'")
            return self
        check_remote(self, where)
        return self

    @property
    def remote(self) -> bool:
        """Scored by a server elsewhere, over HTTP."""
        return self.kind is not None

    @property
    def served_by_stage(self) -> bool:
        """A reward model the stage serves itself for its length (kind reward_model without a url)."""
        return self.kind == "reward_model" and self.url is None


def check_kind_fields(source: RewardSource, where: str) -> None:
    """No field set that only another kind takes (set: other than its default; a dumped config has them all)."""
    for field, kinds in KIND_FIELDS.items():
        if source.kind not in kinds and getattr(source, field) != type(source).model_fields[field].get_default(
            call_default_factory=True
        ):
            takes = " or ".join(k or "null (in-process)" for k in kinds)
            raise ValueError(f"{where} sets {field}, which only kind {takes} takes")


def check_remote(source: RewardSource, where: str, shows: tuple[str, ...] = ("completion",)) -> None:
    """A served source's own fields: what its kind needs (a judge's template shows the `shows` fields), and its
    failure policy's score."""
    if source.kind == "reward_model":
        if (source.url is None) == (source.model is None):
            raise ValueError(f"{where} (kind reward_model) must set exactly one of url or model")
        if source.model is not None and not (source.model == "reward_stage" or source.model.startswith("models:/")):
            raise ValueError(f"{where}: a served reward model is 'reward_stage' or a models:/ URI, not {source.model}")
    elif source.url is None:
        raise ValueError(f"{where} (kind {source.kind}) needs the url of its endpoint")
    if source.kind == "judge":
        if source.judge_model is None or source.template is None:
            raise ValueError(f"{where} (kind judge) needs judge_model and template")
        if (source.score_range is None) == (source.labels is None):
            raise ValueError(f"{where} (kind judge) must set exactly one of score_range or labels")
        if source.score_range is not None and not source.score_range[0] < source.score_range[1]:
            raise ValueError(f"{where}: score_range must be [low, high] with low < high")
        missing = [f"{{{name}}}" for name in shows if name not in template_fields(source.template)]
        if missing:
            raise ValueError(f"{where}: the template must show {' and '.join(missing)}, what it judges")
    if (source.on_failure == "score") != (source.failure_score is not None):
        raise ValueError(f"{where}: failure_score is set exactly when on_failure is score")


class DynamicSampling(Section):
    enabled: bool = Field(
        False,
        description="Drop the groups whose reward has zero spread (they teach nothing) and sample more prompts until the generation batch is full (DAPO's dynamic sampling; the GRPO family: refused for ppo).",
    )
    max_rounds: int = Field(
        3,
        ge=1,
        description="Most extra generation rounds per step; a batch still short after them is filled with zero-spread groups (which carry no advantage) and the step goes on.",
    )


def _default_grpo_rewards() -> list[RewardSource]:
    return [RewardSource(name="reward_model", model="reward_stage")]


class GRPOConfig(Section):
    """The group algorithms' section (rl.algorithm grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline)."""

    num_generations: int = Field(8, ge=2, description="Completions sampled per prompt (the group).")
    generation_batch_size: int | None = Field(
        None,
        ge=2,
        description="Completions generated per RL step by the group algorithms, num_generations per prompt (TRL's name, per process here); null: rl.batch_size. Lets one config give PPO and GRPO each their own batch.",
    )
    epsilon: float = Field(0.2, gt=0.0, description="Lower clip of the importance ratio.")
    epsilon_high: float | None = Field(
        None,
        gt=0.0,
        description="Upper clip of the ratio; null uses epsilon. With loss_type cispo: the cap of the ratio (TRL recommends 5.0).",
    )
    delta: float | None = Field(
        None,
        gt=1.0,
        description="Two-sided clipping (INTELLECT-2): cap the unclipped ratio at delta; null is off. Should exceed 1 + epsilon_high.",
    )
    beta: float = Field(
        0.0,
        ge=0.0,
        description="KL coefficient to the reference; 0 loads no reference (TRL's GRPO default). grpo adds beta x k3 KL to the loss; rloo and reinforce_plus_plus* subtract beta x KL (kl_estimator) from the reward.",
    )
    kl_estimator: Literal["k1", "k3"] = Field(
        "k1",
        description="KL estimator of the penalty rloo and reinforce_plus_plus* put into the reward: k1 (log ratio; TRL's RLOO and verl's default) or k3 (never negative). grpo's loss term is always k3.",
    )
    normalize_advantages: bool = Field(
        False, description="rloo: normalize the advantages over the whole generation batch (TRL's RLOO option)."
    )
    reward_clip_range: list[float] | None = Field(
        None,
        min_length=2,
        max_length=2,
        description="rloo: clip each completion's summed reward into [low, high] before the KL penalty.",
    )
    gamma: float = Field(
        1.0, ge=0.0, le=1.0, description="reinforce_plus_plus: discount of the return over response tokens (verl's)."
    )
    use_bias_correction_kl: bool = Field(
        True, description="Multiply the k3 KL term by the importance ratio (TRL 1.16's default)."
    )
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"] = Field(
        "dapo",
        description="Loss: grpo, bnpo, dr_grpo, dapo (TRL's default), cispo (clipped-IS-weight policy gradient) or sapo (soft gate).",
    )
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token", description="Importance ratio per token, or one per sequence from the mean log ratio (GSPO)."
    )
    sapo_temperature_pos: float = Field(
        1.0, gt=0.0, description="SAPO's gate temperature for tokens with positive advantage."
    )
    sapo_temperature_neg: float = Field(
        1.05, gt=0.0, description="SAPO's gate temperature for tokens with non-positive advantage."
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Divide advantages by the group's, the batch's or no std."
    )
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        "sum_then_normalize",
        description="Weighted sum of rewards then group-normalize, or normalize each reward per group, sum, then batch-normalize.",
    )
    top_entropy_quantile: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Train only on the tokens whose entropy is in this top fraction of the batch's; 1.0 trains on all.",
    )
    num_iterations: int = Field(
        1, ge=1, description="Updates per generation batch, reusing stored old log-probabilities."
    )
    steps_per_generation: int | None = Field(
        None,
        ge=1,
        description="Micro-batches the generation batch (grpo.generation_batch_size or rl.batch_size completions) is split into (TRL's name); a multiple of rl.gradient_accumulation_steps; null: rl.gradient_accumulation_steps, i.e. one optimizer step per generation batch.",
    )
    mask_truncated_completions: bool = Field(
        False, description="Leave completions without a stop token out of the loss."
    )
    sync_ref_model: bool = Field(
        False, description="Mix the policy into the reference every ref_model_sync_steps optimizer steps (TR-DPO)."
    )
    ref_model_mixup_alpha: float = Field(
        0.6, ge=0.0, le=1.0, description="ref = alpha * policy + (1 - alpha) * ref at each sync."
    )
    ref_model_sync_steps: int = Field(512, ge=1, description="Optimizer steps between reference syncs.")
    dynamic_sampling: DynamicSampling = Field(
        default_factory=DynamicSampling, description="DAPO's dynamic sampling (any group algorithm)."
    )
    rewards: list[RewardSource] = Field(
        default_factory=_default_grpo_rewards,
        min_length=1,
        description="Reward sources and weights: a reward model or function in the stage's process, or a scorer served elsewhere (kind; docs/served-rewards.md).",
    )
    log_completions_steps: int = Field(
        10,
        ge=1,
        description="Log a table of completions and rewards every this many steps (CSV in MLflow, Parquet in the stage directory).",
    )
    tools: list[str] = Field(
        default_factory=list,
        description="Tools the policy may call in its rollouts, each 'package.module:function' (sync or async; TRL's tools=): its name, type hints and Google-style docstring are the schema the chat template shows. A tool that raises, runs past grpo.tool_timeout_s or does not exist answers with its error text; the episode goes on (docs/tools.md).",
    )
    environment: str | dict[str, str] | None = Field(
        None,
        description="An environment class 'package.module:Class', one instance per episode (TRL's environment_factory=): reset(**row) may return text appended to the prompt's last user message, its public methods are tools, and get_reward(), when it has one, is a reward source of weight 1. Or a mapping name -> class, the prompt rows' `environment` column choosing one per row.",
    )
    max_tool_calls: int | None = Field(
        None,
        ge=0,
        description="Rounds of tool calls per episode at most (TRL's max_tool_calling_iterations): a turn's calls run together, then the model speaks again; null: until rl.response_length, which counts the tool answers' tokens too, runs out.",
    )
    tool_timeout_s: float = Field(
        10.0,
        gt=0.0,
        description="Seconds one tool call may take; past them the model gets a timeout error as the answer.",
    )

    @field_validator("tools")
    @classmethod
    def _import_paths(cls, tools: list[str]) -> list[str]:
        for spec in tools:
            if ":" not in spec:
                raise ValueError(f"tool '{spec}' must be written 'package.module:function'")
        return tools

    @property
    def uses_tools(self) -> bool:
        """Episodes of several turns: tools or an environment are configured."""
        return bool(self.tools) or self.environment is not None

    def generation_batch(self, rl_batch_size: int) -> int:
        """Completions per RL step: generation_batch_size, or rl.batch_size where it is null."""
        return self.generation_batch_size or rl_batch_size


# grpo-section fields that only some group algorithms read; setting one for another algorithm is an error
GROUP_FIELDS_FOR = {
    "loss_type": ("grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"),
    "importance_sampling_level": ("grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"),
    "delta": ("grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"),
    "sapo_temperature_pos": ("grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"),
    "sapo_temperature_neg": ("grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"),
    "top_entropy_quantile": ("grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"),
    "use_bias_correction_kl": ("grpo",),
    "scale_rewards": ("grpo",),
    "multi_objective_aggregation": ("grpo",),
    "kl_estimator": ("rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"),
    "normalize_advantages": ("rloo",),
    "reward_clip_range": ("rloo",),
    "gamma": ("reinforce_plus_plus",),
}
