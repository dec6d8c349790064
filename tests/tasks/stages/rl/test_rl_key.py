"""The RL stage's key (tasks/stages/rl/stage.py `rl_key`) across the move of rl.dynamic_sampling to
grpo.dynamic_sampling and of rollout.vllm.correction* to rollout.correction.*: each key below was computed by the
code before the move, so a run directory made before it keeps its keys and resumes, whichever names the config uses."""

from __future__ import annotations

import pytest

from rlhf_core.config import load_config
from tasks.stages.data import PreparedData
from tasks.stages.initialization import InitPlan
from tasks.stages.rl.stage import rl_key

DATA = PreparedData(tables={}, fingerprints={"prompts": "f" * 16}, base_model="demo", tokenizer="demo")
PLAN = InitPlan("p", "policy@1", None, None, "reward@1", "copy")
MOVED = ["rl.algorithm=grpo", "rollout.engine=vllm"]


@pytest.mark.parametrize(
    ("sets", "key"),
    [
        (
            [
                *MOVED,
                "grpo.dynamic_sampling.enabled=true",
                "grpo.dynamic_sampling.max_rounds=2",
                "rollout.correction.mode=token_truncate",
                "rollout.correction.cap=2.0",
                "rollout.correction.min=0.5",
            ],
            "d052896e0ba99b64",
        ),
        (
            [  # the old names, read as the new ones
                *MOVED,
                "rl.dynamic_sampling.enabled=true",
                "rl.dynamic_sampling.max_rounds=2",
                "rollout.vllm.correction=token_truncate",
                "rollout.vllm.correction_cap=2.0",
                "rollout.vllm.correction_min=0.5",
            ],
            "d052896e0ba99b64",
        ),
        (["rl.algorithm=grpo"], "960e495dc328569a"),
        ([], "adf9bd70d5ede049"),
        (["rl.algorithm=rloo", "rollout.max_staleness=1"], "77eb6aafc49f5c91"),
    ],
)
def test_the_rl_key_is_the_one_computed_before_the_settings_moved(sets, key):
    assert rl_key(load_config(None, sets), DATA, PLAN) == key
