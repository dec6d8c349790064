"""`rlhf-feedback-watch`: the feedback pairs since the last training counted, and the event emitted only at
retrain.min_new_pairs, with what the triggered retraining needs (tests/e2e/test_deployments.py has the trigger on a
real server)."""

from __future__ import annotations

import mlflow
import pytest

from flows import feedback_watch
from rlhf_core.data.rows import DataValidationError
from tasks import tracking
from tests.fixtures.traffic import choose, traced_answer


def test_the_event_goes_out_once_enough_new_pairs_arrived(prefect_harness, tmp_path, mlflow_uri, monkeypatch):
    monkeypatch.setenv("MLFLOW_ENABLE_ASYNC_TRACE_LOGGING", "false")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", "")  # set_experiment writes it; monkeypatch takes it out after
    emitted = []
    monkeypatch.setattr(feedback_watch, "emit_event", lambda **event: emitted.append(event))
    tracking.store.configure(mlflow_uri)
    mlflow.set_experiment("traffic")
    try:
        for i in range(2):
            choose(traced_answer(f"prompt {i}", ["meh .", "great ."]), 1)
    finally:
        mlflow.set_tracking_uri(None)
    overrides = [f"tracking.uri={mlflow_uri}", f"run.output_dir={tmp_path}", "data.preference.path=traces:traffic"]
    below = feedback_watch.rlhf_feedback_watch("configs/smoke.yaml", [*overrides, "retrain.min_new_pairs=3"])
    assert below == {"experiment": "traffic", "new_pairs": 2, "min_new_pairs": 3, "emitted": False} and not emitted
    at = feedback_watch.rlhf_feedback_watch("configs/smoke.yaml", [*overrides, "retrain.min_new_pairs=2"])
    assert at["emitted"] is True
    (event,) = emitted
    assert event["event"] == "rlhf.feedback.ready"
    assert event["resource"]["prefect.resource.id"] == "rlhf.feedback.traffic"
    assert event["payload"] == {
        "new_pairs": 2,
        "min_new_pairs": 2,
        "config_path": "configs/smoke.yaml",
        "overrides": [*overrides, "retrain.min_new_pairs=2"],
    }


def test_a_config_without_a_traces_source_is_refused_in_one_sentence(prefect_harness):
    with pytest.raises(DataValidationError, match="^data.preference.path is 'demo': rlhf-feedback-watch counts"):
        feedback_watch.rlhf_feedback_watch("configs/smoke.yaml", [])
