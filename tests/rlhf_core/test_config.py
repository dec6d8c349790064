from pathlib import Path

import pytest
import yaml

from rlhf_core.config import (
    ConfigError, PipelineConfig, apply_overrides, flatten_config, is_secret_key, load_config, parse_override, redact_uri,
    validate_config,
)

REPO = Path(__file__).resolve().parents[2]


def test_defaults_follow_trl():
    cfg = PipelineConfig()
    assert (cfg.ppo.kl_coef, cfg.ppo.cliprange, cfg.ppo.vf_coef, cfg.ppo.cliprange_value) == (0.05, 0.2, 0.1, 0.2)
    assert (cfg.ppo.gamma, cfg.ppo.lam, cfg.ppo.num_ppo_epochs) == (1.0, 0.95, 4)
    assert (cfg.grpo.num_generations, cfg.grpo.epsilon, cfg.grpo.loss_type, cfg.grpo.scale_rewards) == (8, 0.2, "dapo", "group")
    assert cfg.reward.center_rewards_coefficient is None
    assert cfg.rl.algorithm == "ppo"


@pytest.mark.parametrize("path", sorted(p for p in (REPO / "configs").rglob("*.yaml") if p.parent.name != "accelerate"),
                         ids=lambda p: p.name)
def test_shipped_configs_validate(path, monkeypatch):
    monkeypatch.chdir(REPO)  # run.accelerate_config is relative to the working directory, as data paths are
    cfg = load_config(path)
    assert cfg.registry.reward_model_name != cfg.registry.policy_model_name


def test_readme_starts_with_the_two_commands():
    # the configuration reference itself: tests/rlhf_core/test_config_reference.py
    readme = (REPO / "README.md").read_text()
    commands = readme.split("## ", 2)[1]
    assert "make demo" in commands and "make test" in commands


def test_overrides_are_parsed_as_yaml_and_applied():
    cfg = load_config(REPO / "configs" / "demo.yaml", ["ppo.kl_coef=0.1", "rl.algorithm=ppo", "ppo.adaptive_kl=true",
                                                         "eval.metrics=[a.b:c, d:e]"])
    assert cfg.ppo.kl_coef == 0.1 and cfg.ppo.adaptive_kl is True
    assert cfg.eval.metrics == ["a.b:c", "d:e"]
    assert parse_override("run.name=x=y") == (["run", "name"], "x=y")


def test_override_does_not_mutate_input():
    raw = {"ppo": {"kl_coef": 0.3}}
    patched = apply_overrides(raw, ["ppo.kl_coef=0.1"])
    assert raw["ppo"]["kl_coef"] == 0.3 and patched["ppo"]["kl_coef"] == 0.1


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["ppo.kl_coeff=0.1"], "unknown config field `ppo.kl_coeff` (did you mean `ppo.kl_coef`?); the fields allowed in ppo are: kl_coef,"),
        (["nonsense.x=1"], "unknown config field `nonsense`"),
        (["rl.algorithm=dpo"], "`rl.algorithm` got 'dpo': allowed values are 'ppo' or 'grpo'"),
        (["grpo.loss_type=sum"], "allowed values are 'grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo' or 'sapo'"),
        (["grpo.importance_sampling_level=seq"], "allowed values are 'token' or 'sequence'"),
        (["grpo.multi_objective_aggregation=mean"], "allowed values are 'sum_then_normalize' or 'normalize_then_sum'"),
        (["grpo.top_entropy_quantile=1.5"], "`grpo.top_entropy_quantile` got 1.5"),
        (["grpo.delta=0.5"], "`grpo.delta` got 0.5"),
        (["rl.algorithm=grpo", "rl.gradient_accumulation_steps=2", "grpo.steps_per_generation=3"],
         "grpo.steps_per_generation 3 must be a multiple of rl.gradient_accumulation_steps 2"),
        (["rl.algorithm=grpo", "rl.missing_eos_penalty=1", "grpo.multi_objective_aggregation=normalize_then_sum"],
         "rl.missing_eos_penalty is subtracted from the summed reward"),
        (["rl.algorithm=grpo", "grpo.sync_ref_model=true"], "grpo.sync_ref_model needs a reference model, but grpo.beta is 0"),
        (["rl.algorithm=grpo", "grpo.sync_ref_model=true", "grpo.beta=0.1", "model.lora.enabled=true"],
         "grpo.sync_ref_model needs a reference copy"),
        (["rl.algorithm=grpo", "grpo.loss_type=cispo", "grpo.delta=2"], "grpo.delta applies to the clipped losses"),
        (["rl.missing_eos_penalty=1", "rl.stop_token=none"], "missing_eos_penalty needs a stop token"),
        (["ppo.cliprange=-1"], "`ppo.cliprange` got -1: Input should be greater than 0"),
        (["run.seed=abc"], "`run.seed` must be an integer, but got 'abc' (a string)"),
        (["rl.algorithm=grpo", "rl.batch_size=12"], "rl.batch_size 12 must be a multiple of grpo.num_generations 8"),
        (["rl.algorithm=grpo", "rl.batch_size=8", "grpo.num_generations=4", "rl.gradient_accumulation_steps=2",
          "grpo.steps_per_generation=16"],
         "rl.batch_size 8 (the generation batch) must be a multiple of grpo.steps_per_generation 16"),
        (["rl.algorithm=grpo", "rl.batch_size=8", "grpo.num_generations=4", "rl.gradient_accumulation_steps=16"],
         "rl.batch_size 8 (the generation batch) must be a multiple of rl.gradient_accumulation_steps 16"),
        (["data.prompts.split=validation"], "`data.prompts`: split 'validation' does not exist in the demo world"),
        (["grpo.rewards=[{name: x}]"], "reward 'x' must set exactly one of model or function"),
        (["grpo.rewards=[{name: x, function: nocolon}]"], "must be written 'package.module:function'"),
        (["sft.enabled=false"], "init.policy is 'sft' but sft.enabled is false"),
        (["data.max_prompt_length=64", "data.max_length=32"], "max_prompt_length 64 must be below max_length 32"),
    ],
)
def test_bad_config_is_one_sentence_naming_the_field(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs" / "demo.yaml", overrides)
    message = str(err.value)
    assert expected in message
    assert "\n" not in message


@pytest.mark.parametrize("text", ["ppo.kl_coef", "=3", "ppo..kl=1", "x.y=[unclosed"])
def test_malformed_override(text):
    with pytest.raises(ConfigError, match="override"):
        parse_override(text)


def test_override_into_a_value_is_refused():
    with pytest.raises(ConfigError, match="`run.seed` is a value, not a section"):
        apply_overrides({"run": {"seed": 1}}, ["run.seed.x=2"])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text(yaml.safe_dump([1, 2]))
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(listy)
    with pytest.raises(ConfigError, match="must be a mapping"):
        validate_config([1])


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


def test_flatten_hides_secrets():
    cfg = load_config(None, ["tracking.uri=http://alice:s3cret@mlflow.example:5000", "model.tokenizer=./tok"])
    flat = flatten_config(cfg)
    assert flat["ppo.kl_coef"] == "0.05"
    assert flat["model.tokenizer"] == "./tok"
    assert "s3cret" not in " ".join(flat.values())
    assert flat["tracking.uri"] == "http://alice:***@mlflow.example:5000"
    assert is_secret_key("hub_token") and is_secret_key("tracking.password") and not is_secret_key("model.tokenizer")
    assert redact_uri("postgresql://u:p@h/db") == "postgresql://u:***@h/db"


def test_grpo_batch_size_is_the_generation_batch():
    # rl.batch_size completions per RL step, split into steps_per_generation micro-batches, GA of them per optimizer step
    cfg = load_config(REPO / "configs" / "demo.yaml", ["rl.algorithm=grpo", "rl.batch_size=16", "grpo.num_generations=4",
                                                       "rl.gradient_accumulation_steps=2", "grpo.steps_per_generation=4"])
    assert cfg.rl.batch_size == 16 and cfg.grpo.steps_per_generation == 4
    # the micro-batch need not be a multiple of the group any more, only the generation batch is
    load_config(REPO / "configs" / "demo.yaml", ["rl.algorithm=grpo", "rl.batch_size=16", "grpo.num_generations=8",
                                                 "rl.gradient_accumulation_steps=2", "grpo.steps_per_generation=4"])


def test_every_optimizer_section_limits_nonfinite_steps_in_a_row():
    cfg = PipelineConfig()
    assert (cfg.sft.max_nonfinite_steps_in_a_row, cfg.reward.max_nonfinite_steps_in_a_row,
            cfg.rl.max_nonfinite_steps_in_a_row) == (3, 3, 3)
    assert load_config(None, ["rl.max_nonfinite_steps_in_a_row=0"]).rl.max_nonfinite_steps_in_a_row == 0
    with pytest.raises(ConfigError, match="`rl.max_nonfinite_steps_in_a_row` got -1"):
        load_config(None, ["rl.max_nonfinite_steps_in_a_row=-1"])


@pytest.mark.parametrize("section", ["rl", "reward"])
def test_deepspeed_needs_zero_nonfinite_steps_in_a_row(monkeypatch, section):
    monkeypatch.chdir(REPO)
    zero2 = "configs/accelerate/deepspeed_zero2.yaml"
    both = [f"run.accelerate_config={zero2}", "rl.max_nonfinite_steps_in_a_row=0", "reward.max_nonfinite_steps_in_a_row=0"]
    assert load_config(REPO / "configs" / "demo.yaml", both).rl.max_nonfinite_steps_in_a_row == 0
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs" / "demo.yaml", [*both, f"{section}.max_nonfinite_steps_in_a_row=2"])
    message = str(err.value)
    assert f"set {section}.max_nonfinite_steps_in_a_row: 0" in message and "DeepSpeed" in message and "\n" not in message
