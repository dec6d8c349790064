"""The guard in a real smoke pipeline: a breach with action rollback restores the last checkpoint that
passed every rule, sets the later ones aside, doubles the KL coefficient and trains on to the end; a
breach with action stop ends RL, and export takes the best checkpoint that passed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

import tasks.stages.rl
from flows.rlhf_pipeline import rlhf_pipeline
from rlhf_core.evaluation.guard import GuardLedger

REPO = Path(__file__).resolve().parents[2]
SMOKE = str(REPO / "configs" / "smoke.yaml")
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]
ONLY_KL = [
    "guard.min_distinct_ratio.limit=null",
    "guard.max_length_change.limit=null",
    "guard.divergence.evals=null",
    "guard.kl_budget.limit=1.0",
]


def scripted_kl(monkeypatch, breaches: set[int]) -> list[int]:
    """The evaluation's KL replaced by 5.0 nats at the steps in `breaches` (each once) and 0.1 elsewhere;
    returns the steps evaluated, in order."""
    real, seen = tasks.stages.rl.evaluate_policy, []

    def evaluate(model, step, **kwargs):
        rows = real(model, step, **kwargs)
        kl = 5.0 if step in breaches else 0.1
        breaches.discard(step)
        seen.append(step)
        return [{**row, "kl_exact": kl} for row in rows]

    monkeypatch.setattr(tasks.stages.rl, "evaluate_policy", evaluate)
    return seen


def stage_dir(out: Path) -> Path:
    (key_dir,) = (out / "ppo").iterdir()
    return key_dir


def test_rollback_restores_the_last_passed_checkpoint_and_trains_on(prefect_harness, tmp_path, mlflow_uri, monkeypatch):
    seen = scripted_kl(monkeypatch, {4})
    out = tmp_path / "out"
    overrides = [f"run.output_dir={out}", f"tracking.uri={mlflow_uri}", "rl.total_steps=4", "rl.save_steps=1"]
    overrides += ["eval.every_steps=2", "guard.kl_budget.action=rollback", "guard.max_rollbacks=1", *ONLY_KL]

    summary = rlhf_pipeline(config_path=SMOKE, overrides=overrides)

    # step 4 broke the budget: back to checkpoint 2 (evaluated and passed); checkpoint 3 had no evaluation
    assert seen == [0, 2, 4, 4]
    ppo = stage_dir(out)
    ledger = GuardLedger.load(ppo / "guard.json")
    assert ledger.rollbacks == 1 and ledger.stopped_at is None
    assert [(t.rule, t.step, t.action) for t in ledger.all_triggers] == [("kl_budget", 4, "rollback")]
    assert ledger.passed(2) and ledger.passed(4) and ledger.triggers == []
    assert (ppo / "rolled_back" / "1" / "checkpoint-3").is_dir()  # set aside, not deleted
    assert sorted(p.name for p in ppo.glob("checkpoint-*")) == [f"checkpoint-{s}" for s in (1, 2, 3, 4)]
    coef = {s: json.loads((ppo / f"checkpoint-{s}" / "metrics.json").read_text())["objective/kl_coef"] for s in (2, 4)}
    assert coef[4] == pytest.approx(2 * coef[2])  # guard.kl_coef_factor
    client = MlflowClient(mlflow_uri, registry_uri=mlflow_uri)
    (run,) = client.search_runs(
        [client.get_run(summary["mlflow_run_id"]).info.experiment_id], "attributes.run_name = 'ppo'"
    )
    assert "guard.kl_budget" in run.data.tags and run.data.metrics["guard/kl_budget"] == 5.0


def test_stop_ends_rl_and_export_takes_the_best_passed_checkpoint(prefect_harness, tmp_path, mlflow_uri, monkeypatch):
    seen = scripted_kl(monkeypatch, {3})
    out = tmp_path / "out"
    overrides = [f"run.output_dir={out}", f"tracking.uri={mlflow_uri}", "rl.total_steps=4", "rl.save_steps=1"]
    overrides += ["eval.every_steps=1", "guard.kl_budget.action=stop", *ONLY_KL]

    summary = rlhf_pipeline(config_path=SMOKE, overrides=overrides)

    assert seen == [0, 1, 2, 3]  # no step 4: RL stopped at the breach
    ppo = stage_dir(out)
    ledger = GuardLedger.load(ppo / "guard.json")
    assert ledger.stopped_at == 3 and sorted(p.name for p in ppo.glob("checkpoint-*")) == [
        "checkpoint-1",
        "checkpoint-2",
    ]
    assert summary["selected_step"] in (1, 2) and summary["guard_triggers"] == [ledger.all_triggers[0].message]
    client = MlflowClient(mlflow_uri, registry_uri=mlflow_uri)
    candidate = client.get_model_version_by_alias("smoke-policy", "candidate")
    assert candidate.tags.get("step") in ("1", "2") and candidate.tags.get("guard.passed") == "true"
