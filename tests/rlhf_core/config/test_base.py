"""rlhf_core/config/base.py: every section is strict (no `true` for an integer, a float field takes an integer,
path fields take strings), on assignment too."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_core.config import load_config

REPO = Path(__file__).resolve().parents[3]


DEMO_YAML = REPO / "configs" / "demo.yaml"


def test_an_integer_is_a_fine_float_and_strings_are_paths(tmp_path):
    cfg = load_config(
        DEMO_YAML,
        [
            "rl.temperature=1",
            "rl.learning_rate=1",
            "ppo.kl_coef=0",
            f"run.output_dir={tmp_path}",
            f"export.output_dir={tmp_path / 'x'}",
        ],
    )
    assert cfg.rl.temperature == 1.0 and isinstance(cfg.rl.temperature, float)
    assert cfg.run.output_dir == tmp_path and cfg.export.output_dir == tmp_path / "x"


def test_assignment_is_strict_too():
    cfg = load_config(DEMO_YAML)
    with pytest.raises(ValueError):
        cfg.rl.total_steps = True
    cfg.run.output_dir = "elsewhere"  # a path field still takes a string
    assert cfg.run.output_dir == Path("elsewhere")
