"""The smoke pipeline on conversational (TRL message-list) data: every table templated by model.chat_template."""

import json
import shutil
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from flows.rlhf_pipeline import rlhf_pipeline
from rlhf_core.data.tables import read_rows

REPO = Path(__file__).resolve().parents[2]
SMOKE = str(REPO / "configs" / "smoke.yaml")
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]

# plain words, so the demo's word-level tokenizer knows most of them
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} . {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)
TOPICS = ["food", "room", "staff", "view", "bed", "service", "price", "pool"]


def user(topic):
    return [{"role": "user", "content": f"the {topic} was"}]


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def tokenizer_without_template(world, directory: Path) -> str:
    """The demo world's tokenizer with its chat template taken out (as a base model's often comes)."""
    shutil.copytree(world.tokenizer, directory)
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return str(directory)


def test_smoke_pipeline_on_conversational_data(prefect_harness, tmp_path, mlflow_uri, smoke_world):
    prefs = [
        {
            "prompt": user(t),
            "chosen": [{"role": "assistant", "content": "great and lovely"}],
            "rejected": [{"role": "assistant", "content": "awful"}],
        }
        for t in TOPICS * 2
    ]
    implicit = [
        {
            "chosen": user(t) + [{"role": "assistant", "content": "great"}],
            "rejected": user(t) + [{"role": "assistant", "content": "bad"}],
        }
        for t in TOPICS
    ]
    prompts = [{"prompt": user(t), "topic": t} for t in TOPICS * 2]
    sft = [{"messages": user(t) + [{"role": "assistant", "content": f"the {t} was great"}]} for t in TOPICS * 2]
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    overrides = [
        f"run.output_dir={tmp_path / 'out'}",
        f"tracking.uri={mlflow_uri}",
        f"model.tokenizer={tokenizer_without_template(smoke_world, tmp_path / 'tokenizer')}",
        f"model.chat_template={template}",
        f"data.preference.path={write(tmp_path / 'prefs.jsonl', prefs)}",
        f"data.preference_eval.path={write(tmp_path / 'prefs_eval.jsonl', implicit)}",
        "data.preference_eval.split=train",
        f"data.prompts.path={write(tmp_path / 'prompts.jsonl', prompts)}",
        f"data.eval_prompts.path={write(tmp_path / 'eval_prompts.jsonl', prompts[:8])}",
        "data.eval_prompts.split=train",
        f"sft.dataset.path={write(tmp_path / 'sft.jsonl', sft)}",
        "rl.algorithm=grpo",
        "grpo.rewards=[{name: rm, model: reward_stage}, {name: words, function: 'tests.fixtures.chat_rewards:assistant_words'}]",
    ]

    state = rlhf_pipeline(config_path=SMOKE, overrides=overrides, return_state=True)

    assert state.is_completed(), state.message
    summary = state.result()
    client = MlflowClient(mlflow_uri, registry_uri=mlflow_uri)
    runs = client.search_runs(
        [client.get_run(summary["mlflow_run_id"]).info.experiment_id],
        f"tags.mlflow.parentRunId = '{summary['mlflow_run_id']}'",
    )
    assert {r.info.run_name: r.info.status for r in runs} == {
        n: "FINISHED" for n in ("data", "sft", "reward", "grpo", "export")
    }
    # GRPO with beta 0 trains without a reference, yet its evaluations measure the KL to the initial policy,
    # and score its reward function (with the prompt's extra columns) beside the reward model
    (grpo,) = [r for r in runs if r.info.run_name == "grpo"]
    expected = {"eval/kl_exact_mean", "eval/kl_k3_mean", "eval/kl_mean", "eval/reward_words_mean", "eval/distinct_2"}
    assert expected <= set(grpo.data.metrics)
    assert grpo.data.metrics["eval/kl_exact_mean"] >= 0 and grpo.data.metrics["eval/kl_k3_mean"] >= 0
    data = tmp_path / "out" / "data"
    [first] = read_rows(data / "prompts.jsonl")[:1]
    assert first["prompt"] == "user : the food was . assistant : "
    assert first["prompt_messages"] == user("food") and first["topic"] == "food"
    assert read_rows(data / "preference.jsonl")[0]["chosen"] == "great and lovely ."  # ends where generation stops
    assert read_rows(data / "preference_eval.jsonl")[0]["prompt"] == "user : the food was . assistant : "
    assert read_rows(data / "sft.jsonl")[0]["text"] == "user : the food was . assistant : the food was great ."
    # the template that model.chat_template supplied travels with every checkpoint into the export
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(summary["export_dir"]).chat_template == TEMPLATE
    assert AutoTokenizer.from_pretrained(summary["checkpoints"][0]).chat_template == TEMPLATE  # the SFT warm start
