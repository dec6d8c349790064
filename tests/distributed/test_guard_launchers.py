"""The guard on two processes under either launcher, torchrun (run.launcher 'local') and Ray (a private
instance, started and stopped by the stage): a rollback, then a stop, and neither process left waiting for
the other. (The Ray launcher on a simulated cluster: test_ray_launcher.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from flows.rlhf_pipeline import rlhf_pipeline
from rlhf_core.evaluation.guard import GuardLedger
from tests.fixtures.runtime import deadline, environment
from tests.fixtures.servers import MLFLOW_ENV

REPO = Path(__file__).resolve().parents[2]
SMOKE = str(REPO / "configs" / "smoke.yaml")
VADER_ONLY = "grpo.rewards=[{name: vader, function: 'rlhf_core.rewards.functions:vader_compound'}]"
ONLY_KL = ["guard.min_distinct_ratio.limit=null", "guard.max_length_change.limit=null", "guard.divergence.evals=null"]
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]


@pytest.mark.parametrize("launcher", ["local", "ray"])
def test_the_guard_rolls_back_then_stops_two_processes_on_either_launcher(prefect_harness, tmp_path, launcher):
    """Every evaluation after the start breaks a KL budget of 0 nats: the first breach rolls back (rank 0 sets
    the checkpoints aside, both processes start over with the KL coefficient doubled), the second stops
    (guard.max_rollbacks 1). Neither process is left waiting for the other. The Ray run starts a private
    local instance (run.ray_address null) and stops it after."""
    out = tmp_path / "out"
    overrides = [
        f"run.output_dir={out}",
        f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
        "sft.enabled=false",
        "init.policy=base",
    ]
    overrides += ["run.num_processes=2", f"run.launcher={launcher}", "rl.algorithm=grpo", VADER_ONLY]
    overrides += ["rl.total_steps=2", "rl.save_steps=1", "eval.every_steps=1", "guard.kl_budget.limit=0"]
    overrides += ["guard.kl_budget.action=rollback", "guard.max_rollbacks=1", *ONLY_KL]
    with deadline(300, f"the guard run ({launcher})"), environment({k: None for k in MLFLOW_ENV}):
        state = rlhf_pipeline(config_path=SMOKE, overrides=overrides, return_state=True)
    # the stop came at the first evaluation, before any checkpoint: nothing to export, said in one sentence
    assert state.is_failed() and "the guard stopped grpo at step 1 before any checkpoint was saved" in state.message
    (stage,) = (out / "grpo").iterdir()
    ledger = GuardLedger.load(stage / "guard.json")
    assert (ledger.rollbacks, ledger.stopped_at) == (1, 1)
    assert [t.rule for t in ledger.all_triggers] == ["kl_budget", "kl_budget"]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("rlhf-smoke").experiment_id])
    assert not [r.info.run_name for r in runs if r.info.status == "RUNNING"]
