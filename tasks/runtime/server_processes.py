"""The server processes a run (or a test) starts on a loopback port: wait until one answers, stop its process
group. They import neither Prefect nor MLflow, so `rlhf ui` and a stage use them alike."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

START_TIMEOUT_S = 120.0


def wait_healthy(
    proc: subprocess.Popen, url: str, what: str, log: Path | None = None, timeout_s: float = START_TIMEOUT_S
) -> None:
    """Return once `url` answers 200; raise when `proc` exits first (naming its log's last line) or after
    `timeout_s`. The servers `rlhf ui` starts, and those the tests start, wait on it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-600:].strip().splitlines() if log else []
            where = f"; see {log}" if log else ""
            raise RuntimeError(
                f"the {what} exited at start (exit {proc.returncode}: {tail[-1] if tail else 'no output'}{where})"
            )
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"the {what} did not answer {url} within {timeout_s:.0f} s")


def stop_group(proc: subprocess.Popen, grace_s: float = 20) -> None:
    """SIGTERM to the process group a server was started in (start_new_session), SIGKILL after `grace_s`."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
