import logging
import os

import pytest

from tasks import tracking

SECRET = "S3cr3t-xyz"
ENV = (
    "MLFLOW_TRACKING_URI",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT",
)


@pytest.fixture
def mlflow_env(monkeypatch):
    for key in ENV:
        monkeypatch.setenv(key, "x")  # recorded, so that what configure sets is undone
        monkeypatch.delenv(key)
    monkeypatch.setattr(tracking.store, "_suppressed_by_us", False)
    yield
    import mlflow

    mlflow.set_tracking_uri(None)


def test_configure_moves_a_user_and_password_into_mlflows_variables(mlflow_env):
    import mlflow

    tracking.store.configure(f"http://alice:a/{SECRET}@127.0.0.1:1")
    assert mlflow.get_tracking_uri() == "http://127.0.0.1:1"
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "alice" and os.environ["MLFLOW_TRACKING_PASSWORD"] == f"a/{SECRET}"
    assert "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT" not in os.environ


def test_configure_suppresses_mlflows_run_links_for_a_secret_that_cannot_move(mlflow_env):
    tracking.store.configure(f"http://{SECRET}@127.0.0.1:1")
    assert os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] == "true"
    tracking.store.configure("http://127.0.0.1:1")
    assert "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT" not in os.environ


def test_log_records_and_their_tracebacks_are_redacted(caplog):
    logger = logging.getLogger("some.library")
    with caplog.at_level(logging.INFO):
        logger.info("request to %s failed", f"http://u:{SECRET}@h/api")
        try:
            raise ConnectionError(f"cannot reach http://{SECRET}@h?token={SECRET}")
        except ConnectionError:
            logger.exception("retrying")
    text = caplog.text
    assert "http://u:***@h/api" in text and "http://***@h?token=***" in text
    assert SECRET not in text
