import requests
from mlflow.exceptions import MlflowException

from tasks.runtime.retry import is_transient


def test_only_connection_failures_and_timeouts_are_transient():
    assert is_transient(ConnectionError("Connection refused"))
    assert is_transient(TimeoutError())
    assert is_transient(requests.ConnectionError("boom"))
    wrapped = MlflowException(
        "API request to http://mlflow:5000/api/2.0/mlflow/runs/log-batch failed with exception "
        "HTTPConnectionPool(host='mlflow', port=5000): Max retries exceeded with url"
    )
    assert is_transient(wrapped)
    try:
        try:
            raise ConnectionResetError("reset")
        except ConnectionResetError as inner:
            raise RuntimeError("log_batch failed") from inner
    except RuntimeError as outer:
        assert is_transient(outer)  # found down the chain
    assert not is_transient(ValueError("data.preference.path: prefs.jsonl does not exist"))
    assert not is_transient(MlflowException("RESOURCE_DOES_NOT_EXIST: model version 9"))
    assert not is_transient(FileNotFoundError("x"))
