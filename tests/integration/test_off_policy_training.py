"""Generation ahead of training in the GRPO stage (rollout.max_staleness > 0), proven on what reaches the loss:

- a deliberately slow engine apart (slow to sample, slow to take weights, pushed every 2 steps) samples batches
  older than k, and none of them reaches an update: the staleness of every trained batch is read from the weights
  that sampled it, checksummed by the engine, against the trainer's weights after each step;
- our loop in a process of its own: two runs with one seed end on the same weights; a run crashed after step 3
  resumes from checkpoint 2 with the prompts of an uninterrupted run, what was in flight sampled again by the
  resumed version; the checkpoints record the policy version; no generator process is left.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import time

import pytest
import torch

import rlhf_core.rl.grpo
from rlhf_core.config import GRPOConfig, RLConfig, RolloutConfig, RunConfig
from rlhf_core.demo.world import world_rows
from rlhf_core.models.forward import response_logprobs
from rlhf_core.models.loading import load_causal_lm, load_tokenizer
from rlhf_core.rl.grpo import GRPOSteps, train_grpo
from rlhf_core.rl.inputs import rl_inputs
from rlhf_core.rl_math import response_mask
from rlhf_core.rollout.engines import Generated, LoopEngine, rollout_seed
from rlhf_core.storage.checkpoints import decode
from tests.rlhf_core.rl.test_grpo import make_reward

pytestmark = pytest.mark.filterwarnings("ignore")
SEED, STEPS = 5, 8
RL = dict(
    algorithm="grpo",
    batch_size=16,
    learning_rate=3e-3,
    lr_scheduler="constant",
    response_length=6,
    temperature=1.0,
    log_steps=1,
)


def checksum(model) -> str:
    digest = hashlib.sha1()
    for p in model.parameters():
        digest.update(p.detach().float().numpy().tobytes())
    return digest.hexdigest()


class SlowEngine:
    """An engine apart over its own copy of the policy, as vLLM is: slow to sample and slower to take weights; every
    batch it samples is recorded with the checksum of the weights that sampled it and the step its seed names."""

    def __init__(self, base_model: str):
        self.model = load_causal_lm(base_model).eval()
        self.places, self.made = {}, []

    def stage(self, policy, slot=None):
        self.places[slot] = {k: v.detach().clone() for k, v in policy.state_dict().items()}

    def load_staged(self, slot=None):
        time.sleep(0.05)
        self.model.load_state_dict(self.places[slot])

    def generate(self, policy, query_ids, query_mask, settings, *, seed=None, **kwargs):
        time.sleep(0.05)
        responses, _ = LoopEngine().generate(self.model, query_ids, query_mask, settings, **kwargs)
        mask, _, _ = response_mask(responses, kwargs["stop_token_ids"])
        with torch.no_grad():
            logp, _ = response_logprobs(self.model, query_ids, query_mask, responses, mask, settings.temperature)
        self.made.append((responses, checksum(self.model), seed))
        return Generated(responses, logp)

    def sync(self, policy, step):
        raise AssertionError("a step sampled ahead pushes nothing itself")


def train(world, out, rollout: RolloutConfig, *, policy=None, steps=STEPS, **hooks):
    tokenizer = load_tokenizer(str(world.tokenizer))
    policy = policy or load_causal_lm(str(world.base_model))
    result = train_grpo(
        rl_inputs(
            policy,
            tokenizer,
            world_rows(world, "prompt", "train"),
            out,
            reference=None,
            rewards=[make_reward(tokenizer)],
            rl=RLConfig(**RL, total_steps=steps, save_steps=2),
            grpo=GRPOConfig(num_generations=4, log_completions_steps=1),
            run=RunConfig(device="cpu", seed=SEED),
            max_prompt_length=12,
            rollout=rollout,
            show_progress=False,
            **hooks,
        )
    )
    return policy, result


def test_a_slow_engine_samples_stale_batches_and_none_of_them_reaches_the_loss(tmp_path, smoke_world, monkeypatch):
    engine = SlowEngine(str(smoke_world.base_model))
    monkeypatch.setattr(rlhf_core.rl.grpo, "make_engine", lambda *args: engine)
    versions, trained, logs = [checksum(load_causal_lm(str(smoke_world.base_model)))], [], []
    update = GRPOSteps.update

    def recording_update(self, batch, estimate):
        (sampled_by,) = [c for r, c, _ in engine.made if r is batch.rollout.responses]
        trained.append((self.loop.step, sampled_by))
        return update(self, batch, estimate)

    monkeypatch.setattr(GRPOSteps, "update", recording_update)
    policy = load_causal_lm(str(smoke_world.base_model))
    rollout = RolloutConfig(engine="vllm", max_staleness=1, vllm={"sync_every_steps": 2})
    train(
        smoke_world,
        tmp_path / "slow",
        rollout,
        policy=policy,
        on_step=lambda step: versions.append(checksum(policy)),
        on_log=lambda metrics, step: logs.append(metrics),
    )
    assert len(versions) == STEPS + 1 and len(set(versions)) == STEPS + 1  # every step changed the weights
    step_of_seed = {rollout_seed(SEED, rank=0, step=s): s for s in range(STEPS + 2)}
    sampled = [(step_of_seed[seed], versions.index(c)) for _, c, seed in engine.made]
    stale = [(s, v) for s, v in sampled if s - v > 1 and s < STEPS]  # the queue left at the end never trains
    assert stale, f"the slow engine never fell behind: {sampled}"  # it did sample batches too old to train
    assert [s for s, _ in trained] == list(range(STEPS))
    assert all(0 <= step - versions.index(c) <= 1 for step, c in trained), trained  # none of them was trained
    # dropped: the stale batch at the head of the queue and those behind it, sampled or not yet
    assert logs[-1]["async/dropped_batches"] >= len(stale) and logs[-1]["async/staleness_max"] == 1


@pytest.mark.slow  # a generator process
def test_our_loop_ahead_is_reproducible_resumes_from_the_trained_steps_and_leaves_no_process(tmp_path, smoke_world):
    rollout = RolloutConfig(max_staleness=1)
    prompts = {"a": {}, "c": {}, "resumed": {}}
    logs = {"a": [], "c": []}

    def table(name):
        return lambda rows, step: prompts[name].setdefault(step, [r["prompt"] for r in rows])

    first, _ = train(
        smoke_world,
        tmp_path / "a",
        rollout,
        steps=4,
        on_completions=table("a"),
        on_log=lambda metrics, step: logs["a"].append((step, metrics)),
    )
    second, _ = train(smoke_world, tmp_path / "b", rollout, steps=4)
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters()):
        assert torch.equal(a, b), f"{name}: the same run twice ended on other weights"
    assert [m["async/staleness"] for _, m in logs["a"]] == [0.0, 1.0, 1.0, 1.0]

    def crash(metrics, step):
        logs["c"].append((step, metrics))
        if step == 3:
            raise RuntimeError("injected crash")

    with pytest.raises(RuntimeError, match="injected crash"):
        train(smoke_world, tmp_path / "c", rollout, steps=4, on_completions=table("c"), on_log=crash)
    assert not multiprocessing.active_children()  # the crash stopped the generator
    logs["c"].clear()
    _, result = train(
        smoke_world,
        tmp_path / "c",
        rollout,
        steps=4,
        on_completions=table("resumed"),
        on_log=lambda metrics, step: logs["c"].append((step, metrics)),
    )
    assert result.resumed_from == 2 and [s for s, _ in logs["c"]] == [3, 4]
    # every step trained the prompts an uninterrupted run trains
    assert prompts["c"] == {s: prompts["a"][s] for s in (1, 2, 3)}
    assert prompts["resumed"] == {s: prompts["a"][s] for s in (3, 4)}
    # steps 3 and 4 are sampled again by the resumed version 2 (step 4 was in flight at the crash, sampled by
    # version 2 of the first attempt): 0, then 1 version old, where the uninterrupted run had 1 and 1
    assert [m["async/staleness"] for _, m in logs["c"]] == [0.0, 1.0]
    saved = json.loads((result.checkpoint / "training_state" / "state.json").read_text())["progress"]
    assert decode(saved, {})["state"]["policy_version"] == 4  # the checkpoint records the policy's version
    assert not multiprocessing.active_children()
