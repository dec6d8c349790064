"""Refactors must not change behaviour: a smoke run's final metrics and weights match a recorded reference.

The reference (tests/flows/reference_run.json) was recorded before the training loops were merged
into one skeleton. Re-record it only for a change that is meant to move the numbers, and say so in
the commit: `RLHF_RECORD_REFERENCE=1 pytest tests/flows/test_reference_run.py`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from safetensors import safe_open

from flows.rlhf_pipeline import rlhf_pipeline

REPO = Path(__file__).resolve().parents[2]
SMOKE = str(REPO / "configs" / "smoke.yaml")
REFERENCE = Path(__file__).with_name("reference_run.json")
RECORD = os.environ.get("RLHF_RECORD_REFERENCE") == "1"
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]
VADER = "{name: vader, function: 'rlhf_core.rewards.functions:vader_compound', weight: 0.5}"
# A median or p90 over the evaluation's completions is one completion's value: where another CPU's rounding breaks
# a near-tie in sampling, one completion changes and the statistic moves to its neighbour's (seen on an AMD EPYC:
# the PPO step-1 exact-KL median 0.0020690 against 0.0020705 recorded, bb1c885 and this code alike, with every
# mean, metric and weight within 1e-4). Means, metrics and weights keep 1e-4.
RANK_STATISTICS = ("_median", "_p90")
CASES = {
    "ppo": ["rl.algorithm=ppo"],
    # a reward model and a function, two optimizer steps per generation batch, a reference model
    "grpo": [
        "rl.algorithm=grpo",
        f"grpo.rewards=[{{name: rm, model: reward_stage}}, {VADER}]",
        "grpo.beta=0.04",
        "rl.batch_size=16",
        "rl.gradient_accumulation_steps=2",
        "grpo.steps_per_generation=4",
    ],
}


def weight_stats(directory: str | Path) -> dict[str, float]:
    """Sum and sum of squares over every tensor of a saved model: equal weights give equal numbers."""
    total, squares = 0.0, 0.0
    with safe_open(str(Path(directory) / "model.safetensors"), "pt") as f:
        for name in f.keys():
            tensor = f.get_tensor(name).double()
            total += float(tensor.sum())
            squares += float((tensor * tensor).sum())
    return {"sum": total, "sum_sq": squares}


def fingerprint(summary: dict) -> dict:
    return {
        "metrics": summary["metrics"],
        "eval_history": {str(k): v for k, v in summary["eval_history"].items()},
        "policy_weights": weight_stats(summary["policy_path"]),
        "reward_weights": weight_stats(summary["reward_model_path"]) if summary["reward_model_path"] else None,
    }


def assert_close(actual, expected, where: str = "") -> None:
    if isinstance(expected, dict):
        assert sorted(actual) == sorted(expected), f"{where}: keys differ"
        for key in expected:
            assert_close(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, float) and where.endswith(RANK_STATISTICS):
        assert actual == pytest.approx(expected, rel=1e-3, abs=1e-6), where
    elif isinstance(expected, float):
        assert actual == pytest.approx(expected, rel=1e-4, abs=1e-6), where
    else:
        assert actual == expected, where


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_smoke_run_reaches_the_recorded_metrics_and_weights(case, prefect_harness, tmp_path, mlflow_uri):
    overrides = [f"run.output_dir={tmp_path / 'out'}", f"tracking.uri={mlflow_uri}", *CASES[case]]
    summary = rlhf_pipeline(config_path=SMOKE, overrides=overrides)
    got = json.loads(json.dumps(fingerprint(summary)))
    reference = json.loads(REFERENCE.read_text()) if REFERENCE.exists() else {}
    if RECORD:
        reference[case] = got
        REFERENCE.write_text(json.dumps(reference, indent=2, sort_keys=True) + "\n")
        return
    assert_close(got, reference[case], case)
