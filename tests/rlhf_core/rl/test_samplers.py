"""Where a step's batch comes from. Sampled in the step: the engine synced, the policy in eval mode, the request
seeded by step and call. Generation ahead of training, the rule alone: what is drawn and submitted when, with which
version, what is dropped, what a checkpoint resumes from, and that closing discards the queue. A generator that
answers at once stands in for the process and the server (tests/rlhf_core/rollout/test_ahead.py tests those)."""

from __future__ import annotations

from concurrent.futures import Future
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from rlhf_core.rl.samplers import AheadSampler, StepSampler, sampler_for
from rlhf_core.rl.step import PromptBatch
from rlhf_core.rollout.ahead import Made


class Batches:
    """Prompt i at draw i; the position counts draws (an epoch is 10 of them)."""

    def __init__(self):
        self.drawn = 0

    @property
    def epoch(self) -> int:
        return self.drawn // 10

    @property
    def position(self) -> int:
        return self.drawn % 10

    def next(self) -> PromptBatch:
        i = self.drawn
        self.drawn += 1
        return PromptBatch(torch.tensor([[i]]), torch.ones(1, 1, dtype=torch.long), [i])


class Generator:
    """Answers each job at once with the version it names (`lag`: a version older by that much, as an engine
    whose weights fall behind); records what it was asked."""

    def __init__(self):
        self.published, self.jobs, self.events = [], [], []

    def publish(self, policy, version):
        self.published.append(version)
        self.events.append(("publish", version))

    def submit(self, job):
        self.jobs.append(job)
        self.events.append(("submit", job.step, job.version))
        future = Future()
        future.set_result(Made(SimpleNamespace(step=job.step, version=job.version), job.version, 0.0))
        return future

    def cancel(self):
        self.events.append(("cancel",))

    def close(self):
        self.events.append(("close",))


def ahead(k: int, sync_every: int = 1, step: int = 0):
    loop = SimpleNamespace(
        step=step,
        rank=0,
        run_cfg=SimpleNamespace(seed=3),
        full_parameters=nullcontext,
        unwrapped=lambda: "policy",
    )
    generator, batches = Generator(), Batches()
    rows = [{"prompt": f"p{i}"} for i in range(100)]
    return AheadSampler(batches, generator, loop, rows, max_staleness=k, sync_every=sync_every), generator, loop


def steps(batches: AheadSampler, loop, count: int) -> list[SimpleNamespace]:
    """`count` steps as the loop and `rl_step` run them: the prompts from next(), their rollout from sample()."""
    out = []
    for _ in range(count):
        prompts = batches.next()
        out.append(SimpleNamespace(indices=prompts.indices, sampled=batches.sample(prompts)))
        loop.step += 1
    return out


def test_step_t_plus_k_is_sampled_by_version_t_and_every_batch_is_at_most_k_old():
    batches, generator, loop = ahead(k=2)
    got = steps(batches, loop, 6)
    # next(0) publishes version 0 and submits steps 0, 1, 2 with it; next(t) then submits step t + 2 with version t
    assert [(j.step, j.version) for j in generator.jobs] == [
        (0, 0),
        (1, 0),
        (2, 0),
        (3, 1),
        (4, 2),
        (5, 3),
        (6, 4),
        (7, 5),
    ]
    assert generator.published == [0, 1, 2, 3, 4, 5]
    assert [b.sampled.step for b in got] == [0, 1, 2, 3, 4, 5]  # each step trains its own prompts' rollout
    assert [b.indices for b in got] == [[0], [1], [2], [3], [4], [5]]  # the order a synchronous run draws
    assert batches.metrics["async/staleness_max"] == 2 and batches.metrics["async/staleness"] == 2
    assert batches.metrics["async/staleness_mean"] == pytest.approx((0 + 1 + 2 + 2 + 2 + 2) / 6)
    assert batches.metrics["async/dropped_batches"] == 0
    assert [j.rows for j in generator.jobs[:2]] == [[{"prompt": "p0"}], [{"prompt": "p1"}]]


def test_the_checkpoint_position_is_the_steps_trained_not_those_drawn_ahead():
    batches, generator, loop = ahead(k=2)
    steps(batches, loop, 3)
    assert batches.batches.drawn == 5  # steps 3 and 4 are in flight
    assert (batches.epoch, batches.position) == (0, 3)  # what a checkpoint after step 3 resumes from


def test_seeds_are_the_steps_own_whatever_was_drawn_ahead():
    first, generator_a, loop_a = ahead(k=1)
    steps(first, loop_a, 3)
    resumed, generator_b, loop_b = ahead(k=1, step=2)
    resumed.batches.drawn = 2  # resumed at checkpoint 2
    steps(resumed, loop_b, 1)
    seeds = {j.step: j.seed for j in generator_a.jobs}
    assert all(seeds[j.step] == j.seed for j in generator_b.jobs)  # in-flight steps sampled again, same seeds
    assert [j.version for j in generator_b.jobs] == [2, 2]  # by the resumed version


def test_a_batch_staler_than_k_is_dropped_and_sampled_again_from_the_same_prompts():
    batches, generator, loop = ahead(k=1, sync_every=3)
    got = steps(batches, loop, 4)
    # a publish every 3 steps: step 2 was submitted by next(1) with version 0, two versions old at step 2, so the
    # queue (steps 2 and 3) is discarded, version 2 published, and both submitted again with it
    assert generator.published == [0, 2]
    resubmitted = [e for e in generator.events if e[0] == "submit" and e[1] in (2, 3)]
    assert resubmitted == [("submit", 2, 0), ("submit", 3, 0), ("submit", 2, 2), ("submit", 3, 2)]
    at = generator.events.index(("cancel",))
    assert generator.events[at + 1] == ("publish", 2)  # discarded before the publish
    assert [b.sampled.version for b in got] == [0, 0, 2, 2]  # step 2 trained on version 2's sample, not version 0's
    assert [b.indices for b in got] == [[0], [1], [2], [3]]  # the same prompts
    assert batches.metrics["async/dropped_batches"] == 2 and batches.metrics["async/staleness_max"] == 1


def test_close_discards_the_queue_and_stops_the_generator():
    batches, generator, loop = ahead(k=2)
    steps(batches, loop, 1)
    assert [p.step for p in batches.pending] == [1, 2]  # a full queue
    batches.close()
    assert not batches.pending and generator.events[-1] == ("close",)


def test_the_ahead_sampler_refuses_prompts_it_did_not_hand_out():
    batches, _, _ = ahead(k=1)
    batches.next()
    with pytest.raises(RuntimeError, match="step 0 asked for the rollout of prompts that next\\(\\) did not hand out"):
        batches.sample(PromptBatch(torch.tensor([[0]]), torch.ones(1, 1, dtype=torch.long), [0]))


class Engine:
    """Records what the step sampler asks of an engine; answers each row with its prompt's last id."""

    def __init__(self):
        self.calls = []

    def sync(self, policy, step):
        self.calls.append(("sync", step, policy.training))

    def generate(self, policy, query_ids, query_mask, settings, **generate):
        self.calls.append(("generate", generate["seed"], policy.training))
        return query_ids[:, -1:].clone(), None


def test_the_step_sampler_syncs_the_engine_then_samples_in_eval_mode_seeded_by_step_and_call():
    from rlhf_core.rollout.collect import SamplingSpec
    from rlhf_core.rollout.engines import rollout_seed
    from rlhf_core.rollout.sampling import SamplingSettings
    from rlhf_core.training.timing import PhaseTimer

    policy, engine = torch.nn.Linear(1, 1), Engine()
    loop = SimpleNamespace(step=4, rank=1, run_cfg=SimpleNamespace(seed=3), full_parameters=nullcontext)
    spec = SamplingSpec(SamplingSettings(response_length=1), pad_token_id=0, stop_token_ids=(9,))
    sampler = StepSampler(loop, engine, spec, [{"prompt": "a"}], lambda: policy, PhaseTimer(enabled=False))
    prompts = PromptBatch(torch.tensor([[5, 9]]), torch.ones(1, 2, dtype=torch.long), [0])
    sampled = sampler.sample(prompts, call=2)
    assert engine.calls == [("sync", 4, True), ("generate", rollout_seed(3, rank=1, step=4, call=2), False)]
    assert sampled.responses.tolist() == [[9]] and sampled.has_stop.tolist() == [True]
    assert sampled.behaviour_logprobs is None  # the policy that trains sampled it


def test_sampler_for_keeps_the_step_sampler_without_staleness():
    from rlhf_core.config import RolloutConfig

    step_sampler, batches = object(), object()
    assert sampler_for(RolloutConfig(), step_sampler, batches) == (step_sampler, batches)
