"""Which config fields a run logs as its params: those it reads."""

from pathlib import Path

from rlhf_core.config import load_config
from rlhf_core.config.redaction import flatten_config
from tasks.tracking.params import run_params
from tasks.tracking.runs import stage_params

DEMO = str(Path(__file__).resolve().parents[3] / "configs" / "demo.yaml")
TABLE = ("path", "split", "revision", "format", "limit")
EXACT_MATCH = "grpo.rewards=[{name: exact_match, function: 'rlhf_core.rewards.functions:exact_match'}]"


def table_keys(field: str, *columns: str) -> set[str]:
    return {f"{field}.{k}" for k in TABLE} | {f"{field}.columns.{c}" for c in columns}


def under(params: dict, section: str) -> set[str]:
    return {k for k in params if k.startswith(f"{section}.")}


def test_a_ppo_run_logs_no_grpo_field_and_of_each_table_the_columns_its_kind_reads():
    cfg = load_config(DEMO)
    params = run_params(cfg)
    assert under(params, "grpo") == set() and "ppo.kl_coef" in params and "reward.max_steps" in params
    # every other section whole: its values as the flattened config has them
    flat = flatten_config(cfg)
    assert {k.split(".")[0] for k in flat} - {k.split(".")[0] for k in params} == {"grpo", "dpo"}
    assert all(flat[k] == v for k, v in params.items())
    tables = {k for k in params if k.startswith(("data.preference", "data.prompts", "data.eval_prompts"))}
    assert tables == (
        table_keys("data.preference", "prompt", "chosen", "rejected", "margin")
        | table_keys("data.preference_eval", "prompt", "chosen", "rejected", "margin")
        | table_keys("data.prompts", "prompt")
        | table_keys("data.eval_prompts", "prompt")
    )
    assert under(params, "sft.dataset") == table_keys("sft.dataset", "text", "messages", "prompt", "completion")
    assert under(params, "data.demo") and under(params, "model.demo")  # the demo world is built
    data = stage_params(cfg, "data")
    assert set(data) == tables | {"data.max_length", "data.max_prompt_length", "data.overlong"} | under(
        params, "data.demo"
    )
    assert under(stage_params(cfg, "ppo"), "grpo") == set()


def test_a_grpo_run_logs_no_ppo_field_nor_one_only_another_group_algorithm_reads():
    params = run_params(load_config(DEMO, ["rl.algorithm=grpo"]))
    assert under(params, "ppo") == set() and params["grpo.num_generations"] == "4" and "grpo.rewards" in params
    assert "reward.max_steps" in params and "data.preference.path" in params  # grpo.rewards reads the reward stage
    assert {"grpo.scale_rewards", "grpo.loss_type"} <= set(params)
    assert not {"grpo.reward_clip_range", "grpo.normalize_advantages", "grpo.gamma", "grpo.kl_estimator"} & set(params)
    rloo = run_params(load_config(None, ["rl.algorithm=rloo"]))
    assert {"grpo.reward_clip_range", "grpo.kl_estimator"} <= set(rloo) and "grpo.scale_rewards" not in rloo


def test_a_dpo_run_logs_its_section_and_the_pairs_and_no_ppo_grpo_or_prompt_field():
    params = run_params(load_config(DEMO, ["rl.algorithm=dpo"]))
    assert params["dpo.beta"] == "0.1" and params["dpo.loss_type"] == '["sigmoid"]'
    assert under(params, "ppo") == set() and under(params, "grpo") == set() and under(params, "reward") == set()
    assert "data.preference.path" in params and "data.eval_prompts.path" in params
    assert not any(k.startswith("data.prompts") for k in params)  # offline DPO trains on the pairs alone
    online = run_params(load_config(DEMO, ["rl.algorithm=online_dpo"]))
    assert "grpo.rewards" in online and "grpo.num_generations" not in online and "dpo.beta" in online


def test_a_run_logs_nothing_of_a_stage_or_table_it_skips():
    # only a reward function: no reward stage, so no preference tables; SFT off: its fields but `enabled`
    cfg = load_config(None, ["rl.algorithm=rloo", EXACT_MATCH, "sft.enabled=false", "model.base=org/model"])
    params = run_params(cfg)
    assert under(params, "ppo") == set() and under(params, "reward") == set()
    assert under(params, "sft") == {"sft.enabled"}
    assert not any(k.startswith("data.preference") for k in params)
    assert "data.prompts.columns.prompt" in params and "data.eval_prompts.path" in params
