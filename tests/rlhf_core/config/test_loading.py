"""rlhf_core/config/loading.py: YAML files, `--set a.b=value` overrides, validation; every shipped config loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlhf_core.config import (
    ConfigError,
    PipelineConfig,
    apply_overrides,
    load_config,
    parse_override,
    validate_config,
)

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    "path", sorted(p for p in (REPO / "configs").rglob("*.yaml") if p.parent.name != "accelerate"), ids=lambda p: p.name
)
def test_shipped_configs_validate(path, monkeypatch):
    monkeypatch.chdir(REPO)  # run.accelerate_config is relative to the working directory, as data paths are
    cfg = load_config(path)
    assert cfg.registry.reward_model_name != cfg.registry.policy_model_name


def test_overrides_are_parsed_as_yaml_and_applied():
    cfg = load_config(
        REPO / "configs" / "demo.yaml",
        ["ppo.kl_coef=0.1", "rl.algorithm=ppo", "ppo.adaptive_kl=true", "eval.metrics=[a.b:c, d:e]"],
    )
    assert cfg.ppo.kl_coef == 0.1 and cfg.ppo.adaptive_kl is True
    assert cfg.eval.metrics == ["a.b:c", "d:e"]
    assert parse_override("run.name=x=y") == (["run", "name"], "x=y")


def test_override_does_not_mutate_input():
    raw = {"ppo": {"kl_coef": 0.3}}
    patched = apply_overrides(raw, ["ppo.kl_coef=0.1"])
    assert raw["ppo"]["kl_coef"] == 0.3 and patched["ppo"]["kl_coef"] == 0.1


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


@pytest.mark.parametrize(
    "path",
    sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").glob("**/*.yaml") if "accelerate" not in p.parts),
)
def test_every_shipped_config_loads_and_round_trips_through_json(path):
    cfg = load_config(REPO / path)
    assert PipelineConfig.model_validate(cfg.model_dump(mode="json")) == cfg  # as tasks.launch.worker does


@pytest.mark.parametrize("text, value", [("5e-4", 5e-4), ("1e-3", 1e-3), (".5", 0.5), ("1E+2", 100.0), ("2E-5", 2e-5)])
def test_numbers_as_people_write_them_are_floats_in_overrides_and_files(tmp_path, text, value):
    assert load_config(REPO / "configs" / "smoke.yaml", [f"rl.learning_rate={text}"]).rl.learning_rate == value
    config = tmp_path / "c.yaml"
    config.write_text(f"rl:\n  learning_rate: {text}\nppo:\n  kl_coef: {text}\n")
    cfg = load_config(config)
    assert (cfg.rl.learning_rate, cfg.ppo.kl_coef) == (value, value)
    # the loader is the config's own: PyYAML's shared safe loader keeps YAML 1.1's rules
    assert yaml.safe_load("5e-4") == "5e-4"
    assert parse_override("run.name=e5") == (["run", "name"], "e5")


def test_tilde_and_environment_variables_expand_in_path_fields(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("RLHF_DATA", str(tmp_path / "data"))
    cfg = load_config(
        None,
        [
            "run.output_dir=~/rlhf-x",
            "export.output_dir=${RLHF_DATA}/export",
            "model.base=~/models/qwen",
            "data.prompts.path=$RLHF_DATA/prompts.jsonl",
            "reward.base=Qwen/Qwen2.5-0.5B",
        ],
    )
    assert cfg.run.output_dir == tmp_path / "rlhf-x"
    assert cfg.export.output_dir == tmp_path / "data" / "export"
    assert cfg.model.base == f"{tmp_path}/models/qwen"
    assert cfg.data.prompts.path == f"{tmp_path}/data/prompts.jsonl"
    assert cfg.reward.base == "Qwen/Qwen2.5-0.5B"  # a hub name passes unchanged
    inline = "{% for m in messages %}{{ m.content }}{% endfor %}"  # a template, not a path: left alone
    assert load_config(None, [f'model.chat_template="{inline}"']).model.chat_template == inline


def test_an_unset_environment_variable_in_a_path_is_refused(monkeypatch):
    monkeypatch.delenv("RLHF_NOT_SET", raising=False)
    with pytest.raises(ConfigError, match=r"run.output_dir.*environment variable RLHF_NOT_SET is not set"):
        load_config(None, ["run.output_dir=$RLHF_NOT_SET/x"])
