"""tests/fixtures/leftovers.py, the check `make test` runs after pytest: a process that carries the run's mark is
found whatever it calls itself, and one that ends in time, or carries another run's mark, is not."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.fixtures.leftovers import MARK, left, main, marked

pytestmark = pytest.mark.slow  # processes of its own


def sleeper(run: str, seconds: float) -> subprocess.Popen:
    """A Python process that renames itself (as Ray's and vLLM's do) and sleeps, with the mark of `run`."""
    script = f"import sys, time; sys.argv[0] = 'ray::IDLE'; time.sleep({seconds})"
    return subprocess.Popen([sys.executable, "-c", script], env={**os.environ, MARK: run})


def test_a_marked_process_is_found_and_killed_and_fails_the_run(capsys):
    run, other = f"left-{os.getpid()}", f"other-{os.getpid()}"
    kept, elsewhere = sleeper(run, 60), sleeper(other, 60)
    try:
        assert kept.pid in marked(run) and elsewhere.pid not in marked(run)
        assert main([run], grace_s=0.5) == 1
        assert kept.wait(timeout=10) == -9  # killed by the check
        assert f"{kept.pid}: " in capsys.readouterr().err
        assert marked(run) == {} and main([run], grace_s=0.5) == 0
    finally:
        for proc in (kept, elsewhere):
            proc.kill()
            proc.wait()


def test_a_process_that_ends_within_the_grace_is_not_a_leftover():
    run = f"ending-{os.getpid()}"
    ending = sleeper(run, 1)
    try:
        assert left(run, grace_s=20) == {}
    finally:
        ending.wait()
