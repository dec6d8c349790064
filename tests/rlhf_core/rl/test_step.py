"""One RL step's shape: the phases in order, batch sizes under one set of names, metric names per algorithm."""

import math

import pytest
import torch

from rlhf_core.config import GRPOConfig, PPOConfig, RLConfig, RunConfig
from rlhf_core.rl.advantages.estimators import Estimate
from rlhf_core.rl.grpo import grpo_batch_sizes
from rlhf_core.rl.inputs import RLSettings
from rlhf_core.rl.ppo import ppo_batch_sizes
from rlhf_core.rl.step import (
    BatchSizes,
    StepStats,
    rl_loop_settings,
    rl_step,
    sampling_spec,
    training_metric_names,
)


def test_ppo_and_grpo_cut_their_batches_under_the_same_names():
    # PPO: 16 prompts, one completion each; 4 mini-batches of 4 per epoch, 2 micro-batches of 2 each
    ppo = ppo_batch_sizes(RLConfig(batch_size=16, gradient_accumulation_steps=2), PPOConfig(num_mini_batches=4))
    assert ppo == BatchSizes(prompts_per_step=16, generations_per_prompt=1, mini_batch=4, micro_batch=2)
    assert (ppo.rollout, ppo.mini_batches, ppo.micro_batches) == (16, 4, 2)
    # GRPO: 16 completions = 4 prompts x 4; steps_per_generation 4 micro-batches of 4, 2 per optimizer step
    rl = RLConfig(algorithm="grpo", batch_size=16, gradient_accumulation_steps=2)
    grpo = grpo_batch_sizes(rl, GRPOConfig(num_generations=4, steps_per_generation=4))
    assert grpo == BatchSizes(prompts_per_step=4, generations_per_prompt=4, mini_batch=8, micro_batch=4)
    assert (grpo.rollout, grpo.mini_batches, grpo.micro_batches) == (16, 2, 2)
    # without steps_per_generation: one optimizer step per generation batch, accumulated over 2 micro-batches
    one = grpo_batch_sizes(rl, GRPOConfig(num_generations=4))
    assert (one.mini_batch, one.micro_batch, one.mini_batches, one.micro_batches) == (16, 8, 1, 2)
    # grpo.generation_batch_size, where set, is the group algorithms' batch whatever rl.batch_size says (PPO's)
    own = grpo_batch_sizes(rl, GRPOConfig(num_generations=4, generation_batch_size=64, steps_per_generation=4))
    assert own == BatchSizes(prompts_per_step=16, generations_per_prompt=4, mini_batch=32, micro_batch=16)


def test_a_short_last_micro_batch_still_counts_as_a_backward_pass():
    assert BatchSizes(prompts_per_step=7, generations_per_prompt=1, mini_batch=7, micro_batch=3).micro_batches == 3


def test_each_algorithm_names_its_training_score_and_kl_once():
    assert training_metric_names("ppo").score == "objective/scores"
    assert training_metric_names("ppo").kl == "objective/kl"
    assert (training_metric_names("grpo").score, training_metric_names("grpo").kl) == ("reward", "kl")
    sizes = BatchSizes(prompts_per_step=4, generations_per_prompt=4, mini_batch=16, micro_batch=8)
    settings = rl_loop_settings(RLConfig(algorithm="grpo"), RunConfig(), sizes, eval_every=None)
    assert settings.name == "grpo" and settings.best_metric == ("reward",) and settings.shown == ("reward", "kl")
    assert (settings.micro_batches, settings.micro_batch_size) == (2, 8)


def test_one_step_samples_scores_refills_then_advantages_update_metrics_in_that_order():
    calls = []

    class Sampler:
        def sample(self, prompts, call=0):
            calls.append(("sample", prompts, call))
            return "sampled"

    class Steps:
        sampler = Sampler()

        def score(self, prompts, sampled):
            calls.append(("score", prompts, sampled))
            return "scored"

        def refill(self, batch):
            calls.append(("refill", batch))
            return "batch"

        def estimator(self, batch, context):
            calls.append(("advantages", batch, context))
            return Estimate(torch.tensor([0.5]))

        def estimator_context(self):
            calls.append(("context",))
            return "context"

        def update(self, batch, estimate):
            calls.append(("update", batch, estimate.advantages.tolist()))
            return "stats"

        def metrics(self, batch, estimate, stats):
            calls.append(("metrics", batch, stats))
            return {"done": 1.0}

    assert rl_step(Steps(), "prompts") == {"done": 1.0}
    assert calls == [
        ("sample", "prompts", 0),
        ("score", "prompts", "sampled"),
        ("refill", "scored"),
        ("context",),
        ("advantages", "batch", "context"),
        ("update", "batch", [0.5]),
        ("metrics", "batch", "stats"),
    ]


def test_step_statistics_average_over_micro_batches_and_are_nan_when_never_recorded():
    stats = StepStats()
    stats.add(loss=torch.tensor(1.0, requires_grad=True) * 2, kl=torch.tensor(0.5))
    stats.add(loss=torch.tensor(4.0))
    assert "loss" in stats and "entropy" not in stats
    assert float(stats.mean("loss")) == pytest.approx(3.0) and float(stats.mean("kl")) == 0.5
    assert not stats.values["loss"][0].requires_grad  # statistics hold no graph
    assert math.isnan(stats.mean("entropy"))


def test_the_sampling_spec_takes_the_callers_stop_ids_or_computes_the_runs_own():
    class Tokenizer:
        pad_token_id, eos_token_id = 0, 7

        def get_vocab(self):
            return {"<pad>": 0, "</s>": 7}

    rl = RLConfig(response_length=5, temperature=0.9)
    given = sampling_spec(Tokenizer(), object(), RLSettings(rl, RunConfig(), stop_token_ids=(3, 4)), prompt_repeats=4)
    assert given.stop_token_ids == (3, 4) and given.pad_token_id == 0 and given.prompt_repeats == 4
    assert given.settings.response_length == 5 and given.settings.temperature == 0.9
    assert sampling_spec(Tokenizer(), object(), RLSettings(rl, RunConfig())).stop_token_ids == (7,)  # the eos
