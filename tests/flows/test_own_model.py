"""A team's first run: a config naming only a model directory and four JSONL files, on the defaults sized for
real models (prompts up to 512 tokens, completions up to 256), PPO and GRPO end to end.

The prompts are 40 to 200 tokens (tests/fixtures/team_data.py), so none is cut; no metric of the demo's world
(its VADER sentiment) appears anywhere, and `rlhf validate` prints the length table first. Only the step counts
and batch sizes are set here, to fit a test's minutes; every length is the default.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from flows.cli import main
from flows.rlhf_pipeline import rlhf_pipeline
from rlhf_core.config import load_config
from tests.fixtures.team_data import team_config, write_team_world

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]

SIZES = [
    "reward.max_steps=4",
    "reward.batch_size=4",
    "reward.eval_steps=2",
    "reward.save_steps=4",
    "rl.total_steps=2",
    "rl.save_steps=2",
    "eval.every_steps=2",
    "eval.num_prompts=4",
    "eval.batch_size=4",
]
RUNS = {"ppo": ["rl.batch_size=4", "ppo.num_ppo_epochs=1"], "grpo": ["rl.batch_size=8", "grpo.num_generations=4"]}


@pytest.fixture(scope="module")
def team(tmp_path_factory):
    root = tmp_path_factory.mktemp("team")
    model, files = write_team_world(root)
    return root, team_config(root, model, files)


def test_validate_prints_the_length_table_of_every_table(team, capsys, monkeypatch):
    root, config = team
    monkeypatch.chdir(root)
    assert main(["validate", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    table = out[out.index("Token lengths of the data") :]
    for name, limit in [("preference", "data.max_length 1024"), ("prompts", "data.max_prompt_length 512")]:
        [line] = [line for line in table.splitlines() if line.split()[:1] == [name]]
        rows, p50, p95, longest = (int(v) for v in line.split()[1:5])
        assert 40 <= p50 <= p95 <= longest <= 200 and limit in line and line.endswith("none over")
    assert "The policy's context: 2048 tokens" in table and "vader" not in out


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_a_model_directory_and_four_files_run_end_to_end(team, algorithm, prefect_harness, monkeypatch, caplog):
    root, config = team
    monkeypatch.chdir(root)  # run.output_dir and the MLflow store are the defaults, relative to here
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # an earlier test's mlflow.set_tracking_uri sets it
    overrides = [f"rl.algorithm={algorithm}", f"run.output_dir=outputs/{algorithm}", *SIZES, *RUNS[algorithm]]
    cfg = load_config(config, overrides)
    assert (cfg.data.max_prompt_length, cfg.rl.response_length, cfg.data.max_length) == (512, 256, 1024)
    assert cfg.eval.metrics == [] and not cfg.sft.enabled and cfg.gold_metric() is None

    state = rlhf_pipeline(config_path=str(config), overrides=overrides, return_state=True)

    assert state.is_completed(), state.message
    summary = state.result()
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri, registry_uri=uri)
    parent = client.get_run(summary["mlflow_run_id"])
    runs = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    by_name = {r.info.run_name: r for r in runs}
    # no SFT on the demo's reviews; the reward stage ran, or reused the model of an earlier run on the same data
    assert {"data", algorithm, "export"} <= set(by_name) <= {"data", "reward", algorithm, "export"}
    data = by_name["data"].data.metrics
    for table in ("preference", "preference_eval", "prompts", "eval_prompts"):
        assert data[f"data/{table}/overlong"] == 0  # no prompt cut
    keys = [k for r in [parent, *runs] for k in [*r.data.metrics, *r.data.params, *r.data.tags]]
    assert not [k for k in keys if "vader" in k.lower() or "sentiment" in k.lower()]
    assert "eval/kl_exact_mean" in by_name[algorithm].data.metrics
    # the guard's divergence rule says once that it is off, for lack of a gold metric, and the summary says it too
    off = "guard: the divergence rule is off for lack of a gold metric"
    assert summary["guard_off"].startswith(off)
    assert sum(off in record.getMessage() for record in caplog.records) == 1
    assert off.capitalize() in client.get_run(parent.info.run_id).data.tags["mlflow.note.content"]  # the summary
    assert (root / f"outputs/{algorithm}/export/model.safetensors").is_file()


@pytest.mark.parametrize("example", ["one-gpu", "multi-gpu"])
def test_the_example_configs_validate_with_local_stand_ins_for_the_hub(team, example, capsys, monkeypatch):
    """configs/examples/ as written, but for their hub names: the model and the four tables are local stand-ins of
    the same shapes (a Qwen2.5-Instruct-shaped directory, conversational JSONL), as nothing is downloaded here."""
    root, config = team
    monkeypatch.chdir(REPO)  # run.accelerate_config is relative to the repository, as the example's comment says
    tables = yaml.safe_load(config.read_text())["data"]
    local = [f"model.base={yaml.safe_load(config.read_text())['model']['base']}"]
    local += [f"data.{name}.path={spec['path']}" for name, spec in tables.items()]
    # as many prompts as one RL step of the example takes (rl.batch_size x run.num_processes: 512 for multi-gpu),
    # which `rlhf validate` checks as the data stage does: the stand-in's 32 prompts, repeated
    prompts = Path(tables["prompts"]["path"]).read_text()
    (root / "data" / "many-prompts.jsonl").write_text(prompts * 16)
    local.append(f"data.prompts.path={root / 'data' / 'many-prompts.jsonl'}")
    assert (
        main(
            [
                "validate",
                "--config",
                str(REPO / "configs" / "examples" / f"{example}.yaml"),
                *sum((["--set", o] for o in local), []),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    resolved = yaml.safe_load(out[: out.index("Token lengths of the data")])
    assert resolved["run"]["device"] == "cuda" and resolved["model"]["torch_dtype"] == "bfloat16"
    assert "none over" in out and "The policy's context: 2048 tokens" in out
