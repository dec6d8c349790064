"""The guard in a real smoke pipeline: a breach with action rollback restores the last checkpoint that
passed every rule, sets the later ones aside, doubles the KL coefficient and trains on to the end, the next
attempt in an MLflow run of its own (no series goes back) and Prefect artifacts of its own, and says what it did;
a breach with action stop ends RL, and export takes the best checkpoint that passed."""

from __future__ import annotations

import gc
import json
import weakref
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from mlflow.tracking import MlflowClient

import tasks.stages.rl.stage
from flows.rlhf_pipeline import rlhf_pipeline
from rlhf_core.config import load_config
from rlhf_core.demo.world import world_rows
from rlhf_core.evaluation.guard import GuardLedger, GuardRollback, Trigger
from rlhf_core.evaluation.policy import LoadedModels, evaluate_policy
from rlhf_core.models.loading import load_causal_lm, load_tokenizer, run_stop_ids
from rlhf_core.training.determinism import seed_everything
from tasks.stages.rl.guard import Guard, GuardListener, guarded_training

REPO = Path(__file__).resolve().parents[4]
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
    real, seen = tasks.stages.rl.stage.evaluate_policy, []

    def evaluate(model, step, **kwargs):
        rows = real(model, step, **kwargs)
        kl = 5.0 if step in breaches else 0.1
        breaches.discard(step)
        seen.append(step)
        return [{**row, "kl_exact": kl} for row in rows]

    monkeypatch.setattr(tasks.stages.rl.stage, "evaluate_policy", evaluate)
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
    pipeline = client.get_run(summary["mlflow_run_id"])
    (run,) = client.search_runs([pipeline.info.experiment_id], "attributes.run_name = 'ppo'")
    assert "guard.kl_budget" in run.data.tags and run.data.metrics["guard/kl_budget"] == 5.0

    # the second attempt is a run of its own in the stage run; no series of either goes back to an earlier step
    (attempt,) = client.search_runs([pipeline.info.experiment_id], f"tags.mlflow.parentRunId = '{run.info.run_id}'")
    assert attempt.info.run_name == "ppo-attempt-2" and attempt.info.status == "FINISHED"
    assert attempt.data.tags["rlhf.run_kind"] == "attempt" and attempt.data.tags["rlhf.attempt"] == "2"
    first, second = metric_steps(client, run.info.run_id), metric_steps(client, attempt.info.run_id)
    for steps in (*first.values(), *second.values()):
        assert steps == sorted(set(steps)), steps
    assert first["objective/kl_coef"] == [1, 2, 3, 4] and second["objective/kl_coef"] == [3, 4]
    assert first["eval/kl_exact_mean"] == [0, 2, 4] and second["eval/kl_exact_mean"] == [4]

    # what the rollback did, in one sentence: the log's, a tag and the description of the stage run, the guard's
    # artifact of step 4, the attempt run's description
    sentence = ledger.rollback_log[0].message
    assert sentence.startswith("guard: attempt 1 rolled back at step 4 (kl_budget) to checkpoint-2; checkpoint-3")
    assert f"ppo.kl_coef is now {coef[4]:g} ({coef[2]:g} x 2, guard.kl_coef_factor 2 per rollback)" in sentence
    assert sentence.endswith("attempt 2 trains on from step 2 (MLflow run ppo-attempt-2)")
    said = sentence.removeprefix("guard: ")
    assert run.data.tags["guard.rollback.1"] == sentence and said in run.data.tags["mlflow.note.content"]
    assert attempt.data.tags["mlflow.note.content"] == f"Attempt 2 of the ppo stage: {said}."
    assert (ppo / "rolled_back" / "1" / "eval" / "eval_step_000004.parquet").is_file()

    # each attempt's checkpoint of step 3 is a version of its own, logged to its attempt's run (the breach at
    # step 4 came before the first attempt saved step 4)
    versions = {
        (v.tags["step"], v.tags.get("attempt", "1")): v
        for v in client.search_model_versions("name = 'smoke-policy'")
        if v.tags.get("stage") == "ppo"
    }
    assert sorted(versions) == [("1", "1"), ("2", "1"), ("3", "1"), ("3", "2"), ("4", "2")]
    assert {versions[k].run_id for k in [("1", "1"), ("2", "1"), ("3", "1")]} == {run.info.run_id}
    assert versions[("3", "2")].run_id == versions[("4", "2")].run_id == attempt.info.run_id
    exported = client.get_model_version_by_alias("smoke-policy", "candidate")
    selected = versions[(str(summary["selected_step"]), "2" if summary["selected_step"] > 2 else "1")]
    assert f"- source checkpoint: `models:/smoke-policy/{selected.version}`" in exported.description

    # Prefect: one artifact per key, the second attempt's keys carry it, the guard's says what it did, and the
    # evaluation report names the step exported
    artifacts = flow_run_artifacts(pipeline.data.tags["prefect.flow_run_id"])
    keys = [a.key for a in artifacts if a.key and a.key.startswith("ppo-")]
    assert len(keys) == len(set(keys)), keys
    assert {"ppo-eval-step-0", "ppo-eval-step-4", "ppo-attempt-2-eval-step-4", "ppo-guard-step-4"} <= set(keys)
    (guard,) = [a for a in artifacts if a.key == "ppo-guard-step-4"]
    assert f"**What the guard did**: {said}." in guard.data
    (report,) = [a for a in artifacts if a.key == "ppo-evaluation"]
    step = summary["selected_step"]
    assert f"| {step} (exported) |" in report.data and f"the checkpoint of step {step}" in report.data
    # and the run's summary says it too, on the pipeline's run and in the result the console prints
    assert summary["guard_rollbacks"] == [sentence]
    assert f"What the guard did:\n\n- {sentence}" in pipeline.data.tags["mlflow.note.content"]


def metric_steps(client: MlflowClient, run_id: str) -> dict[str, list[int]]:
    """Each metric of the run: the steps of its points, in the order MLflow returns them (logged)."""
    return {
        key: [m.step for m in client.get_metric_history(run_id, key)] for key in client.get_run(run_id).data.metrics
    }


def flow_run_artifacts(flow_run_id: str) -> list:
    """The Prefect artifacts of one flow run, every version of each key."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    only = ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=only)


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


def recording_guard(cfg, out_dir: Path, seen: list) -> Guard:
    """A guard whose listener only records what it hears: every evaluation with its verdict, what the guard did,
    each attempt that begins."""
    guard = Guard(cfg, out_dir)
    guard.listener = GuardListener(
        on_eval=lambda rows, step, verdict: seen.append((step, rows)),
        on_action=lambda step, sentence: seen.append((step, sentence)),
        begin_attempt=lambda: seen.append(("attempt", guard.ledger.attempt)),
        settle=lambda: None,
    )
    return guard


def trained(inputs) -> str:
    return "trained"


def test_the_step_0_evaluation_is_seeded_whatever_ran_before_it(tmp_path, smoke_world):
    """The 'before' column does not depend on the generators' state the stage found (stages, loading, Ray or
    torchrun); the seeding is the one promotion uses, so promotion's evaluation of the initial policy matches."""
    cfg = load_config(SMOKE)
    tok, policy = load_tokenizer(str(smoke_world.tokenizer)), load_causal_lm(str(smoke_world.base_model))
    models = LoadedModels(tok, policy, None, None, run_stop_ids(tok, policy.generation_config, cfg.rl))
    prompt_rows = world_rows(smoke_world, "prompt", "test")[: cfg.eval.num_prompts]
    evaluate = partial(evaluate_policy, cfg=cfg, models=models, prompt_rows=prompt_rows, metrics={})

    def step_0_rows(history_seed: int, draws: int) -> list[dict]:
        torch.manual_seed(history_seed)
        torch.rand(draws)  # what ran before: other stages, model loading
        seen = []
        guard = recording_guard(cfg, tmp_path / f"{history_seed}-{draws}", seen)
        assert guarded_training(guard, lambda: (models, evaluate), lambda *attempt: attempt, trained) == "trained"
        assert [step for step, _ in seen] == [0]
        return seen[0][1]

    first = step_0_rows(1, 0)
    assert step_0_rows(2, 7) == first and step_0_rows(3, 1000) == first
    torch.manual_seed(2)
    unseeded = evaluate(policy, 0)
    seed_everything(cfg.run.seed)
    assert evaluate(policy, 0) == first and unseeded != first  # promotion's seeding; the history did matter


def test_a_rolled_back_attempt_lets_its_models_go_before_the_next_one_loads(tmp_path):
    cfg = load_config(SMOKE, ["guard.max_rollbacks=1"])
    attempts, released = [], []

    def load():
        if attempts:  # the previous attempt's policy, held by its models, `evaluate` and the breach's frames
            released.append(attempts[-1]() is None)
        models = SimpleNamespace(policy=torch.nn.Linear(2, 2))
        attempts.append(weakref.ref(models.policy))
        return models, partial(evaluate_with, models=models)  # as the RL stage's `evaluate` holds its models

    def evaluate_with(model, step, *, models):
        return [{"step": step}]

    def train(attempt):
        models, evaluate, kl_scale = attempt
        if len(attempts) > 1:
            return "trained"
        evaluate(models.policy, 1)
        error = None
        try:  # as the training loop raises an evaluation's breach on every process: from a frame that keeps it
            raise GuardRollback(Trigger("kl_budget", "rollback", 1, 5.0, 3.0, "guard kl_budget at step 1"))
        except GuardRollback as err:
            error = err
        raise error

    said = []
    guard = recording_guard(cfg, tmp_path, said)
    gc.disable()  # no collection but the guard's own
    try:
        assert guarded_training(guard, load, lambda *attempt: attempt, train) == "trained"
    finally:
        gc.enable()
    assert released == [True] and guard.ledger.rollbacks == 1
    assert said[-1] == ("attempt", 2)  # the reporter starts the second attempt, after it heard what was done
    assert said[-2][0] == 1 and said[-2][1].startswith("guard: attempt 1 rolled back at step 1 (kl_budget)")


def test_a_breach_rolls_back_through_the_guard_while_the_reporting_only_records(tmp_path):
    """The verdict is the guard's and so is the rollback: a listener that raises nothing and decides nothing still
    sees the attempt end at the breach, the checkpoint after the last passed one set aside, and the next attempt
    train at twice the KL coefficient."""
    cfg = load_config(SMOKE, [*ONLY_KL, "guard.kl_budget.action=rollback"])
    from rlhf_core.storage.checkpoints import STATE_DIR, STATE_JSON, TENSORS

    for step in (1, 2):  # two complete checkpoints, as the loop saves them
        state = tmp_path / f"checkpoint-{step}" / STATE_DIR
        state.mkdir(parents=True)
        (state / TENSORS).write_bytes(b"")
        (state / STATE_JSON).write_text("{}")
    said, scales = [], []

    def evaluate(model, step):
        return [{"completion": "fine words", "kl_exact": 5.0 if step == 2 else 0.1}]

    def train(attempt):
        models, evaluate, kl_scale = attempt
        scales.append(kl_scale)
        if kl_scale == 1.0:  # the first attempt: evaluations at steps 1 and 2, as the loop makes them
            guard.evaluated(evaluate(models.policy, 1), 1)
            guard.evaluated(evaluate(models.policy, 2), 2)
        return "trained"

    guard = recording_guard(cfg, tmp_path, said)
    guard.ledger.judge(0, {"eval/kl_exact_mean": 0.0}, cfg.guard, None)  # the initial policy, evaluated already
    load = lambda: (SimpleNamespace(policy=None), evaluate)  # noqa: E731
    assert guarded_training(guard, load, lambda *attempt: attempt, train) == "trained"
    assert scales == [1.0, cfg.guard.kl_coef_factor]
    assert [(s, [r["kl_exact"] for r in rows]) for s, rows in said[:2]] == [(1, [0.1]), (2, [5.0])]
    assert said[2][0] == 2 and said[2][1].startswith(
        "guard: attempt 1 rolled back at step 2 (kl_budget) to checkpoint-1"
    )
    assert said[3] == ("attempt", 2)
    assert not (tmp_path / "checkpoint-2").exists() and (tmp_path / "rolled_back" / "1" / "checkpoint-2").is_dir()
    assert guard.ledger.rollbacks == 1 and Guard(cfg, tmp_path).ledger.rollbacks == 1  # saved
