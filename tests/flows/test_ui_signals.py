"""`make ui` stopped as a terminal (Ctrl-C's SIGINT to its process group) or a service manager (SIGTERM to the
group, once or again and again) stops it, while its pipeline run is still going: make exits, both ports are
closed, and no process it started is left (the servers, the run, their children).

`make` runs from tmp_path with the repository's Makefile (`-f`, `VENV=` the repository's, `-o venv`: the
environment is not rebuilt), so `rlhf ui` writes its ./mlflow.db and ./.rlhf-ui there; UI_ARGS gives it free
ports, configs/smoke.yaml with a run.output_dir under tmp_path, and an SFT stage long enough to still be
running when the signal comes."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from flows.ui import Stopper
from tests.fixtures.prefect_db import premigrated_home
from tests.fixtures.servers import MLFLOW_ENV, free_port

REPO = Path(__file__).resolve().parents[2]
VENV = Path(sys.executable).parent.parent
START_S = 150  # both servers answering and the run's MLflow run RUNNING, on 2 busy cores
STOP_S = 45  # make's exit after the signal: the run stopped (it ends its MLflow runs), then both servers
# between repeated signals: all of them within the cleanup, which took 1.5 s once here (0.5 s apart, the fourth
# signal found make gone)
SIGNAL_GAP_S = 0.1


def make_ui(tmp_path: Path, mlflow_port: int, prefect_port: int) -> subprocess.Popen:
    """`make ui` in a process group of its own, as a shell starts a job, its output in tmp_path/make.log."""
    env = {k: v for k, v in os.environ.items() if k not in MLFLOW_ENV and not k.startswith("PREFECT_API_")}
    env.update(PYTHONUNBUFFERED="1", **premigrated_home(tmp_path / "prefect"))  # its database already migrated
    ui_args = [
        f"--mlflow-port {mlflow_port} --prefect-port {prefect_port} --config {REPO / 'configs' / 'smoke.yaml'}",
        f"--set run.output_dir={tmp_path / 'out'} --set sft.max_steps=100000 --set sft.log_steps=1000",
    ]
    command = ["make", "--no-print-directory", "-f", str(REPO / "Makefile"), "-o", "venv", "ui"]
    command += [f"VENV={VENV}", f"UI_ARGS={' '.join(ui_args)}"]
    with (tmp_path / "make.log").open("w") as log, interruptible():
        return subprocess.Popen(
            command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


@contextlib.contextmanager
def interruptible():
    """SIGINT handled (not ignored) in this process while a child starts, so that the child starts with SIGINT's
    default action, as a terminal's foreground job does. A test run started as a background job of a shell
    ignores SIGINT, every process below it inherits that, and `rlhf ui` keeps a signal ignored from its start
    ignored (as `nohup` means it): Ctrl-C would then stop nothing."""
    previous = signal.getsignal(signal.SIGINT)
    if previous == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of a process, None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1]), int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """Every process below `root` (reparented ones are missed: taken while all are still running), with its
    start time, so that a pid taken by a new process later is not mistaken for it."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        stat = proc_stat(int(entry.name)) if entry.name.isdigit() else None
        if stat is not None:
            children.setdefault(stat[1], []).append(int(entry.name))
            starts[int(entry.name)] = stat[2]
    found, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = starts[child]
            todo.append(child)
    return found


def alive(pid: int, start: int) -> bool:
    stat = proc_stat(pid)
    return stat is not None and stat[2] == start and stat[0] not in ("Z", "X")


def listener(port: int) -> int | None:
    """The pid of the process listening on 127.0.0.1:`port` (read from /proc, for processes of this user)."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == f"0100007F:{port:04X}" and fields[3] == "0A":  # LISTEN
            inodes.add(f"socket:[{fields[9]}]")
    for entry in Path("/proc").iterdir():
        try:
            fds = list((entry / "fd").iterdir()) if entry.name.isdigit() else []
            if any(os.readlink(fd) in inodes for fd in fds):
                return int(entry.name)
        except OSError:
            continue
    return None


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def statuses(tmp_path: Path) -> list[str]:
    """The status of each MLflow run in ./mlflow.db, the store `rlhf ui` serves."""
    db = tmp_path / "mlflow.db"
    if not db.is_file():
        return []
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as conn:
        try:
            return [row[0] for row in conn.execute("SELECT status FROM runs")]
        except sqlite3.OperationalError:  # the server is still creating its tables
            return []


def wait_up(make: subprocess.Popen, tmp_path: Path, ports: tuple[int, int], run_under_way: bool) -> None:
    """Until both servers answer and, with `run_under_way`, the run's MLflow run is RUNNING (its flow is going)."""
    deadline = time.monotonic() + START_S
    urls = (f"http://127.0.0.1:{ports[0]}/health", f"http://127.0.0.1:{ports[1]}/api/health")
    while not (all(answers(url) for url in urls) and (not run_under_way or "RUNNING" in statuses(tmp_path))):
        assert make.poll() is None, (tmp_path / "make.log").read_text()
        assert time.monotonic() < deadline, (tmp_path / "make.log").read_text()
        time.sleep(1)


# the signals to make's group, and whether to wait for the run's flow to be under way first (about 30 s more
# here, so in one case; the others signal once both servers answer, as the run starts). A SIGTERM to `rlhf ui`
# alone: tests/flows/test_ui.py
CASES = {
    "sigterm": ([signal.SIGTERM], False),
    "sigterm-again-during-cleanup-with-the-flow-under-way": ([signal.SIGTERM] * 4, True),
    "ctrl-c": ([signal.SIGINT], False),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_make_ui_stops_both_servers_and_the_run(tmp_path, case):
    signals, run_under_way = CASES[case]
    ports = free_port(), free_port()
    make = make_ui(tmp_path, *ports)
    try:
        wait_up(make, tmp_path, ports, run_under_way)
        started = descendants(make.pid)
        servers = [listener(port) for port in ports]
        assert all(pid in started for pid in servers), (servers, started)  # what is checked below holds them
        sent = time.monotonic()
        for signum in signals:
            assert make.poll() is None  # each arrives while `rlhf ui` stops the run and the servers
            os.killpg(make.pid, signum)
            time.sleep(SIGNAL_GAP_S)
        try:
            code = make.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"make did not exit within {STOP_S} s of the signal\n{(tmp_path / 'make.log').read_text()}")
        stopped_s = time.monotonic() - sent
    finally:
        if make.poll() is None:  # and what `rlhf ui` did not stop: its servers and the run, each in a group of its own
            for group in (make.pid, *descendants(make.pid)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(group, signal.SIGKILL)
    log = (tmp_path / "make.log").read_text()
    left = [pid for pid, start in started.items() if alive(pid, start)]
    assert not left, f"left running: {left}\n{log}"
    for port in ports:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    assert "Traceback" not in log, log  # no second signal cut `rlhf ui`'s cleanup short
    assert code == -signals[0], log  # make ends by the signal, once `rlhf ui` has ended
    # the run was stopped while the MLflow server was up: its MLflow runs ended (KILLED), none left RUNNING
    assert "RUNNING" not in statuses(tmp_path), (statuses(tmp_path), log)
    assert not run_under_way or "KILLED" in statuses(tmp_path), (statuses(tmp_path), log)
    print(f"{case}: make exited {stopped_s:.1f} s after the first signal")


def test_the_first_signal_interrupts_and_later_ones_are_ignored():
    stopper = Stopper()
    with pytest.raises(KeyboardInterrupt):
        stopper.on_signal(signal.SIGTERM, None)
    stopper.on_signal(signal.SIGTERM, None)  # during the cleanup: returns, the cleanup goes on
    stopper.on_signal(signal.SIGINT, None)


@pytest.mark.slow  # a process of its own
def test_a_signal_while_a_process_starts_is_raised_once_it_is_recorded(monkeypatch):
    stopper = Stopper()
    real_popen = subprocess.Popen

    def popen_signalled_meanwhile(*args, **kwargs):
        proc = real_popen(*args, **kwargs)
        stopper.on_signal(signal.SIGTERM, None)  # arrives between the fork and the bookkeeping
        return proc

    monkeypatch.setattr(subprocess, "Popen", popen_signalled_meanwhile)
    with pytest.raises(KeyboardInterrupt):
        stopper.start([sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ))
    assert len(stopper.procs) == 1  # recorded, so the cleanup stops it
    stopper.stop_all()
    assert stopper.procs[0][0].returncode == -signal.SIGTERM
