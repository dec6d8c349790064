"""Where an RL step's batch comes from, chosen once per stage (`sampler_for`):

- `StepSampler`: sampled in the step, on the rollout engine (our decode loop, or the vLLM server given the step's
  weights first), by the policy the step trains;
- `AheadSampler`: taken from a generator apart that sampled it ahead of training (rollout.max_staleness k > 0,
  TRL's max_staleness, verl's staleness_threshold).

Either way the loop's batch iterator yields prompts only, and `rl_step` asks the sampler for their rollout.

Generation ahead: a policy's version is the number of RL steps it has trained. Before step t, `AheadSampler.next()`
1. publishes the policy to the generator (`rollout/ahead.py`) as version t, every `sync_every` steps;
2. draws the prompts of the steps up to t + k not drawn yet and submits each, to be sampled by the newest version
   published: step t + k by version t. So the generator samples step t + k while step t trains, and once the first k
   steps are past every batch is exactly k versions old (with a publish every step): the same run each time, as a
   synchronous one is;
3. hands the loop step t's prompts. `sample` then waits for their rollout. Its staleness is t minus the version that
   sampled it; a batch staler than k (weights published every N > 1 steps) is dropped, never trained: everything
   queued is discarded, the policy published now, and the steps sampled again, in order, from the same prompts.

The batches' epoch and position are those of the steps handed out, not of those drawn ahead: a checkpoint resumes
where training was, and whatever was in flight is sampled again (by the resumed version). `close()` discards the
queue and stops the generator; the stage calls it on every exit (the guard's rollback or stop included) before
anything else runs.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, replace
from time import perf_counter

import torch

from rlhf_core.config import RolloutConfig
from rlhf_core.rl.step import PromptBatch, PromptBatches
from rlhf_core.rollout.ahead import Generator, Job, Made, ProcessGenerator, ThreadGenerator
from rlhf_core.rollout.collect import Sampled, SamplingSpec, sample
from rlhf_core.rollout.engines import RolloutEngine, rollout_seed
from rlhf_core.training.timing import PhaseTimer


class StepSampler:
    """Sampled in the step on `engine`, by the policy the step trains (`policy()`: the loop's own, unwrapped),
    seeded from the run's seed, the process, the step and the call; `rows`: the prompt rows by index (tool episodes
    read their messages). The engine gets the policy's weights first (vllm: every rollout.vllm.sync_every_steps)."""

    def __init__(self, loop, engine: RolloutEngine, spec: SamplingSpec, rows: list[dict], policy, timer: PhaseTimer):
        self.loop, self.engine, self.spec, self.rows, self.policy, self.timer = loop, engine, spec, rows, policy, timer
        self.metrics: dict[str, float] = {}  # none of its own

    def close(self) -> None:
        """Nothing to stop: the engine outlives the stage's loop (the stage stops its server)."""

    def sample(self, prompts: PromptBatch, call: int = 0) -> Sampled:
        loop = self.loop
        seed = rollout_seed(loop.run_cfg.seed, rank=loop.rank, step=loop.step, call=call)
        policy = self.policy()
        with loop.full_parameters():
            self.engine.sync(policy, loop.step)  # once per step: a later round finds it done
            policy.eval()
            with self.timer("generate"), torch.no_grad():
                rows = [self.rows[i] for i in prompts.indices]
                return sample(
                    self.engine, policy, prompts.query_ids, prompts.query_mask, self.spec, seed=seed, rows=rows
                )


@dataclass
class Pending:
    step: int
    prompts: PromptBatch
    job: Job
    drawn_at: tuple[int, int]  # the batches' (epoch, position) once this step's prompts were drawn
    future: Future | None = None


class AheadSampler:
    """Generation ahead: the loop's batches (`next()`: step t's prompts) and their sampler (`sample`: their rollout,
    sampled on `generator` while earlier steps trained). `rows`: the prompt rows by index."""

    def __init__(
        self,
        batches: PromptBatches,
        generator: Generator,
        loop,
        rows: list[dict],
        *,
        max_staleness: int,
        sync_every: int,
    ):
        self.batches, self.generator, self.loop, self.rows = batches, generator, loop, rows
        self.max_staleness, self.sync_every = max_staleness, sync_every
        self.epoch, self.position = batches.epoch, batches.position
        self.pending: deque[Pending] = deque()
        self.published: int | None = None
        self.staleness: list[int] = []  # of every batch trained in this attempt
        self.dropped = 0
        self.metrics: dict[str, float] = {}  # the latest step's async/* numbers

    def next(self) -> PromptBatch:
        """Step t's prompts, the generator given the weights when due and the steps up to t + k submitted."""
        step = self.loop.step
        if self.published is None or step - self.published >= self.sync_every:
            self._publish(step)
        self._draw_until(step + self.max_staleness)
        head = self.pending[0]
        self.epoch, self.position = head.drawn_at
        return head.prompts

    def sample(self, prompts: PromptBatch, call: int = 0) -> Sampled:
        """The rollout of `prompts` (the step's, from `next()`), dropped and sampled again while too stale."""
        step, head = self.loop.step, self.pending[0]
        if head.prompts is not prompts:
            raise RuntimeError(f"step {step} asked for the rollout of prompts that next() did not hand out")
        made, waited = self._wait(head)
        while step - made.version > self.max_staleness:
            self.dropped += len(self.pending)  # this batch and those queued behind it, sampled by older weights
            self._sample_again(step)
            made, more = self._wait(head)
            waited += more
        self.pending.popleft()
        self.staleness.append(step - made.version)
        self.metrics = {
            "async/staleness": float(self.staleness[-1]),
            "async/staleness_mean": sum(self.staleness) / len(self.staleness),
            "async/staleness_max": float(max(self.staleness)),
            "async/dropped_batches": float(self.dropped),
            "async/trainer_wait_s": waited,
            "async/engine_wait_s": made.waited_s,
        }
        return made.sampled

    def _publish(self, version: int) -> None:
        with self.loop.full_parameters():
            self.generator.publish(self.loop.unwrapped(), version)
        self.published = version

    def _draw_until(self, last: int) -> None:
        """Draw and submit the prompts of every step up to `last` not drawn yet."""
        step = self.pending[-1].step + 1 if self.pending else self.loop.step
        while step <= last:
            prompts = self.batches.next()
            job = Job(
                step,
                prompts.query_ids.cpu(),
                prompts.query_mask.cpu(),
                [self.rows[i] for i in prompts.indices],
                rollout_seed(self.loop.run_cfg.seed, rank=self.loop.rank, step=step),
                self.published,
            )
            item = Pending(step, prompts, job, (self.batches.epoch, self.batches.position))
            item.future = self.generator.submit(job)
            self.pending.append(item)
            step += 1

    def _wait(self, item: Pending) -> tuple[Made, float]:
        started = perf_counter()
        made = item.future.result()
        return made, perf_counter() - started

    def _sample_again(self, step: int) -> None:
        """Every queued step discarded and submitted again, to be sampled by the policy of `step`, published now."""
        self.generator.cancel()
        self._publish(step)
        for item in self.pending:
            item.job = replace(item.job, version=step)
            item.future = self.generator.submit(item.job)

    def close(self) -> None:
        """Discard the queue and stop the generator: nothing sampled so far trains after this."""
        self.pending.clear()
        self.generator.close()


def sampler_for(
    rollout: RolloutConfig, step_sampler: StepSampler, batches: PromptBatches
) -> tuple[StepSampler | AheadSampler, PromptBatches | AheadSampler]:
    """The stage's sampler and the loop's batches: `step_sampler` and `batches` with rollout.max_staleness 0, else
    one `AheadSampler` for both, sampling as step_sampler.spec says on a generator apart: the vLLM server from a
    thread, pushed every rollout.vllm.sync_every_steps steps, or our loop in a process of its own with the
    trainer's device and thread count, given the weights after every step."""
    if rollout.max_staleness == 0:
        return step_sampler, batches
    loop, engine, spec = step_sampler.loop, step_sampler.engine, step_sampler.spec
    slots = rollout.max_staleness + 1  # the versions a queued job may still need
    if rollout.engine == "vllm":
        generator, sync_every = ThreadGenerator(engine, spec, slots), rollout.vllm.sync_every_steps
    else:
        threads = torch.get_num_threads()
        generator, sync_every = ProcessGenerator(loop.unwrapped(), spec, slots, device=loop.device, threads=threads), 1
    ahead = AheadSampler(
        batches, generator, loop, step_sampler.rows, max_staleness=rollout.max_staleness, sync_every=sync_every
    )
    return ahead, ahead
