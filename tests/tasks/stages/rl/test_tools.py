"""Tool episodes in the pipeline: the calculator world (data.demo.world calculator) with grpo.tools, a verifier as
the reward. The RL stage logs the tool metrics, its eval and completions tables hold the transcripts and their
counts, and the export keeps the chat template that writes the calls and lists the tool on its card; a tool that
cannot be imported is refused before anything runs."""

from pathlib import Path

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from flows.rlhf_pipeline import rlhf_pipeline
from rlhf_core.config import UserError

SMOKE = str(Path(__file__).resolve().parents[4] / "configs" / "smoke.yaml")
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]
EXACT = "rlhf_core.rewards.functions:exact_match"
TOOL = "rlhf_core.demo.calculator:multiply"
CALCULATOR = [
    "data.demo.world=calculator",
    "data.demo.num_labelled=64",
    "data.demo.tool_call_fraction=0.5",
    "data.max_length=48",
    "data.max_prompt_length=12",
    "rl.algorithm=grpo",
    "rl.response_length=32",
    f"grpo.tools=['{TOOL}']",
    "grpo.max_tool_calls=2",
    f"grpo.rewards=[{{name: exact_match, function: '{EXACT}'}}]",
    "grpo.log_completions_steps=1",
    f"eval.metrics=['{EXACT}']",
    f"promote.evaluator.metrics=['{EXACT}']",
]
TOOL_METRICS = ("call_frequency", "failure_frequency", "failures", "turns", "hit_max_calls", "token_share")


def test_a_tool_run_logs_tool_metrics_and_transcripts_and_exports_its_tools(prefect_harness, tmp_path, mlflow_uri):
    out = tmp_path / "out"
    summary = rlhf_pipeline(
        config_path=SMOKE, overrides=[f"run.output_dir={out}", f"tracking.uri={mlflow_uri}", *CALCULATOR]
    )
    client = MlflowClient(mlflow_uri, registry_uri=mlflow_uri)
    parent = client.get_run(summary["mlflow_run_id"])
    runs = {r.info.run_name: r for r in client.search_runs([parent.info.experiment_id])}
    metrics = runs["grpo"].data.metrics
    for name in TOOL_METRICS:
        assert f"tools/{name}" in metrics, name
    assert 1.0 <= metrics["tools/turns"] <= 3.0 and 0.0 <= metrics["tools/token_share"] < 1.0
    [stage] = (out / "grpo").iterdir()
    evals = pd.read_parquet(stage / "eval" / "eval_step_000002.parquet")
    assert {"final_answer", "completion", "tool_calls", "tool_failures", "turns", "exact_match"} <= set(evals.columns)
    assert list(evals.columns[:4]) == [
        "step",
        "prompt",
        "final_answer",
        "completion",
    ]  # the answer before the transcript
    assert (evals["turns"] >= 1).all() and (evals["turns"] <= evals["tool_calls"] + 1).all()
    completions = pd.read_parquet(next((stage / "completions").glob("*.parquet")))
    assert len(completions) == 8 and completions["completion"].map(lambda c: isinstance(c, str)).all()
    export = out / "export"
    card = (export / "README.md").read_text()
    assert f"- `{TOOL}`" in card and "tool-use" in card
    assert "<tool_call>" in (export / "chat_template.jinja").read_text()


def test_a_tool_that_cannot_be_imported_is_refused_before_anything_runs(prefect_harness, tmp_path, mlflow_uri):
    out = tmp_path / "out"
    overrides = [f"run.output_dir={out}", f"tracking.uri={mlflow_uri}", *CALCULATOR, "grpo.tools=['no_such_module:f']"]
    with pytest.raises(UserError, match=r"grpo.tools\[0\]: could not import module 'no_such_module'"):
        rlhf_pipeline(config_path=SMOKE, overrides=overrides)
    assert not (out / "sft").exists()
