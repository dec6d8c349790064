"""BackgroundJobs: one thread, submission order, transient failures retried, the first lasting failure stops the rest."""

import threading
import time

import pytest

from tasks.reporting.background import BackgroundJobs, NotRun


def jobs(**kw) -> BackgroundJobs:
    return BackgroundJobs("test-jobs", backoff_s=0.01, **kw)


def test_jobs_run_in_submission_order_on_one_thread_beside_the_caller():
    worker, seen = jobs(), []
    gate = threading.Event()
    first = worker.submit(lambda: gate.wait(5) and seen.append((1, threading.current_thread().name)), "one")
    futures = [first] + [
        worker.submit(lambda i=i: seen.append((i, threading.current_thread().name)), f"#{i}") for i in (2, 3)
    ]
    assert worker.pending == 3 and seen == []  # submit returned while the first job waits
    gate.set()
    worker.wait()
    assert [i for i, _ in seen] == [1, 2, 3]
    assert len({name for _, name in seen}) == 1 and seen[0][1] != threading.current_thread().name
    assert all(f.done() for f in futures) and worker.pending == 0
    worker.close()


def test_a_transient_failure_is_retried_until_it_passes():
    worker, calls = jobs(attempts=3), []

    def flaky():
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise ConnectionError("tracking server unreachable")
        return "models:/p/1"

    assert worker.submit(flaky, "flaky").result(timeout=10) == "models:/p/1"
    assert len(calls) == 3
    assert calls[1] - calls[0] >= 0.01 and calls[2] - calls[1] >= 0.02  # exponential back-off
    worker.wait()


def test_a_lasting_failure_stops_the_later_jobs_and_is_raised_to_the_caller_as_it_was():
    worker, ran, gate = jobs(attempts=2), [], threading.Event()

    def broken():
        gate.wait(5)
        raise ValueError("bad tag value")  # not transient: tried once

    def down():
        ran.append("down")
        raise ConnectionError("still down")

    failing = worker.submit(broken, "broken")
    later = worker.submit(lambda: ran.append("later"), "later")
    gate.set()
    with pytest.raises(ValueError, match="bad tag value"):
        worker.wait()
    assert isinstance(later.exception(), NotRun) and ran == []
    assert isinstance(failing.exception(), ValueError)
    with pytest.raises(ValueError, match="bad tag value"):  # the training thread learns at its next checkpoint
        worker.submit(lambda: ran.append("after"), "after")

    retried = jobs(attempts=2)
    retried.submit(down, "down")
    with pytest.raises(ConnectionError, match="still down"):
        retried.wait()
    assert ran == ["down", "down"]


def test_cancel_drops_the_jobs_not_started_and_lets_the_running_one_finish():
    worker, seen = jobs(), []
    started, gate = threading.Event(), threading.Event()

    def running():
        started.set()
        gate.wait(5)
        seen.append("running finished")

    worker.submit(running, "running")
    queued = worker.submit(lambda: seen.append("queued"), "queued")
    started.wait(5)
    threading.Timer(0.05, gate.set).start()
    worker.cancel()
    assert seen == ["running finished"] and queued.cancelled()
    worker.close()
