"""rlhf_core/config/loading.py: YAML files, `--set a.b=value` overrides, validation; every shipped config loads."""

from __future__ import annotations

import logging
import re
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


# settings that moved to the section where they apply: read under their old names, said once -------------------

OLD_NAMES = {
    "rl": {"algorithm": "grpo", "dynamic_sampling": {"enabled": True, "max_rounds": 2}},
    "rollout": {
        "engine": "vllm",
        "vllm": {"correction": "token_truncate", "correction_cap": 2.0, "correction_min": 0.5},
    },
}
NEW_NAMES = [
    "rl.algorithm=grpo",
    "grpo.dynamic_sampling.enabled=true",
    "grpo.dynamic_sampling.max_rounds=2",
    "rollout.engine=vllm",
    "rollout.correction.mode=token_truncate",
    "rollout.correction.cap=2.0",
    "rollout.correction.min=0.5",
]


@pytest.fixture
def said(caplog):
    """The sentences the loader says (each once per process: forgotten before and after the test)."""
    from rlhf_core.config import loading

    loading._say_once.cache_clear()
    caplog.set_level(logging.WARNING, logger=loading.__name__)
    yield lambda: [r.getMessage() for r in caplog.records if r.name == loading.__name__]
    loading._say_once.cache_clear()


def test_moved_settings_are_read_under_their_old_names_and_said_once(tmp_path, said):
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(OLD_NAMES))
    for _ in range(3):  # `rlhf run` loads it, then its flow (the flow run's name, the flow's body)
        cfg = load_config(path)
    assert cfg == load_config(None, NEW_NAMES)  # the new names: the same config, nothing said
    assert cfg.grpo.dynamic_sampling.model_dump() == {"enabled": True, "max_rounds": 2}
    assert cfg.rollout.correction.model_dump() == {"mode": "token_truncate", "cap": 2.0, "min": 0.5}
    assert said() == [
        "config: rollout.vllm.correction is now rollout.correction.mode, rollout.vllm.correction_cap is now "
        "rollout.correction.cap, rollout.vllm.correction_min is now rollout.correction.min, rl.dynamic_sampling is "
        f"now grpo.dynamic_sampling (read as those; rename them in {path})"
    ]


def test_an_override_by_an_old_name_is_read_as_the_new_one(said):
    cfg = load_config(None, ["rl.algorithm=grpo", "rl.dynamic_sampling.enabled=true"])
    assert cfg.grpo.dynamic_sampling.enabled is True
    assert said() == [
        "config: rl.dynamic_sampling is now grpo.dynamic_sampling (read as that; rename it in your --set overrides)"
    ]
    whole = load_config(None, ["rollout.max_staleness=1", "rl.algorithm=grpo", "rollout.vllm={correction: none}"])
    assert whole.rollout.correction.mode == "none"
    assert said()[-1] == (
        "config: rollout.vllm.correction is now rollout.correction.mode (read as that; rename it in your --set overrides)"
    )


def test_both_names_of_one_setting_are_refused_naming_both(tmp_path, said):
    both = tmp_path / "both.yaml"
    both.write_text(yaml.safe_dump({**OLD_NAMES, "grpo": {"dynamic_sampling": {"enabled": False}}}))
    with pytest.raises(
        ConfigError,
        match=f"^rl.dynamic_sampling and grpo.dynamic_sampling are both set in config file {re.escape(str(both))}; ",
    ):
        load_config(both)
    with pytest.raises(
        ConfigError,
        match="^rollout.vllm.correction_cap and rollout.correction.cap are both set in the --set overrides; "
        "rollout.vllm.correction_cap is the old name of rollout.correction.cap: keep only rollout.correction.cap$",
    ):
        load_config(None, ["rollout.vllm.correction_cap=2", "rollout.correction.cap=3"])
    assert said() == []
    # an override by either name applies over the file's setting, as every override does
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump(OLD_NAMES))
    assert load_config(old, ["grpo.dynamic_sampling.max_rounds=5"]).grpo.dynamic_sampling.max_rounds == 5
    assert load_config(old, ["rl.dynamic_sampling.enabled=false"]).grpo.dynamic_sampling.enabled is False


def test_an_older_runs_resolved_dump_loads_as_the_same_config(tmp_path, said):
    cfg = load_config(REPO / "configs" / "smoke.yaml", NEW_NAMES)
    dump = cfg.model_dump(mode="json")  # as `rlhf validate` prints it, with the names before the move
    correction = dump["rollout"].pop("correction")
    dump["rollout"]["vllm"] |= {
        "correction": correction["mode"],
        "correction_cap": correction["cap"],
        "correction_min": correction["min"],
    }
    dump["rl"]["dynamic_sampling"] = dump["grpo"].pop("dynamic_sampling")
    path = tmp_path / "resolved.yaml"
    path.write_text(yaml.safe_dump(dump, sort_keys=False))
    assert load_config(path) == cfg
    assert len(said()) == 1
