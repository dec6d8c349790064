"""promote.approval: required, on a real Prefect server (the harness's): the promotion pauses with a form, and the
test answers it through Prefect's API as its UI does (POST /flow_runs/<id>/resume with the form's values)."""

import threading
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
from prefect.client.schemas.objects import StateType

from flows.promote import rlhf_promote
from tasks.promotion import approval
from tests.flows.test_promote import AGREEMENT, NAME, SMOKE, perturbed, register_candidate, settings, write_targets

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]


def promote_in_background(overrides: list[str]) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        out["state"] = rlhf_promote(config_path=SMOKE, overrides=overrides, return_state=True)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def paused_run(timeout_s: float = 240.0):
    """The flow run that is paused, once Prefect holds its form (the description is saved after the pause)."""
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            paused = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.PAUSED]))
                )
            )
            for run in paused:
                keyset = run.state.state_details.run_input_keyset
                try:
                    description = client.read_flow_run_input(run.id, keyset["description"])
                except Exception:  # not saved yet
                    continue
                return run, description
            time.sleep(0.5)
    raise AssertionError("no flow run paused for approval")


def answer(run_id, values: dict) -> None:
    """What Prefect's UI sends when a person submits the form."""
    with get_client(sync_client=True) as client:
        result = client.resume_flow_run(run_id, run_input=values)
    assert result.status.value == "ACCEPT", result.details


def test_approve_moves_the_alias_reject_and_timeout_do_not(
    prefect_harness, tmp_path, mlflow_uri, smoke_world, monkeypatch
):
    monkeypatch.setattr(approval, "POLL_S", 1)
    targets = tmp_path / "targets.json"
    monkeypatch.setenv("RLHF_TEST_TARGETS", str(targets))
    client = MlflowClient(mlflow_uri, registry_uri=mlflow_uri)
    base = Path(smoke_world.base_model)
    a, b = perturbed(base, tmp_path / "a", seed=1), perturbed(base, tmp_path / "b", seed=2)
    overrides = [
        *settings(tmp_path, mlflow_uri),
        f"promote.evaluator.metrics=['{AGREEMENT}']",
        "promote.approval=required",
    ]

    # approve: the alias moves, and who approved and why are tags
    write_targets(a, smoke_world, targets)
    v1 = register_candidate(a, base, mlflow_uri)
    thread, out = promote_in_background(overrides)
    run, description = paused_run()
    assert f"# Promotion of {NAME} version {v1}" in description and "**Awaiting approval**: " in description
    assert str(client.get_model_version_by_alias(NAME, "candidate").version) == v1
    with pytest.raises(Exception, match="alias champion not found|RESOURCE_DOES_NOT_EXIST"):
        client.get_model_version_by_alias(NAME, "champion")  # nothing moved while it waits
    answer(run.id, {"approve": True, "approver": "ana", "comment": "samples read, fine"})
    thread.join(300)
    assert out["state"].is_completed()
    tags = client.get_model_version(NAME, v1).tags
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == v1
    assert (tags["promotion.decision"], tags["promotion.approval"], tags["promotion.approved_by"]) == (
        "promoted",
        "approved",
        "ana",
    )
    assert tags["promotion.approval_comment"] == "samples read, fine"

    # reject: B passes the evaluation against A, a person says no, A stays champion
    write_targets(b, smoke_world, targets)
    v2 = register_candidate(b, base, mlflow_uri)
    thread, out = promote_in_background(overrides)
    run, _ = paused_run()
    answer(run.id, {"approve": False, "approver": "bo", "comment": "wait for the safety review"})
    thread.join(300)
    tags = client.get_model_version(NAME, v2).tags
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == v1
    assert (tags["promotion.decision"], tags["promotion.rejected_by"]) == ("rejected", "bo")
    assert "approval: rejected by bo: wait for the safety review" in client.get_model_version(NAME, v2).description

    # no answer within approval_timeout_h: A stays champion, and the tags say the form timed out
    v3 = register_candidate(b, base, mlflow_uri)
    thread, out = promote_in_background([*overrides, "promote.approval_timeout_h=0.001"])  # 3.6 s
    thread.join(300)
    assert out["state"].is_failed()  # Prefect fails a run whose pause timed out; the tags say why
    tags = client.get_model_version(NAME, v3).tags
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == v1
    assert (tags["promotion.decision"], tags["promotion.approval"]) == ("timed_out", "timed_out")
    described = client.get_model_version(NAME, v3).description
    assert "no one answered the approval form within promote.approval_timeout_h 0.001 h" in described
