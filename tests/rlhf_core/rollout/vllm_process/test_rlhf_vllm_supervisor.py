"""The vLLM server's supervisor (rlhf_core/rollout/vllm_process/rlhf_vllm_supervisor.py): when the process that
started it dies, SIGKILL included, the server and the processes it started go within seconds. The server itself is
stood in for by a Python process that starts a `sleep` (vLLM's engine core); the real server's start and stop are
tests/rlhf_core/rollout/test_vllm_server.py's."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from rlhf_core.rollout.vllm_server import SUPERVISOR, group_alive


@pytest.mark.slow  # processes of its own
def test_the_supervisor_stops_its_command_when_the_owner_is_killed(tmp_path):
    """The owner (here a short Python process) starts the supervisor as VllmServer does, then dies by SIGKILL;
    the supervised command and the process it started (vLLM's engine, here a sleep) go within seconds."""
    pids = tmp_path / "pids"
    command = [
        sys.executable,
        "-c",
        f"import os, subprocess, time; p = subprocess.Popen(['sleep', '300']); "
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{p.pid}}'); time.sleep(300)",
    ]
    owner_code = (
        "import os, subprocess, sys, time; "
        f"s = subprocess.Popen([sys.executable, {str(SUPERVISOR)!r}, str(os.getpid()), *{command!r}], "
        "start_new_session=True); print(s.pid, flush=True); time.sleep(300)"
    )
    owner = subprocess.Popen([sys.executable, "-c", owner_code], stdout=subprocess.PIPE, text=True)
    group = int(owner.stdout.readline())
    deadline = time.monotonic() + 30
    while not (pids.is_file() and pids.read_text().count(" ") == 1) and time.monotonic() < deadline:
        time.sleep(0.1)
    server_pid, engine_pid = map(int, pids.read_text().split())
    assert {group, server_pid, engine_pid} <= set(group_alive(group))  # the supervisor leads their group
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    deadline = time.monotonic() + 20
    while group_alive(group) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert group_alive(group) == []  # none of the three runs (a zombie nothing reaps here does not count)


def test_the_modules_the_vllm_environment_runs_import_nothing_of_this_repository():
    """vllm_process/ is on the server's PYTHONPATH in the vLLM environment, where rlhf_core's dependencies (our
    transformers among them) are not installed: its modules import the standard library, torch and vllm only."""
    import ast

    for module in SUPERVISOR.parent.glob("*.py"):
        tree = ast.parse(module.read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        roots = {name.split(".")[0] for name in imported}
        assert roots <= set(sys.stdlib_module_names) | {"torch", "vllm"}, f"{module.name} imports {roots}"
