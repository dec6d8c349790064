"""An RL trainer's one input: every model, setting and hook lands in its place, and a misspelt name is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_core.config import GRPOConfig, RLConfig, RunConfig
from rlhf_core.rl.inputs import PromptSet, RLHooks, rl_inputs


def test_rl_inputs_puts_each_keyword_in_its_place():
    def on_log(metrics, step):
        return None

    inputs = rl_inputs(
        "policy",
        "tokenizer",
        ["a", {"prompt": "b", "answer": "2"}],
        "out",
        rl=RLConfig(algorithm="grpo"),
        run=RunConfig(seed=3),
        max_prompt_length=7,
        reference="ref",
        rewards=["r"],
        grpo=GRPOConfig(beta=0.3),
        kl_scale=2.0,
        stop_token_ids=[4, 5],
        rollout=None,  # None keeps the default
        on_log=on_log,
        show_progress=False,
    )
    m, s = inputs.models, inputs.settings
    assert (m.policy, m.tokenizer, m.reference, m.rewards, m.value, m.reward_model) == (
        "policy",
        "tokenizer",
        "ref",
        ["r"],
        None,
        None,
    )
    assert inputs.prompts == PromptSet([{"prompt": "a"}, {"prompt": "b", "answer": "2"}], 7)
    assert (s.grpo.beta, s.kl_scale, s.stop_token_ids, s.rollout.engine, s.run.seed) == (0.3, 2.0, (4, 5), "hf", 3)
    assert inputs.hooks.on_log is on_log and inputs.hooks.show_progress is False and inputs.output_dir == Path("out")


def test_a_misspelt_keyword_is_refused_rather_than_dropped():
    with pytest.raises(TypeError, match="on_logs"):
        rl_inputs("p", "t", ["a"], "o", rl=RLConfig(), run=RunConfig(), max_prompt_length=4, on_logs=print)


def test_evaluations_are_scheduled_only_when_someone_receives_them():
    assert RLHooks(eval_every=5).eval_cadence is None
    assert RLHooks(eval_every=5, on_eval=lambda rows, step: None).eval_cadence == 5
