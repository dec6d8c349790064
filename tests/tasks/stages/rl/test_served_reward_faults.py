"""A served scorer that fails mid-run, in the pipeline: killed (retries, then on_failure fail), slower than its
timeout (on_failure score), answering garbage (fail), a 429 storm (drop_group). Each ends as configured, with
nothing registered twice, no MLflow run left RUNNING and the bearer token in no file, record or log. The runs
share one output directory: the data and SFT stages run once, each fault is an RL stage of its own key."""

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from flows.rlhf_pipeline import rlhf_pipeline
from rlhf_core.rewards.remote import RemoteRewardError
from tests.fixtures.scorers import Behaviour, scorer_in_thread, scorer_process
from tests.fixtures.servers import free_port
from tests.flows.test_secrets import prefect_records
from tests.tasks.stages.rl.test_served_rewards import history

REPO = Path(__file__).resolve().parents[4]
SMOKE = str(REPO / "configs" / "smoke.yaml")
TOKEN = "sk-judge-fault-51d2"
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]


def judge(url: str, **settings) -> str:
    extra = "".join(f", {k}: {v}" for k, v in settings.items())
    return (
        "grpo.rewards=[{name: judge, kind: judge, url: '" + url + "/v1', judge_model: j, api_key_env: JUDGE_TOKEN, "
        "score_range: [0, 10], backoff_s: 0.05, template: 'Rate 0 to 10. Completion: {completion}'" + extra + "}]"
    )


def run(tmp_path: Path, mlflow_uri: str, rewards: str):
    overrides = [f"run.output_dir={tmp_path / 'out'}", f"tracking.uri={mlflow_uri}", "rl.algorithm=grpo", rewards]
    return rlhf_pipeline(config_path=SMOKE, overrides=overrides, return_state=True)


def rl_runs(client: MlflowClient) -> list:
    experiment = client.get_experiment_by_name("rlhf-smoke")
    return client.search_runs([experiment.experiment_id], "attributes.run_name = 'grpo'", order_by=["start_time"])


def test_each_fault_ends_as_configured(prefect_harness, tmp_path, mlflow_uri, monkeypatch):
    monkeypatch.setenv("JUDGE_TOKEN", TOKEN)
    client = MlflowClient(mlflow_uri, registry_uri=mlflow_uri)

    # killed mid-run: the first requests are answered (preflight, evaluation at step 0), then nothing listens
    port = free_port()
    with scorer_process(port, "die:12", TOKEN):
        state = run(tmp_path, mlflow_uri, judge(f"http://127.0.0.1:{port}", max_retries=2))
    with pytest.raises(
        RemoteRewardError, match=r"reward judge could not score completion \d+ of \d+ .*connection"
    ) as killed:
        state.result()
    assert "after 3 attempts" in str(killed.value) and "on_failure is fail" in str(killed.value)
    assert rl_runs(client)[-1].info.status == "FAILED"

    # slower than the timeout: every completion gets failure_score, counted
    with scorer_in_thread(Behaviour(mode="slow", delay_s=1.5, after=1, token=TOKEN)) as (url, _):
        state = run(
            tmp_path, mlflow_uri, judge(url, timeout_s=0.4, max_retries=1, on_failure="score", failure_score=-1.0)
        )
    assert state.is_completed()
    slow = rl_runs(client)[-1]
    assert history(client, slow, "rewards/judge/failures") == [8.0, 8.0]
    assert history(client, slow, "rewards/judge/mean") == [-1.0, -1.0] and history(
        client, slow, "rewards/judge/retries"
    ) == [8.0, 8.0]

    # garbage: not retried, the stage fails in one sentence
    with scorer_in_thread(Behaviour(mode="garbage", after=1, token=TOKEN)) as (url, behaviour):
        state = run(tmp_path, mlflow_uri, judge(url))
    with pytest.raises(
        RemoteRewardError, match="the answer is not JSON: '<html>not json</html>' .on the first attempt"
    ):
        state.result()

    # a 429 storm: retried, then each group dropped (no reward, advantage 0), the run goes on
    with scorer_in_thread(Behaviour(mode="429", after=1, token=TOKEN)) as (url, behaviour):
        state = run(tmp_path, mlflow_uri, judge(url, max_retries=2, on_failure="drop_group"))
    assert state.is_completed()
    storm = rl_runs(client)[-1]
    assert history(client, storm, "rewards/judge/dropped_groups") == [2.0, 2.0]
    assert history(client, storm, "rewards/num_unscorable") == [8.0, 8.0]
    assert history(client, storm, "rewards/judge/retries") == [16.0, 16.0]

    # nothing registered twice, nothing RUNNING, the token nowhere
    versions = client.search_model_versions("name = 'smoke-policy'")
    identities = [(v.tags["stage"], v.tags.get("stage_key"), v.tags["step"]) for v in versions]
    assert len(identities) == len(set(identities))
    experiments = [e.experiment_id for e in client.search_experiments()]
    assert client.search_runs(experiments, "attributes.status = 'RUNNING'") == []
    needle = TOKEN.encode()
    assert [p for p in tmp_path.rglob("*") if p.is_file() and needle in p.read_bytes()] == []
    assert TOKEN not in prefect_records()
