from pathlib import Path

import yaml

from flows.cli import main

SMOKE = str(Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml")


def test_validate_prints_the_resolved_config(capsys):
    assert main(["validate", "--config", SMOKE, "--set", "ppo.kl_coef=0.3"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["ppo"]["kl_coef"] == 0.3 and printed["run"]["name"] == "smoke"


def test_bad_config_exits_2_with_one_sentence_before_any_work(capsys, tmp_path):
    code = main(["run", "--config", SMOKE, "--set", "rl.algorithm=dpo", "--set", f"run.output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert (
        err
        == "error: config field `rl.algorithm` got 'dpo': allowed values are 'ppo', 'grpo', 'rloo', 'reinforce_plus_plus' or 'reinforce_plus_plus_baseline'"
    )
    assert not (tmp_path / "out").exists()


def test_promote_outside_the_demo_without_a_gate_exits_2_with_one_sentence(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default tracking URI would be ./mlflow.db: nothing may create it
    (tmp_path / "base").mkdir()
    config = tmp_path / "real.yaml"
    config.write_text(yaml.safe_dump({"model": {"base": str(tmp_path / "base")}, "run": {"output_dir": "out"}}))
    assert main(["promote", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "error: promote.min_value or promote.min_improvement must be set to promote on 'score' outside the demo "
        f"(model.base is '{tmp_path / 'base'}'), so that no value becomes champion by default"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "real.yaml"]
