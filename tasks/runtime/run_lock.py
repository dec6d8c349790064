"""One writer per run directory, and SIGTERM as an interruption the pipeline's `with` blocks see.

`run_lock(output_dir)` holds an OS file lock (`filelock`, flock on POSIX) on `<output_dir>/.rlhf-run.lock`
for the whole flow, with `<output_dir>/.rlhf-run.json` beside it naming the holder (host, pid, start
time). A second run on the same directory stops at once with `RunLockedError`, one sentence naming
the holder. The OS releases the lock when its process dies, however it dies, so the lock of a killed
run is taken over by the next one, which rewrites the holder file. Limit: flock across machines is
as good as the shared filesystem's support for it (NFS and most cluster filesystems have it, some
FUSE filesystems do not).

`terminate_on_sigterm()` makes SIGTERM raise `Terminated` (a SystemExit with status 143) while it is
active, so that the MLflow runs end KILLED and the lock is released instead of the process dying
mid-write. Inside a Prefect flow run Prefect's engine has already installed such a bridge (raising
its TerminationSignal); it is then left in place.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

from rlhf_core.storage.ownership import OwnershipError

LOCK_FILE = ".rlhf-run.lock"
HOLDER_FILE = ".rlhf-run.json"


class RunLockedError(OwnershipError):
    """Another pipeline run holds the run directory (an OwnershipError, so the CLI prints one sentence, exit 2)."""


class Terminated(SystemExit):
    """Raised by the SIGTERM handler of `terminate_on_sigterm`; uncaught, the process exits 143."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(128 + signum)
        self.signum = signum


def holder_info() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def read_holder(output_dir: str | Path) -> dict | None:
    try:
        data = json.loads((Path(output_dir) / HOLDER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@contextmanager
def run_lock(output_dir: str | Path) -> Iterator[dict]:
    """Hold the run directory for this process; raise RunLockedError at once when another run holds it.

    Yields the holder document written beside the lock. The directory must exist (check_pipeline_outputs
    creates and marks it).
    """
    directory = Path(output_dir)
    lock = FileLock(str(directory / LOCK_FILE), blocking=False)
    try:
        lock.acquire()
    except Timeout:
        holder = read_holder(directory) or {}
        raise RunLockedError(
            f"run.output_dir {directory} is in use by another pipeline run (host {holder.get('host', 'unknown')}, "
            f"pid {holder.get('pid', 'unknown')}, started {holder.get('started_at', 'at an unknown time')}); "
            "wait for it to end or choose another run.output_dir"
        ) from None
    holder_path = directory / HOLDER_FILE
    try:
        holder = holder_info()
        tmp = holder_path.with_name(f"{HOLDER_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(holder) + "\n")
        os.replace(tmp, holder_path)  # a reader sees the old holder or the new one, never half of one
        yield holder
    finally:
        try:
            holder_path.unlink(missing_ok=True)
        finally:
            lock.release()


def _raise_terminated(signum, frame):
    raise Terminated(signum)


@contextmanager
def terminate_on_sigterm() -> Iterator[None]:
    """While active, SIGTERM raises `Terminated` (unless another handler, such as Prefect's, is installed)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous not in (signal.SIG_DFL, None):
        yield  # someone (Prefect's flow engine) already turns SIGTERM into an exception
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
