"""What the RL stage's evaluation scores, each once: a reward function that is an eval metric too is one column,
and its description says which KL metric to read."""

import pytest

from rlhf_core.config import load_config
from tasks.stages.rl.evaluation_report import kl_guide
from tasks.stages.rl.stage import eval_functions, scored_as_metric

EXACT_MATCH = "rlhf_core.rewards.functions:exact_match"
RLVR = ["rl.algorithm=grpo", f"grpo.rewards=[{{name: exact_match, function: '{EXACT_MATCH}'}}]"]


def test_a_reward_function_that_is_an_eval_metric_too_is_scored_once_under_the_metrics_name():
    # configs/rlvr.yaml: exact_match is the only reward and the gold metric; both columns held the same values
    cfg = load_config(None, [*RLVR, f"eval.metrics=[{EXACT_MATCH}]"])
    assert sorted(eval_functions(cfg)) == ["exact_match"]
    assert cfg.gold_metric() == "exact_match"  # the column the guard (and promotion) reads stays


def test_a_reward_function_is_its_own_column_where_it_differs_from_the_metrics_or_is_read_by_name():
    assert sorted(eval_functions(load_config(None, RLVR))) == ["reward_exact_match", "vader_compound"]  # the demo's
    proxy = load_config(None, [*RLVR, f"eval.metrics=[{EXACT_MATCH}]", "guard.divergence.proxy=reward_exact_match"])
    assert sorted(eval_functions(proxy)) == ["exact_match", "reward_exact_match"]
    cfg = load_config(None, [*RLVR, f"eval.metrics=[{EXACT_MATCH}]"])
    bound = cfg.grpo.rewards[0].model_copy(update={"arguments": {"strict": True}})
    assert not scored_as_metric(cfg, bound)  # arguments bound: another function than the metric's


@pytest.mark.parametrize("algorithm, training", [("ppo", "`objective/kl` is"), ("grpo", "`kl` (where logged) is")])
def test_the_stage_runs_description_says_which_kl_to_read(algorithm, training):
    guide = kl_guide(algorithm)
    sentences = guide.removeprefix("**Which KL to read**: ").split(". ")
    assert len(sentences) == 3
    assert sentences[0].startswith("`eval/kl_exact_mean`") and "guard and promotion read" in sentences[0]
    assert "`eval/kl_mean` (k1) and `eval/kl_k3_mean` (k3)" in sentences[1] and "diagnostics" in sentences[1]
    assert sentences[2].startswith(training) and "training batch" in sentences[2]
