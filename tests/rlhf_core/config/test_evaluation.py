"""The evaluation section (the sampled evaluation's columns, its pass@k bounds, its verifier) and promote.*: the evaluator
promotion is judged by, refused in one sentence when missing or malformed."""

from pathlib import Path

import pytest

from rlhf_core.config import ConfigError, EvalConfig, PipelineConfig, load_config, validate_config


def test_sampled_columns_exist_only_with_several_samples():
    assert EvalConfig().sampled_columns() == []
    cfg = EvalConfig(samples_per_prompt=8, pass_at_k=[1, 4])
    assert cfg.sampled_columns() == ["pass_at_1", "pass_at_4", "maj_at_8"]


def test_pass_at_k_must_fit_the_samples():
    with pytest.raises(ValueError, match="eval.pass_at_k 9 must be between 1 and eval.samples_per_prompt 8"):
        EvalConfig(samples_per_prompt=8, pass_at_k=[9])


def test_the_verifier_is_the_first_metric_unless_named_and_must_be_one():
    metrics = ["rlhf_core.rewards.functions:exact_match"]
    cfg = PipelineConfig.model_validate({"eval": {"metrics": metrics, "samples_per_prompt": 4, "pass_at_k": [2]}})
    assert cfg.verifier() == "exact_match"
    assert cfg.metric_names() == ["exact_match", "pass_at_2", "maj_at_4"]  # promotion and the guard may name them
    with pytest.raises(
        ConfigError, match="eval.verifier 'accuracy', which is not an eval metric; allowed: 'exact_match'"
    ):
        validate_config({"eval": {"metrics": metrics, "samples_per_prompt": 4, "verifier": "accuracy"}})


# promote.* ----------------------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[3]
DEMO = REPO / "configs" / "demo.yaml"
JUDGE = {
    "url": "http://judge:8000/v1",
    "judge_model": "j",
    "template": "{prompt}\nA: {completion_a}\nB: {completion_b}\nA, B or tie?",
    "labels": {"A": 1.0, "B": 0.0, "tie": 0.5},
}


def one_sentence(message: str) -> bool:
    return "\n" not in message and message.count(". ") == 0


def test_the_demo_is_judged_by_its_gold_metric_and_needs_no_floor():
    plan = load_config(DEMO).promotion(first=True)
    assert plan.evaluator.kind == "metrics" and plan.evaluator.column == "vader_compound"
    assert plan.evaluator.metrics == ("rlhf_core.rewards.functions:vader_compound",)
    assert (plan.gates.min_win_rate, plan.gates.min_value) == (0.5, None)


def test_outside_the_demo_no_evaluator_is_refused_naming_the_three_options(tmp_path):
    cfg = load_config(DEMO, [f"model.base={tmp_path}"])
    with pytest.raises(ConfigError) as err:
        cfg.promotion()
    message = str(err.value)
    assert message.startswith("promote.evaluator must name what judges promotion outside the demo")
    for option in ("promote.evaluator.judge", "promote.evaluator.reward_model", "promote.evaluator.metrics"):
        assert option in message
    assert "promote.allow_training_reward" in message and one_sentence(message)
    allowed = load_config(DEMO, [f"model.base={tmp_path}", "promote.allow_training_reward=true"])
    plan = allowed.promotion()
    assert plan.evaluator.kind == "training_reward" and plan.evaluator.column == "score"
    assert "own reward model" in plan.evaluator.label()


def test_a_first_champion_judged_by_a_mean_needs_min_value_outside_the_demo(tmp_path):
    rm = [f"model.base={tmp_path}", "promote.evaluator.reward_model=models:/judge-rm@gold"]
    cfg = load_config(DEMO, rm)
    assert cfg.promotion().evaluator.reward_model == "models:/judge-rm@gold"  # with a champion: the win rate
    with pytest.raises(ConfigError, match="^promote.min_value must be set to promote a first champion on 'score'"):
        cfg.promotion(first=True)
    assert load_config(DEMO, [*rm, "promote.min_value=0.1"]).promotion(first=True).gates.min_value == 0.1
    judge = PipelineConfig(model={"base": str(tmp_path)}, promote={"evaluator": {"judge": JUDGE}})
    assert judge.promotion(first=True).evaluator.kind == "judge"  # a judge compares with the start instead


def test_bad_evaluators_are_refused_by_field():
    def refused(promote: dict, match: str):
        with pytest.raises(ConfigError, match=match) as err:
            validate_config({"model": {"base": "/m"}, "promote": promote})
        assert one_sentence(str(err.value))

    refused({"min_win_rate": 1.0}, r"promote.min_win_rate")
    refused({"min_win_rate": 0.0}, r"promote.min_win_rate")
    no_b = {**JUDGE, "template": "{prompt} {completion_a}"}
    refused({"evaluator": {"judge": no_b}}, r"the template must show \{completion_b\}")
    refused({"evaluator": {"judge": {**JUDGE, "template": "{completion}"}}}, r"\{completion_a\} and \{completion_b\}")
    refused({"evaluator": {"reward_model": "/some/dir"}}, "must be a models:/<name>@<alias> or version URI")
    refused({"evaluator": {"metrics": ["nomodule"]}}, "must be written 'package.module:function'")
    refused({"evaluator": {"metrics": ["m:f"], "reward_model": "models:/r/1"}}, "set one evaluator")
    with pytest.raises(ConfigError, match="a pairwise judge has none"):
        PipelineConfig(model={"base": "/m"}, promote={"evaluator": {"judge": JUDGE}, "min_value": 0.5}).promotion()


def test_the_retired_fields_say_what_replaced_them():
    with pytest.raises(ConfigError, match=r"`promote.metric` was replaced by `promote.evaluator`"):
        load_config(DEMO, ["promote.metric=score"])
    with pytest.raises(ConfigError, match=r"`promote.min_improvement` was replaced by `promote.min_win_rate`"):
        load_config(DEMO, ["promote.min_improvement=0.1"])


def test_the_judge_scale_places_labels_and_ranges():
    cfg = PipelineConfig(model={"base": "/m"}, promote={"evaluator": {"judge": JUDGE}})
    assert cfg.promote.evaluator.judge.bounds() == (0.0, 1.0)
    ranged = {k: v for k, v in JUDGE.items() if k != "labels"} | {"score_range": [1.0, 9.0]}
    cfg = PipelineConfig(model={"base": "/m"}, promote={"evaluator": {"judge": ranged}})
    assert cfg.promote.evaluator.judge.bounds() == (1.0, 9.0)


def test_the_example_configs_name_an_evaluator_apart_from_their_reward_model():
    for name in ("one-gpu", "multi-gpu"):
        cfg = load_config(REPO / "configs" / "examples" / f"{name}.yaml")
        assert not cfg.is_demo() and cfg.promotion(first=True).evaluator.kind == "judge"
    for name in ("rlvr", "tools"):
        assert load_config(REPO / "configs" / f"{name}.yaml").promotion(first=True).evaluator.column == "exact_match"


def test_the_promote_section_alone_makes_the_plan():
    from rlhf_core.config.evaluation import PromoteConfig, promotion_plan

    plan = promotion_plan(PromoteConfig(min_win_rate=0.6, max_kl=None), demo_gold="m:gold", first=True)
    assert (plan.evaluator.column, plan.gates.min_win_rate, plan.gates.max_kl) == ("gold", 0.6, None)
