"""One RL step, the same shape for PPO and the GRPO family, read top to bottom as its phases:

    rollout (generate + score) -> advantages (ESTIMATORS[rl.algorithm]) -> update (the loss over
    mini- and micro-batches) -> metrics

`rl_step` runs them; a trainer (`ppo.PPOSteps`, `grpo.GRPOSteps`) supplies rollout, update and
metrics, `advantages.estimator_for` the estimator. Around the step: the batch sizes under one set of
names, each step's prompts, what the RL stage's loop runs with, and the metric names of each algorithm.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple, Protocol, TypedDict

import torch

from rlhf_core.config import RLConfig, RolloutConfig, RunConfig
from rlhf_core.data.batching import ShardedBatches
from rlhf_core.data.rows import DataValidationError
from rlhf_core.models.loading import run_stop_ids
from rlhf_core.rl.advantages.estimators import Estimate, EstimatorContext
from rlhf_core.rollout.collect import RolloutBatch, Sampled
from rlhf_core.rollout.engines import RolloutEngine
from rlhf_core.rollout.generation import left_pad, tokenize_prompts
from rlhf_core.rollout.sampling import SamplingSettings, rl_sampling
from rlhf_core.training.loop import (
    Cadence,
    LoopCallbacks,
    LoopMetrics,
    LoopResult,
    LoopSettings,
    OnCheckpoint,
    OnLog,
    OnStep,
    TrainingLoop,
)


@dataclass(frozen=True)
class BatchSizes:
    """How one RL step's completions are cut, named the same for every algorithm (per process)."""

    prompts_per_step: int  # prompts drawn per step
    generations_per_prompt: int  # completions sampled per prompt (GRPO's group; 1 for PPO)
    mini_batch: int  # completions per optimizer step
    micro_batch: int  # completions per forward and backward pass

    @property
    def rollout(self) -> int:
        """Completions per step (rl.batch_size; grpo.generation_batch_size for the group algorithms where set)."""
        return self.prompts_per_step * self.generations_per_prompt

    @property
    def mini_batches(self) -> int:
        """Optimizer steps per pass over the rollout."""
        return max(1, self.rollout // self.mini_batch)

    @property
    def micro_batches(self) -> int:
        """Forward and backward passes per optimizer step (the last may be short)."""
        return -(-self.mini_batch // self.micro_batch)


@dataclass(frozen=True)
class TrainingMetricNames:
    """What an algorithm calls its step's training score and KL (checkpoint choice, curves, progress bar)."""

    score: str
    kl: str


METRIC_NAMES = {"ppo": TrainingMetricNames("objective/scores", "objective/kl")}
GROUP_METRIC_NAMES = TrainingMetricNames("reward", "kl")  # the GRPO family, TRL's names


def training_metric_names(algorithm: str) -> TrainingMetricNames:
    """The training score and KL metric names of rl.algorithm `algorithm`."""
    return METRIC_NAMES.get(algorithm, GROUP_METRIC_NAMES)


class PromptBatch(NamedTuple):
    query_ids: torch.Tensor  # (B, Q) left-padded
    query_mask: torch.Tensor  # (B, Q)
    indices: list[int]  # each row's prompt, an index into the prompt set
    sampled: Sampled | None = None  # its rollout, sampled ahead (`off_policy.py`); None: the step samples it


class PromptBatches:
    """Each RL step's prompts: this process's share of an epoch's shuffle (see `ShardedBatches`), each
    prompt repeated sizes.generations_per_prompt times (GRPO's groups), left-padded on the loop's device."""

    def __init__(self, tokenizer, prompts: list[str], sizes: BatchSizes, *, max_prompt_length: int, seed: int, loop):
        if not prompts:
            raise DataValidationError(
                f"the prompt set is empty; {loop.settings.name.upper()} needs at least one prompt"
            )
        self.prompt_ids = tokenize_prompts(tokenizer, prompts, max_prompt_length)
        self.pad_id, self.repeat, self.device = tokenizer.pad_token_id, sizes.generations_per_prompt, loop.device
        # data parallel: every process rolls out its own prompts_per_step prompts per step
        self.order = ShardedBatches(
            len(self.prompt_ids),
            sizes.prompts_per_step,
            seed,
            rank=loop.rank,
            world=loop.world,
            epoch=loop.epoch,
            position=loop.position,
        )

    @property
    def epoch(self) -> int:
        return self.order.epoch

    @property
    def position(self) -> int:
        return self.order.position

    def next(self) -> PromptBatch:
        indices = [i for i in self.order.next() for _ in range(self.repeat)]
        query_ids, query_mask = left_pad([self.prompt_ids[i] for i in indices], self.pad_id)
        return PromptBatch(query_ids.to(self.device), query_mask.to(self.device), indices)


@dataclass(frozen=True)
class RolloutSettings:
    """How the rollout phase samples: the RL stage's sampling, the run's stop ids, the pad id."""

    sampling: SamplingSettings
    stop_token_ids: tuple[int, ...]
    pad_token_id: int


def rollout_settings(tokenizer, policy, rl: RLConfig, stop_token_ids: Sequence[int] | None = None) -> RolloutSettings:
    """The sampling and stop ids of a policy's rollouts; `stop_token_ids` when the caller computed them already
    (the RL task, which evaluates with them too), else `run_stop_ids` of the policy."""
    if stop_token_ids is None:
        stop_token_ids = run_stop_ids(tokenizer, getattr(policy, "generation_config", None), rl)
    return RolloutSettings(rl_sampling(rl), tuple(stop_token_ids), tokenizer.pad_token_id)


def rl_loop_settings(rl: RLConfig, run: RunConfig, sizes: BatchSizes, *, eval_every: int | None) -> LoopSettings:
    """PPO's and GRPO's loop: rl.total_steps rollout batches, checkpoints of `policy/` (and the models beside it)."""
    names = training_metric_names(rl.algorithm)
    return LoopSettings(
        name=rl.algorithm,
        section="rl",
        total_steps=rl.total_steps,
        optim=rl,
        micro_batches=sizes.micro_batches,
        micro_batch_size=sizes.micro_batch,
        disable_dropout=rl.disable_dropout,
        cadence=Cadence(log_every=rl.log_steps, eval_every=eval_every, save_every=rl.save_steps),
        loop_metrics=LoopMetrics(timing=True),
        shown=(names.score, names.kl),
        keep_last=run.keep_last_checkpoints,
        best_metric=(names.score,),  # the newest N checkpoints and the best by the step's training score
        registered="policy",
    )


class StepStats:
    """The update phase's per-micro-batch statistics, on the device until the metrics phase averages them."""

    def __init__(self):
        self.values: dict[str, list[torch.Tensor]] = defaultdict(list)

    def add(self, **values: torch.Tensor) -> None:
        for key, value in values.items():
            self.values[key].append(value.detach())

    def mean(self, key: str) -> torch.Tensor | float:
        """The mean over the step's micro-batches; NaN when none recorded `key`."""
        return torch.stack(self.values[key]).float().mean() if self.values.get(key) else float("nan")

    def last(self, key: str) -> torch.Tensor | float:
        """The latest value recorded for `key`; NaN when none was."""
        return self.values[key][-1] if self.values.get(key) else float("nan")

    def __contains__(self, key: str) -> bool:
        return bool(self.values.get(key))


class RLSteps(Protocol):
    """An algorithm's phases of one RL step; the advantages between rollout and update come from the estimator."""

    def rollout(self, prompts: PromptBatch) -> RolloutBatch: ...

    def estimator_context(self) -> EstimatorContext: ...

    def update(self, batch: RolloutBatch, estimate: Estimate) -> StepStats: ...

    def metrics(self, batch: RolloutBatch, estimate: Estimate, stats: StepStats) -> dict[str, torch.Tensor | float]: ...


def rl_step(
    steps: RLSteps, estimator: Callable[[RolloutBatch, EstimatorContext], Estimate], prompts: PromptBatch
) -> dict[str, torch.Tensor | float]:
    """One RL step: the four phases in order."""
    batch = steps.rollout(prompts)  # generate and score
    estimate = estimator(batch, steps.estimator_context())  # advantages
    stats = steps.update(batch, estimate)  # the loss over mini- and micro-batches, optimizer steps
    return steps.metrics(batch, estimate, stats)  # what the loop logs


class RLHooks(TypedDict, total=False):
    """What the caller of an RL trainer receives along the way (see `TrainingLoop.run`)."""

    on_log: OnLog
    on_checkpoint: OnCheckpoint
    on_eval: Callable[[list[dict], int], None]
    on_step: OnStep
    evaluate: Callable[..., list[dict]]  # eval rows of (policy, step), sampled by `engine=` when one is given
    eval_every: int  # evaluate every this many steps and at the end
    on_completions: Callable[[list[dict], int], None]  # GRPO's completions table
    show_progress: bool


def run_rl(
    loop: TrainingLoop,
    steps: RLSteps,
    estimator,
    batches: PromptBatches,
    policy,
    hooks: RLHooks,
    eval_engine: RolloutEngine | None = None,
) -> LoopResult:
    """The stage's loop over `rl_step`, with the caller's hooks; with `eval_engine`, evaluations sample there
    (`evaluate(policy, step, engine=...)`), the current policy pushed first."""
    evaluate = hooks.get("evaluate")
    if evaluate is not None and eval_engine is not None:
        evaluate = partial(evaluate_on_engine, evaluate, eval_engine, loop)
    callbacks = LoopCallbacks(
        on_log=hooks.get("on_log"),
        on_step=hooks.get("on_step"),
        evaluate=(lambda at: evaluate(policy, at)) if evaluate else None,
        on_eval=hooks.get("on_eval"),
        on_checkpoint=hooks.get("on_checkpoint"),
    )
    return loop.run(
        lambda prompts: rl_step(steps, estimator, prompts),
        batches,
        callbacks,
        show_progress=hooks.get("show_progress", True),
    )


def evaluate_on_engine(evaluate, engine: RolloutEngine, loop: TrainingLoop, policy, step: int) -> list[dict]:
    """`evaluate(policy, step)` with its samples drawn by `engine`, which gets the policy's weights first."""
    with loop.full_parameters():
        engine.refresh(policy, step)
    return evaluate(policy, step, engine=engine)


def eval_engine_of(engine: RolloutEngine, rollout: RolloutConfig) -> RolloutEngine | None:
    """The engine evaluations sample on: the rollout engine with rollout.vllm.evaluate, else None (our loop)."""
    return engine if rollout.engine == "vllm" and rollout.vllm.evaluate else None


def eval_cadence(hooks: RLHooks) -> int | None:
    """The loop's evaluation cadence: hooks' eval_every when someone receives the evaluations."""
    return hooks.get("eval_every") if hooks.get("on_eval") is not None else None
