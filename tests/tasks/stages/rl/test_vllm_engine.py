"""rollout.engine vllm in the pipeline: the RL stage starts its vLLM server (.venv-vllm, `make vllm-venv`) from the
stage's start policy, samples every step there with weights pushed after each update, logs the correction's
statistics, evaluates on the engine (rollout.vllm.evaluate) and stops the server when the stage ends, leaving no
process of it; promotion then evaluates the candidate on a server of its own and repeats the stage's numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from flows.promote import rlhf_promote
from flows.rlhf_pipeline import rlhf_pipeline
from rlhf_core.rollout.engines import WEIGHTS_FILE

SMOKE = str(Path(__file__).resolve().parents[4] / "configs" / "smoke.yaml")
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]
VADER_ONLY = "grpo.rewards=[{name: vader, function: 'rlhf_core.rewards.functions:vader_compound'}]"


def processes_naming(text: str) -> list[int]:
    """The live processes whose command line names `text` (the run's own directory: the server's model path)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().decode(errors="replace"):
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def test_grpo_on_the_vllm_engine_runs_logs_the_correction_and_stops_its_server(prefect_harness, tmp_path, mlflow_uri):
    out = tmp_path / "out"
    overrides = [
        f"run.output_dir={out}",
        f"tracking.uri={mlflow_uri}",
        "model.demo.hidden_size=64",  # heads of 32: the smallest vLLM's CPU attention takes
        "rl.algorithm=grpo",
        VADER_ONLY,
        "rollout.engine=vllm",
        "rollout.vllm.evaluate=true",
    ]
    summary = rlhf_pipeline(config_path=SMOKE, overrides=overrides)
    assert processes_naming(str(out)) == []  # the server and its engine process are gone

    client = MlflowClient(mlflow_uri, registry_uri=mlflow_uri)
    parent = client.get_run(summary["mlflow_run_id"])
    [grpo_run] = client.search_runs([parent.info.experiment_id], "attributes.run_name = 'grpo'")
    ratio = client.get_metric_history(grpo_run.info.run_id, "sampling/importance_sampling_ratio/mean")
    assert [m.step for m in ratio] == [1, 2]
    assert all(abs(m.value - 1.0) < 0.02 for m in ratio)  # fp32 on both sides; the min-tokens mask aside
    gap = client.get_metric_history(grpo_run.info.run_id, "sampling/sampling_logp_difference/max")
    assert all(m.value < 0.1 for m in gap)
    [stage_dir] = (out / "grpo").iterdir()
    assert (stage_dir / "engine-weights" / WEIGHTS_FILE).is_file()
    assert "Application startup complete" in (stage_dir / "vllm-server.log").read_text()
    assert grpo_run.data.params["rollout.engine"] == "vllm"

    # promotion samples the candidate (the exported checkpoint) on a vLLM server, seeded as the stage's evaluations
    promoted = rlhf_promote(config_path=SMOKE, overrides=overrides)
    assert processes_naming(str(out)) == []
    step = int(client.get_model_version("smoke-policy", summary["candidate_uri"].rsplit("/", 1)[1]).tags["step"])
    for name in ("eval/vader_compound_mean", "eval/length_mean", "eval/stop_rate"):
        stage = {m.step: m.value for m in client.get_metric_history(grpo_run.info.run_id, name)}
        assert promoted["candidate_summary"][name] == pytest.approx(stage[step], abs=1e-6), name
