"""A `traces:<experiment>` source read from an MLflow store: traced answers with people's feedback become the
preference file the data stage reads, with provenance; the window since the last training's cut-off kept on the
registered model; what cannot be read is one sentence (a missing experiment, a tracking server down)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from rlhf_core.config import load_config
from rlhf_core.config.errors import UserError
from rlhf_core.data.rows import DataValidationError
from tasks import tracking
from tasks.stages.feedback import feedback_source, new_pairs
from tests.fixtures.servers import free_port
from tests.fixtures.traffic import choose, traced_answer

SMOKE = "configs/smoke.yaml"
EOS = SimpleNamespace(eos_token="<|im_end|>")  # the tokenizer's end token, which a stopped completion ends on


@pytest.fixture
def traffic(tmp_path, mlflow_uri, monkeypatch):
    """An MLflow store with the experiment `traffic`, tracing synchronously; the smoke config reading it."""
    monkeypatch.setenv("MLFLOW_ENABLE_ASYNC_TRACE_LOGGING", "false")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", "")  # set_experiment writes it; monkeypatch takes it out after
    tracking.store.configure(mlflow_uri)
    mlflow.set_experiment("traffic")
    cfg = load_config(
        SMOKE,
        [f"run.output_dir={tmp_path / 'out'}", f"tracking.uri={mlflow_uri}", "data.preference.path=traces:traffic"],
    )
    yield cfg
    mlflow.set_tracking_uri(None)


def test_feedback_becomes_the_preference_file_with_provenance(traffic):
    first = traced_answer("the soup was", ["cold .", "lovely ."], model=("smoke-policy", "3"))
    choose(first, 1, user="ann")
    choose(first, 0, user="bob")  # a later, conflicting choice of the same pair decides: one pair, superseded 1
    second = traced_answer("the staff were", ["kind .", "rude ."])
    choose(second, 0)
    traced_answer("no one answered this", ["a", "b"])  # no feedback: no pair
    read = feedback_source(traffic, "preference", "data.preference", traffic.data.preference, "preference", EOS)
    rows = [json.loads(line) for line in open(read.path)]
    assert [(r["prompt"], r["chosen"], r["rejected"]) for r in rows] == [
        ("the soup was", "cold .<|im_end|>", "lovely .<|im_end|>"),  # they stopped: the end token, as RL scores them
        ("the staff were", "kind .<|im_end|>", "rude .<|im_end|>"),
    ]
    assert rows[0]["trace_ids"] == [first] and rows[0]["models"] == ["smoke-policy/3"]
    assert read.notes == ["1 assessments were superseded by a later one of the same pair or completion"]
    # read again: the same rows, so the same data fingerprint (a retraining with nothing new trains nothing)
    again = feedback_source(traffic, "preference", "data.preference", traffic.data.preference, "preference", EOS)
    assert open(again.path).read() == open(read.path).read()


def test_the_window_since_the_last_training_counts_only_what_came_after_its_cut_off(traffic):
    choose(traced_answer("old prompt", ["x", "y"]), 0)
    assert new_pairs(traffic) == (1, "traffic")  # no training yet: everything is new
    client = MlflowClient()
    client.create_registered_model(traffic.registry.policy_model_name)
    tracking.feedback.record_cutoffs(traffic.registry.policy_model_name, {"traffic": int(time.time() * 1000)})
    assert new_pairs(traffic) == (0, "traffic")
    time.sleep(0.01)
    choose(traced_answer("new prompt", ["x", "y"]), 1)
    assert new_pairs(traffic) == (1, "traffic")
    since = traffic.model_copy(deep=True)
    since.data.preference.since = "last_training"
    read = feedback_source(since, "preference", "data.preference", since.data.preference, "preference", EOS)
    assert [json.loads(line)["prompt"] for line in open(read.path)] == ["new prompt"]


def test_no_feedback_in_the_window_and_a_missing_experiment_are_one_sentence(traffic, tmp_path, mlflow_uri):
    traced_answer("asked, never judged", ["a", "b"])
    with pytest.raises(
        DataValidationError, match="^data.preference.path: the experiment 'traffic' holds no feedback pairs"
    ):
        feedback_source(traffic, "preference", "data.preference", traffic.data.preference, "preference", EOS)
    other = load_config(SMOKE, [f"tracking.uri={mlflow_uri}", "data.preference.path=traces:nowhere"])
    with pytest.raises(UserError, match="^data.preference.path: there is no MLflow experiment 'nowhere'") as err:
        new_pairs(other)
    assert "\n" not in str(err.value)


def test_a_tracking_server_that_does_not_answer_is_one_sentence_raised_from_the_connection_error(tmp_path, monkeypatch):
    from tasks.runtime.retry import is_transient

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    uri = f"http://rlhf:hunter2@127.0.0.1:{free_port()}"
    cfg = load_config(SMOKE, [f"run.output_dir={tmp_path}", f"tracking.uri={uri}", "data.preference.path=traces:t"])
    tracking.store.configure(cfg.tracking_uri())
    try:
        with pytest.raises(tracking.feedback.FeedbackUnreachable) as err:
            new_pairs(cfg)
    finally:
        mlflow.set_tracking_uri(None)
    message = str(err.value)
    assert message.startswith("data.preference.path: the MLflow tracking server at http://") and "\n" not in message
    assert "hunter2" not in message
    assert is_transient(err.value)  # so the data stage's transient-I/O retries take it before it is said


def test_feedback_on_the_answers_of_a_retired_version_still_counts_and_names_it(traffic, tmp_path):
    client = MlflowClient()
    client.create_registered_model("old-policy")
    version = client.create_model_version("old-policy", source=str(tmp_path)).version
    choose(traced_answer("the view was", ["grey .", "stunning ."], model=("old-policy", version)), 1)
    client.delete_model_version("old-policy", version)  # retired after its users answered
    read = feedback_source(traffic, "preference", "data.preference", traffic.data.preference, "preference", EOS)
    (row,) = [json.loads(line) for line in open(read.path)]
    assert row["chosen"] == "stunning .<|im_end|>" and row["models"] == [f"old-policy/{version}"]


def test_thumbs_and_scores_logged_through_mlflow_become_pairs_on_the_same_prompt(traffic):
    from mlflow.entities import AssessmentSource

    person = AssessmentSource(source_type="HUMAN", source_id="ann")
    up, down = traced_answer("the hotel was", ["lovely ."]), traced_answer("the hotel was", ["filthy ."])
    mlflow.log_feedback(trace_id=up, name="thumbs", value=True, source=person, metadata={"completion": "0"})
    mlflow.log_feedback(trace_id=down, name="thumbs", value=False, source=person)
    high, low = traced_answer("the bus was", ["on time ."]), traced_answer("the bus was", ["late ."])
    mlflow.log_feedback(trace_id=high, name="score", value=0.9, source=person)
    mlflow.log_feedback(trace_id=low, name="score", value=0.2, source=person)
    read = feedback_source(traffic, "preference", "data.preference", traffic.data.preference, "preference", EOS)
    rows = [json.loads(line) for line in open(read.path)]
    assert sorted((r["feedback"], r["chosen"], r["rejected"]) for r in rows) == [
        ("score", "on time .<|im_end|>", "late .<|im_end|>"),
        ("thumbs", "lovely .<|im_end|>", "filthy .<|im_end|>"),
    ]
    assert all(len(r["trace_ids"]) == 2 and len(r["assessment_ids"]) == 2 for r in rows)
