"""The rollout section: the engine's names, where the vLLM environment is found, what enters the RL stage's key,
and the checks across sections, each refused in one sentence."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_core.config import ConfigError, RolloutConfig, load_config
from rlhf_core.config.rollout import REPOSITORY, VLLM_PYTHON_ENV


def test_hf_is_the_default_and_the_engines_have_the_names_scripts_rely_on():
    assert RolloutConfig().engine == "hf"
    assert load_config(None, ["rollout.engine=vllm"]).rollout.engine == "vllm"
    with pytest.raises(ConfigError, match="rollout.engine"):
        load_config(None, ["rollout.engine=sglang"])


def test_the_vllm_interpreter_is_the_field_then_the_environment_then_this_repositorys(monkeypatch, tmp_path):
    monkeypatch.delenv(VLLM_PYTHON_ENV, raising=False)
    assert RolloutConfig().vllm.interpreter() == REPOSITORY / ".venv-vllm" / "bin" / "python"
    monkeypatch.setenv(VLLM_PYTHON_ENV, "/opt/vllm/bin/python")
    assert RolloutConfig().vllm.interpreter() == Path("/opt/vllm/bin/python")
    monkeypatch.setenv("VLLM_HOME", str(tmp_path))
    cfg = load_config(None, ["rollout.vllm.python=$VLLM_HOME/bin/python"])
    assert cfg.rollout.vllm.interpreter() == tmp_path / "bin" / "python"


def test_the_stage_key_sees_what_changes_the_weights_and_not_where_the_server_runs():
    assert RolloutConfig().result_fields() == {}  # hf: the keys of runs made before the engines stay
    vllm = load_config(None, ["rollout.engine=vllm"]).rollout
    elsewhere = load_config(
        None, ["rollout.engine=vllm", "rollout.vllm.url=http://gpu-7:8000", "rollout.vllm.startup_timeout_s=9"]
    ).rollout
    assert vllm.result_fields() == elsewhere.result_fields() != {}
    capped = load_config(None, ["rollout.engine=vllm", "rollout.correction.cap=2.0"]).rollout
    assert capped.result_fields() != vllm.result_fields()
    assert RolloutConfig(max_staleness=0).result_fields() == {}  # in step: the keys of earlier runs stay
    ahead = [RolloutConfig(max_staleness=k).result_fields() for k in (1, 2)]
    assert ahead[0]["max_staleness"] == 1 and ahead[0] != ahead[1]
    assert ahead[0]["correction"] == ["sequence_mask", 3.0, None]  # the correction applies to hf ahead too
    assert "max_staleness" not in vllm.result_fields()


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        (
            ["rollout.correction.min=2.0", "rollout.correction.cap=1.5"],
            "rollout.correction.min 2.0 must not exceed rollout.correction.cap 1.5",
        ),
        (
            ["rollout.engine=vllm", "rl.algorithm=rloo", "rollout.correction.mode=token_mask"],
            "rollout.correction.mode 'token_mask' weighs tokens, but rloo's loss has one ratio per sequence",
        ),
        (
            ["rollout.max_staleness=1", "rl.algorithm=rloo", "rollout.correction.mode=token_mask"],
            "rollout.correction.mode 'token_mask' weighs tokens, but rloo's loss has one ratio per sequence",
        ),
        (
            ["rollout.max_staleness=1", "rl.algorithm=ppo"],
            "rollout.max_staleness 1 runs generation ahead for the GRPO family; rl.algorithm 'ppo' needs 0",
        ),
        (
            ["rollout.max_staleness=2", "rl.algorithm=grpo", "run.num_processes=2"],
            "rollout.max_staleness 2 runs in one process; set run.num_processes to 1",
        ),
        (
            ["rollout.max_staleness=1", "rl.algorithm=grpo", "grpo.dynamic_sampling.enabled=true"],
            "rollout.max_staleness 1 samples each step's groups ahead, so grpo.dynamic_sampling cannot refill them",
        ),
        (
            ["rollout.max_staleness=1", "rl.algorithm=grpo", "rollout.engine=vllm", "rollout.vllm.evaluate=true"],
            "rollout.max_staleness 1 keeps the vLLM server busy ahead of training; set rollout.vllm.evaluate to false",
        ),
    ],
)
def test_cross_section_checks_refuse_in_one_sentence(sets, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, sets)
    assert load_config(None, ["rollout.engine=vllm", "rl.algorithm=rloo", "rollout.correction.mode=sequence_mask"])
