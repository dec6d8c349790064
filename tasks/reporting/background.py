"""Work that runs beside training: one thread, jobs in the order they were given, transient failures retried.

A stage's reporter (tasks/reporting/reporter.py) runs two: its metrics writer's writes the metrics and progress
each step logs, its registrar's logs and registers each checkpoint the training loop saves, while training goes on. Jobs run one
at a time in submission order, so metrics are written and versions created in step order. A transient
failure (tasks/runtime/retry.py `is_transient`) is retried with exponential back-off; the first failure that
stays stops the rest: the later jobs are not run, and the next `submit` and `wait` raise that failure
in the caller's thread, as it was raised.

Each job runs in a copy of the submitting thread's context (Prefect's run context with it, so its
logger works there).
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from tasks.runtime.retry import is_transient

T = TypeVar("T")
logger = logging.getLogger(__name__)


class NotRun(RuntimeError):
    """A job that was not run because an earlier one failed or the jobs were cancelled."""


class BackgroundJobs:
    """A single worker thread. `attempts` tries per job for transient failures, waiting backoff_s, 2x, 4x ... between."""

    attempts = 4
    backoff_s = 1.0

    def __init__(self, name: str, *, attempts: int | None = None, backoff_s: float | None = None):
        self.name = name
        self.attempts = self.attempts if attempts is None else attempts
        self.backoff_s = self.backoff_s if backoff_s is None else backoff_s
        self._pool: ThreadPoolExecutor | None = None
        self._futures: list[Future] = []
        self._failure: BaseException | None = None
        self._stopping = threading.Event()

    def submit(self, job: Callable[[], T], what: str) -> Future:
        """Queue `job` (`what` names it in messages) and return its Future; raises an earlier job's failure."""
        self.raise_failure()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.name)
        self._futures = [f for f in self._futures if not f.done()]  # a finished job's failure is kept by _run
        future = self._pool.submit(contextvars.copy_context().run, self._run, job, what)
        self._futures.append(future)
        return future

    def submitted(self) -> list[Future]:
        """The Futures of the jobs submitted so far and not yet seen finished (for `wait_for` on another thread)."""
        return list(self._futures)

    @staticmethod
    def wait_for(futures: list[Future]) -> None:
        """Block until `futures` are done; raise the first failure among them."""
        for future in futures:
            future.result()

    @property
    def pending(self) -> int:
        """Jobs submitted and not finished."""
        return sum(not f.done() for f in self._futures)

    def wait(self) -> None:
        """Block until every submitted job has finished; raise the first failure."""
        for future in self._futures:
            future.exception()  # waits; the failure itself is kept by _run
        self._futures = [f for f in self._futures if not f.done()]
        self.raise_failure()

    def cancel(self) -> None:
        """Drop the jobs not started and wait for the running one (a job is never cut off half-way)."""
        self._stopping.set()
        for future in self._futures:
            future.cancel()
        for future in self._futures:
            if not future.cancelled():
                future.exception()
        self._futures = []

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _run(self, job: Callable[[], T], what: str) -> T:
        attempt = 1
        while True:
            if self._failure is not None:
                raise NotRun(f"{what} was not run: an earlier job of {self.name} failed ({self._failure})")
            if self._stopping.is_set():
                raise NotRun(f"{what} was not run: {self.name} was cancelled")
            try:
                return job()
            except Exception as err:
                if attempt == self.attempts or not is_transient(err):
                    self._failure = err
                    raise
                delay = self.backoff_s * 2 ** (attempt - 1)
                logger.warning("%s failed (%s); try %d of %d in %.0f s", what, err, attempt + 1, self.attempts, delay)
                attempt += 1
                self._stopping.wait(delay)
            except BaseException as err:
                self._failure = err
                raise
