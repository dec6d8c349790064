"""deployments/slurm/rlhf-ray.sbatch, run by bash against stand-ins for srun, scontrol, hostname, ray, python (the
readiness check) and rlhf that write what they were asked into a log: a simulated job of two nodes, n1 (where the
script runs) and n2. The script must start one Ray node per SLURM node with the step's CPUs and GPUs and the node's
own address, wait for the head and then for every node, run the flow against the head's address, and stop Ray on
every node however it ends: done, failed, not ready in time, or cancelled. No SLURM and no Ray run here.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "deployments" / "slurm" / "rlhf-ray.sbatch"
NODES = ("n1", "n2")
IPS = {"n1": "198.51.100.1", "n2": "198.51.100.2"}  # documentation addresses: only written, never reached
HEAD = "198.51.100.1:6379"
pytestmark = pytest.mark.slow  # bash runs the job script and its stand-ins: processes of their own

STUBS = {
    # srun: runs the command on the node -w names, or once on every node of the job
    "srun": r"""
opts=() node=
while (($#)); do
  case $1 in
    -w) node=$2; opts+=("-w $2"); shift 2 ;;
    -*) opts+=("$1"); shift ;;
    *) break ;;
  esac
done
echo "srun ${opts[*]} :: $*" >>"$STUB_LOG"
if [[ -n $node ]]; then STUB_NODE=$node exec "$@"; fi
for n in $STUB_NODES; do STUB_NODE=$n "$@"; done
""",
    "scontrol": 'printf "%s\\n" $STUB_NODES\n',
    "hostname": '[[ $1 == -I ]] && echo "${STUB_IPS[$STUB_NODE]} fd00::1" || echo "$STUB_NODE"\n',
    # `ray start` takes SIGTERM from its first line: a job that fails at once (a node never joins, timeout 0) may
    # end the step between the log line and a later trap, and bash's default would end it without a word (CI, once)
    "ray": r"""
[[ $1 == start ]] && trap 'echo "ray@$STUB_NODE ended" >>"$STUB_LOG"; exit 0' TERM
echo "ray@${STUB_NODE:-batch} $* (auth $RAY_AUTH_MODE ${RAY_AUTH_TOKEN:+token})" >>"$STUB_LOG"
case $1 in
  start) exec </dev/null >/dev/null 2>&1; echo $$ >"$STUB_DIR/ray-$STUB_NODE.pid"
    while :; do sleep 0.1; done ;;
  stop) [[ -f $STUB_DIR/ray-$STUB_NODE.pid ]] && kill "$(<"$STUB_DIR/ray-$STUB_NODE.pid")" 2>/dev/null; exit 0 ;;
  health-check) exit "${STUB_HEAD_UP:-0}" ;;
esac
""",
    # the readiness check: joined (STUB_JOINED 0) once every node's `ray start` is up (its pid file written), as
    # Ray's own check waits for the nodes; on a loaded machine the job could otherwise end before a node started
    "python": r"""
cat >/dev/null; echo "python $*" >>"$STUB_LOG"
if [[ ${STUB_JOINED:-0} == 0 ]]; then
  for n in $STUB_NODES; do for _ in {1..200}; do [[ -s $STUB_DIR/ray-$n.pid ]] && break; sleep 0.05; done; done
fi
exit "${STUB_JOINED:-0}"
""",
    "rlhf": r"""
echo "rlhf $* (auth $RAY_AUTH_MODE ${RAY_AUTH_TOKEN:+token}, mlflow ${MLFLOW_TRACKING_PASSWORD:+password})" >>"$STUB_LOG"
trap 'echo "rlhf terminated" >>"$STUB_LOG"; exit 143' TERM
[[ -n ${STUB_RLHF_WAIT:-} ]] && while :; do sleep 0.1; done
exit "${STUB_RLHF_STATUS:-0}"
""",
}


def stage(tmp: Path, script: Path = SCRIPT, **env: str) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a simulated job whose stand-ins live in tmp."""
    bin_dir, venv = tmp / "bin", tmp / "venv" / "bin"
    bin_dir.mkdir()
    venv.mkdir(parents=True)
    ips = " ".join(f"[{n}]={ip}" for n, ip in IPS.items())
    for name, body in STUBS.items():
        (bin_dir / name).write_text(f"#!/bin/bash\ndeclare -A STUB_IPS=({ips})\n{body}")
        (bin_dir / name).chmod(0o755)
    (venv / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    (tmp / "token").write_text("a-token")
    base = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp),
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_CPUS_PER_TASK": "8",
        "SLURM_GPUS_PER_NODE": "a100:4",
        "SLURMD_NODENAME": "n1",
        "SLURM_SUBMIT_DIR": str(tmp),
        "RLHF_VENV": str(tmp / "venv"),
        "RAY_AUTH_TOKEN_FILE": str(tmp / "token"),
        "MLFLOW_TRACKING_PASSWORD": "secret",
        "STUB_LOG": str(tmp / "log"),
        "STUB_DIR": str(tmp),
        "STUB_NODES": " ".join(NODES),
    }
    env = {k: v for k, v in {**base, **env}.items() if v is not None}
    return ["bash", str(script), "configs/my-run.yaml", "/shared/runs/my-run"], env


def run_job(tmp: Path, script: Path = SCRIPT, cancel: bool = False, **env: str) -> tuple[int, str, list[str]]:
    """Run the script to its end (or SIGTERM it, as scancel does, once the flow runs): exit code, stderr, log."""
    command, environment = stage(tmp, script, **env)
    job = subprocess.Popen(command, env=environment, stderr=subprocess.PIPE, text=True)
    if cancel:
        deadline = time.monotonic() + 20
        while "rlhf run" not in read_log(tmp) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # the script has taken the flow's process id by then
        job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=60)
    time.sleep(0.2)  # a stand-in the script signalled writes its last line
    return job.returncode, err, read_log(tmp).splitlines()


def read_log(tmp: Path) -> str:
    log = tmp / "log"
    return log.read_text() if log.exists() else ""


def first(log: list[str], pattern: str) -> int:
    """The index of the first log line that matches, or -1."""
    return next((i for i, line in enumerate(log) if re.search(pattern, line)), -1)


def stop_problems(log: list[str], tmp: Path) -> list[str]:
    """Every `ray start` ended (the workers' before the head's), `ray stop` on every node, all after the flow."""
    started = [n for n in NODES if first(log, rf"^ray@{n} start") >= 0]
    problems = [f"no `ray stop` on {n}" for n in NODES if first(log, rf"^ray@{n} stop") < 0]
    problems += [f"the `ray start` of {n} was not ended" for n in started if first(log, rf"^ray@{n} ended") < 0]
    if len(started) == len(NODES) and first(log, "^ray@n1 ended") < first(log, "^ray@n2 ended"):
        problems.append("the head's node ended before the worker's")
    flow = max((i for i, line in enumerate(log) if line.startswith("rlhf")), default=-1)
    if any(0 <= first(log, rf"^ray@{n} (ended|stop)") < flow for n in NODES):
        problems.append("Ray stopped before the flow ended")
    for pid_file in tmp.glob("ray-*.pid"):
        try:
            os.kill(written_pid(pid_file), signal.SIGKILL)
        except ProcessLookupError:
            continue
        problems.append(f"a `ray start` was still running ({pid_file.name})")
    return problems


def written_pid(pid_file: Path, timeout_s: float = 5.0) -> int:
    """The pid the stand-in `ray start` wrote: `echo $$ >file` empties the file before it writes, so a `ray start`
    caught in between has an empty file for a moment (seen once in CI: int('') failed)."""
    deadline = time.monotonic() + timeout_s
    while not (text := pid_file.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return int(text)


def start_problems(log: list[str]) -> list[str]:
    """One Ray node per SLURM node, on the step's CPUs and GPUs at the node's own address, ready before the flow."""
    expected = {
        "head step": r"^srun .*--cpus-per-task=8 --gpus-per-task=4 -w n1 :: ray start --head",
        "head": rf"^ray@n1 start --head --port=6379 --node-ip-address={IPS['n1']} --num-cpus=8 --num-gpus=4 --block "
        r"\(auth token token\)",
        "head ready": rf"^ray@batch health-check --address {HEAD}",
        "worker step": r"^srun .*--cpus-per-task=8 --gpus-per-task=4 -w n2 :: ray start --address",
        "worker": rf"^ray@n2 start --address={HEAD} --node-ip-address={IPS['n2']} --num-cpus=8 --num-gpus=4 --block",
        "all joined": rf"^python - {HEAD} 2$",
        "flow": rf"^rlhf run --config configs/my-run.yaml --set run.launcher=ray --set run.ray_address={HEAD} "
        r"--set run.device=cuda --set run.num_processes=8 --set run.output_dir=/shared/runs/my-run "
        r"\(auth token token, mlflow password\)",
    }
    at = {what: first(log, pattern) for what, pattern in expected.items()}
    problems = [f"no {what} in the log" for what, i in at.items() if i < 0]
    # what the script does one after the other (the `ray start` steps run beside it)
    order = [("head ready", "worker step"), ("head ready", "all joined"), ("all joined", "flow")]
    return problems + [f"{b} before {a}" for a, b in order if min(at[a], at[b]) >= 0 and at[b] < at[a]]


def test_a_job_starts_a_node_per_slurm_node_runs_the_flow_and_stops_every_node(tmp_path):
    code, err, log = run_job(tmp_path)
    assert code == 0, err
    problems = start_problems(log) + stop_problems(log, tmp_path)
    assert not problems, "\n".join(problems + log)


ENDINGS = {
    "the flow fails": ({"STUB_RLHF_STATUS": "3"}, 3, "", True),
    "the head never answers": (
        {"STUB_HEAD_UP": "1", "RAY_READY_TIMEOUT_S": "0"},
        1,
        f"the Ray head at {HEAD} not up",
        False,
    ),
    "a node never joins": ({"STUB_JOINED": "1", "RAY_READY_TIMEOUT_S": "0"}, 1, "2 Ray nodes not up", False),
}


@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_ray_stops_on_every_node_however_the_job_ends(tmp_path, ending):
    env, expected_code, message, flow_ran = ENDINGS[ending]
    code, err, log = run_job(tmp_path, **env)
    assert code == expected_code, err
    assert message in err
    assert (first(log, r"^rlhf run") >= 0) == flow_ran, log
    assert not stop_problems(log, tmp_path), log


def test_scancel_stops_the_flow_and_every_node(tmp_path):
    code, _, log = run_job(tmp_path, cancel=True, STUB_RLHF_WAIT="1")
    assert code == 143
    assert first(log, "^rlhf terminated") >= 0, log
    assert not stop_problems(log, tmp_path), log


MISSING = {
    "no Ray token": ({"RAY_AUTH_TOKEN_FILE": "/nowhere/auth_token"}, "ray get-auth-token --generate"),
    "no --cpus-per-task": ({"SLURM_CPUS_PER_TASK": None}, "--cpus-per-task"),
    "no --gpus-per-node": ({"SLURM_GPUS_PER_NODE": None}, "--gpus-per-node"),
}


@pytest.mark.parametrize("case", sorted(MISSING))
def test_a_job_without_what_it_needs_stops_before_any_step(tmp_path, case):
    env, message = MISSING[case]
    code, err, log = run_job(tmp_path, **env)
    assert code != 0 and message in err, err
    assert first(log, "^srun") < 0, log


BREAKS = {
    "no trap": ("trap stop_ray EXIT\n", "", "no `ray stop`"),
    "no CPUs for the steps": ('--cpus-per-task="$cpus" ', "", "no head step"),
    "a fixed sleep for readiness": ('wait_for "$SLURM_JOB_NUM_NODES Ray nodes" all_joined', "sleep 0", "no all joined"),
    "the loopback address": ("hostname -I | awk '{print $1}'", "echo 127.0.0.1", "no head in the log"),
}


@pytest.mark.parametrize("case", sorted(BREAKS))
def test_the_checks_catch_a_broken_script(tmp_path, case):
    old, new, expected = BREAKS[case]
    text = SCRIPT.read_text()
    assert old in text, f"the script no longer holds {old!r}: update this case"
    script = tmp_path / "broken.sbatch"
    script.write_text(text.replace(old, new))
    _, _, log = run_job(tmp_path, script)
    problems = start_problems(log) + stop_problems(log, tmp_path)
    assert any(expected in p for p in problems), problems
