"""One RL step, the same shape for PPO and the GRPO family, read top to bottom as its phases (`rl_step`):

    sample (the stage's sampler: here, or ahead) -> score -> refill (dynamic sampling) -> advantages (the
    estimator of rl.algorithm) -> update (the loss over mini- and micro-batches) -> metrics

Around it: the batch sizes under one set of names, each step's prompts, how rollouts are sampled, the loop the RL
stage runs on and its callbacks, and the metric names of each algorithm.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from rlhf_core.config import RLConfig, RolloutConfig, RunConfig
from rlhf_core.data.batching import ShardedBatches, micro_batch_plan
from rlhf_core.data.rows import DataValidationError
from rlhf_core.models.loading import run_stop_ids
from rlhf_core.rl.advantages.estimators import Estimate, EstimatorContext
from rlhf_core.rl.inputs import RLHooks, RLSettings
from rlhf_core.rollout.collect import RolloutBatch, Sampled, SamplingSpec, ToolRollout
from rlhf_core.rollout.engines import RolloutEngine
from rlhf_core.rollout.generation import left_pad, tokenize_prompts
from rlhf_core.rollout.sampling import rl_sampling
from rlhf_core.training.loop import Cadence, LoopCallbacks, LoopMetrics, LoopSettings, TrainingLoop


@dataclass(frozen=True)
class BatchSizes:
    """How one RL step's completions are cut, named the same for every algorithm (per process)."""

    prompts_per_step: int  # prompts drawn per step
    generations_per_prompt: int  # completions sampled per prompt (GRPO's group; 1 for PPO)
    mini_batch: int  # completions per optimizer step
    micro_batch: int  # completions per forward and backward pass
    max_tokens: int | None = None  # rl.max_tokens_per_micro_batch: micro-batches by tokens instead of micro_batch

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


def micro_plan(loop: TrainingLoop, sizes: BatchSizes, query_mask, resp_mask, rows: Sequence[int] | None = None):
    """The micro-batches (lists of rows) of `rows` of a batch (every row when None), for every forward and backward
    pass: sizes.micro_batch rows each in order, or packed by length within sizes.max_tokens (`micro_batch_plan`),
    then as many on every process (their greatest count: a sharded model's forwards are collective)."""
    rows = list(range(query_mask.shape[0])) if rows is None else list(rows)
    lengths = (query_mask.sum(1) + resp_mask.sum(1))[rows].tolist()
    plan = micro_batch_plan(lengths, sizes.micro_batch, sizes.max_tokens)
    if sizes.max_tokens is not None and loop.world > 1:
        count = int(loop.gather(torch.tensor([len(plan)], device=loop.device)).max())
        plan = micro_batch_plan(lengths, sizes.micro_batch, sizes.max_tokens, count=count)
    return [[rows[i] for i in micro] for micro in plan]


@dataclass(frozen=True)
class TrainingMetricNames:
    """What an algorithm calls its step's training score and KL (checkpoint choice, curves, progress bar)."""

    score: str
    kl: str | None  # None: the algorithm logs none in training (offline DPO)


METRIC_NAMES = {
    "ppo": TrainingMetricNames("objective/scores", "objective/kl"),
    # DPO trains on pairs it did not sample: no KL of its own samples to log, the evaluations measure it
    "dpo": TrainingMetricNames("rewards/margins", None),
    "online_dpo": TrainingMetricNames("objective/scores", "objective/kl"),  # TRL's online trainer's
}
GROUP_METRIC_NAMES = TrainingMetricNames("reward", "kl")  # the GRPO family, TRL's names


def training_metric_names(algorithm: str) -> TrainingMetricNames:
    """The training score and KL metric names of rl.algorithm `algorithm`."""
    return METRIC_NAMES.get(algorithm, GROUP_METRIC_NAMES)


class PromptBatch(NamedTuple):
    query_ids: torch.Tensor  # (B, Q) left-padded
    query_mask: torch.Tensor  # (B, Q)
    indices: list[int]  # each row's prompt, an index into the prompt set


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


def sampling_spec(
    tokenizer, policy, settings: RLSettings, prompt_repeats: int = 1, tools: ToolRollout | None = None
) -> SamplingSpec:
    """How a stage's rollouts are sampled: rl's sampling, the stop ids (settings.stop_token_ids when the caller
    computed them, as the RL task does to evaluate with them too; else `run_stop_ids` of the policy), the pad id, and
    rl.max_tokens_per_micro_batch, which our decode loop keeps its KV cache within."""
    stop_token_ids = settings.stop_token_ids
    if stop_token_ids is None:
        stop_token_ids = run_stop_ids(tokenizer, getattr(policy, "generation_config", None), settings.rl)
    return SamplingSpec(
        rl_sampling(settings.rl),
        tokenizer.pad_token_id,
        tuple(stop_token_ids),
        prompt_repeats,
        tools,
        max_tokens=settings.rl.max_tokens_per_micro_batch,
    )


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
        shown=(names.score, names.kl) if names.kl else (names.score, "rewards/accuracies"),
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
    """An algorithm's phases of one RL step (`rl_step`); `sampler` is where its batches come from (`samplers.py`)."""

    sampler: Sampler
    estimator: Callable[[RolloutBatch, EstimatorContext], Estimate]

    def score(self, prompts: PromptBatch, sampled: Sampled) -> RolloutBatch: ...

    def refill(self, batch: RolloutBatch) -> RolloutBatch: ...

    def estimator_context(self) -> EstimatorContext: ...

    def update(self, batch: RolloutBatch, estimate: Estimate) -> StepStats: ...

    def metrics(self, batch: RolloutBatch, estimate: Estimate, stats: StepStats) -> dict[str, torch.Tensor | float]: ...


class Sampler(Protocol):
    """What samples a step's prompts: `sample(prompts, call)` gives their completions, unscored (`samplers.py`; `call`: the
    generation round within the step, dynamic sampling's, which seeds an engine's requests); `metrics`, its own
    numbers of the latest step; `close()` when the stage's loop ends."""

    metrics: dict[str, float]

    def sample(self, prompts: PromptBatch, call: int = 0) -> Sampled: ...

    def close(self) -> None: ...


def rl_step(steps: RLSteps, prompts: PromptBatch) -> dict[str, torch.Tensor | float]:
    """One RL step. The batch is sampled by steps.sampler, chosen once for the stage (`samplers.sampler_for`):
    here, on the rollout engine, by the policy this step trains; or, with rollout.max_staleness > 0, taken from
    the generator that sampled it ahead, while earlier steps trained."""
    sampled = steps.sampler.sample(prompts)  # the completions, unscored
    batch = steps.score(prompts, sampled)  # log-probs under the policy and the reference, rewards (PPO: values)
    batch = steps.refill(batch)  # dynamic sampling: groups without spread replaced by fresh ones (else as it is)
    estimate = steps.estimator(batch, steps.estimator_context())  # advantages
    stats = steps.update(batch, estimate)  # the loss over mini- and micro-batches, optimizer steps
    return steps.metrics(batch, estimate, stats)  # what the loop logs


def loop_callbacks(hooks: RLHooks, loop: TrainingLoop, policy, eval_engine: RolloutEngine | None) -> LoopCallbacks:
    """The loop's callbacks from an RL trainer's hooks: `evaluate(policy, step)` of the policy being trained; with
    `eval_engine`, its samples drawn there (`evaluate(policy, step, engine=...)`), the current policy pushed first."""

    def evaluate(step: int) -> list[dict]:
        if eval_engine is None:
            return hooks.evaluate(policy, step)
        with loop.full_parameters():
            eval_engine.refresh(policy, step)
        return hooks.evaluate(policy, step, engine=eval_engine)

    return LoopCallbacks(
        on_log=hooks.on_log,
        on_step=hooks.on_step,
        evaluate=evaluate if hooks.evaluate is not None else None,
        on_eval=hooks.on_eval,
        on_checkpoint=hooks.on_checkpoint,
    )


def eval_engine_of(engine: RolloutEngine, rollout: RolloutConfig) -> RolloutEngine | None:
    """The engine evaluations sample on: the rollout engine with rollout.vllm.evaluate, else None (our loop)."""
    return engine if rollout.engine == "vllm" and rollout.vllm.evaluate else None
