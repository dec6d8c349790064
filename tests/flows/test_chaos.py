"""Chaos: kill -9 the pipeline at random points, resume, and end exactly where an uninterrupted run ends.

Each attempt is `python -m flows.cli run -c configs/smoke.yaml` in its own process (and process group),
connected to the session's Prefect test server. A kill point is a line the pipeline prints (a Prefect
task's log line, an MLflow registration line) plus a random delay after it; the attempt is killed with
SIGKILL there, and the next attempt resumes on the same run directory and MLflow store. A trial kills
once in each of its stage groups, in pipeline order (reward training and its registrations, RL and its
registrations, export and its registration), then runs to completion. At the end of each trial:

- the exported weights (and the final reward model's) equal those of an uninterrupted run (CPU, same seed);
- every registered version's (stage, stage_key, step) appears exactly once, and the (stage, step) pairs
  are the uninterrupted run's;
- no MLflow run is RUNNING: a killed attempt's pipeline run was ended KILLED by the next start (or had
  ended FINISHED when the kill came after it);
- no hidden temporary directory is left anywhere in the run directory.

The short form (one trial, 2 kills) runs in `make test`; `make chaos` runs the long form (3 trials, 9 kills).
The random generator is seeded, so the kill points repeat; the kill points hit are printed (`pytest -s`).
"""

from __future__ import annotations

import collections
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

REPO = Path(__file__).resolve().parents[2]
SMOKE = "configs/smoke.yaml"
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]

# (group, regular expression of a line the pipeline prints); within a group in the order they appear
KILL_POINTS = {
    "reward": [
        r"Task run 'reward-[^']*' - ",
        r"reward eval at step 2",
        r"Successfully registered model 'smoke-reward-model'",
        r"reward checkpoint 2 is models:/",
        r"reward checkpoint 4 is models:/",
    ],
    "rl": [
        r"Task run 'init-[^']*' - Finished",
        r"Task run 'ppo-[^']*' - eval at step 0:",
        r"Task run 'ppo-[^']*' - eval at step 1:",
        r"ppo checkpoint 1 is models:/",
        r"Task run 'ppo-[^']*' - eval at step 2:",
        r"ppo checkpoint 2 is models:/",
    ],
    "export": [
        r"Task run 'ppo-[^']*' - Finished",
        r"Task run 'export-[^']*' - exported the ppo policy",
        r"is models:/smoke-policy/\d+, alias candidate",
        r"Task run 'export-[^']*' - Finished",
    ],
}
GROUPS = list(KILL_POINTS)
MAX_DELAY_S = 0.12  # after the marker line: well inside a stage of the smoke config
ATTEMPT_TIMEOUT_S = 240


def _env(prefect_api_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(
        PREFECT_API_URL=prefect_api_url,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    return env


def _command(root: Path, extra: tuple[str, ...] = ()) -> list[str]:
    sets = [a for s in extra for a in ("--set", s)]
    return [
        sys.executable,
        "-m",
        "flows.cli",
        "run",
        "-c",
        SMOKE,
        "--set",
        f"run.output_dir={root / 'out'}",
        "--set",
        f"tracking.uri=sqlite:///{root / 'mlflow.db'}",
        *sets,
    ]


def attempt(root: Path, env: dict[str, str], kill_at: tuple[str, float] | None = None, extra=()) -> dict:
    """Run the pipeline once (`extra`: more section.field=value overrides); with `kill_at` = (regex, delay), SIGKILL
    it `delay` s after a line matches."""
    proc = subprocess.Popen(
        _command(root, tuple(extra)),
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    lines: list[str] = []
    seen = threading.Event()
    pattern = re.compile(kill_at[0]) if kill_at else None

    def read() -> None:
        for line in proc.stdout:  # universal newlines: progress bars' \r splits lines too
            lines.append(line.rstrip())
            if pattern is not None and not seen.is_set() and pattern.search(line):
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    killed, last_line, last_log = False, "", ""
    deadline = time.monotonic() + ATTEMPT_TIMEOUT_S
    if kill_at is not None:
        while not seen.is_set() and proc.poll() is None and time.monotonic() < deadline:
            seen.wait(0.05)
        if seen.is_set():
            time.sleep(kill_at[1])
            if proc.poll() is None:
                last_line = next((line for line in reversed(lines) if line.strip()), "")
                last_log = next(
                    (line for line in reversed(lines) if " | INFO " in line or "Created version" in line), ""
                )
                os.killpg(proc.pid, signal.SIGKILL)
                killed = True
    try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(f"attempt ran past {ATTEMPT_TIMEOUT_S} s:\n" + "\n".join(lines[-40:])) from None
    reader.join(timeout=10)
    return {
        "returncode": proc.returncode,
        "killed": killed,
        "last_line": last_line[:160],
        "last_log": last_log[:200],
        "output": lines,
    }


def plan_trial(rng: random.Random, groups: list[str]) -> list[tuple[str, str, float]]:
    return [(g, rng.choice(KILL_POINTS[g]), round(rng.uniform(0.0, MAX_DELAY_S), 3)) for g in groups]


def hidden_dirs(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob(".*") if p.is_dir())


def describe_hidden(root: Path) -> str:
    """What a leftover hidden directory holds, and its marker (which process wrote it), for the failure message."""
    lines = []
    for name in hidden_dirs(root):
        path = root / name
        marker = path / ".rlhf-owned"
        text = marker.read_text()[:300] if marker.is_file() else "no marker"
        lines.append(f"{name}: {sorted(p.name for p in path.iterdir())} marker={text!r} (this pid {os.getpid()})")
    return "\n".join(lines)


def registered(uri: str) -> dict[str, list[tuple[str, str, str]]]:
    client = MlflowClient(uri, registry_uri=uri)
    found = {}
    for model in client.search_registered_models():
        versions = client.search_model_versions(f"name = '{model.name}'")
        assert all(v.status == "READY" for v in versions), [(v.version, v.status) for v in versions]
        found[model.name] = sorted((v.tags.get("stage"), v.tags.get("stage_key"), v.tags.get("step")) for v in versions)
    return found


def running_runs(uri: str) -> list[tuple[str, str]]:
    client = MlflowClient(uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, "attributes.status = 'RUNNING'", max_results=1000)
    return [(r.info.run_name, r.info.run_id) for r in runs]


def pipeline_run_statuses(uri: str) -> list[str]:
    """The statuses of the pipeline's (top-level) MLflow runs, oldest first."""
    client = MlflowClient(uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(
        experiments, "attributes.run_name LIKE 'smoke-ppo-seed7-%'", order_by=["attributes.start_time ASC"]
    )
    return [r.info.status for r in runs if "mlflow.parentRunId" not in r.data.tags]


def weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def assert_same_weights(actual: Path, expected: Path) -> None:
    import torch

    got, want = weights(actual), weights(expected)
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), f"{actual}: tensor {name} differs from the uninterrupted run's"


def final_reward_model(out: Path) -> Path:
    [path] = (out / "reward").glob("*/checkpoint-4/model.safetensors")
    return path


def run_chaos(tmp_path: Path, prefect_api_url: str, trials: list[list[str]], seed: int) -> list[dict]:
    env = _env(prefect_api_url)
    rng = random.Random(seed)
    reference = tmp_path / "reference"
    reference.mkdir()
    done = attempt(reference, env)
    assert done["returncode"] == 0, "\n".join(done["output"][-40:])
    ref_uri = f"sqlite:///{reference / 'mlflow.db'}"
    expected_versions = registered(ref_uri)

    hits = []
    for t, groups in enumerate(trials):
        root = tmp_path / f"trial{t}"
        root.mkdir()
        for group, marker, delay in plan_trial(rng, groups):
            result = attempt(root, env, (marker, delay))
            hits.append(
                {
                    "trial": t,
                    "group": group,
                    "marker": marker,
                    "delay_s": delay,
                    "killed": result["killed"],
                    "returncode": result["returncode"],
                    "last_line": result["last_line"],
                    "last_log": result["last_log"],
                }
            )
            print(
                f"trial {t} kill {group}: {marker!r} + {delay} s -> killed={result['killed']} "
                f"rc={result['returncode']}\n    last log line: {result['last_log']}\n    last line: {result['last_line']}",
                flush=True,
            )
            assert result["killed"] and result["returncode"] == -signal.SIGKILL, (
                f"the attempt was not killed at {marker!r} (+{delay} s): rc {result['returncode']}\n"
                + "\n".join(result["output"][-40:])
            )
        final = attempt(root, env)
        assert final["returncode"] == 0, "the run after the kills failed:\n" + "\n".join(final["output"][-60:])

        out, uri = root / "out", f"sqlite:///{root / 'mlflow.db'}"
        assert_same_weights(out / "export" / "model.safetensors", reference / "out" / "export" / "model.safetensors")
        assert_same_weights(final_reward_model(out), final_reward_model(reference / "out"))
        versions = registered(uri)
        for name, identities in versions.items():
            duplicated = [k for k, n in collections.Counter(identities).items() if n > 1]
            assert not duplicated, f"{name}: versions registered twice: {duplicated}"
        # the RL stage_key hashes paths under run.output_dir, so it differs between run directories: compare
        # (stage, step), and require one stage_key per stage within the run
        assert {n: [(s, step) for s, _, step in ids] for n, ids in versions.items()} == {
            n: [(s, step) for s, _, step in ids] for n, ids in expected_versions.items()
        }
        for name, identities in versions.items():
            keys = collections.defaultdict(set)
            for stage, key, _ in identities:
                keys[stage].add(key)
            assert all(len(k) == 1 for k in keys.values()), f"{name}: one stage with several stage keys: {dict(keys)}"
        assert running_runs(uri) == []
        # one pipeline run per attempt; a killed attempt's is KILLED, or FINISHED when the kill came after it ended
        statuses = pipeline_run_statuses(uri)
        assert len(statuses) == len(groups) + 1 and set(statuses) <= {"KILLED", "FINISHED"}, statuses
        assert statuses[-1] == "FINISHED" and "KILLED" in statuses, statuses
        assert hidden_dirs(out) == [], describe_hidden(out)
    return hits


@pytest.fixture
def prefect_api_url(prefect_harness) -> str:
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    assert url, "the Prefect test harness set no API URL"
    return url


def test_two_kills_then_resume_end_as_an_uninterrupted_run(tmp_path, prefect_api_url):
    rng = random.Random(20260)
    groups = sorted(rng.sample(GROUPS, 2), key=GROUPS.index)
    hits = run_chaos(tmp_path, prefect_api_url, [groups], seed=9)
    assert sum(h["killed"] for h in hits) == 2


@pytest.mark.chaos
def test_nine_kills_across_reward_rl_export_and_registration(tmp_path, prefect_api_url):
    hits = run_chaos(
        tmp_path, prefect_api_url, [GROUPS, GROUPS, GROUPS], seed=int(os.environ.get("RLHF_CHAOS_SEED", "11"))
    )
    assert sum(h["killed"] for h in hits) == 9
