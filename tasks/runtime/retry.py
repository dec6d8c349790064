"""Retrying tasks when the failure is transient I/O (a tracking server briefly unreachable), never on user errors.

Every pipeline task carries IO_RETRIES: up to three retries with exponential back-off, only when
the exception (or one it was raised from) is a connection failure or a timeout. Training tasks
resume from their last checkpoint and registration is idempotent, so a retry repeats no work.
"""

from __future__ import annotations

from typing import Any

from prefect.tasks import exponential_backoff

TRANSIENT_MESSAGES = (
    "Connection refused",
    "Max retries exceeded",
    "Connection reset",
    "Temporary failure in name resolution",
    "timed out",
    "Remote end closed connection",
    "503 Service Unavailable",
    "502 Bad Gateway",
)


def is_transient(error: BaseException) -> bool:
    """A connection error or timeout, or an MLflow/HTTP error caused by one (its chain is walked)."""
    import requests

    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, (ConnectionError, TimeoutError, requests.ConnectionError, requests.Timeout)):
            return True
        if type(error).__name__ == "MlflowException" and any(m in str(error) for m in TRANSIENT_MESSAGES):
            return True
        error = error.__cause__ or error.__context__
    return False


def retry_on_transient_io(task, task_run, state) -> bool:
    """Prefect's retry_condition_fn: retry only transient I/O failures."""
    try:
        state.result()
    except Exception as err:  # the task's exception, re-raised by result()
        return is_transient(err)
    return False


IO_RETRIES: dict[str, Any] = {
    "retries": 3,
    "retry_delay_seconds": exponential_backoff(backoff_factor=5),  # 5, 10, 20 s
    "retry_jitter_factor": 0.5,
    "retry_condition_fn": retry_on_transient_io,
}
