"""Generation ahead of training (rollout.max_staleness > 0) in the pipeline:

- the guard: a breach whose action is rollback, taken with a full queue, trains nothing sampled before it: the
  attempt's queue is discarded before the next attempt starts, and every batch trained after the rollback was
  sampled by the new attempt's generator from the restored policy's versions;
- tool episodes played ahead in the generator process: the tool and async metrics are logged;
- a run killed with SIGKILL in the RL stage and run again registers no (stage, step) twice and leaves no MLflow run
  RUNNING.
"""

from __future__ import annotations

import collections
import multiprocessing
import signal
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from flows.rlhf_pipeline import rlhf_pipeline
from rlhf_core.evaluation.guard import GuardLedger
from rlhf_core.rl.samplers import AheadSampler
from tests.flows.test_chaos import _env, attempt, registered, running_runs
from tests.tasks.stages.rl.test_guard import ONLY_KL, scripted_kl
from tests.tasks.stages.rl.test_tools import CALCULATOR, TOOL_METRICS

SMOKE = str(Path(__file__).resolve().parents[4] / "configs" / "smoke.yaml")
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]
GRPO_AHEAD = ["rl.algorithm=grpo", "rollout.max_staleness=2"]


def record_ahead(monkeypatch) -> list[tuple]:
    """Every AheadSampler's steps sampled ("next", its id, step, version, id of the batch) and its close ("close",
    its id, the steps still queued, ids of the batches sampled for them)."""
    events, sample, close = [], AheadSampler.sample, AheadSampler.close

    def recording_sample(self, prompts, call=0):
        step = self.loop.step
        sampled = sample(self, prompts, call)
        events.append(("next", id(self), step, step - int(self.metrics["async/staleness"]), id(sampled)))
        return sampled

    def recording_close(self):
        made = [p.future.result() for p in self.pending if p.future.done() and not p.future.cancelled()]
        events.append(("close", id(self), [p.step for p in self.pending], {id(m.sampled) for m in made}))
        close(self)

    monkeypatch.setattr(AheadSampler, "sample", recording_sample)
    monkeypatch.setattr(AheadSampler, "close", recording_close)
    return events


def test_a_rollback_with_a_full_queue_trains_nothing_sampled_before_it(
    prefect_harness, tmp_path, mlflow_uri, monkeypatch
):
    scripted_kl(monkeypatch, {4})
    events = record_ahead(monkeypatch)
    out = tmp_path / "out"
    overrides = [f"run.output_dir={out}", f"tracking.uri={mlflow_uri}", "rl.total_steps=6", "rl.save_steps=1"]
    overrides += ["eval.every_steps=2", "guard.kl_budget.action=rollback", "guard.max_rollbacks=1", *ONLY_KL]
    rlhf_pipeline(config_path=SMOKE, overrides=[*overrides, *GRPO_AHEAD])

    (stage,) = (out / "grpo").iterdir()
    ledger = GuardLedger.load(stage / "guard.json")
    assert ledger.rollbacks == 1 and [(t.step, t.action) for t in ledger.all_triggers] == [(4, "rollback")]
    closes = [e for e in events if e[0] == "close"]
    first, second = closes[0][1], closes[1][1]
    assert first != second and len(closes) == 2
    # the breach came at step 4's evaluation: steps 4 and 5 (0-based) were queued, k = 2, a full queue
    assert closes[0][2] == [4, 5]
    at = events.index(closes[0])
    assert all(e[1] == first for e in events[:at]) and all(e[1] == second for e in events[at + 1 :])
    after = [e for e in events[at + 1 :] if e[0] == "next"]
    # back to checkpoint 2 (the last passed evaluation), then to the end, every batch from the new attempt's
    # generator and the restored policy's versions
    assert [e[2] for e in after] == [2, 3, 4, 5] and all(e[3] >= 2 for e in after)
    assert not {e[4] for e in after} & closes[0][3]  # none of the discarded batches trained
    assert not multiprocessing.active_children()


def test_tool_episodes_are_played_ahead_in_the_generator_process(prefect_harness, tmp_path, mlflow_uri):
    out = tmp_path / "out"
    overrides = [f"run.output_dir={out}", f"tracking.uri={mlflow_uri}", *CALCULATOR, "rollout.max_staleness=1"]
    overrides += ["rl.total_steps=3"]
    summary = rlhf_pipeline(config_path=SMOKE, overrides=overrides)
    client = MlflowClient(mlflow_uri, registry_uri=mlflow_uri)
    parent = client.get_run(summary["mlflow_run_id"])
    runs = {r.info.run_name: r for r in client.search_runs([parent.info.experiment_id])}
    metrics = runs["grpo"].data.metrics
    assert all(f"tools/{name}" in metrics for name in TOOL_METRICS)
    assert metrics["async/staleness"] == 1 and metrics["async/dropped_batches"] == 0
    assert "sampling/importance_sampling_ratio/mean" in metrics
    assert runs["grpo"].data.params["rollout.max_staleness"] == "1"
    assert not multiprocessing.active_children()


def test_a_killed_run_resumed_registers_nothing_twice_and_leaves_nothing_running(tmp_path, prefect_harness):
    from prefect.settings import PREFECT_API_URL

    env = _env(PREFECT_API_URL.value())
    extra = [*GRPO_AHEAD, "rl.total_steps=4"]
    killed = attempt(tmp_path, env, (r"grpo checkpoint 2 is models:/", 0.05), extra=extra)
    assert killed["killed"] and killed["returncode"] == -signal.SIGKILL, "\n".join(killed["output"][-30:])
    final = attempt(tmp_path, env, extra=extra)
    assert final["returncode"] == 0, "\n".join(final["output"][-40:])
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    policy = registered(uri)["smoke-policy"]
    assert not [k for k, n in collections.Counter(policy).items() if n > 1]
    steps = sorted(int(step) for stage, _, step in policy if stage == "grpo")
    assert steps == [1, 2, 3, 4]
    assert running_runs(uri) == []
