"""The pipeline run's summary metrics read from what the stages return, with the keys a stage may or may not report."""

import pytest

from flows.rlhf_pipeline import summary_metrics
from rlhf_core.config import load_config
from tasks.stage_io import Checkpoint


@pytest.fixture
def cfg(tmp_path):
    return load_config(None, [f"run.output_dir={tmp_path}"])


def checkpoint(metrics: dict, final_eval: dict | None = None, gold: str | None = "vader_compound") -> Checkpoint:
    return Checkpoint(
        path="p", model_uri=None, step=7, metrics=metrics, extra={"gold": gold, "final_eval": final_eval or {}}
    )


def test_summary_prefers_the_stage_metrics_k3_kl_and_counts_guard_triggers(cfg):
    trained = checkpoint(
        {
            "eval/vader_compound_mean": 0.5,
            "eval/score_mean": 1.25,
            "eval/kl_mean": 0.2,
            "eval/kl_k3_mean": 0.1,
            "guard/triggers": 3.0,
        },
        final_eval={"eval/vader_compound_mean": -1.0, "eval/score_mean": -1.0, "eval/kl_mean": -1.0},
    )
    reward = Checkpoint(path="r", model_uri=None, step=4, metrics={"eval_accuracy": 0.875, "eval_loss": 0.3})

    assert summary_metrics(cfg, reward, trained) == {
        "summary/gold": 0.5,
        "summary/proxy": 1.25,
        "summary/kl": 0.1,
        "summary/reward_accuracy": 0.875,
        "summary/guard_triggers": 3.0,
    }


def test_summary_falls_back_to_the_last_evaluation_and_leaves_out_what_was_not_measured(cfg):
    # train metrics only on the Checkpoint (today's PPO), the evaluation summary in extra; no reward stage
    trained = checkpoint(
        {"objective/kl": 0.4}, final_eval={"eval/vader_compound_mean": 0.3, "eval/kl_mean": 0.05}, gold=None
    )

    assert summary_metrics(cfg, None, trained) == {
        "summary/gold": 0.3,  # eval.metrics[0] is vader_compound
        "summary/kl": 0.05,
        "summary/guard_triggers": 0.0,
    }
