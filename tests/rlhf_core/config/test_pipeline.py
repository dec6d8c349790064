"""rlhf_core/config/pipeline.py: PipelineConfig's derived values and cross-field checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_core.config import (
    ConfigError,
    PipelineConfig,
    load_config,
)

REPO = Path(__file__).resolve().parents[3]


def test_tracking_uri_falls_back_to_env_then_sqlite(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert PipelineConfig().tracking_uri() == f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert PipelineConfig().tracking_uri() == "http://127.0.0.1:5000"
    assert load_config(None, ["tracking.uri=sqlite:///x.db"]).tracking_uri() == "sqlite:///x.db"


def test_config_hash_is_stable_and_sensitive():
    a, b = PipelineConfig(), PipelineConfig()
    assert a.config_hash() == b.config_hash()
    assert a.config_hash() != load_config(None, ["ppo.kl_coef=0.2"]).config_hash()


def test_grpo_batch_size_is_the_generation_batch():
    # rl.batch_size completions per RL step, split into steps_per_generation micro-batches, GA of them per optimizer step
    cfg = load_config(
        REPO / "configs" / "demo.yaml",
        [
            "rl.algorithm=grpo",
            "rl.batch_size=16",
            "grpo.num_generations=4",
            "rl.gradient_accumulation_steps=2",
            "grpo.steps_per_generation=4",
        ],
    )
    assert cfg.rl.batch_size == 16 and cfg.grpo.steps_per_generation == 4
    # the micro-batch need not be a multiple of the group any more, only the generation batch is
    load_config(
        REPO / "configs" / "demo.yaml",
        [
            "rl.algorithm=grpo",
            "rl.batch_size=16",
            "grpo.num_generations=8",
            "rl.gradient_accumulation_steps=2",
            "grpo.steps_per_generation=4",
        ],
    )


@pytest.mark.parametrize("section", ["rl", "reward"])
def test_deepspeed_needs_zero_nonfinite_steps_in_a_row(monkeypatch, section):
    monkeypatch.chdir(REPO)
    zero2 = "configs/accelerate/deepspeed_zero2.yaml"
    both = [
        f"run.accelerate_config={zero2}",
        "rl.max_nonfinite_steps_in_a_row=0",
        "reward.max_nonfinite_steps_in_a_row=0",
    ]
    assert load_config(REPO / "configs" / "demo.yaml", both).rl.max_nonfinite_steps_in_a_row == 0
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs" / "demo.yaml", [*both, f"{section}.max_nonfinite_steps_in_a_row=2"])
    message = str(err.value)
    assert (
        f"set {section}.max_nonfinite_steps_in_a_row: 0" in message and "DeepSpeed" in message and "\n" not in message
    )


def test_a_token_budget_is_refused_under_deepspeed_and_for_dpo(monkeypatch):
    monkeypatch.chdir(REPO)
    demo = REPO / "configs" / "demo.yaml"
    assert load_config(demo, ["rl.max_tokens_per_micro_batch=2048"]).rl.max_tokens_per_micro_batch == 2048
    zero2 = ["run.accelerate_config=configs/accelerate/deepspeed_zero2.yaml", "rl.max_nonfinite_steps_in_a_row=0"]
    zero2.append("reward.max_nonfinite_steps_in_a_row=0")
    for overrides, words in (
        ([*zero2, "rl.max_tokens_per_micro_batch=2048"], "DeepSpeed (zero2)"),
        (["rl.algorithm=dpo", "rl.max_tokens_per_micro_batch=2048"], "not by rl.algorithm 'dpo'"),
    ):
        with pytest.raises(ConfigError) as err:
            load_config(demo, overrides)
        assert "rl.max_tokens_per_micro_batch" in str(err.value) and words in str(err.value), err.value


def test_outside_the_demo_no_gold_metric_and_no_sft_on_the_demo_corpus_unless_named(tmp_path):
    demo = load_config(REPO / "configs" / "demo.yaml")
    assert (
        demo.eval.metrics == ["rlhf_core.rewards.functions:vader_compound"] and demo.gold_metric() == "vader_compound"
    )
    assert demo.sft.enabled and demo.init.policy == "sft"
    own = PipelineConfig(model={"base": str(tmp_path)})
    assert own.eval.metrics == [] and own.gold_metric() is None and own.selection_metric() == "score"
    assert own.sft.enabled is False and own.init.policy == "base"  # not fine-tuned on the demo's reviews
    corpus = PipelineConfig(model={"base": str(tmp_path)}, sft={"dataset": {"path": "corpus.jsonl"}})
    assert corpus.sft.enabled and corpus.init.policy == "sft"
    named = PipelineConfig(model={"base": str(tmp_path)}, eval={"metrics": ["m:f"]}, sft={"enabled": True})
    assert named.gold_metric() == "f" and named.sft.enabled
    # the resolved values are what a dump holds: loading it again gives the same config
    assert PipelineConfig.model_validate(own.model_dump(mode="json")) == own


def test_defaults_are_sized_for_real_models():
    cfg = PipelineConfig(model={"base": "/models/x"})
    assert (cfg.data.max_prompt_length, cfg.rl.response_length, cfg.data.max_length) == (512, 256, 1024)
    assert cfg.data.max_prompt_length + cfg.rl.response_length <= cfg.data.max_length
    assert (cfg.sft.learning_rate, cfg.reward.learning_rate) == (2e-5, 1e-5)


def test_guard_section_defaults_and_checks():
    from rlhf_core.config import ConfigError, load_config

    smoke = str(Path(__file__).resolve().parents[3] / "configs" / "smoke.yaml")
    cfg = load_config(smoke)
    assert cfg.guard.kl_budget.limit is None and cfg.guard.min_distinct_ratio.limit == 0.5
    assert cfg.export.select == "best" and cfg.gold_metric() == "vader_compound"
    assert cfg.eval_temperature() == cfg.rl.temperature
    assert load_config(smoke, ["eval.temperature=0.5"]).eval_temperature() == 0.5
    # the evaluating process decides and every process acts (tests/ray/test_guard_processes.py)
    assert load_config(smoke, ["guard.kl_budget.action=rollback", "run.num_processes=2"]).run.num_processes == 2
    with pytest.raises(ConfigError, match="guard.divergence.gold 'bleu' is not an eval metric"):
        load_config(smoke, ["guard.divergence.gold=bleu"])


def test_the_ray_launcher_takes_no_accelerate_launch_file():
    from rlhf_core.config import ConfigError, load_config

    example = REPO / "configs" / "examples" / "multi-gpu.yaml"
    with pytest.raises(
        ConfigError, match="run.accelerate_config .* is read by `accelerate launch`, which run.launcher 'ray'"
    ):
        load_config(example, ["run.launcher=ray"])
    assert load_config(example, ["run.launcher=ray", "run.accelerate_config=null"]).run.launcher == "ray"


def test_prompts_per_step_names_the_field_that_sets_the_generation_batch():
    cfg = load_config(REPO / "configs" / "demo.yaml", ["rl.algorithm=grpo", "grpo.generation_batch_size=null"])
    assert cfg.prompts_per_step() == (
        cfg.rl.batch_size // cfg.grpo.num_generations,
        "rl.batch_size / grpo.num_generations",
    )
    sized = load_config(REPO / "configs" / "demo.yaml", ["rl.algorithm=grpo", "grpo.generation_batch_size=64"])
    assert sized.prompts_per_step()[1] == "grpo.generation_batch_size / grpo.num_generations"
    online = load_config(REPO / "configs" / "demo.yaml", ["rl.algorithm=online_dpo", "rl.batch_size=16"])
    assert online.prompts_per_step() == (8, "rl.batch_size / 2")  # two completions per prompt


def test_dpo_reads_the_pairs_and_no_reward_stage_online_dpo_its_rewards():
    dpo = load_config(REPO / "configs" / "dpo.yaml")
    tables = [name for name, *_ in dpo.data_tables()]
    assert tables == ["preference", "preference_eval", "eval_prompts", "sft"] and not dpo.trains_reward_model()
    online = load_config(REPO / "configs" / "demo.yaml", ["rl.algorithm=online_dpo"])
    assert online.trains_reward_model()  # grpo.rewards' default is the reward stage's model
    assert [name for name, *_ in online.data_tables()][:3] == ["preference", "preference_eval", "prompts"]
    with pytest.raises(ConfigError, match="dpo.precompute_ref_log_probs needs the pairs before training"):
        load_config(REPO / "configs" / "demo.yaml", ["rl.algorithm=online_dpo", "dpo.precompute_ref_log_probs=true"])
    with pytest.raises(ConfigError, match="online_dpo samples two completions per prompt"):
        load_config(
            REPO / "configs" / "demo.yaml",
            ["rl.algorithm=online_dpo", "rl.batch_size=6", "rl.gradient_accumulation_steps=2"],
        )
    with pytest.raises(ConfigError, match="offline dpo trains on data.preference's pairs without sampling"):
        load_config(REPO / "configs" / "dpo.yaml", ["rollout.engine=vllm"])
    with pytest.raises(ConfigError, match="dpo.sync_ref_model needs a reference copy"):
        load_config(REPO / "configs" / "dpo.yaml", ["dpo.sync_ref_model=true", "model.lora.enabled=true"])


def test_outside_the_demo_unset_micro_batches_are_eight_sequences_of_the_same_optimizer_step(tmp_path):
    def sizes(*sets):
        cfg = load_config(None, list(sets))
        return [(s.batch_size, s.gradient_accumulation_steps) for s in (cfg.sft, cfg.reward, cfg.rl)]

    assert sizes() == [(32, 1), (32, 1), (32, 1)]  # the demo: whole batches
    own = f"model.base={tmp_path}"
    assert sizes(own) == [(8, 4), (8, 4), (32, 4)]
    assert sizes(own, "rl.algorithm=grpo", "grpo.generation_batch_size=64") == [(8, 4), (8, 4), (32, 8)]
    assert sizes(own, "reward.batch_size=16", "rl.gradient_accumulation_steps=2") == [(8, 4), (16, 1), (32, 2)]
    assert sizes(own, "rl.batch_size=12", "sft.gradient_accumulation_steps=1") == [(32, 1), (8, 4), (12, 1)]
    assert sizes(own, "rl.algorithm=grpo", "grpo.steps_per_generation=2")[2] == (32, 1)
