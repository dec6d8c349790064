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
    assert err == "error: config field `rl.algorithm` got 'dpo': allowed values are 'ppo' or 'grpo'"
    assert not (tmp_path / "out").exists()
