"""The pipeline run's summary as a reviewer reads it: its metrics read from what the stages return (with the keys
a stage may or may not report), the held-out samples before and after, each stage run's description."""

import pytest

from flows import rlhf_pipeline
from flows.console import SAMPLE_PROMPTS
from flows.rlhf_pipeline import before_and_after, summary_markdown, summary_metrics
from flows.stage_notes import stage_notes
from rlhf_core.config import load_config
from tasks import tracking
from tasks.stage_io import Checkpoint
from tasks.stages.data import PreparedData


@pytest.fixture
def cfg(tmp_path):
    return load_config(None, [f"run.output_dir={tmp_path}"])


def checkpoint(metrics: dict, final_eval: dict | None = None, gold: str | None = "vader_compound") -> Checkpoint:
    return Checkpoint(
        path="p", model_uri=None, step=7, metrics=metrics, extra={"gold": gold, "final_eval": final_eval or {}}
    )


def test_summary_prefers_the_stage_metrics_k3_kl_and_counts_guard_triggers(cfg):
    trained = checkpoint(
        {
            "eval/vader_compound_mean": 0.5,
            "eval/score_mean": 1.25,
            "eval/kl_mean": 0.2,
            "eval/kl_k3_mean": 0.1,
            "guard/triggers": 3.0,
        },
        final_eval={"eval/vader_compound_mean": -1.0, "eval/score_mean": -1.0, "eval/kl_mean": -1.0},
    )
    reward = Checkpoint(path="r", model_uri=None, step=4, metrics={"eval_accuracy": 0.875, "eval_loss": 0.3})

    assert summary_metrics(cfg, reward, trained) == {
        "summary/gold": 0.5,
        "summary/proxy": 1.25,
        "summary/kl": 0.1,
        "summary/reward_accuracy": 0.875,
        "summary/guard_triggers": 3.0,
    }


def test_summary_falls_back_to_the_last_evaluation_and_leaves_out_what_was_not_measured(cfg):
    # train metrics only on the Checkpoint (today's PPO), the evaluation summary in extra; no reward stage
    trained = checkpoint(
        {"objective/kl": 0.4}, final_eval={"eval/vader_compound_mean": 0.3, "eval/kl_mean": 0.05}, gold=None
    )

    assert summary_metrics(cfg, None, trained) == {
        "summary/gold": 0.3,  # eval.metrics[0] is vader_compound
        "summary/kl": 0.05,
        "summary/guard_triggers": 0.0,
    }


def row(prompt: str, completion: str, score: float) -> dict:
    return {"prompt": f"<|im_start|>user\n{prompt}<|im_end|>", "completion": completion, "score": score, "length": 3}


def test_final_samples_hold_each_prompts_completion_before_and_after_side_by_side():
    before = [row("the food was", "bad", -1.0), row("the film was", "dull", -0.5)]
    after = [row("the film was", "great", 1.0), row("the food was", "awesome", 2.0), row("new prompt", "ok", 0.0)]

    rows = before_and_after(before, after, 0, 40)

    assert list(rows[0]) == [
        "prompt",
        "completion_before",
        "completion_after",
        "score_before",
        "score_after",
        "length_before",
        "length_after",
        "step_before",
        "step_after",
        "rendered_prompt",
    ]
    assert [(r["prompt"], r["completion_before"], r["completion_after"]) for r in rows] == [
        ("the film was", "dull", "great"),
        ("the food was", "bad", "awesome"),
        ("new prompt", None, "ok"),  # the initial policy never saw it
    ]
    assert (rows[1]["score_before"], rows[1]["score_after"], rows[1]["step_before"], rows[1]["step_after"]) == (
        -1.0,
        2.0,
        0,
        40,
    )
    assert rows[2]["step_before"] is None and rows[0]["rendered_prompt"].startswith("<|im_start|>")


def trained_run(cfg) -> Checkpoint:
    history = {
        0: {"eval/vader_compound_mean": 0.02, "eval/score_mean": -0.5, "eval/kl_exact_mean": 0.0},
        40: {"eval/vader_compound_mean": 0.41, "eval/score_mean": 1.2, "eval/kl_exact_mean": 1.84},
    }
    prompts = [f"prompt {i}" for i in range(5)]
    return Checkpoint(
        path="p",
        model_uri="models:/demo-policy/6",
        step=40,
        metrics={},
        extra={
            "eval_history": history,
            "initial_rows": [row(p, f"before {i}", 0.0) for i, p in enumerate(prompts)],
            "final_rows": [row(p, f"after {i}", 1.0) for i, p in enumerate(prompts)],
            "guard_triggers": [],
            "rollbacks": 0,
            "selected": "best",
        },
    )


def test_the_summary_shows_as_many_prompts_before_and_after_as_the_console(cfg, monkeypatch):
    monkeypatch.setattr(tracking.logs, "run_link", lambda run_id: f"run `{run_id}`")
    exported = Checkpoint(path="out/export", model_uri=None, step=40, metrics={})

    text = summary_markdown(cfg, "r1", trained_run(cfg), exported)

    assert SAMPLE_PROMPTS == 3 and "Three held-out prompts, before and after:" in text
    shown = [line for line in text.splitlines() if line.startswith("| prompt ")]
    assert len(shown) == 4 and "| prompt 2 | before 2 | after 2 |" in text and "prompt 3 |" not in text


def test_the_summary_keeps_each_sample_on_its_table_line_says_what_the_arrows_mean_and_what_promotion_will_do(
    cfg, monkeypatch
):
    monkeypatch.setattr(tracking.logs, "run_link", lambda run_id: f"run `{run_id}`")
    monkeypatch.setattr(tracking.logs, "version_link", lambda uri: f"`{uri}`")
    trained = trained_run(cfg)
    episode = {"tool_calls": 1, "completion": "-> multiply {} ⏎ <- multiply: 6 ⏎ 6"}
    trained.extra["initial_rows"] = [{**row("2*3=", "6\n| `x`", 0.0), "tool_calls": 0}]
    trained.extra["final_rows"] = [{**row("2*3=", "", 1.0), **episode}]
    trained.extra["guard_broken"] = ["max_length_change"]
    exported = Checkpoint(path="out/export", model_uri="models:/demo-policy/7", step=40, metrics={})

    lines = summary_markdown(cfg, "r1", trained, exported).splitlines()

    assert "| 2\\*3= | 6<br>\\| \\`x\\` | -> multiply {} ⏎ <- multiply: 6 ⏎ 6 |" in lines
    assert lines[-1].startswith("Tool episodes: -> is a call the model made")
    assert any(
        line.startswith("- Cannot be promoted: this checkpoint broke the guard rule max_length_change")
        for line in lines
    )


def test_each_stage_run_says_what_the_stage_did_with_its_numbers(cfg):
    data = PreparedData(
        tables={},
        fingerprints={"prompts": "f"},
        base_model="demo",
        tokenizer="demo",
        reports=[{"table": "preference", "kept": 3000, "overlong": 0}, {"table": "prompts", "kept": 1024}],
    )
    policy = Checkpoint(
        "sft", "models:/demo-policy/1", 300, {"sft/first_loss": 5.1234, "sft/loss": 2.3456, "sft/steps": 300.0}
    )
    reward = Checkpoint("r", "models:/demo-reward-model/6", 600, {"eval_accuracy": 0.935, "eval_loss": 0.21})
    exported = Checkpoint(path="/o/export", model_uri="models:/demo-policy/7", step=40, metrics={})

    notes = stage_notes(cfg, data, policy, reward, trained_run(cfg), exported)

    assert set(notes) == {"data", "sft", "reward", "ppo", "export"}
    assert (
        notes["data"]
        == f"Prepared 2 tables (rows: preference 3000, prompts 1024); data fingerprint `{data.fingerprint}`."
    )
    assert notes["sft"] == (
        f"Fine-tuned `{cfg.model.base}` on the SFT texts for 300 steps: loss 5.123 -> 2.346. "
        "Registered as `models:/demo-policy/1`."
    )
    assert "for 600 steps: held-out accuracy 0.935, loss 0.210." in notes["reward"]
    assert notes["ppo"].startswith("PPO from `models:/demo-policy/1`, scored by `models:/demo-reward-model/6`")
    assert (
        "step 0 -> step 40: vader_compound 0.020 -> 0.410, reward-model score -0.500 -> 1.200, "
        "KL to the initial policy 1.840 nats." in notes["ppo"]
    )
    assert notes["ppo"].endswith("Guard: 0 trigger(s), 0 rollback(s); export.select `best` picked step 40.")
    assert notes["export"] == (
        "Exported step 40 of the PPO policy to `/o/export` and registered it as `models:/demo-policy/7` "
        "(alias `candidate`). Guard: passed."
    )


def test_the_mlflow_run_takes_the_flow_runs_name_only_when_it_names_this_config(cfg, monkeypatch):
    from types import SimpleNamespace

    for name, expected in [
        ("rlhf-ppo-seed42-20261126-095012", "rlhf-ppo-seed42-20261126-095012"),
        ("smoke", None),  # a config that did not load when the flow run was named
        (None, None),  # no flow run
    ]:
        monkeypatch.setattr(rlhf_pipeline, "prefect_flow_run", SimpleNamespace(name=name))
        assert rlhf_pipeline.mlflow_run_name(cfg) == expected
