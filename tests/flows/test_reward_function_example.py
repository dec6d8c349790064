"""docs/reward-functions.md as written: its module and its grpo.rewards entry, cut out of the page, run.

The module is called as the GRPO stage calls it (plain and conversational completions, a dataset column, an
argument from the config, None where it does not apply), then the smoke pipeline runs GRPO with the page's
entry from a prompt table that carries the column, importing the module from the directory it runs in.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from flows.rlhf_pipeline import rlhf_pipeline
from rlhf_core.config import load_config
from rlhf_core.rewards.functions import load_reward_function
from rlhf_core.rewards.sources import function_reward

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "reward-functions.md"
SMOKE = REPO / "configs" / "smoke.yaml"


def block_after(marker: str, language: str) -> str:
    """The fenced block of `language` that follows the HTML comment naming `marker` on the page."""
    text = PAGE.read_text()
    found = re.search(rf"<!-- tested: {re.escape(marker)}.*?-->\n```{language}\n(.*?)```", text, re.S)
    assert found, f"docs/reward-functions.md has no tested {language} block for {marker}"
    return found.group(1)


@pytest.fixture
def my_rewards(tmp_path, monkeypatch):
    """The page's module written as my_rewards.py in a directory on the import path (the run's directory)."""
    (tmp_path / "my_rewards.py").write_text(block_after("my_rewards.py", "python"))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_rewards", None)
    yield importlib.import_module("my_rewards")
    sys.modules.pop("my_rewards", None)


def test_the_function_scores_as_the_page_says(my_rewards):
    entry = yaml.safe_load(block_after("the grpo.rewards entry", "yaml"))["grpo"]["rewards"][1]
    fn = load_reward_function(entry["function"], entry["arguments"], field="grpo.rewards[1]")
    completions = ["a cat sat", "a dog ran", "cat " * 40, "no keyword here"]
    scores = fn(prompts=["p"] * 4, completions=completions, keyword=["cat", "cat", "cat", None])
    assert scores == [1.0, 0.0, 1.0, None]  # the keyword within max_words 30; None where the row has none
    late = " ".join(["word"] * 30 + ["cat"])
    assert fn(prompts=["p"], completions=[late], keyword=["cat"]) == [0.0]  # past max_words
    # as the stage hands conversational completions, through the reward source with the rows' columns
    source = function_reward("keyword", entry["weight"], fn)
    rows = [{"prompt": "p", "prompt_messages": [{"role": "user", "content": "Tell me"}], "keyword": "cat"}] * 2
    assert source.score(["p", "p"], ["The cat.", "A dog."], None, rows) == [1.0, 0.0]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_the_page_entry_trains_grpo_with_the_function(my_rewards, prefect_harness, tmp_path, mlflow_uri):
    entry = yaml.safe_load(block_after("the grpo.rewards entry", "yaml"))
    prompts = [
        {"prompt": f"the {t} was", "keyword": "great" if i % 2 else None}
        for i, t in enumerate(["food", "room", "staff", "view"] * 4)
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in prompts))
    config = tmp_path / "mine.yaml"
    merged = yaml.safe_load(SMOKE.read_text())
    merged["rl"].update(entry["rl"])
    merged["grpo"].update(entry["grpo"])
    merged["data"].update({"prompts": {"path": str(path)}})
    config.write_text(yaml.safe_dump(merged))
    overrides = [f"run.output_dir={tmp_path / 'out'}", f"tracking.uri={mlflow_uri}"]
    assert load_config(config, overrides).grpo.rewards[1].function == "my_rewards:mentions_keyword"

    state = rlhf_pipeline(config_path=str(config), overrides=overrides, return_state=True)

    assert state.is_completed(), state.message
    client = MlflowClient(mlflow_uri)
    summary = state.result()
    [grpo] = client.search_runs(
        [client.get_run(summary["mlflow_run_id"]).info.experiment_id],
        f"tags.mlflow.parentRunId = '{summary['mlflow_run_id']}' and attributes.run_name = 'grpo'",
    )
    assert 0.0 <= grpo.data.metrics["rewards/keyword/mean"] <= 1.0
    assert "rewards/reward_model/mean" in grpo.data.metrics
